"""The op table: one row per recorded op, the single source of truth.

A row says which rule computes the op's output shape and dtype (the rules are
C code in csrc/rules.pxi), which aten expression it lowers to (read, per
attr, into the aten calls every backend lowers: fastlazy.node_program), which
torch entry points record it, and what its parameters are.  Patching,
LazyTensor's methods, the node programs and the parametrized tests all read
this table; adding an op is adding a row.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from fastlazy._core import (ATTR_ADAPTIVE_SIZE_BITS, ATTR_CHOICE_SHIFT, ATTR_CONV_DILATION_BITS,
                            ATTR_CONV_DILATION_SHIFT, ATTR_CONV_GROUPS_BITS, ATTR_CONV_GROUPS_SHIFT,
                            ATTR_CONV_PADDING_BITS, ATTR_CONV_PADDING_SHIFT, ATTR_CONV_STRIDE_BITS,
                            ATTR_CONV_STRIDE_SHIFT, ATTR_DIM_MASK, ATTR_DTYPE_MASK,
                            ATTR_DTYPE_SHIFT, ATTR_EMBEDDING_PADDING_BITS, ATTR_KEEPDIM,
                            ATTR_POOL_CEIL_MODE, ATTR_POOL_DILATION_BITS, ATTR_POOL_DILATION_SHIFT,
                            ATTR_POOL_KERNEL_BITS, ATTR_POOL_KERNEL_SHIFT, ATTR_POOL_PADDING_BITS,
                            ATTR_POOL_PADDING_SHIFT, ATTR_POOL_STRIDE_BITS, ATTR_POOL_STRIDE_SHIFT,
                            ATTR_SDPA_CAUSAL, ATTR_SDPA_GQA, ATTR_SDPA_SCALE_BITS,
                            ATTR_SDPA_SCALE_SHIFT, ATTR_SMALL_MASK, ATTR_DIM_BITS,
                            ATTR_PERMUTE_RANK_SHIFT, ATTR_SELECT_INDEX_BIAS,
                            ATTR_SLICE_END_OPEN, ATTR_SLICE_START_OPEN, ATTR_VIEW_SIZES_BITS,
                            MAX_NDIM, Category, OpFlag, Rule, dtype_of_code, interned_float,
                            interned_sizes)

# Dtype categories an op accepts (the computation dtype must be in the mask).
BOOL, INT, FLOAT, COMPLEX = (Category.CAT_BOOL, Category.CAT_INT, Category.CAT_FLOAT,
                             Category.CAT_COMPLEX)
ALL = BOOL | INT | FLOAT | COMPLEX
REAL = BOOL | INT | FLOAT
NUMERIC = INT | FLOAT | COMPLEX

# Optional operands that may also be given as None.
NULLABLE = frozenset({"min", "max", "weight", "bias", "attn_mask", "mask"})

# Parameters that are structure, read by their rule rather than recorded as
# operands (they sit between operands in the signature).
RAW = frozenset({"normalized_shape", "training", "momentum", "embed_dim", "num_head"})

# Parameters that aten takes as a Python number (Scalar) rather than as an
# operand of type promotion.
SCALAR_ARGS = frozenset({"alpha", "negative_slope", "eps", "min_val", "max_val"})


@dataclass(frozen=True)
class Opt:
    """Node input `index` if the call gave it, else the constant `default`."""
    index: int
    default: object = None


class AttrValue:
    """A structural argument, read back from the node's attr (and result
    dtype)."""

    def value(self, attr, dtype):
        raise NotImplementedError


@dataclass(frozen=True)
class Attr(AttrValue):
    """The row's choice parameter: one of `values` (the first is the default)."""
    values: tuple

    def value(self, attr, dtype):
        return self.values[attr >> ATTR_CHOICE_SHIFT & ATTR_SMALL_MASK]


@dataclass(frozen=True)
class MaskedDims(AttrValue):
    """The dims whose bits the attr's low byte sets, as an explicit list: a
    reduction's (all of them when the call gave no dim: TorchScript's shape
    analysis rejects dim=None), the dims squeeze drops."""

    def value(self, attr, dtype):
        return [k for k in range(MAX_NDIM) if (attr & ATTR_DIM_MASK) >> k & 1]


@dataclass(frozen=True)
class KeepDim(AttrValue):
    def value(self, attr, dtype):
        return bool(attr & ATTR_KEEPDIM)


@dataclass(frozen=True)
class Dim(AttrValue):
    """A single dim (softmax)."""

    def value(self, attr, dtype):
        return attr & ATTR_SMALL_MASK


@dataclass(frozen=True)
class Const(AttrValue):
    """A constant argument (an int in a lowering means a node input)."""
    constant: object

    def value(self, attr, dtype):
        return self.constant


