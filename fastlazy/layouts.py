"""The layout eager gives a result that has not been computed yet.

A LazyTensor's pending result has eager's sizes and dtype, but its strides
are only known once the graph runs.  Two things need them before: a random
draw of its shape fills memory in order, so its noise must be laid out as
eager's empty_like(x) would be (fastlazy.random_ops), and `contiguous()`
returns the tensor itself where eager's is contiguous and a copy where it
is not (the core's view rules).  The layout is worked out from the
recorded producers: TensorIterator's rule for elementwise ops, the
contiguous results of matmuls and normalizations, the memory format
convolutions and pooling keep, a generic call's as its signature's real
run laid it out; where the producers do not tell, None.
"""
from __future__ import annotations

import collections
import functools

import torch

from fastlazy import _core, generic, node_program, optable, views
from fastlazy._core import Rule
from fastlazy.backends.base import argument_reader

# ops whose eager result is laid out as their operands are (TensorIterator's)
_ELEMENTWISE = frozenset(rule for rule in Rule if _core.is_elementwise_rule(rule))
# ops whose eager result is contiguous whatever their operands' layouts
# (matmuls, layer_norm, softmax, reductions, embedding, copies); the core's
# dropout draws for these alone
_CONTIGUOUS_RESULTS = frozenset(rule for rule in Rule if _core.is_contiguous_result_rule(rule))
# ops whose eager result takes their input's memory format (a channels-last
# input gives a channels-last result); cat takes its inputs' common format
_FORMAT_FOLLOWING = frozenset((Rule.R_CONV2D, Rule.R_MAX_POOL2D, Rule.R_ADAPTIVE_AVG_POOL2D,
                               Rule.R_BATCH_NORM, Rule.R_CAT))
# views that keep a contiguous input's layout contiguous
_CONTIGUOUS_VIEWS = frozenset((Rule.R_VIEW, Rule.R_UNSQUEEZE, Rule.R_SQUEEZE, Rule.R_FLATTEN,
                               Rule.R_UNFLATTEN))
# generic ops that TensorIterator computes (laid out as their operands are)
_GENERIC_ELEMENTWISE = frozenset(f"generic_{name}" for name in
                                 ("where", "lerp", "addcmul", "addcdiv", "masked_fill"))
# ops whose result is contiguous where their operands are (attention: its
# CPU kernel lays its output out as the query is laid out)
_CONTIGUOUS_FROM_CONTIGUOUS = frozenset((Rule.R_SDPA, Rule.R_NATIVE_MHA))
# _Layouts._meta_strides' answers: (op, attr, dtype, shape, inputs) -> strides,
# a tensor input described by a _MetaOperand
_MetaOperand = collections.namedtuple("_MetaOperand", "shape strides dtype")
_META_STRIDES: dict = {}
_META_STRIDES_KEPT = 4096
# how many recorded nodes a layout may be followed through (a CNN's
# channels-last input decides the layout of every convolution after it)
_LAYOUT_NODES = 512
# and how deep a chain of them (each node is three Python frames here: a
# chain of 512 passed Python's recursion limit, efficientnet_v2_s at
# batch 3 raised RecursionError at its flatten)
_LAYOUT_DEPTH = 120


def pending_strides(x):
    """The strides eager gives the pending, non-view LazyTensor x, or None
    where its recorded producers do not tell (random_ops then computes x
    first; the core's contiguous(), csrc/view_rules.pxi, copies it).  A
    live view's strides are known; an elementwise op's result is laid out
    from its operands' layouts as TensorIterator lays it out;
    matmuls, normalizations over the last dims, softmax, reductions and
    embedding give contiguous results; convolution, pooling, batch norm
    and cat give their input's memory format (contiguous or channels
    last; only 4-D and 5-D tensors have another); attention gives a
    contiguous result of contiguous operands; a view that no tensor holds
    any more is followed only where it keeps a contiguous input
    contiguous; a generic call's result is laid out as the real run of its
    signature's first call laid it out, where its operands are laid out as
    they were there (a kernel lays its result out by its operands' shapes
    and strides, never their values).  Any other op -- a generic call too
    large for a real run, one whose operands are laid out otherwise --
    does not tell."""
    # (worked out afresh at each question: a segment drops the nodes at its
    # end that no tensor holds, and records the next ones at their indices)
    seg, index = _core.pending_in(x)
    return _Layouts(seg).strides(index)


