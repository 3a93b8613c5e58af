"""Bad calls: eager's exception type at the call, nothing recorded, every
LazyTensor made before still correct -- on every backend in
helpers.BACKENDS, with materialized and with pending (recorded, not yet
computed) lazy arguments.

`check()` (helpers.py) runs each call eagerly and lazily; here every call
must be one eager rejects, and with materialized arguments the failed lazy
call must leave the pending node count exactly as it was (no flush, no
node).  Known core bugs are marked xfail(strict=True).
"""
from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F

import fastlazy
from fastlazy import _core
from fastlazy._core import Rule
from fastlazy.optable import OPS

from helpers import fastlazy_enabled  # noqa: F401  (fixture: enable() for the module)
from helpers import (BOOL, C64, F16, F32, F64, I64, U8, T, assert_same, check,
                     fastlazy_disabled, forms_of, seed)

# every test runs once per backend in helpers.BACKENDS (conftest's backend fixture)
pytestmark = pytest.mark.usefixtures("backend")


def t(shape, dtype=F32):
    return T(tuple(shape), dtype)


class Bad:
    """A call eager rejects: fn(*args, **kwargs) with T specs for tensors."""

    def __init__(self, label, fn, *args, lazy=None, inplace=False, **kwargs):
        self.label, self.fn, self.args, self.kwargs = label, fn, args, kwargs
        self.lazy, self.inplace = lazy, inplace

    def build(self):
        seed(self.label)
        return ([a.make() if isinstance(a, T) else a for a in self.args],
                {k: v.make() if isinstance(v, T) else v for k, v in self.kwargs.items()})

    def eager_rejects(self):
        args, kwargs = self.build()
        try:
            self.fn(*args, **kwargs)
        except Exception:   # noqa: BLE001
            return True
        return False


def run_bad(case, pending):
    args, kwargs = case.build()
    out = check(case.fn, *args, lazy=case.lazy, returns_self=case.inplace, pending=pending,
                **kwargs)
    assert out.exception is not None, f"{case.label}: eager accepts this call"
    # nothing recorded (check() asserts the count did not grow); with
    # materialized arguments nothing is flushed either: the buffer is exactly
    # as before.  (In-place calls are exempt: a rejected in-place call
    # flushes -- test_rejected_inplace_call_does_not_flush.)
    if not pending and not case.inplace:
        assert out.nodes_after == out.nodes_before, (
            f"{case.label}: pending nodes {out.nodes_before} -> {out.nodes_after}")
    return out


# --------------------------------------------------------------------------
# hand-written bad calls, one per kind of mistake


i, f, b, c = t((3,), I64), t((3,)), t((3,), BOOL), t((3,), C64)
x23, y4 = t((2, 3)), t((4,))

