"""The FX graph the inductor backend compiles, built from a graph view:
each node's aten program copied in, Python scalars as 0-dim tensor inputs
cast as eager would promote them.  Built in the compile process from its
copy of the view (fastlazy.compile_process), or here where this process
compiles; its targets are importable by name (`aten_<name>`), for pickles
and inductor's caches."""
from __future__ import annotations

import functools

import torch
import torch.fx

from fastlazy import host_checks
from fastlazy.backends.base import Input, builtin, resolve, run_key


def _example(node_or_slot):
    """A one-element tensor of the operand's dtype and rank, or the scalar."""
    dtype, ndim, scalar = node_or_slot
    if scalar is not None:
        return scalar
    return torch.zeros((1,) * ndim, dtype=dtype)


def input_kinds(view):
    """Per input of the view's graph: None (a tensor) or the kind of the
    Python scalar that travels as a 0-dim tensor."""
    return [None if s.kind == "tensor" else s.kind for s in view.slots]


def build_fx(view):
    """The FX graph (a torch.fx.Graph, not yet a GraphModule) of a view
    (fastlazy.graph.GraphView, or the compile process's copy of one)."""
    graph = torch.fx.Graph()
    env = {}
    meta = {}                       # ('node'|'slot', i) -> (dtype, ndim, scalar)
    for s in view.slots:
        env[("slot", s.index)] = graph.placeholder(f"x{s.index}")
        if s.kind == "tensor":
            meta[("slot", s.index)] = (s.value.dtype, s.value.dim(), None)
        else:
            meta[("slot", s.index)] = (None, 0, s.value)
    casts = {}

    def cast(inp, dtype):
        key = (inp, dtype)
        if key not in casts:
            casts[key] = graph.call_function(_TO_COPY, (env[inp],), {"dtype": dtype})
        return casts[key]

    runs = {}                     # base.run_key -> the program's outputs
    for node in view.nodes:
        key = run_key(node)
        if key not in runs:
            runs[key] = _lower(graph, node, env, meta, cast)
        value = runs[key][node.output]
        if node.cast:
            value = graph.call_function(_TO_COPY, (value,), {"dtype": node.dtype})
        env[("node", node.index)] = value
        meta[("node", node.index)] = (node.dtype, len(node.shape), None)
    graph.output(tuple(env[("node", i)] for i in view.outputs))
    host_checks.keep_kernel_checks(graph, view.device_types <= {"cpu"})
    _narrow_casts_through_int32(graph)
    return graph


# dtype casts in an FX graph: the op, and where its dtype argument is
# (a position, or a keyword)
_CASTS = {
    torch.ops.aten._to_copy.default: "dtype",
    torch.ops.aten.to.dtype: 1,
    torch.ops.prims.convert_element_type.default: 1,
}
_NARROW_INTS = frozenset((torch.int8, torch.uint8, torch.int16))


def _narrow_casts_through_int32(graph):
    """Casts to an integer type narrower than int32 go through int32 first
    (in place).  Eager's CPU kernels convert a float to int32 and keep the
    low bits (x.to(torch.int8) of -965.4 is 59); inductor's vectorized
    conversion to int8 saturates (-128), and its conversion to int32 then
    to the narrow type keeps the low bits as eager's does.  An integer or
    bool source converts alike either way (int32's low bits are its own)."""
    for node in list(graph.nodes):
        where = _CASTS.get(node.target) if node.op == "call_function" else None
        if where is None:
            continue
        dtype = node.kwargs.get(where) if type(where) is str else (
            node.args[where] if len(node.args) > where else node.kwargs.get("dtype"))
        if dtype not in _NARROW_INTS or not node.args:
            continue
        with graph.inserting_before(node):
            wide = graph.call_function(_TO_COPY, (node.args[0],), {"dtype": torch.int32})
        node.args = (wide, *node.args[1:])


