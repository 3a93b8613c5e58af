"""W3: the cost of fastlazy's machinery itself.

- P4: eager-only code with fastlazy enabled versus disabled (`x + y` on
  one-element tensors; an MLP forward on eager tensors).
- P5: the direct shape/dtype rule versus meta-tensor propagation, for an
  elementwise add.
- P6: a cache-hit flush of a 32-node graph, without the backend's run time.
- The generic path's cost per recorded call (conv2d with padding="same",
  which its C rule leaves to the generic path; a view) against eager
  running the same op.

The baseline of each item is recorded as contender "eager", the fastlazy side
as "fastlazy", so the report shows them in those two columns.
"""
import operator
import time

import pytest
import torch

import fastlazy
import fastlazy.backends
import fastlazy.graph_cache
import workloads
from report import SHAPE_ADDS_PER_CALL

MLP_WIDTH, MLP_LAYERS = 256, 4
SHAPE_N = 100


def _info(benchmark, item, contender, **more):
    benchmark.group = f"W3 {item}"
    benchmark.extra_info.update(workload="W3", item=item, contender=contender, **more)


def _time(benchmark, fn, *args):
    """Warm fn up, then time it.  (A slow first call would make
    pytest-benchmark calibrate to one call per round, and time the timer.)"""
    for _ in range(workloads.WARMUP_CALLS):
        fn(*args)
    benchmark(fn, *args)


def _interleaved_slowdown(fn, *args, blocks=4, repeats=5, calls=20_000):
    """fn's time with fastlazy on over its time with fastlazy off, minus 1,
    the two measured in alternating blocks (minimum of each side).  Timed
    one after the other, as pytest-benchmark times the two tests, a 1 µs
    baseline drifts by up to 8 % between them; alternating cancels that."""
    best = {False: float("inf"), True: float("inf")}
    for _ in range(blocks):
        for on in (False, True):
            with workloads.fastlazy_state(on):
                for _ in range(repeats):
                    start = time.perf_counter()
                    for _ in range(calls):
                        fn(*args)
                    best[on] = min(best[on], time.perf_counter() - start)
    return best[True] / best[False] - 1


@pytest.mark.parametrize("enabled", [False, True], ids=["disabled", "enabled"])
def test_add_overhead(benchmark, enabled):
    """P4: `x + y` on eager one-element tensors, fastlazy off versus on."""
    _info(benchmark, "x+y", "fastlazy" if enabled else "eager", n=1, ops=1, mode="exec")
    x, y = torch.rand(1), torch.rand(1)
    if enabled:
        benchmark.extra_info["interleaved_slowdown"] = _interleaved_slowdown(operator.add, x, y)
    with workloads.fastlazy_state(enabled):
        _time(benchmark, operator.add, x, y)


def _mlp():
    torch.manual_seed(0)
    layers = []
    for _ in range(MLP_LAYERS):
        layers += [torch.nn.Linear(MLP_WIDTH, MLP_WIDTH), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers).eval()


@pytest.mark.parametrize("enabled", [False, True], ids=["disabled", "enabled"])
def test_mlp_overhead(benchmark, enabled):
    """P4: an eager MLP forward (4 Linear+ReLU of 256, batch 1, no_grad),
    fastlazy off versus on."""
    _info(benchmark, "mlp", "fastlazy" if enabled else "eager", n=1, ops=2 * MLP_LAYERS,
          mode="exec")
    model, x = _mlp(), torch.rand(1, MLP_WIDTH)
    with torch.no_grad():
        if enabled:
            benchmark.extra_info["interleaved_slowdown"] = _interleaved_slowdown(
                model, x, calls=500)
        with workloads.fastlazy_state(enabled):
            _time(benchmark, model, x)


