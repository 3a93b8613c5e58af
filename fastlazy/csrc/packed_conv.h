// fastlazy::packed_conv2d: a 2-d convolution whose weight was reordered
// once for oneDNN (mkldnn::_reorder_convolution_weight), with eager's output
// memory format.
//
// oneDNN's convolution with a packed weight writes a channels-last result
// whatever its input's layout; eager's convolution gives a channels-last
// result only where its input or its weight suggests that format
// (suggest_memory_format, as ATen's thnn and mkldnn paths ask it: a 1x1 or
// depthwise weight made channels-last is also contiguous, and suggests
// channels-last).  This op calls oneDNN's and copies the result into
// eager's format, strides and all, so that a graph's later ops (a `view`,
// say) see the strides eager's would.  The format is read from the weight
// and input of each call: a model moved to channels-last after its weights
// were packed gets channels-last results.  An empty `packed` means the
// weight was judged not worth packing (fastlazy::conv_times found ATen's
// own convolution as fast): the call is then eager's at::conv2d, so that a
// graph's program need not change when its convolutions are judged one by
// one after it was compiled.
//
// fastlazy::conv_times times the two calls of one convolution, alternated,
// in C++: a thread beside the user's that timed them from Python would
// count its waits for the GIL, which the user's thread holds for up to the
// interpreter's switch interval (5 ms) at a time.
//
// Registered at run time by register_packed_conv(), called once the module
// has checked that it was built for the torch imported, not by a static
// TORCH_LIBRARY initializer, which would run against any torch that loads
// the module.
#pragma once

#include <ATen/Functions.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/util/strides.h>
#include <torch/library.h>

#include <algorithm>
#include <chrono>
#include <limits>
#include <memory>
#include <optional>
#include <vector>

namespace fastlazy {

// `out` with the strides at::empty gives its sizes in `format`: oneDNN's
// channels-last result is also "contiguous" where a dim of size 1 makes
// the two orders one (a single output channel, a 1x1 image), and
// contiguous() then keeps strides eager's result does not have there.
inline at::Tensor with_strides_of(const at::Tensor& out, at::MemoryFormat format) {
  c10::IntArrayRef sizes = out.sizes();
  bool laid_so = format == at::MemoryFormat::ChannelsLast
                     ? out.strides().equals(c10::get_channels_last_strides_2d(sizes))
                     : out.strides().equals(c10::contiguous_strides(sizes));
  if (laid_so) return out;
  at::Tensor laid = at::empty(sizes, out.options().memory_format(format));
  laid.copy_(out);
  return laid;
}

inline at::Tensor packed_conv2d(const at::Tensor& input, const at::Tensor& weight,
                                const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                                c10::IntArrayRef padding, c10::IntArrayRef stride,
                                c10::IntArrayRef dilation, int64_t groups) {
  if (packed.numel() == 0) {
    return at::conv2d(input, weight, bias, stride, padding, dilation, groups);
  }
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
  bool channels_last = weight.suggest_memory_format() == at::MemoryFormat::ChannelsLast ||
                       input.suggest_memory_format() == at::MemoryFormat::ChannelsLast;
  return with_strides_of(out, channels_last ? at::MemoryFormat::ChannelsLast
                                            : at::MemoryFormat::Contiguous);
}

// The fastest of `runs` timed calls (after one untimed call) of ATen's
// convolution and of the packed one, alternated, in seconds; fewer timed
// calls where the first took over `budget_s` in all.
inline std::vector<double> conv_times(const at::Tensor& input, const at::Tensor& weight,
                                      const at::Tensor& packed,
                                      const std::optional<at::Tensor>& bias,
                                      c10::IntArrayRef padding, c10::IntArrayRef stride,
                                      c10::IntArrayRef dilation, int64_t groups,
                                      int64_t runs, double budget_s) {
  using clock = std::chrono::steady_clock;
  const at::Tensor none = at::empty({0}, input.options());
  std::vector<double> best(2, std::numeric_limits<double>::infinity());
  double spent = 0.0;
  for (int64_t k = 0; k <= runs; ++k) {
    for (int which = 0; which < 2; ++which) {
      auto start = clock::now();
      packed_conv2d(input, weight, which ? packed : none, bias, padding, stride, dilation,
                    groups);
      double took = std::chrono::duration<double>(clock::now() - start).count();
      spent += took;
      if (k > 0) best[which] = std::min(best[which], took);
    }
    if (k > 0 && spent > budget_s) break;
  }
  return best;
}

inline void register_packed_conv() {
  static std::unique_ptr<torch::Library> library;
  if (library) return;
  library = std::make_unique<torch::Library>(torch::Library::DEF, "fastlazy", std::nullopt,
                                             __FILE__, __LINE__);
  library->def(
      "packed_conv2d(Tensor input, Tensor weight, Tensor packed, Tensor? bias, "
      "int[2] padding, int[2] stride, int[2] dilation, int groups) -> Tensor",
      TORCH_FN(packed_conv2d));
  library->def(
      "conv_times(Tensor input, Tensor weight, Tensor packed, Tensor? bias, int[2] padding, "
      "int[2] stride, int[2] dilation, int groups, int runs, float budget_s) -> float[]",
      TORCH_FN(conv_times));
}

}  // namespace fastlazy
