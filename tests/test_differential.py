"""Differential tests: every recorded op, through every entry point, against
eager PyTorch (the oracle), on every backend in helpers.BACKENDS, on the
CPU and (where one is present) on CUDA, against eager on the same device.

The cases are generated from the op table (fastlazy.optable.OPS): a row's
entry points (functions, methods -- operators included --, inplace,
nn_functions) give the forms, and its rule, params, nrequired, npos and
noperands give the arguments: operands of every dtype, broadcasting shapes,
0-dim and empty tensors, Python scalars, eager tensors beside lazy ones,
keyword arguments and the values of each extra parameter (its domain is
looked up by parameter name in PARAM_KINDS).  The case generators name no
op (only the known-bug predicates do): adding a row adds its cases, and
test_every_row_and_entry_point_is_covered / test_every_parameter_has_a_domain
fail if a row, an entry point or a parameter gets none.

Cases are grouped into one test item per (row, entry point, group, backend,
device) to keep the suite fast.  On CUDA a case whose eager run raises on
the CPU is left out (helpers.raises_on_cpu: CUDA checks such values in the
kernel, or not at all).  Cases that hit a known core bug are split out into
their own items, marked xfail(strict=True) with the bug's description
(KNOWN_BUGS); such an item must fail, and only in the way the bug describes.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
import zlib

import pytest
import torch
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

import fastlazy
from fastlazy._core import OpFlag, Rule
from fastlazy.optable import COMPLEX, OPS, Attr, Call

from helpers import fastlazy_enabled  # noqa: F401  (fixture: enable() for the module)
from helpers import (BACKENDS, fastlazy_disabled, BF16, BOOL, C64, C128, F16, F32, F64, I8, I32, I64, U8, Mismatch,
                     T, assert_same, check, forms_of, fuzz_settings, make_value, raises_on_cpu,
                     returns_self, seed, show)

# every test runs once per backend in helpers.BACKENDS (conftest's backend fixture)
pytestmark = pytest.mark.usefixtures("backend")

CORE_DTYPES = (F32, F64, I64, BOOL)
EXTRA_DTYPES = (F16, BF16, I32, U8, C64)
ALL_DTYPES = CORE_DTYPES + EXTRA_DTYPES

# What each parameter name of the table is, so its values can be generated.
PARAM_KINDS = {
    "input": "operand", "other": "operand", "exponent": "operand", "mat2": "operand",
    "weight": "operand", "bias": "operand",
    "alpha": "number", "negative_slope": "number", "min_val": "number", "max_val": "number",
    "min": "bound", "max": "bound",
    "rounding_mode": "choice", "approximate": "choice",
    "inplace": "flag", "keepdim": "flag",
    "dim": "dim", "dtype": "dtype", "_stacklevel": "stacklevel",
    "normalized_shape": "shape", "eps": "number", "p": "number", "training": "flag",
    "running_mean": "operand", "running_var": "operand", "momentum": "number",
    "stride": "size", "padding": "size", "dilation": "size", "groups": "size",
    "mat1": "operand", "beta": "number",
    "kernel_size": "size", "ceil_mode": "flag", "return_indices": "flag", "output_size": "size",
    "padding_idx": "size", "max_norm": "number", "norm_type": "number",
    "scale_grad_by_freq": "flag", "sparse": "flag",
    "query": "operand", "key": "operand", "value": "operand", "attn_mask": "operand",
    "dropout_p": "number", "is_causal": "flag", "scale": "number", "enable_gqa": "flag",
    "size": "size", "dim0": "dim", "dim1": "dim", "dims": "size", "index": "size",
    "start": "size", "length": "size", "tensors": "operand",
    "start_dim": "dim", "end_dim": "dim", "implicit": "flag",
    "split_size_or_sections": "size", "chunks": "size", "sizes": "size",
    "embed_dim": "size", "num_head": "size", "qkv_weight": "operand", "qkv_bias": "operand",
    "proj_weight": "operand", "proj_bias": "operand", "mask": "operand",
    "need_weights": "flag", "average_attn_weights": "flag", "mask_type": "size",
}
ELEMENTWISE_RULES_MAX = Rule.R_CLAMP          # rules 0..R_CLAMP are elementwise
MATMUL_RULES = (Rule.R_MM, Rule.R_BMM, Rule.R_MATMUL, Rule.R_LINEAR, Rule.R_ADDMM)


# --------------------------------------------------------------------------
# cases


@dataclasses.dataclass
class Case:
    row: object
    form: object
    group: str
    args: tuple
    kwargs: dict = dataclasses.field(default_factory=dict)
    lazy: frozenset | None = None     # None: every tensor argument is lazy
    pending: bool = False

    def __post_init__(self):
        # an operator cannot take keywords (Form would have to drop them)
        assert not (self.form.is_operator and self.kwargs), self.id

    @property
    def id(self):
        parts = [show(a) for a in self.args]
        parts += [f"{k}={show(v)}" for k, v in self.kwargs.items()]
        s = f"{self.row.name}|{self.form}|{self.group}|" + ",".join(parts)
        if self.lazy is not None:
            s += "|lazy=" + ",".join(str(k) for k in sorted(self.lazy, key=str))
        if self.pending:
            s += "|pending"
        return s

    def build(self, device="cpu"):
        seed(self.id)
        return ([make_value(a, device) for a in self.args],
                {k: make_value(v, device) for k, v in self.kwargs.items()})

    def run(self, device="cpu"):
        """check() the case on `device`; None (not run) on CUDA where eager
        raises on the CPU (helpers.raises_on_cpu)."""
        if device != "cpu":
            args, kwargs = self.build()
            if raises_on_cpu(self.form, *args, **kwargs):
                return None
        args, kwargs = self.build(device)
        return check(self.form, *args, lazy=self.lazy, pending=self.pending,
                     returns_self=returns_self(self.row, self.form, args, kwargs), **kwargs)


SCALARS = (True, False, 3, -2, 0, 2.5, -0.5, 1.5 - 2j)
FEW_SCALARS = (True, 3, -0.5, 1.5 - 2j)       # beside the less common dtypes
# scalars at the edge of what a dtype holds (eager checks some at the call)
RANGE_SCALARS = (300, -1, 2 ** 63, 2 ** 64, -2 ** 63 - 1, 1e10, math.inf, math.nan)
RANGE_DTYPES = (U8, I32, I64, F16, BF16, BOOL)
SHAPE_PAIRS = (((3, 4), (3, 4)), ((3, 4), (4,)), ((3, 1), (1, 4)), ((), (3, 4)),
               ((3, 4), ()), ((), ()), ((0, 3), (3,)), ((0, 3), (1, 3)), ((2, 1, 3), (4, 1)),
               ((2, 3), (4,)), ((3,), (3, 1)))
UNARY_SHAPES = ((3, 4), (), (0, 3), (2, 1, 3), (1,))
# a dim tensor beside a 0-dim tensor of another dtype: result_type corner cases
ZERODIM_PAIRS = ((I64, F64), (F32, F64), (F16, F32), (BOOL, I64), (U8, I64), (I32, C64),
                 (F32, C128), (BF16, F16), (U8, I8), (BOOL, F16))
BASE_DTYPE_PAIRS = ((F32, F32), (I64, I64), (BOOL, BOOL), (U8, U8), (F16, F32), (C64, C64),
                    (I64, F32))
NUMBER_VALUES = (2, -1, 0, 0.5, True, False, 1j, 300, 1e10, None, "bad",
                 T((4,), F32), T((), I64))
FLAG_VALUES = (False, True, 1, None)
DTYPE_VALUES = (None, F64, F32, F16, I64, I32, BOOL, C64, "bad")


def _dtype_pairs():
    pairs = [(a, b) for a in CORE_DTYPES for b in CORE_DTYPES]
    for d in EXTRA_DTYPES:
        pairs += [(d, d), (d, F32), (I64, d)]
    pairs += [(F16, BF16), (U8, I32), (C64, F64), (BOOL, U8)]
    return pairs


DTYPE_PAIRS = tuple(_dtype_pairs())


def _choice_values(row, name):
    """Values of a choice parameter, read from the row's lowering."""
    def walk(expr):
        if isinstance(expr, Call):
            for k, v in expr.kwargs:
                if k == name and isinstance(v, Attr):
                    return v.values
            for a in list(expr.args) + [v for _, v in expr.kwargs]:
                found = walk(a)
                if found is not None:
                    return found
        return None
    return walk(row.lower)


def param_values(row, name):
    """The values an extra (non-operand) parameter is tried with."""
    kind = PARAM_KINDS[name]
    if kind == "choice":
        return tuple(_choice_values(row, name) or ()) + ("bad", 1)
    if kind == "number":
        return NUMBER_VALUES
    if kind == "flag":
        return FLAG_VALUES
    if kind == "dtype":
        return DTYPE_VALUES
    if kind == "stacklevel":
        return (3, 5)
    raise LookupError(f"no values for parameter {name!r} of {row.name}")


def _npos(row):
    return len(row.params) if row.npos is None else row.npos


def _divisor(row, index):
    # only the divisor of a rounding division must avoid 0 (integer floor or
    # trunc division by zero raises at the call eagerly, at the read lazily:
    # test_integer_division_by_zero_raises_when_read)
    return row.rule == Rule.R_DIV and index == 1


def _tensor(row, index, shape, dtype, special=False):
    return T(tuple(shape), dtype, nonzero=_divisor(row, index), special=special)


def extra_param_cases(row, form, bases):
    """Each parameter after the required ones, alone: by keyword, and
    positionally where npos allows (earlier optional ones as None)."""
    nreq = row.nrequired
    for j in range(nreq, len(row.params)):
        name = row.params[j]
        if PARAM_KINDS[name] == "bound":
            continue                       # clamp-like: clamp_like_cases
        for v in param_values(row, name):
            for base in bases:
                yield Case(row, form, "params", base, {name: v})
            if j < _npos(row) and v is not None:
                yield Case(row, form, "params", bases[0] + (None,) * (j - nreq) + (v,))


def unary_cases(row, form):
    for d in ALL_DTYPES:
        yield Case(row, form, "dtypes", (T((3, 4), d),))
    for shape in UNARY_SHAPES:
        for d in (F32, I64):
            yield Case(row, form, "shapes", (T(shape, d),))
    for d in (F32, F64, F16, BF16):
        yield Case(row, form, "special", (T((8,), d, special=True),))
    for d in (F32, I64, BOOL, C64):
        yield Case(row, form, "pending", (T((2, 3), d),), pending=True)
    if form.takes_kwargs:
        yield Case(row, form, "keywords", (), {"input": T((2, 3), F32)})
        yield Case(row, form, "keywords", (T((2, 3), F32),), {"bogus": 1})
    if "inplace" in row.params and form.takes_kwargs:
        for d in ALL_DTYPES:
            yield Case(row, form, "inplace", (T((3, 4), d),), {"inplace": True})
        for shape in UNARY_SHAPES:
            yield Case(row, form, "inplace", (T(shape, F32),), {"inplace": True}, pending=True)
    if form.takes_kwargs:
        yield from extra_param_cases(row, form, [(T((3, 4), d),) for d in
                                                 (F32, I64, BOOL, U8, F16, C64, F64)])


