"""Backends and the graph cache: same results everywhere, cache policy."""
import pytest
import torch

import fastlazy
from fastlazy import backends, graph_cache, step_executor
from fastlazy.backends import torchscript

pytestmark = pytest.mark.usefixtures("lazy_on")


def program(a, b, s):
    r = (a * s + b).sub(a, alpha=2).div(b + 1.5)
    r = torch.clamp(r, min=-1.0, max=s).relu() - torch.tanh(a) ** 2
    return (r > 0.1) & (a <= b), torch.maximum(r, a).exp().sqrt(), -abs(r), 3 / (b + 1)


def compare(lazy_out, eager_out, exact):
    for got, want in zip(lazy_out, eager_out):
        got = got.to_eager()
        assert got.dtype == want.dtype and got.shape == want.shape
        if exact or want.dtype == torch.bool:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize("name", ["torchscript", "eager", "inductor"])
def test_backends_agree_with_eager(name):
    fastlazy.set_backend(name)
    try:
        a, b = torch.randn(6, 5), torch.rand(5)
        misses = []
        for s in (0.75, 0.5, -2.0):       # a new scalar value: no new graph
            got = program(fastlazy.lazy(a), fastlazy.lazy(b), s)
            compare(got, program(a, b, s), exact=name != "inductor")
            misses.append(fastlazy.metrics.counters()["cache_misses"])
        assert misses[0] == misses[-1] > 0
    finally:
        fastlazy.set_backend("torchscript")


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown fastlazy backend"):
        fastlazy.set_backend("tvm")


def test_torchscript_scalar_type_numbers_match_the_tracer():
    for dtype, number in torchscript.SCALAR_TYPE.items():
        if dtype == torch.complex32:
            continue
        traced = torch.jit.trace(lambda x: x.to(dtype), torch.zeros(1))
        consts = [n.output().toIValue() for n in traced.graph.nodes()
                  if n.kind() == "prim::Constant" and n.output().type().kind() == "IntType"]
        assert number in consts, dtype


def test_torchscript_graphs_are_shape_generic():
    for n in (3, 5, 8, 13):
        x = fastlazy.lazy(torch.rand(n, 2))
        assert torch.allclose((x * 2 + 1).to_eager(), x.to_eager() * 2 + 1)
    assert fastlazy.metrics.counters()["cache_misses"] == 1


def test_torchscript_reuses_dead_intermediates():
    a, b = fastlazy.lazy(torch.rand(4)), fastlazy.lazy(torch.rand(4))
    (a.add(b).mul(b).sub(a)).to_eager()
    source = next(reversed(graph_cache.programs.values())).source
    assert "aten::mul_(" in source and "aten::sub_(" in source
    assert "aten::add(" in source       # the first op must not write into an input


def test_torchscript_keeps_zero_and_negative_zero_constants_apart():
    """0.0 == -0.0 in Python, so a dict of constants keyed by value would
    hand one graph the first of them for both: -0.0's sign would be lost."""
    x = torch.rand(3)
    zero = torch.full_like(fastlazy.lazy(x), 0.0)
    negative = torch.full_like(fastlazy.lazy(x), -0.0)
    fastlazy.mark_step()
    source = next(reversed(graph_cache.programs.values())).source
    assert "value=0.0]" in source and "value=-0.0]" in source
    assert not torch.signbit(zero.to_eager()).any()
    assert torch.signbit(negative.to_eager()).all()


def test_torchscript_reuse_is_part_of_the_key():
    """A graph that computes into an intermediate is never reused for shapes
    where a broadcast makes the result larger than that intermediate."""
    failures = fastlazy.metrics.counters()["compile_failures"]
    for a_shape, b_shape in (((2, 2), (2, 2)), ((1, 2), (2, 1)), ((2, 2), (2, 2))):
        a, b = torch.rand(a_shape), torch.rand(b_shape)
        got = (fastlazy.lazy(a) * 2 + fastlazy.lazy(b)).to_eager()
        assert torch.equal(got, a * 2 + b)
    assert fastlazy.metrics.counters()["cache_misses"] == 2
    # and no graph failed to run (the eager backend would cover it up)
    assert fastlazy.metrics.counters()["compile_failures"] == failures


