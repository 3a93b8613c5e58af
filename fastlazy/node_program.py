"""What every backend lowers: each recorded node as a small program of aten
calls over the node's inputs.

A node comes from one of two sources: an op-table row (its lowering a
`Call` expression read with the node's attr: absent operands, reduced dims,
the choice parameter...) or a captured aten program (fastlazy.generic: an
FX graph with several outputs, of which the node is one).  Both become a
NodeProgram here, once per row, attr and dtype or once per captured
program, so that a backend has one thing to lower: a sequence of AtenCalls
whose arguments are templates -- Input(k) (the node's input k), Value(j)
(call j's result), Sizes (an input's trailing sizes, read when the graph
runs), lists of those, or constants -- and the outputs the node picks from.
"""
from __future__ import annotations

import functools
import math
import operator
import threading
from dataclasses import dataclass

import torch
import torch.fx

from fastlazy import generic
from fastlazy._core import (ATTR_ABSENT_SHIFT, ATTR_CHOICE_SHIFT, ATTR_GENERIC_OUT_SHIFT,
                            ATTR_SMALL_MASK, ATTR_VIEW_SIZES_BITS, GENERIC_OP, MAX_IN, MAX_NDIM,
                            SIZE_OF_DIM, Rule, interned_sizes)
from fastlazy.optable import (OPS, RAW, SCALAR_ARGS, AttrValue, Call, DimSize, Item, Opt,
                              SizeList, TensorList, TrailingDims)

_LOWERING_MASK = (1 << ATTR_GENERIC_OUT_SHIFT) - 1
# the size ops a program computes sizes with (a dim's size read when the
# graph runs, and a size divided: unflatten's -1); backends lower them
SYM_SIZE = torch.ops.aten.sym_size.int
FLOORDIV = torch.ops.aten.floordiv.int


class _Ref:
    __slots__ = ("k",)

    def __init__(self, k):
        self.k = k

    def __eq__(self, other):
        return type(other) is type(self) and other.k == self.k

    def __hash__(self):
        return hash((type(self), self.k))

    def __repr__(self):
        return f"{type(self).__name__}({self.k})"


class Input(_Ref):
    """The node's input k."""
    __slots__ = ()


class Value(_Ref):
    """The result of the program's call k."""
    __slots__ = ()


@dataclass(frozen=True)
class Sizes:
    """The last `count` sizes of `of`, read when the graph runs (graphs are
    shape-generic, so a size may not be a constant of the graph)."""
    of: Input | Value
    count: int


REFS = (Input, Value)
_FIRST_VALUE = (Value(0),)


def holds_refs(template):
    """Does the argument read a value when the graph runs (anything but a
    constant)?"""
    if isinstance(template, (Input, Value, Sizes)):
        return True
    if isinstance(template, (list, tuple)):
        return any(holds_refs(t) for t in template)
    return False


class AtenCall:
    """One call: `name` is the aten op's name; `overload` the exact aten
    overload (an OpOverload, or operator.getitem of a call's several
    results), or None where the arguments choose the overload, as torch's
    argument parser and TorchScript's operator matching do; `fn` what runs
    it in Python.  `optional`: keywords the call may leave out (their value
    is the op's default).  `flat`: every argument is a reference or a
    constant (none a list of values or an input's sizes)."""

    __slots__ = ("name", "overload", "fn", "args", "kwargs", "optional", "flat")

    def __init__(self, name, overload, args, kwargs=(), optional=frozenset()):
        self.name = name
        self.overload = overload
        # an OpOverload's own builtin: its __call__ is one more Python frame
        self.fn = builtin(name) if overload is None else getattr(overload, "_op", overload)
        self.args = tuple(args)
        self.kwargs = tuple(kwargs)
        self.optional = optional
        self.flat = all(isinstance(a, REFS) or not holds_refs(a)
                        for a in (*self.args, *(v for _, v in self.kwargs)))

    def __repr__(self):
        return f"<aten call {self.name} {self.args} {self.kwargs}>"


