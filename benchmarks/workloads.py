"""The W1 workload of ../shared/BENCHMARKS.md and the contenders that run it.

W1 is Torchy's fusible-chain microbenchmark: nine `torch.rand(n, n)` inputs
and 8, 16 or 32 add/sub/mul/div calls, plus a 32-op control-flow variant
whose int argument picks one of two middle blocks (alternated call by call).

A contender is one way of running a workload (eager, torch.jit, torch._lazy,
torch.compile, fastlazy with each backend).  It turns a workload into one
zero-argument call per variant; `prepared()` wraps those calls into the step
a benchmark times, after a first call (timed: it includes any compilation),
a check against eager and a warm-up.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch._lazy
import torch._lazy.metrics

import fastlazy
import fastlazy.backends
import fastlazy.graph_cache

TRACE, EXEC = "trace", "exec"      # build the graph only / read the result
MODES = (TRACE, EXEC)
NS = (100, 1000)
LARGE_N = 10000
OPS = (8, 16, 32)
WARMUP_CALLS = 3                   # per variant, after the first call


@functools.lru_cache(maxsize=1)
def inputs(n: int) -> list[torch.Tensor]:
    """The nine inputs a ... i of W1 (kept for the cases of one size)."""
    torch.manual_seed(0)
    return [torch.rand(n, n) for _ in range(9)]


def chain(ops: int) -> Callable:
    """W1's straight chain of `ops` (8, 16 or 32) elementwise calls."""
    more_lines = ops // 8 - 1

    def fn(a, b, c, d, e, f, g, h, i):
        r = a.add(b).mul(c).div(d).add(e).sub(f).mul(g).div(h).add(i)
        for _ in range(more_lines):
            r = r.sub(b).mul(c).div(d).add(e).sub(f).mul(g).div(h).add(i)
        return r

    fn.__name__ = fn.__qualname__ = f"chain{ops}"
    return fn


def control_flow(a, b, c, d, e, f, g, h, i, var: int):
    """W1's 32-op control-flow variant: `var` picks the middle block."""
    r = a.add(b).mul(c).div(d).add(e).sub(f).mul(g).div(h).add(i)
    if var == 0:
        r = r.sub(b).mul(c).div(d).add(e).sub(f).mul(g).div(h).add(i)
        r = r.sub(b).mul(c).div(d).add(e).sub(f).mul(g).div(h).add(i)
    else:
        r = r.sub(c).div(c).mul(d).sub(e).mul(f).div(g).add(h).add(i)
        r = r.sub(c).div(c).mul(d).sub(e).mul(f).div(g).add(h).add(i)
    r = r.sub(b).mul(c).div(d).add(e).sub(f).mul(g).div(h).add(i)
    return r


@dataclass(frozen=True)
class Workload:
    """A W1 function and the trailing arguments its calls cycle through."""
    name: str
    ops: int
    fn: Callable
    variants: tuple = ((),)

    @property
    def has_control_flow(self) -> bool:
        return len(self.variants) > 1


W1 = tuple(Workload(f"{k}ops", k, chain(k)) for k in OPS) + (
    Workload("32ops-cf", 32, control_flow, ((0,), (1,))),)


@contextlib.contextmanager
def fastlazy_state(on: bool, backend: str | None = None):
    """fastlazy enabled or disabled (and its backend) for a block; the
    previous state is put back afterwards."""
    was_on, was_backend = fastlazy.enabled(), fastlazy.backend()
    if on:
        fastlazy.enable()
    else:
        fastlazy.disable()
    if backend is not None:
        fastlazy.set_backend(backend)
    try:
        yield
    finally:
        fastlazy.set_backend(was_backend)
        if was_on:
            fastlazy.enable()
        else:
            fastlazy.disable()


def _bind(fn: Callable, tensors, workload: Workload) -> list[Callable]:
    """fn bound to the tensors and to each variant's trailing arguments."""
    return [functools.partial(fn, *tensors, *v) for v in workload.variants]


class Contender:
    """One way of running a workload; by default plain eager torch."""
    name = "eager"
    modes = MODES     # eager "traces" by executing: the per-op reference

    def supports(self, workload: Workload, mode: str) -> bool:
        return mode in self.modes

    def session(self):
        """The global state the contender runs under."""
        return fastlazy_state(False)

    def calls(self, workload: Workload, tensors, mode: str) -> list[Callable]:
        """One zero-argument call per variant of the workload."""
        return _bind(workload.fn, tensors, workload)

    def compiles(self) -> int | None:
        """Graphs compiled so far (None: not counted for this contender)."""
        return None


class Jit(Contender):
    """torch.jit.trace of the chain; torch.jit.script for the control-flow
    variant, whose branch a trace would bake in."""
    name = "torch.jit"
    modes = (EXEC,)

    def calls(self, workload, tensors, mode):
        if workload.has_control_flow:
            fn = torch.jit.script(workload.fn)
        else:
            fn = torch.jit.trace(workload.fn, tuple(tensors), check_trace=False)
        return _bind(fn, tensors, workload)