def test_alternating_graphs_stay_cached():
    a = fastlazy.lazy(torch.rand(8))
    for i in range(10):
        r = (a + i).exp() if i % 2 else (a - i).tanh()
        r.to_eager()
    c = fastlazy.metrics.counters()
    assert c["cache_misses"] == 2 and c["cache_hits"] == 8


def test_lru_eviction():
    graph_cache.clear()
    graph_cache.set_capacity(2)
    try:
        a = fastlazy.lazy(torch.rand(8))
        for make in (lambda: a + 1, lambda: a * 2, lambda: a - 3, lambda: a + 1):
            make().to_eager()
        c = fastlazy.metrics.counters()
        assert c["cache_evictions"] == 2 and c["cache_size"] == 2
        assert c["cache_misses"] == 4      # `a + 1` was evicted before its second use
    finally:
        graph_cache.set_capacity(1024)


def test_compile_failure_falls_back_to_eager(monkeypatch):
    def broken(view):
        raise RuntimeError("backend bug")
    monkeypatch.setattr(backends.get("torchscript"), "compile", broken)
    a = fastlazy.lazy(torch.arange(4.0))
    assert torch.equal((a * 3).to_eager(), torch.arange(4.0) * 3)
    c = fastlazy.metrics.counters()
    assert c["compile_failures"] == 1
    assert c["fallback.compile:torchscript:RuntimeError"] == 1


def test_inductor_switches_to_dynamic_shapes(monkeypatch):
    backend = backends.get("inductor")
    monkeypatch.setattr(backend, "dynamic_after", 2)
    fastlazy.set_backend("inductor")
    try:
        for n in (4, 6, 9, 11, 17):
            x = fastlazy.lazy(torch.rand(n))
            torch.testing.assert_close((x * 2 - 1).to_eager(), x.to_eager() * 2 - 1)
        c = fastlazy.metrics.counters()
        assert c["recompile.inductor: new input shape"] == 1
        assert c["recompile.inductor: dynamic shapes"] == 1
        assert c["cache_misses"] == 1
    finally:
        fastlazy.set_backend("torchscript")


def test_inductor_alternating_shapes_run_their_own_static_versions(monkeypatch):
    """Each call goes to the version compiled for its sizes, though the
    last version run is checked first (its ShapeGuard): shapes that take
    turns compile once each, and give eager's values every time."""
    backend = backends.get("inductor")
    monkeypatch.setattr(backend, "dynamic_after", 3)
    fastlazy.set_backend("inductor")
    try:
        tensors = [torch.rand(4, 3), torch.rand(3, 4), torch.rand(4, 3)]
        for t in tensors * 3:
            x = fastlazy.lazy(t)
            torch.testing.assert_close((x * 2 - x.sum(0)).to_eager(), t * 2 - t.sum(0))
        c = fastlazy.metrics.counters()
        assert c["recompile.inductor: new input shape"] == 1
        assert c["cache_misses"] == 1 and "recompile.inductor: dynamic shapes" not in c
    finally:
        fastlazy.set_backend("torchscript")


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["torchscript", "inductor"])
def test_cuda_backends(name):
    fastlazy.set_backend(name)
    try:
        a = torch.randn(6, 5, device="cuda")
        b = torch.rand(5, device="cuda")
        for _ in range(3):
            got = program(fastlazy.lazy(a), fastlazy.lazy(b), 0.75)
            compare(got, program(a, b, 0.75), exact=False)
        assert got[0].device.type == "cuda"
    finally:
        fastlazy.set_backend("torchscript")