CASES = [
    # shapes that do not broadcast
    Bad("x + y, (2,3) with (4,)", lambda x, y: x + y, x23, y4),
    Bad("torch.mul((2,3), (3,2))", lambda x, y: torch.mul(x, y), x23, t((3, 2))),
    Bad("x < y, (2,3) with (4,)", lambda x, y: x < y, x23, y4),
    Bad("torch.clamp(x, min=(4,))", lambda x, y: torch.clamp(x, min=y), x23, y4),
    Bad("torch.maximum((2,3), (4,))", lambda x, y: torch.maximum(x, y), x23, y4),
    Bad("eager (2,3) + lazy (4,)", lambda x, y: x + y, x23, y4, lazy={1}),
    # maximum/minimum take tensors only
    Bad("torch.maximum(x, 2)", lambda x: torch.maximum(x, 2), f),
    Bad("torch.minimum(x, 2.5)", lambda x: torch.minimum(x, 2.5), f),
    Bad("x.maximum(True)", lambda x: x.maximum(True), f),
    # subtraction of bools
    Bad("b - b", lambda x, y: x - y, b, b),
    Bad("torch.sub(b, b)", lambda x, y: torch.sub(x, y), b, b),
    Bad("b.subtract(b)", lambda x, y: x.subtract(y), b, b),
    Bad("b - True", lambda x: x - True, b),
    Bad("True - b", lambda x: True - x, b),
    Bad("torch.rsub(b, b)", lambda x, y: torch.rsub(x, y), b, b),
    Bad("b.sub_(b)", lambda x, y: x.sub_(y), b, b, inplace=True),
    # alpha
    Bad("i.add(i, alpha=0.5)", lambda x, y: x.add(y, alpha=0.5), i, i),
    Bad("torch.sub(i, i, alpha=1.5)", lambda x, y: torch.sub(x, y, alpha=1.5), i, i),
    Bad("f.add(f, alpha=1j)", lambda x, y: x.add(y, alpha=1j), f, f),
    Bad("f.add(f, alpha=True)", lambda x, y: x.add(y, alpha=True), f, f),
    Bad("f.add(f, alpha=tensor)", lambda x, y: x.add(y, alpha=y), f, f),
    Bad("i.add_(i, alpha=0.5)", lambda x, y: x.add_(y, alpha=0.5), i, i, inplace=True),
    Bad("torch.add(f, f, 2) (alpha is keyword-only)", lambda x, y: torch.add(x, y, 2), f, f),
    # rounding_mode
    Bad("div rounding_mode='bad'", lambda x, y: x.div(y, rounding_mode="bad"), f, f),
    Bad("div rounding_mode='FLOOR'", lambda x, y: torch.div(x, y, rounding_mode="FLOOR"), f, f),
    Bad("div rounding_mode=''", lambda x, y: torch.div(x, y, rounding_mode=""), i, i),
    Bad("div rounding_mode=1", lambda x, y: torch.div(x, y, rounding_mode=1), f, f),
    Bad("div(x, y, 'floor') (keyword-only)", lambda x, y: torch.div(x, y, "floor"), f, f),
    Bad("c.div(c, rounding_mode='floor')", lambda x, y: x.div(y, rounding_mode="floor"), c, c),
    Bad("div_ rounding_mode='bad'", lambda x, y: x.div_(y, rounding_mode="bad"), f, f,
        inplace=True),
    # in-place: the result cannot be cast to self's dtype
    Bad("i.add_(1.5)", lambda x: x.add_(1.5), i, inplace=True),
    Bad("i += 1.5", lambda x: x.__iadd__(1.5), i, inplace=True),
    Bad("i.div_(2)", lambda x: x.div_(2), i, inplace=True),
    Bad("i /= i", lambda x, y: x.__itruediv__(y), i, i, inplace=True),
    Bad("i.exp_()", lambda x: x.exp_(), i, inplace=True),
    Bad("b.sqrt_()", lambda x: x.sqrt_(), b, inplace=True),
    Bad("b.add_(1)", lambda x: x.add_(1), b, inplace=True),
    Bad("f.add_(1j)", lambda x: x.add_(1j), f, inplace=True),
    Bad("i.mul_(f)", lambda x, y: x.mul_(y), i, f, inplace=True),
    Bad("u8.sub_(-1.5)", lambda x: x.sub_(-1.5), t((3,), U8), inplace=True),
    Bad("i.clamp_(0.5)", lambda x: x.clamp_(0.5), i, inplace=True),
    Bad("i.pow_(0.5)", lambda x: x.pow_(0.5), i, inplace=True),
    Bad("f16.mul_(c)", lambda x, y: x.mul_(y), t((3,), F16), c, inplace=True),
    Bad("c.abs_()", lambda x: x.abs_(), c, inplace=True),
    # in-place: the result does not broadcast to self's shape
    Bad("(3,).add_((2,3))", lambda x, y: x.add_(y), f, x23, inplace=True),
    Bad("().mul_((3,))", lambda x, y: x.mul_(y), t(()), f, inplace=True),
    Bad("(3,1).sub_((1,4))", lambda x, y: x.sub_(y), t((3, 1)), t((1, 4)), inplace=True),
    Bad("(3,) += (2,3)", lambda x, y: x.__iadd__(y), f, x23, inplace=True),
    Bad("(3,).clamp_(min=(2,3))", lambda x, y: x.clamp_(min=y), f, x23, inplace=True),
    Bad("(3,).eq_((2,3))", lambda x, y: x.eq_(y), f, x23, inplace=True),
    # wrong argument types
    Bad("x + 'a'", lambda x: x + "a", f),
    Bad("torch.add(x, 'a')", lambda x: torch.add(x, "a"), f),
    Bad("x.mul([1, 2, 3])", lambda x: x.mul([1, 2, 3]), f),
    Bad("x + None", lambda x: x + None, f),
    Bad("None - x", lambda x: None - x, f),
    Bad("torch.clamp(x, 'a')", lambda x: torch.clamp(x, "a"), f),
    Bad("x.add(object())", lambda x: x.add(object()), f),
    Bad("x.sub((1, 2, 3))", lambda x: x.sub((1, 2, 3)), f),
    Bad("x.lt(1j)", lambda x: x.lt(1j), f),
    Bad("x < 'a'", lambda x: x < "a", f),
    Bad("torch.exp(x, 2)", lambda x: torch.exp(x, 2), f),
    Bad("x.neg(1)", lambda x: x.neg(1), f),
    Bad("torch.add(x)", lambda x: torch.add(x), f),
    Bad("x.add(x, x)", lambda x: x.add(x, x), f),
    Bad("x.add(x, alpha=2, bogus=1)", lambda x: x.add(x, alpha=2, bogus=1), f),
    Bad("torch.neg(x, bogus=1)", lambda x: torch.neg(x, bogus=1), f),
    Bad("x.clamp()", lambda x: x.clamp(), f),
    Bad("x.clamp(None, None)", lambda x: x.clamp(None, None), f),
    Bad("torch.clamp(x, 1, [2])", lambda x: torch.clamp(x, 1, [2]), f),
    # dtypes an op does not take
    Bad("b.neg()", lambda x: x.neg(), b),
    Bad("-b", lambda x: -x, b),
    Bad("c < c", lambda x, y: x < y, c, c),
    Bad("c.clamp(0)", lambda x: x.clamp(0), c),
    Bad("torch.maximum(c, c)", lambda x, y: torch.maximum(x, y), c, c),
    Bad("i ** -1", lambda x: x ** -1, i),
    Bad("torch.pow(i, -2)", lambda x: torch.pow(x, -2), i),
    Bad("b ** b", lambda x, y: x ** y, b, b),
    # reductions, softmax, matrix products
    Bad("x.sum(dim=5)", lambda x: x.sum(dim=5), x23),
    Bad("x.sum(dim='a')", lambda x: x.sum(dim="a"), x23),
    Bad("x.sum(dim=(0, 0))", lambda x: x.sum(dim=(0, 0)), x23),
    Bad("x.sum(dtype='bad')", lambda x: x.sum(dtype="bad"), x23),
    Bad("x.sum(0, True, torch.float64) (dtype keyword-only)",
        lambda x: x.sum(0, True, torch.float64), x23),
    Bad("i.mean()", lambda x: x.mean(), i),
    Bad("empty.amax()", lambda x: x.amax(), t((0, 3))),
    Bad("empty.amin(dim=0)", lambda x: x.amin(dim=0), t((0, 3))),
    Bad("x.softmax(3)", lambda x: x.softmax(3), x23),
    Bad("torch.softmax(x, 'a')", lambda x: torch.softmax(x, "a"), x23),
    Bad("torch.softmax(i, 0)", lambda x: torch.softmax(x, 0), i),
    Bad("F.log_softmax(x, dim=-3)", lambda x: F.log_softmax(x, dim=-3), x23),
    Bad("x.mm(y) shape mismatch", lambda x, y: x.mm(y), x23, x23),
    Bad("mm f32 with f64", lambda x, y: torch.mm(x, y), x23, t((3, 2), F64)),
    Bad("mm of 1-d", lambda x, y: torch.mm(x, y), f, x23),
    Bad("torch.bmm(2-d, 2-d)", lambda x, y: torch.bmm(x, y), x23, t((3, 2))),
    Bad("x @ y mismatch", lambda x, y: x @ y, x23, t((4, 2))),
    Bad("matmul 0-d", lambda x, y: torch.matmul(x, y), t(()), f),
    Bad("matmul f32 with i64", lambda x, y: torch.matmul(x, y), x23, t((3,), I64)),
    Bad("x.mm('a')", lambda x: x.mm("a"), x23),
    Bad("F.linear weight mismatch", lambda x, w: F.linear(x, w), x23, t((4, 2))),
    Bad("F.linear bias mismatch", lambda x, w, bb: F.linear(x, w, bb), x23, t((4, 3)), t((3,))),
    Bad("F.linear dtype mismatch", lambda x, w: F.linear(x, w), x23, t((4, 3), F64)),
    Bad("F.gelu(x, approximate='bad')", lambda x: F.gelu(x, approximate="bad"), f),
    Bad("F.silu(i)", lambda x: F.silu(x), i),
    Bad("F.leaky_relu(x, 'a')", lambda x: F.leaky_relu(x, "a"), f),
]

