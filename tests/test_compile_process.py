"""Background compiles of CPU graphs run in a child process (no compiler
shares the user's GIL); a job that cannot go there is compiled on the
compile thread as before, and every value stays eager's."""
import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch

import fastlazy
from fastlazy import compile_process, graph_cache, tiering
from fastlazy import inductor_graph
from fastlazy.backends import inductor

from helpers import fastlazy_enabled  # noqa: F401  (module-scoped enable)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def auto(auto, monkeypatch):
    """conftest's tiered engine, with short probes; every compile done at
    the end."""
    monkeypatch.setattr(tiering, "PROBE_RUNS", 2)
    yield
    assert tiering.wait(300)


def graph(a, b, k):
    return ((a * b + k).sigmoid() * 3 - a).sum(1)


def other_graph(a, b, k):
    return (a - b * k).tanh().sum(0)


def run_until_settled(a, b, f=graph):
    """f's runs until its background compile is done and its probe over,
    every value checked against eager's."""
    for k in (0.5, 1.5):
        torch.testing.assert_close(f(fastlazy.lazy(a), fastlazy.lazy(b), k).to_eager(), f(a, b, k))
    assert tiering.wait(300)
    for k in range(tiering.probe_calls() + 2):
        torch.testing.assert_close(f(fastlazy.lazy(a), fastlazy.lazy(b), k / 3).to_eager(),
                                   f(a, b, k / 3))


def counted(name):
    return fastlazy.metrics.counters()[name]


def test_a_background_compile_runs_in_the_child(auto):
    run_until_settled(torch.randn(8, 16), torch.randn(8, 16))
    assert counted("tier_compiles_in_child") == 1, compile_process.last_error
    assert counted("tier_child_compile_fallbacks") == 0
    assert graph_cache.tiers()[0]["tier"] in ("hot", "fast (compiled was slower)")


def test_a_job_the_child_fails_is_compiled_on_the_thread(auto, monkeypatch):
    monkeypatch.setattr(compile_process, "_ask", lambda job: {"error": "ValueError: no"})
    run_until_settled(torch.randn(8, 16), torch.randn(8, 16))
    assert counted("tier_compiles_in_child") == 0
    assert counted("tier_child_compile_fallbacks") == 1
    assert "ValueError: no" in compile_process.last_error
    assert counted("tier_compiles_done") == 1 and counted("tier_compiles_failed") == 0


def test_a_child_that_dies_mid_job_is_not_used_again(auto, monkeypatch):
    monkeypatch.setattr(compile_process, "_child", None)
    monkeypatch.setattr(compile_process, "_broken", False)

    def cut(stream):
        raise EOFError("no answer")
    monkeypatch.setattr(compile_process, "_receive", cut)
    run_until_settled(torch.randn(8, 16), torch.randn(8, 16))
    assert compile_process._broken and compile_process._child is None
    assert counted("tier_child_compile_fallbacks") == 1
    # the next graph does not try
    run_until_settled(torch.randn(4, 5), torch.randn(4, 5), other_graph)
    assert counted("tier_child_compile_fallbacks") == 2
    assert "stopped" in compile_process.last_error


def test_the_child_can_be_turned_off(auto, monkeypatch):
    monkeypatch.setenv("FASTLAZY_COMPILE_PROCESS", "0")
    run_until_settled(torch.randn(8, 16), torch.randn(8, 16))
    assert counted("tier_compiles_in_child") == counted("tier_child_compile_fallbacks") == 0
    assert counted("tier_compiles_done") == 1