def _lower(graph, node, env, meta, cast):
    """A node's program copied into graph, each input read as eager would
    promote it (Python scalars are 0-dim tensor inputs here); its outputs."""
    program = node.program
    common = _common_dtype(node, meta)
    # the scalar inputs aten takes as Python numbers
    numbers = {node.inputs[k] for k in program.numbers if node.inputs[k][0] == "slot"}
    # True division of integral operands: eager casts each operand from its
    # own dtype to the float result dtype.  Inductor would first cast to the
    # integral common dtype (a 0-dim int64 -5 beside a uint8 tensor becomes
    # 251), so the operands are cast here.
    in_float = program.true_division and (node.dtype.is_floating_point or node.dtype.is_complex)
    # other / x is reciprocal(x) * other: the scalar meets a float
    scalar_in_float = in_float or program.scalars_in_float
    operands = {}

    def operand(k):
        if k in operands:
            return operands[k]
        inp = node.inputs[k]
        if meta[inp][2] is None:          # a tensor
            value = env[inp]
            if in_float and meta[inp][0] != node.dtype:
                value = cast(inp, node.dtype)
            if node.detach:
                value = graph.call_function(torch.ops.aten.detach.default, (value,))
        elif inp in numbers or scalar_in_float:    # alpha, negative_slope; true division
            value = cast(inp, node.dtype)
        else:
            value = env[inp] if common is None else cast(inp, common)
        operands[k] = value
        return value

    values = []

    def ref(r):
        return operand(r.k) if isinstance(r, Input) else values[r.k]

    def sizes(value, count):
        return graph.call_function(trailing_dims, (value, count))

    # the call whose result is the node's (its dtype is node.dtype)
    last = program.outputs[0].k if len(program.outputs) == 1 \
        and not isinstance(program.outputs[0], Input) else None
    for i, call in enumerate(program.calls):
        args = [resolve(a, ref, sizes) for a in call.args]
        kwargs = {name: resolve(a, ref, sizes) for name, a in call.kwargs}
        eager_kernel = _EAGER_FLOAT_KERNELS.get(_division_kind(call, kwargs)) \
            if i == last and node.dtype in _FLOOR_DIVIDED else None
        if eager_kernel is not None and any(isinstance(a, torch.fx.Node) for a in args[:2]):
            values.append(eager_kernel(graph, args[0], args[1]))
        else:
            values.append(_call(graph, call, args, kwargs))
    return [ref(o) for o in program.outputs]


# the dtypes whose floor division inductor computes otherwise than eager's
# kernel (float16 and bfloat16 eager computes in float32 and rounds; left
# to the first-run check)
_FLOOR_DIVIDED = frozenset((torch.float32, torch.float64))


def _division_kind(call, kwargs):
    """"floor" for a floor division, "remainder" for remainder, else None."""
    if call.name == "floor_divide" or (call.name == "div"
                                       and kwargs.get("rounding_mode") == "floor"):
        return "floor"
    return "remainder" if call.name == "remainder" else None


def _eager_floor_division(graph, a, b):
    """a // b for floating a and b as eager's CPU kernel computes it
    (c10's div_floor_floating), in aten calls inductor fuses: from fmod,
    not from floor(a / b).  Inductor's floor(a / b) gives 10.0 for 1.0 //
    0.1, where a / b rounds up to 10 in float32; eager's gives 9.0, the
    quotient of a - fmod(a, b).  `b` is a graph value or a Python number."""
    aten = torch.ops.aten
    call, a, scalar = _float_operands(graph, a, b)
    if scalar and b == 0:
        return call(aten.div.Scalar, a, b)      # IEEE's inf and nan, as eager
    mod, crossed = _fmod_crossing(call, a, b, scalar)
    quotient = call(aten.div.Scalar if scalar else aten.div.Tensor,
                    call(aten.sub.Tensor, a, mod), b)
    # a remainder whose sign is not the divisor's: one less
    quotient = call(aten.where.self, crossed, call(aten.sub.Scalar, quotient, 1), quotient)
    floored = call(aten.floor.default, quotient)
    rounded_down = call(aten.gt.Scalar, call(aten.sub.Tensor, quotient, floored), 0.5)
    floored = call(aten.where.self, rounded_down, call(aten.add.Scalar, floored, 1), floored)
    true_quotient = call(aten.div.Scalar if scalar else aten.div.Tensor, a, b)
    signed_zero = call(aten.copysign.Tensor, call(aten.zeros_like.default, floored), true_quotient)
    result = call(aten.where.self, call(aten.eq.Scalar, quotient, 0), signed_zero, floored)
    if not scalar:
        result = call(aten.where.self, call(aten.eq.Scalar, b, 0), true_quotient, result)
    return result