class _Layouts:
    """The eager layouts of one segment's nodes, each worked out once."""

    def __init__(self, seg):
        self.seg = seg
        self.known = {}
        self.budget = _LAYOUT_NODES
        self.depth = 0

    def strides(self, index):
        if index not in self.known:
            self.budget -= 1
            if self.budget < 0 or self.depth >= _LAYOUT_DEPTH:
                self.known[index] = None
            else:
                self.depth += 1
                try:
                    self.known[index] = self._work_out(index)
                finally:
                    self.depth -= 1
        return self.known[index]

    def _work_out(self, index):
        seg = self.seg
        node = seg.node(index)
        owner = seg.owner(index)
        where = None if owner is None else views.geometry(owner)
        if where is not None:
            return tuple(where[1])                      # a live view
        if node.flags & _core.NodeFlag.NODE_WRITTEN and node.inputs:
            # an in-place call (its functional form): eager writes the
            # tensor, whose layout it keeps -- but a resize_ to another
            # shape, which lays it out contiguously
            if not node.flags & _core.NodeFlag.NODE_KEEPS_SHAPE:
                return views.contiguous_strides(tuple(node.shape))
            operand = self._operand(*node.inputs[0])
            return None if operand is None else tuple(operand[1])
        row = optable.OPS[node.op] if 0 <= node.op < len(optable.OPS) else None
        rule = None if row is None else row.rule
        if row is not None and row.aliases:
            # a view no tensor holds any more: its strides follow from its
            # input's alone, as its own program gives them on meta tensors
            strides = self._meta_strides(node)
            if strides is not None:
                return strides
        if node.op == _core.GENERIC_OP:
            if _preserves_layout(node.attr):
                # empty_like(x), zeros_like(x), x.clone()...: dense in x's order
                kind, k = node.inputs[0]
                operand = self._operand(kind, k)
                return None if operand is None else iterator_strides(node.shape, [operand])
            # any other call: as the real run of its signature laid it out,
            # where its operands are laid out as they were there
            lowering = generic.lowering(node.attr & ((1 << _core.ATTR_GENERIC_OUT_SHIFT) - 1))
            found = lowering.strides_of(node.attr >> _core.ATTR_GENERIC_OUT_SHIFT,
                                        [self._operand(kind, k) for kind, k in node.inputs])
            if found is None and generic_follows_operands(node.attr):
                # no real run laid out so (too large for one, or its operands
                # laid out otherwise): a pointwise call, a cast, a view is
                # laid out by its meta kernels as by eager's
                found = self._meta_strides(node)
            return found
        if rule in _CONTIGUOUS_RESULTS or (rule in _FORMAT_FOLLOWING and len(node.shape) < 4):
            return views.contiguous_strides(node.shape)
        elementwise = rule in _ELEMENTWISE or (row is not None and row.name in _GENERIC_ELEMENTWISE)
        if not (elementwise or rule in _CONTIGUOUS_VIEWS or rule in _FORMAT_FOLLOWING
                or rule in _CONTIGUOUS_FROM_CONTIGUOUS):
            return None
        operands = []
        for kind, k in node.inputs:
            operand = self._operand(kind, k)
            if operand is None:
                if kind == "node":
                    return None
                continue                                # a scalar slot
            operands.append(operand)
        if elementwise:
            return iterator_strides(node.shape, operands)
        if rule in _FORMAT_FOLLOWING and len(node.shape) == 4 and operands:
            # the memory format its input suggests (a convolution: its
            # input's or its weight's; cat: every input's), as eager's
            # kernels ask suggest_memory_format
            if rule == Rule.R_CAT:
                last = all(_suggests_channels_last(*o) for o in operands)
            else:
                judged = operands[:2] if rule == Rule.R_CONV2D else operands[:1]
                last = any(_suggests_channels_last(*o) for o in judged)
            return _channels_last_strides(node.shape) if last \
                else views.contiguous_strides(node.shape)
        if all(views.contiguous(shape, strides) for shape, strides in operands):
            return views.contiguous_strides(node.shape)
        return None

    def _meta_strides(self, node):
        """The strides of node `node` (a view, or a generic call laid out by
        its operands) where its operands' layouts are known: its program
        run on meta tensors laid out as they are -- once per op, operand
        layouts and other inputs (_META_STRIDES): a model's step asks the
        same of every call's nodes (a reshape of a transposed projection's
        pointwise result, at every token), and a meta run costs 30-100 us."""
        inputs = []
        for kind, k in node.inputs:
            value = self.seg.slot(k)[1] if kind == "slot" else None
            if kind == "node" or isinstance(value, torch.Tensor):
                operand = self._operand(kind, k)
                if operand is None:
                    return None
                dtype = self.seg.node(k).dtype if kind == "node" else value.dtype
                value = _MetaOperand(tuple(operand[0]), tuple(operand[1]), dtype)
            inputs.append(value)
        key = (node.op, node.attr, node.dtype, tuple(node.shape), tuple(inputs))
        try:
            return _META_STRIDES[key]
        except KeyError:
            pass
        except TypeError:           # (an input no key can hold: not kept)
            return self._meta_run(node, inputs)
        found = self._meta_run(node, inputs)
        if len(_META_STRIDES) >= _META_STRIDES_KEPT:
            _META_STRIDES.clear()
        _META_STRIDES[key] = found
        return found

    @staticmethod
    def _meta_run(node, inputs):
        inputs = [torch.empty_strided(v.shape, v.strides, dtype=v.dtype, device="meta")
                  if type(v) is _MetaOperand else v for v in inputs]
        program, output = node_program.of_record(node.op, node.attr, node.dtype)[1:]
        values = []
        try:
            for call in program.calls:
                values.append(call.fn(*[argument_reader(a)(inputs, values) for a in call.args],
                                      **{name: argument_reader(a)(inputs, values)
                                         for name, a in call.kwargs}))
            out = argument_reader(program.outputs[output])(inputs, values)
        except Exception:       # noqa: BLE001 - eager would raise: not told here
            return None
        return tuple(out.stride()) if tuple(out.shape) == tuple(node.shape) else None

    def _operand(self, kind, k):
        """(shape, strides) of a node's input: a node's as worked out, a
        tensor slot's own; None where not known (or not a tensor)."""
        if kind == "node":
            strides = self.strides(k)
            return None if strides is None else (self.seg.node(k).shape, strides)
        value = self.seg.slot(k)[1]
        if isinstance(value, torch.Tensor):
            return tuple(value.shape), value.stride()
        return None


