"""Differential fuzzing: random programs (DAGs over every recorded op), run
lazily and eagerly, must agree -- same values (NaN-aware), dtypes and shapes,
or the same exception type at the same op.

Programs draw shapes with 0-dim, size-1 and empty dims that broadcast, every
supported dtype, Python scalars (inf, nan, -0.0, negative), mixed eager and
lazy operands, in-place ops, and views with mutation through them.

Each runs on the CPU and on CUDA (fewer examples: helpers.fuzz_settings),
against eager on the same device; on CUDA a program whose eager run raises
on the CPU is left out (helpers.raises_on_cpu).

`pytest tests/test_fuzz.py --fuzz-long` runs the long profile.
"""
import math
import operator

import pytest
import torch
from hypothesis import assume, given, strategies as st

import fastlazy
from fastlazy._core import Rule
from fastlazy.optable import OPS

from helpers import fuzz_settings

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
          torch.int32, torch.uint8, torch.bool]
SCALARS = [0, 1, -2, 3, 2.5, -0.0, 0.5, float("inf"), float("-inf"), float("nan"),
           True, False, 1e-3]
ELEMENTWISE = [op for op in OPS if op.rule < Rule.R_REDUCE]
# ops whose eager errors depend on values (integer division by zero): eager
# raises at the call, fastlazy when the value is read
VALUE_ERRORS = ("ZeroDivisionError",)


@st.composite
def tensors(draw, target):
    ndim = draw(st.integers(0, len(target)))
    shape = [s if draw(st.booleans()) else 1 for s in target[len(target) - ndim:]]
    dtype = draw(st.sampled_from(DTYPES))
    n = math.prod(shape)
    if dtype == torch.bool:
        values = torch.tensor(draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=dtype)
    elif dtype.is_floating_point:
        pool = st.sampled_from([0.0, -0.0, 1.0, -1.5, 2.0, 0.25, 3.0, float("inf"),
                                float("-inf"), float("nan"), 1e-3, -7.0])
        values = torch.tensor(draw(st.lists(pool, min_size=n, max_size=n)),
                              dtype=torch.float64).to(dtype)
    else:
        lo = 0 if dtype == torch.uint8 else -5
        values = torch.tensor(draw(st.lists(st.integers(lo, 9), min_size=n, max_size=n)),
                              dtype=dtype)
    return values.reshape(shape), draw(st.booleans())     # (value, make it lazy)


@st.composite
def programs(draw):
    target = draw(st.lists(st.sampled_from([0, 1, 2, 3]), min_size=0, max_size=3))
    inputs = draw(st.lists(tensors(target), min_size=1, max_size=3))
    steps = []
    for k in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(["op", "op", "op", "inplace", "view", "reduce"]))
        pool_size = len(inputs) + k
        a = draw(st.integers(0, pool_size - 1))
        b = draw(st.one_of(st.integers(0, pool_size - 1), st.sampled_from(SCALARS)))
        c = draw(st.one_of(st.none(), st.sampled_from(SCALARS)))
        op = draw(st.sampled_from(ELEMENTWISE))
        steps.append((kind, op.name, a, b, c, draw(st.integers(-2, 1))))
    return inputs, steps


def _operand(pool, x):
    return pool[x] if type(x) is int and not isinstance(x, bool) else x


def _apply(step, pool):
    kind, name, a, b, c, dim = step
    op = next(o for o in OPS if o.name == name)
    x = pool[a]
    y = _operand(pool, b)
    if kind == "view":
        v = x.view(-1) if x.dim() else x
        if v.numel():
            v[0:1].add_(1) if x.dtype != torch.bool else v[0:1].logical_not_()
        return x
    if kind == "reduce":
        return torch.sum(x, dim=dim) if x.dim() else torch.sum(x)
    if kind == "inplace" and op.inplace:
        method = op.inplace[0]
        args = [y] if op.nrequired >= 2 else []
        return getattr(x, method)(*args) if method.endswith("_") else \
            getattr(operator, method.strip("_"))(x, *args)
    if op.functions:
        fn = getattr(torch, op.functions[0])
    elif op.methods:
        fn = getattr(type(x), op.methods[0])
    else:
        fn = getattr(torch.nn.functional, op.nn_functions[0])
    if op.nrequired >= 2:
        args = [x, y]
    elif len(op.params) > 1 and op.params[1] in ("min", "negative_slope") and c is not None:
        args = [x, c]
    else:
        args = [x]
    return fn(*args)