def _eager_remainder(graph, a, b):
    """remainder(a, b) for floating a and b as eager's CPU kernel computes
    it: fmod(a, b), plus b where its sign is not b's (inductor's own came
    out ulps away: 0.09999996 for eager's 0.09999999 of 1.0 by 0.1)."""
    aten = torch.ops.aten
    call, a, scalar = _float_operands(graph, a, b)
    mod, crossed = _fmod_crossing(call, a, b, scalar)
    return call(aten.where.self, crossed,
                call(aten.add.Scalar if scalar else aten.add.Tensor, mod, b), mod)


def _float_operands(graph, a, b):
    """For the eager kernels above: a function adding an aten call to
    graph, `a` as a graph value (a Python number filled to b's shape:
    3.0 // x), and whether b is a Python number."""
    def call(op, *args):
        return graph.call_function(op, args)

    if not isinstance(a, torch.fx.Node):
        a = call(torch.ops.aten.full_like.default, b, a)
    return call, a, not isinstance(b, torch.fx.Node)


def _fmod_crossing(call, a, b, scalar):
    """fmod(a, b), and where it is nonzero with a sign other than b's
    (eager's remainder adds b there, its floor division takes one off)."""
    aten = torch.ops.aten
    mod = call(aten.fmod.Scalar if scalar else aten.fmod.Tensor, a, b)
    mod_negative = call(aten.lt.Scalar, mod, 0)
    crossed = (call(aten.logical_not.default, mod_negative) if b < 0 else mod_negative) \
        if scalar else call(aten.ne.Tensor, call(aten.lt.Scalar, b, 0), mod_negative)
    return mod, call(aten.logical_and.default, call(aten.ne.Scalar, mod, 0), crossed)


_EAGER_FLOAT_KERNELS = {"floor": _eager_floor_division, "remainder": _eager_remainder}


def _call(graph, call, args, kwargs):
    if call.overload is not None:
        if isinstance(call.overload, torch._ops.OpOverload):
            return _scalars_as_tensors(graph, call.overload, tuple(args), kwargs)
        return graph.call_function(call.overload, tuple(args), kwargs)
    if call.name in _DECOMPOSE and any(isinstance(kwargs.get(k), torch.fx.Node) or k == "*"
                                       for k in _DECOMPOSE[call.name][0]):
        return _DECOMPOSE[call.name][1](graph, args, kwargs)
    return graph.call_function(fx_target(call.name), tuple(args), kwargs)


def _scalars_as_tensors(graph, op, args, kwargs):
    """A captured program's call of aten op `op`, where a Python float it
    takes as an input (fastlazy.lifted_floats) reaches a Scalar argument:
    here a 0-dim tensor, passed to the op's overload that takes a Tensor
    there (masked_fill.Scalar -> masked_fill.Tensor), cast to the dtype of
    the op's first tensor, to which the Scalar overload converts it.  An op
    with no such overload is not compiled (the graph stays on the fast
    tier): inductor takes a Scalar only as a constant."""
    schema = op._schema.arguments
    given = [(i, a) for i, a in enumerate(args)] + [
        (next(i for i, arg in enumerate(schema) if arg.name == name), a)
        for name, a in kwargs.items()]
    scalars = {i for i, a in given
               if isinstance(a, torch.fx.Node) and str(schema[i].type) in ("number", "float")}
    if not scalars:
        return graph.call_function(op, args, kwargs)
    if op is torch.ops.aten.scalar_tensor.default and scalars == {0}:
        return graph.call_function(_TO_COPY, (args[0],), {
            k: v for k, v in kwargs.items() if k in ("dtype", "device")})
    tensor_op = _tensor_overload(op, frozenset(scalars))
    first = next((a for i, a in given if i not in scalars and isinstance(a, torch.fx.Node)), None)
    if tensor_op is None or first is None:
        raise NotImplementedError(
            f"{op} takes a Python float that varies between calls, which inductor "
            "compiles only as a constant (the graph runs on the fast tier)")
    cast = {i: graph.call_function(torch.ops.aten.type_as.default, (a, first))
            for i, a in given if i in scalars}
    args = tuple(cast.get(i, a) for i, a in enumerate(args))
    kwargs = {name: cast.get(i, a) for (name, a), (i, _) in zip(kwargs.items(), given[len(args):])}
    return graph.call_function(tensor_op, args, kwargs)