# aten calls whose result eager lays out as its first argument is laid out
# (memory_format preserve: the same strides where that is dense, else dense
# in its order); _to_copy is a dtype or device cast
_LIKE = frozenset(getattr(torch.ops.aten, name).default for name in
                  ("empty_like", "zeros_like", "ones_like", "full_like", "clone",
                   "rand_like", "randn_like", "_to_copy"))
_LAYOUT_FREE = frozenset((torch.ops.aten.contiguous.default, torch.ops.aten.detach.default))


def generic_keeps_contiguous(attr) -> bool:
    """Is the result of the generic node of this attr, where its operands
    are contiguous, a new contiguous tensor: no view of an input (its aten
    op's schema returns no alias), and contiguous in every real run of its
    signatures on contiguous operands (a linalg result is column-major),
    where there were such runs (without, it is taken as contiguous, as a
    layout not known is elsewhere)?  The core asks once per attr
    (csrc/view_rules.pxi): a view of a pending result decides by its eager
    layout."""
    lowering = generic.lowering(attr & ((1 << _core.ATTR_GENERIC_OUT_SHIFT) - 1))
    index = attr >> _core.ATTR_GENERIC_OUT_SHIFT & 255
    if index >= len(lowering.outputs) or not node_program.returns_new(lowering.outputs[index]):
        return False
    for known in lowering.result_strides.get(index, {}).values():
        for operands, strides in known.items():
            # a dense result laid out otherwise has a stride smaller than
            # the next one's
            if all(o is None or views.contiguous(*o) for o in operands) \
                    and any(a < b for a, b in zip(strides, strides[1:])):
                return False
    return True


