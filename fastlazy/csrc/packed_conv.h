// fastlazy::packed_conv2d: a 2-d convolution whose weight was reordered
// once for oneDNN (mkldnn::_reorder_convolution_weight), with eager's output
// memory format.
//
// oneDNN's convolution with a packed weight writes a channels-last result
// whatever its input's layout; eager's convolution gives a channels-last
// result only where its input or its weight suggests that format.  This op
// calls oneDNN's and copies the result into eager's format, so that a
// graph's later ops (a `view`, say) see the strides eager's would.  The
// original weight's format is a flag of the call, fixed when the weight
// was packed: the packed weight no longer shows it.
//
// Registered at run time by register_packed_conv(), called once the module
// has checked that it was built for the torch imported, not by a static
// TORCH_LIBRARY initializer, which would run against any torch that loads
// the module.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#include <memory>
#include <optional>

namespace fastlazy {

inline at::Tensor packed_conv2d(const at::Tensor& input, const at::Tensor& packed,
                                const std::optional<at::Tensor>& bias,
                                c10::IntArrayRef padding, c10::IntArrayRef stride,
                                c10::IntArrayRef dilation, int64_t groups,
                                bool weight_channels_last) {
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow(
      "mkldnn::_convolution_pointwise", "");
  // called boxed: the op's C++ signature differs between torch releases,
  // its schema does not
  torch::jit::Stack stack;
  stack.reserve(10);
  stack.emplace_back(input);
  stack.emplace_back(packed);
  stack.emplace_back(bias);
  stack.emplace_back(padding.vec());
  stack.emplace_back(stride.vec());
  stack.emplace_back(dilation.vec());
  stack.emplace_back(groups);
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<std::optional<at::Scalar>>());
  stack.emplace_back(std::string(""));
  op.callBoxed(&stack);
  at::Tensor out = std::move(stack[0]).toTensor();
  bool channels_last = weight_channels_last ||
                       input.suggest_memory_format() == at::MemoryFormat::ChannelsLast;
  return out.contiguous(channels_last ? at::MemoryFormat::ChannelsLast
                                      : at::MemoryFormat::Contiguous);
}

inline void register_packed_conv() {
  static std::unique_ptr<torch::Library> library;
  if (library) return;
  library = std::make_unique<torch::Library>(torch::Library::DEF, "fastlazy", std::nullopt,
                                             __FILE__, __LINE__);
  library->def(
      "packed_conv2d(Tensor input, Tensor packed, Tensor? bias, int[2] padding, "
      "int[2] stride, int[2] dilation, int groups, bool weight_channels_last) -> Tensor",
      TORCH_FN(packed_conv2d));
}

}  // namespace fastlazy