def binary_cases(row, form):
    for da, db in DTYPE_PAIRS:
        yield Case(row, form, "dtypes", (T((3, 4), da), _tensor(row, 1, (4,), db)))
    for sa, sb in SHAPE_PAIRS:
        for d in (F32, I64):
            yield Case(row, form, "shapes", (T(sa, d), _tensor(row, 1, sb, d)))
    for da, db in ZERODIM_PAIRS:
        yield Case(row, form, "zerodim", (T((2, 3), da), _tensor(row, 1, (), db)))
        yield Case(row, form, "zerodim", (T((), db), _tensor(row, 1, (2, 3), da)))
    for d in ALL_DTYPES:
        for s in SCALARS if d in CORE_DTYPES else FEW_SCALARS:
            if not (_divisor(row, 1) and s == 0):
                yield Case(row, form, "scalars", (T((3, 4), d), s))
        yield Case(row, form, "scalars", (T((), d), 2))
    for d in RANGE_DTYPES:
        for s in RANGE_SCALARS:
            yield Case(row, form, "range", (T((3,), d), s))
    for d in (F32, I64):
        yield Case(row, form, "none", (T((3,), d), None))
    if form.scalar_self_ok:
        # a Python scalar as `input`, the LazyTensor as `other`
        for d in (F32, I64, BOOL, C64):
            for s in (True, 3, -1.5, 2j):
                yield Case(row, form, "scalar_self", (s, _tensor(row, 1, (2, 3), d)))
    for lazy in (frozenset({0}), frozenset({1})):
        for (da, db), (sa, sb) in (((F32, F32), ((3, 4), (4,))), ((I64, F32), ((3, 1), (1, 4))),
                                   ((F64, I32), ((2, 3), ())), ((I64, F64), ((), (2, 3))),
                                   ((F32, F32), ((2, 3), (3, 3)))):
            yield Case(row, form, "mixed", (T(sa, da), _tensor(row, 1, sb, db)), lazy=lazy)
    for d in (F32, F64, F16, C64):
        yield Case(row, form, "special", (T((8,), d, special=True),
                                          _tensor(row, 1, (8,), d, special=True)))
    for da, db in ((F32, F32), (I64, BOOL), (BOOL, BOOL), (C64, F32)):
        yield Case(row, form, "pending", (T((2, 3), da), _tensor(row, 1, (3,), db)),
                   pending=True)
    if form.takes_kwargs:
        yield from keyword_cases(row, form, T((2, 3), F32), _tensor(row, 1, (3,), I64), 2)
        yield from extra_param_cases(row, form, [
            (T((3, 4), da), _tensor(row, 1, (4,), db)) for da, db in BASE_DTYPE_PAIRS])


def keyword_cases(row, form, x, y, scalar=None):
    """Operands given by keyword, as row.params names them."""
    names = row.params
    if form.kind in ("function", "nn_function"):
        yield Case(row, form, "keywords", (), {names[0]: x, names[1]: y})
        yield Case(row, form, "keywords", (x,), {names[1]: y})
        if scalar is not None:
            yield Case(row, form, "keywords", (x,), {names[1]: scalar})
        if form.kind == "function":
            # an empty out= is resized by eager without a warning
            yield Case(row, form, "keywords", (x, y), {"out": T((0,), F32)},
                       lazy=frozenset({0, 1}))
    else:
        yield Case(row, form, "keywords", (x,), {names[1]: y})
        if scalar is not None:
            yield Case(row, form, "keywords", (x,), {names[1]: scalar})
    yield Case(row, form, "keywords", (x, y), {"bogus": 1})


def clamp_like_cases(row, form):
    """nrequired == 1 with optional operands (clamp): bounds as scalars,
    tensors, None, mixed; keyword and positional."""
    names = [n for n in row.params[1:] if PARAM_KINDS[n] == "bound"]
    npos = _npos(row)

    def call(x, *bounds, group, kw=True, lazy=None, pending=False):
        if kw and form.takes_kwargs:
            return Case(row, form, group, (x,), {n: b for n, b in zip(names, bounds)
                                                 if b is not None}, lazy=lazy, pending=pending)
        return Case(row, form, group, (x,) + bounds[:npos - 1], lazy=lazy, pending=pending)

    for d in ALL_DTYPES:
        x = T((3, 4), d)
        yield call(x, -1, None, group="dtypes")
        yield call(x, None, 1.5, group="dtypes")
        yield call(x, 0, 2, group="dtypes", kw=False)
        yield call(x, T((4,), d), None, group="dtypes")
    for shape in UNARY_SHAPES:
        for d in (F32, I64):
            yield call(T(shape, d), -1, 1, group="shapes", kw=False)
            yield call(T(shape, d), T((4,), d), T((1,), d), group="shapes")
            yield call(T(shape, d), None, T((), d), group="shapes")
    for d in ALL_DTYPES:
        for s in SCALARS if d in CORE_DTYPES else FEW_SCALARS:
            yield call(T((3, 4), d), s, None, group="scalars")
            yield call(T((3, 4), d), None, s, group="scalars", kw=False)
        yield call(T((3, 4), d), 3, -2, group="scalars")   # min > max
    for d in RANGE_DTYPES:
        for s in RANGE_SCALARS:
            yield call(T((3,), d), s, None, group="range")
            yield call(T((3,), d), None, s, group="range")
    for lo, hi in ((None, None), (1, T((), F32)), (T((4,), F32), 2.0), (T((4,), I64), None),
                   (T((3, 1), F64), T((4,), F32)), ("bad", None), (None, [1, 2])):
        for d in (F32, I64):
            yield call(T((3, 4), d), lo, hi, group="bounds")
            yield call(T((3, 4), d), lo, hi, group="bounds", kw=False)
    for lazy in (frozenset({0}), frozenset({1, 2, names[0], names[1]}),
                 frozenset({0, names[0]})):
        yield call(T((3, 4), F32), T((4,), F32), T((3, 1), F64), group="mixed", lazy=lazy)
        yield call(T((3, 4), F32), T((4,), F32), T((3, 1), F64), group="mixed", lazy=lazy,
                   kw=False)
    for d in (F32, F64, F16):
        yield call(T((8,), d, special=True), T((8,), d, special=True), 1.0, group="special")
    for d in (F32, I64):
        yield call(T((2, 3), d), 0, T((3,), d), group="pending", pending=True)
        yield call(T((2, 3), d), 1, None, group="pending", pending=True, kw=False)


DIM_VALUES = (0, -1, 2, 3, -4, (0, 2), [1, 2], (0, 0), (), None, "bad", 1.5, (0, "a"))
REDUCE_SHAPES = ((), (0, 3), (3, 0), (2, 1, 3), (5,), (2, 3, 4))


def reduce_cases(row, form):
    """input, dim, keepdim[, dtype]: dims of every kind, keepdim, dtype=."""
    p = row.params
    has_dtype = "dtype" in p

    def kw(**k):
        return {p[{"dim": 1, "keepdim": 2, "dtype": 3}[n]]: v for n, v in k.items()}

    for d in ALL_DTYPES:
        x = T((3, 4), d)
        yield Case(row, form, "dtypes", (x,))
        yield Case(row, form, "dtypes", (x,), kw(dim=1))
        yield Case(row, form, "dtypes", (x, (0, 1), True) if _npos(row) >= 3 else (x,),
                   {} if _npos(row) >= 3 else kw(dim=(0, 1), keepdim=True))
        if has_dtype:
            yield Case(row, form, "dtypes", (x,), kw(dtype=F64))
    for shape in REDUCE_SHAPES:
        for d in (F32, I64):
            x = T(shape, d)
            yield Case(row, form, "shapes", (x,))
            yield Case(row, form, "shapes", (x,), kw(dim=0))
            yield Case(row, form, "shapes", (x,), kw(dim=-1, keepdim=True))
            if len(shape) >= 2:
                yield Case(row, form, "shapes", (x,), kw(dim=(0, -1)))
    x = T((2, 3, 4), F32)
    for dim in DIM_VALUES:
        yield Case(row, form, "dims", (x,), kw(dim=dim))
        yield Case(row, form, "dims", (x,), kw(dim=dim, keepdim=True))
        if dim is not None:
            yield Case(row, form, "dims", (x, dim))
    for keep in FLAG_VALUES + ("x",):
        yield Case(row, form, "keepdim", (x,), kw(dim=1, keepdim=keep))
        yield Case(row, form, "keepdim", (x, 1, keep))
    if has_dtype:
        for dt in DTYPE_VALUES:
            for d in (F32, I64, BOOL, C64, F16):
                yield Case(row, form, "dtype", (T((3, 4), d),), kw(dtype=dt))
                yield Case(row, form, "dtype", (T((3, 4), d),), kw(dim=0, dtype=dt))
        yield Case(row, form, "dtype", (x, 1, True, F64))      # dtype is keyword-only
    for d in (F32, F64, F16):
        yield Case(row, form, "special", (T((8,), d, special=True),))
        yield Case(row, form, "special", (T((2, 8), d, special=True),), kw(dim=1))
    for d in (F32, I64, BOOL):
        yield Case(row, form, "pending", (T((2, 3), d),), pending=True)
        yield Case(row, form, "pending", (T((2, 3), d),), kw(dim=1), pending=True)
    if form.takes_kwargs:
        yield Case(row, form, "keywords", (), {"input": T((2, 3), F32), p[1]: 1})
        yield Case(row, form, "keywords", (T((2, 3), F32),), {"bogus": 1})
        if form.kind == "function":
            yield Case(row, form, "keywords", (T((2, 3), F32), 1), {"out": T((0,), F32)},
                       lazy=frozenset({0}))


def softmax_cases(row, form):
    """input, dim[, _stacklevel], dtype."""
    p = row.params
    x = T((3, 4), F32)
    for d in ALL_DTYPES:
        yield Case(row, form, "dtypes", (T((3, 4), d), 1))
        yield Case(row, form, "dtypes", (T((3, 4), d),), {"dim": -1, "dtype": F64})
    for shape in ((), (0, 3), (3, 0), (5,), (2, 3, 4), (1, 1)):
        for d in (F32, F64):
            yield Case(row, form, "shapes", (T(shape, d), 0))
            yield Case(row, form, "shapes", (T(shape, d), -1))
    for dim in (0, -1, 1, 2, -3, None, "bad", 1.5, (0,)):
        yield Case(row, form, "dims", (x, dim))
        yield Case(row, form, "dims", (x,), {"dim": dim})
    yield Case(row, form, "dims", (x,))
    for dt in DTYPE_VALUES:
        for d in (F32, F16, I64, BOOL, C64):
            yield Case(row, form, "dtype", (T((3, 4), d), 1), {"dtype": dt})
    for j, name in enumerate(p):
        if PARAM_KINDS[name] == "stacklevel":
            for v in param_values(row, name):
                yield Case(row, form, "params", (x, 1), {name: v})
                if j < _npos(row):
                    yield Case(row, form, "params", (x, 1) + (None,) * (j - 2) + (v,))
    for d in (F32, F64, F16, BF16):
        yield Case(row, form, "special", (T((2, 8), d, special=True), 1))
    for d in (F32, F64):
        yield Case(row, form, "pending", (T((2, 3), d), 0), pending=True)
    if form.takes_kwargs:
        yield Case(row, form, "keywords", (), {"input": x, "dim": 0})
        yield Case(row, form, "keywords", (x, 0), {"bogus": 1})


