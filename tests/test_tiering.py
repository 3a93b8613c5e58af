"""The tiered engine ("auto", the default): a graph runs on the fast tier at
once, is compiled on the background thread once hot, and moves to the
compiled tier only if that runs faster; a compile that fails or is slow
never costs a call anything.

Most tests stand a scripted hot backend in for inductor (its compile can be
made slow, failing, or its program slow), so that what the engine decides is
what the test set up; two tests run the real inductor end to end.
"""
import gc
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import fastlazy
from fastlazy import _core, backends, compile_process, debug, graph_cache, step_executor, tiering
from fastlazy.backends.base import Program

from helpers import fastlazy_enabled  # noqa: F401  (module-scoped enable)


class Scripted:
    """Stands in for the inductor backend: its programs compute the graph
    with the eager backend, after `compile_seconds` (on the compile thread),
    `run_seconds` per call and `backward_seconds` in the backward of each
    result that requires grad, or raising `fail` when compiled, or
    `raises` when run."""

    def __init__(self, compile_seconds=0.0, run_seconds=0.0, fail=None, backward_seconds=0.0,
                 raises=None):
        self.compile_seconds, self.run_seconds, self.fail = compile_seconds, run_seconds, fail
        self.backward_seconds, self.raises = backward_seconds, raises
        self.compiled = threading.Event()

    def compile(self, view, replay=None, on_replay=None):
        eager = backends.get("eager").compile(view)
        scripted = self

        class Call:
            def warm(self, examples):
                time.sleep(scripted.compile_seconds)
                if scripted.fail is not None:
                    raise scripted.fail
                scripted.compiled.set()

            def __call__(self, *inputs):
                if scripted.raises is not None:
                    raise scripted.raises
                if scripted.run_seconds:
                    time.sleep(scripted.run_seconds)
                out = eager.call(*inputs)
                if scripted.backward_seconds:
                    out = [_SlowBackward.apply(o, scripted.backward_seconds)
                           if o.requires_grad else o for o in out]
                return out

        return Program(eager.slots, Call(), False, "scripted")


