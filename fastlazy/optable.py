"""The op table: one row per recorded op, the single source of truth.

A row says which rule computes the op's output shape and dtype (the rules are
C code in rules.pxi/dispatch.pxi), which aten expression it lowers to (every
backend lowers from the same expression), which torch entry points record it,
and what its parameters are.  Patching, LazyTensor's methods, the backends and
the parametrized tests all read this table; adding an op is adding a row.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from fastlazy import _core

# Dtype categories an op accepts (the computation dtype must be in the mask).
BOOL, INT, FLOAT, COMPLEX = 1, 2, 4, 8
ALL = BOOL | INT | FLOAT | COMPLEX
REAL = BOOL | INT | FLOAT
NUMERIC = INT | FLOAT | COMPLEX

# Rule ids, mirrored from the compiled core's `Rule` enum.
(R_UNARY, R_UNARY_FLOAT, R_ABS, R_BINARY, R_TRUEDIV, R_DIV, R_COMPARE, R_POW,
 R_CLAMP) = range(9)

# Op flags, mirrored from the core's `OpFlags` enum.
NO_BOOL, TENSORS_ONLY, TENSOR_SELF = 1, 2, 4


@dataclass(frozen=True)
class Opt:
    """Node input `index` if the call gave it, else the constant `default`."""
    index: int
    default: object = None


@dataclass(frozen=True)
class Attr:
    """A structural argument: the node's attr selects one of `values`."""
    values: tuple


@dataclass(frozen=True)
class Call:
    """An aten call: `aten::<name>(*args, **kwargs)`; an int argument is the
    node's input of that index, a Call is a nested call."""
    name: str
    args: tuple
    kwargs: tuple = ()

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
    flags: int = 0
    functions: tuple = ()         # torch.<name>
    methods: tuple = ()           # Tensor.<name>, including operators
    inplace: tuple = ()           # Tensor.<name> that mutate self
    opcode: int = field(default=-1, compare=False)


def _rows():
    c = Call.of
    binary = ("input", "other")
    yield Op("add", R_BINARY, c("add", 0, 1, alpha=Opt(2, 1)), binary + ("alpha",),
             nrequired=2, npos=2, functions=("add",),
             methods=("add", "__add__", "__radd__"), inplace=("add_", "__iadd__"))
    yield Op("sub", R_BINARY, c("sub", 0, 1, alpha=Opt(2, 1)), binary + ("alpha",),
             nrequired=2, npos=2, flags=NO_BOOL, functions=("sub", "subtract"),
             methods=("sub", "subtract", "__sub__"),
             inplace=("sub_", "subtract_", "__isub__"))
    yield Op("rsub", R_BINARY, c("rsub", 0, 1, alpha=Opt(2, 1)), binary + ("alpha",),
             nrequired=2, npos=2, flags=NO_BOOL | TENSOR_SELF, functions=("rsub",),
             methods=("__rsub__",))
    yield Op("mul", R_BINARY, c("mul", 0, 1), binary, nrequired=2,
             functions=("mul", "multiply"), methods=("mul", "multiply", "__mul__", "__rmul__"),
             inplace=("mul_", "multiply_", "__imul__"))
    yield Op("div", R_DIV, c("div", 0, 1, rounding_mode=Attr((None, "trunc", "floor"))),
             binary + ("rounding_mode",), nrequired=2, npos=2, noperands=2,
             functions=("div", "divide"), methods=("div", "divide", "__truediv__"),
             inplace=("div_", "divide_", "__itruediv__"))
    # Tensor.__rtruediv__ is `self.reciprocal() * other` in eager; lowering
    # it the same way keeps the results bit-identical.
    yield Op("rtruediv", R_TRUEDIV, c("mul", c("reciprocal", 0), 1), binary, nrequired=2,
             flags=TENSOR_SELF, methods=("__rtruediv__", "__rdiv__"))
    yield Op("pow", R_POW, c("pow", 0, 1), ("input", "exponent"), nrequired=2,
             cats=NUMERIC, flags=TENSOR_SELF, functions=("pow",),
             methods=("pow", "__pow__"), inplace=("pow_", "__ipow__"))
    yield Op("rpow", R_POW, c("pow", 1, 0), binary, nrequired=2, cats=NUMERIC,
             flags=TENSOR_SELF, methods=("__rpow__",))
    yield Op("maximum", R_BINARY, c("maximum", 0, 1), binary, nrequired=2, cats=REAL,
             flags=TENSORS_ONLY, functions=("maximum",), methods=("maximum",))
    yield Op("minimum", R_BINARY, c("minimum", 0, 1), binary, nrequired=2, cats=REAL,
             flags=TENSORS_ONLY, functions=("minimum",), methods=("minimum",))
    yield Op("clamp", R_CLAMP, c("clamp", 0, Opt(1), Opt(2)), ("input", "min", "max"),
             cats=INT | FLOAT, functions=("clamp", "clip"), methods=("clamp", "clip"),
             inplace=("clamp_", "clip_"))
    yield Op("neg", R_UNARY, c("neg", 0), ("input",), cats=NUMERIC,
             functions=("neg", "negative"), methods=("neg", "negative", "__neg__"),
             inplace=("neg_", "negative_"))
    yield Op("abs", R_ABS, c("abs", 0), ("input",), cats=NUMERIC,
             functions=("abs", "absolute"), methods=("abs", "absolute", "__abs__"),
             inplace=("abs_", "absolute_"))
    yield Op("relu", R_UNARY, c("relu", 0), ("input",), cats=INT | FLOAT,
             functions=("relu",), methods=("relu",), inplace=("relu_",))
    for name in ("exp", "log", "sqrt", "sigmoid", "tanh"):
        yield Op(name, R_UNARY_FLOAT, c(name, 0), ("input",), functions=(name,),
                 methods=(name,), inplace=(name + "_",))
    for name, aliases, cats in (("eq", ("eq",), ALL), ("ne", ("ne", "not_equal"), ALL),
                                ("lt", ("lt", "less"), REAL),
                                ("le", ("le", "less_equal"), REAL),
                                ("gt", ("gt", "greater"), REAL),
                                ("ge", ("ge", "greater_equal"), REAL)):
        yield Op(name, R_COMPARE, c(name, 0, 1), binary, nrequired=2, cats=cats,
                 functions=aliases, methods=aliases + (f"__{name}__",),
                 inplace=tuple(a + "_" for a in aliases))


def _build():
    ops = []
    for opcode, row in enumerate(_rows()):
        object.__setattr__(row, "opcode", opcode)
        nparams = len(row.params)
        _core.register_op(
            opcode, row.rule, row.cats, row.flags, row.params,
            nparams if row.noperands is None else row.noperands,
            row.nrequired, nparams if row.npos is None else row.npos)
        ops.append(row)
    return tuple(ops)


OPS: tuple[Op, ...] = _build()
BY_NAME = {op.name: op for op in OPS}
