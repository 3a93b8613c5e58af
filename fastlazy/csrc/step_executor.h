// The step executor: runs a graph (TorchScript IR, as the TorchScript
// backend emits it) as a flat list of steps over a register file, without
// the TorchScript interpreter.
//
// Each node is one step.  A step calls the node's boxed operator (the
// Operation the interpreter would call), or, for the ops of direct_ops(),
// ATen's CPU kernel itself (at::cpu::<op>): no dispatcher, no boxing.  A
// direct call skips the dispatch keys a recorded, already-checked graph of
// plain CPU tensors does not need (Autograd, ADInplaceOrView, autocast), so
// it is made only where those keys would do nothing: for the run, no
// dispatch key forced on by the thread (a TorchDispatchMode, functorch),
// autocast off and no input carrying a forward-mode tangent; for the step,
// every tensor it reads a plain dense CPU tensor (no conjugate or negative
// bit, no subclass, not an inference tensor) requiring no grad where grad
// mode is on.  Any other step is called boxed, as the interpreter calls it.
// An in-place direct call bumps its tensor's version, as ADInplaceOrView
// does.
//
// A register is released after its last use, as the interpreter drops
// values, so a dead intermediate's buffer returns to the allocator.
#pragma once

#include <Python.h>

#include <ATen/EmptyTensor.h>
#include <ATen/ScalarOps.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/stack.h>
#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/ir/constants.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/ir/irparser.h>
#include <torch/csrc/utils/python_numbers.h>

#include "gil_lending.h"
#include "ir_reader.h"

#include <ATen/ops/add_cpu_dispatch.h>
#include <ATen/ops/as_strided_scatter.h>
#include <ATen/ops/clone.h>
#include <ATen/ops/addmm_cpu_dispatch.h>
#include <ATen/ops/bmm_cpu_dispatch.h>
#include <ATen/ops/div_cpu_dispatch.h>
#include <ATen/ops/eq_cpu_dispatch.h>
#include <ATen/ops/exp_cpu_dispatch.h>
#include <ATen/ops/ge_cpu_dispatch.h>
#include <ATen/ops/gelu_cpu_dispatch.h>
#include <ATen/ops/gt_cpu_dispatch.h>
#include <ATen/ops/le_cpu_dispatch.h>
#include <ATen/ops/lt_cpu_dispatch.h>
#include <ATen/ops/max_pool2d.h>
#include <ATen/ops/mm_cpu_dispatch.h>
#include <ATen/ops/mul_cpu_dispatch.h>
#include <ATen/ops/ne_cpu_dispatch.h>
#include <ATen/ops/neg_cpu_dispatch.h>
#include <ATen/ops/pow_cpu_dispatch.h>
#include <ATen/ops/relu_cpu_dispatch.h>
#include <ATen/ops/rsqrt_cpu_dispatch.h>
#include <ATen/ops/sigmoid_cpu_dispatch.h>
#include <ATen/ops/silu_cpu_dispatch.h>
#include <ATen/ops/sub_cpu_dispatch.h>
#include <ATen/ops/tanh_cpu_dispatch.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace fastlazy {

using c10::IValue;

struct Frame;
struct Step;
using DirectCall = void (*)(Frame&, const Step&);

struct Step {
  torch::jit::Operation op = torch::jit::Operation(nullptr);  // the boxed call
  DirectCall direct = nullptr;   // the CPU kernel's call, where there is one
  std::vector<int32_t> ins;      // >= 0: a register; < 0: ~index of a constant
  std::vector<int32_t> outs;     // registers
  std::vector<int32_t> release;  // registers read for the last time here
  std::vector<bool> moves;       // per input: read for the last time, and once: moved to the callee
};

struct Frame {
  std::vector<IValue> regs;
  int64_t reused = 0;            // steps that took over their input's buffer
  const std::vector<IValue>* consts;
  const IValue& at(int32_t k) const { return k >= 0 ? regs[k] : (*consts)[~k]; }
  const at::Tensor& tensor(const Step& s, int i) const { return at(s.ins[i]).toTensor(); }
};

// -- direct calls: one line per op, the op's CPU kernel with its schema's
// arguments.  In-place ones return their first argument.

inline void set_out(Frame& f, const Step& s, at::Tensor&& t) { f.regs[s.outs[0]] = std::move(t); }