class _SlowBackward(torch.autograd.Function):
    """The identity, whose backward takes `seconds` more."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


@pytest.fixture
def scripted(monkeypatch):
    def use(**kwargs):
        stand_in = Scripted(**kwargs)
        real_get = backends.get
        monkeypatch.setattr(backends, "get",
                            lambda name: stand_in if name == "inductor" else real_get(name))
        return stand_in
    return use


def graph(a, b, k):
    return ((a * b + k).relu() * 2 - a).sum(1)


def run(a, b, k):
    return graph(fastlazy.lazy(a), fastlazy.lazy(b), k).to_eager()


def only_tier():
    (entry,) = graph_cache.tiers()
    return entry


def _slow_fast_tier(monkeypatch, seconds):
    """The fast tier's runs made `seconds` slower (a number, or a function
    giving it at each run)."""
    real = backends.get("torchscript").compile
    delay = seconds if callable(seconds) else (lambda: seconds)

    def slow(view):
        program = real(view)
        inner = program.call

        def call(*inputs):
            time.sleep(delay())
            return inner(*inputs)
        program.call = call
        program._first_call = None
        return program
    monkeypatch.setattr(backends.get("torchscript"), "compile", slow)


def test_auto_is_the_default_backend(monkeypatch):
    monkeypatch.delenv("FASTLAZY_BACKEND", raising=False)
    assert backends.default_name() == "auto"
    assert "auto" in graph_cache.backend_names()


def test_unknown_backend_names_every_choice():
    with pytest.raises(ValueError, match="auto, torchscript, inductor, native, eager"):
        fastlazy.set_backend("tvm")


def test_a_hot_graph_moves_to_the_faster_compiled_tier(auto, scripted, monkeypatch):
    scripted()
    # the fast tier made slower than the compiled one: the switch must happen
    _slow_fast_tier(monkeypatch, 0.002)
    a, b = torch.randn(4, 5), torch.randn(4, 5)
    for k in range(3):
        torch.testing.assert_close(run(a, b, float(k)), graph(a, b, float(k)))
    assert tiering.wait(30)
    for k in range(tiering.probe_calls()):
        torch.testing.assert_close(run(a, b, float(k)), graph(a, b, float(k)))
    entry = only_tier()
    assert entry["tier"] == "hot", entry
    c = fastlazy.metrics.counters()
    assert c["tier_compiles_queued"] == c["tier_compiles_done"] == c["tier_promotions"] == 1
    assert c["cache_misses"] == 1


@pytest.mark.parametrize("compiled_seconds", [0.0, 0.003])
def test_runs_count_every_call_on_every_tier(auto, scripted, compiled_seconds):
    """metrics.tiers()'s runs: every call of the graph, before, during and
    after its probation, whichever tier won it."""
    scripted(run_seconds=compiled_seconds)
    a, b = torch.randn(4, 5), torch.randn(4, 5)
    calls = 0
    for k in range(3):
        run(a, b, float(k))
        calls += 1
    assert tiering.wait(30)
    for k in range(tiering.probe_calls() + 7):
        run(a, b, float(k))
        calls += 1
    entry = only_tier()
    assert entry["tier"] not in ("compiling", "probation"), entry
    assert entry["runs"] == calls


def test_a_graph_is_compiled_once_its_runs_add_up_to_hot_seconds(auto, scripted,
                                                                  monkeypatch):
    """Runs alone do not make a graph hot: its fast-tier runs must also add
    up to hot_seconds, and runs_until_hot says how many more it needs."""
    compiler = scripted()
    monkeypatch.setattr(tiering.ENGINE, "hot_seconds", 3600.0)
    a, b = torch.randn(4, 5), torch.randn(4, 5)
    for _ in range(5):
        torch.testing.assert_close(run(a, b, 1.0), graph(a, b, 1.0))
    entry = only_tier()
    assert entry["tier"] == "fast" and entry["runs"] == 5 and entry["fast_seconds"] > 0
    assert tiering.runs_until_hot(graph_cache.programs.values()) > 1000
    assert fastlazy.metrics.counters()["tier_compiles_queued"] == 0
    monkeypatch.setattr(tiering.ENGINE, "hot_seconds", entry["fast_seconds"])
    run(a, b, 1.0)
    assert only_tier()["tier"] != "fast"
    assert compiler.compiled.wait(30)
    assert fastlazy.metrics.counters()["tier_compiles_queued"] == 1
    assert tiering.runs_until_hot(graph_cache.programs.values()) == 0


def test_a_graph_of_short_runs_is_compiled_only_once_its_runs_lengthen(auto, scripted,
                                                                         monkeypatch):
    """A graph whose fast-tier runs average under hot_min_run stays on the
    fast tier, its compile never queued (a compiled program's call costs
    more than such a run); once its runs take longer (larger inputs), the
    next window of runs sends it to the compiler."""
    compiler = scripted()
    delay = [0.0]
    _slow_fast_tier(monkeypatch, lambda: delay[0])
    monkeypatch.setattr(tiering.ENGINE, "hot_after", 3)
    monkeypatch.setattr(tiering.ENGINE, "hot_min_run", 0.005)
    a, b = torch.randn(4, 5), torch.randn(4, 5)
    for _ in range(8):
        torch.testing.assert_close(run(a, b, 1.0), graph(a, b, 1.0))
    assert only_tier()["tier"] == tiering._TOO_SHORT
    assert fastlazy.metrics.counters()["tier_compiles_queued"] == 0
    assert tiering.runs_until_hot(graph_cache.programs.values()) == 0
    delay[0] = 0.01
    torch.testing.assert_close(run(a, b, 1.0), graph(a, b, 1.0))
    assert compiler.compiled.wait(30)
    assert fastlazy.metrics.counters()["tier_compiles_queued"] == 1
    torch.testing.assert_close(run(a, b, 1.0), graph(a, b, 1.0))


def test_a_slower_compiled_program_is_dropped(auto, scripted):
    scripted(run_seconds=0.003)
    a, b = torch.randn(4, 5), torch.randn(4, 5)
    run(a, b, 1)
    run(a, b, 1)
    assert tiering.wait(30)
    for k in range(tiering.probe_calls() + 2):
        torch.testing.assert_close(run(a, b, k), graph(a, b, k))
    entry = only_tier()
    assert entry["tier"] == "fast (compiled was slower)", entry
    assert entry["compiled_run_seconds"] > entry["fast_run_seconds"]
    assert fastlazy.metrics.counters()["tier_promotions"] == 0


def test_a_training_graph_is_judged_with_its_backward(auto, scripted, monkeypatch):
    """A compiled training graph whose run is faster than the fast tier's
    but whose backward costs more than that saves: the step is slower on
    it, and the probe, timing a training graph from one of its runs to the
    next, keeps the fast tier."""
    scripted(backward_seconds=0.012)
    _slow_fast_tier(monkeypatch, 0.004)
    w = torch.randn(5, 3, requires_grad=True)
    x = torch.randn(4, 5)

    def step(a):
        w.grad = None
        (a @ w).relu().sum().backward()
        return w.grad
    for _ in range(2):
        step(fastlazy.lazy(x))
    assert tiering.wait(30)
    for _ in range(tiering.probe_calls()):
        got = step(fastlazy.lazy(x))
        torch.testing.assert_close(got, step(x))
    entry = only_tier()
    assert entry["timed"] == "period"
    assert entry["tier"] == "fast (compiled was slower)", entry
    assert entry["compiled_run_seconds"] > entry["fast_run_seconds"] + 0.004


def test_no_call_waits_for_a_compile(auto, scripted):
    stand_in = scripted(compile_seconds=3.0)
    a, b = torch.randn(4, 5), torch.randn(4, 5)
    run(a, b, 0)
    start = time.perf_counter()
    for k in range(20):                     # the compile is under way meanwhile
        torch.testing.assert_close(run(a, b, k), graph(a, b, k))
    elapsed = time.perf_counter() - start
    assert not stand_in.compiled.is_set(), "the loop outlasted the compile: test proves nothing"
    assert elapsed < 1.5, f"20 calls took {elapsed:.2f} s while a 3 s compile ran"
    assert only_tier()["tier"] == "compiling"
    assert fastlazy.metrics.counters()["tier_fast_runs_while_compiling"] >= 19


def test_a_failed_compile_leaves_the_graph_on_the_fast_tier(auto, scripted):
    scripted(fail=RuntimeError("inductor cannot lower this"))
    a, b = torch.randn(4, 5), torch.randn(4, 5)
    run(a, b, 0)
    run(a, b, 0)
    assert tiering.wait(30)
    for k in range(5):
        torch.testing.assert_close(run(a, b, k), graph(a, b, k))
    entry = only_tier()
    assert entry["tier"] == "fast (compile failed)"
    assert "inductor cannot lower this" in entry["error"]
    c = fastlazy.metrics.counters()
    assert c["tier_compiles_failed"] == c["compile_failures"] == 1
    assert "fast (compile failed) 1" in fastlazy.metrics.report()


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_a_compiled_program_that_raises_on_probation_is_left_out(auto, scripted, grad):
    """(AOT autograd asserted on an LSTM's saved tensors when the hidden
    state was carried between steps: the call raised, and the graph's
    later calls failed.)  The fast tier's run gives the call its values;
    the graph stays on the fast tier, the error kept."""
    scripted(raises=AssertionError("expected all tensors_saved_with_vc_check to be Tensors"))
    w = torch.randn(5, requires_grad=grad)
    a, b = torch.randn(4, 5), torch.randn(4, 5)

    def step(k):
        got = graph(fastlazy.lazy(a), b * w, k)
        total = got.sum()                   # (one graph: both pending at the read)
        want = graph(a, b * w, k)
        torch.testing.assert_close(got.to_eager(), want)
        if grad:
            total.backward()
            (gw,) = torch.autograd.grad(want.sum(), w)
            torch.testing.assert_close(w.grad, gw)
            w.grad = None

    step(0)
    step(0)
    assert tiering.wait(30)
    for k in range(tiering.probe_calls() + 2):
        step(k)
    entry = only_tier()
    assert entry["tier"] == "fast (compiled program raised)", entry
    assert "tensors_saved_with_vc_check" in entry["error"]
    assert fastlazy.metrics.counters()["tier_candidate_errors"] >= 1


def test_a_training_graph_compiled_on_the_thread_lowers_its_backward_there(auto, monkeypatch):
    """AOT autograd lowers a backward lazily, at its first run: on the
    user's thread, in the middle of `loss.backward()` -- a compile stall,
    and where the lowering fails (an embedding's sparse gradient under the
    C++ wrapper), an InductorError from `backward()`.  Compiled on the
    compile thread (no compile process here), the backward is lowered
    there with the forward."""
    from torch._inductor import compile_fx
    monkeypatch.setattr(compile_process, "enabled", lambda: False)
    monkeypatch.setattr(tiering, "PROBE_RUNS", 2)
    lowered_on = []
    real = compile_fx.compile_fx_backward
    monkeypatch.setattr(compile_fx, "compile_fx_backward", lambda *a, **k: (
        lowered_on.append(threading.current_thread()), real(*a, **k))[1])
    torch.manual_seed(0)
    lazy_emb = torch.nn.Embedding(20, 4, sparse=True)
    eager_emb = torch.nn.Embedding(20, 4, sparse=True)
    eager_emb.load_state_dict(lazy_emb.state_dict())
    ids = torch.randint(0, 20, (3, 4))
    for step in range(3 + tiering.probe_calls()):
        for emb, x in ((lazy_emb, fastlazy.lazy(ids)), (eager_emb, ids)):
            emb.zero_grad()
            emb(x).pow(2).mean().backward()
        torch.testing.assert_close(lazy_emb.weight.grad.to_dense(),
                                   eager_emb.weight.grad.to_dense())
        if step == 1:
            assert tiering.wait(300)
    assert lowered_on, "no backward compiled: the test proves nothing"
    assert threading.main_thread() not in lowered_on


def test_a_graph_that_never_turns_hot_keeps_no_input_alive(auto, monkeypatch):
    monkeypatch.setattr(tiering.ENGINE, "hot_after", 1000)
    a = torch.randn(64, 64)
    ref = __import__("weakref").ref(a)
    out = (fastlazy.lazy(a) * 2).to_eager()
    del a
    assert ref() is None, "the cached graph keeps its first input alive"
    assert out.shape == (64, 64)


def test_constant_bool_slots_reach_the_compiled_tier(auto, scripted, monkeypatch):
    """TorchScript folds a bool scalar into the graph (it is part of the
    key), so the fast tier takes fewer inputs than the compiled program."""
    monkeypatch.setattr(tiering, "PROBE_RUNS", 2)
    scripted()
    a = torch.randn(3, 4)

    def f(x):
        return (x + True) * 3
    for _ in range(2):
        f(fastlazy.lazy(a)).to_eager()
    assert tiering.wait(30)
    for _ in range(tiering.probe_calls()):
        torch.testing.assert_close(f(fastlazy.lazy(a)).to_eager(), f(a))
    assert only_tier()["tier"] in ("hot", "fast (compiled was slower)")


# -- the real inductor, end to end ------------------------------------------


def _compile_and_probe(a, b, fn=graph):
    """Run the test graph (`fn`) until its background compile is done and
    its probe is over, checking every value against eager's."""
    def lazily(k):
        return fn(fastlazy.lazy(a), fastlazy.lazy(b), k).to_eager()
    lazily(0.5)
    lazily(0.5)
    assert tiering.wait(300)
    for k in range(tiering.probe_calls()):
        torch.testing.assert_close(lazily(k / 4), fn(a, b, k / 4))