@dataclass(frozen=True)
class TrailingDims:
    """The last `attr & 15` sizes of operand `index`, read when the graph
    runs (layer_norm's normalized_shape): graphs are shape-generic, so a
    size may not be a constant of the graph."""
    index: int = 0


@dataclass(frozen=True)
class DimSize:
    """Operand `index`'s size at `dim`, read when the graph runs."""
    index: int
    dim: int


@dataclass(frozen=True)
class Item:
    """Output `index` of a call that returns several."""
    call: "Call"
    index: int


@dataclass(frozen=True)
class ResultDType(AttrValue):
    """The node's own dtype, spelled out: a reduction over no dims (a 0-dim
    input) would otherwise keep a bool input's dtype where eager gives int64."""

    def value(self, attr, dtype):
        return dtype


@dataclass(frozen=True)
class DTypeArg(AttrValue):
    """The dtype= argument, or None."""

    def value(self, attr, dtype):
        code = attr >> ATTR_DTYPE_SHIFT & ATTR_DTYPE_MASK
        return None if code == 0 else dtype_of_code(code - 1)


@dataclass(frozen=True)
class Packed(AttrValue):
    """An int packed in the attr at `shift`, `bits` wide, less `low`
    (conv2d's groups)."""
    shift: int
    bits: int
    low: int

    def value(self, attr, dtype):
        return (attr >> self.shift & (1 << self.bits) - 1) + self.low


@dataclass(frozen=True)
class PackedPair(AttrValue):
    """A pair of such ints, side by side (conv2d's stride, padding,
    dilation: height's, then width's)."""
    shift: int
    bits: int
    low: int

    def value(self, attr, dtype):
        return [Packed(self.shift + k * self.bits, self.bits, self.low).value(attr, dtype)
                for k in range(2)]


@dataclass(frozen=True)
class Flag(AttrValue):
    """A bool that is one bit of the attr (max_pool2d's ceil_mode)."""
    bit: int

    def value(self, attr, dtype):
        return bool(attr & self.bit)


@dataclass(frozen=True)
class InternedFloat(AttrValue):
    """A float the rule interned (None at index 0), its index packed in the
    attr (sdpa's scale)."""
    shift: int
    bits: int

    def value(self, attr, dtype):
        return interned_float(attr >> self.shift & (1 << self.bits) - 1)


@dataclass(frozen=True)
class PermutedDims(AttrValue):
    """permute's dims, 3 bits each, their count at PERMUTE_RANK_SHIFT."""

    def value(self, attr, dtype):
        rank = attr >> ATTR_PERMUTE_RANK_SHIFT & ATTR_SMALL_MASK
        return [attr >> (ATTR_DIM_BITS * i) & (1 << ATTR_DIM_BITS) - 1 for i in range(rank)]


@dataclass(frozen=True)
class SliceBound(AttrValue):
    """A slice's start (0), end (1) or step (2): from the (start, end, step)
    its rule interned, None where the attr marks the bound open."""
    which: int

    def value(self, attr, dtype):
        if self.which == 0 and attr & ATTR_SLICE_START_OPEN or \
                self.which == 1 and attr & ATTR_SLICE_END_OPEN:
            return None
        index = attr >> ATTR_DIM_BITS & (1 << ATTR_VIEW_SIZES_BITS - ATTR_DIM_BITS) - 1
        return interned_sizes(index)[self.which]


@dataclass(frozen=True)
class TensorList:
    """The node's inputs, all of them, as one list (cat's tensors: their
    number is in the attr from bit `shift`)."""
    shift: int


@dataclass(frozen=True)
class SizeList:
    """The sizes of a view or reshape of operand `index`: the list its rule
    interned (the attr holds its index), each entry a constant or that
    operand's size at a dim, read when the graph runs, so that the graph
    serves every shape."""
    index: int = 0


@dataclass(frozen=True)
class Call:
    """An aten call: `aten::<name>(*args, **kwargs)`; an int argument is the
    node's input of that index, a Call is a nested call.  `overload` names
    the aten overload where the arguments alone cannot say it (a list of
    tensors, which TorchScript's IR must type)."""
    name: str
    args: tuple
    kwargs: tuple = ()
    overload: str | None = None

    @staticmethod
    def of(name, *args, **kwargs):
        return Call(name, args, tuple(kwargs.items()))


@dataclass(frozen=True)
class Op:
    name: str
    rule: int
    lower: Call
    params: tuple                 # parameter names; the first is the tensor
    nrequired: int = 1            # leading params that must be given
    npos: int | None = None       # params accepted positionally (default: all)
    noperands: int | None = None  # leading params that are operands (default: all)
    cats: int = ALL               # accepted dtype categories
    # those CUDA's kernel takes, where fewer (None: cats); another dtype on
    # CUDA runs eagerly, so that eager's error is raised at the call
    cuda_cats: int | None = None
    flags: int = 0
    functions: tuple = ()         # torch.<name>
    methods: tuple = ()           # Tensor.<name>, including operators
    inplace: tuple = ()           # Tensor.<name> that mutate self
    nn_functions: tuple = ()      # torch.nn.functional.<name>
    # the result may share its input's storage (a view; contiguous's input
    # itself where the value is contiguous already): no later op of the
    # graph may compute into it
    aliases: bool = False
    opcode: int = field(default=-1, compare=False)