def test_a_graph_reading_parameters_keeps_its_frozen_candidate(auto):
    # the plain candidate comes from the child; the frozen one cannot (its
    # folded parameters do not save) and is compiled on the thread
    layer = torch.nn.Linear(16, 8)
    x = torch.randn(4, 16)
    with torch.no_grad():
        want = torch.relu(layer(x))
        for _ in range(2 + tiering.probe_calls() * 3):
            got = torch.relu(layer(fastlazy.lazy(x))).to_eager()
            torch.testing.assert_close(got, want)
            tiering.wait(300)
    assert counted("tier_compiles_in_child") == 1, compile_process.last_error
    assert counted("tier_frozen_compiles_failed") == 0
    assert counted("tier_child_compile_fallbacks") == 0


FORKED = textwrap.dedent("""
    import os, sys, traceback, torch, fastlazy
    from fastlazy import compile_process, tiering
    fastlazy.enable(backend="auto")
    tiering.ENGINE.hot_after, tiering.ENGINE.hot_seconds = 1, 0.0
    tiering.ENGINE.hot_min_run = 0.0
    a = torch.randn(8, 16)

    def settle(f):
        for k in (0.5, 1.5):
            f(fastlazy.lazy(a), k).to_eager()
        assert tiering.wait(300)
        for k in range(tiering.probe_calls() + 2):
            torch.testing.assert_close(f(fastlazy.lazy(a), k / 3).to_eager(), f(a, k / 3))

    def in_child():
        return fastlazy.metrics.counters()["tier_compiles_in_child"]

    settle(lambda a, k: ((a * k + 1).sigmoid() - a).sum())
    parents = compile_process._child.pid
    before = in_child()
    pid = os.fork()
    if pid == 0:
        try:
            settle(lambda a, k: (a - k).tanh().sum(0))
            ok = compile_process._child.pid != parents and in_child() == before + 1
            os._exit(0 if ok else 3)
        except BaseException:
            traceback.print_exc()
            os._exit(4)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, os.waitstatus_to_exitcode(status)
    settle(lambda a, k: (a * a + k).cos().sum(1))      # the parent's pipe is its own still
    assert in_child() == before + 1, fastlazy.metrics.counters()
    assert fastlazy.metrics.counters()["tier_child_compile_fallbacks"] == 0
    print("ok")
""")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_process_compiles_in_a_child_of_its_own():
    # fork copies only the forking thread: the compile thread, the parent's
    # compile process and its pipes, and any lock they held stay behind
    done = subprocess.run([sys.executable, "-c", FORKED], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")


def test_a_graph_view_travels_to_the_child_and_builds_the_same_fx_graph(auto, monkeypatch):
    """The child builds the FX graph from the graph's view (no GIL time in
    the user's process for it): the view's nodes -- op-table rows, captured
    aten programs, casts, scalars -- pickle, and the FX graph built from
    the copy is the one built here; the compile goes through the child."""
    import pickle
    views = []
    real = inductor.InductorBackend.compile
    monkeypatch.setattr(inductor.InductorBackend, "compile",
                        lambda self, view, *a, **k: views.append(view) or real(self, view, *a, **k))

    def f(a, b, k):
        h = torch.nn.functional.layer_norm(a * k + b, (4,)).view(-1, 2, 2)
        return (h.transpose(1, 2).softmax(-1) + (b > 0).to(torch.float32).view(-1, 2, 2)).sum(1)

    a, b = torch.randn(3, 4), torch.randn(3, 4)
    before = counted("tier_compiles_in_child")
    run_until_settled(a, b, f)
    assert views
    for view in views:
        copy = pickle.loads(compile_process._pickled_view(view))
        built = torch.fx.GraphModule(torch.nn.Module(), inductor_graph.build_fx(copy)).code
        assert built == torch.fx.GraphModule(torch.nn.Module(), inductor_graph.build_fx(view)).code
    assert counted("tier_compiles_in_child") > before, compile_process.last_error


def test_the_norms_dynamo_traces_warn_the_user_of_nothing():
    """inductor_graph's layer_norm and batch_norm with eps a tensor are
    traced by dynamo in a dynamic-shape compile: a call there to an
    lru_cache-wrapped helper made dynamo warn the user at every compile."""
    import warnings
    x, w, b = torch.randn(2, 3, 8), torch.randn(8), torch.randn(8)
    mean, var = torch.randn(3), torch.rand(3) + 0.5
    eps = torch.tensor(1e-5)
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ln = torch.compile(inductor_graph._layer_norm_of, backend="eager")(x, [8], w, b, eps)
        bn = torch.compile(inductor_graph._batch_norm_of, backend="eager")(
            x, None, None, mean, var, False, 0.1, eps, False)
    assert not [w for w in seen if "lru_cache" in str(w.message)]
    torch.testing.assert_close(ln, torch.nn.functional.layer_norm(x, [8], w, b, 1e-5))
    torch.testing.assert_close(bn, torch.nn.functional.batch_norm(x, mean, var, eps=1e-5))


ANSWER_LOST = textwrap.dedent("""
    import torch, fastlazy
    from fastlazy import compile_process, tiering

    received = compile_process._receive
    def lost(stream):                       # the child saved, its answer is lost
        received(stream)
        raise EOFError("the answer was lost")
    compile_process._receive = lost
    fastlazy.enable()
    tiering.ENGINE.hot_after, tiering.ENGINE.hot_seconds, tiering.ENGINE.hot_min_run = 1, 0.0, 0.0
    a, b = torch.randn(8, 16), torch.randn(8, 16)
    for _ in range(3):
        ((fastlazy.lazy(a) * b + 1).sigmoid() - a).sum(1).to_eager()
    assert tiering.wait(300)
    assert "answer was lost" in compile_process.last_error, compile_process.last_error
    print("exiting")
""")


def test_an_artifact_whose_answer_never_arrived_is_removed_at_exit(tmp_path):
    # the child saves each artifact in a folder of this process's, which
    # its exit removes, whatever became of the answer that named the file
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    env = dict(os.environ, TMPDIR=str(tmp_path), TORCHINDUCTOR_CACHE_DIR=cache_dir())
    done = subprocess.run([sys.executable, "-c", ANSWER_LOST], capture_output=True,
                          text=True, timeout=600, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("exiting")
    assert [name for name in os.listdir(tmp_path) if "fastlazy" in name] == []


def test_a_hot_program_refuses_a_negative_index_as_eager_does(auto, monkeypatch):
    """The compile in the child sees a view whose tensors are metadata;
    the graph's devices travel with it, so a CPU graph keeps its index
    checks (host_checks.NON_NEGATIVE_INDICES), and once the compiled
    program serves, `index_select(0, [-1])` raises eager's IndexError where
    inductor's lowering read the last row."""
    from test_tiering import _slow_fast_tier
    _slow_fast_tier(monkeypatch, 0.002)          # (the compiled program wins)
    views = []
    real = inductor.InductorBackend.compile
    monkeypatch.setattr(inductor.InductorBackend, "compile",
                        lambda self, view, *a, **k: views.append(view) or real(self, view, *a, **k))

    def f(a, index, k):
        return ((a * k).index_select(0, index) + 1).sum(1)

    a = torch.randn(6, 4)
    run_until_settled(a, torch.tensor([5, 0, 2]), f)
    assert graph_cache.tiers()[0]["tier"] == "hot", graph_cache.tiers()
    assert views and all(v.device_types == {"cpu"} for v in views)
    assert "int_values_within" in str(inductor_graph.build_fx(
        pickle.loads(compile_process._pickled_view(views[0]))))
    bad = torch.tensor([1, -1])
    with pytest.raises(IndexError, match="index out of range in self"):
        f(a, bad, 1.0)
    with pytest.raises(IndexError, match="index out of range in self"):
        f(fastlazy.lazy(a), fastlazy.lazy(bad), 1.0).to_eager()
    ok = torch.tensor([3, 4])
    torch.testing.assert_close(f(fastlazy.lazy(a), fastlazy.lazy(ok), 1.0).to_eager(), f(a, ok, 1.0))
