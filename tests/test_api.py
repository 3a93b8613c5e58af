"""The torch._lazy-shaped API, debugging views, step closures, autograd."""
import threading

import pytest
import torch

import fastlazy

pytestmark = pytest.mark.usefixtures("lazy_on")


def test_mark_step_runs_step_closures_after_computing():
    a = fastlazy.lazy(torch.rand(3))
    r = a * 2
    seen = []
    fastlazy.add_step_closure(lambda t: seen.append(t.is_materialized), args=(r,))
    assert not seen
    fastlazy.mark_step()
    assert seen == [True]
    fastlazy.mark_step()
    assert seen == [True]          # run once


def test_async_step_closures_run_in_order_on_a_worker():
    order, threads = [], set()
    for i in range(5):
        fastlazy.add_step_closure(lambda i: (order.append(i), threads.add(
            threading.current_thread().name)), args=(i,), run_async=True)
    fastlazy.mark_step(wait=True)
    assert order == list(range(5)) and threads == {"fastlazy-step-closures"}


def test_async_closure_errors_reach_the_caller():
    def boom():
        raise ValueError("in closure")
    fastlazy.add_step_closure(boom, run_async=True)
    fastlazy.mark_step()
    with pytest.raises(RuntimeError, match="asynchronous step closure") as info:
        fastlazy.wait_device_ops()
    assert isinstance(info.value.__cause__, ValueError)


def test_sync_multi_and_to_cpu():
    a = fastlazy.lazy(torch.rand(3))
    x, y = a + 1, a * 3
    fastlazy.sync_multi([x])
    assert x.is_materialized
    tree = fastlazy.to_cpu({"x": x, "pair": (y, 5)})
    assert type(tree["x"]) is torch.Tensor and tree["pair"][1] == 5
    assert torch.equal(tree["pair"][0], a.to_eager() * 3)


def test_metrics_torch_lazy_names():
    (fastlazy.lazy(torch.rand(2)) + 1).to_eager()
    names = fastlazy.metrics.counter_names()
    assert "nodes_recorded" in names and "flushes" in names
    assert fastlazy.metrics.counter_value("nodes_recorded") == 1
    assert fastlazy.metrics.counter_value("no such counter") is None
    assert "cache_misses" in fastlazy.metrics.metrics_report()


def test_pending_graph_and_dot():
    a = fastlazy.lazy(torch.rand(2, 3))
    r = (a * 2).relu()
    text = fastlazy.debug.pending_graph()
    assert "mul(" in text and "relu(" in text and "output" in text
    assert "relu(" in fastlazy.debug.dump_ir([r], "text")
    assert "aten::relu" in fastlazy.debug.dump_ir([r], "backend")
    dot = fastlazy.debug.render_ir_graph([r])
    assert dot.startswith("digraph") and "->" in dot
    with pytest.raises(ValueError):
        fastlazy.debug.dump_ir([r], "hlo")


def test_compiled_graph_of_a_tensor():
    a = fastlazy.lazy(torch.rand(2))
    r = a.exp() + 1
    with pytest.raises(ValueError, match="not computed yet"):
        fastlazy.debug.compiled_graph(r)
    r.to_eager()
    assert "aten::exp" in fastlazy.debug.compiled_graph(r)
    with pytest.raises(ValueError, match="not computed by a graph"):
        fastlazy.debug.compiled_graph(a)


def test_sync_mode_runs_each_op_at_its_call(tmp_path):
    import subprocess
    import sys
    code = ("import torch, fastlazy\n"
            "fastlazy.enable()\n"
            "a = fastlazy.lazy(torch.arange(4))\n"
            "b = a * 2\n"
            "assert b.is_materialized and fastlazy.backend() == 'eager'\n"
            "print('ok')\n")
    env = dict(__import__("os").environ, FASTLAZY_SYNC="1", FASTLAZY_METRICS="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok") and "fastlazy metrics" in out.stdout


@pytest.mark.parametrize("name", ["torchscript", "eager"])
def test_gradients_through_recorded_ops(name):
    fastlazy.set_backend(name)
    try:
        w = torch.randn(4, requires_grad=True)
        x = fastlazy.lazy(torch.randn(4))
        y = ((x * w + 1).tanh() * 2 - 0.5) ** 2
        assert y.requires_grad
        with torch.no_grad():
            z = x * w
            assert not z.requires_grad
            y.to_eager()       # read under no_grad: keeps its history
        y.sum().backward()
        we = w.detach().clone().requires_grad_()
        xe = x.to_eager()
        (((xe * we + 1).tanh() * 2 - 0.5) ** 2).sum().backward()
        torch.testing.assert_close(w.grad, we.grad)
        assert not z.to_eager().requires_grad
    finally:
        fastlazy.set_backend("torchscript")


def test_explain_lists_fallbacks_with_reasons():
    assert "recorded" in fastlazy.explain()
    x = fastlazy.lazy(torch.rand(4))
    torch.cumsum(x, 0)                    # no row: recorded by the generic path
    torch.nonzero(x)                      # data-dependent shape: eager
    torch.bernoulli(x)                    # random, drawn from the values: eager
    torch.add(x, x, out=torch.empty(4))   # an argument pattern rules do not take
    with pytest.raises(TypeError):
        torch.maximum(x, 2)               # eager refuses it, at the call
    text = fastlazy.explain()
    assert "cumsum" not in text
    assert "nonzero" in text and "depends on the data" in text
    assert "bernoulli" in text and "random" in text
    assert "torch.add" in text and "aten.add.out mutates its input" in text
    assert "torch.maximum" in text and "eager judges the arguments" in text