inline void written(Frame& f, const Step& s) {
  f.tensor(s, 0).unsafeGetTensorImpl()->bump_version();
  f.regs[s.outs[0]] = f.at(s.ins[0]);
}

inline at::Tensor& self_of(Frame& f, const Step& s) {
  return const_cast<at::Tensor&>(f.tensor(s, 0));
}

// max_pool2d of a contiguous batch of at least MAX_POOL_CL_CHANNELS
// channels and MAX_POOL_CL_ELEMENTS elements runs ATen's channels-last
// kernel on a channels-last copy, then copies the result back: ATen's NCHW
// kernel walks each plane without vectorizing across channels (a
// 64x112x112 pool: 10.4 ms, against 1.25 ms this way, both copies
// included; 64x32x32: 421 against 224 us).  The maximum of the same
// elements is the same number in any order, NaN included, so the result
// is eager's bit for bit, laid out as eager's (contiguous).  Smaller or
// fewer-channel inputs keep ATen's call (1x16x8x8: 4.5 against 7.0 us).
constexpr int64_t MAX_POOL_CL_CHANNELS = 16;
constexpr int64_t MAX_POOL_CL_ELEMENTS = 4096;

inline at::Tensor max_pool2d_step(const at::Tensor& x, const IValue& kernel, const IValue& stride,
                                  const IValue& padding, const IValue& dilation,
                                  const IValue& ceil_mode) {
  std::vector<int64_t> k = kernel.toIntVector(), st = stride.toIntVector(),
                       p = padding.toIntVector(), d = dilation.toIntVector();
  bool ceil = ceil_mode.toBool();
  if (x.dim() == 4 && x.is_floating_point() && x.size(1) >= MAX_POOL_CL_CHANNELS &&
      x.numel() >= MAX_POOL_CL_ELEMENTS && x.is_contiguous()) {
    return at::max_pool2d(x.contiguous(at::MemoryFormat::ChannelsLast), k, st, p, d, ceil)
        .contiguous();
  }
  return at::max_pool2d(x, k, st, p, d, ceil);
}

// -- a dead intermediate's buffer taken over.  A graph that writes into a
// tensor it computed (x[:, :3] = v on a fresh new_zeros, masked_fill_ on
// a result: the functional forms clone the tensor, then write the clone)
// copies it once per write.  Where the step reads the tensor for the last
// time and nothing else can see its memory -- this register holds the
// only reference to it and it is its storage's only tensor, no weak
// reference, the whole storage from offset 0, laid out as the copy would
// be -- the copy could not be told from the tensor itself, so the tensor
// is the result.  (Graph inputs and constants are always held elsewhere.)

inline bool sole_owner(const Frame& f, const Step& s, int i) {
  if (s.ins[i] < 0 || !s.moves[i]) return false;
  const at::Tensor& t = f.tensor(s, i);
  const c10::Storage& storage = t.storage();
  return t.use_count() == 1 && t.weak_use_count() == 1 && storage.use_count() == 1 &&
         t.storage_offset() == 0 && !t.unsafeGetTensorImpl()->is_wrapped_number() &&
         storage.nbytes() == static_cast<size_t>(t.numel()) * t.itemsize();
}

inline std::optional<c10::MemoryFormat> memory_format_of(const IValue& v) {
  if (v.isNone()) return std::nullopt;
  return v.toMemoryFormat();
}

// contiguous(x): x itself where it is contiguous in the format asked
// (ATen's own first check), without a call through the dispatcher
inline void contiguous_step(Frame& f, const Step& s) {
  const at::Tensor& t = f.tensor(s, 0);
  const c10::MemoryFormat format = f.at(s.ins[1]).toMemoryFormat();
  f.regs[s.outs[0]] = t.is_contiguous(format) ? t : t.contiguous(format);
}

// clone(x, memory_format): x's buffer where x dies here and no one else
// sees it, and the clone would lay it out as it is
inline void clone_step(Frame& f, const Step& s) {
  const at::Tensor& t = f.tensor(s, 0);
  const std::optional<c10::MemoryFormat> format = memory_format_of(f.at(s.ins[1]));
  const bool same_layout = !format || *format == c10::MemoryFormat::Preserve
                               ? t.is_non_overlapping_and_dense()
                               : t.is_contiguous(*format);
  if (same_layout && sole_owner(f, s, 0)) {
    f.regs[s.outs[0]] = std::move(f.regs[s.ins[0]]);
    f.reused++;
    return;
  }
  set_out(f, s, at::clone(t, format));
}