def generic_follows_operands(attr) -> bool:
    """Is the result of the generic node of this attr laid out from its
    operands' layouts, as its program's meta kernels lay it out: a program
    of pointwise calls (TensorIterator's: `round`, `lerp`, `nan_to_num`),
    *_like calls, casts and clones (memory format preserve), and views?
    Run on meta tensors laid out as its operands are, it gives eager's
    strides (csrc/view_rules.pxi asks the layouts of such a call of
    operands laid out otherwise, where it takes any other generic call's
    result as contiguous)."""
    return _program_follows_operands(attr & ((1 << _core.ATTR_GENERIC_OUT_SHIFT) - 1))


@functools.lru_cache(maxsize=4096)
def _program_follows_operands(index) -> bool:
    calls = [n for n in generic.lowering(index).gm.graph.nodes if n.op == "call_function"]
    return bool(calls) and all(_follows_operands(n.target) for n in calls)


def _follows_operands(target) -> bool:
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if target in _LIKE or target in _LAYOUT_FREE or torch.Tag.pointwise in target.tags:
        return True
    schema = target._schema
    # a view: its one result aliases its first argument, nothing written
    return (len(schema.returns) == 1 and schema.returns[0].alias_info is not None
            and not schema.returns[0].alias_info.is_write and not schema.is_mutable)


def _preserves_layout(attr) -> bool:
    """Is the generic node of this attr one *_like call (or a clone) of its
    first input, in that input's memory format?  (Its program may make the
    input contiguous first -- the generic path computes on contiguous
    copies of pending operands -- but eager's result takes the input's
    layout.)"""
    return _program_preserves_layout(attr & ((1 << _core.ATTR_GENERIC_OUT_SHIFT) - 1))


@functools.lru_cache(maxsize=4096)
def _program_preserves_layout(index) -> bool:
    """_preserves_layout of lowering `index` (a program never changes; its
    walk cost microseconds at every dropout of a generic result)."""
    lowering = generic.lowering(index)
    calls = [n for n in lowering.gm.graph.nodes
             if n.op == "call_function" and n.target not in _LAYOUT_FREE]
    # (a dtype cast, x.long(), is _to_copy, whose memory_format None is
    # preserve too)
    return (len(calls) == 1 and calls[0].target in _LIKE
            and calls[0].kwargs.get("memory_format", torch.preserve_format)
            in (torch.preserve_format, None)
            and lowering.placeholders[:1] == _sources(calls[0].args[0]))


def _sources(arg):
    """The placeholders `arg` is made from through layout-free calls."""
    while isinstance(arg, torch.fx.Node) and arg.op == "call_function" \
            and arg.target in _LAYOUT_FREE:
        arg = arg.args[0]
    return [arg] if isinstance(arg, torch.fx.Node) and arg.op == "placeholder" else []


def _channels_last_strides(shape):
    """The strides of a channels-last (NHWC) tensor of the 4-D `shape`."""
    n, c, h, w = (max(d, 1) for d in shape)
    return (h * w * c, 1, w * c, c)


def _is_channels_last(shape, strides) -> bool:
    """c10's channels-last contiguity of a 4-D geometry, approximately:
    the strides of a channels-last layout in every dim of size above 1."""
    if 0 in shape:
        return False
    return all(n == 1 or st == want
               for n, st, want in zip(shape, strides, _channels_last_strides(shape)))