class NodeProgram:
    """A node's computation.  `calls` run in order; `outputs` are the
    program's results (a node takes one: Node.output).

    `fresh`: every output is a new tensor that no other node's value
    aliases, so a later op may compute into it; a program without that
    (a captured one: its results may be views of its inputs or of each
    other) is never written, and its nodes over the same inputs share one
    run of it.

    What a backend with its own type promotion needs (inductor, whose
    Python-number operands are 0-dim tensor inputs): `promoting`, the
    inputs that take part in the op's type promotion; `numbers`, the inputs
    aten takes as Python numbers (alpha, eps...); `true_division`, the
    operands are computed in the float result dtype; `scalars_in_float`:
    a Python-number operand meets a float whatever the other's dtype
    (other / x as reciprocal(x) * other)."""

    __slots__ = ("name", "calls", "outputs", "fresh", "new_output", "promoting", "numbers",
                 "true_division", "scalars_in_float")

    def __init__(self, name, calls, outputs, fresh, promoting=(), numbers=(),
                 true_division=False, scalars_in_float=False, new_output=None):
        self.name = name
        self.calls = tuple(calls)
        self.outputs = tuple(outputs)
        self.fresh = fresh
        # its one output is a tensor of its own (no view of an input, and
        # not an input): a fresh program's is; a captured one's if its
        # aten op's schema returns no alias (backends.base.as_written)
        self.new_output = fresh if new_output is None else new_output
        self.promoting = promoting
        self.numbers = numbers
        self.true_division = true_division
        self.scalars_in_float = scalars_in_float

    def only_call(self, name=None):
        """The program's one call (of `name`, if given) if it is its only
        call, its result the output, and its arguments choose the overload
        -- so that its `<name>_` variant, or another implementation of the
        op, takes the same arguments; else None."""
        if len(self.calls) != 1 or self.outputs != _FIRST_VALUE:
            return None
        call = self.calls[0]
        if call.overload is not None or name is not None and call.name != name:
            return None
        return call

    def __repr__(self):
        return f"<node program {self.name}: {len(self.calls)} calls>"


@functools.lru_cache(maxsize=None)
def builtin(name):
    """torch's own builtin for an aten name (torch.add, torch._C._nn.linear,
    ...): never fastlazy's entry point, and much cheaper to call than an
    aten OpOverloadPacket, which matches schemas on every call."""
    for namespace in (torch._C._VariableFunctions, torch._C._nn):
        fn = getattr(namespace, name, None)
        if fn is not None:
            return fn
    return getattr(torch.ops.aten, name)


# -- building them --------------------------------------------------------------

# Re-entrant: a finalizer run by an allocation inside the lock may read a
# LazyTensor, whose flush builds programs on this very thread.
_lock = threading.RLock()
_row_programs: dict = {}        # (opcode, attr, dtype) -> NodeProgram
_captured_programs: dict = {}   # lowering index -> NodeProgram
_MAX_ROW_PROGRAMS = 4096


def of_record(opcode, attr, dtype):
    """(the op or captured lowering, its NodeProgram, which of the
    program's outputs the node is) of a recorded node."""
    if opcode == GENERIC_OP:
        lowering = generic.lowering(attr & _LOWERING_MASK)
        program = _captured_programs.get(lowering.index)
        if program is None:
            with _lock:
                program = _captured_programs.setdefault(lowering.index, _captured(lowering))
        return lowering, program, attr >> ATTR_GENERIC_OUT_SHIFT & 255
    op = OPS[opcode]
    key = (opcode, attr, dtype)
    program = _row_programs.get(key)
    if program is None:
        with _lock:
            if len(_row_programs) >= _MAX_ROW_PROGRAMS:
                _row_programs.clear()
            program = _row_programs.setdefault(key, _row(op, attr, dtype))
    return op, program, 0