// as_strided_scatter(self, src, size, stride, offset): ATen clones self
// (preserving its layout) and copies src into the clone's place; where
// self may be taken over, src is copied into self's own place instead
inline void as_strided_scatter_step(Frame& f, const Step& s) {
  const at::Tensor& self = f.tensor(s, 0);
  const at::Tensor& src = f.tensor(s, 1);
  const std::vector<int64_t> size = f.at(s.ins[2]).toIntVector();
  const std::vector<int64_t> stride = f.at(s.ins[3]).toIntVector();
  const IValue& offset_value = f.at(s.ins[4]);
  const std::optional<int64_t> offset =
      offset_value.isNone() ? std::nullopt : std::optional<int64_t>(offset_value.toInt());
  if (self.is_non_overlapping_and_dense() && src.sizes().equals(size) && sole_owner(f, s, 0)) {
    at::Tensor out = std::move(f.regs[s.ins[0]]).toTensor();
    out.as_strided(size, stride, offset).copy_(src);
    set_out(f, s, std::move(out));
    f.reused++;
    return;
  }
  set_out(f, s, at::as_strided_scatter(self, src, size, stride, offset));
}

// A Python number operand of a binary op, as the 0-dim "wrapped number"
// tensor ATen's Scalar overloads make of it (add.Scalar is
// add(self, wrapped_scalar_tensor(other))).  ATen wraps a float as a double
// tensor, which TensorIterator then copies to a float32 self's dtype (a
// .to() of its own: about 1 us of a 2 us call on a small tensor).  Where
// self is float32 or float64 and the number a float or an int, the number
// is wrapped in self's dtype at once, converted as that copy converts it
// (static_cast): the kernel reads the same value (for these dtypes the
// kernels' math type is self's dtype).  Any other case -- half types, whose
// kernels read the original double, integer, bool and complex operands --
// is wrapped as ATen wraps it.
inline at::Tensor number_operand(const at::Tensor& self, const IValue& v) {
  const auto dtype = self.scalar_type();
  if ((dtype == at::kFloat || dtype == at::kDouble) && (v.isDouble() || v.isInt())) {
    at::Tensor t = at::detail::empty_cpu({}, dtype, /*pin_memory=*/false, std::nullopt);
    if (dtype == at::kFloat) {
      *t.data_ptr<float>() = v.isDouble() ? static_cast<float>(v.toDouble())
                                          : static_cast<float>(v.toInt());
    } else {
      *t.data_ptr<double>() = v.isDouble() ? v.toDouble() : static_cast<double>(v.toInt());
    }
    t.unsafeGetTensorImpl()->set_wrapped_number(true);
    return t;
  }
  return at::native::wrapped_scalar_tensor(v.toScalar());
}

#define FL_T(i) f.tensor(s, i)
#define FL_N(i) number_operand(f.tensor(s, 0), f.at(s.ins[i]))
#define FL_S(i) f.at(s.ins[i]).toScalar()
#define FL_FUNCTIONAL(expr) [](Frame& f, const Step& s) { set_out(f, s, expr); }
#define FL_INPLACE(expr) [](Frame& f, const Step& s) { expr; written(f, s); }

struct DirectOp {
  const char* name;
  const char* overload;
  DirectCall call;
};