MATMUL_SHAPES = {
    Rule.R_MM: (((3, 4), (4, 5)), ((0, 4), (4, 5)), ((3, 0), (0, 5)), ((1, 1), (1, 1)),
           ((3, 4), (5, 4)), ((3,), (3, 4)), ((2, 3, 4), (4, 5))),
    Rule.R_BMM: (((2, 3, 4), (2, 4, 5)), ((0, 3, 4), (0, 4, 5)), ((1, 3, 4), (1, 4, 2)),
            ((2, 3, 4), (3, 4, 5)), ((2, 3, 4), (2, 5, 4)), ((3, 4), (4, 5))),
    Rule.R_MATMUL: (((3,), (3,)), ((3,), (3, 4)), ((2, 3), (3,)), ((2, 3), (3, 4)),
               ((2, 1, 3, 4), (5, 4, 2)), ((5, 3, 4), (4,)), ((4,), (2, 4, 3)),
               ((2, 0, 3), (3, 2)), ((), (3,)), ((3,), (4,)), ((2, 3, 4), (3, 4, 5)),
               ((3,), ())),
    Rule.R_ADDMM: (((4,), (3, 5), (5, 4)), ((3, 4), (3, 5), (5, 4)), ((1, 4), (3, 5), (5, 4)),
              ((3, 1), (3, 5), (5, 4)), ((), (3, 5), (5, 4)), ((1,), (3, 5), (5, 4)),
              ((2,), (3, 5), (5, 4)), ((4,), (3, 5), (4, 4)), ((4,), (0, 5), (5, 4)),
              ((4,), (3, 0), (0, 4)), ((0,), (3, 5), (5, 0)), ((4,), (2, 3, 5), (5, 4)),
              ((2, 3, 4), (3, 5), (5, 4)), ((4,), (5,), (5, 4))),
    Rule.R_LINEAR: (((3, 4), (5, 4), (5,)), ((4,), (5, 4), (5,)), ((2, 3, 4), (5, 4), None),
               ((3, 4), (5, 4), (4,)), ((3, 4), (4, 5), None), ((3, 4), (5, 4), ()),
               ((0, 4), (5, 4), (5,)), ((3, 4), (5, 4), (1,)), ((3, 0), (2, 0), (2,))),
}


def matmul_cases(row, form):
    shapes = MATMUL_SHAPES[row.rule]
    nops = len(row.params)

    def ops(shape_set, dtypes):
        return tuple(T(s, d) if s is not None else None for s, d in zip(shape_set, dtypes))

    good = shapes[0]
    for d in ALL_DTYPES:
        yield Case(row, form, "dtypes", ops(good, [d] * nops))
    for dts in ((F32, F64), (F64, F32), (F32, I64), (C64, F32), (F16, F32)):
        yield Case(row, form, "dtypes", ops(good, (dts * 2)[:nops]))
    for shape_set in shapes:
        for d in (F32, F64):
            args = ops(shape_set, [d] * nops)
            if form.is_operator:
                args = args[:2]
            yield Case(row, form, "shapes", args)
    for s in (2, 1.5, True, None):
        yield Case(row, form, "scalars", (T(good[0], F32), s) + ops(good, [F32] * nops)[2:])
        if form.scalar_self_ok:
            yield Case(row, form, "scalar_self", (s,) + ops(good, [F32] * nops)[1:])
    for lazy in (frozenset({0}), frozenset({1})) + ((frozenset({2}),) if nops > 2 else ()):
        yield Case(row, form, "mixed", ops(good, [F32] * nops), lazy=lazy)
    for d in (F32, F64):
        yield Case(row, form, "special", tuple(
            T(s, d, special=True) if s is not None else None for s in good))
        yield Case(row, form, "pending", ops(good, [d] * nops), pending=True)
    if form.takes_kwargs:
        a = ops(good, [F32] * nops)
        yield from keyword_cases(row, form, a[0], a[1])
        if nops > 2:
            yield Case(row, form, "keywords", a[:2], {row.params[2]: a[2]})
            yield Case(row, form, "keywords", a[:2], {row.params[2]: None})
    if row.rule == Rule.R_ADDMM and form.takes_kwargs:
        # beta and alpha (keyword-only): the generic path's calls
        a = ops(good, [F32] * 3)
        for beta, alpha in ((0.5, 2), (0, 1), (1, 0.25), (True, 1), (2, 1j), ("x", 1)):
            yield Case(row, form, "keywords", a, {"beta": beta, "alpha": alpha})
        yield Case(row, form, "keywords", a, {"beta": 0.5})


def layer_norm_cases(row, form):
    """input, normalized_shape, weight, bias, eps."""
    w, b = T((4,), F32), T((4,), F32)
    for d in ALL_DTYPES:
        yield Case(row, form, "dtypes", (T((3, 4), d), (4,)))
        yield Case(row, form, "dtypes", (T((3, 4), d), (4,), T((4,), d), T((4,), d)))
    for shape, norm in (((2, 3, 4), (4,)), ((2, 3, 4), (3, 4)), ((2, 3, 4), [2, 3, 4]),
                        ((0, 4), (4,)), ((4,), (4,)), ((3, 4), (5,)), ((3, 4), (3,)),
                        ((), (1,)), ((3, 4), ()), ((3, 4), torch.Size([4])),
                        ((3, 4), 4), ((3, 4), (4.0,)), ((3, 4), "bad")):
        yield Case(row, form, "shapes", (T(shape, F32), norm))
    for weight in (w, None, T((3,), F32), T((4,), F64), T((1, 4), F32), 2.0):
        for bias in (b, None, T((4,), F64)):
            yield Case(row, form, "params", (T((3, 4), F32), (4,), weight, bias))
    for eps in (1e-5, 0.1, 1, 0.0, True, None, 1j, "x"):
        yield Case(row, form, "params", (T((3, 4), F32), (4,), w, b, eps))
        yield Case(row, form, "params", (T((3, 4), F32), (4,)), {"eps": eps})
    yield Case(row, form, "keywords", (T((2, 4), F32), (4,)), {"weight": w, "bias": b})
    yield Case(row, form, "keywords", (T((2, 4), F32),), {"normalized_shape": (4,)})
    for d in (F32, F64, F16, BF16):
        yield Case(row, form, "special", (T((2, 8), d, special=True), (8,)))
    yield Case(row, form, "pending", (T((2, 3), F32), (3,), T((3,), F32)), pending=True)


def dropout_cases(row, form):
    """input, p, training, inplace: the input itself unless training.  (In
    training it is random and runs eagerly: test_training.py checks seeded
    runs are bit-equal to eager.)"""
    for d in (F32, F64, I64, BOOL, F16):
        yield Case(row, form, "dtypes", (T((3, 4), d), 0.5, False))
    for p_, training in ((0.0, True), (0.3, False), (1.0, False), (0, True), (2.0, False),
                         (-0.1, False), ("x", False), (0.5, 1)):
        yield Case(row, form, "params", (T((3, 4), F32), p_, training))
        yield Case(row, form, "params", (T((3, 4), F32),), {"p": p_, "training": training})
    yield Case(row, form, "params", (T((3, 4), F32), 0.5, False, True))      # inplace in eval
    yield Case(row, form, "pending", (T((2, 3), F32), 0.2, False), pending=True)


# Generic rows (no C rule; recorded from fake-tensor signatures): argument
# sets per op, eager-rejected ones included.  The lowering is captured per
# signature, so the cases vary what a signature holds: shapes, dtypes,
# views among the arguments, keyword and optional arguments.
X34, X234 = T((3, 4), F32), T((2, 3, 4), F32)
IMG, KERNEL = T((2, 3, 6, 6), F32), T((4, 3, 3, 3), F32)
GENERIC_ARGS = {
    "t": [((X34,), {}), ((T((3,), I64),), {}), ((X234,), {})],
    "expand_as": [((T((3, 1), F32), X34), {}), ((X34, T((3, 5), F32)), {})],
    "view_as": [((X34, T((12,), F32)), {}), ((X34, T((5,), F32)), {})],
    "reshape_as": [((X34, T((2, 6), F32)), {}), ((X34, T((5,), F32)), {})],
    "unbind": [((X34,), {}), ((X234, 1), {})],
    "stack": [(([X34, X34],), {}), (([X34, X34], -1), {}), (([X34, T((4, 3), F32)],), {})],
    "where": [((T((3, 4), BOOL), X34, T((4,), F32)), {}), ((T((3, 4), BOOL), X34, 0.5), {}),
              ((T((3, 4), BOOL), T((3, 4), I64), T((3, 4), F64)), {})],
    "lerp": [((X34, T((3, 4), F32), 0.3), {}), ((X34, T((4,), F32), T((3, 4), F32)), {}),
             ((X34, T((3, 4), F64), 0.5), {})],
    "addcmul": [((X34, X34, T((4,), F32)), {"value": 0.5}), ((T((3, 4), I64),) * 3, {}),
                ((X34, X34, T((5,), F32)), {})],
    "addcdiv": [((X34, X34, T((4,), F32)), {"value": 2}),
                ((T((3, 4), I64),) * 3, {})],
    "masked_fill": [((X34, T((3, 4), BOOL), 2.5), {}), ((T((3, 4), I64), T((4,), BOOL), -1), {}),
                    ((X34, T((3, 4), BOOL), T((), F32)), {}), ((X34, T((3, 4), I64), 1.0), {})],
    "type_as": [((X34, T((2,), F64)), {}), ((T((3,), I64), X34), {})],
    "float": [((T((3, 4), I64),), {}), ((X34,), {})],
    "half": [((X34,), {})],
    "double": [((T((3, 4), I32),), {})],
    "bfloat16": [((X34,), {})],
    "long": [((X34,), {})],
    "int": [((T((3, 4), F64),), {})],
    "bool": [((X34,), {})],
    "prod": [((X34,), {}), ((X34, 1), {}), ((T((3, 4), I32), 0), {"keepdim": True}),
             ((X34, 2), {})],
    "var": [((X34,), {}), ((X34, 1), {}), ((X234, (0, 2)), {"correction": 0}),
            ((T((3, 4), I64),), {})],
    "std": [((X34,), {}), ((X34, 0), {"keepdim": True}), ((T((1,), F32),), {})],
    "logsumexp": [((X34, 1), {}), ((X234, (0, 1)), {"keepdim": True}), ((T((3, 4), I64), 0), {})],
    "norm": [((X34,), {}), ((X34, 1), {}), ((X34,), {"p": 1, "dim": 0}),
             ((X34, "fro"), {})],
    "argmax": [((X34,), {}), ((X34, 1), {}), ((T((3, 4), I64), 0), {"keepdim": True})],
    "argmin": [((X34,), {}), ((X234, -1), {})],
    "max": [((X34,), {}), ((X34, 1), {}), ((X34, T((3, 4), F32)), {}), ((X34, 0, True), {})],
    "min": [((X34,), {}), ((X234, 2), {}), ((X34, T((4,), F32)), {})],
    "all": [((T((3, 4), BOOL),), {}), ((X34, 1), {}), ((T((3, 4), I64), 0), {"keepdim": True})],
    "any": [((T((3, 4), BOOL),), {}), ((X34, 0), {})],
    "cumsum": [((X34, 1), {}), ((T((3, 4), I32), 0), {}), ((X34, 0), {"dtype": F64})],
    "topk": [((X34, 2), {}), ((X34, 1, 0), {"largest": False}), ((T((3, 4), I64), 3), {}),
             ((X34, 5), {})],
    "isin": [((T((3, 4), I64), T((5,), I64)), {}), ((T((3, 4), I64), T((3,), I64)), {"invert": True}),
             ((X34, T((2,), F32)), {})],
    "baddbmm": [((X234, T((2, 3, 5), F32), T((2, 5, 4), F32)), {})],
    # src, embed_dim, num_heads, the attention's 4 tensors, use_gelu,
    # norm_first, eps, the norms' 4, the feed-forward's 4, mask, mask_type
    "_transformer_encoder_layer_fwd": [
        ((T((2, 5, 8), F32), 8, 2, T((24, 8), F32), T((24,), F32), T((8, 8), F32),
          T((8,), F32), use_gelu, norm_first, 1e-5, *(T((8,), F32) for _ in range(4)),
          T((16, 8), F32), T((16,), F32), T((8, 16), F32), T((8,), F32), None, None), {})
        for use_gelu, norm_first in ((False, False), (True, True))],
    "conv1d": [((T((2, 3, 8), F32), T((4, 3, 3), F32)), {"padding": 1}),
               ((T((2, 3, 8), F32), T((4, 3, 3), F32), T((4,), F32), 2), {})],
    "avg_pool2d": [((IMG, 2), {}), ((IMG, 3), {"stride": 1, "padding": 1})],
    "group_norm": [((IMG, 3), {}), ((IMG, 1, T((3,), F32), T((3,), F32)), {}), ((IMG, 2), {})],
    "cross_entropy": [((X34, T((3,), I64, index=4)), {}),
                      ((X34, T((3, 4), F32)), {"label_smoothing": 0.1}),
                      ((X34, T((3,), I64, index=4)), {"reduction": "sum", "ignore_index": 2})],
    "mse_loss": [((X34, T((3, 4), F32)), {}), ((X34, T((4,), F32)), {"reduction": "none"})],
    "nll_loss": [((X34, T((3,), I64, index=4)), {}),
                 ((X34, T((3,), I64, index=4)), {"reduction": "sum"}),
                 ((X34, T((4,), I64, index=4)), {})],
    "pad": [((X34, (1, 2)), {}), ((IMG, (1, 1, 2, 0)), {"mode": "reflect"}),
            ((X34, (1, 1)), {"value": 3.5})],
    "softplus": [((X34,), {}), ((X34, 2, 10), {})],
    "elu": [((T((3, 4), F32, special=True),), {}), ((X34, 0.5), {})],
    "hardtanh": [((X34,), {}), ((X34, -0.5, 0.5), {})],
    "relu6": [((X34,), {})],
    "mish": [((X34,), {})],
    "normalize": [((X34,), {}), ((X34, 1.0, 0), {})],
}