def two_kernels(a, b, k):
    """A graph inductor compiles into more than one kernel (a matmul, and
    the sum of its relu), where the C++ wrapper pays."""
    return ((a @ b.t() + k).relu() * 2).sum(1)


def test_inductor_tier_gives_eagers_values_before_and_after_the_switch(auto, monkeypatch):
    monkeypatch.setattr(tiering, "PROBE_RUNS", 2)
    a, b = torch.randn(8, 16), torch.randn(8, 16)
    _compile_and_probe(a, b)
    entry = only_tier()
    assert entry["tier"] in ("hot", "fast (compiled was slower)"), entry
    assert entry["compile_seconds"] > 0


def _record_wrappers(monkeypatch, fail_cpp=False):
    """Which wrapper each inductor compile asked for (cpp_wrapper flags);
    with fail_cpp, a C++-wrapper compile raises."""
    from fastlazy.backends import inductor
    asked = []
    real = inductor._ShapeDispatch._compile_with

    def spy(self, args, dynamic, cpp_wrapper):
        asked.append(cpp_wrapper)
        if cpp_wrapper and fail_cpp:
            raise RuntimeError("no C++ wrapper here")
        return real(self, args, dynamic, cpp_wrapper)
    monkeypatch.setattr(inductor._ShapeDispatch, "_compile_with", spy)
    return asked


def test_background_compiles_use_the_cpp_wrapper_on_cpu(auto, monkeypatch):
    monkeypatch.setattr(tiering, "PROBE_RUNS", 2)
    asked = _record_wrappers(monkeypatch)
    a, b = torch.randn(8, 16), torch.randn(8, 16)
    _compile_and_probe(a, b, two_kernels)
    assert asked and all(asked), asked
    # a compile the user's thread waits for (the inductor backend) does not
    # pay the wrapper's longer compile
    asked.clear()
    fastlazy.set_backend("inductor")
    got = two_kernels(fastlazy.lazy(a), fastlazy.lazy(b), 0.5).to_eager()
    torch.testing.assert_close(got, two_kernels(a, b, 0.5))
    assert asked == [False]


def test_a_one_kernel_graph_keeps_the_python_wrapper(auto, monkeypatch):
    """The C++ wrapper's call costs more than the Python wrapper's where
    one fused kernel does all the work."""
    monkeypatch.setattr(tiering, "PROBE_RUNS", 2)
    asked = _record_wrappers(monkeypatch)
    a, b = torch.randn(8, 16), torch.randn(8, 16)
    _compile_and_probe(a, b, lambda a, b, k: (a * b + k).relu() * 2 - a)
    assert asked == [False]


def test_kernel_breaks_count_the_ops_that_end_a_fused_kernel():
    from fastlazy.inductor_graph import kernel_breaks
    a, b = torch.randn(8, 16), torch.randn(8, 16)
    cases = [(lambda a, b: (a * b + 1).relu().view(16, 8).t() - 2, 0),
             (lambda a, b: (a * b).sum(1), 1),
             (lambda a, b: (a @ b.t()).softmax(-1).to(torch.float64), 2)]
    for fn, breaks in cases:
        out = fn(fastlazy.lazy(a), fastlazy.lazy(b))
        assert kernel_breaks(debug._view(out)) == breaks, fn
        out.to_eager()


def test_a_failed_cpp_wrapper_compile_falls_back_to_the_python_wrapper(auto, monkeypatch):
    monkeypatch.setattr(tiering, "PROBE_RUNS", 2)
    asked = _record_wrappers(monkeypatch, fail_cpp=True)
    a, b = torch.randn(8, 16), torch.randn(8, 16)
    _compile_and_probe(a, b, two_kernels)
    assert asked == [True, False]
    assert fastlazy.metrics.counters()["tier_cpp_wrapper_failures"] == 1
    assert only_tier()["error"] is None


def test_inductor_tier_runs_a_new_shape_on_the_fast_tier_while_compiling(auto, monkeypatch):
    monkeypatch.setattr(tiering, "PROBE_RUNS", 2)
    # promote whatever the timings say: the point is the compiled tier's
    # handling of a shape it was not compiled for
    monkeypatch.setattr(tiering.TieredProgram, "_decide", _always_promote)
    a, b = torch.randn(8, 16), torch.randn(8, 16)
    run(a, b, 1)
    run(a, b, 1)
    assert tiering.wait(300)
    for _ in range(tiering.probe_calls()):
        run(a, b, 1)
    assert only_tier()["tier"] == "hot"
    fastlazy.metrics.reset()
    c, d = torch.randn(5, 16), torch.randn(5, 16)
    start = time.perf_counter()
    torch.testing.assert_close(run(c, d, 2), graph(c, d, 2))
    assert time.perf_counter() - start < 1.0, "the new shape waited for its compile"
    assert fastlazy.metrics.counters()["tier_fast_runs_while_compiling"] == 1
    assert tiering.wait(300)
    torch.testing.assert_close(run(c, d, 3), graph(c, d, 3))
    assert fastlazy.metrics.counters()["cache_misses"] == 0


def _always_promote(self):
    self.tier = "hot"
    self.call = self._compiled
    self._candidates = []


def test_a_program_does_not_wait_at_exit_for_the_compile_process():
    """A program whose last calls queued a compile of a large model must
    not wait at exit for the compile process (minutes for inception_v3):
    the compile is dropped, the child killed.  Here the child is one that
    never answers."""
    program = textwrap.dedent("""
        import subprocess, sys, time, torch, fastlazy
        from fastlazy import compile_process, tiering

        def never_answering_child():
            if compile_process._broken:
                raise compile_process.Unavailable("stopped earlier")
            compile_process._child = subprocess.Popen(
                [sys.executable, "-c", "import time; time.sleep(600)"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            return compile_process._child

        compile_process._ensure_child = never_answering_child
        tiering.ENGINE.hot_after, tiering.ENGINE.hot_seconds = 1, 0.0
        tiering.ENGINE.hot_min_run = 0.0
        fastlazy.enable(backend="auto")
        x = torch.randn(4, 8)
        for _ in range(2):
            (fastlazy.lazy(x) * 2).relu().sum().to_eager()
        deadline = time.time() + 60
        while compile_process._child is None and time.time() < deadline:
            time.sleep(0.05)      # until the compile thread has sent its job
        time.sleep(0.5)
        print("done", compile_process._child is not None)
    """)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "done True"
    assert time.perf_counter() - start < 60, "the exit waited for the compile process"