inline const std::vector<DirectOp>& direct_ops() {
  static const std::vector<DirectOp> ops = {
    {"aten::add", "Tensor", FL_FUNCTIONAL(at::cpu::add(FL_T(0), FL_T(1), FL_S(2)))},
    {"aten::add_", "Tensor", FL_INPLACE(at::cpu::add_(self_of(f, s), FL_T(1), FL_S(2)))},
    {"aten::sub", "Tensor", FL_FUNCTIONAL(at::cpu::sub(FL_T(0), FL_T(1), FL_S(2)))},
    {"aten::sub_", "Tensor", FL_INPLACE(at::cpu::sub_(self_of(f, s), FL_T(1), FL_S(2)))},
    {"aten::mul", "Tensor", FL_FUNCTIONAL(at::cpu::mul(FL_T(0), FL_T(1)))},
    {"aten::mul_", "Tensor", FL_INPLACE(at::cpu::mul_(self_of(f, s), FL_T(1)))},
    {"aten::div", "Tensor", FL_FUNCTIONAL(at::cpu::div(FL_T(0), FL_T(1)))},
    {"aten::div_", "Tensor", FL_INPLACE(at::cpu::div_(self_of(f, s), FL_T(1)))},
    {"aten::add", "Scalar", FL_FUNCTIONAL(at::cpu::add(FL_T(0), FL_N(1), FL_S(2)))},
    {"aten::add_", "Scalar", FL_INPLACE(at::cpu::add_(self_of(f, s), FL_N(1), FL_S(2)))},
    {"aten::sub", "Scalar", FL_FUNCTIONAL(at::cpu::sub(FL_T(0), FL_N(1), FL_S(2)))},
    {"aten::sub_", "Scalar", FL_INPLACE(at::cpu::sub_(self_of(f, s), FL_N(1), FL_S(2)))},
    {"aten::mul", "Scalar", FL_FUNCTIONAL(at::cpu::mul(FL_T(0), FL_N(1)))},
    {"aten::mul_", "Scalar", FL_INPLACE(at::cpu::mul_(self_of(f, s), FL_N(1)))},
    {"aten::div", "Scalar", FL_FUNCTIONAL(at::cpu::div(FL_T(0), FL_N(1)))},
    {"aten::div_", "Scalar", FL_INPLACE(at::cpu::div_(self_of(f, s), FL_N(1)))},
    // comparisons: ATen's Scalar overloads compare with the wrapped number
    {"aten::eq", "Scalar", FL_FUNCTIONAL(at::cpu::eq(FL_T(0), FL_N(1)))},
    {"aten::ne", "Scalar", FL_FUNCTIONAL(at::cpu::ne(FL_T(0), FL_N(1)))},
    {"aten::lt", "Scalar", FL_FUNCTIONAL(at::cpu::lt(FL_T(0), FL_N(1)))},
    {"aten::le", "Scalar", FL_FUNCTIONAL(at::cpu::le(FL_T(0), FL_N(1)))},
    {"aten::gt", "Scalar", FL_FUNCTIONAL(at::cpu::gt(FL_T(0), FL_N(1)))},
    {"aten::ge", "Scalar", FL_FUNCTIONAL(at::cpu::ge(FL_T(0), FL_N(1)))},
    {"aten::eq", "Tensor", FL_FUNCTIONAL(at::cpu::eq(FL_T(0), FL_T(1)))},
    {"aten::ne", "Tensor", FL_FUNCTIONAL(at::cpu::ne(FL_T(0), FL_T(1)))},
    {"aten::lt", "Tensor", FL_FUNCTIONAL(at::cpu::lt(FL_T(0), FL_T(1)))},
    {"aten::le", "Tensor", FL_FUNCTIONAL(at::cpu::le(FL_T(0), FL_T(1)))},
    {"aten::gt", "Tensor", FL_FUNCTIONAL(at::cpu::gt(FL_T(0), FL_T(1)))},
    {"aten::ge", "Tensor", FL_FUNCTIONAL(at::cpu::ge(FL_T(0), FL_T(1)))},
    {"aten::pow", "Tensor_Scalar", FL_FUNCTIONAL(at::cpu::pow(FL_T(0), FL_S(1)))},
    {"aten::pow", "Tensor_Tensor", FL_FUNCTIONAL(at::cpu::pow(FL_T(0), FL_T(1)))},
    {"aten::neg", "", FL_FUNCTIONAL(at::cpu::neg(FL_T(0)))},
    {"aten::neg_", "", FL_INPLACE(at::cpu::neg_(self_of(f, s)))},
    {"aten::exp", "", FL_FUNCTIONAL(at::cpu::exp(FL_T(0)))},
    {"aten::exp_", "", FL_INPLACE(at::cpu::exp_(self_of(f, s)))},
    {"aten::rsqrt", "", FL_FUNCTIONAL(at::cpu::rsqrt(FL_T(0)))},
    {"aten::rsqrt_", "", FL_INPLACE(at::cpu::rsqrt_(self_of(f, s)))},
    {"aten::sigmoid", "", FL_FUNCTIONAL(at::cpu::sigmoid(FL_T(0)))},
    {"aten::sigmoid_", "", FL_INPLACE(at::cpu::sigmoid_(self_of(f, s)))},
    {"aten::tanh", "", FL_FUNCTIONAL(at::cpu::tanh(FL_T(0)))},
    {"aten::tanh_", "", FL_INPLACE(at::cpu::tanh_(self_of(f, s)))},
    {"aten::relu", "", FL_FUNCTIONAL(at::cpu::relu(FL_T(0)))},
    {"aten::relu_", "", FL_INPLACE(at::cpu::relu_(self_of(f, s)))},
    {"aten::silu", "", FL_FUNCTIONAL(at::cpu::silu(FL_T(0)))},
    {"aten::silu_", "", FL_INPLACE(at::cpu::silu_(self_of(f, s)))},
    {"aten::gelu", "", FL_FUNCTIONAL(at::cpu::gelu(FL_T(0), f.at(s.ins[1]).toStringView()))},
    {"aten::gelu_", "", FL_INPLACE(at::cpu::gelu_(self_of(f, s), f.at(s.ins[1]).toStringView()))},
    {"aten::mm", "", FL_FUNCTIONAL(at::cpu::mm(FL_T(0), FL_T(1)))},
    {"aten::bmm", "", FL_FUNCTIONAL(at::cpu::bmm(FL_T(0), FL_T(1)))},
    {"aten::addmm", "", FL_FUNCTIONAL(at::cpu::addmm(FL_T(0), FL_T(1), FL_T(2), FL_S(3), FL_S(4)))},
    {"aten::contiguous", "", contiguous_step},
    {"aten::clone", "", clone_step},
    {"aten::as_strided_scatter", "", as_strided_scatter_step},
    {"aten::max_pool2d", "", FL_FUNCTIONAL(max_pool2d_step(FL_T(0), f.at(s.ins[1]), f.at(s.ins[2]),
                                                           f.at(s.ins[3]), f.at(s.ins[4]),
                                                           f.at(s.ins[5])))},
  };
  return ops;
}

