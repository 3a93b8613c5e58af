"""CUDA-graph replay (fastlazy.cuda_graphs): a GraphedCall computes its
program's values on every call, whatever changes between calls; what it
cannot capture is refused at the capture, and the CUDA device stays usable;
the tiered engine puts a CUDA-graph twin of each candidate of a GPU
inference graph on probation.  Most tests need a CUDA device; the input
guard's scalar rules and the engine's choice on CPU graphs run anywhere."""
import gc
import time
import weakref

import pytest
import torch

import fastlazy
from fastlazy import backends, cuda_graphs, graph_cache, tiering

from helpers import fastlazy_enabled  # noqa: F401  (module-scoped enable)

cuda = pytest.mark.cuda


def _differ(got, want):
    return tiering._results_differ(got, want)


def program(x, w, scale):
    """A program as the tiered engine calls one: inputs -> a tuple."""
    y = torch.addmm(w[0], x, w) * scale
    return (y.relu(), y.sum(0))


def _layouts():
    layouts = cuda_graphs._layouts_type()
    if layouts is None:
        pytest.skip("fastlazy._executor is not built for this torch")
    return layouts


def test_a_non_tensor_input_must_recur_with_its_type_and_value():
    layouts = _layouts()((1.5, 2, True), ())
    assert layouts.matches((1.5, 2, True))
    assert not layouts.matches((1.6, 2, True))
    assert not layouts.matches((1.5, 2, 1))          # (the capture baked a bool)
    assert not layouts.matches((1.5, 2))


def test_a_cpu_tensor_cannot_be_captured():
    with pytest.raises(ValueError, match="input 0 is not a dense strided CUDA tensor"):
        _layouts()((torch.ones(2),), ())
    assert cuda_graphs.unsuitable((torch.ones(2), 1.0), False) == \
        "its tensor inputs are not all on one CUDA device"
    assert cuda_graphs.unsuitable((torch.ones(2),), True) == "a training graph"


def test_a_cpu_graph_has_no_cuda_graph_twin(auto):
    a = torch.randn(4, 5)
    for _ in range(tiering.probe_calls() + 3):
        (fastlazy.lazy(a) * 2 + 1).relu().to_eager()
        tiering.wait(60)
    (entry,) = graph_cache.tiers()
    assert entry["cuda_graph"] is None, entry
    assert fastlazy.metrics.counters()["cuda_graph_captures"] == 0


@cuda
def test_replays_compute_the_programs_values_as_inputs_change():
    w = torch.randn(8, 8, device="cuda")
    graphed = cuda_graphs.GraphedCall(program, _differ)
    outs = []
    for k in range(6):
        x = torch.randn(4, 8, device="cuda")        # a new tensor each call: copied in
        got = graphed(x, w, 0.5)
        for g, e in zip(got, program(x, w, 0.5)):
            torch.testing.assert_close(g, e, rtol=0, atol=0)
        outs.append((x, got))
    assert graphed.replays == 5 and graphed.misses == 0
    # each call's results are its own: later replays did not overwrite them
    for x, got in outs:
        torch.testing.assert_close(got[0], program(x, w, 0.5)[0], rtol=0, atol=0)
    # w, read in place, written between calls: the replay reads the new values
    w.mul_(-1)
    x = torch.randn(4, 8, device="cuda")
    torch.testing.assert_close(graphed(x, w, 0.5)[0], program(x, w, 0.5)[0], rtol=0, atol=0)
    assert graphed.replays == 6


@cuda
@pytest.mark.parametrize("change", ["sizes", "strides", "dtype", "other w", "scalar",
                                    "offset of w"])
def test_a_call_unlike_the_capture_runs_the_program(change):
    base = torch.randn(9, 8, device="cuda")
    w = base[:8]
    graphed = cuda_graphs.GraphedCall(program, _differ)
    x = torch.randn(4, 8, device="cuda")
    graphed(x, w, 0.5)
    graphed(x, w, 0.5)
    assert graphed.replays == 1
    args = {"sizes": (torch.randn(5, 8, device="cuda"), w, 0.5),
            "strides": (torch.randn(8, 4, device="cuda").t(), w, 0.5),
            "dtype": (x.double(), w.double(), 0.5),
            "other w": (x, w.clone(), 0.5),
            "scalar": (x, w, 0.25),
            "offset of w": (x, base[1:], 0.5)}[change]
    got = graphed(*args)
    for g, e in zip(got, program(*args)):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    assert graphed.misses == 1 and graphed.replays == 1