@pytest.mark.parametrize("delay", [0.0, 0.5, 1.5])
def test_a_program_that_ends_during_a_compile_exits_cleanly(delay):
    """The compile under way is waited for, queued ones are dropped; the
    process exits normally (a compiler thread cut off mid-way by the
    interpreter's teardown can abort it).  `delay`: how far into the
    compile the program ends."""
    program = textwrap.dedent(f"""
        import time, torch, fastlazy
        from fastlazy import tiering
        tiering.ENGINE.hot_after, tiering.ENGINE.hot_seconds = 1, 0.0
        tiering.ENGINE.hot_min_run = 0.0
        fastlazy.enable(backend="auto")
        for k in range(4):                 # four graphs queued for compiles
            x = torch.randn(4, 8)
            for _ in range(2):
                y = ((fastlazy.lazy(x) * 2).relu() - k).sum(k % 2).to_eager()
                y = [fastlazy.lazy(x).exp() for _ in range(k)]
        time.sleep({delay})
        print("done")
    """)
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "done"


def test_the_fast_tier_calls_what_the_first_run_left(auto, monkeypatch):
    """A backend's first run may replace its program's callable (the
    TorchScript backend does when the legacy executor's shape analysis
    rejects a graph): later runs must call the replacement."""
    monkeypatch.setattr(tiering.ENGINE, "hot_after", 1000)
    real = backends.get("torchscript").compile

    def replaced_at_first_run(view):
        program = real(view)
        good = program.call

        def stale(*inputs):
            raise AssertionError("called the callable the first run replaced")

        def first_call(*inputs):
            program.call = good
            return good(*inputs)
        program.call, program._first_call = stale, first_call
        return program
    monkeypatch.setattr(backends.get("torchscript"), "compile", replaced_at_first_run)
    a, b = torch.randn(4, 5), torch.randn(4, 5)
    for k in range(3):
        torch.testing.assert_close(run(a, b, float(k)), graph(a, b, float(k)))


# -- parameters frozen into the compiled program ------------------------------


_real_decide = tiering.TieredProgram._decide


def _prefer_frozen(self):
    """The probe's verdict: the frozen program, once it is a candidate (the
    second probation); the timings' verdict before."""
    frozen = [c for c in self._candidates if c.name == "compiled, parameters frozen"]
    if not frozen:
        return _real_decide(self)
    self.tier = "hot (compiled, parameters frozen)"
    self.call = self._compiled = frozen[0].call
    self._fallback = self._candidates[0].call
    self._candidates = []


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.fc = torch.nn.Linear(4 * 6 * 6, 5)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))


def _settled(net, x):
    """net's inference graph through its compile, its probation, its
    second compile (parameters frozen) and that one's probation."""
    with torch.no_grad():
        for _ in range(2):
            net(fastlazy.lazy(x)).to_eager()
        for _ in range(2):
            assert tiering.wait(300)
            for _ in range(tiering.probe_calls()):
                net(fastlazy.lazy(x)).to_eager()
        assert not tiering.unsettled(graph_cache.programs.values())


def _settled_on_frozen(monkeypatch, before_settling=lambda net: None):
    """A small conv net and its input, its graph settled on the program
    with its parameters frozen (the probe's verdict forced)."""
    monkeypatch.setattr(tiering, "PROBE_RUNS", 1)
    monkeypatch.setattr(tiering.TieredProgram, "_decide", _prefer_frozen)
    torch.manual_seed(0)
    net, x = _Net(), torch.randn(2, 3, 6, 6)
    before_settling(net)
    _settled(net, x)
    assert only_tier()["tier"] == "hot (compiled, parameters frozen)"
    return net, x


def _lazy_run(net, x):
    with torch.no_grad():
        return net(fastlazy.lazy(x)).to_eager()


def test_frozen_parameters_follow_writes_replacements_and_new_shapes(auto, monkeypatch):
    """A program compiled with the parameters as constants must never give
    a stale value: a parameter written in place, a parameter replaced, or
    an input of another shape runs elsewhere, with eager's values."""
    net, x = _settled_on_frozen(monkeypatch)
    with torch.no_grad():
        expected = net(x)
    torch.testing.assert_close(_lazy_run(net, x), expected)
    misses = fastlazy.metrics.counters()["tier_frozen_misses"]

    with torch.no_grad():
        net.conv.weight.mul_(2)                # written in place: a new version
        expected = net(x)
    torch.testing.assert_close(_lazy_run(net, x), expected)
    assert fastlazy.metrics.counters()["tier_frozen_misses"] == misses + 1
    assert only_tier()["tier"] == "hot", "a stale frozen program stayed in use"

    net.fc.weight = torch.nn.Parameter(torch.randn(5, 4 * 6 * 6))   # replaced
    with torch.no_grad():
        expected = net(x)
    torch.testing.assert_close(_lazy_run(net, x), expected)


@pytest.mark.parametrize("how", ["swap_tensors", "m.double() swapping"])
def test_frozen_parameters_can_be_swapped(auto, monkeypatch, how):
    """torch.utils.swap_tensors refuses a tensor with a weak reference, and
    a frozen program holds its parameters weakly: swapping one (as
    nn.Module._apply does under set_swap_module_params_on_conversion) must
    work as in eager, and the program give way to the new values."""
    net, x = _settled_on_frozen(monkeypatch)
    if how == "swap_tensors":
        torch.utils.swap_tensors(net.fc.weight, torch.nn.Parameter(torch.randn(5, 4 * 6 * 6)))
    else:
        monkeypatch.setattr(torch.__future__, "_swap_module_params_on_conversion", True)
        net.double()
        x = x.double()
    with torch.no_grad():
        expected = net(x)
    torch.testing.assert_close(_lazy_run(net, x), expected)


def _write_through_data(p):
    p.data.mul_(0.5)


def _write_through_a_storage(p):
    p.untyped_storage().fill_(0)


def _write_through_numpy(p):
    p.detach().numpy()[...] *= 0.5           # memory handed out, written later


def _write_through_torch_ops(p):
    torch.ops.aten.mul_.Tensor(p.data, torch.tensor(0.5))


@pytest.mark.parametrize("write", [_write_through_data, _write_through_a_storage,
                                   _write_through_numpy, _write_through_torch_ops])
def test_frozen_parameters_hear_writes_no_version_counter_sees(auto, monkeypatch, write):
    """Writes through a `.data` alias, a storage, NumPy or torch.ops bump
    no version counter of the parameter: the frozen program must still
    give way, or it computes with the old weights."""
    net, x = _settled_on_frozen(monkeypatch)
    assert _core.watched_storages() > 0
    version = net.conv.weight._version
    write(net.conv.weight)
    assert net.conv.weight._version == version, "this write is meant to be unversioned"
    with torch.no_grad():
        expected = net(x)
    torch.testing.assert_close(_lazy_run(net, x), expected)
    assert only_tier()["tier"] == "hot", "a stale frozen program stayed in use"


def test_a_parameter_handed_to_numpy_before_the_compile_is_not_frozen(auto, monkeypatch):
    """A NumPy array taken before the compile may write the parameter at
    any time, unseen: that parameter stays an input of the frozen program."""
    arrays = []
    net, x = _settled_on_frozen(
        monkeypatch, lambda net: arrays.append(net.conv.weight.detach().numpy()))
    arrays[0] *= 10
    with torch.no_grad():
        expected = net(x)
    torch.testing.assert_close(_lazy_run(net, x), expected)