def _dense(shape, strides) -> bool:
    """Non-overlapping and dense: the elements fill a block of numel()
    places exactly (some permutation of a contiguous layout)."""
    if 0 in shape:
        return False
    expected = 1
    for n, st in sorted(zip(shape, strides), key=lambda d: (d[1], d[0])):
        if n != 1:
            if st != expected:
                return False
            expected *= n
    return True


def _suggests_channels_last(shape, strides) -> bool:
    """Does a tensor of this geometry suggest the channels-last memory
    format (c10's is_channels_last_strides_2d_s4, which
    suggest_memory_format asks of a 4-D tensor)?  A tensor that is both
    contiguous and channels-last by its strides (a 1x1 or depthwise weight
    made channels-last) can: its strides, not its contiguity, decide."""
    if len(shape) != 4 or strides[1] == 0:
        return False
    low = 0
    for d in (1, 3, 2, 0):
        if shape[d] == 0 or strides[d] < low:
            return False
        # N111 and the like: contiguous, by c10's default
        if d == 0 and low == strides[1]:
            return False
        low = strides[d] * shape[d] if shape[d] > 1 else strides[d]
    return True


def iterator_strides(shape, operands):
    """The strides TensorIterator gives the result of `shape` of an
    elementwise op of operands [(shape, strides)] (aten's
    TensorIteratorBase::reorder_dimensions: dimensions sorted by the
    operands' strides, the first operand with an opinion deciding, a
    broadcast dimension giving none; the result dense in that order).
    Each answer is worked out once: a model's step asks the same ones at
    every call."""
    return _iterator_strides(tuple(shape), tuple((tuple(s), tuple(st)) for s, st in operands))


@functools.lru_cache(maxsize=4096)
def _iterator_strides(shape, operands):
    ndim = len(shape)
    if ndim <= 1:
        return views.contiguous_strides(shape)
    if operands and all(s == shape for s, _ in operands):
        # TensorIterator's fast set-up, where no operand broadcasts: every
        # operand contiguous (c10's check, blind to a size-1 dim's stride),
        # a contiguous result; every one channels last, a channels-last
        # one; all dense with the same strides, those
        if all(views.contiguous(shape, st) for _, st in operands):
            return views.contiguous_strides(shape)
        if ndim == 4 and all(_is_channels_last(shape, st) for _, st in operands):
            return _channels_last_strides(shape)
        first = operands[0][1]
        if all(st == first for _, st in operands) and _dense(shape, first):
            return first
    broadcast = []
    for operand_shape, operand_strides in operands:
        offset = ndim - len(operand_shape)
        strides = [0] * ndim
        for i, (size, stride) in enumerate(zip(operand_shape, operand_strides)):
            strides[offset + i] = 0 if size == 1 and shape[offset + i] != 1 else stride
        broadcast.append(strides)

    def should_swap(dim0, dim1):
        for strides in broadcast:
            stride0, stride1 = strides[dim0], strides[dim1]
            if stride0 == 0 or stride1 == 0:
                continue
            if stride0 != stride1:
                return -1 if stride0 < stride1 else 1
            if shape[dim0] > shape[dim1]:
                return 1
        return 0

    perm = list(range(ndim - 1, -1, -1))           # perm[0]: the fastest dimension
    for i in range(1, ndim):
        dim1 = i
        for dim0 in range(i - 1, -1, -1):
            comparison = should_swap(perm[dim0], perm[dim1])
            if comparison > 0:
                perm[dim0], perm[dim1] = perm[dim1], perm[dim0]
                dim1 = dim0
            elif comparison < 0:
                break
    if perm == list(range(ndim - 1, -1, -1)):
        # in order: ATen allocates a contiguous result, whose strides count
        # a dim of size 0 as 1 (x + 1 of a (5, 0) tensor: (1, 1))
        return views.contiguous_strides(shape)
    strides, step = [0] * ndim, 1
    for dim in perm:
        strides[dim] = step
        step *= shape[dim]
    return tuple(strides)
