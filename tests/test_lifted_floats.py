"""Python floats of generic calls become inputs of the program once they
vary (fastlazy.lifted_floats): eager's values for every value, one graph
structure for all of them, and eager's errors for values eager refuses."""
import pytest
import torch
import torch.nn.functional as F

import fastlazy
from fastlazy import lifted_floats
from helpers import first_arguments_of_calls

pytestmark = pytest.mark.usefixtures("flush_after", "fresh_signatures")

VALUES = (0.5, 0.75, -1.25, 3.0, 0.1, 2.5, float("inf"))

# calls whose floats reach their aten op as arguments (no guard)
LIFTED = {
    "masked_fill": lambda x, v: x.masked_fill(x > 0, v),
    "masked_fill_": lambda x, v: x.clone().masked_fill_(x > 0, v),
    "where": lambda x, v: torch.where(x > 0, x, v),
    "full_like": lambda x, v: torch.full_like(x, v) * x,
    "lerp": lambda x, v: torch.lerp(x, x.relu(), v),
    "fill_": lambda x, v: x.clone().fill_(v),
    "addcmul": lambda x, v: torch.addcmul(x, x, x, value=v),
}


def misses():
    return fastlazy.metrics.counters()["cache_misses"]


@pytest.mark.parametrize("name", sorted(LIFTED))
def test_a_varying_float_compiles_once(backend, name):
    fn = LIFTED[name]
    x0 = torch.randn(6, 7)
    x = fastlazy.lazy(x0)
    counts = []
    for v in VALUES:
        torch.testing.assert_close(fn(x, v).to_eager(), fn(x0, v), rtol=0, atol=0,
                                   equal_nan=True)
        counts.append(misses())
    # the first two values are each traced with the value baked in; the
    # third and later values run one program that takes them as an input
    assert counts[2:] == [counts[2]] * (len(VALUES) - 2)


def _counting_lifts(monkeypatch):
    """The calls of lifted_floats._lift (one symbolic trace each) from now on."""
    return first_arguments_of_calls(monkeypatch, lifted_floats, "_lift")


def test_values_met_in_one_graph_stay_constants_until_a_later_graph_brings_a_new_one(
        monkeypatch):
    # two calls of one signature with their own constant (swin_t's mask
    # filled with -100.0, then 0.0) in every graph: not a value that varies
    lifts = _counting_lifts(monkeypatch)

    def fn(x, a, b):
        return x.masked_fill(x > 0, a).masked_fill(x < -1, b)
    x0 = torch.randn(6, 7)
    x = fastlazy.lazy(x0)
    for _ in range(3):
        assert torch.equal(fn(x, -100.0, 0.0).to_eager(), fn(x0, -100.0, 0.0))
    assert lifts == [] and misses() == 1
    # a value that changes from one graph to the next is lifted, once
    # (its first graph still has it baked in, as test_a_varying_float_compiles_once)
    counts = []
    for v in (0.5, 0.25, 0.125, 2.0):
        assert torch.equal(fn(x, v, 0.0).to_eager(), fn(x0, v, 0.0))
        counts.append(misses())
    assert len(lifts) == 1 and counts[1:] == [counts[1]] * 3


def test_many_values_in_one_graph_are_lifted(monkeypatch):
    lifts = _counting_lifts(monkeypatch)
    x0 = torch.randn(6, 7)
    x, y, y0 = fastlazy.lazy(x0), None, x0
    y = x
    for v in VALUES[:-1]:
        y, y0 = y.masked_fill(y > v, v), y0.masked_fill(y0 > v, v)
    assert torch.equal(y.to_eager(), y0)
    assert len(lifts) == 1
    assert lifted_floats.SAME_GRAPH_VALUES <= len(VALUES) - 1


def test_softplus_beta_and_guarded_hardtanh(backend):
    x0 = torch.randn(5, 5)
    x = fastlazy.lazy(x0)
    for v in VALUES[:-1]:
        torch.testing.assert_close(F.softplus(x, beta=abs(v)).to_eager(),
                                   F.softplus(x0, beta=abs(v)), rtol=0, atol=0)
        torch.testing.assert_close(F.hardtanh(x, -abs(v), abs(v)).to_eager(),
                                   F.hardtanh(x0, -abs(v), abs(v)), rtol=0, atol=0)
    assert misses() <= 6


def test_a_value_against_a_guard_raises_eagers_error():
    x0 = torch.randn(5)
    x = fastlazy.lazy(x0)
    for v in (0.5, 0.75, 1.0):
        F.hardtanh(x, -v, v).to_eager()
    # hardtanh's Python code checks min_val <= max_val: the lifted program
    # holds that check, and a value that fails it is the exact path's
    with pytest.raises(ValueError) as lazy_error:
        F.hardtanh(x, 1.0, -1.0)
    with pytest.raises(ValueError) as eager_error:
        F.hardtanh(x0, 1.0, -1.0)
    assert str(lazy_error.value) == str(eager_error.value)
    assert torch.equal(F.hardtanh(x, -2.0, 2.0).to_eager(), F.hardtanh(x0, -2.0, 2.0))