def _rows():
    c = Call.of
    binary = ("input", "other")
    yield Op("add", Rule.R_BINARY, c("add", 0, 1, alpha=Opt(2, 1)), binary + ("alpha",),
             nrequired=2, npos=2, functions=("add",),
             methods=("add", "__add__", "__radd__"), inplace=("add_", "__iadd__"))
    yield Op("sub", Rule.R_BINARY, c("sub", 0, 1, alpha=Opt(2, 1)), binary + ("alpha",),
             nrequired=2, npos=2, flags=OpFlag.OPF_NO_BOOL, functions=("sub", "subtract"),
             methods=("sub", "subtract", "__sub__"),
             inplace=("sub_", "subtract_", "__isub__"))
    yield Op("rsub", Rule.R_BINARY, c("rsub", 0, 1, alpha=Opt(2, 1)), binary + ("alpha",),
             nrequired=2, npos=2, flags=OpFlag.OPF_NO_BOOL, functions=("rsub",),
             methods=("__rsub__",))
    yield Op("mul", Rule.R_BINARY, c("mul", 0, 1), binary, nrequired=2,
             functions=("mul", "multiply"), methods=("mul", "multiply", "__mul__", "__rmul__"),
             inplace=("mul_", "multiply_", "__imul__"))
    yield Op("div", Rule.R_DIV, c("div", 0, 1, rounding_mode=Attr((None, "trunc", "floor"))),
             binary + ("rounding_mode",), nrequired=2, npos=2, noperands=2,
             functions=("div", "divide"), methods=("div", "divide", "__truediv__"),
             inplace=("div_", "divide_", "__itruediv__"))
    # Tensor.__rtruediv__ is `self.reciprocal() * other` in eager; lowering
    # it the same way keeps the results bit-identical.
    yield Op("rtruediv", Rule.R_RTRUEDIV, c("mul", c("reciprocal", 0), 1), binary, nrequired=2,
             methods=("__rtruediv__", "__rdiv__"))
    yield Op("pow", Rule.R_POW, c("pow", 0, 1), ("input", "exponent"), nrequired=2,
             cats=NUMERIC, functions=("pow",),
             methods=("pow", "__pow__"), inplace=("pow_", "__ipow__"))
    yield Op("rpow", Rule.R_POW, c("pow", 1, 0), binary, nrequired=2, cats=NUMERIC,
             methods=("__rpow__",))
    yield Op("maximum", Rule.R_BINARY, c("maximum", 0, 1), binary, nrequired=2, cats=REAL,
             flags=OpFlag.OPF_TENSORS_ONLY, functions=("maximum",), methods=("maximum",))
    yield Op("minimum", Rule.R_BINARY, c("minimum", 0, 1), binary, nrequired=2, cats=REAL,
             flags=OpFlag.OPF_TENSORS_ONLY, functions=("minimum",), methods=("minimum",))
    yield Op("clamp", Rule.R_CLAMP, c("clamp", 0, Opt(1), Opt(2)), ("input", "min", "max"),
             cats=INT | FLOAT, functions=("clamp", "clip"), methods=("clamp", "clip"),
             inplace=("clamp_", "clip_"))
    yield Op("neg", Rule.R_UNARY, c("neg", 0), ("input",), cats=NUMERIC,
             functions=("neg", "negative"), methods=("neg", "negative", "__neg__"),
             inplace=("neg_", "negative_"))
    yield Op("abs", Rule.R_ABS, c("abs", 0), ("input",), cats=NUMERIC,
             functions=("abs", "absolute"), methods=("abs", "absolute", "__abs__"),
             inplace=("abs_", "absolute_"))
    yield Op("relu", Rule.R_UNARY, c("relu", 0), ("input",), cats=INT | FLOAT,
             functions=("relu",), methods=("relu",), inplace=("relu_",))
    for name in ("exp", "log", "sqrt", "rsqrt", "sigmoid", "tanh"):
        yield Op(name, Rule.R_UNARY_FLOAT, c(name, 0), ("input",), functions=(name,),
                 methods=(name,), inplace=(name + "_",),
                 nn_functions=(name,) if name in ("sigmoid", "tanh") else ())
    # torch.nn.functional's activations (their `inplace=True` is the in-place form)
    yield Op("nn_relu", Rule.R_UNARY, c("relu", 0), ("input", "inplace"), noperands=1,
             cats=INT | FLOAT, nn_functions=("relu",))
    yield Op("silu", Rule.R_UNARY, c("silu", 0), ("input", "inplace"), noperands=1, cats=FLOAT,
             nn_functions=("silu",))
    for name in ("hardswish", "hardsigmoid"):        # (mobile networks' activations)
        yield Op(name, Rule.R_UNARY, c(name, 0), ("input", "inplace"), noperands=1,
                 cats=FLOAT, nn_functions=(name,))
    yield Op("leaky_relu", Rule.R_UNARY, c("leaky_relu", 0, Opt(1, 0.01)),
             ("input", "negative_slope", "inplace"), noperands=2, cats=FLOAT,
             nn_functions=("leaky_relu",))
    # nn.Hardtanh and nn.ReLU6 (a Hardtanh) call F.hardtanh; F.relu6 is
    # hardtanh(0, 6) in aten too
    yield Op("hardtanh", Rule.R_UNARY, c("hardtanh", 0, Opt(1, -1.0), Opt(2, 1.0)),
             ("input", "min_val", "max_val", "inplace"), noperands=3, cats=FLOAT,
             flags=OpFlag.OPF_ORDERED_LIMITS, nn_functions=("hardtanh",))
    yield Op("relu6", Rule.R_UNARY, c("hardtanh", 0, Const(0.0), Const(6.0)),
             ("input", "inplace"), noperands=1, cats=FLOAT, nn_functions=("relu6",))
    yield Op("gelu", Rule.R_UNARY, c("gelu", 0, approximate=Attr(("none", "tanh"))),
             ("input", "approximate"), noperands=1, npos=1, cats=FLOAT,
             nn_functions=("gelu",))
    # reductions
    reduce = ("input", "dim", "keepdim", "dtype")
    yield Op("sum", Rule.R_REDUCE, c("sum", 0, MaskedDims(), KeepDim(), dtype=ResultDType()),
             reduce, noperands=1, npos=3, flags=OpFlag.OPF_INT_TO_INT64, functions=("sum",),
             methods=("sum",))
    yield Op("mean", Rule.R_REDUCE, c("mean", 0, MaskedDims(), KeepDim(), dtype=ResultDType()),
             reduce, noperands=1, npos=3, cats=FLOAT | COMPLEX, functions=("mean",),
             methods=("mean",))
    for name in ("amax", "amin"):
        yield Op(name, Rule.R_REDUCE, c(name, 0, MaskedDims(), KeepDim()),
                 ("input", "dim", "keepdim"), noperands=1, cats=REAL, flags=OpFlag.OPF_EMPTY_ERROR,
                 functions=(name,), methods=(name,))
    # softmax: torch.softmax(input, dim, dtype) and F.softmax(input, dim, _stacklevel, dtype)
    for name in ("softmax", "log_softmax"):
        lowering = c(name, 0, Dim(), DTypeArg())
        yield Op(name, Rule.R_SOFTMAX, lowering, ("input", "dim", "dtype"), noperands=1, npos=2,
                 cats=FLOAT, functions=(name,), methods=(name,))
        yield Op("nn_" + name, Rule.R_SOFTMAX, lowering, ("input", "dim", "_stacklevel", "dtype"),
                 noperands=1, npos=3, cats=FLOAT, nn_functions=(name,))
    # matrix products: no type promotion (eager refuses mixed dtypes)
    yield Op("mm", Rule.R_MM, c("mm", 0, 1), ("input", "mat2"), nrequired=2, cats=FLOAT | COMPLEX,
             functions=("mm",), methods=("mm",))
    yield Op("bmm", Rule.R_BMM, c("bmm", 0, 1), ("input", "mat2"), nrequired=2,
             cats=FLOAT | COMPLEX, functions=("bmm",), methods=("bmm",))
    yield Op("matmul", Rule.R_MATMUL, c("matmul", 0, 1), ("input", "other"), nrequired=2,
             cats=FLOAT | COMPLEX, functions=("matmul",), methods=("matmul", "__matmul__"))
    # beta and alpha given: the generic path's (as are the calls the rule leaves)
    yield Op("addmm", Rule.R_ADDMM, c("addmm", 0, 1, 2, beta=Const(1), alpha=Const(1)),
             ("input", "mat1", "mat2", "beta", "alpha"), nrequired=3, npos=3, noperands=3,
             cats=FLOAT | COMPLEX,
             flags=OpFlag.OPF_RULE_IN_GENERIC, functions=("addmm",), methods=("addmm",))
    yield Op("linear", Rule.R_LINEAR, c("linear", 0, 1, Opt(2)), ("input", "weight", "bias"),
             nrequired=2, cats=FLOAT | COMPLEX, nn_functions=("linear",))
    # dropout records nothing: in eval (or p=0) it is its input, as in eager;
    # in training it runs eagerly at the call, so seeded runs match eager
    yield Op("dropout", Rule.R_DROPOUT, c("dropout", 0, Opt(1, 0.5), Opt(2, True)),
             ("input", "p", "training", "inplace"), noperands=1, nn_functions=("dropout",))
    yield Op("layer_norm", Rule.R_LAYER_NORM,
             c("layer_norm", 0, TrailingDims(0), Opt(2), Opt(3), Opt(4, 1e-5), Const(True)),
             ("input", "normalized_shape", "weight", "bias", "eps"), nrequired=2,
             cats=FLOAT, nn_functions=("layer_norm",))
    # inference (training=False); F.batch_norm's statistics come before
    # weight and bias, aten's after
    yield Op("batch_norm", Rule.R_BATCH_NORM,
             c("batch_norm", 0, Opt(3), Opt(4), 1, 2, Const(False), Const(0.0), Opt(7, 1e-5),
               Const(True)),
             ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum",
              "eps"), nrequired=3, cats=FLOAT, flags=OpFlag.OPF_RULE_IN_GENERIC,
             nn_functions=("batch_norm",))
    # F.conv2d as nn.Conv2d calls it; other calls (padding="same", an
    # unbatched input, sizes the attr cannot pack) are the generic path's
    yield Op("conv2d", Rule.R_CONV2D,
             c("conv2d", 0, 1, Opt(2),
               PackedPair(ATTR_CONV_STRIDE_SHIFT, ATTR_CONV_STRIDE_BITS, 1),
               PackedPair(ATTR_CONV_PADDING_SHIFT, ATTR_CONV_PADDING_BITS, 0),
               PackedPair(ATTR_CONV_DILATION_SHIFT, ATTR_CONV_DILATION_BITS, 1),
               Packed(ATTR_CONV_GROUPS_SHIFT, ATTR_CONV_GROUPS_BITS, 1)),
             ("input", "weight", "bias", "stride", "padding", "dilation", "groups"),
             nrequired=2, noperands=3, cats=FLOAT, flags=OpFlag.OPF_RULE_IN_GENERIC,
             nn_functions=("conv2d",))
    # pooling: sizes packed in the attr, as conv2d's; indices (a second
    # result) and sizes beyond the attr's fields are the generic path's
    yield Op("max_pool2d", Rule.R_MAX_POOL2D,
             c("max_pool2d", 0,
               PackedPair(ATTR_POOL_KERNEL_SHIFT, ATTR_POOL_KERNEL_BITS, 1),
               PackedPair(ATTR_POOL_STRIDE_SHIFT, ATTR_POOL_STRIDE_BITS, 1),
               PackedPair(ATTR_POOL_PADDING_SHIFT, ATTR_POOL_PADDING_BITS, 0),
               PackedPair(ATTR_POOL_DILATION_SHIFT, ATTR_POOL_DILATION_BITS, 1),
               Flag(ATTR_POOL_CEIL_MODE)),
             ("input", "kernel_size", "stride", "padding", "dilation", "ceil_mode",
              "return_indices"),
             nrequired=2, noperands=1, cats=INT | FLOAT, cuda_cats=FLOAT,
             flags=OpFlag.OPF_RULE_IN_GENERIC, nn_functions=("max_pool2d",))
    yield Op("adaptive_avg_pool2d", Rule.R_ADAPTIVE_AVG_POOL2D,
             c("adaptive_avg_pool2d", 0, PackedPair(0, ATTR_ADAPTIVE_SIZE_BITS, 1)),
             ("input", "output_size"), nrequired=2, noperands=1, cats=FLOAT,
             flags=OpFlag.OPF_RULE_IN_GENERIC, nn_functions=("adaptive_avg_pool2d",))
    # F.embedding(input, weight, ...) lowers to aten::embedding(weight, input)
    yield Op("embedding", Rule.R_EMBEDDING,
             c("embedding", 1, 0, Packed(0, ATTR_EMBEDDING_PADDING_BITS, -1), Const(False),
               Const(False)),
             ("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq",
              "sparse"),
             nrequired=2, noperands=2, flags=OpFlag.OPF_RULE_IN_GENERIC,
             nn_functions=("embedding",))
    # attention as transformers call it in inference: dropout (random) and
    # the rest are the generic path's
    yield Op("scaled_dot_product_attention", Rule.R_SDPA,
             c("scaled_dot_product_attention", 0, 1, 2, attn_mask=Opt(3), dropout_p=Const(0.0),
               is_causal=Flag(ATTR_SDPA_CAUSAL),
               scale=InternedFloat(ATTR_SDPA_SCALE_SHIFT, ATTR_SDPA_SCALE_BITS),
               enable_gqa=Flag(ATTR_SDPA_GQA)),
             ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
              "enable_gqa"),
             nrequired=3, noperands=4, cats=FLOAT, flags=OpFlag.OPF_RULE_IN_GENERIC,
             nn_functions=("scaled_dot_product_attention",))
    # nn.MultiheadAttention's fast path in inference (fastlazy/fast_paths.py
    # sends LazyTensors down it): one fused kernel, whose second output (the
    # weights) is not asked for
    yield Op("native_multi_head_attention", Rule.R_NATIVE_MHA,
             Item(Call("_native_multi_head_attention",
                       (0, 1, 2, DimSize(0, 2), Packed(0, 8, 0), 5, 6, 7, 8, Const(None),
                        Const(False), Const(True), Const(None)), (), "default"), 0),
             ("query", "key", "value", "embed_dim", "num_head", "qkv_weight", "qkv_bias",
              "proj_weight", "proj_bias", "mask", "need_weights", "average_attn_weights",
              "mask_type"), nrequired=9, noperands=10, cats=FLOAT,
             flags=OpFlag.OPF_RULE_IN_GENERIC | OpFlag.OPF_PAIR_WITH_NONE,
             functions=("_native_multi_head_attention",))
    # views (csrc/view_rules.pxi).  The torch.<name> forms take sizes and
    # dims as one sequence only, the Tensor methods also spread out
    # (x.view(2, 3)).  view and reshape lower to reshape: the graph's input
    # may have another layout than the recording saw (a value computed
    # earlier), which reshape copies where view would raise
    view, spread = ("input", "size"), OpFlag.OPF_RULE_IN_GENERIC
    sequence = OpFlag.OPF_RULE_IN_GENERIC | OpFlag.OPF_SIZE_SEQUENCE
    sized = c("reshape", 0, SizeList())
    yield Op("view", Rule.R_VIEW, sized, view, nrequired=2, noperands=1, flags=spread,
             aliases=True, methods=("view",))
    copies = OpFlag.OPF_COPIES
    yield Op("reshape", Rule.R_VIEW, sized, view, nrequired=2, noperands=1,
             flags=spread | copies, aliases=True, methods=("reshape",))
    yield Op("torch_reshape", Rule.R_VIEW, sized, view, nrequired=2, noperands=1,
             flags=sequence | copies, aliases=True, functions=("reshape",))
    # what reshape records where no view can have its sizes: eager's copy
    # (a clone, then a view of it), a new tensor
    yield Op("reshape_copy", Rule.R_RESHAPE_COPY,
             c("reshape", c("clone", 0, memory_format=Const(torch.contiguous_format)), SizeList()),
             view, nrequired=2, noperands=1)
    yield Op("unflatten", Rule.R_UNFLATTEN, sized, ("input", "dim", "sizes"), nrequired=3,
             noperands=1, flags=spread, aliases=True, functions=("unflatten",),
             methods=("unflatten",))
    yield Op("squeeze", Rule.R_SQUEEZE, Call("squeeze", (0, MaskedDims()), (), "dims"),
             ("input", "dim"), noperands=1, flags=spread, aliases=True, functions=("squeeze",),
             methods=("squeeze",))
    yield Op("expand", Rule.R_EXPAND, c("expand", 0, SizeList(), implicit=Const(False)), view,
             nrequired=2, noperands=1, flags=spread, aliases=True, methods=("expand",))
    # flatten lowers to flatten, not to a reshape to the recorded sizes: its
    # graph is the same at every input shape
    yield Op("flatten", Rule.R_FLATTEN,
             c("flatten", 0, Packed(0, ATTR_DIM_BITS, 0), Packed(ATTR_DIM_BITS, ATTR_DIM_BITS, 0)),
             ("input", "start_dim", "end_dim"), noperands=1, flags=spread, aliases=True,
             functions=("flatten",), methods=("flatten",))
    transposes = ("transpose", "swapaxes", "swapdims")
    yield Op("transpose", Rule.R_TRANSPOSE,
             c("transpose", 0, Packed(0, ATTR_DIM_BITS, 0), Packed(ATTR_DIM_BITS, ATTR_DIM_BITS, 0)),
             ("input", "dim0", "dim1"), nrequired=3, noperands=1, flags=spread, aliases=True,
             functions=transposes, methods=transposes)
    permuted = c("permute", 0, PermutedDims())
    yield Op("permute", Rule.R_PERMUTE, permuted, ("input", "dims"), nrequired=2, noperands=1,
             flags=spread, aliases=True, methods=("permute",))
    yield Op("torch_permute", Rule.R_PERMUTE, permuted, ("input", "dims"), nrequired=2,
             noperands=1, flags=sequence, aliases=True, functions=("permute",))
    yield Op("unsqueeze", Rule.R_UNSQUEEZE, c("unsqueeze", 0, Packed(0, ATTR_DIM_BITS + 1, 0)),
             ("input", "dim"), nrequired=2, noperands=1, flags=spread, aliases=True,
             functions=("unsqueeze",), methods=("unsqueeze",))
    # x[i] and x[a:b:c] record these rows' steps too (view_rules.pxi getitem_view)
    yield Op("select", Rule.R_SELECT,
             c("select", 0, Packed(0, ATTR_DIM_BITS, 0),
               Packed(ATTR_DIM_BITS, 27, -ATTR_SELECT_INDEX_BIAS)),
             ("input", "dim", "index"), nrequired=3, noperands=1, flags=spread, aliases=True,
             functions=("select",), methods=("select",))
    slices = c("slice", 0, Packed(0, ATTR_DIM_BITS, 0), SliceBound(0), SliceBound(1),
               SliceBound(2))
    yield Op("narrow", Rule.R_SLICE, slices, ("input", "dim", "start", "length"), nrequired=4,
             noperands=1, flags=spread, aliases=True, functions=("narrow",),
             methods=("narrow",))
    # split and chunk record narrow's slice steps (their own lowering, the
    # same, is never read: their nodes carry narrow's opcode)
    yield Op("split", Rule.R_SPLIT, slices, ("input", "split_size_or_sections", "dim"),
             nrequired=2, noperands=1, flags=spread, aliases=True, functions=("split",),
             methods=("split",))
    yield Op("chunk", Rule.R_SPLIT, slices, ("input", "chunks", "dim"), nrequired=2,
             noperands=1, flags=spread | OpFlag.OPF_CHUNKS, aliases=True,
             functions=("chunk",), methods=("chunk",))
    yield Op("cat", Rule.R_CAT,
             Call("cat", (TensorList(ATTR_DIM_BITS), Packed(0, ATTR_DIM_BITS, 0)), (), "default"),
             ("tensors", "dim"), noperands=1, flags=OpFlag.OPF_RULE_IN_GENERIC,
             functions=("cat", "concat", "concatenate"))
    # (every argument spelled out: TorchScript's IR has no defaults)
    yield Op("contiguous", Rule.R_CONTIGUOUS,
             c("contiguous", 0, memory_format=Const(torch.contiguous_format)), ("input",),
             noperands=1, flags=spread, aliases=True, methods=("contiguous",))
    for name, aliases, cats in (("eq", ("eq",), ALL), ("ne", ("ne", "not_equal"), ALL),
                                ("lt", ("lt", "less"), REAL),
                                ("le", ("le", "less_equal"), REAL),
                                ("gt", ("gt", "greater"), REAL),
                                ("ge", ("ge", "greater_equal"), REAL)):
        yield Op(name, Rule.R_COMPARE, c(name, 0, 1), binary, nrequired=2, cats=cats,
                 functions=aliases, methods=aliases + (f"__{name}__",),
                 inplace=tuple(a + "_" for a in aliases))