@pytest.mark.parametrize("contender", ["eager", "fastlazy"])
def test_shape_inference(benchmark, contender):
    """P5: output shape and dtype of `a + b` (100x100 float32), timed
    SHAPE_ADDS_PER_CALL times per call on both sides.

    "eager" is meta-tensor propagation: `a + b` on meta tensors made once
    outside the timed region (the conservative choice: making them costs
    more).  "fastlazy" is recording `a + b` on two LazyTensors: the
    operator call, the entry point, the C shape and dtype rule, the node
    append, the input slots and the new LazyTensor (the rule alone cannot be
    timed from Python, so this is an upper bound on it); each result is
    dropped, nothing runs.
    """
    _info(benchmark, "shape", contender, n=SHAPE_N, ops=SHAPE_ADDS_PER_CALL, mode="trace")
    if contender == "eager":
        a, b = (torch.empty(SHAPE_N, SHAPE_N, device="meta") for _ in range(2))
    else:
        a, b = (fastlazy.lazy(torch.rand(SHAPE_N, SHAPE_N)) for _ in range(2))

    def adds(a, b):
        for _ in range(SHAPE_ADDS_PER_CALL):
            a + b

    with workloads.fastlazy_state(contender == "fastlazy"):
        _time(benchmark, adds, a, b)


GENERIC_CALLS = {
    # item: (eager arguments, the call)
    "conv2d": (lambda: (torch.rand(1, 3, 8, 8), torch.rand(4, 3, 3, 3)),
               lambda x, w: torch.nn.functional.conv2d(x, w, padding="same")),
    "view": (lambda: (torch.rand(16, 16),), lambda x: x.view(-1)),
}


@pytest.mark.parametrize("item", list(GENERIC_CALLS))
@pytest.mark.parametrize("contender", ["eager", "fastlazy"])
def test_generic_call(benchmark, item, contender):
    """The generic path on a signature hit: eager running the op versus
    fastlazy recording it (signature built in C, dict lookup, node append;
    for a view, registering it with its base).  The result is dropped,
    nothing runs."""
    _info(benchmark, f"generic_{item}", contender, n=1, ops=1, mode="trace")
    make, call = GENERIC_CALLS[item]
    args = make()
    if contender == "fastlazy":
        args = tuple(fastlazy.lazy(a) if k == 0 else a for k, a in enumerate(args))
    with workloads.fastlazy_state(contender == "fastlazy"):
        before = fastlazy.metrics.counters()["fallbacks"]
        _time(benchmark, call, *args)
        assert fastlazy.metrics.counters()["fallbacks"] == before   # recorded, not run


@pytest.fixture
def replaying_programs(monkeypatch):
    """Programs the active backend compiles while this fixture is active run
    their graph once and from then on hand back the stored outputs."""
    # (with the tiered engine, the fast tier's backend compiles new graphs)
    backend = fastlazy.graph_cache.active_backend()
    compile_graph = backend.compile

    def compile_replaying(view):
        program = compile_graph(view)
        program.call = _replaying(program.call)
        return program

    monkeypatch.setattr(backend, "compile", compile_replaying)
    fastlazy.graph_cache.clear()
    yield
    fastlazy.graph_cache.clear()


def _replaying(call):
    stored = []

    def replay(*args):
        if not stored:
            stored.append(call(*args))
        return stored[0]

    return replay


def test_flush_overhead(benchmark, replaying_programs):
    """P6: a cache-hit flush of W1's 32-node chain, backend run excluded.

    Method: the program the graph cache holds is made to return stored
    outputs (see `replaying_programs`), so `to_eager()` on a pending chain
    pays exactly fastlazy's own flush: live-output scan, structural key,
    cache lookup, input gathering, the program call, write-back.  Each round
    records a fresh chain in an untimed setup and times only `to_eager()`.
    """
    _info(benchmark, "flush", "fastlazy", n=SHAPE_N, ops=32, mode="flush")
    fn = workloads.chain(32)
    with workloads.fastlazy_state(True):
        fastlazy.mark_step()                  # a fresh segment: slots from 0
        lazy_inputs = [fastlazy.lazy(t) for t in workloads.inputs(SHAPE_N)]
        fn(*lazy_inputs).to_eager()           # compile and store the outputs

        def record():
            return (fn(*lazy_inputs),), {}

        before = fastlazy.metrics.counters()["cache_misses"]
        benchmark.pedantic(fastlazy.LazyTensor.to_eager, setup=record,
                           rounds=5000, warmup_rounds=100)
        assert fastlazy.metrics.counters()["cache_misses"] == before