@cuda
@pytest.mark.parametrize("case", ["writes its input", "reads a value on the host",
                                  "returns its input's memory"])
def test_what_cannot_be_captured_is_refused_and_the_device_stays_usable(case):
    def writes(x):
        return (x.add_(1) * 2,)

    def syncs(x):
        return (x * float(x.sum()),)

    def aliases(x):
        return (x.view(-1),)

    fn = {"writes its input": writes, "reads a value on the host": syncs,
          "returns its input's memory": aliases}[case]
    graphed = cuda_graphs.GraphedCall(fn, _differ)
    x = torch.randn(4, 4, device="cuda")
    x0 = x.clone()
    graphed(x)
    with pytest.raises(cuda_graphs.NotCaptured):
        graphed(x)
    if case == "writes its input":
        torch.testing.assert_close(x, x0 + 1)       # by the first call alone
    # random draws on the device still work, and follow the seed as eager's
    torch.manual_seed(3)
    y = torch.randn(4, 4, device="cuda")
    torch.manual_seed(3)
    torch.testing.assert_close(torch.randn(4, 4, device="cuda"), y, rtol=0, atol=0)
    torch.testing.assert_close((y @ y).sum(), (y.cpu() @ y.cpu()).sum().cuda(),
                               rtol=1e-4, atol=1e-4)
    torch.cuda.synchronize()


@cuda
def test_a_hot_gpu_inference_graph_gets_a_cuda_graph_twin(auto):
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                torch.nn.Linear(32, 4)).cuda()
    with torch.no_grad():
        for k in range(tiering.probe_calls() + 10):
            x = torch.randn(3, 16, device="cuda")
            got = model(fastlazy.lazy(x)).to_eager()
            torch.testing.assert_close(got, model(x), rtol=1e-5, atol=1e-5)
            if k == 1:
                assert tiering.wait(300)
    (entry,) = graph_cache.tiers()
    assert entry["cuda_graph"] is not None and "us a run" in entry["cuda_graph"], entry
    assert entry["tier"] not in ("compiling", "probation"), entry
    assert fastlazy.metrics.counters()["cuda_graph_captures"] >= 1


@cuda
def test_threads_calling_one_graph_each_get_their_own_values():
    """A call made while another thread replays (or captures) the graph
    runs the program itself: the graph's buffers serve one call at a time."""
    import threading
    w = torch.randn(8, 8, device="cuda")
    graphed = cuda_graphs.GraphedCall(program, _differ)
    wrong = []

    def work(seed):
        for k in range(50):
            x = torch.full((4, 8), float(seed * 100 + k), device="cuda")
            got = graphed(x, w, 0.5)
            if not all(torch.equal(g, e) for g, e in zip(got, program(x, w, 0.5))):
                wrong.append((seed, k))
    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong
    assert graphed.replays + graphed.misses == 4 * 50 - 1      # (the first call observed)


# -- the fast tier's twin on trial, with a stand-in for the CUDA graph -----------

class StandIn:
    """Stands in for cuda_graphs.GraphedCall on the CPU: calls the program,
    `delay` seconds slower, or refuses its capture (its second call)."""
    made = []
    delay = 0.0
    refuse = False

    def __init__(self, call, differ):
        self.call, self.calls = call, 0
        StandIn.made.append(self)

    def __call__(self, *inputs):
        self.calls += 1
        if StandIn.refuse and self.calls == 2:
            raise cuda_graphs.NotCaptured("the stand-in refuses")
        _inside[0] = True
        try:
            time.sleep(StandIn.delay)
            return self.call(*inputs)
        finally:
            _inside[0] = False


_inside = [False]