# Ops without a C rule whose entry points are patched all the same, so that
# model code reaches the generic path (fastlazy.generic) from C rather than
# through torch's __torch_function__ protocol.  Their lowering is the aten
# program captured per call signature.  Any other torch function still
# reaches the generic path through LazyTensor.__torch_function__.
GENERIC_OPS = {
    # name: (torch.<name>, Tensor.<name>, torch.nn.functional.<name>)
    # shape and view ops
    "t": (True, True, False),
    "expand_as": (False, True, False),
    "view_as": (False, True, False), "reshape_as": (False, True, False),
    "unbind": (True, True, False),
    "stack": (True, False, False),
    # elementwise beyond the C rules
    "where": (True, True, False), "lerp": (True, True, False),
    "addcmul": (True, True, False), "addcdiv": (True, True, False),
    "masked_fill": (True, True, False), "type_as": (False, True, False),
    "float": (False, True, False), "half": (False, True, False),
    "double": (False, True, False), "bfloat16": (False, True, False),
    "long": (False, True, False), "int": (False, True, False),
    "bool": (False, True, False),
    # reductions beyond the C rules
    "prod": (True, True, False), "var": (True, True, False), "std": (True, True, False),
    "logsumexp": (True, True, False), "norm": (True, True, False),
    "argmax": (True, True, False), "argmin": (True, True, False),
    "max": (True, True, False), "min": (True, True, False),
    "all": (True, True, False), "any": (True, True, False),
    "cumsum": (True, True, False),
    # selection (HuggingFace's generate: per token)
    "topk": (True, True, False), "isin": (True, False, False),
    # linear algebra
    "baddbmm": (True, True, False),
    # nn.TransformerEncoderLayer's fast path in inference (fastlazy/fast_paths.py)
    "_transformer_encoder_layer_fwd": (True, False, False),
    # torch.nn.functional, where nn modules call it
    "conv1d": (False, False, True),
    "avg_pool2d": (False, False, True),
    "group_norm": (False, False, True),
    "cross_entropy": (False, False, True), "mse_loss": (False, False, True),
    "nll_loss": (False, False, True),
    "pad": (False, False, True), "softplus": (False, False, True),
    "elu": (False, False, True), "mish": (False, False, True),
    "normalize": (False, False, True),
}