# Bad calls fastlazy records anyway (core bugs): each must still fail here.
BUG_CASES = [
    (Bad("x.add(y, alpha=None)", lambda x, y: x.add(y, alpha=None), f, f),
     "alpha=None is recorded as 'no alpha'; eager raises TypeError"),
    (Bad("F.leaky_relu(x, None)", lambda x: F.leaky_relu(x, None), f),
     "negative_slope=None is recorded as the default; eager raises TypeError"),
    (Bad("torch.eq(3, x)", lambda x: torch.eq(3, x), f),
     "compare with a Python scalar input is recorded; eager raises TypeError"),
    (Bad("torch.lt(True, x)", lambda x: torch.lt(True, x), i),
     "compare with a Python scalar input is recorded; eager raises TypeError"),
    (Bad("x + 2**64", lambda x: x + 2 ** 64, i),
     "Python int beyond int64 is recorded; eager raises OverflowError"),
    (Bad("x * -2**63 - 1", lambda x: x * (-2 ** 63 - 1), f),
     "Python int beyond int64 is recorded; eager raises OverflowError"),
    (Bad("u8.pow(300)", lambda x: x.pow(300), t((3,), U8)),
     "out-of-range pow exponent recorded; eager raises RuntimeError at the call"),
    (Bad("u8.clamp(300)", lambda x: x.clamp(300), t((3,), U8)),
     "out-of-range clamp bound recorded; eager raises RuntimeError at the call"),
    (Bad("u8.add(u8, alpha=300)", lambda x, y: x.add(y, alpha=300), t((3,), U8), t((3,), U8)),
     "out-of-range alpha recorded; eager raises RuntimeError at the call"),
    (Bad("F.leaky_relu(x, 1j)", lambda x: F.leaky_relu(x, 1j), f),
     "complex negative_slope recorded; eager raises RuntimeError at the call"),
    (Bad("f16 ** 1j", lambda x: x ** 1j, t((3,), F16)),
     "ComplexHalf pow recorded; eager raises NotImplementedError at the call"),
    (Bad("f16 / (1 - 2j)", lambda x: x / (1 - 2j), t((3,), F16)),
     "ComplexHalf div recorded; eager raises NotImplementedError at the call"),
    (Bad("x.pow(None)", lambda x: x.pow(None), f),
     "None as a required operand is recorded as absent; eager raises TypeError"),
    (Bad("torch.add(x, None)", lambda x: torch.add(x, None), f),
     "None as a required operand is recorded as absent; eager raises TypeError"),
    (Bad("x.eq(None)", lambda x: x.eq(None), f),
     "None as a required operand is recorded as absent; eager raises TypeError"),
    (Bad("x.add_(None)", lambda x: x.add_(None), f, inplace=True),
     "None as a required operand is recorded as absent; eager raises TypeError"),
    (Bad("x += None", lambda x: operator.iadd(x, None), f, inplace=True),
     "x += None returns x unchanged; eager raises TypeError"),
    (Bad("x **= None", lambda x: operator.ipow(x, None), f, inplace=True),
     "x **= None returns x unchanged; eager raises TypeError"),
    (Bad("F.gelu(x, 'tanh')", lambda x: F.gelu(x, "tanh"), f),
     "approximate given positionally is recorded; eager raises TypeError (keyword-only)"),
]