def run(inputs, steps, lazy, device="cpu"):
    pool = [fastlazy.lazy(v.to(device, copy=True)) if lazy and make_lazy
            else v.to(device, copy=True) for v, make_lazy in inputs]
    for k, step in enumerate(steps):
        try:
            out = _apply(step, pool)
        except Exception as exc:
            return pool, (k, exc)
        pool.append(out if isinstance(out, (torch.Tensor, fastlazy.LazyTensor)) else pool[0])
    return pool, None


def _value(x):
    return x.to_eager() if isinstance(x, fastlazy.LazyTensor) else x


def comparable(inputs, steps, device):
    """Has the program an eager outcome to compare on `device`?  On CUDA
    only where eager runs it through on the CPU (helpers.raises_on_cpu)."""
    return device == "cpu" or run(inputs, steps, lazy=False)[1] is None


def check(inputs, steps, device="cpu"):
    want, want_err = run(inputs, steps, lazy=False, device=device)
    got, got_err = run(inputs, steps, lazy=True, device=device)
    if want_err is not None and any(m in str(want_err[1]) for m in VALUE_ERRORS):
        with pytest.raises(RuntimeError):        # surfaces when read
            for g in got:
                _value(g)
        return
    if want_err is not None or got_err is not None:
        assert want_err is not None and got_err is not None, (want_err, got_err)
        assert want_err[0] == got_err[0], (want_err, got_err)
        assert type(want_err[1]) is type(got_err[1]), (want_err, got_err)
        want, got = want[: len(inputs)], got[: len(inputs)]
    for w, g in zip(want, got):
        g = _value(g)
        assert g.dtype == w.dtype and g.shape == w.shape
        if w.dtype in (torch.float16, torch.bfloat16):
            torch.testing.assert_close(g, w, equal_nan=True, rtol=1e-2, atol=1e-2)
        else:
            torch.testing.assert_close(g, w, equal_nan=True, rtol=1e-6, atol=1e-7)


def test_random_programs(backend, lazy_on, device):
    @fuzz_settings(device)
    @given(program=programs())
    def random_program(program):
        assume(comparable(*program, device))
        check(*program, device)
    random_program()


REGRESSIONS = [
    # every failure the fuzzer found, as (inputs, steps)
    # a write through a view of x after a pending node read x
    ([(torch.tensor([0.]), True)],
     [("op", "add", 0, 0, None, 0), ("view", "add", 0, 0, None, 0)]),
    # an eager input written in place after a pending node read it
    ([(torch.tensor(0.), False), (torch.tensor(0.), True)],
     [("op", "add", 0, 1, None, 0), ("inplace", "add", 0, 0, None, 0)]),
    # ... through a view and a method without an op-table row
    ([(torch.tensor([False]), False), (torch.tensor(0.), True)],
     [("op", "add", 0, 1, None, 0), ("view", "add", 0, 0, None, 0)]),
    # sum of a 0-dim bool: TorchScript kept bool where eager gives int64
    ([(torch.tensor(False), True)],
     [("reduce", "lt", 0, 0, 2.5, -2), ("op", "rpow", 0, 1, 2.5, 1)]),
]


@pytest.mark.parametrize("case", REGRESSIONS)
def test_fuzz_regressions(case, lazy_on, device):
    assert comparable(*case, device)
    check(*case, device)