def test_a_parameter_written_while_fastlazy_is_disabled_unfreezes(auto, monkeypatch):
    """disable() takes away the entry points that see writes: a frozen
    program cannot know what happens to its parameters until enable()."""
    net, x = _settled_on_frozen(monkeypatch)
    fastlazy.disable()
    try:
        net.conv.weight.data.mul_(0.5)
    finally:
        fastlazy.enable()
    with torch.no_grad():
        expected = net(x)
    torch.testing.assert_close(_lazy_run(net, x), expected)
    assert only_tier()["tier"] == "hot"


def test_dropped_frozen_programs_stop_watching(auto, monkeypatch):
    """The watch on frozen parameters ends with their program: a cache
    cleared leaves in-place writes nothing to report."""
    _settled_on_frozen(monkeypatch)
    assert _core.watched_storages() > 0
    fastlazy.graph_cache.clear()
    gc.collect()
    assert _core.watched_storages() == 0
    assert not _core.watching()


def test_the_frozen_compile_comes_second_and_no_call_waits_for_it(auto, monkeypatch):
    """An inference graph reading parameters settles on its compiled
    program (or the fast tier) first; the compile with its parameters
    frozen runs meanwhile, and its program goes on probation when ready."""
    monkeypatch.setattr(tiering, "PROBE_RUNS", 1)
    monkeypatch.setattr(tiering.TieredProgram, "_decide", _prefer_frozen)
    release = threading.Event()
    inductor = type(backends.get("inductor"))
    real = inductor.compile_frozen

    def held(self, view, frozen):
        assert release.wait(300)
        return real(self, view, frozen)
    monkeypatch.setattr(inductor, "compile_frozen", held)
    torch.manual_seed(0)
    net, x = _Net(), torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        want = net(x)
    for _ in range(2):
        _lazy_run(net, x)
    assert tiering.wait(300)                  # the first compile
    for _ in range(tiering.probe_calls()):
        torch.testing.assert_close(_lazy_run(net, x), want)
    first = only_tier()["tier"]
    assert first in ("hot", "fast (compiled was slower)"), first
    assert tiering.unsettled(graph_cache.programs.values()) == 1
    start = time.perf_counter()
    for _ in range(5):
        torch.testing.assert_close(_lazy_run(net, x), want)
    assert time.perf_counter() - start < 1.0, "a call waited for the frozen compile"
    assert only_tier()["tier"] == first
    release.set()
    assert tiering.wait(300)
    for _ in range(tiering.probe_calls()):
        torch.testing.assert_close(_lazy_run(net, x), want)
    assert only_tier()["tier"] == "hot (compiled, parameters frozen)"
    assert not tiering.unsettled(graph_cache.programs.values())
    assert fastlazy.metrics.counters()["tier_compiles_done"] == 2


def test_a_failed_frozen_compile_keeps_the_tier_in_use(auto, monkeypatch):
    monkeypatch.setattr(tiering, "PROBE_RUNS", 1)
    inductor = type(backends.get("inductor"))

    def broken(self, view, frozen):
        raise RuntimeError("no freezing here")
    monkeypatch.setattr(inductor, "compile_frozen", broken)
    torch.manual_seed(0)
    net, x = _Net(), torch.randn(2, 3, 6, 6)
    _settled(net, x)
    entry = only_tier()
    assert entry["tier"] in ("hot", "fast (compiled was slower)"), entry
    assert "no freezing here" in entry["error"]
    assert fastlazy.metrics.counters()["tier_frozen_compiles_failed"] == 1
    with torch.no_grad():
        torch.testing.assert_close(_lazy_run(net, x), net(x))


def test_frozen_program_sends_another_shape_elsewhere(auto, monkeypatch):
    monkeypatch.setattr(tiering, "PROBE_RUNS", 1)
    monkeypatch.setattr(tiering.TieredProgram, "_decide", _prefer_frozen)
    torch.manual_seed(0)
    net = _Net()
    _settled(net, torch.randn(2, 3, 6, 6))
    y = torch.randn(3, 3, 6, 6)
    misses = fastlazy.metrics.counters()["tier_frozen_misses"]
    start = time.perf_counter()
    out = _lazy_run(net, y)
    assert time.perf_counter() - start < 1.0, "the new shape waited for a compile"
    with torch.no_grad():
        torch.testing.assert_close(out, net(y))
    assert fastlazy.metrics.counters()["tier_frozen_misses"] == misses + 1
    assert only_tier()["tier"] == "hot (compiled, parameters frozen)"


def test_a_graph_that_takes_a_small_share_of_the_time_gets_no_frozen_compile(auto, monkeypatch):
    """The frozen compile costs the user's process seconds of its GIL: a
    graph whose runs took under FROZEN_MIN_SHARE of the time until its
    compile (the prefill of `generate`, once per 32 tokens) keeps the tier
    its first probation chose."""
    monkeypatch.setattr(tiering, "FROZEN_MIN_SHARE", 0.2)
    monkeypatch.setattr(tiering, "PROBE_RUNS", 1)
    torch.manual_seed(0)
    net, x = _Net(), torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        net(fastlazy.lazy(x)).to_eager()
        time.sleep(0.5)         # the program's other work, between the graph's runs
        net(fastlazy.lazy(x)).to_eager()
        assert tiering.wait(300)
        for _ in range(tiering.probe_calls()):
            net(fastlazy.lazy(x)).to_eager()
        assert tiering.wait(300)
    assert fastlazy.metrics.counters()["tier_compiles_queued"] == 1
    assert only_tier()["tier"] in ("hot", "fast (compiled was slower)")


def test_training_graphs_freeze_nothing(auto, monkeypatch):
    """Parameters that autograd differentiates change every step: a graph
    recorded with grad enabled gets no frozen candidate."""
    monkeypatch.setattr(tiering, "PROBE_RUNS", 1)
    seen = []
    real = tiering.TieredProgram._compile

    def spy(self, view, described, frozen):
        seen.append(frozen)
        return real(self, view, described, frozen)
    monkeypatch.setattr(tiering.TieredProgram, "_compile", spy)
    net, x = _Net(), torch.randn(2, 3, 6, 6)
    for _ in range(2):
        net(fastlazy.lazy(x)).sum().backward()
    assert tiering.wait(300)
    assert seen and all(f is None for f in seen)


def test_training_graphs_hand_back_gradients_in_the_parameters_layout(auto, monkeypatch):
    """A compiled training graph gives each weight's gradient in the
    weight's own layout, which autograd keeps as .grad instead of copying
    it at every step (inductor's channels-last convolutions gave them
    channels-last), and eager's gradients."""
    monkeypatch.setattr(tiering, "PROBE_RUNS", 1)
    monkeypatch.setattr(tiering.TieredProgram, "_decide", _always_promote)
    torch.manual_seed(0)
    net, x = _Net(), torch.randn(2, 3, 6, 6)
    for _ in range(2):
        net(fastlazy.lazy(x)).sum().backward()
    assert tiering.wait(300)
    for _ in range(tiering.probe_calls()):
        net(fastlazy.lazy(x)).sum().backward()
    assert only_tier()["tier"] == "hot"
    arrived = []
    net.conv.weight.register_hook(lambda g: arrived.append(g.stride()))
    net.zero_grad()
    net(fastlazy.lazy(x)).sum().backward()
    assert arrived == [net.conv.weight.stride()]
    got = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    net(x).sum().backward()                   # an eager input: eager's step
    for g, p in zip(got, net.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-5)