def _generic_rows():
    for name, (function, method, nn_function) in GENERIC_OPS.items():
        yield Op("generic_" + name, Rule.R_GENERIC, None, (),
                 functions=(name,) if function else (), methods=(name,) if method else (),
                 nn_functions=(name,) if nn_function else ())


def _choice(expr):
    """(param name, Attr) of the row's choice parameter, if it has one: the
    keyword argument of the lowering whose value is an Attr."""
    if isinstance(expr, Call):
        for name, value in expr.kwargs:
            if isinstance(value, Attr):
                return name, value
        for arg in expr.args:
            found = _choice(arg)
            if found:
                return found
    return None


def _number(rows):
    for opcode, row in enumerate(rows):
        object.__setattr__(row, "opcode", opcode)
    return tuple(rows)


def register(register_op):
    """Declare every row to the core (register_op is _core.register_op;
    called once, by fastlazy's boot)."""
    for row in OPS:
        nparams = len(row.params)
        choice = _choice(row.lower)
        register_op(
            row.opcode, row.rule, row.cats, row.flags, row.params,
            nparams if row.noperands is None else row.noperands,
            row.nrequired, nparams if row.npos is None else row.npos,
            -1 if choice is None else row.params.index(choice[0]),
            None if choice is None else choice[1].values,
            sum(1 << i for i, name in enumerate(row.params) if name in NULLABLE),
            sum(1 << i for i, name in enumerate(row.params) if name in RAW),
            row.cats if row.cuda_cats is None else row.cuda_cats)