def batch_norm_cases(row, form):
    """input, running_mean, running_var, weight, bias, training, momentum, eps
    (its C rule takes inference; training and the rest go generic)."""
    c = T((3,), F32)
    for d in ALL_DTYPES:
        yield Case(row, form, "dtypes", (T((2, 3, 4), d), T((3,), d), T((3,), d)))
    for shape in ((2, 3), (2, 3, 4), (2, 3, 4, 4), (1, 3, 2, 2, 2), (0, 3), (3,), ()):
        yield Case(row, form, "shapes", (T(shape, F32), c, c))
    for mean, var in ((T((4,), F32), c), (c, T((3,), F64)), (None, None), (c, None)):
        yield Case(row, form, "params", (IMG, mean, var))
    for weight in (c, None, T((4,), F32), T((3,), F64), 2.0):
        for bias in (c, None):
            yield Case(row, form, "params", (IMG, c, c, weight, bias))
    # (training=True writes the running statistics, which eager's run and
    # fastlazy's here share: tests/test_batch_norm_rule.py checks it)
    for training in (False, 0, None):
        yield Case(row, form, "params", (IMG, c, c, c, c, training))
    for momentum in (0.1, 0, None, "x"):
        yield Case(row, form, "params", (IMG, c, c), {"momentum": momentum})
    for eps in (1e-5, 0.1, 1, True, None, "x"):
        yield Case(row, form, "params", (IMG, c, c, c, c, False, 0.1, eps))
    yield Case(row, form, "keywords", (IMG, c, c), {"weight": c, "bias": c, "eps": 1e-3})
    yield Case(row, form, "keywords", (IMG,), {"running_mean": c, "running_var": c})
    yield Case(row, form, "special", (T((2, 3, 4), F32, special=True), c, c))
    yield Case(row, form, "pending", (IMG, c, c, c), pending=True)


def conv2d_cases(row, form):
    """input, weight, bias, stride, padding, dilation, groups: the C rule's
    calls, and around them the ones it leaves to the generic path (padding
    by name, an unbatched input, sizes beyond the attr's fields) and the
    ones eager refuses."""
    b = T((4,), F32)
    for d in ALL_DTYPES:
        yield Case(row, form, "dtypes", (T((2, 3, 6, 6), d), T((4, 3, 3, 3), d)))
    yield Case(row, form, "dtypes", (IMG, T((4, 3, 3, 3), F64)))
    yield Case(row, form, "dtypes", (IMG, KERNEL, T((4,), F64)))
    for shape, kernel in (((1, 3, 5, 7), (4, 3, 3, 3)), ((2, 3, 3, 3), (4, 3, 3, 3)),
                          ((2, 3, 2, 6), (4, 3, 3, 3)), ((2, 3, 6, 6), (4, 3, 1, 1)),
                          ((2, 3, 6, 6), (4, 3, 2, 5)), ((3, 6, 6), (4, 3, 3, 3)),
                          ((0, 3, 6, 6), (4, 3, 3, 3)), ((2, 3, 6, 6), (0, 3, 3, 3)),
                          ((2, 4, 6, 6), (4, 3, 3, 3)), ((2, 3, 6, 6), (4, 3, 3)),
                          ((2, 3, 6, 6, 1), (4, 3, 3, 3, 1))):
        yield Case(row, form, "shapes", (T(shape, F32), T(kernel, F32)))
    for bias in (b, None, T((3,), F32), T((1, 4), F32), T((), F32), 2.0):
        yield Case(row, form, "params", (IMG, KERNEL, bias))
    for stride in (1, 2, 4, 5, 16, 17, (1, 2), [2, 1], (2,), (1, 1, 1), 0, -1, 2.0, True,
                   (1, 2.0), 1 << 70):
        yield Case(row, form, "params", (IMG, KERNEL, b, stride))
    for padding in (0, 1, 7, 8, (0, 2), [1, 0], -1, 1.0, "same", "valid", "full", (1,)):
        yield Case(row, form, "params", (IMG, KERNEL, b, 1, padding))
    for dilation in (1, 2, (1, 2), 3, 5, 0, (2,)):
        yield Case(row, form, "params", (T((1, 3, 12, 12), F32), KERNEL, b, 1, 0, dilation))
    for groups, kernel in ((1, (4, 3, 3, 3)), (3, (6, 1, 3, 3)), (3, (4, 1, 3, 3)),
                           (2, (4, 3, 3, 3)), (0, (4, 3, 3, 3)), (-1, (4, 3, 3, 3)),
                           (3.0, (6, 1, 3, 3)), (True, (4, 3, 3, 3))):
        yield Case(row, form, "params", (IMG, T(kernel, F32), None, 1, 0, 1, groups))
    yield Case(row, form, "params", (T((1, 4096, 3, 3), F32), T((4096, 1, 1, 1), F32), None,
                                     1, 0, 1, 4096))
    yield Case(row, form, "keywords", (IMG, KERNEL), {"bias": b, "stride": 2, "padding": 1})
    yield Case(row, form, "keywords", (IMG,), {"weight": KERNEL, "groups": 1})
    yield Case(row, form, "keywords", (IMG, KERNEL), {"dilation": (2, 1), "padding": (2, 1)})
    yield Case(row, form, "special", (T((2, 3, 6, 6), F32, special=True), KERNEL))
    yield Case(row, form, "pending", (IMG, KERNEL, b), pending=True)


def pooling_cases(row, form):
    """max_pool2d (input, kernel_size, stride, padding, dilation, ceil_mode,
    return_indices) and adaptive_avg_pool2d (input, output_size): the C
    rules' calls and, around them, the generic path's and eager's errors."""
    max_pool = row.rule == Rule.R_MAX_POOL2D
    size = 2
    for d in ALL_DTYPES:
        yield Case(row, form, "dtypes", (T((2, 3, 6, 6), d), size))
    for shape in ((2, 3, 7, 5), (3, 6, 6), (1, 1, 2, 2), (0, 3, 6, 6), (2, 0, 6, 6),
                  (2, 3, 0, 6), (6, 6), (6,), (1, 2, 3, 6, 6)):
        yield Case(row, form, "shapes", (T(shape, F32), size))
    if max_pool:
        for kernel in (1, 3, 8, 9, (2, 3), [3, 1], 0, -1, (2,), 2.0, (7, 7)):
            yield Case(row, form, "params", (IMG, kernel))
        for stride in (None, 1, 3, 8, 9, (1, 2), [], (), 0, 2.5):
            yield Case(row, form, "params", (IMG, 3, stride))
        for padding in (0, 1, (1, 0), 2, 3, -1):
            yield Case(row, form, "params", (IMG, 3, 2, padding))
        for dilation in (1, 2, (1, 2), 4, 5, 0):
            yield Case(row, form, "params", (T((1, 2, 12, 12), F32), 2, 1, 0, dilation))
        for ceil_mode in (False, True, 0, None):
            for shape in ((2, 3, 7, 7), (1, 1, 5, 6)):
                yield Case(row, form, "params", (T(shape, F32), 3, 2, 1, 1, ceil_mode))
        yield Case(row, form, "params", (T((1, 1, 5, 5), F32), 2, 2, 1, 1, True))
        for return_indices in (False, True):
            yield Case(row, form, "params", (IMG, 2), {"return_indices": return_indices})
        yield Case(row, form, "keywords", (IMG,), {"kernel_size": 3, "stride": 1,
                                                    "padding": 1, "ceil_mode": True})
    else:
        for output in (1, 3, 6, 7, 256, 257, (2, 3), [1, 4], (None, 2), (2, None), 0, -1,
                       (2,), 2.0, (1, 2, 3)):
            yield Case(row, form, "params", (IMG, output))
        yield Case(row, form, "keywords", (IMG,), {"output_size": 2})
    yield Case(row, form, "special", (T((2, 3, 6, 6), F32, special=True), size))
    yield Case(row, form, "pending", (IMG, size), pending=True)