def _train_step(net, x):
    net.zero_grad()
    net(x).square().sum().backward()
    return [p.grad.clone() for p in net.parameters()]


def test_a_training_graph_keeps_its_gradients_at_a_new_shape_on_the_compiled_tier(
        auto, monkeypatch):
    """A smaller last batch: the hot training graph's program for the new
    shape, compiled in the background, still computes gradients (it was
    compiled from copies of the inputs that no longer required grad: an
    inference program, and backward raised)."""
    import copy
    monkeypatch.setattr(tiering, "PROBE_RUNS", 1)
    monkeypatch.setattr(tiering.TieredProgram, "_decide", _always_promote)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    twin = copy.deepcopy(net)
    x = torch.randn(4, 8)
    for _ in range(2):
        _train_step(net, fastlazy.lazy(x))
    assert tiering.wait(300)
    for _ in range(tiering.probe_calls()):
        _train_step(net, fastlazy.lazy(x))
    assert only_tier()["tier"] == "hot"
    fastlazy.metrics.reset()
    y = torch.randn(3, 8)
    _train_step(net, fastlazy.lazy(y))        # on the fast tier while it compiles
    assert fastlazy.metrics.counters()["tier_fast_runs_while_compiling"] == 1
    assert tiering.wait(300)
    got = _train_step(net, fastlazy.lazy(y))  # the new shape's compiled program
    assert fastlazy.metrics.counters()["tier_fast_runs_while_compiling"] == 1
    for g, w in zip(got, _train_step(twin, y)):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def _promoting(monkeypatch):
    monkeypatch.setattr(tiering, "PROBE_RUNS", 1)
    monkeypatch.setattr(tiering.TieredProgram, "_decide", _always_promote)
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def test_a_running_loss_beside_a_compiled_training_graph(auto, monkeypatch):
    """`running = running + loss.detach()`: the next step's graph reads the
    last loss detached, and its compiled program must not tie its backward
    to the last step's graph (backward raised 'Trying to backward through
    the graph a second time')."""
    net, x = _promoting(monkeypatch), torch.randn(3, 4)
    running, want = 0, 0.0
    for step in range(5 + tiering.probe_calls()):
        loss = net(fastlazy.lazy(x)).square().mean()
        loss.backward()
        running = running + loss.detach()
        want += float(net(x).square().mean())
        if step == 3:             # (steps 2 on record the same graph)
            assert tiering.wait(300)
    assert "hot" in [t["tier"] for t in graph_cache.tiers()]
    assert abs(float(running) - want) < 1e-4


def test_a_compiled_training_graph_backs_up_twice_with_retain_graph(auto, monkeypatch):
    """backward(retain_graph=True) and a second backward, as eager allows
    (AOT autograd's donated buffers refused it)."""
    import copy
    net, x = _promoting(monkeypatch), torch.randn(3, 4)
    twin = copy.deepcopy(net)
    for step in range(3 + tiering.probe_calls()):
        net.zero_grad()
        loss = net(fastlazy.lazy(x)).square().mean()
        loss.backward(retain_graph=True)
        loss.backward()
        if step == 1:
            assert tiering.wait(300)
    assert only_tier()["tier"] == "hot"
    twin(x).square().mean().backward()
    for p, q in zip(net.parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, 2 * q.grad, rtol=1e-4, atol=1e-6)


def _penalty_step(net, x, lazy):
    net.zero_grad()
    inp = x.detach().requires_grad_(True)
    out = net(fastlazy.lazy(inp) if lazy else inp).sum()
    (g,) = torch.autograd.grad(out, inp, create_graph=True)
    (g.square().sum() + out).backward()
    return [p.grad.clone() for p in net.parameters()]


def test_gradients_of_gradients_keep_training_graphs_on_the_fast_tier(auto, monkeypatch):
    """A gradient penalty (create_graph=True) differentiates the graph's
    backward, which a compiled training program cannot: training graphs
    stay on the fast tier from then on, with eager's gradients (the
    compiled tier raised 'does not currently support double backward')."""
    import copy
    net, x = _promoting(monkeypatch), torch.randn(3, 4)
    twin = copy.deepcopy(net)
    for step in range(3 + tiering.probe_calls()):
        got = _penalty_step(net, x, True)
        if step == 1:
            tiering.wait(300)
    assert {t["tier"] for t in graph_cache.tiers()} == {tiering.TWICE_DIFFERENTIATED}
    for g, w in zip(got, _penalty_step(twin, x, False)):
        assert torch.equal(g, w)


def _saliency_step(net, x, lazy):
    """Grad-CAM's pattern: gradients of a score with respect to an
    activation computed in the same graph, and the parameters'."""
    hidden = net[0](fastlazy.lazy(x) if lazy else x)
    score = net[1:](hidden).sum()
    return torch.autograd.grad(score, (hidden, net[0].weight))


def test_gradients_with_respect_to_a_pending_result_keep_training_graphs_fast(
        auto, monkeypatch):
    """In a compiled training graph the score and the activation are
    sibling outputs of one autograd node: eager's autograd.grad raised
    "appears to not have been used in the graph" once the graph went hot.
    Asked for gradients with respect to a pending result, training graphs
    stay on the fast tier, whose autograd is eager's op by op."""
    net, x = _promoting(monkeypatch), torch.randn(3, 4)
    want = _saliency_step(net, x, False)
    for step in range(3 + tiering.probe_calls()):
        got = _saliency_step(net, x, True)
        for g, w in zip(got, want):
            torch.testing.assert_close(g.to_eager() if type(g) is fastlazy.LazyTensor else g, w)
        if step == 1:
            tiering.wait(300)
    assert {t["tier"] for t in graph_cache.tiers()} == {tiering.INTERMEDIATES_DIFFERENTIATED}


def _gan_step(G, D, oG, oD, z):
    """A GAN's step: the discriminator's loss on the generator's output
    detached, backward and step; then the generator's loss through the
    discriminator, backward -- into the first graph's output `fake`."""
    fake = G(z)
    loss_d = D(fake.detach()).mean()
    oD.zero_grad()
    loss_d.backward()
    oD.step()
    loss_g = -D(fake).mean()
    oG.zero_grad()
    loss_g.backward()
    oG.step()
    return float(loss_d), float(loss_g)


def _gan():
    torch.manual_seed(0)
    G, D = torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)
    return G, D, torch.optim.SGD(G.parameters(), lr=0.1), torch.optim.SGD(D.parameters(), lr=0.1)