@functools.lru_cache(maxsize=None)
def _tensor_overload(op, positions):
    """The overload of op's packet whose schema is op's with a Tensor at
    each of `positions` in place of a Scalar; None if it has none."""
    mine = op._schema.arguments
    for name in op.overloadpacket.overloads():
        other = getattr(op.overloadpacket, name)
        theirs = other._schema.arguments
        if len(theirs) == len(mine) and all(
                a.name == b.name and (str(b.type) == "Tensor" if i in positions
                                      else str(a.type) == str(b.type))
                for i, (a, b) in enumerate(zip(mine, theirs))):
            return other
    return None


# aten takes these arguments as Python numbers; as graph inputs (0-dim
# tensors, so a new value never recompiles) they are decomposed into tensor
# arithmetic, which inductor fuses anyway.
def _add_alpha(graph, args, kwargs):
    scaled = graph.call_function(fx_target("mul"), (args[1], kwargs["alpha"]))
    return graph.call_function(fx_target("add"), (args[0], scaled))


def _sub_alpha(graph, args, kwargs):
    scaled = graph.call_function(fx_target("mul"), (args[1], kwargs["alpha"]))
    return graph.call_function(fx_target("sub"), (args[0], scaled))


def _rsub_alpha(graph, args, kwargs):
    scaled = graph.call_function(fx_target("mul"), (args[0], kwargs["alpha"]))
    return graph.call_function(fx_target("sub"), (args[1], scaled))


def _leaky_relu(graph, args, kwargs):
    x, slope = args
    if not isinstance(slope, torch.fx.Node):
        return graph.call_function(fx_target("leaky_relu"), (x, slope))
    positive = graph.call_function(fx_target("gt"), (x, 0))
    return graph.call_function(fx_target("where"), (
        positive, x, graph.call_function(fx_target("mul"), (x, slope))))


def trailing_dims(x, k):
    return list(x.shape[-k:])


# torch's own builtins, bound once: the functions below are traced by
# dynamo, which warns (to the user) at every call of an lru_cache-wrapped
# function such as builtin() it meets
_MEAN, _RSQRT = builtin("mean"), builtin("rsqrt")


def _layer_norm_of(x, shape, weight, bias, eps):
    """layer_norm with eps a 0-dim tensor (traced by inductor, not run)."""
    dims = list(range(-len(shape), 0))
    mean = _MEAN(x, dims, True)
    centered = x - mean
    y = centered * _RSQRT(_MEAN(centered * centered, dims, True) + eps)
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y


def _layer_norm(graph, args, kwargs):
    if not isinstance(args[4], torch.fx.Node):
        return graph.call_function(fx_target("layer_norm"), tuple(args))
    return graph.call_function(_layer_norm_of, tuple(args[:5]))


def _batch_norm_of(x, weight, bias, mean, var, training, momentum, eps, cudnn_enabled):
    """Inference batch_norm with eps a 0-dim tensor: as aten computes it,
    (x - mean) * rsqrt(var + eps) * weight + bias over dim 1."""
    per_channel = [-1] + [1] * (x.dim() - 2)
    y = (x - mean.view(per_channel)) * _RSQRT(var + eps).view(per_channel)
    if weight is not None:
        y = y * weight.view(per_channel)
    if bias is not None:
        y = y + bias.view(per_channel)
    return y


def _hardtanh(graph, args, kwargs):
    """hardtanh with limits that are 0-dim tensor inputs, which aten's
    Scalar parameters cannot take: clamping by comparisons (eager's forward
    is a clamp), written so that the gradient passes only strictly between
    the limits, as hardtanh_backward's does (clamp's passes at them too)."""
    x, low, high = args
    if not isinstance(low, torch.fx.Node) and not isinstance(high, torch.fx.Node):
        return graph.call_function(fx_target("hardtanh"), (x, low, high))
    where = fx_target("where")
    upper = graph.call_function(where, (graph.call_function(fx_target("ge"), (x, high)), high, x))
    return graph.call_function(where, (graph.call_function(fx_target("le"), (x, low)), low, upper))