def embedding_cases(row, form):
    """input, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq,
    sparse."""
    ids, w = T((2, 3), I64, index=10), T((10, 4), F32)
    for d in ALL_DTYPES:
        yield Case(row, form, "dtypes", (ids, T((10, 4), d)))
    for d in (I64, I32, I8, U8):
        yield Case(row, form, "dtypes", (T((2, 3), d, index=10), w))
    for d in (F32, BOOL, C64):
        yield Case(row, form, "dtypes", (T((2, 3), d), w))
    for shape in ((), (5,), (2, 3, 4), (0,), (2, 0)):
        yield Case(row, form, "shapes", (T(shape, I64, index=10), w))
    for weight in ((10,), (10, 4, 2), (0, 4), (10, 0)):
        yield Case(row, form, "shapes", (ids, T(weight, F32)))
    for padding_idx in (None, 0, 9, -1, -10, 10, -11, 1.0, True):
        yield Case(row, form, "params", (ids, w, padding_idx))
    yield Case(row, form, "params", (ids, w, None, 1.0))            # max_norm writes w
    for norm_type in (2.0, 1, "x"):
        yield Case(row, form, "params", (ids, w, None, None, norm_type))
    for flag in (False, True):
        yield Case(row, form, "params", (ids, w, None, None, 2.0, flag))
        yield Case(row, form, "params", (ids, w, None, None, 2.0, False, flag))
    yield Case(row, form, "keywords", (ids,), {"weight": w, "padding_idx": 1})
    yield Case(row, form, "pending", (ids, w), pending=True)


MHA_WEIGHTS = (T((24, 8), F32), T((24,), F32), T((8, 8), F32), T((8,), F32))


def fused_attention_cases(row, form):
    """query, key, value, embed_dim, num_head, the projections, mask,
    need_weights, average_attn_weights, mask_type (each case's tensors are
    made apart: key and value are not the query, so these are the generic
    path's; tests/test_python_bodies.py holds the rule's own call)."""
    q = T((2, 5, 8), F32)
    yield Case(row, form, "basic", (q, q, q, 8, 2) + MHA_WEIGHTS + (None, False))
    yield Case(row, form, "params", (q, q, q, 8, 2) + MHA_WEIGHTS + (None, True, False))
    yield Case(row, form, "params", (q, q, q, 8, 3) + MHA_WEIGHTS + (None, False))
    yield Case(row, form, "params", (q, q, q, 6, 2) + MHA_WEIGHTS + (None, False))
    yield Case(row, form, "shapes", (T((5, 8), F32),) * 3 + (8, 2) + MHA_WEIGHTS + (None, False))
    yield Case(row, form, "dtypes", (T((2, 5, 8), F64),) * 3 + (8, 2) + MHA_WEIGHTS
               + (None, False))


def attention_cases(row, form):
    """query, key, value, attn_mask, dropout_p, is_causal, scale,
    enable_gqa."""
    q, k, v = T((1, 2, 3, 4), F32), T((1, 2, 5, 4), F32), T((1, 2, 5, 6), F32)
    for d in ALL_DTYPES:
        yield Case(row, form, "dtypes", (T((1, 2, 3, 4), d), T((1, 2, 5, 4), d), T((1, 2, 5, 6), d)))
    for dk in (F64, F16):
        yield Case(row, form, "dtypes", (q, T((1, 2, 5, 4), dk), v))
    for shapes in (((2, 3, 4), (2, 5, 4), (2, 5, 6)), ((3, 4), (5, 4), (5, 6)),
                   ((1, 1, 2, 3, 4), (1, 1, 2, 5, 4), (1, 1, 2, 5, 6)),
                   ((2, 2, 3, 4), (1, 2, 5, 4), (1, 2, 5, 6)),      # broadcast batch
                   ((1, 2, 3, 4), (1, 2, 5, 3), (1, 2, 5, 6)),      # E differs
                   ((1, 2, 3, 4), (1, 2, 5, 4), (1, 2, 4, 6)),      # S differs
                   ((1, 2, 0, 4), (1, 2, 5, 4), (1, 2, 5, 6)), ((1, 2, 3, 4), (1, 2, 0, 4), (1, 2, 0, 6)),
                   ((1, 4, 3, 4), (1, 2, 5, 4), (1, 2, 5, 6)), ((1, 2, 3, 4), (1, 2, 5, 4), (1, 2, 5))):
        yield Case(row, form, "shapes", tuple(T(sh, F32) for sh in shapes))
    for mask in (T((3, 5), BOOL), T((1, 2, 3, 5), F32), T((1, 1, 3, 5), BOOL), T((5,), F32),
                 T((3, 1), BOOL), T((2, 3, 5), F32), T((3, 5), F64), T((3, 5), I64),
                 T((4, 5), BOOL), T((1, 1, 1, 2, 3, 5), BOOL), None, 1.0):
        yield Case(row, form, "params", (q, k, v, mask))
    for dropout_p in (0.0, 0, None, "x"):      # (dropout draws: tests/test_layer_rules.py)
        yield Case(row, form, "params", (q, k, v, None, dropout_p))
    for causal in (False, True, 1, None):
        yield Case(row, form, "params", (q, k, v, None, 0.0, causal))
        yield Case(row, form, "params", (q, T((1, 2, 3, 4), F32), T((1, 2, 3, 6), F32), None, 0.0,
                                         causal))
    yield Case(row, form, "params", (q, k, v, T((3, 5), BOOL), 0.0, True))
    for scale in (None, 0.5, 1.0, -0.0, float("inf"), 2, "x"):
        yield Case(row, form, "params", (q, k, v), {"scale": scale})
    for gqa, heads in ((False, 4), (True, 4), (True, 3), (True, 2), (1, 4)):
        yield Case(row, form, "params", (T((1, heads, 3, 4), F32), k, v), {"enable_gqa": gqa})
    yield Case(row, form, "keywords", (q, k, v), {"attn_mask": T((3, 5), BOOL), "scale": 0.25})
    yield Case(row, form, "keywords", (), {"query": q, "key": k, "value": v})
    yield Case(row, form, "special", (T((1, 2, 3, 4), F32, special=True), k, v))
    yield Case(row, form, "pending", (q, k, v), pending=True)


# View rows and cat (csrc/view_rules.pxi): what the rule takes, and what it leaves
# to the generic path -- keywords, a dtype view, sizes or dims eager
# refuses, the function forms' spread-out sizes (a TypeError in eager).
E03 = T((0, 3), I64)
VIEW_ARGS = {
    "view": [((X34, 12), {}), ((X34, -1, 2), {}), ((X234, 6, 4), {}), ((X34, 5), {}),
             ((X34, (2, 6)), {}), ((X34, [4, -1]), {}), ((X34, torch.Size([12, 1])), {}),
             ((X234, 2, 1, 3, 4), {}), ((X34, -1, -1), {}), ((X34, -2, -6), {}),
             ((X34, 2.0, 6), {}), ((X34, True, 12), {}), ((X34, F64), {}),
             ((E03, 3, 0), {}), ((E03, -1, 0), {}), ((E03, 0, -1), {}),
             ((T((), F64), 1), {}), ((T((), F64), -1), {}), ((T((1,), I64),), {"size": (1,)})],
    "reshape": [((X34, (4, 3)), {}), ((X234, -1), {}), ((E03, (3, 0)), {}),
                ((X34, (5, 2)), {}), ((X34, 2, 6), {}), ((T((), F64), ()), {}),
                ((X234, (4, -1, 3)), {}), ((X34, (2, 2, 3)), {"x": 1})],
    "torch_reshape": [((X34, (4, 3)), {}), ((X234, (-1,)), {}), ((X34, 2, 6), {}),
                      ((X34,), {"shape": (6, 2)}), ((X34, [3, 5]), {})],
    "transpose": [((X34, 0, 1), {}), ((X234, -1, 0), {}), ((X34, 0, 2), {}),
                  ((X234, 1, 1), {}), ((T((), F64), 0, 0), {}), ((T((), F64), 0, -1), {}),
                  ((X34,), {"dim0": 1, "dim1": 0}), ((X34, 0.0, 1), {}), ((X34, True, 0), {})],
    "permute": [((X234, (2, 0, 1)), {}), ((X34, (1, 0)), {}), ((X34, (0, 0)), {}),
                ((X34, 1, 0), {}), ((X234, -1, 0, 1), {}), ((X234, 2, 0), {}),
                ((X234, [0, 1, 3]), {}), ((T((), F64), ()), {})],
    "torch_permute": [((X234, (2, 0, 1)), {}), ((X34, [1, 0]), {}), ((X34, 1, 0), {}),
                      ((X34,), {"dims": (1, 0)})],
    "unsqueeze": [((X34, 0), {}), ((X34, -1), {}), ((T((), F64), 0), {}), ((X34, 3), {}),
                  ((X34, 2), {}), ((X34, -3), {}), ((X34, -4), {}), ((X34,), {"dim": 1})],
    "select": [((X34, 0, 2), {}), ((X234, -1, 3), {}), ((X34, 0, 7), {}), ((X34, 1, -4), {}),
               ((X34, -3, 0), {}), ((T((), F64), 0, 0), {}), ((X34, 0, True), {}),
               ((X34,), {"dim": 1, "index": 0})],
    "narrow": [((X34, 1, 1, 2), {}), ((X34, 0, 2, 5), {}), ((X34, 1, 0, 4), {}),
               ((X34, 1, -2, 2), {}), ((X34, 0, 3, 0), {}), ((X34, 0, -4, 1), {}),
               ((X34, 1, 2, -1), {}), ((X234, 2, 1, 3), {}), ((T((), F64), 0, 0, 1), {})],
    "cat": [(([X34, T((2, 4), F32)],), {}), (([X34, X34], 1), {}),
            (([X34, T((3, 4), F64)],), {"dim": 0}), (([X34, T((3, 5), F32)],), {}),
            (((X34, T((3, 2), I64), T((3, 1), BOOL)),), {"dim": -1}), (([X34],), {}),
            (([X34, T((0,), F32)],), {}), (([T((), F32), T((), F32)],), {}),
            (([X34, X234],), {}), (([X34, X34], 2), {}), (([X34, X34],), {"dim": "a"}),
            (([X34] * 9,), {}), (([T((2, 0), F32), T((2, 3), F32)], 1), {}),
            (([X34, X34], 1.0), {}), ((X34,), {})],
    "chunk": [((T((6, 4), F32), 3), {}), ((T((5, 4), F32), 2, 1), {}), ((X34, 0), {}),
              ((T((7, 4), F32), 3), {}), ((X34, 5, -1), {}), ((X34, 2), {"dim": 1}),
              ((T((0, 4), F32), 2), {}), ((T((), F32), 1), {}), ((X34, -1), {})],
    "split": [((T((6, 4), F32), 2), {}), ((T((5, 4), F32), [2, 3]), {}),
              ((X34, [1, 1]), {}), ((X34, 3, 1), {}), ((X34, (1, 0, 2)), {}),
              ((X34, 1), {"dim": -1}), ((X34, 0), {}), ((X34, -2), {}), ((X34, [4, -1]), {}),
              ((T((0, 4), F32), 2), {}), ((X34, 2.0), {})],
    "contiguous": [((X34,), {}), ((T((), I64),), {}), ((X34,), {"memory_format": torch.contiguous_format})],
    "squeeze": [((T((3, 1, 4), F32),), {}), ((T((3, 1, 4), F32), 1), {}),
                ((T((1, 3, 1), I64), (0, 2)), {}), ((X34, 5), {}), ((X34, 0), {}),
                ((T((1, 1), F32),), {}), ((T((1, 3, 1), F32), [0, 0]), {}),
                ((T((1, 3, 1), F32), -1), {}), ((T((), F64),), {}), ((T((), F64), 0), {}),
                ((T((1, 3), F32), ()), {}), ((X34,), {"dim": 0}), ((X34, 1.0), {})],
    "unflatten": [((X34, 1, (2, 2)), {}), ((X234, -1, (2, -1)), {}), ((X34, 0, [3, 1]), {}),
                  ((X34, 1, (3, 2)), {}), ((X34, 2, (2, 2)), {}), ((X34, 1, ()), {}),
                  ((X34, 1, (-1, -1)), {}), ((E03, 1, (3, 1)), {}), ((E03, 0, (0, -1)), {}),
                  ((X34, 1, torch.Size([4, 1])), {}), ((T((), F64), 0, (1,)), {}),
                  ((X34, 1), {"sizes": (2, 2)})],
    "flatten": [((X234,), {}), ((X234, 1), {}), ((X234,), {"start_dim": 0, "end_dim": 1}),
                ((X234, 3), {}), ((X234, 1, 1), {}), ((X234, -2, -1), {}), ((X234, 2, 1), {}),
                ((X234,), {"end_dim": -2}), ((T((), F64),), {}), ((T((3, 0, 2), F32), 1), {}),
                ((X234, 1.0), {}), ((X234,), {"dim": 0}), ((X234, 0, 1), {"start_dim": 0})],
    "expand": [((T((3, 1), F32), 3, 4), {}), ((T((4,), F32), (2, 4)), {}),
               ((T((3, 2), F32), 3, 4), {}), ((T((3, 1), I64), -1, 0), {}),
               ((T((1, 4), BOOL), (1, 2, -1, 4)), {}), ((T((), F64), 3), {}),
               ((T((3, 1), F32), -1, 2, 2), {}), ((X34,), {"size": (3, 4)}),
               ((T((3, 1), F32), 3, 4), {"implicit": True}), ((X34, 3, 4.0), {})],
}


