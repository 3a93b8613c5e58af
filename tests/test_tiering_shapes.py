"""The tiered engine and input shapes its compiled program was not compiled
for: probation compares a candidate only at the shapes it was compiled for
(a call with others runs the fast tier and queues no compile), and a hot
graph's dynamic-shape version is tried against the fast tier before it
serves (backends/inductor.py: _DynamicTrial)."""
import time

import pytest
import torch

import fastlazy
from fastlazy import backends, graph_cache, tiering
from fastlazy.backends import inductor

from helpers import fastlazy_enabled  # noqa: F401  (module-scoped enable)


@pytest.fixture
def auto(auto, monkeypatch):
    """conftest's tiered engine, with two timed probe runs."""
    monkeypatch.setattr(tiering, "PROBE_RUNS", 2)


def graph(a, k):
    return ((a * 3 + k).relu() * 2 - a).sum(1)


def run(a, k=0.5):
    return graph(fastlazy.lazy(a), k).to_eager()


def only_program():
    (program,) = graph_cache.programs.values()
    return program


def test_probation_runs_other_shapes_on_the_fast_tier_and_compiles_none(auto):
    a = torch.randn(8, 16)
    run(a)
    run(a)
    assert tiering.wait(300)
    program = only_program()
    others = [torch.randn(n, 16) for n in (3, 4, 5, 6, 7)]
    for x in others:            # each the first call of probation or later
        torch.testing.assert_close(run(x), graph(x, 0.5))
        assert program.tier == "probation"
    (dispatch,) = program._dispatchers
    assert len(dispatch.by_shape) == 1, "probation queued a compile for another shape"
    assert dispatch.replays == len(others)
    assert fastlazy.metrics.counters()["tier_compiles_queued"] == 1
    # its runs at the compiled shape are what decide it
    for _ in range(tiering.probe_calls()):
        torch.testing.assert_close(run(a), graph(a, 0.5))
    assert program.tier in ("hot", "fast (compiled was slower)"), program.tier


class _Dispatch:
    """What _DynamicTrial reads of a shape dispatcher: its replay (the fast
    tier, `fast_seconds` a run) and whether it records autograd history."""

    def __init__(self, fast_seconds=0.0):
        self.grad = False
        self.dynamic = None
        self.dynamic_verdict = None
        self.fast_seconds = fast_seconds

    def replay(self, *inputs):
        time.sleep(self.fast_seconds)
        return [inputs[0] * 2]


def _trial(dispatch, dynamic, calls):
    trial = inductor._DynamicTrial(dynamic, tiering.JUDGE)
    dispatch.dynamic = trial
    x = torch.arange(4.0)
    for _ in range(calls):
        if dispatch.dynamic is not trial:
            break
        (out,) = trial.run(dispatch, (x,), (x,))
        torch.testing.assert_close(out, x * 2)
    return trial


def test_a_dynamic_version_slower_than_the_fast_tier_is_dropped(monkeypatch):
    fastlazy.metrics.reset()
    dispatch = _Dispatch()

    def slow(x):
        time.sleep(0.003)
        return [x * 2]
    _trial(dispatch, slow, 4 * (tiering.PROBE_WARMUP + tiering.PROBE_RUNS))
    assert dispatch.dynamic is inductor._REPLAY
    assert dispatch.dynamic_verdict.startswith("fast tier ("), dispatch.dynamic_verdict
    assert fastlazy.metrics.counters()["tier_dynamic_dropped"] == 1


def test_a_dynamic_version_faster_than_the_fast_tier_is_kept():
    fastlazy.metrics.reset()
    dispatch = _Dispatch(fast_seconds=0.003)

    def quick(x):
        return [x * 2]
    _trial(dispatch, quick, 4 * (tiering.PROBE_WARMUP + tiering.PROBE_RUNS))
    assert dispatch.dynamic is quick
    assert dispatch.dynamic_verdict.startswith("compiled ("), dispatch.dynamic_verdict
    assert fastlazy.metrics.counters()["tier_dynamic_kept"] == 1


def test_a_dynamic_version_computing_other_values_is_dropped_at_its_first_run():
    fastlazy.metrics.reset()
    dispatch = _Dispatch()
    _trial(dispatch, lambda x: [x * 2.5], 1)     # (its result is not returned)
    assert dispatch.dynamic is inductor._REPLAY
    assert "results differ" in dispatch.dynamic_verdict
    assert fastlazy.metrics.counters()["tier_wrong_results"] == 1