#undef FL_T
#undef FL_N
#undef FL_S
#undef FL_FUNCTIONAL
#undef FL_INPLACE

inline DirectCall direct_call_for(const c10::OperatorName& name) {
  // a graph's every step looks itself up here: hashed, not a scan of names
  static const std::unordered_map<c10::OperatorName, DirectCall> by_name = [] {
    std::unordered_map<c10::OperatorName, DirectCall> found;
    for (const auto& op : direct_ops()) found.emplace(c10::OperatorName(op.name, op.overload), op.call);
    return found;
  }();
  auto found = by_name.find(name);
  return found == by_name.end() ? nullptr : found->second;
}

// The dispatch keys of a plain dense CPU tensor (what a direct call's
// inputs must have, exactly).
inline c10::DispatchKeySet plain_cpu_keys() {
  static const c10::DispatchKeySet keys = [] {
    // made outside inference mode, whatever the first run's mode: an
    // inference tensor lacks the autograd keys
    c10::InferenceMode normal(false);
    return at::empty({0}).key_set();
  }();
  return keys;
}

enum InputKind : int8_t { IN_TENSOR, IN_INT, IN_FLOAT, IN_COMPLEX };

// A run lets go of the GIL only where the program's last run took at least
// this long (and on its first run).  Letting go hands the GIL to any
// thread that wants it -- fastlazy's own compile thread while a compile is
// under way -- and taking it back waits until that thread lets go in turn
// (fastlazy's own background threads give it back as the run ends, where
// they see the run's counts -- gil_lending.h -- and otherwise after up to
// 200 us: compile_worker.RUN_US).
// For a run of a few microseconds (a loop that reads a value each
// iteration) that wait was 15 % of the loop's time, and what another
// thread could do meanwhile is as short as the run itself.
constexpr int64_t RELEASE_GIL_AFTER_NS = 100000;

class StepProgram {
 public:
  explicit StepProgram(const std::string& ir) {
    auto graph = read_ir(ir, &read_fast_);
    build(*graph);
  }

  // Was the IR read by IRReader (not by parseIR)?
  bool read_fast() const { return read_fast_; }

  int64_t steps() const { return static_cast<int64_t>(steps_.size()); }
  int64_t direct_steps() const { return direct_steps_; }
  int64_t direct_calls() const { return direct_calls_; }
  int64_t boxed_calls() const { return boxed_calls_; }
  int64_t reused_buffers() const { return reused_; }