def view_cases(row, form):
    for args, kwargs in VIEW_ARGS[row.name]:
        if not form.takes_kwargs and kwargs:
            continue
        yield Case(row, form, "view", args, kwargs)
        if isinstance(args[0], T):
            yield Case(row, form, "pending", args, kwargs, pending=True)


def generic_cases(row, form):
    for args, kwargs in GENERIC_ARGS[row.name[len("generic_"):]]:
        if not form.takes_kwargs and kwargs:
            continue
        yield Case(row, form, "generic", args, kwargs)
        if isinstance(args[0], T):
            yield Case(row, form, "pending", args, kwargs, pending=True)


def family(row):
    if row.rule == Rule.R_GENERIC:
        return "generic"
    if Rule.R_VIEW <= row.rule <= Rule.R_RESHAPE_COPY:
        return "view"
    if row.rule == Rule.R_DROPOUT:
        return "dropout"
    if row.rule == Rule.R_LAYER_NORM:
        return "layer_norm"
    if row.rule == Rule.R_BATCH_NORM:
        return "batch_norm"
    if row.rule == Rule.R_CONV2D:
        return "conv2d"
    if row.rule in (Rule.R_MAX_POOL2D, Rule.R_ADAPTIVE_AVG_POOL2D):
        return "pooling"
    if row.rule == Rule.R_EMBEDDING:
        return "embedding"
    if row.rule == Rule.R_SDPA:
        return "attention"
    if row.rule == Rule.R_NATIVE_MHA:
        return "fused_attention"
    if row.rule in MATMUL_RULES:
        return "matmul"
    if row.rule == Rule.R_REDUCE:
        return "reduce"
    if row.rule == Rule.R_SOFTMAX:
        return "softmax"
    if row.rule <= ELEMENTWISE_RULES_MAX or row.rule == Rule.R_RTRUEDIV:
        if row.nrequired >= 2:
            return "binary"
        if any(PARAM_KINDS[p] == "bound" for p in row.params):
            return "clamp"
        return "unary"
    raise LookupError(f"op table row {row.name}: rule {row.rule} has no case generator")


GENERATORS = {"unary": unary_cases, "binary": binary_cases, "clamp": clamp_like_cases,
              "reduce": reduce_cases, "softmax": softmax_cases, "matmul": matmul_cases,
              "layer_norm": layer_norm_cases, "batch_norm": batch_norm_cases,
              "conv2d": conv2d_cases, "pooling": pooling_cases, "embedding": embedding_cases,
              "attention": attention_cases, "fused_attention": fused_attention_cases,
              "dropout": dropout_cases,
              "view": view_cases,
              "generic": generic_cases}


def cases_of(row, form):
    cases = []
    main = form in _main_forms(row)
    for case in GENERATORS[family(row)](row, form):
        if case.group == "range" and not main:
            continue            # which values a rule takes does not depend on the form
        if form.is_operator:
            # operators: positional operands only, as many as the operator takes
            if case.kwargs or len(case.args) != min(len(row.params), 2) \
                    or case.group == "scalar_self":
                continue
        if not form.scalar_self_ok and (not case.args or not isinstance(case.args[0], T)):
            continue            # methods and operators need a tensor self
        if not _has_lazy(case):
            continue
        cases.append(case)
    # The full set for the row's main entry point and its main in-place one;
    # a deterministic sample for the other forms (operators and methods
    # share the main one's rule, aliases share its entry code too).
    keep = 1 if main else 3 if form.primary else 8
    return [c for c in cases if zlib.crc32(c.id.encode()) % keep == 0] or cases[:1]


def _main_forms(row):
    forms = _FORMS[row.name]
    main = next((f for f in forms if f.kind in ("function", "nn_function")), forms[0])
    inplace = next((f for f in forms if f.inplace and not f.is_operator), None)
    return main, inplace


_FORMS = {row.name: forms_of(row) for row in OPS}


def _has_lazy(case):
    keys = [i for i, a in enumerate(case.args) if isinstance(a, T) or
            type(a) in (list, tuple) and any(isinstance(v, T) for v in a)]
    keys += [k for k, v in case.kwargs.items() if isinstance(v, T)]
    if case.lazy is not None:
        keys = [k for k in keys if k in case.lazy]
    return bool(keys)


ALL_CASES = [case for row in OPS for form in _FORMS[row.name] for case in cases_of(row, form)]
# rows some entry point calls; the others (reshape_copy) are recorded by
# another row's rule, and its cases cover them (test_view_rules.py)
ENTERED_ROWS = [row for row in OPS if row.functions or row.methods or row.inplace
                or getattr(row, "nn_functions", ())]


# --------------------------------------------------------------------------
# known core bugs.  Cases a bug's predicate selects are split out into their
# own items, marked xfail(strict=True, raises=KnownBug): such an item must
# fail, and only with failures that match the bug's signature (any other
# failure is reported as a failure, and an item that no longer fails XPASSes,
# which strict xfail reports too).


class KnownBug(Exception):
    """Every failure of an xfail item matched its bug's signature."""


@dataclasses.dataclass(frozen=True)
class Bug:
    name: str
    reason: str
    applies: object          # (case, backend) -> bool
    signature: str           # regex every failure message must match


# Every fastlazy bug this suite found is fixed; its cases now run as ordinary
# cases.  What is left are inductor's own numerics, which torch.compile
# shares (checked against torch.compile when each was found); eager stays
# the oracle, so these cases fail on inductor, in exactly this way.
# A new bug goes here as Bug(name, reason, predicate, signature).
KNOWN_BUGS = (
    Bug("inductor-gelu-inf",
        "eager's vectorized gelu gives nan at +inf (its one-element path gives inf); "
        "inductor and torch.compile give inf",
        lambda case, backend: backend == "inductor" and case.row.name == "gelu"
        and case.group == "special" and _vectorized_gelu_nan_at_inf(),
        r"lazy: +tensor\(\[ +nan, +inf,(.|\n)*eager: +tensor\(\[ +nan, +nan,"),
    Bug("inductor-pow-zerodim-base",
        "a 0-dim float32 base of a float16 tensor: eager rounds it to float16 before pow; "
        "inductor drops that round trip, even when the cast is explicit (torch.compile too)",
        lambda case, backend: backend == "inductor" and case.row.name == "rpow"
        and case.group == "zerodim" and case.id.endswith("f16,T[]f32"),
        r"values differ(.|\n)*Greatest relative difference: 0\.00\d"),
)


@functools.cache
def _vectorized_gelu_nan_at_inf() -> bool:
    """Does this CPU's vectorized gelu give nan at +inf?  It did on the
    machines where the bug was found; ATen's AVX2 kernel on an AMD EPYC
    gives inf, as inductor does, and the item then passes."""
    return bool(torch.nn.functional.gelu(torch.full((64,), float("inf"))).isnan().any())


def _xfail(bug):
    """A known bug's items must fail, and only in the bug's way."""
    return pytest.mark.xfail(strict=True, raises=KnownBug, reason=bug.reason)


def known_bug(case, backend):
    for bug in KNOWN_BUGS:
        if bug.applies(case, backend):
            return bug
    return None


def _params():
    params = []
    for backend_name in BACKENDS:
        groups = {}
        for case in ALL_CASES:
            bug = known_bug(case, backend_name)
            key = f"{case.row.name}|{case.form}|{case.group}"
            if bug is not None:
                key += f"|BUG:{bug.name}"
            groups.setdefault((key, bug), []).append(case)
        for (key, bug), cases in groups.items():
            marks = () if bug is None else _xfail(bug)
            params.append(pytest.param(backend_name, cases, bug, marks=marks,
                                       id=f"{key}|{backend_name}"))
    return params


def run_cases(cases, device="cpu"):
    """The cases' failures, and how many ran (on CUDA some are left out)."""
    failures, ran = [], 0
    for case in cases:
        try:
            ran += case.run(device) is not None
        except Mismatch as exc:
            failures.append((case, str(exc)))
            ran += 1
    return failures, ran


def _report(failures, ncases):
    return (f"{len(failures)} of {ncases} cases differ from eager:\n\n"
            + "\n\n".join(f"{c.id}\n    " + m.replace("\n", "\n    ") for c, m in failures))


@pytest.mark.parametrize("backend, cases, bug", _params(), indirect=["backend"])
def test_op(backend, cases, bug, device):
    check_cases(cases, bug, device)


def check_cases(cases, bug, device="cpu"):
    """Pass if every case matches eager; with a known bug, raise KnownBug if
    every failure is the bug's (strict xfail), fail on any other."""
    failures, ran = run_cases(cases, device)
    if not ran:
        pytest.skip(f"every case raises on the CPU: none runs on {device}")
    if bug is None:
        if failures:
            pytest.fail(_report(failures, len(cases)), pytrace=False)
        return
    unexplained = [(c, m) for c, m in failures if not re.search(bug.signature, m, re.M)]
    if unexplained:
        pytest.fail(f"failures other than known bug {bug.name}: "
                    + _report(unexplained, len(cases)), pytrace=False)
    if failures:
        raise KnownBug(f"{bug.name}: " + _report(failures, len(cases)))
    # no failure at all: the item passes and strict xfail reports the fix


# --------------------------------------------------------------------------
# inductor: every case of the suite costs an inductor compile (0.2-1 s per
# distinct graph), so CI runs a deterministic sample, one case per row beside
# test_every_row_on_inductor's basic call; `--inductor-all` runs every case.


