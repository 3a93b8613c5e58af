"""Long runs keep memory flat and the buffer bounded.

CI runs a few thousand iterations; `pytest --long` runs the 100,000 of the
acceptance criteria (W1 loop and an MLP training loop).
"""
import gc
import resource
import weakref

import pytest
import torch
from torch import nn

import fastlazy
from fastlazy import _core

pytestmark = pytest.mark.usefixtures("lazy_on")


def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def w1(a, b, c, d, e, f, g, h, i):
    r = a.add(b).mul(c).div(d).add(e).sub(f).mul(g).div(h).add(i)
    for _ in range(3):
        r = r.sub(b).mul(c).div(d).add(e).sub(f).mul(g).div(h).add(i)
    return r


def run_flat(step, iterations, warmup):
    for _ in range(warmup):
        step()
    gc.collect()
    start = rss_mb()
    peak_pending = 0
    for k in range(iterations):
        step()
        peak_pending = max(peak_pending, _core.pending_nodes())
    gc.collect()
    return start, rss_mb(), peak_pending


@pytest.fixture
def iterations(request):
    return 100_000 if request.config.getoption("--long") else 3_000


def test_w1_loop_memory_is_flat(iterations, record_property):
    torch.manual_seed(0)
    inputs = [torch.rand(100, 100).to("lazy") for _ in range(9)]
    start, end, pending = run_flat(lambda: w1(*inputs).to_eager(), iterations, 200)
    record_property("rss_mb", (start, end))
    print(f"W1 x{iterations}: RSS {start:.1f} -> {end:.1f} MiB, peak pending {pending}")
    assert end - start < 20
    assert pending == 0          # every iteration reads its result
    assert fastlazy.metrics.counters()["cache_misses"] == 1


def test_trace_only_loop_keeps_buffer_bounded(iterations):
    inputs = [torch.rand(10, 10).to("lazy") for _ in range(9)]
    start, end, pending = run_flat(lambda: w1(*inputs), iterations, 200)
    assert pending <= 32 and end - start < 20


def test_training_loop_memory_is_flat(iterations):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 16), torch.randn(8, 1)

    def step():
        opt.zero_grad()
        loss = ((model(x.to("lazy")) - y) ** 2).sigmoid().mean()
        loss.backward()
        opt.step()
        fastlazy.mark_step()

    start, end, pending = run_flat(step, iterations, 100)
    print(f"training x{iterations}: RSS {start:.1f} -> {end:.1f} MiB")
    assert end - start < 20 and pending < 10


def test_no_lazy_tensor_or_segment_outlives_its_use():
    a = fastlazy.lazy(torch.rand(4))
    r = (a + 1) * 2
    seg, _ = _core.pending_in(r)
    ref = weakref.ref(seg)
    r.to_eager()
    del seg
    gc.collect()
    assert ref() is None            # the segment went with its flush
    probe = weakref.ref(r)
    del r
    assert probe() is None          # no cycle keeps a LazyTensor alive