  // Will the next run let go of the GIL (RELEASE_GIL_AFTER_NS)?
  bool releases_gil() const {
    int64_t last = last_run_ns_.load(std::memory_order_relaxed);
    return last < 0 || last >= RELEASE_GIL_AFTER_NS;
  }

  // args: a tuple of the graph's inputs in order.  A new reference to the
  // graph's output (a tensor, or a tuple of them), or NULL with the Python
  // error set.
  PyObject* run(PyObject* args) {
    HANDLE_TH_ERRORS
    Frame f;
    f.consts = &consts_;
    f.regs.resize(nregs_);
    bool direct = direct_steps_ > 0 && direct_allowed();
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    if (n != static_cast<Py_ssize_t>(inputs_.size())) {
      throw std::runtime_error("fastlazy step executor: wrong number of inputs");
    }
    for (Py_ssize_t i = 0; i < n; i++) {
      PyObject* arg = PyTuple_GET_ITEM(args, i);
      IValue& reg = f.regs[inputs_[i]];
      switch (input_kinds_[i]) {
        case IN_TENSOR: {
          if (!THPVariable_Check(arg)) {
            throw torch::TypeError("fastlazy step executor: input " + std::to_string(i) +
                                   " is not a tensor");
          }
          const at::Tensor& t = THPVariable_Unpack(arg);
          // forward-mode AD's tangents come from the autograd kernels, which
          // a direct call skips (every intermediate of such a run has them)
          if (direct && t._fw_grad(0).defined()) direct = false;
          reg = t;
          break;
        }
        case IN_INT:
          reg = static_cast<int64_t>(THPUtils_unpackLong(arg));
          break;
        case IN_FLOAT:
          reg = THPUtils_unpackDouble(arg);
          break;
        case IN_COMPLEX: {
          Py_complex c = PyComplex_AsCComplex(arg);
          if (PyErr_Occurred()) throw python_error();
          reg = c10::complex<double>(c.real, c.imag);
          break;
        }
      }
    }
    IValue out;
    const auto start = std::chrono::steady_clock::now();
    if (releases_gil()) {
      KernelsWithoutGil no_gil;   // (lent to fastlazy's background threads: gil_lending.h)
      execute(f, direct);
    } else {
      execute(f, direct);
    }
    out = std::move(f.regs[output_]);
    reused_ += f.reused;
    last_run_ns_.store(std::chrono::duration_cast<std::chrono::nanoseconds>(
                           std::chrono::steady_clock::now() - start).count(),
                       std::memory_order_relaxed);
    return wrap(out);
    END_HANDLE_TH_ERRORS
  }

 private:
  std::vector<IValue> consts_;
  std::vector<Step> steps_;
  std::vector<int32_t> inputs_;
  std::vector<InputKind> input_kinds_;
  int32_t output_ = 0;
  int32_t nregs_ = 0;
  int64_t direct_steps_ = 0;
  // steps called each way, over all runs (not exact where threads run the
  // program at once: a statistic)
  int64_t direct_calls_ = 0;
  int64_t boxed_calls_ = 0;
  int64_t reused_ = 0;           // steps that took over a dead input's buffer
  bool read_fast_ = false;
  std::atomic<int64_t> last_run_ns_{-1};   // -1: never run

  static bool direct_allowed() {
    auto tls = c10::impl::tls_local_dispatch_key_set();
    return (tls.included_ - c10::default_included_set).empty() &&
           c10::impl::tls_is_dispatch_key_excluded(c10::DispatchKey::AutocastCPU);
  }