def _inductor_params():
    import sys
    every = "--inductor-all" in sys.argv
    rows, bugs = {}, {}
    for case in ALL_CASES:
        bug = known_bug(case, "inductor")
        if bug is None:
            rows.setdefault(case.row.name, []).append(case)
        else:
            bugs.setdefault(bug, []).append(case)
    if not every:       # the sample: per row, the case whose id hashes lowest
        rows = {name: [min(cases, key=lambda c: zlib.crc32(c.id.encode()))]
                for name, cases in rows.items()}
    return ([pytest.param(cases, None, id=name) for name, cases in rows.items()]
            + [pytest.param(cases, bug, id=f"BUG:{bug.name}", marks=_xfail(bug))
               for bug, cases in bugs.items()])


# The module's `backend` fixture parametrized with inductor alone: one item
# per case, where the fixture's own parameters would make one per backend
# (generated only to skip, 444 items once).
ON_INDUCTOR = pytest.mark.parametrize("backend", ["inductor"], indirect=True)


@ON_INDUCTOR
@pytest.mark.parametrize("cases, bug", _inductor_params())
def test_op_on_inductor(cases, bug):
    check_cases(cases, bug)


# --------------------------------------------------------------------------
# coverage of the table


def test_every_row_and_entry_point_is_covered():
    """Adding a row or an entry point without cases fails here."""
    covered = {}
    for case in ALL_CASES:
        covered.setdefault(case.row.name, set()).add((case.form.kind, case.form.name))
    for row in ENTERED_ROWS:
        assert row.name in covered, f"op table row {row.name!r} has no differential case"
        names = {n for _, n in covered[row.name]}
        for name in (row.functions + row.methods + row.inplace
                     + tuple(getattr(row, "nn_functions", ()))):
            assert name in names, f"{row.name}: entry point {name} has no case"
    # and every row has cases that are not known bugs
    clean = {c.row.name for c in ALL_CASES if known_bug(c, "torchscript") is None}
    assert clean >= {row.name for row in ENTERED_ROWS}


def test_every_parameter_has_a_domain():
    for row in OPS:
        family(row)
        for name in row.params:
            assert name in PARAM_KINDS, f"{row.name}: no values known for parameter {name!r}"


def _basic_call(row):
    """The simplest call of a row, from its rule family: float32 operands."""
    fam = family(row)
    form = forms_of(row)[0]
    if fam == "generic":
        # pending inputs: an op that returns its input (x.contiguous()) returns
        # a pending node too, and a fallback would have run it
        args, kwargs = GENERIC_ARGS[row.name[len("generic_"):]][0]
        return Case(row, form, "basic", args, kwargs, pending=True)
    if fam == "matmul":
        args = tuple(T(s, F32) for s in MATMUL_SHAPES[row.rule][0] if s is not None)
        return Case(row, form, "basic", args)
    if fam == "binary":
        return Case(row, form, "basic", (T((3, 4), F32), _tensor(row, 1, (4,), F32)))
    if fam == "clamp":
        return Case(row, form, "basic", (T((3, 4), F32), -0.5))
    if fam == "softmax":
        return Case(row, form, "basic", (T((3, 4), F32), 1))
    if fam == "layer_norm":
        return Case(row, form, "basic", (T((3, 4), F32), (4,), T((4,), F32), T((4,), F32)))
    if fam == "batch_norm":
        return Case(row, form, "basic", (IMG,) + (T((3,), F32),) * 4)
    if fam == "conv2d":
        return Case(row, form, "basic", (IMG, KERNEL, T((4,), F32), 1, 1))
    if fam == "pooling":
        return Case(row, form, "basic", (IMG, 2))
    if fam == "embedding":
        return Case(row, form, "basic", (T((2, 3), I64, index=10), T((10, 4), F32)))
    if fam == "attention":
        return Case(row, form, "basic", (T((1, 2, 3, 4), F32),) * 3)
    if fam == "fused_attention":
        q = T((2, 5, 8), F32)
        return Case(row, form, "basic", (q, q, q, 8, 2) + MHA_WEIGHTS + (None, False))
    if fam == "view":
        args, kwargs = VIEW_ARGS[row.name][0]
        return Case(row, form, "basic", args, kwargs, pending=True)
    if fam == "dropout":    # in eval it is its (pending) input: nothing runs eagerly
        return Case(row, form, "basic", (T((3, 4), F32), 0.5, False), pending=True)
    return Case(row, form, "basic", (T((3, 4), F32),))


@pytest.mark.parametrize("row", ENTERED_ROWS, ids=lambda r: r.name)
def test_every_row_records(row, device):
    """The op is recorded (a pending node, no flush), not run eagerly, and
    agrees with eager -- and the backend compiles its graph: a lowering
    the backend refuses falls back to the eager replay, whose values are
    right, so only the count of compile failures shows it."""
    case = _basic_call(row)
    before = fastlazy.metrics.counters()
    outcome = case.run(device)
    after = fastlazy.metrics.counters()
    assert outcome is not None and outcome.exception is None
    assert outcome.recorded, f"{case.id} was run eagerly, not recorded"
    assert after["flushes"] == before["flushes"] + 1   # the one read
    assert after["compile_failures"] == before["compile_failures"], \
        f"{case.id}: the backend did not compile its graph"


@ON_INDUCTOR
@pytest.mark.parametrize("row", ENTERED_ROWS, ids=lambda r: r.name)
def test_every_row_on_inductor(row):
    """The inductor backend compiles every row (its kernels take seconds to
    build, so one basic call per row rather than the whole suite)."""
    failures = fastlazy.metrics.counters()["compile_failures"]
    outcome = _basic_call(row).run()
    assert outcome.exception is None and outcome.recorded
    assert fastlazy.metrics.counters()["compile_failures"] == failures


# --------------------------------------------------------------------------
# integer division by zero: eager raises at the call, fastlazy at the read


def _rounding_division_forms():
    for row in OPS:
        modes = [m for m in (_choice_values(row, "rounding_mode") or ()) if m is not None]
        for form in forms_of(row):
            if form.takes_kwargs:
                for mode in modes:
                    yield pytest.param(row, form, mode, id=f"{form}-{mode}")


@pytest.mark.parametrize("row, form, mode", list(_rounding_division_forms()))
@pytest.mark.parametrize("divisor", ["tensor", "scalar"])
def test_integer_division_by_zero_raises_when_read(row, form, mode, divisor):
    before_base = torch.arange(4.0)
    before = fastlazy.lazy(before_base.clone()) * 2            # pending, made before
    x = fastlazy.lazy(torch.tensor([5, -7, 3, 1]))
    y = fastlazy.lazy(torch.tensor([2, 0, 1, 3])) if divisor == "tensor" else 0
    with pytest.raises(RuntimeError):
        form(torch.tensor([5, -7, 3, 1]), torch.tensor([2, 0, 1, 3]) if divisor == "tensor"
             else 0, rounding_mode=mode)                        # eager: at the call
    r = form(x, y, rounding_mode=mode)                          # lazy: recorded
    assert type(r) is fastlazy.LazyTensor and r.dtype == torch.int64 and r.shape == (4,)
    after = (fastlazy.lazy(torch.tensor([5, -7, 3, 1])) if form.inplace else x) + 1
    with pytest.raises(RuntimeError):
        r.to_eager()
    with pytest.raises(RuntimeError):
        r.to_eager()                                            # and again
    assert_same(before.to_eager(), before_base * 2, "a LazyTensor made before")
    assert_same(after.to_eager(), torch.tensor([6, -6, 4, 2]), "a LazyTensor made after")
    if not form.inplace:
        assert_same(x.to_eager(), torch.tensor([5, -7, 3, 1]), "the dividend")
    # recording goes on
    assert_same((fastlazy.lazy(torch.tensor([1, 2])) * 3).to_eager(), torch.tensor([3, 6]))


def test_out_argument_never_mutates_a_lazy_source():
    source = torch.zeros(3)
    out = fastlazy.lazy(source)
    r = torch.add(fastlazy.lazy(torch.ones(3)), 1, out=out)
    assert_same(r, torch.full((3,), 2.0))
    assert_same(out, torch.full((3,), 2.0), "out= after the call")
    assert torch.equal(source, torch.zeros(3)), "the tensor given to fastlazy.lazy() changed"


# --------------------------------------------------------------------------
# a value is computed once; scalar values are graph inputs


def test_second_read_does_not_recompute():
    base = torch.randn(3, 4)
    r = (fastlazy.lazy(base.clone()) + 1) * 2
    first = r.to_eager()
    c = fastlazy.metrics.counters()
    assert r.to_eager() is first
    assert r.to_eager() is r.to_eager()
    repr(r), r.tolist(), r.numpy()
    after = fastlazy.metrics.counters()
    assert after["flushes"] == c["flushes"]
    assert after["cache_hits"] + after["cache_misses"] == c["cache_hits"] + c["cache_misses"]
    assert_same(first, (base + 1) * 2)


def _scalar_program(row, device="cpu"):
    """(input shape, program(x, s)) for one row, taking a Python float: the
    scalar goes into the op where the row takes one, else through a mul
    before it.  Its other tensors are on `device`."""
    fam = family(row)
    form = forms_of(row)[0]
    if fam == "generic":
        # the scalar enters through a mul before the op; a list's first tensor
        # (into the first float tensor argument; the first result)
        args, kwargs = GENERIC_ARGS[row.name[len("generic_"):]][0]
        built = [make_value(a, device) for a in args]
        if isinstance(args[0], T):
            tensors = [k for k, a in enumerate(args) if isinstance(a, T)]
            i = next((k for k in tensors if args[k].dtype.is_floating_point), tensors[0])

            def program(x, s):
                out = form(*built[:i], x * s, *built[i + 1:], **kwargs)
                return out[0] if isinstance(out, (tuple, list)) else out
            return args[i].shape, program
        return args[0][0].shape, lambda x, s: form([x * s, *built[0][1:]], *built[1:], **kwargs)
    if fam in ("binary", "clamp") and not row.flags & OpFlag.OPF_TENSORS_ONLY:
        return (3, 4), lambda x, s: form(x, s)
    if fam == "binary":
        return (3, 4), lambda x, s: form(x * s, x)
    if fam == "softmax":
        return (3, 4), lambda x, s: form(x * s, 1)
    if fam == "dropout":               # eval: the input itself, here x * s
        return (3, 4), lambda x, s: form(x * s, 0.1, False)
    if fam == "layer_norm":            # eps is the row's own Python number
        return (3, 4), lambda x, s: form(x, (4,), None, None, abs(s) * 1e-3)
    if fam == "batch_norm":            # so is batch_norm's
        stats = [torch.rand(4).to(device) + 0.5 for _ in range(2)]
        return (3, 4), lambda x, s: form(x, *stats, None, None, False, 0.1, abs(s) * 1e-3)
    if fam == "conv2d":
        weight = torch.rand(4, 3, 3, 3).to(device)
        return (2, 3, 6, 6), lambda x, s: form(x * s, weight, None, 1, 1)
    if fam == "pooling":
        return (2, 3, 6, 6), lambda x, s: form(x * s, 2)
    if fam == "attention":
        kv = torch.rand(1, 2, 5, 4).to(device)
        return (1, 2, 3, 4), lambda x, s: form(x * s, kv, kv)
    if fam == "fused_attention":         # self-attention: the rule's own call
        weights = [make_value(w, device) for w in MHA_WEIGHTS]

        def program(x, s):
            y = x * s
            return form(y, y, y, 8, 2, *weights, None, False)[0]
        return (2, 5, 8), program
    if fam == "embedding":             # the scalar scales the weight
        ids = torch.tensor([[1, 2], [0, 3]]).to(device)
        return (4, 3), lambda x, s: form(ids, x * s)
    if fam == "matmul":
        shapes = [shape for shape in MATMUL_SHAPES[row.rule][0] if shape is not None]
        others = [torch.rand(shape).to(device) for shape in shapes[1:]]
        return shapes[0], lambda x, s: form(x * s, *others)
    if fam == "view":
        args, kwargs = VIEW_ARGS[row.name][0]
        if isinstance(args[0], list):            # cat: the scalar scales the first tensor
            rest = [make_value(a, device) for a in args[0][1:]]
            return args[0][0].shape, lambda x, s: form([x * s, *rest], *args[1:], **kwargs)

        def program(x, s):
            out = form(x * s, *args[1:], **kwargs)
            return out[0] if isinstance(out, tuple) else out      # split: its first piece
        return args[0].shape, program
    return (3, 4), lambda x, s: form(x * s)