@pytest.fixture
def twins(auto, monkeypatch):
    """The tiered engine treating CPU inference graphs as a GPU's, with
    StandIn for the CUDA graph, and the fast tier 2 ms slower a run
    outside a StandIn where `fast_delay` says so."""
    from test_tiering import Scripted, _slow_fast_tier
    monkeypatch.setattr(cuda_graphs, "unsuitable",
                        lambda inputs, grad: "a training graph" if grad else None)
    monkeypatch.setattr(cuda_graphs, "GraphedCall", StandIn)
    monkeypatch.setattr(StandIn, "made", [])
    monkeypatch.setattr(StandIn, "delay", 0.0)
    monkeypatch.setattr(StandIn, "refuse", False)
    compiler = {}

    def use(fast_delay=0.0, compile_fails=True, **stand_in):
        for k, v in stand_in.items():
            setattr(StandIn, k, v)
        _slow_fast_tier(monkeypatch, lambda: 0.0 if _inside[0] else fast_delay)
        stand = Scripted(fail=RuntimeError("no compile here") if compile_fails else None)
        real_get = backends.get
        monkeypatch.setattr(backends, "get",
                            lambda name: stand if name == "inductor" else real_get(name))
        compiler["stand"] = stand
    return use


def chain(a, k):
    return ((a * 2 + k).relu() - a).sum(1)


def _calls(n, a):
    for k in range(n):
        torch.testing.assert_close(chain(fastlazy.lazy(a), float(k)).to_eager(),
                                   chain(a, float(k)))


TRIAL = 2 * (tiering.PROBE_WARMUP + tiering.PROBE_RUNS)


def test_a_faster_twin_becomes_the_fast_tier(twins):
    twins(fast_delay=0.002)
    a = torch.randn(4, 5)
    _calls(TRIAL + 2, a)
    tiering.wait(60)
    _calls(3, a)
    (entry,) = graph_cache.tiers()
    assert entry["cuda_graph"].startswith("fast, CUDA graph: kept"), entry
    (twin,) = StandIn.made
    before = twin.calls
    _calls(5, a)
    assert twin.calls == before + 5        # every call replays now


def test_a_slower_twin_is_left_out(twins):
    twins(delay=0.002)
    a = torch.randn(4, 5)
    _calls(TRIAL + 2, a)
    (entry,) = graph_cache.tiers()
    assert entry["cuda_graph"].startswith("fast, CUDA graph: left out"), entry
    (twin,) = StandIn.made
    before = twin.calls
    _calls(5, a)
    assert twin.calls == before
    # the losing twin is let go (a CUDA graph holds its intermediates' memory)
    made, StandIn.made = weakref.ref(twin), []
    del twin
    gc.collect()
    assert made() is None


def test_a_twin_that_cannot_be_captured_leaves_the_fast_tier(twins):
    twins(refuse=True)
    a = torch.randn(4, 5)
    _calls(TRIAL + 2, a)
    (entry,) = graph_cache.tiers()
    assert entry["cuda_graph"] == \
        "fast, CUDA graph: not captured: the stand-in refuses", entry
    assert fastlazy.metrics.counters()["cuda_graph_failures"] == 1
    (twin,) = StandIn.made
    assert twin.calls == 2


def test_a_graph_too_short_to_compile_gets_a_twin(twins, monkeypatch):
    monkeypatch.setattr(tiering.ENGINE, "hot_min_run", 1.0)
    twins(fast_delay=0.002)
    a = torch.randn(4, 5)
    _calls(TRIAL + 2, a)
    (entry,) = graph_cache.tiers()
    assert entry["tier"] == tiering._TOO_SHORT, entry
    assert entry["cuda_graph"].startswith("fast, CUDA graph: kept"), entry
    assert fastlazy.metrics.counters()["tier_compiles_queued"] == 0
    (twin,) = StandIn.made
    before = twin.calls
    _calls(5, a)
    assert twin.calls == before + 5        # the fast tier replays now


def test_probation_twins_the_compiled_program_not_a_graphed_fast_tier(twins):
    twins(fast_delay=0.002, compile_fails=False)
    a = torch.randn(4, 5)
    _calls(TRIAL + 2, a)
    assert tiering.wait(60)
    _calls(tiering.probe_calls() + 2, a)
    (entry,) = graph_cache.tiers()
    assert entry["tier"] not in ("compiling", "probation"), entry
    assert len(StandIn.made) == 2, [t.call for t in StandIn.made]     # the fast tier's, the compiled
    assert "compiled, CUDA graph" in entry["cuda_graph"], entry