  void build(torch::jit::Graph& graph) {
    std::unordered_map<const torch::jit::Value*, int32_t> where;
    auto reg = [&](const torch::jit::Value* v) {
      auto found = where.find(v);
      if (found != where.end()) return found->second;
      int32_t k = nregs_++;
      where.emplace(v, k);
      return k;
    };
    for (const torch::jit::Value* v : graph.inputs()) {
      inputs_.push_back(reg(v));
      auto kind = v->type()->kind();
      if (kind == c10::TypeKind::TensorType) {
        input_kinds_.push_back(IN_TENSOR);
      } else if (kind == c10::TypeKind::IntType) {
        input_kinds_.push_back(IN_INT);
      } else if (kind == c10::TypeKind::FloatType) {
        input_kinds_.push_back(IN_FLOAT);
      } else if (kind == c10::TypeKind::ComplexType) {
        input_kinds_.push_back(IN_COMPLEX);
      } else {
        throw std::runtime_error("fastlazy step executor: no input of type " +
                                 v->type()->str());
      }
    }
    for (torch::jit::Node* node : graph.nodes()) {
      if (node->kind() == c10::prim::Constant) {
        auto value = torch::jit::toIValue(node->output());
        if (!value) throw std::runtime_error("fastlazy step executor: constant without a value");
        where.emplace(node->output(), ~static_cast<int32_t>(consts_.size()));
        consts_.push_back(std::move(*value));
        continue;
      }
      if (node->kind() == c10::prim::ListConstruct && constant_inputs(node, where)) {
        // a list of constants (sizes, strides) is itself one
        std::vector<IValue> items;
        for (const torch::jit::Value* v : node->inputs()) items.push_back(consts_[~where.at(v)]);
        auto type = node->output()->type()->expect<c10::ListType>();
        where.emplace(node->output(), ~static_cast<int32_t>(consts_.size()));
        consts_.push_back(make_list(*type, std::move(items)));
        continue;
      }
      Step step;
      for (const torch::jit::Value* v : node->inputs()) step.ins.push_back(reg(v));
      for (const torch::jit::Value* v : node->outputs()) step.outs.push_back(reg(v));
      const c10::FunctionSchema* schema = node->maybeSchema();
      if (schema != nullptr && node->outputs().size() == 1) {
        step.direct = direct_call_for(schema->operator_name());
      }
      direct_steps_ += step.direct != nullptr;
      step.op = operation_of(node);
      steps_.push_back(std::move(step));
    }
    output_ = reg(graph.outputs()[0]);
    if (output_ < 0) throw std::runtime_error("fastlazy step executor: a constant output");
    // each register's last reader releases it (the output is never
    // released).  Not the graph's inputs: a Python object holds each of
    // them, so letting go of one frees nothing, and dropping the last C++
    // reference to a tensor a Python object holds decrefs that object
    // (torch's PyObject preservation), which takes the GIL -- in the
    // middle of a run without it, a wait of up to the switch interval
    // where another thread holds the GIL.  The frame lets go of them once
    // the run has the GIL back.
    std::vector<int32_t> last(nregs_, -1);
    for (size_t i = 0; i < steps_.size(); i++) {
      for (int32_t k : steps_[i].ins) if (k >= 0) last[k] = static_cast<int32_t>(i);
    }
    for (int32_t k : inputs_) last[k] = -1;
    for (size_t i = 0; i < steps_.size(); i++) {
      Step& step = steps_[i];
      for (int32_t k : step.ins) {
        bool dies = k >= 0 && k != output_ && last[k] == static_cast<int32_t>(i);
        bool once = std::count(step.ins.begin(), step.ins.end(), k) == 1;
        step.moves.push_back(dies && once);
        if (dies && std::find(step.release.begin(), step.release.end(), k) == step.release.end()) {
          step.release.push_back(k);
        }
      }
      // a result nothing reads (copy_'s, an in-place op's: its written
      // input returned) goes at once: it may be a view whose base a later
      // step could otherwise take over (sole_owner)
      for (int32_t k : step.outs) {
        if (k != output_ && last[k] < 0 &&
            std::find(step.release.begin(), step.release.end(), k) == step.release.end()) {
          step.release.push_back(k);
        }
      }
    }
  }

  static bool constant_inputs(const torch::jit::Node* node,
                              const std::unordered_map<const torch::jit::Value*, int32_t>& where) {
    for (const torch::jit::Value* v : node->inputs()) {
      auto found = where.find(v);
      if (found == where.end() || found->second >= 0) return false;
    }
    return true;
  }

  static IValue make_list(const c10::ListType& type, std::vector<IValue> items) {
    c10::List<IValue> list(type.getElementType());
    list.reserve(items.size());
    for (IValue& item : items) list.push_back(std::move(item));
    return list;
  }

  // The top n values of the stack, taken off it in order.
  static std::vector<IValue> take_top(torch::jit::Stack& stack, size_t n) {
    std::vector<IValue> items(std::make_move_iterator(stack.end() - n),
                              std::make_move_iterator(stack.end()));
    stack.resize(stack.size() - n);
    return items;
  }

