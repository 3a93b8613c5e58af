"""The pool of large CPU buffers for recorded backwards (fastlazy.cpu_pool,
csrc/cpu_pool.h): a training loop's buffers come back from the pool, the
values are eager's, eager's own allocations never touch it, the cap holds,
and pooled buffers may be freed on any thread and after a fork."""
import os
import subprocess
import sys
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fastlazy
from fastlazy import cpu_pool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(cpu_pool.why_not() is not None,
                                reason=f"no CPU pool here: {cpu_pool.why_not()}")


def _model(seed=0):
    """Weights whose gradients are pooled (a 128x512 float32 weight is
    256 KiB, over the pool's 128 KiB floor)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(64, 64, 3, padding=1), nn.Flatten(),
                         nn.Linear(64 * 8 * 8, 128), nn.ReLU(), nn.Linear(128, 10))


def _train(model, x, y, wrap, steps=3):
    """Losses, then the parameters and their gradients after `steps` SGD
    steps on inputs wrap(x), wrap(y)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = F.cross_entropy(model(wrap(x)), wrap(y))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()], \
        [p.grad.clone() for p in model.parameters()]


def test_a_training_loop_takes_its_buffers_back_from_the_pool(lazy_on):
    x, y = torch.randn(2, 3, 8, 8), torch.tensor([1, 7])
    eager = _train(_model(), x, y, lambda t: t)
    before = cpu_pool.stats() or dict.fromkeys(("hits", "misses", "returned"), 0)
    lazy = _train(_model(), x, y, fastlazy.lazy)
    after = cpu_pool.stats()
    # the second and third steps' gradients reuse the first's buffers
    assert after["hits"] - before["hits"] >= 2 * 2
    assert after["returned"] > before["returned"]
    # eager's kernels on both sides: the same values, bit for bit
    assert eager[0] == lazy[0]
    for a, b in zip(eager[1] + eager[2], lazy[1] + lazy[2]):
        assert torch.equal(a, b)


def test_eager_backwards_and_eager_allocations_do_not_use_the_pool(lazy_on):
    x, y = torch.randn(2, 3, 8, 8), torch.tensor([1, 7])
    _train(_model(), x, y, fastlazy.lazy, steps=1)      # the pool is there
    before = cpu_pool.stats()
    _train(_model(), x, y, lambda t: t, steps=2)
    big = torch.empty(1 << 20)
    del big
    after = cpu_pool.stats()
    assert (after["hits"], after["misses"]) == (before["hits"], before["misses"])


def test_autograd_grad_of_lazy_outputs_uses_the_pool(lazy_on):
    w = torch.randn(256, 256, requires_grad=True)
    before = cpu_pool.stats() or {"hits": 0, "misses": 0}
    for _ in range(2):
        x = fastlazy.lazy(torch.randn(256, 256))
        (g,) = torch.autograd.grad((x @ w).sum(), w)
        assert torch.equal(g, torch.autograd.grad((x.to_eager() @ w).sum(), w)[0])
        del g
    after = cpu_pool.stats()
    assert after["hits"] + after["misses"] > before["hits"] + before["misses"]


def test_the_cap_bounds_the_idle_buffers_and_empty_gives_them_back(lazy_on):
    x, y = torch.randn(2, 3, 8, 8), torch.tensor([1, 7])
    model = _model()
    _train(model, x, y, fastlazy.lazy, steps=1)
    cap = cpu_pool.stats()["cap"]
    try:
        cpu_pool.set_cap(1)                              # MiB
        model.zero_grad()                                # the gradients come back
        stats = cpu_pool.stats()
        assert stats["idle_bytes"] <= 1 << 20 and stats["given_back"] > 0
        cpu_pool.set_cap(0)
        assert cpu_pool.stats()["idle_bytes"] == 0
    finally:
        cpu_pool.set_cap(cap >> 20)
    _train(model, x, y, fastlazy.lazy, steps=1)
    model.zero_grad()
    assert cpu_pool.stats()["idle_bytes"] > 0
    cpu_pool.empty()
    assert cpu_pool.stats()["idle_bytes"] == 0