def test_inductor_async_compile_replays_until_ready(monkeypatch):
    backend = backends.get("inductor")
    monkeypatch.setattr(backend, "async_compile", True)
    fastlazy.set_backend("inductor")
    try:
        x = fastlazy.lazy(torch.rand(7, 3))
        first = (x.sigmoid() * 3 - 1).to_eager()       # compile starts, replayed now
        torch.testing.assert_close(first, x.to_eager().sigmoid() * 3 - 1)
        assert fastlazy.metrics.counters()["fallback.inductor: replayed while compiling"] == 1
        future = next(iter(graph_cache.programs[next(reversed(graph_cache.programs))]
                           .call.by_shape.values()))
        future.result(timeout=300)                      # wait for the kernels
        again = (x.sigmoid() * 3 - 1).to_eager()
        torch.testing.assert_close(again, first)
        assert fastlazy.metrics.counters()["fallback.inductor: replayed while compiling"] == 1
    finally:
        fastlazy.set_backend("torchscript")


@pytest.mark.parametrize("program", [
    lambda u, s: u / s,                 # uint8 / 0-dim int64
    lambda u, s: u / 300,               # a Python int the uint8 common dtype cannot hold
    lambda u, s: 300 / u,
    lambda u, s: torch.div(u, -1),
])
def test_inductor_true_division_of_integers_casts_each_operand(program):
    """Eager casts each operand of an integer true division from its own
    dtype to the float result; inductor went through the integral common
    dtype first (-5 beside uint8 became 251).  Found by --inductor-all."""
    u = torch.tensor([[3, 250, 7]], dtype=torch.uint8)
    s = torch.tensor(-5)
    torch.testing.assert_close(_on_inductor(program, u, s), program(u, s))


def _on_inductor(program, *tensors):
    """program's value with each of `tensors` made lazy, on the inductor
    backend (the torchscript backend restored after)."""
    fastlazy.set_backend("inductor")
    try:
        return program(*[fastlazy.lazy(t) for t in tensors]).to_eager()
    finally:
        fastlazy.set_backend("torchscript")


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16])
def test_inductor_narrow_integer_casts_keep_eagers_low_bits(dtype):
    """Eager converts a float to int32 and keeps the low bits of it
    (-965.4 to int8 is 59); inductor's vectorized conversion to int8
    saturated (-128), so a graph that went hot gave other values once its
    inputs left the type's range.  Casts to a narrow integer type go
    through int32 (inductor_graph)."""
    x = torch.linspace(-70000, 70000, 4099)

    def program(x):
        return ((x * 1.5).to(dtype) * 3).to(torch.float32)
    assert torch.equal(_on_inductor(program, x), program(x))