def _params():
    out = [pytest.param(case, id=case.label) for case in CASES]
    # former bugs, fixed: kept as regression cases
    out += [pytest.param(case, id=case.label) for case, _reason in BUG_CASES]
    return out


@pytest.mark.parametrize("pending", [False, True], ids=["materialized", "pending"])
@pytest.mark.parametrize("case", _params())
def test_bad_call(case, pending):
    run_bad(case, pending)


def test_cases_are_bad():
    """Every case above is one eager rejects (a typo would make it vacuous)."""
    for case in CASES + [c for c, _ in BUG_CASES]:
        with fastlazy_disabled():
            assert case.eager_rejects(), f"eager accepts {case.label}"


# --------------------------------------------------------------------------
# the same mistakes through every entry point of the table


def _binary_rows():
    return [row for row in OPS if row.rule <= Rule.R_CLAMP and row.nrequired >= 2]


def _table_cases():
    """For every elementwise binary row and each of its entry points:
    operands that do not broadcast; for every in-place entry point, a
    result that cannot be cast to self (int64 self, float other) and one that
    does not fit self's shape."""
    out = []
    for row in _binary_rows():
        for form in forms_of(row):
            out.append(Bad(f"{row.name}|{form}|no broadcast", form, x23, y4,
                           inplace=form.inplace))
            if form.inplace:
                out.append(Bad(f"{row.name}|{form}|cannot cast", form, i, 1.5, inplace=True))
                out.append(Bad(f"{row.name}|{form}|self shape", form, f, x23, inplace=True))
    for row in OPS:
        if row.rule <= Rule.R_CLAMP and row.nrequired == 1 and row.inplace:
            for form in forms_of(row):
                if form.inplace:
                    extra = (0.5,) if row.rule == Rule.R_CLAMP else ()
                    out.append(Bad(f"{row.name}|{form}|cannot cast", form, t((3,), BOOL),
                                   *extra, inplace=True))
    with fastlazy_disabled():
        # keep the calls eager rejects (eq_ into a bool self is fine, say)
        return [case for case in out if case.eager_rejects()]