def _row(op, attr, dtype):
    """A row's lowering expression read for one attr and result dtype."""
    # (a required operand is never absent -- a row whose operands all are
    # may use those bits for its own fields, as the view rules do -- but a
    # required parameter its rule reads is not recorded: layer_norm's shape)
    # the input index of each operand, None where absent (absent optional
    # operands are not stored)
    inputs, stored = [], 0
    for p, name in enumerate(op.params):
        if (p >= op.nrequired or name in RAW) and attr >> (ATTR_ABSENT_SHIFT + p) & 1:
            inputs.append(None)
        else:
            inputs.append(stored)
            stored += 1
    operand = inputs.__getitem__

    calls = []

    def template(expr):
        if isinstance(expr, int):
            return Input(operand(expr))
        if isinstance(expr, DimSize):
            calls.append(AtenCall("sym_size", SYM_SIZE, [Input(operand(expr.index)), expr.dim]))
            return Value(len(calls) - 1)
        if isinstance(expr, Item):
            source = template(expr.call)
            calls.append(AtenCall("getitem", operator.getitem, [source, expr.index]))
            return Value(len(calls) - 1)
        if isinstance(expr, TrailingDims):
            return Sizes(Input(operand(expr.index)), attr & 15)
        if isinstance(expr, TensorList):
            # the count, up to MAX_IN, fills the bits of 2 * MAX_IN - 1
            return [Input(k) for k in range(attr >> expr.shift & (2 * MAX_IN - 1))]
        if isinstance(expr, SizeList):
            sizes = []
            entries = interned_sizes(attr & (1 << ATTR_VIEW_SIZES_BITS) - 1)
            for entry in entries:
                if entry <= SIZE_OF_DIM:
                    # input k's size at dim d: the operand's (k = 0), or
                    # that of a node the rule added after it
                    k, d = divmod(SIZE_OF_DIM - entry, MAX_NDIM)
                    source = Input(operand(expr.index) + k)
                    calls.append(AtenCall("sym_size", SYM_SIZE, [source, d]))
                    entry = Value(len(calls) - 1)
                sizes.append(entry)
            if op.rule == Rule.R_UNFLATTEN and -1 in entries:
                sizes[entries.index(-1)] = _split_size(entries, Input(operand(expr.index)))
            return sizes
        if isinstance(expr, Opt):
            k = operand(expr.index)
            return expr.default if k is None else Input(k)
        if isinstance(expr, AttrValue):
            return expr.value(attr, dtype)
        if isinstance(expr, Call):
            args = [template(a) for a in expr.args]
            kwargs = [(name, template(v)) for name, v in expr.kwargs]
            # keywords at the op's default: an absent operand's, or None
            optional = frozenset(name for (name, v), (_, t) in zip(expr.kwargs, kwargs)
                                 if t is None or isinstance(v, Opt) and operand(v.index) is None)
            overload = (None if expr.overload is None
                        else getattr(getattr(torch.ops.aten, expr.name), expr.overload))
            calls.append(AtenCall(expr.name, overload, args, kwargs, optional))
            return Value(len(calls) - 1)
        raise TypeError(f"bad lowering expression {expr!r}")

    def _split_size(entries, source):
        """The -1 among unflatten's split sizes, as eager infers it: the
        size of the dim split over the product of the others (reshape would
        infer it from the whole tensor's, which a tensor of no elements
        leaves ambiguous).  The split sizes are the list's constants, from
        the split dim on (the dims before and after it are read off the
        source)."""
        d = next(i for i, e in enumerate(entries) if e > SIZE_OF_DIM)
        known = math.prod(e for e in entries if e > SIZE_OF_DIM and e != -1)
        calls.append(AtenCall("sym_size", SYM_SIZE, [source, d]))
        calls.append(AtenCall("floordiv", FLOORDIV, [Value(len(calls) - 1), known]))
        return Value(len(calls) - 1)

    out = template(op.lower)
    operands = op.params[: op.noperands or len(op.params)]
    present = [(p, name) for p, name in enumerate(operands) if operand(p) is not None]
    choice = attr >> ATTR_CHOICE_SHIFT & ATTR_SMALL_MASK
    return NodeProgram(
        op.name, calls, (out,), fresh=not op.aliases,
        promoting=tuple(operand(p) for p, name in present if name not in SCALAR_ARGS),
        numbers=tuple(operand(p) for p, name in present if name in SCALAR_ARGS),
        true_division=op.rule == Rule.R_TRUEDIV or op.rule == Rule.R_DIV and choice == 0,
        scalars_in_float=op.rule == Rule.R_RTRUEDIV)


def _captured(lowering):
    """A captured aten program (an FX graph over the call's tensors)."""
    refs = {fx: Input(k) for k, fx in enumerate(lowering.placeholders)}
    calls = []

    def template(a):
        if isinstance(a, torch.fx.Node):
            return refs[a]
        if isinstance(a, (list, tuple)) and _holds_nodes(a):
            # FX's immutable_list, which torch's argument parser refuses
            return (list if isinstance(a, list) else tuple)(template(v) for v in a)
        return a

    for fx in lowering.gm.graph.nodes:
        if fx.op != "call_function":
            continue
        target = fx.target
        name = ("getitem" if target is operator.getitem
                else target._schema.name.split("::", 1)[1] if hasattr(target, "_schema")
                else getattr(target, "__name__", str(target)))
        calls.append(AtenCall(name, target, [template(a) for a in fx.args],
                              [(k, template(v)) for k, v in fx.kwargs.items()]))
        refs[fx] = Value(len(calls) - 1)
    outputs = lowering.outputs
    return NodeProgram(lowering.name, calls, [refs[o] for o in outputs], fresh=False,
                       new_output=len(outputs) == 1 and returns_new(outputs[0]))


def returns_new(fx):
    """Is fx's value a tensor its op made (its schema's return carries no
    alias annotation), not an input or a view of one?"""
    if not isinstance(fx, torch.fx.Node) or fx.op != "call_function":
        return False
    k = 0
    if fx.target is operator.getitem:
        fx, k = fx.args
        if not isinstance(fx, torch.fx.Node) or fx.op != "call_function":
            return False
    schema = getattr(fx.target, "_schema", None)
    if schema is None or k >= len(schema.returns):
        return False
    ret = schema.returns[k]
    return ret.alias_info is None and str(ret.type) == "Tensor"


def _holds_nodes(a):
    return any(isinstance(v, torch.fx.Node) or isinstance(v, (list, tuple)) and _holds_nodes(v)
               for v in a)