@pytest.mark.parametrize("row", ENTERED_ROWS, ids=lambda r: r.name)
def test_new_scalar_value_hits_the_cache(row, device):
    shape, program = _scalar_program(row, device)
    base = (torch.rand(shape) + 0.5).to(device)
    program(fastlazy.lazy(base.clone()), 1.5).to_eager()        # compiles
    for s in (2.5, -0.75):
        before = fastlazy.metrics.counters()
        r = program(fastlazy.lazy(base.clone()), s)
        value = r.to_eager()
        after = fastlazy.metrics.counters()
        assert after["cache_misses"] == before["cache_misses"], f"scalar {s} recompiled"
        assert after["cache_hits"] == before["cache_hits"] + 1
        with fastlazy_disabled():
            expected = program(base.clone(), s)
        assert_same(value, expected)


# --------------------------------------------------------------------------
# random programs: chains of ops from the table, lazily vs eagerly


CHAIN_DTYPES = (F32, F64, I64, BOOL, I32, U8, BF16, C64)
CHAIN_SHAPES = ((), (3,), (2, 3), (0, 3), (1, 3), (2, 1, 3))
CHAIN_SCALARS = (True, 2, -3, 0.5, -1.25, 1 + 1j)
# (generic rows have programs of their own: tests/test_view_fuzz.py, OpInfo)
CHAIN_FORMS = [(row, form) for row in OPS for form in forms_of(row) if row.rule != Rule.R_GENERIC]


def _draw_step(data, row, form, shape, dtype):
    """Operands for one step applied to a value of `shape`/`dtype` (operand
    0); others are scalars, the chain's inputs or values of fitting shape."""
    fam = family(row)
    other_kinds = st.sampled_from(["scalar", "input", "fresh", "previous"])
    pick_int = data.draw(st.integers(-3, 3), label="dim")
    if fam == "unary":
        kwargs = {}
        for name in row.params[1:] if form.takes_kwargs else ():
            if data.draw(st.booleans(), label=f"give {name}"):
                if PARAM_KINDS[name] == "flag":
                    kwargs[name] = data.draw(st.booleans(), label=name)
                elif PARAM_KINDS[name] == "number":
                    kwargs[name] = data.draw(st.sampled_from([0.1, 0.0, 2]), label=name)
                elif PARAM_KINDS[name] == "choice":
                    kwargs[name] = data.draw(st.sampled_from(
                        [v for v in _choice_values(row, name) if v is not None] or [None]))
        return ("self",), kwargs
    if fam == "reduce":
        kwargs = {}
        if form.takes_kwargs and data.draw(st.booleans(), label="give dim"):
            kwargs[row.params[1]] = pick_int
            if data.draw(st.booleans(), label="keepdim"):
                kwargs[row.params[2]] = True
        return ("self",), kwargs
    if fam == "softmax":
        return ("self", pick_int), {}
    if fam == "dropout":
        return ("self", 0.25, False), {}
    if fam == "clamp":
        lo = data.draw(st.sampled_from([None, -1, 0.5, "input"]), label="min")
        hi = data.draw(st.sampled_from([None, 2, 1.5]), label="max")
        return ("self", lo, hi), {}
    if fam == "view":
        spread = not row.flags & OpFlag.OPF_SIZE_SEQUENCE
        if row.rule == Rule.R_VIEW:
            sizes = data.draw(st.sampled_from([(-1,), tuple(reversed(shape)), (1, -1)]),
                              label="sizes")
            return (("self", *sizes) if spread else ("self", sizes)), {}
        if row.rule == Rule.R_PERMUTE:
            dims = tuple(reversed(range(len(shape))))
            return (("self", *dims) if spread else ("self", dims)), {}
        if row.rule == Rule.R_TRANSPOSE:
            return ("self", pick_int, data.draw(st.integers(-2, 1), label="dim1")), {}
        if row.rule == Rule.R_UNSQUEEZE:
            return ("self", pick_int), {}
        if row.rule == Rule.R_SELECT:
            return ("self", pick_int, data.draw(st.integers(-1, 1), label="index")), {}
        if row.rule == Rule.R_SLICE:
            return ("self", pick_int, 0, 1), {}
        return ("self",), {}          # contiguous; cat of a bare tensor (eager's TypeError)
    if fam == "matmul":
        k = shape[-1] if shape else 1
        other = ("fresh", (k, 2), dtype)
        ops = ("self", other)
        if row.rule == Rule.R_LINEAR:
            ops = ("self", ("fresh", (2, k), dtype), ("fresh", (2,), dtype))
        return ops, {}
    kind = data.draw(other_kinds, label="other kind")
    if kind == "scalar":
        other = data.draw(st.sampled_from(CHAIN_SCALARS), label="scalar")
    elif kind == "input":
        other = "input"
    elif kind == "previous":
        other = "previous"
    else:
        oshape = data.draw(st.sampled_from([shape, shape[-1:], (), (1,)]), label="shape")
        odtype = data.draw(st.sampled_from(CHAIN_DTYPES), label="dtype")
        other = ("fresh", tuple(oshape), odtype)
    kwargs = {}
    if row.rule == Rule.R_DIV and form.takes_kwargs:
        kwargs["rounding_mode"] = data.draw(st.sampled_from(_choice_values(row, "rounding_mode")))
    return ("self", other), kwargs


def _resolve(spec, current, inputs, previous, lazy_side):
    if isinstance(spec, tuple) and spec and spec[0] == "fresh":
        return fastlazy.lazy(spec[1]) if lazy_side else spec[1].clone()
    if spec == "self":
        return current
    if spec == "input":
        return inputs
    if spec == "previous":
        return previous
    return spec


def _category(dtype):
    from fastlazy.optable import BOOL as C_BOOL, FLOAT as C_FLOAT, INT as C_INT
    if dtype == BOOL:
        return C_BOOL
    if dtype.is_complex:
        return COMPLEX
    return C_FLOAT if dtype.is_floating_point else C_INT


_N_EXAMPLES = 100 if settings.default.max_examples <= 150 else settings.default.max_examples


_CHAIN_SETTINGS = settings(
    max_examples=_N_EXAMPLES, deadline=None, derandomize=_N_EXAMPLES == 100,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                           HealthCheck.filter_too_much])


def test_random_programs(device):
    @fuzz_settings(device, _CHAIN_SETTINGS)
    @given(data=st.data())
    def random_program(data):
        _random_program(data, device)
    random_program()


def _random_program(data, device):
    shape = data.draw(st.sampled_from(CHAIN_SHAPES), label="shape")
    dtype = data.draw(st.sampled_from(CHAIN_DTYPES), label="dtype")
    seed(repr((shape, dtype)))
    source = T(shape, dtype).make().to(device)
    given = source.clone()
    eager_vals, lazy_vals = [source.clone()], [fastlazy.lazy(given)]
    input_e, input_l = eager_vals[0], lazy_vals[0]
    nsteps = data.draw(st.integers(1, 8), label="steps")
    steps = []
    for _ in range(nsteps):
        cur_e = eager_vals[-1]
        # mostly ops that take the current dtype; now and then any op (its error path)
        pool = CHAIN_FORMS if data.draw(st.integers(0, 9), label="any op") == 0 else [
            (r, f) for r, f in CHAIN_FORMS if r.cats & _category(cur_e.dtype)]
        row, form = data.draw(st.sampled_from(pool), label="op")
        ops, kwargs = _draw_step(data, row, form, tuple(cur_e.shape), cur_e.dtype)
        # materialize fresh operands, one tensor per spec for both sides
        built = []
        for spec in ops:
            if isinstance(spec, tuple) and spec and spec[0] == "fresh":
                seed(repr(spec) + str(len(steps)))
                spec = ("fresh", T(spec[1], spec[2],
                                   nonzero=row.rule == Rule.R_DIV).make().to(device))
            built.append(spec)
        prev_index = data.draw(st.integers(0, len(eager_vals) - 1), label="previous")
        args_e = [_resolve(s, cur_e, input_e, eager_vals[prev_index], False) for s in built]
        args_l = [_resolve(s, lazy_vals[-1], input_l, lazy_vals[prev_index], True)
                  for s in built]
        # steps that hit a known bug are not this test's business
        spec_case = Case(row, form, "chain", tuple(
            T(tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a for a in args_e),
            dict(kwargs))
        assume(known_bug(spec_case, fastlazy.backend()) is None)
        if device != "cpu" and raises_on_cpu(form, *args_e, **kwargs):
            event("ends before a step that raises on the CPU (not run on CUDA)")
            break
        steps.append(spec_case.id)
        try:
            out_e = form(*args_e, **kwargs)
            exc_e = None
        except Exception as exc:   # noqa: BLE001
            out_e, exc_e = None, exc
        try:
            out_l = form(*args_l, **kwargs)
            exc_l = None
        except Exception as exc:   # noqa: BLE001
            out_l, exc_l = None, exc
        where = "\n".join(steps)
        if exc_e is not None and "ZeroDivisionError" in str(exc_e):
            # eager raises at the call; fastlazy when the value is read
            if exc_l is None:
                with pytest.raises(RuntimeError):
                    out_l.to_eager()
            break
        if exc_e is not None or exc_l is not None:
            assert type(exc_e) is type(exc_l), (
                f"program:\n{where}\neager: {exc_e!r}\nlazy: {exc_l!r}")
            event(f"ends raising {type(exc_e).__name__}: {str(exc_e)[:50]}")
            break
        if not isinstance(out_e, torch.Tensor):
            assert out_e == out_l, f"program:\n{where}"
            break
        assert type(out_l) is fastlazy.LazyTensor or out_l is args_l[0], where
        assert tuple(out_l.shape) == tuple(out_e.shape) and out_l.dtype == out_e.dtype, (
            f"program:\n{where}\nlazy {out_l.dtype}{tuple(out_l.shape)}, "
            f"eager {out_e.dtype}{tuple(out_e.shape)}")
        eager_vals.append(out_e)
        lazy_vals.append(out_l)
    event(f"{len(eager_vals) - 1} ops ran")
    # every value of the program (in-place steps included) agrees at the end
    for k, (e, lz) in enumerate(zip(eager_vals, lazy_vals)):
        try:
            assert_same(lz, e, f"value {k}")
        except Mismatch as exc:
            raise AssertionError("program:\n" + "\n".join(steps) + f"\n{exc}") from None
    assert torch.equal(given.nan_to_num(), source.nan_to_num()), "fastlazy.lazy()'s tensor mutated"