def test_outputs_differentiated_apart_keep_their_graph_fast(auto, monkeypatch):
    """`fake` and the discriminator's loss are outputs of one graph that
    eager differentiates apart: compiled, one autograd node, the first
    backward freed what the second needed ("Trying to backward through
    the graph a second time").  Such a graph stays on the fast tier; a
    graph whose outputs share their backward (a model's output and its
    loss) is compiled as before."""
    _promoting(monkeypatch)
    lazy_gan, eager_gan = _gan(), _gan()
    zs = [torch.randn(6, 4) for _ in range(3 + tiering.probe_calls())]
    for step, z in enumerate(zs):
        got = _gan_step(*lazy_gan, fastlazy.lazy(z))
        assert got == pytest.approx(_gan_step(*eager_gan, z), rel=1e-5)
        if step == 1:
            assert tiering.wait(300)
    for a, b in zip(lazy_gan[0].parameters(), eager_gan[0].parameters()):
        torch.testing.assert_close(a, b)
    tiers = [t["tier"] for t in graph_cache.tiers()]
    assert tiering.SEPARATE_BACKWARDS in tiers, tiers

    net, x = _promoting(monkeypatch), torch.randn(3, 4)
    graph_cache.clear()
    for step in range(3 + tiering.probe_calls()):
        out = net(fastlazy.lazy(x))
        loss = out.square().mean()
        loss.backward()
        assert out.requires_grad
        if step == 1:
            assert tiering.wait(300)
    assert only_tier()["tier"] == "hot"


def test_the_inductor_backend_runs_outputs_differentiated_apart_on_eagers():
    before = fastlazy.backend()
    fastlazy.set_backend("inductor")
    try:
        lazy_gan, eager_gan = _gan(), _gan()
        for _ in range(2):
            z = torch.randn(6, 4)
            assert _gan_step(*lazy_gan, fastlazy.lazy(z)) == pytest.approx(
                _gan_step(*eager_gan, z), rel=1e-5)
        assert fastlazy.metrics.fallbacks_by_op["compile:inductor:SeparateBackwards"] >= 1
    finally:
        fastlazy.set_backend(before)


def test_a_graph_run_under_inference_mode_runs_on_the_compiled_tier(auto, monkeypatch):
    """An inference graph is compiled as an inference program: a training
    one (its parameters require grad) saves activations, which autograd
    refuses for inference tensors."""
    monkeypatch.setattr(tiering, "PROBE_RUNS", 1)
    monkeypatch.setattr(tiering.TieredProgram, "_decide", _always_promote)
    torch.manual_seed(0)
    net, x = _Net(), torch.randn(2, 3, 6, 6)
    with torch.inference_mode():
        want = net(x)
        for _ in range(2):
            net(fastlazy.lazy(x)).to_eager()
        assert tiering.wait(300)
        for _ in range(tiering.probe_calls() + 1):
            got = net(fastlazy.lazy(x)).to_eager()
    assert only_tier()["tier"] == "hot"
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_a_parameter_written_during_probation_still_ends_it(auto, monkeypatch):
    """The frozen candidate turns stale mid-probe (its parameter written):
    the probe goes on without it and a tier is chosen, with eager's values."""
    monkeypatch.setattr(tiering, "PROBE_RUNS", 1)
    torch.manual_seed(0)
    net, x = _Net(), torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        for _ in range(2):
            net(fastlazy.lazy(x)).to_eager()
        assert tiering.wait(300)
        _lazy_run(net, x)                      # the first probe call
        assert only_tier()["tier"] == "probation"
        net.conv.weight.mul_(2)
        for _ in range(tiering.probe_calls()):
            torch.testing.assert_close(_lazy_run(net, x), net(x))
    assert only_tier()["tier"] != "probation"
    assert not only_tier()["tier"].startswith("hot (compiled, parameters frozen")


def test_a_thread_waiting_for_the_compile_threads_trace_lifts_its_throttle():
    # the compile thread holds the one-trace-at-a-time lock (fx_threads):
    # a user's first call that must trace waits for it, and meanwhile the
    # compile thread runs unthrottled, not through its sleeps
    from fastlazy import compile_worker, fx_threads
    assert fx_threads.install()
    holding, release = threading.Event(), threading.Event()

    def hold_the_trace_lock():
        with fx_threads._trace_lock:
            holding.set()
            release.wait(10)
    done = compile_worker.submit(hold_the_trace_lock)
    assert holding.wait(10)
    traced = []
    user = threading.Thread(target=lambda: traced.append(
        torch.fx.symbolic_trace(lambda x: x + 1)))
    user.start()
    deadline = time.monotonic() + 10
    while compile_worker._waiting == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    waiting = compile_worker._waiting
    release.set()
    done.result(10)
    user.join(10)
    assert waiting == 1 and traced
    assert compile_worker._waiting == 0


class _Collect(logging.Handler):
    """A handler on torch's inductor logger, standing in for the stderr
    handler torch._logging puts there (pytest captures that one's stream)."""

    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def inductor_handler():
    handler, logger = _Collect(), logging.getLogger("torch._inductor")
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


def test_torchs_warnings_during_a_background_compile_stay_off_stderr(inductor_handler,
                                                                    monkeypatch):
    """A compile the engine started on its own sends torch's log records
    below ERROR (inductor's "missing a c-shim implementation") to no
    handler; they are kept for fastlazy.compile_log.messages().  The user's
    own thread and errors are handled as before."""
    from fastlazy import compile_log, compile_worker
    monkeypatch.delenv("TORCH_LOGS", raising=False)
    logger = logging.getLogger("torch._inductor.ir")

    def compile_job():
        logger.warning("op %s is missing a c-shim implementation", "x.default")
        logger.error("a compile error")
    compile_worker.submit(compile_job).result(30)
    logger.warning("the user's own warning")
    assert inductor_handler.messages == ["a compile error", "the user's own warning"]
    assert compile_log.messages()[-1] == \
        "WARNING torch._inductor.ir: op x.default is missing a c-shim implementation"
    assert "missing a c-shim" in fastlazy.metrics.report()


def test_torch_logs_lets_the_compile_threads_warnings_through(inductor_handler, monkeypatch):
    from fastlazy import compile_worker
    monkeypatch.setenv("TORCH_LOGS", "+inductor")
    logger = logging.getLogger("torch._inductor.ir")
    compile_worker.submit(logger.warning, "asked for by TORCH_LOGS").result(30)
    assert inductor_handler.messages == ["asked for by TORCH_LOGS"]