class _Counting(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the aten calls made while it is active, by op (add_ as add)."""

    def __init__(self):
        super().__init__()
        self.calls = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__.rstrip("_")
        self.calls[name] = self.calls.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["torchscript", "native", "eager"])
def test_a_captured_program_runs_once_for_all_its_outputs(name):
    """Nodes that are outputs of one captured program over the same inputs
    (the parts of an unbind) share one run of it; nodes of op-table rows do
    not (each may be computed into by a later op)."""
    fastlazy.set_backend(name)
    try:
        x = torch.rand(6, 4)
        lx = fastlazy.lazy(x)
        parts = (lx * 2).unbind(0)
        twice = lx.exp() * lx.exp()
        got = parts[0] + parts[1] * parts[2] + twice[:2]
        with _Counting() as counting:
            value = got.to_eager()
        parts = (x * 2).unbind(0)
        assert torch.equal(value, parts[0] + parts[1] * parts[2] + (x.exp() * x.exp())[:2])
        assert counting.calls.get("unbind") == 1
        assert counting.calls.get("exp") == 2
    finally:
        fastlazy.set_backend("torchscript")


def test_torchscript_plans_a_graph_unoptimized_and_leaves_the_flags_as_they_were():
    """The graph executor's optimization passes cost a model's first call
    10-16 ms and buy nothing on fastlazy's IR: every call runs the
    unoptimized plan (the executor's fallback plan; no optimized execution
    plan is ever made), and the flags switched for it are as they were.
    (With fastlazy's step executor off: the interpreter's path.)"""
    c = torch._C
    before = (c._get_graph_executor_optimize(), c._jit_set_profiling_executor(True))
    c._jit_set_profiling_executor(before[1])
    backend = fastlazy.backend()
    fastlazy.mark_step()
    fastlazy.set_backend("torchscript")
    executor = step_executor.enabled()
    step_executor.set_enabled(False)
    try:
        for _ in range(3):          # (the executor plans again when the flag changes)
            a = fastlazy.lazy(torch.rand(5))
            torch.testing.assert_close((a.sin() * 2 + a.cos()).to_eager(),
                                       a.to_eager().sin() * 2 + a.to_eager().cos())
        fn = next(reversed(graph_cache.programs.values())).call
        # the profiling executor has no optimized plan to show after three
        # runs (its debug state asserts that it has one)
        with pytest.raises(RuntimeError, match="optimized_plan"):
            getattr(fn, "fn", fn).get_debug_state()
        after = (c._get_graph_executor_optimize(), c._jit_set_profiling_executor(before[1]))
        assert after == before
    finally:
        fastlazy.mark_step()
        fastlazy.set_backend(backend)
        step_executor.set_enabled(executor)


def test_torchscript_without_the_step_executor_agrees_with_eager():
    """The interpreter's path (graphs that fuse, and builds without the
    step executor) gives the same values as the executor's."""
    executor = step_executor.enabled()
    step_executor.set_enabled(False)
    try:
        a, b = torch.randn(6, 5), torch.rand(5)
        for s in (0.75, -2.0):
            compare(program(fastlazy.lazy(a), fastlazy.lazy(b), s), program(a, b, s), exact=True)
        fn = next(reversed(graph_cache.programs.values())).call
        assert isinstance(fn, torchscript._unoptimized)
    finally:
        fastlazy.mark_step()
        step_executor.set_enabled(executor)


def test_implicit_expand_keeps_its_shape_on_the_graph_executor():
    """The graph executor's RemoveExpands deletes `expand(implicit=True)`
    (on CUDA, where it runs every fusing graph): the flag is emitted as
    False, which gives the same value."""
    executor = step_executor.enabled()
    step_executor.set_enabled(False)
    fastlazy.set_backend("torchscript")
    try:
        x = torch.randn(3, 1)
        for _ in range(3):          # the profiling executor optimizes on a later run
            got = fastlazy.lazy(x).expand(3, 4, implicit=True) * 2
            assert torch.equal(got.to_eager(), x.expand(3, 4) * 2)
    finally:
        fastlazy.mark_step()
        step_executor.set_enabled(executor)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("program", [
    lambda x, d: torch.div(x, 0.1, rounding_mode="floor"),
    lambda x, d: x // -0.1,
    lambda x, d: torch.floor_divide(x, d),
    lambda x, d: 3.0 // d,
    lambda x, d: x // 0.0,
    lambda x, d: torch.remainder(x, 0.1),
    lambda x, d: x % -0.1,
    lambda x, d: torch.remainder(x, d),
    lambda x, d: 3.0 % d,
])
def test_inductor_floor_division_of_floats_is_eagers(program, dtype):
    """Inductor computes a float floor division as floor(a / b): 1.0 // 0.1
    gave 10.0, where a / b rounds up to 10 in float32, and eager's kernel
    gives 9.0 (the quotient of a - fmod(a, b)); its remainder came out ulps
    away from eager's.  Graphs for inductor compute both as eager's kernels
    do (inductor_graph)."""
    x = torch.tensor([1.0, 2.0, 3.0, 0.7, 0.3, 0.5, 5.0, 0.9, -1.0, -0.7, 0.0, -0.0, 1e-30,
                      float("inf"), float("nan"), 7.5], dtype=dtype)
    d = torch.tensor([0.1, -0.1, 0.3, 0.0, -0.0, 0.7, 2.5, -0.9, 0.1, 0.1, -3.0, 3.0, 0.1,
                      2.0, 1.0, float("inf")], dtype=dtype)
    want, got = program(x, d), _on_inductor(program, x, d)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(torch.signbit(got), torch.signbit(want))