TABLE_CASES = _table_cases()


@pytest.mark.parametrize("case", TABLE_CASES, ids=lambda c: c.label)
def test_bad_call_every_entry_point(case):
    run_bad(case, pending=False)


def test_every_binary_entry_point_has_a_bad_call():
    labels = {c.label.split("|")[1] for c in TABLE_CASES}
    for row in _binary_rows():
        for form in forms_of(row):
            assert str(form) in labels, f"{row.name}: {form} has no bad-input case"


# --------------------------------------------------------------------------
# a run of failures among live LazyTensors


def test_failures_leave_the_graph_intact():
    """Many pending LazyTensors, then a series of rejected calls on them:
    no node is added, nothing is flushed, and every tensor (made before,
    between and after the failures) computes correctly in one flush."""
    base = torch.randn(2, 3)
    a = fastlazy.lazy(base.clone())
    live = [a * k for k in range(1, 6)]                   # pending
    expected = [base * k for k in range(1, 6)]
    ib = fastlazy.lazy(torch.tensor([True, False]))
    bad_calls = [
        lambda: live[0] + torch.ones(4),
        lambda: ib - ib,
        lambda: torch.maximum(live[1], 2),
        lambda: live[2].div(live[3], rounding_mode="nope"),
        lambda: live[4] + "a",
        lambda: live[0].mm(live[1]),
        lambda: live[0].sum(dim=7),
    ]
    for k, call in enumerate(bad_calls):
        nodes = _core.pending_nodes()
        with pytest.raises((RuntimeError, TypeError, IndexError)):
            call()
        # nothing recorded (the pending arguments may have been computed so
        # that eager could judge the call: a flush, never a new node)
        assert _core.pending_nodes() <= nodes, f"bad call {k} recorded a node"
        live.append(live[k % 5] + k)                      # recording goes on
        expected.append(expected[k % 5] + k)
    fastlazy.mark_step()
    for k, (lz, e) in enumerate(zip(live, expected)):
        assert_same(lz.to_eager(), e, f"live tensor {k}")


def test_failed_inplace_leaves_self_unchanged():
    """A rejected in-place call leaves its LazyTensor with its old value,
    dtype and shape."""
    base = torch.arange(6).reshape(2, 3)
    x = fastlazy.lazy(base.clone()) * 2                   # pending
    with pytest.raises(RuntimeError):
        x.add_(0.5)
    with pytest.raises(RuntimeError):
        x.mul_(torch.ones(4, 2, 3))
    with pytest.raises(RuntimeError):
        x.exp_()
    assert x.dtype == torch.int64 and x.shape == (2, 3)
    assert_same(x.to_eager(), base * 2, "self after failed in-place calls")


def test_rejected_inplace_call_does_not_flush():
    pending = fastlazy.lazy(torch.rand(3)) * 2
    x = fastlazy.lazy(torch.arange(3))
    nodes = _core.pending_nodes()
    flushes = fastlazy.metrics.counters()["flushes"]
    with pytest.raises(RuntimeError):
        x.add_(1.5)                     # int64 self, float result: eager refuses
    assert _core.pending_nodes() == nodes and not pending.is_materialized
    assert fastlazy.metrics.counters()["flushes"] == flushes
