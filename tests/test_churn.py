"""Calls whose Python numbers take a new value at every flush
(fastlazy.churn): after NEW_VALUE_SEGMENTS segments with a new value, new
values run eagerly, with eager's values; values analysed before, and the
many values of one graph, are still recorded."""
import pytest
import torch
import torch.nn.functional as F

import fastlazy
from fastlazy import churn, generic

pytestmark = pytest.mark.usefixtures("flush_after", "fresh_signatures")


# a number new at every call: an int on the generic path, a float C++
# reads as a double (baked into its program)
STREAMS = {
    "where_int": lambda x, i: torch.where(x > 0, x, i).relu(),
    "roll": lambda x, i: (x * 2).roll(i, 1),
    "full_like_int": lambda x, i: torch.full_like(x, i) * x,
    "pad_value": lambda x, i: F.pad(x * 2, (1, 2), value=0.5 + i).relu(),
}


@pytest.mark.parametrize("name", sorted(STREAMS))
def test_a_number_new_at_every_flush_runs_eagerly_after_a_few(name):
    call = STREAMS[name]
    x0 = torch.randn(3, 5)
    x = fastlazy.lazy(x0)
    steps = churn.NEW_VALUE_SEGMENTS + 10
    for i in range(steps):
        assert torch.equal(call(x, i).to_eager(), call(x0, i))
    counters = fastlazy.metrics.counters()
    assert counters["fallbacks"] == steps - churn.NEW_VALUE_SEGMENTS
    assert any(reason == churn.REASON for _, reason in fastlazy.metrics.fallback_reasons)
    # no new graph structure for the new values: the graphs around the
    # call are the same at every step
    before = counters["cache_misses"]
    for i in range(steps, steps + 5):
        assert torch.equal(call(x, i).to_eager(), call(x0, i))
    assert fastlazy.metrics.counters()["cache_misses"] == before
    # a value analysed before is still recorded
    fastlazy.metrics.reset()
    call(x, 1).to_eager()
    assert fastlazy.metrics.counters()["fallbacks"] == 0


def test_the_values_of_one_graph_count_once():
    # a loop unrolled into one graph: many values, one segment, every call
    # after the first recorded whole
    x0 = torch.randn(4, 6)
    x = fastlazy.lazy(x0)

    def unrolled(t):
        return sum(t.roll(i, 1) for i in range(3 * churn.NEW_VALUE_SEGMENTS))
    for _ in range(3):
        torch.testing.assert_close(unrolled(x).to_eager(), unrolled(x0))
    assert fastlazy.metrics.counters()["fallbacks"] == 0


def test_only_segments_with_a_new_value_count():
    # recurring values between the new ones count for nothing: the call is
    # recorded until NEW_VALUE_SEGMENTS segments have met a new value, and
    # runs eagerly from the next new value on
    x0 = torch.randn(4, 6)
    x = fastlazy.lazy(x0)

    def step(i):
        assert torch.equal(torch.where(x > 0, x, i).to_eager(), torch.where(x0 > 0, x0, i))
    for new in range(churn.NEW_VALUE_SEGMENTS):
        step(new)
        for old in range(new + 1):
            step(old)
    assert fastlazy.metrics.counters()["fallbacks"] == 0
    step(churn.NEW_VALUE_SEGMENTS)
    assert fastlazy.metrics.counters()["fallbacks"] == 1


def test_programs_past_the_cores_limit_run_eagerly(monkeypatch):
    # a node names its program in ATTR_GENERIC_OUT_SHIFT bits: past that
    # many, a new program's call runs eagerly rather than raising
    monkeypatch.setattr(generic, "MAX_LOWERINGS", len(generic._lowerings))
    x0 = torch.randn(3, 4)
    got = torch.cummax(fastlazy.lazy(x0) * 3, 1).values
    assert torch.equal(got.to_eager(), torch.cummax(x0 * 3, 1).values)
    assert fastlazy.metrics.counters()["fallbacks"] == 1


# views whose places are numbers new at every flush: eager's result shares
# its argument's storage, which a copy run eagerly would not
VIEW_STREAMS = {
    "unfold": lambda t, i: t.unfold(0, 2, 2 + i),
    "as_strided": lambda t, i: t.as_strided((2, 2), (1, 2), i),
    "narrow": lambda t, i: t.narrow(0, i % 5, 3),
    "select": lambda t, i: t.select(0, i),
}


@pytest.mark.parametrize("name", sorted(VIEW_STREAMS))
def test_views_with_new_numbers_stay_views(name):
    view = VIEW_STREAMS[name]
    steps = churn.NEW_VALUE_SEGMENTS + 6
    x0 = torch.zeros(steps + 8)
    x = fastlazy.lazy(x0.clone())
    for i in range(steps):
        v0, v = view(x0, i), view(x, i)
        v0.add_(i + 1)
        v.add_(i + 1)
        assert torch.equal(x.to_eager(), x0), i
        assert torch.equal(v.to_eager(), v0), i
    assert fastlazy.metrics.counters()["fallbacks"] == 0
