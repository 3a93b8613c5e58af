"""Deep graphs: no walk may recurse per node, on the C stack or Python's.

A chain of 30,000 dependent ops under a raised flush threshold, or of 9,999
at the default one in a thread with a 2 MB stack, once crashed TorchScript's
code emitter (it recursed per node).  A graph deeper than a backend takes
now runs on the native backend (graph_cache._choose); the core's own walks
(keying, killing dead nodes) are loops.  Each backend's cases run in a
subprocess with a timeout, so a crash fails the test instead of the suite.
"""
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROGRAM = textwrap.dedent("""
    import threading, torch, fastlazy
    fastlazy.enable(backend={backend!r})

    def chain(n, start=0.0):
        x = fastlazy.lazy(torch.full((3,), start))
        for _ in range(n):
            x = x + 1
        return x

    # 1. one graph of 30,000 dependent nodes
    fastlazy.set_flush_threshold(10**9)
    assert chain(30000)[0].item() == 30000.0
    print("chain", flush=True)

    # 2. in-place ops rebinding one handle, and a generic op in the chain
    x = fastlazy.lazy(torch.zeros(4))
    for i in range(10000):
        x.add_(1)
        if i % 1000 == 0:
            x = x.roll(1)
    assert torch.equal(x.to_eager(), torch.full((4,), 10000.0))
    print("in-place", flush=True)

    # 3. autograd through a deep chain
    w = torch.ones(3, requires_grad=True)
    y = fastlazy.lazy(w)
    for _ in range(5000):
        y = y * 1.0 + 0.0
    y.sum().backward()
    assert torch.equal(w.grad, torch.ones(3)), w.grad
    print("backward", flush=True)

    # 4. a deep chain discarded: its nodes die one after the other (a loop)
    x = chain(30000)
    del x
    assert fastlazy._core.pending_nodes() == 0, fastlazy._core.pending_nodes()
    print("discarded", flush=True)

    # 5. the default threshold, in a thread with a 2 MB stack
    fastlazy.set_flush_threshold(10000)
    got = []
    threading.stack_size(2 * 1024 * 1024)
    t = threading.Thread(target=lambda: got.append(chain(9999)[0].item()))
    t.start()
    t.join()
    assert got == [9999.0], got
    print("thread", flush=True)
""")


@pytest.mark.parametrize("backend", ["torchscript", "native", "eager", "inductor"])
def test_deep_chains_do_not_crash(backend):
    done = subprocess.run([sys.executable, "-c", PROGRAM.format(backend=backend)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, (f"exit {done.returncode} after: {done.stdout.split()}\n"
                                  f"{done.stderr[-3000:]}")
    assert done.stdout.split() == ["chain", "in-place", "backward", "discarded", "thread"]


def test_depth_is_measured_without_recursion():
    import torch

    import fastlazy
    from fastlazy import _core
    from fastlazy.graph import GraphView
    with fastlazy.enable():
        before = _core.get_flush_threshold()
        _core.set_flush_threshold(10**9)
        try:
            x = fastlazy.lazy(torch.zeros(2))
            y = x * 2
            for _ in range(5000):
                x = x + 1
            seg, index = _core.pending_in(x)
            assert GraphView(seg, [index]).depth() == 5000
            assert GraphView(seg, [_core.pending_in(y)[1]]).depth() == 1
        finally:
            _core.set_flush_threshold(before)
            fastlazy.mark_step()


@pytest.mark.parametrize("backend", ["torchscript", "native", "eager"], indirect=True)
def test_a_deep_graph_leaves_torchscript(lazy_on, backend):
    import torch

    import fastlazy
    x = fastlazy.lazy(torch.zeros(2))
    for _ in range(1500):
        x = x + 1
    assert torch.equal(x.to_eager(), torch.full((2,), 1500.0))
    # deeper than TorchScript's max_depth (1,000): run natively
    assert fastlazy.metrics.counters()["deep_graphs"] == (backend == "torchscript")
