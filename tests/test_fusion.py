"""NNC fusion, counted (fastlazy.metrics.fusion): W1's 32-op elementwise
chain (benchmarks/workloads.py) is one fusion group, and a new scalar or a
new shape runs that graph again without a new compile.

On the CPU, NNC fuses only with LLVM, which PyPI's wheels lack; its IR
evaluator interprets the fused loops without LLVM, and these tests switch
it on (torch's flags, each put back afterwards).  On CUDA NNC fuses as it
does for every user, and a profiled call shows what ran: one kernel.
"""
import contextlib

import pytest
import torch

import fastlazy
from fastlazy import graph_cache, metrics

from helpers import import_benchmark

workloads = import_benchmark("workloads")

N = {"cpu": 16, "cuda": 100}       # the IR evaluator interprets: small on the CPU
OPS = 32


def _flags():
    c = torch._C
    return (c._jit_can_fuse_on_cpu(), c._jit_get_te_must_use_llvm_cpu(),
            c._jit_texpr_fuser_enabled(), c._get_graph_executor_optimize())


@contextlib.contextmanager
def fusing(device):
    """The torchscript backend with NNC fusing on `device` (on the CPU
    through its IR evaluator), from an empty graph cache; afterwards every
    flag as it was, and the graphs compiled meanwhile out of the cache."""
    c = torch._C
    saved = _flags()
    profiling = c._jit_set_profiling_executor(True)
    c._jit_set_texpr_fuser_enabled(True)
    c._set_graph_executor_optimize(True)
    if device == "cpu":
        c._jit_override_can_fuse_on_cpu(True)
        c._jit_set_te_must_use_llvm_cpu(False)
    backend = fastlazy.backend()
    fastlazy.mark_step()
    graph_cache.clear()
    fastlazy.set_backend("torchscript")
    try:
        yield
    finally:
        fastlazy.mark_step()
        graph_cache.clear()
        fastlazy.set_backend(backend)
        c._jit_override_can_fuse_on_cpu(saved[0])
        c._jit_set_te_must_use_llvm_cpu(saved[1])
        c._jit_set_texpr_fuser_enabled(saved[2])
        c._set_graph_executor_optimize(saved[3])
        c._jit_set_profiling_executor(profiling)


def _inputs(n, device, seed=0):
    """W1's nine n x n inputs, kept away from 0 (four of them divide)."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.rand(n, n, generator=gen) + 0.5).to(device) for _ in range(9)]


def _program(ts, s):
    """W1's 32-op chain, then a multiplication by a Python scalar (33 ops)."""
    return workloads.chain(OPS)(*ts).mul(s)


def _run(ts, s):
    return _program([fastlazy.lazy(t) for t in ts], s).to_eager()


def _fused_graphs():
    """(state, groups, fused ops, ops left outside) per cached graph."""
    return [(g["state"], g["groups"], g["fused"], g["unfused"]) for g in metrics.fusion()]


def test_w1_chain_is_one_fusion_group(lazy_on, device):
    before = _flags()
    chain = workloads.chain(OPS)
    with fusing(device):
        ts = _inputs(N[device], device)
        want = chain(*ts)                    # eager tensors: eager's own calls
        for k in range(3):                   # the executor optimizes at the second run
            got = chain(*[fastlazy.lazy(t) for t in ts]).to_eager()
            torch.testing.assert_close(got, want)
            if k == 0:
                assert _fused_graphs() == [("not optimized yet", 0, 0, {})]
        assert _fused_graphs() == [("optimized", 1, OPS, {})], fastlazy.explain()
        assert metrics.counters()["compiles"] == 1
        line = f"1 optimized graph(s) hold 1 fusion group(s) covering {OPS} aten op(s), 0 outside"
        assert line in metrics.report() and line in fastlazy.explain()
    assert _flags() == before
    assert metrics.fusion() == []            # its graph left the cache


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.float32])
def test_complex_graphs_run_unfused(lazy_on, device, dtype):
    """NNC takes complex values into a fusion group, then fails from the
    second run on ("UNSUPPORTED DTYPE: complex"): such graphs run unfused."""
    x = torch.ones(3, 4, dtype=dtype, device=device)
    with fusing(device):
        for _ in range(3):
            got = ((1.5 - 2j) / fastlazy.lazy(x)).to_eager()
            assert torch.equal(got, (1.5 - 2j) / x)
        assert [g["state"] for g in metrics.fusion()] == []


def test_a_new_scalar_or_shape_runs_the_fused_graph_without_a_compile(lazy_on, device):
    n = N[device]
    with fusing(device):
        ts = _inputs(n, device)
        for _ in range(3):
            _run(ts, 1.5)
        assert _fused_graphs() == [("optimized", 1, OPS + 1, {})], fastlazy.explain()
        compiled = metrics.counters()
        for s, new in ((-0.25, ts), (3.0, _inputs(n + 5, device, seed=1))):
            for _ in range(3):
                got = _run(new, s)
            torch.testing.assert_close(got, _program(new, s))
        after = metrics.counters()
        assert after["compiles"] == compiled["compiles"] == 1
        assert after["cache_misses"] == compiled["cache_misses"]
        assert after["cache_hits"] == compiled["cache_hits"] + 6
        assert _fused_graphs() == [("optimized", 1, OPS + 1, {})]


def _cuda_kernels(call):
    """The names of the CUDA kernels one call launched (copies and memsets
    left out)."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return [e.name for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA
            and not e.name.startswith(("Memcpy", "Memset"))]


@pytest.mark.cuda
def test_w1_chain_runs_as_one_cuda_kernel(lazy_on):
    """The whole flush launches one kernel, for the first shape, a new
    scalar and (once the executor has specialized its fallback path for it:
    torch's fusion strategy) a new shape."""
    n = N["cuda"]
    with fusing("cuda"):
        ts = _inputs(n, "cuda")
        for _ in range(3):
            _run(ts, 1.5)
        for s, new in ((1.5, ts), (-0.25, ts), (3.0, _inputs(n + 5, "cuda", seed=1))):
            for _ in range(3):
                _run(new, s)
            kernels = _cuda_kernels(lambda: _run(new, s))
            assert len(kernels) == 1, (
                f"scalar {s}, shape {tuple(new[0].shape)}: {len(kernels)} kernels "
                f"{kernels}\n{fastlazy.explain()}")
        assert metrics.counters()["compiles"] == 1


@pytest.mark.skipif(torch._C._llvm_enabled(), reason="this torch fuses on the CPU")
@pytest.mark.parametrize("backend", ["torchscript"], indirect=True)
def test_nothing_fuses_on_a_cpu_without_llvm(lazy_on, backend):
    x = fastlazy.lazy(torch.rand(4, 4))
    for _ in range(3):
        (x * 2 + 1).to_eager()
    assert metrics.fusion() == []
    assert "TorchScript fusion" not in metrics.report()