def test_a_value_out_of_the_dtypes_range_raises_at_the_call():
    x0 = torch.randn(4, 4, dtype=torch.float16)
    x = fastlazy.lazy(x0)
    for v in (1.5, 2.5, 3.5):
        assert torch.equal(x.masked_fill(x > 0, v).to_eager(), x0.masked_fill(x0 > 0, v))
    with pytest.raises(RuntimeError, match="overflow"):
        x0.masked_fill(x0 > 0, 1e6)
    with pytest.raises(RuntimeError, match="overflow"):
        x.masked_fill(x > 0, 1e6)
    assert torch.equal(x.to_eager(), x0)


def test_a_specialized_float_stays_baked_in():
    # F.pad's value reaches C++ as a double before its op: each value is
    # its own program, as before, with eager's values
    x0 = torch.randn(3, 4)
    x = fastlazy.lazy(x0)
    for v in VALUES:
        assert torch.equal(F.pad(x, (1, 2), value=v).to_eager(), F.pad(x0, (1, 2), value=v))
    assert misses() == len(VALUES)


@pytest.mark.parametrize("call", [
    lambda x, p: torch.linalg.vector_norm(x, ord=p), lambda x, p: x.norm(p=p, dim=1),
    lambda x, p: F.normalize(x, p=p)], ids=["vector_norm", "norm", "normalize"])
def test_a_float_the_code_takes_modulo_of(call):
    # vector_norm checks `ord % 2`: a condition in torch's own sympy
    # functions (PythonMod), which lifting cannot evaluate: the floats stay
    # baked in, each value eager's
    x0 = torch.randn(4, 5)
    x = fastlazy.lazy(x0)
    for p in (2.0, 1.0, 3.0, 0.5, 4.0):
        torch.testing.assert_close(call(x, p).to_eager(), call(x0, p))


def test_an_unvarying_float_beside_a_varying_one_stays_a_constant():
    x0 = torch.randn(4, 4)
    x = fastlazy.lazy(x0)
    for v in (0.5, 0.25, 0.125, 2.0):
        assert torch.equal(torch.addcmul(x, x, x, value=v).masked_fill(x > 1, 7.0).to_eager(),
                           torch.addcmul(x0, x0, x0, value=v).masked_fill(x0 > 1, 7.0))
    # a new value of the float that was the same so far is a new exact
    # signature, with eager's values
    assert torch.equal(torch.addcmul(x, x, x, value=2.0).masked_fill(x > 1, 9.0).to_eager(),
                       torch.addcmul(x0, x0, x0, value=2.0).masked_fill(x0 > 1, 9.0))


def test_batch_norm_with_cumulative_momentum_trains_as_eager():
    # momentum=None: the running statistics' factor is 1 / batches seen,
    # a new float every step
    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16, momentum=None),
                                   torch.nn.ReLU(), torch.nn.Linear(16, 3))
    eager, lazy = make(), make()
    x, y = torch.randn(10, 8), torch.randint(0, 3, (10,))
    for step in range(8):
        losses = []
        for model, inp in ((eager, x), (lazy, x.to("lazy"))):
            model.zero_grad()
            loss = F.cross_entropy(model(inp), y)
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
            losses.append(float(loss.detach()))
        assert losses[0] == pytest.approx(losses[1], rel=1e-6, abs=1e-7), step
    torch.testing.assert_close(lazy[1].running_mean, eager[1].running_mean)
    torch.testing.assert_close(lazy[1].running_var, eager[1].running_var)
    assert lazy[1].num_batches_tracked == eager[1].num_batches_tracked
    # the first steps' graphs (two values baked in), then one for every
    # later value: 4 here, 9 with each value baked in
    assert misses() <= 5


def test_inductor_takes_a_lifted_float_through_a_tensor_overload(monkeypatch):
    before = fastlazy.backend()
    fastlazy.set_backend("inductor")
    try:
        x0 = torch.randn(8, 8)
        x = fastlazy.lazy(x0)
        for v in (0.5, 1.5, 2.5, -3.0):
            torch.testing.assert_close((x.masked_fill(x > 0, v) * 2).to_eager(),
                                       x0.masked_fill(x0 > 0, v) * 2)
        # softplus has no overload taking beta as a tensor: its graph runs
        # unfused, counted with the reason
        for v in (0.5, 1.5, 2.5):
            torch.testing.assert_close(F.softplus(x, beta=v).to_eager(), F.softplus(x0, beta=v))
        counters = fastlazy.metrics.counters()
        assert counters.get("fallback.compile:inductor:NotImplementedError", 0) >= 1
        assert counters["compile_failures"] == counters[
            "fallback.compile:inductor:NotImplementedError"]
    finally:
        fastlazy.mark_step()
        fastlazy.set_backend(before)