def _batch_norm(graph, args, kwargs):
    if not isinstance(args[7], torch.fx.Node):
        return graph.call_function(fx_target("batch_norm"), tuple(args))
    return graph.call_function(_batch_norm_of, tuple(args))


_DECOMPOSE = {
    "add": (("alpha",), _add_alpha),
    "sub": (("alpha",), _sub_alpha),
    "rsub": (("alpha",), _rsub_alpha),
    "leaky_relu": (("*",), _leaky_relu),
    "hardtanh": (("*",), _hardtanh),
    "layer_norm": (("*",), _layer_norm),
    "batch_norm": (("*",), _batch_norm),
}


def __getattr__(name):
    """`aten_<name>`: the FX target fx_target(<name>) -- so that a graph's
    targets are importable by name (pickled for the compile process, keyed
    by inductor's caches)."""
    if name.startswith("aten_"):
        return fx_target(name[len("aten_"):])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.lru_cache(maxsize=None)
def fx_target(name):
    """The FX target for an aten name: a small wrapper around the original
    torch builtin.  A builtin itself would be written into the generated
    code as `torch.<name>`, which resolves to fastlazy's entry point while
    fastlazy is enabled; dynamo inlines the wrapper and sees the builtin."""
    fn = builtin(name)

    def call(*args, **kwargs):
        return fn(*args, **kwargs)

    call.__name__ = call.__qualname__ = f"aten_{name}"
    return call


_TO_COPY = torch.ops.aten._to_copy.default


def _constant(value):
    return value


def _common_dtype(node, meta):
    """The dtype eager computes `node` in, if a Python scalar takes part."""
    operands = []
    has_scalar = False
    for k in node.program.promoting:
        inp = node.inputs[k]
        operands.append(_example(meta[inp]))
        has_scalar = has_scalar or meta[inp][2] is not None
    if not has_scalar:
        return None
    # N operands, Python scalars included, with eager's category rules
    from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes
    return elementwise_dtypes(*operands,
                              type_promotion_kind=ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT)[1]


# Ops that inductor fuses into a neighbour's kernel or that launch none,
# though aten tags them neither pointwise nor views: dtype casts, copies,
# fills and factories (and the sym_* size reads, by their prefix).
_FUSED_ANYWAY = frozenset({
    "_to_copy", "copy_", "copy", "contiguous", "_unsafe_view", "lift_fresh_copy", "type_as",
    "fill", "fill_", "full", "full_like", "scalar_tensor", "zeros", "zeros_like", "ones",
    "ones_like", "empty", "empty_like", "empty_strided"})


def kernel_breaks(view) -> int:
    """How many calls of the view's nodes end a fused kernel: an op that is
    neither pointwise nor a view (a matmul, a convolution, a reduction, an
    op inductor calls as an extern kernel), counted once per run of a
    program as build_fx runs them.  An estimate of the kernels the compiled
    program launches, read before compiling it."""
    runs = set()
    breaks = 0
    for node in view.nodes:
        key = run_key(node)
        if key in runs:
            continue
        runs.add(key)
        breaks += sum(not _fuses(call.name, call.overload) for call in node.program.calls)
    return breaks


def _fuses(name, overload) -> bool:
    if isinstance(overload, torch._ops.OpOverload):
        return _fuses_overload(overload)
    if overload is not None:
        return True           # operator.getitem of a call's results: no kernel
    return _fuses_name(name)


@functools.lru_cache(maxsize=None)
def _fuses_overload(op) -> bool:
    return (torch.Tag.pointwise in op.tags or op.is_view
            or _launches_none(op.overloadpacket.__name__))


def _launches_none(name) -> bool:
    return name in _FUSED_ANYWAY or name.startswith("sym_")


@functools.lru_cache(maxsize=None)
def _fuses_name(name) -> bool:
    if _launches_none(name):
        return True
    packet = getattr(torch.ops.aten, name, None)
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return False
    overloads = [getattr(packet, o) for o in packet.overloads()]
    return any(torch.Tag.pointwise in o.tags or o.is_view for o in overloads)