@functools.cache
def _torch_lazy_device() -> torch.device:
    import torch._lazy.ts_backend
    torch._lazy.ts_backend.init()
    # A device object, not the string "lazy", which fastlazy's Tensor.to takes.
    return torch.device("lazy")


class TorchLazy(Contender):
    """PyTorch's own lazy tensors (LTC) on the TorchScript backend; with
    execution, `mark_step()` runs the graph and `.cpu()` reads the result."""
    name = "torch._lazy"

    def calls(self, workload, tensors, mode):
        device = _torch_lazy_device()
        calls = super().calls(workload, [t.to(device) for t in tensors], mode)
        return calls if mode == TRACE else [functools.partial(_mark_step_and_read, c)
                                            for c in calls]

    def compiles(self):
        return torch._lazy.metrics.counter_value("UncachedCompile") or 0


def _mark_step_and_read(call):
    r = call()
    torch._lazy.mark_step()
    return r.cpu()


class Compile(Contender):
    """torch.compile (inductor), shape-specialized, from a clean dynamo cache."""
    name = "torch.compile"
    modes = (EXEC,)

    @contextlib.contextmanager
    def session(self):
        with super().session():
            torch._dynamo.reset()
            yield

    def calls(self, workload, tensors, mode):
        return _bind(torch.compile(workload.fn, dynamic=False), tensors, workload)


class FastLazy(Contender):
    """fastlazy on one backend, from an empty graph cache and a fresh
    segment; trace only is the same for every backend, so it runs once, as
    the backend-less "fastlazy"."""

    def __init__(self, backend: str | None = None):
        self.backend = backend
        self.name = "fastlazy" if backend is None else f"fastlazy[{backend}]"
        self.modes = (TRACE,) if backend is None else (EXEC,)

    @contextlib.contextmanager
    def session(self):
        with fastlazy_state(True, self.backend):
            fastlazy.mark_step()
            fastlazy.graph_cache.clear()
            yield

    def calls(self, workload, tensors, mode):
        calls = super().calls(workload, [fastlazy.lazy(t) for t in tensors], mode)
        return calls if mode == TRACE else [functools.partial(_to_eager, c) for c in calls]

    def compiles(self):
        return fastlazy.metrics.counters()["cache_misses"]


def _to_eager(call):
    return call().to_eager()


def contenders(with_compile: bool = True) -> list[Contender]:
    """Every contender, fastlazy with each backend it registers."""
    found = [Contender(), Jit(), TorchLazy()]
    if with_compile:
        found.append(Compile())
    found.append(FastLazy())
    found += [FastLazy(name) for name in fastlazy.backends.names()]
    return found


@dataclass(frozen=True)
class Case:
    """One W1 benchmark: a contender running a workload at size n."""
    mode: str
    n: int
    workload: Workload
    contender: Contender

    @property
    def id(self) -> str:
        return f"{self.mode}-n{self.n}-{self.workload.name}-{self.contender.name}"


def w1_cases(ns=NS, ops=OPS, with_compile=True) -> list[Case]:
    """All W1 cases, grouped by n so that one size's inputs live at a time."""
    return [Case(mode, n, w, c)
            for n in ns for mode in MODES for w in W1 if w.ops in ops
            for c in contenders(with_compile) if c.supports(w, mode)]


@dataclass
class Prepared:
    """A contender ready to be timed: `step` makes one call (variants in
    turn); `first_call_s` is the time to the first result of each variant
    (setup and compilation included); `recompiles()` counts graphs compiled
    since then."""
    step: Callable
    first_call_s: float
    recompiles: Callable[[], int | None]


@contextlib.contextmanager
def prepared(case: Case):
    """Set up a case: first calls (timed, compilation included), a check of
    the results against eager, a warm-up; yields a Prepared."""
    tensors = inputs(case.n)
    contender = case.contender
    with contender.session():
        start = time.perf_counter()
        calls = contender.calls(case.workload, tensors, case.mode)
        results = [call() for call in calls]
        first_call_s = time.perf_counter() - start
        if case.mode == EXEC:
            _check(results, case.workload, tensors)
        compiled = contender.compiles()
        for _ in range(WARMUP_CALLS):
            for call in calls:
                call()
        yield Prepared(_alternate(calls), first_call_s,
                       lambda: None if compiled is None else contender.compiles() - compiled)


def _check(results, workload, tensors):
    """Each variant's result must be eager's."""
    with fastlazy_state(False):
        expected = [workload.fn(*tensors, *v) for v in workload.variants]
    for got, want in zip(results, expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, equal_nan=True)


def _alternate(calls: list[Callable]) -> Callable:
    """One call, or a step that makes the calls in turn."""
    if len(calls) == 1:
        return calls[0]
    turn = itertools.cycle(calls)
    return lambda: next(turn)()