FORKED_DURING_A_COMPILE = textwrap.dedent("""
    import os, torch, fastlazy
    from fastlazy import graph_cache, tiering
    tiering.ENGINE.hot_after, tiering.ENGINE.hot_seconds = 1, 0.0
    tiering.ENGINE.hot_min_run = 0.0
    fastlazy.enable(backend="auto")
    a = torch.randn(6, 7)

    def f(x, k):
        return ((x * k + 1).sigmoid() - x).sum(0)

    for k in (0.5, 1.5):                  # the second run queues the compile
        f(fastlazy.lazy(a), k).to_eager()
    (entry,) = graph_cache.tiers()
    assert entry["tier"] == "compiling", entry
    pid = os.fork()
    if pid == 0:
        try:
            for k in range(5):
                torch.testing.assert_close(f(fastlazy.lazy(a), k / 3).to_eager(), f(a, k / 3))
            (entry,) = graph_cache.tiers()
            os._exit(0 if entry["tier"].startswith("fast (its compile") else 3)
        except BaseException:
            import traceback
            traceback.print_exc()
            os._exit(4)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, os.waitstatus_to_exitcode(status)
    assert tiering.wait(300)
    for k in range(tiering.probe_calls() + 1):
        torch.testing.assert_close(f(fastlazy.lazy(a), k / 3).to_eager(), f(a, k / 3))
    (entry,) = graph_cache.tiers()
    assert not entry["tier"].startswith("fast (its compile"), entry
    print("ok")
""")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_compile_under_way_at_a_fork_leaves_the_childs_graph_on_the_fast_tier():
    """The compile thread stays behind in a forked child: its compile there
    never finishes, so the child's graph stays on the fast tier for good
    (said in its tier) and computes eager's values; the parent's compile
    goes on."""
    done = subprocess.run([sys.executable, "-c", FORKED_DURING_A_COMPILE], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")


def _results_changed(stand_in, monkeypatch, change):
    """The stand-in's compiled programs give change(result) for each result
    (a lowering that computes something else than the graph)."""
    real_compile = stand_in.compile

    def changed(view, replay=None, on_replay=None):
        program = real_compile(view, replay, on_replay)
        inner = program.call

        class Call:
            def warm(self, examples):
                inner.warm(examples)

            def __call__(self, *inputs):
                return [change(o) for o in inner(*inputs)]
        program.call = Call()
        return program
    monkeypatch.setattr(stand_in, "compile", changed)


def test_a_compiled_program_with_other_result_dtypes_is_left_out(auto, scripted, monkeypatch):
    """Inductor computes any/all of a uint8 tensor as bool where eager
    gives uint8: a candidate whose results' dtypes differ from the fast
    tier's is dropped at its first probe run, and that run's result comes
    from the fast tier."""
    _results_changed(scripted(), monkeypatch, lambda o: o.bool())
    m = torch.tensor([[0, 2], [0, 4]], dtype=torch.uint8)
    want = m.any(0)
    for _ in range(3):
        assert torch.equal(fastlazy.lazy(m).any(0).to_eager(), want)
    assert tiering.wait(30)
    for _ in range(tiering.probe_calls() + 3):
        got = fastlazy.lazy(m).any(0).to_eager()
        assert got.dtype == torch.uint8 and torch.equal(got, want)
    entry = only_tier()
    assert entry["tier"] == "fast (compiled results differ)", entry
    assert fastlazy.metrics.counters()["tier_wrong_dtypes"] == 1


@pytest.mark.parametrize("grad", [False, True])
def test_a_compiled_program_computing_other_values_is_left_out(auto, scripted, monkeypatch, grad):
    """A lowering that computes other values than the graph (torch.compile's
    own multilabel_margin_loss, an int8 cast that saturates) is found by
    its first probe run, checked against the fast tier's on the same inputs:
    it is dropped, and every result, that run's too, is the fast tier's."""
    _results_changed(scripted(), monkeypatch, lambda o: o * 1.05)
    x = torch.linspace(-1, 2, 8)       # (a sum far from 0: its forward differs too)
    eager_x = x.clone().requires_grad_(grad)
    want = (eager_x * 3).tanh()
    if grad:
        want.sum().backward()
    want = want.detach()

    def step():
        lx = fastlazy.lazy(x.clone()).requires_grad_(grad)
        y = (lx * 3).tanh()
        got = y.to_eager().detach()
        if grad:
            y.sum().backward()
            assert torch.equal(lx.grad, eager_x.grad)
        return got
    for _ in range(3):
        assert torch.equal(step(), want)
    assert tiering.wait(30)
    for _ in range(tiering.probe_calls() + 3):
        assert torch.equal(step(), want)
    for entry in graph_cache.tiers():      # (the training step's sum has a graph too)
        assert entry["tier"] == "fast (compiled results differ)", entry
        assert "results differ" in entry["error"]
    assert fastlazy.metrics.counters()["tier_wrong_results"] == len(graph_cache.tiers())


def test_requires_grad_on_a_lazy_tensor_makes_its_graphs_training_graphs(auto):
    x = fastlazy.lazy(torch.tensor([1.0, 2.0]))
    x.requires_grad_()
    y = x * x
    assert y.requires_grad and x.requires_grad
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.tensor([2.0, 4.0]))


def test_jobs_run_beside_share_one_thread_with_the_callers_thread_count():
    # one thread, started by enable(), serves every job (a thread started
    # per job cost the caller up to 0.3 ms); each job runs with the
    # intra-op thread count its caller had, and its arguments are let go
    # when it ends
    import gc
    import threading
    import weakref
    from fastlazy import compile_worker

    class Held:
        pass

    def job(held):
        return threading.get_ident(), torch.get_num_threads()
    before = torch.get_num_threads()
    try:
        seen = []
        for threads in (1, 2, 1):
            torch.set_num_threads(threads)
            held = Held()
            alive = weakref.ref(held)
            seen.append(compile_worker.run_beside(job, held).result(30))
            del held
            gc.collect()
            assert alive() is None
    finally:
        torch.set_num_threads(before)
    idents = {ident for ident, _ in seen}
    assert len(idents) == 1 and threading.get_ident() not in idents
    assert [n for _, n in seen] == [1, 2, 1]


def test_wait_counts_a_finished_job_whose_done_callback_has_not_run():
    # a job's future wakes its waiters before its done-callbacks run, so
    # tiering.wait can see a finished job still listed as queued beside the
    # user's thread (a CI run's wait returned False on a finished packing);
    # this is that window, held open
    import concurrent.futures
    from fastlazy import compile_worker
    finished = concurrent.futures.Future()
    finished.set_result(None)
    compile_worker._beside.add(finished)
    try:
        assert tiering.wait(30)
    finally:
        compile_worker._beside.discard(finished)
    unfinished = concurrent.futures.Future()
    compile_worker._beside.add(unfinished)
    try:
        assert not tiering.wait(0.2)
    finally:
        compile_worker._beside.discard(unfinished)


@pytest.mark.skipif(not step_executor.enabled(), reason="the step executor's runs lend the GIL")
def test_a_job_run_beside_borrows_the_gil_only_while_the_users_runs_lend_it():
    # the job's Python runs while the user's graph runs its kernels without
    # the GIL, and lets go of it the moment the run ends: with the switch
    # interval at 50 ms, a run that had to win the GIL back from the job
    # (or that took the GIL in its middle, to let go of an input's Python
    # object) would take 50 ms
    from fastlazy import compile_worker
    a = torch.randn(512, 512)

    def call():
        x = fastlazy.lazy(a)
        return (x @ x).relu().to_eager()
    for _ in range(5):
        call()      # (a run lets go of the GIL where the last took 100 us)
    busy = [True]

    def python_until_told():
        n = 0
        while busy[0]:
            n += len(str(n))
        return n
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.05)
    try:
        done = compile_worker.run_beside(python_until_told)
        times = []
        for _ in range(30):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        busy[0] = False
        done.result(30)
    finally:
        busy[0] = False
        sys.setswitchinterval(interval)
    assert done.result() > 0
    assert sorted(times)[15] < 0.025, sorted(times)


def test_a_job_run_beside_does_not_hold_its_caller():
    # a job whose Python runs long before it first lets go of the GIL must
    # not keep the caller waiting for the switch interval (set to a second
    # here, so that the wait, if any, stands out from a loaded machine's
    # scheduling): Thread.start() waited for a new thread to begin
    import sys
    import time
    from fastlazy import compile_worker

    def python_for_half_a_second():
        end = time.perf_counter() + 0.5
        while time.perf_counter() < end:
            pass
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1.0)
    try:
        start = time.perf_counter()
        done = compile_worker.run_beside(python_for_half_a_second)
        took = time.perf_counter() - start
        done.result(30)
    finally:
        sys.setswitchinterval(interval)
    assert took < 0.25