def test_pooled_buffers_freed_on_other_threads(lazy_on):
    x, y = torch.randn(2, 3, 8, 8), torch.tensor([1, 7])
    models = [_model(seed) for seed in range(4)]
    for m in models:
        _train(m, x, y, fastlazy.lazy, steps=1)
    returned = cpu_pool.stats()["returned"]
    threads = [threading.Thread(target=m.zero_grad) for m in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert cpu_pool.stats()["returned"] >= returned + 4 * 2


def test_onednn_scratch_memory_in_a_pooled_backward(lazy_on):
    """A convolution ATen runs on oneDNN (batch 4) allocates through the
    raw interface (ideep) inside the pool's scope, and frees through
    raw_deleter: pooled and torch's own blocks alike."""
    torch.manual_seed(1)
    conv = nn.Conv2d(64, 64, 3, padding=1)
    x = torch.randn(4, 64, 32, 32)
    for _ in range(2):
        conv.zero_grad()
        conv(fastlazy.lazy(x)).square().sum().backward()
        lazy_grads = [p.grad.clone() for p in conv.parameters()]
        conv.zero_grad()
        conv(x).square().sum().backward()
        for p, g in zip(conv.parameters(), lazy_grads):
            torch.testing.assert_close(g, p.grad, rtol=0, atol=0)


POOL_OFF = """
import torch, torch.nn as nn, fastlazy
from fastlazy import cpu_pool
fastlazy.enable()
w = nn.Linear(512, 512)
w(fastlazy.lazy(torch.randn(4, 512))).sum().backward()
print(cpu_pool.why_not(), cpu_pool.stats())
"""


def test_fastlazy_cpu_pool_mb_0_switches_it_off():
    done = subprocess.run([sys.executable, "-c", POOL_OFF], capture_output=True, text=True,
                          timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT, "FASTLAZY_CPU_POOL_MB": "0"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "switched off (FASTLAZY_CPU_POOL_MB=0, or set_cap(0)) {}"


FORK = """
import os, threading, torch, torch.nn as nn, fastlazy
from fastlazy import cpu_pool
fastlazy.enable()
# (one intra-op thread: a child forked while another thread is inside an
# OpenMP region hangs in its own first one, pool or no pool)
torch.set_num_threads(1)
w = nn.Linear(512, 512)
w(fastlazy.lazy(torch.randn(4, 512))).sum().backward()
# a thread takes and frees pooled buffers over and over while the parent
# forks (the pool's lock held at some of the forks)
stop = False
def churn():
    while not stop:
        with cpu_pool.scope():
            t = torch.empty(1 << 18)
        del t
t = threading.Thread(target=churn, daemon=True)
t.start()
for _ in range(20):
    pid = os.fork()
    if pid == 0:
        w.zero_grad()
        w(fastlazy.lazy(torch.randn(4, 512))).sum().backward()
        w.zero_grad()
        os._exit(0 if cpu_pool.stats()["hits"] > 0 else 3)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
stop = True
t.join()
print("ok")
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forked_child_uses_the_pool_whatever_the_parent_held():
    done = subprocess.run([sys.executable, "-c", FORK], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "ok"


def test_graph_runs_take_their_buffers_from_the_pool_and_a_failed_run_leaves_it(lazy_on):
    x = fastlazy.lazy(torch.randn(256, 256))
    hits = (cpu_pool.stats() or {"hits": 0})["hits"]
    for _ in range(3):
        y = (x * 2 + 1).to_eager()          # a 256 KiB output
        del y
    assert cpu_pool.stats()["hits"] >= hits + 2
    bad = fastlazy.lazy(torch.randn(4)).index_select(0, fastlazy.lazy(torch.tensor([10])))
    with pytest.raises((IndexError, RuntimeError)):
        bad.to_eager()
    # the failed run left the pool's scope: this thread's allocations are
    # torch's again
    before = cpu_pool.stats()
    big = torch.empty(1 << 20)
    del big
    after = cpu_pool.stats()
    assert (after["hits"], after["misses"]) == (before["hits"], before["misses"])


def test_the_metrics_report_shows_the_pool(lazy_on):
    x = fastlazy.lazy(torch.randn(256, 256))
    (x + 1).to_eager()
    assert "CPU pool (large buffers of graph runs and backwards): " in fastlazy.metrics.report()


def test_an_allocation_that_fails_gives_the_idle_buffers_back_first(lazy_on):
    """Memory the pool keeps idle must not make an allocation fail that
    would succeed without it: a failed one empties the pool and is tried
    again; where it still fails, eager's error comes out."""
    x, y = torch.randn(2, 3, 8, 8), torch.tensor([1, 7])
    model = _model()
    _train(model, x, y, fastlazy.lazy, steps=1)
    model.zero_grad()
    assert cpu_pool.stats()["idle_bytes"] > 0
    with pytest.raises(RuntimeError, match="memory"):
        torch.empty(1 << 48, dtype=torch.uint8)        # 256 TiB
    assert cpu_pool.stats()["idle_bytes"] == 0
    _train(model, x, y, fastlazy.lazy, steps=2)        # and the pool serves again
    model.zero_grad()
    assert cpu_pool.stats()["idle_bytes"] > 0