OPS: tuple[Op, ...] = _number(list(itertools.chain(_rows(), _generic_rows())))
BY_NAME = {op.name: op for op in OPS}


def markdown() -> str:
    """The supported-ops table for the README."""
    rule_names = {Rule.R_UNARY: "unary", Rule.R_UNARY_FLOAT: "unary, int->float", Rule.R_ABS: "abs",
                  Rule.R_BINARY: "binary, promoting", Rule.R_TRUEDIV: "true division",
                  Rule.R_DIV: "division", Rule.R_COMPARE: "comparison", Rule.R_POW: "power",
                  Rule.R_CLAMP: "clamp", Rule.R_REDUCE: "reduction", Rule.R_SOFTMAX: "softmax",
                  Rule.R_MM: "matrix product", Rule.R_BMM: "matrix product",
                  Rule.R_MATMUL: "matrix product", Rule.R_LINEAR: "linear",
                  Rule.R_ADDMM: "matrix product plus input",
                  Rule.R_RTRUEDIV: "reflected true division", Rule.R_LAYER_NORM: "layer norm",
                  Rule.R_DROPOUT: "identity in eval; in training noise drawn at the call, product recorded",
                  Rule.R_BATCH_NORM: "batch norm (inference)",
                  Rule.R_CONV2D: "2-d convolution of a batch",
                  Rule.R_MAX_POOL2D: "2-d max pooling", Rule.R_EMBEDDING: "embedding lookup",
                  Rule.R_ADAPTIVE_AVG_POOL2D: "adaptive 2-d average pooling",
                  Rule.R_SDPA: "attention without dropout",
                  Rule.R_NATIVE_MHA: "fused self-attention (inference)",
                  Rule.R_VIEW: "view", Rule.R_TRANSPOSE: "view", Rule.R_PERMUTE: "view",
                  Rule.R_UNSQUEEZE: "view", Rule.R_SELECT: "view", Rule.R_SLICE: "view",
                  Rule.R_CONTIGUOUS: "the input where contiguous, else a copy",
                  Rule.R_CAT: "concatenation", Rule.R_SPLIT: "views (slices)",
                  Rule.R_SQUEEZE: "view", Rule.R_UNFLATTEN: "view", Rule.R_FLATTEN: "view",
                  Rule.R_EXPAND: "view",
                  Rule.R_RESHAPE_COPY: "copy (reshape of what it cannot view)",
                  Rule.R_GENERIC: "generic (fake-tensor signature)"}
    lines = ["| op | rule | aten | entry points |", "|---|---|---|---|"]
    for op in OPS:
        points = ([f"torch.{n}" for n in op.functions] + [f"Tensor.{n}" for n in op.methods]
                  + [f"Tensor.{n}" for n in op.inplace]
                  + [f"F.{n}" for n in op.nn_functions])
        lower = op.lower.call if isinstance(op.lower, Item) else op.lower
        aten = "per call signature" if lower is None else f"aten::{lower.name}"
        lines.append(f"| {op.name} | {rule_names[op.rule]} | {aten} | "
                     f"{', '.join('`' + p + '`' for p in points)} |")
    return "\n".join(lines)