def _hot(a):
    run(a)
    run(a)
    assert tiering.wait(300)
    for _ in range(tiering.probe_calls()):
        run(a)
    program = only_program()
    assert program.tier == "hot"
    return program


def test_a_hot_cpu_graph_compiles_a_few_static_shapes_and_no_dynamic_one(auto, monkeypatch):
    """In the compile process, one per shape, up to STATIC_SHAPES; the
    shapes after them run the fast tier, and no dynamic-shape version is
    compiled on this process."""
    monkeypatch.setattr(tiering.TieredProgram, "_decide", _always_promote)
    monkeypatch.setattr(inductor, "STATIC_SHAPES", 3)
    dynamic = []
    real = inductor._ShapeDispatch._compile_here
    monkeypatch.setattr(inductor._ShapeDispatch, "_compile_here",
                        lambda self, args, dyn: dynamic.append(dyn) or real(self, args, dyn))
    program = _hot(torch.randn(8, 16))
    for n in (3, 4, 5, 6, 7):
        x = torch.randn(n, 16)
        torch.testing.assert_close(run(x), graph(x, 0.5))
        assert tiering.wait(300)
        torch.testing.assert_close(run(x), graph(x, 0.5))
    (dispatch,) = program._dispatchers
    assert len(dispatch.by_shape) == 3
    assert True not in dynamic
    assert "after 3 shapes" in graph_cache.tiers()[0]["dynamic_shapes"]


def test_a_hot_graph_over_many_shapes_tries_its_dynamic_version(auto, monkeypatch):
    """Where a dynamic-shape version is compiled (here: no compile process)."""
    monkeypatch.setenv("FASTLAZY_COMPILE_PROCESS", "0")
    monkeypatch.setattr(backends.get("inductor"), "dynamic_after", 1)
    monkeypatch.setattr(tiering.TieredProgram, "_decide", _always_promote)
    program = _hot(torch.randn(8, 16))
    sizes = [3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 14, 15, 17, 18, 19, 20, 21, 22, 23]
    for n in sizes[:2]:           # the second queues the dynamic version
        x = torch.randn(n, 16)
        torch.testing.assert_close(run(x), graph(x, 0.5))
    assert tiering.wait(300)
    for n in sizes[2:]:
        x = torch.randn(n, 16)
        torch.testing.assert_close(run(x), graph(x, 0.5))
    (dispatch,) = program._dispatchers
    assert dispatch.dynamic_verdict is not None, "the dynamic version was never tried"
    assert graph_cache.tiers()[0]["dynamic_shapes"] == dispatch.dynamic_verdict
    counters = fastlazy.metrics.counters()
    assert counters["tier_dynamic_kept"] + counters["tier_dynamic_dropped"] == 1


def _always_promote(self):
    self.tier = "hot"
    self.call = self._compiled


def _timed_as(monkeypatch, gain):
    """Probation decides on timed runs of 1 s for the fast tier and
    1 / (1 + gain) s for the compiled program, whatever they took."""
    real = tiering.TieredProgram._decide

    def decide(self):
        for c in self._candidates:
            c.times[:] = [1.0 if c is self._fast_candidate else 1.0 / (1.0 + gain)] * len(c.times)
        return real(self)
    monkeypatch.setattr(tiering.TieredProgram, "_decide", decide)


@pytest.mark.parametrize("gain, compiles", [(0.05, False), (1.0, True)])
def test_new_shapes_compile_only_where_the_compiled_program_gained_enough(auto, monkeypatch,
                                                                           gain, compiles):
    """A hot graph whose compiled program ran only a little faster than the
    fast tier at its own shapes runs other shapes on the fast tier, and
    compiles none (GPT-2's decode step)."""
    _timed_as(monkeypatch, gain)
    program = _hot(torch.randn(8, 16))
    x = torch.randn(5, 16)
    torch.testing.assert_close(run(x), graph(x, 0.5))
    assert tiering.wait(300)
    torch.testing.assert_close(run(x), graph(x, 0.5))
    (dispatch,) = program._dispatchers
    assert (len(dispatch.by_shape) == 2) is compiles
    assert ("gained under" in (dispatch.dynamic_verdict or "")) is not compiles