  // The operation a node's step calls boxed: its operator's, or, for the
  // two prim nodes the TorchScript backend emits that have no operator
  // (the interpreter runs them as instructions of its own), the same work.
  static torch::jit::Operation operation_of(const torch::jit::Node* node) {
    size_t n = node->inputs().size();
    if (node->kind() == c10::prim::ListConstruct) {
      auto type = node->output()->type()->expect<c10::ListType>();
      return torch::jit::Operation([type, n](torch::jit::Stack& stack) {
        stack.emplace_back(make_list(*type, take_top(stack, n)));
      });
    }
    if (node->kind() == c10::prim::TupleConstruct) {
      return torch::jit::Operation([n](torch::jit::Stack& stack) {
        stack.emplace_back(c10::ivalue::Tuple::create(take_top(stack, n)));
      });
    }
    return node->getOperation();
  }

  // May step call its kernel directly?  Each tensor it reads must be a
  // plain dense CPU tensor (exactly those dispatch keys: no conjugate or
  // negative bit, no subclass, not an inference tensor), and none may
  // require grad where grad mode would record it.
  static bool plain_operands(const Frame& f, const Step& step, c10::DispatchKeySet keys,
                             bool grad) {
    for (int32_t k : step.ins) {
      const IValue& v = f.at(k);
      if (v.isTensor()) {
        const at::Tensor& t = v.toTensor();
        if (t.key_set() != keys || (grad && t.requires_grad())) return false;
      }
    }
    return true;
  }

  void execute(Frame& f, bool direct) {
    torch::jit::Stack stack;
    const c10::DispatchKeySet keys = plain_cpu_keys();
    const bool grad = c10::GradMode::is_enabled();
    for (Step& step : steps_) {
      if (direct && step.direct != nullptr && plain_operands(f, step, keys, grad)) {
        step.direct(f, step);
        direct_calls_++;
      } else {
        boxed_calls_++;
        stack.clear();
        for (size_t i = 0; i < step.ins.size(); i++) {
          int32_t k = step.ins[i];
          // a value read for the last time moves onto the stack: the
          // callee holds the only reference, as under the interpreter
          if (step.moves[i]) {
            stack.push_back(std::move(f.regs[k]));
          } else {
            stack.push_back(f.at(k));
          }
        }
        step.op(stack);
        for (size_t i = 0; i < step.outs.size(); i++) {
          f.regs[step.outs[i]] = std::move(stack[i]);
        }
        // (what the call left on the stack -- an input it did not consume
        // -- is let go now, not at the next boxed step: a view's base
        // read for the last time here must not look shared to the steps
        // in between)
        stack.clear();
      }
      for (int32_t k : step.release) f.regs[k] = IValue();
    }
  }

  static PyObject* wrap(const IValue& out) {
    if (out.isTensor()) return THPVariable_Wrap(out.toTensor());
    if (out.isTuple()) {
      const auto& items = out.toTupleRef().elements();
      PyObject* tuple = PyTuple_New(static_cast<Py_ssize_t>(items.size()));
      if (tuple == nullptr) return nullptr;
      for (size_t i = 0; i < items.size(); i++) {
        PyObject* item = wrap(items[i]);
        if (item == nullptr) {
          Py_DECREF(tuple);
          return nullptr;
        }
        PyTuple_SET_ITEM(tuple, static_cast<Py_ssize_t>(i), item);
      }
      return tuple;
    }
    if (out.isTensorList()) {
      auto list = out.toTensorList();
      PyObject* tuple = PyTuple_New(static_cast<Py_ssize_t>(list.size()));
      if (tuple == nullptr) return nullptr;
      for (size_t i = 0; i < list.size(); i++) {
        PyTuple_SET_ITEM(tuple, static_cast<Py_ssize_t>(i), THPVariable_Wrap(list.get(i)));
      }
      return tuple;
    }
    throw std::runtime_error("fastlazy step executor: an output of type " + out.tagKind());
  }
};

}  // namespace fastlazy

// For Cython: a method call as a function, with the reference it returns.
inline PyObject* fastlazy_run(fastlazy::StepProgram& program, PyObject* args) {
  return program.run(args);
}
