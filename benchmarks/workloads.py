"""The W1 and W2 workloads of the benchmark suite (its targets: TARGETS in
report.py) and the contenders that run them.

W1 is Torchy's fusible-chain microbenchmark: nine `torch.rand(n, n)` inputs
and 8, 16 or 32 add/sub/mul/div calls, plus a 32-op control-flow variant
whose int argument picks one of two middle blocks (alternated call by call).

W2 is small models, where per-op overhead dominates: an MLP of 8
Linear(256, 256)+ReLU layers at batch 1 and 64, inference and one training
step, and an nn.TransformerEncoderLayer (d_model 256, 4 heads, seq 32,
batch 1) in eval (see the W2 section below).

W4 is real models (zoo.py: torchvision's resnet18, mobilenet_v3_small and a
small ViT; HuggingFace's BERT, GPT-2 and Llama) at batch 1 and at batch 8 on
larger inputs, inference and, for resnet18 and GPT-2, one training step (see
the W4 section below).

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
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch._lazy
import torch._lazy.metrics
import torch.nn.functional as F       # F.mse_loss looked up per call: fastlazy patches it
from torch import nn

import fastlazy
import fastlazy.backends
import fastlazy.graph_cache
from fastlazy import tiering
import zoo

TRACE, EXEC = "trace", "exec"      # build the graph only / read the result
MODES = (TRACE, EXEC)
NS = (100, 1000)
LARGE_N = 10000
OPS = (8, 16, 32)
WARMUP_CALLS = 3                   # per variant, after the first call
SETTLE_RUNS = 20000                # at most, per round, for graphs to reach their hot thresholds
SETTLE_ROUNDS = 10                 # at most


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


def best_per_call(fn: Callable, args, calls: int, rounds: int,
                  after_round: Callable = lambda: None) -> float:
    """The best of `rounds` rounds of `calls` calls of fn(*args), seconds
    per call (other work on the machine only ever adds time);
    after_round() runs between rounds, unclocked."""
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        best = min(best, (time.perf_counter() - start) / calls)
        after_round()
    return best


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
    # draws random numbers as eager does (dropout masks), so a training
    # step's loss can be checked against eager's
    eager_random_numbers = True
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

    def settle(self, calls: list[Callable]) -> None:
        """Run the warmed-up calls until the contender's steady state (a
        tiered engine: every hot graph compiled and its tier chosen)."""

    # W2 (small models)
    w2_tolerance = dict(rtol=1e-4, atol=1e-5)   # for the check against eager
    skips_on_error = False    # an exception in a W2 first call: a failure, not a skip

    def w2_step(self, model: nn.Module, x, y, mode: str):
        """A W2 step as a zero-argument call (inference: the output as an
        eager tensor; training: the loss as a float), and a function giving
        the model's parameters as eager tensors (for the check)."""
        return _w2_step(model, model, x, y, mode), functools.partial(_eager_params, model)

    # W4 (real models)
    w4_tolerance = dict(rtol=1e-4, atol=1e-5)

    @property
    def settled_w4_tolerance(self):
        """W4 inference after settle(): the steady-state program's."""
        return self.w4_tolerance

    first_call_limit_s: float | None = None     # W4: the first call may run this long

    def w4_step(self, model: zoo.ZooModel, module: nn.Module, x, target, mode: str):
        """A W4 call as a zero-argument function (see zoo.step), and a
        function giving the module's gradients, parameters and buffers as
        eager tensors (for the check)."""
        return (zoo.step(model, module, module, x, target, mode),
                functools.partial(zoo.state, module))


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
    import fastlazy.lazy_device
    fastlazy.lazy_device.remove()       # torch._lazy's kernels take the Lazy key back
    torch._lazy.ts_backend.init()
    # A device object, not the string "lazy", which fastlazy's Tensor.to takes.
    return torch.device("lazy")


class TorchLazy(Contender):
    """PyTorch's own lazy tensors (LTC) on the TorchScript backend; with
    execution, `mark_step()` runs the graph and `.cpu()` reads the result."""
    name = "torch._lazy"
    eager_random_numbers = False

    def calls(self, workload, tensors, mode):
        device = _torch_lazy_device()
        calls = super().calls(workload, [t.to(device) for t in tensors], mode)
        return calls if mode == TRACE else [functools.partial(_mark_step_and_read, c)
                                            for c in calls]

    def compiles(self):
        return torch._lazy.metrics.counter_value("UncachedCompile") or 0

    skips_on_error = True

    def w2_step(self, model, x, y, mode):
        """The model and both inputs moved to the lazy device once; each step
        ends with `mark_step()`, then reads the output with `.cpu()` or the
        loss with `.item()`."""
        device = _torch_lazy_device()
        model.to(device)
        step = _w2_step(model, model, x.to(device), y.to(device), mode,
                        read=_mark_step_and_cpu, after_step=torch._lazy.mark_step)
        return step, lambda: [p.detach().cpu() for p in model.parameters()]

    first_call_limit_s = 120.0

    def w4_step(self, model, module, x, target, mode):
        """As w2_step: the module, input and target moved to the lazy device
        once, `mark_step()` after each call."""
        device = _torch_lazy_device()
        module.to(device)
        step = zoo.step(model, module, module, x.to(device), target.to(device), mode,
                        read=_mark_step_and_cpu, after_step=torch._lazy.mark_step)
        return step, functools.partial(zoo.state, module, torch.Tensor.cpu)


def _mark_step_and_read(call):
    r = call()
    torch._lazy.mark_step()
    return r.cpu()


def _mark_step_and_cpu(r):
    torch._lazy.mark_step()
    return r.cpu()


class Compile(Contender):
    """torch.compile (inductor), shape-specialized, from a clean dynamo cache."""
    name = "torch.compile"
    eager_random_numbers = False
    modes = (EXEC,)

    @contextlib.contextmanager
    def session(self):
        with super().session():
            torch._dynamo.reset()
            yield

    def calls(self, workload, tensors, mode):
        return _bind(torch.compile(workload.fn, dynamic=False), tensors, workload)

    w2_tolerance = dict(rtol=1e-3, atol=1e-4)
    skips_on_error = True

    def w2_step(self, model, x, y, mode):
        """The model's forward compiled (training: AOTAutograd compiles its
        backward too); loss, backward and the SGD step as in eager."""
        forward = torch.compile(model, dynamic=False)
        return _w2_step(model, forward, x, y, mode), functools.partial(_eager_params, model)

    w4_tolerance = dict(rtol=1e-3, atol=1e-4)

    def w4_step(self, model, module, x, target, mode):
        """The module's forward compiled (with a language model's loss, which
        HuggingFace computes in it); the rest as in eager."""
        forward = torch.compile(module, dynamic=False)
        return (zoo.step(model, module, forward, x, target, mode),
                functools.partial(zoo.state, module))


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

    def settle(self, calls):
        """The tiered engine: each graph past its hot thresholds (runs and
        seconds), its background compile done, and its probe runs over."""
        if self.backend != tiering.ENGINE.name:
            return
        for _ in range(tiering.ENGINE.hot_after + 1):
            for call in calls:
                call()
        # run times vary, so the runs a graph still needs are asked again
        # after each round, until none needs more (a round that fell one
        # run short left W1's graph compiling while it was timed)
        for _ in range(SETTLE_ROUNDS):
            needed = tiering.runs_until_hot(list(fastlazy.graph_cache.programs.values()))
            if not needed:
                break
            for _ in range(min(needed, SETTLE_RUNS)):
                for call in calls:
                    call()
        # a compile, its probation, then (for an inference graph reading
        # parameters) a second compile with them frozen and its probation
        for _ in range(3):
            tiering.wait()
            for _ in range(tiering.probe_calls() + 1):
                for call in calls:
                    call()
            if not tiering.unsettled(list(fastlazy.graph_cache.programs.values())):
                break

    @property
    def w2_tolerance(self):
        return Compile.w2_tolerance if self.backend == "inductor" else Contender.w2_tolerance

    def w2_step(self, model, x, y, mode):
        """The model stays eager; the inputs are made lazy once
        (`fastlazy.lazy`); inference reads the output with `.to_eager()`,
        training the loss with `.item()` after `opt.step()`."""
        step = _w2_step(model, model, fastlazy.lazy(x), fastlazy.lazy(y), mode,
                        read=fastlazy.LazyTensor.to_eager)
        return step, functools.partial(_eager_params, model)

    # the inductor backend compiles the forward alone (batch norm's
    # statistics fused) and autograd runs its backward: resnet18's first
    # convolution's weight gradient differed from eager's by up to 2.6e-4
    # (45 of 9408 elements beyond torch.compile's 1e-4)
    inductor_w4_tolerance = dict(rtol=1e-3, atol=5e-4)

    @property
    def w4_tolerance(self):
        return self.inductor_w4_tolerance if self.backend == "inductor" else Contender.w4_tolerance

    @property
    def settled_w4_tolerance(self):
        compiled = self.backend in ("inductor", tiering.ENGINE.name)
        return self.inductor_w4_tolerance if compiled else Contender.w4_tolerance

    def w4_step(self, model, module, x, target, mode):
        """The module stays eager (its parameters join the graphs as
        inputs); the input and target are made lazy once; inference reads
        the output with `.to_eager()`, training the loss with `.item()`."""
        step = zoo.step(model, module, module, fastlazy.lazy(x), fastlazy.lazy(target), mode,
                        read=_eager_value)
        return step, functools.partial(zoo.state, module, _eager_value)


def _eager_value(t):
    """A LazyTensor's value; an eager tensor as it is."""
    return t.to_eager() if isinstance(t, fastlazy.LazyTensor) else t


def _to_eager(call):
    return call().to_eager()


def contenders(with_compile: bool = True) -> list[Contender]:
    """Every contender, fastlazy with each backend it registers."""
    found = [Contender(), Jit(), TorchLazy()]
    if with_compile:
        found.append(Compile())
    found.append(FastLazy())
    found += [FastLazy(name) for name in fastlazy.graph_cache.backend_names()]
    return found


def contender_named(name: str) -> Contender:
    """The contender of that name (as Contender.name gives it)."""
    for c in [Contender(), Jit(), TorchLazy(), Compile()] + [
            FastLazy(b) for b in (None, *fastlazy.graph_cache.backend_names())]:
        if c.name == name:
            return c
    raise KeyError(f"no contender named {name!r}")


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
        contender.settle(calls)
        yield Prepared(_alternate(calls), first_call_s,
                       lambda: None if compiled is None else contender.compiles() - compiled)


def _check(results, workload, tensors):
    """Each variant's result must be eager's, to 1e-4, except in elements
    the chain computes badly in float32: where the float64 result moves by
    over 1e-5 (relative) when the inputs move by one float32 rounding (a
    random sign per element, twice), or where eager's float32 result is
    that far from the float64 one, the chain has cancelled most of its
    digits, and any other float32 rounding (a fused kernel's reciprocals
    and fused multiply-adds) lands elsewhere; there a result within 100
    times the larger of those two distances from the float64 value is
    taken.  (On an H200, torch.compile's W1 at n=4000 differed from eager
    in 53 of 16 million elements, by up to 14 % relative, some of them
    where eager's own result happened to be close to the float64 one.)"""
    with fastlazy_state(False):
        expected = [workload.fn(*tensors, *v) for v in workload.variants]
    for got, want, v in zip(results, expected, workload.variants):
        try:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, equal_nan=True)
        except AssertionError:
            if got.shape != want.shape or got.dtype != want.dtype:
                raise
            with fastlazy_state(False):
                exact = workload.fn(*(t.double() for t in tensors), *v)
                sensitivity = torch.zeros_like(exact)
                draw = torch.Generator().manual_seed(0)
                for _ in range(2):
                    moved = [t.double() * (1 + 2.0 ** -24 * (torch.randint(
                        0, 2, t.shape, generator=draw) * 2 - 1).to(t.device)) for t in tensors]
                    sensitivity = torch.maximum(
                        sensitivity, (workload.fn(*moved, *v) - exact).abs())
            got, want = got.double(), want.double()
            close = (got - want).abs() <= 1e-4 + 1e-4 * want.abs()
            close |= got.isnan() & want.isnan()
            noise = torch.maximum((want - exact).abs(), sensitivity)
            badly_computed = noise > 1e-5 * exact.abs()
            if not (close | badly_computed & ((got - exact).abs() <= 100 * noise)).all():
                raise


def _alternate(calls: list[Callable]) -> Callable:
    """One call, or a step that makes the calls in turn."""
    if len(calls) == 1:
        return calls[0]
    turn = itertools.cycle(calls)
    return lambda: next(turn)()


# -- W2: small models -----------------------------------------------------------

INFER, TRAIN = "infer", "train"
W2_MODES = (INFER, TRAIN)
W2_WIDTH, W2_LAYERS, W2_HEADS, W2_SEQ = 256, 8, 4, 32
W2_LR = 0.01


def mlp() -> nn.Module:
    """W2's MLP: 8 x (Linear(256, 256), ReLU), seeded."""
    torch.manual_seed(0)
    layers = []
    for _ in range(W2_LAYERS):
        layers += [nn.Linear(W2_WIDTH, W2_WIDTH), nn.ReLU()]
    return nn.Sequential(*layers)


def transformer_layer() -> nn.Module:
    """W2's nn.TransformerEncoderLayer (d_model 256, 4 heads), seeded."""
    torch.manual_seed(0)
    return nn.TransformerEncoderLayer(d_model=W2_WIDTH, nhead=W2_HEADS, batch_first=True,
                                      dropout=0.0)


@dataclass(frozen=True)
class Model:
    """A W2 model: how to build it, one sample's shape (input and training
    target alike), the batch sizes and modes it runs at."""
    name: str
    build: Callable[[], nn.Module]
    sample_shape: tuple
    batches: tuple
    modes: tuple


W2 = (Model("mlp", mlp, (W2_WIDTH,), (1, 64), (INFER, TRAIN)),
      Model("transformer", transformer_layer, (W2_SEQ, W2_WIDTH), (1,), (INFER,)))


class Unsupported(Exception):
    """A contender cannot run a W2 case (the benchmark skips it)."""


def _w2_step(model, forward, x, y, mode, read=lambda r: r, after_step=lambda: None):
    """Inference: `read(forward(x))` under no_grad.  Training: zero_grad,
    forward, MSE loss against y, backward, SGD step, `after_step()`, then
    the loss as a float."""
    if mode == INFER:
        def infer():
            with torch.no_grad():
                return read(forward(x))
        return infer
    opt = torch.optim.SGD(model.parameters(), lr=W2_LR)

    def train():
        opt.zero_grad()
        loss = F.mse_loss(forward(x), y)
        loss.backward()
        opt.step()
        after_step()
        return loss.item()
    return train


def _eager_params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@dataclass(frozen=True)
class W2Case:
    """One W2 benchmark: a contender running a model at a batch size."""
    model: Model
    batch: int
    mode: str
    contender: Contender

    @property
    def id(self) -> str:
        return f"{self.mode}-b{self.batch}-{self.model.name}-{self.contender.name}"

    @property
    def label(self) -> str:
        return f"W2 {self.model.name} {self.mode} batch={self.batch}"


def w2_contenders(with_compile: bool = True) -> list[Contender]:
    """eager, torch._lazy, torch.compile, fastlazy with each backend."""
    found = [Contender(), TorchLazy()]
    if with_compile:
        found.append(Compile())
    return found + [FastLazy(name) for name in fastlazy.graph_cache.backend_names()]


def parametrize_cases(metafunc, fixture: str, make_cases: Callable) -> None:
    """Parametrize `fixture` over make_cases(quick, with_compile), as the
    suite's --bench-quick and --bench-no-compile options ask."""
    option = metafunc.config.getoption
    quick = option("--bench-quick")
    with_compile = not (quick or option("--bench-no-compile"))
    cases = make_cases(quick, with_compile)
    metafunc.parametrize(fixture, cases, ids=[c.id for c in cases])


def w2_cases(quick: bool = False, with_compile: bool = True) -> list[W2Case]:
    """All W2 cases; quick: the MLP at batch 1, inference (target P7) only."""
    return [W2Case(m, b, mode, c)
            for m in W2 if not quick or m.name == "mlp"
            for mode in m.modes if not quick or mode == INFER
            for b in m.batches if not quick or b == 1
            for c in w2_contenders(with_compile)]


def w2_inputs(model: Model, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The input and the training target, seeded."""
    torch.manual_seed(1)
    shape = (batch, *model.sample_shape)
    return torch.rand(shape), torch.rand(shape)


def _w2_first_step(case: W2Case, contender: Contender, x, y):
    """A fresh model in the case's mode, the contender's step and parameter
    reader, and the result of the first step."""
    module = case.model.build().train(case.mode == TRAIN)
    step, params = contender.w2_step(module, x, y, case.mode)
    return step, params, step()


@contextlib.contextmanager
def prepared_w2(case: W2Case):
    """Set up a W2 case as `prepared` does a W1 one: the first step (timed:
    setup and compilation included), a check against eager (the output; or
    the loss and every parameter after the first SGD step), a warm-up.
    Raises Unsupported when torch._lazy or torch.compile fails in the first
    step."""
    x, y = w2_inputs(case.model, case.batch)
    with fastlazy_state(False):
        _, want_params, want = _w2_first_step(case, Contender(), x, y)
        want_params = want_params()
    contender = case.contender
    with contender.session():
        start = time.perf_counter()
        try:
            step, params, got = _w2_first_step(case, contender, x, y)
        except Exception as error:
            if not contender.skips_on_error:
                raise
            raise Unsupported(f"{contender.name} cannot run {case.label}: "
                              f"{type(error).__name__}: {error}") from error
        first_call_s = time.perf_counter() - start
        tolerance = contender.w2_tolerance
        if case.mode == INFER:
            torch.testing.assert_close(got, want, **tolerance)
        else:
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **tolerance)
            for p, q in zip(params(), want_params, strict=True):
                torch.testing.assert_close(p, q, **tolerance)
        compiled = contender.compiles()
        for _ in range(WARMUP_CALLS):
            step()
        contender.settle([step])
        yield Prepared(step, first_call_s,
                       lambda: None if compiled is None else contender.compiles() - compiled)


# -- W4: real models (zoo.py) -------------------------------------------------------

W4_QUICK_MODELS = ("resnet18", "bert")
W4_FIRST_CALLS = 100             # "first 100 calls": what a user waits for
W4_COLD_TIMEOUT_S = 600          # one fresh process's run of them
BENCH_DIR = pathlib.Path(__file__).resolve().parent


@dataclass(frozen=True)
class W4Case:
    """One W4 benchmark: a contender running a zoo model at a size."""
    model: zoo.ZooModel
    size: zoo.Size
    mode: str
    contender: Contender

    @property
    def id(self) -> str:
        return f"{self.mode}-b{self.size.batch}-{self.model.name}-{self.contender.name}"

    @property
    def label(self) -> str:
        return f"W4 {self.model.name} {self.mode} batch={self.size.batch}"


def w4_contenders(quick: bool = False, with_compile: bool = True) -> list[Contender]:
    """eager, torch._lazy, torch.compile, fastlazy with each backend
    (inductor only with compilation); quick: eager and fastlazy's default
    backend."""
    if quick:
        return [Contender(), FastLazy(fastlazy.backend())]
    found = [Contender(), TorchLazy()]
    if with_compile:
        found.append(Compile())
    return found + [FastLazy(name) for name in fastlazy.graph_cache.backend_names()
                    if with_compile or name != "inductor"]


def w4_cases(quick: bool = False, with_compile: bool = True) -> list[W4Case]:
    """All W4 cases, by model, batch and mode; quick: resnet18 and BERT at
    batch 1, inference."""
    return [W4Case(m, zoo.SIZES[b], mode, c)
            for m in zoo.W4 if not quick or m.name in W4_QUICK_MODELS
            for b in zoo.SIZES if not quick or b == 1
            for mode in m.modes if not quick or mode == INFER
            for c in w4_contenders(quick, with_compile)]


@dataclass
class W4Prepared:
    """A W4 case ready to be timed: `step` makes one call; `first_call_s`
    is the time to the first result (setup and compilation included);
    `call_s` the last warm-up call's time; `counts` fastlazy's counters
    over one steady-state call (None for other contenders)."""
    step: Callable
    first_call_s: float
    call_s: float
    counts: dict | None


@contextlib.contextmanager
def _time_limit(seconds: float | None):
    """TimeoutError in this thread after `seconds` (None: no limit; only
    the main thread can be interrupted, elsewhere there is no limit)."""
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise TimeoutError(f"first call over {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def fastlazy_counts(step: Callable) -> dict:
    """fastlazy's counters over one call of step: nodes recorded, graphs
    computed (flushes), calls run eagerly by op (counters' fallback.<op>
    keys), calls recorded by the generic path."""
    fastlazy.metrics.reset()
    step()
    c = fastlazy.metrics.counters()
    return dict(nodes=c["nodes_recorded"], graphs_per_call=c["flushes"],
                fallbacks={k[len("fallback."):]: v for k, v in c.items()
                           if k.startswith("fallback.")},
                fallbacks_total=c["fallbacks"], generic_calls=c["generic_calls"])


def _check_w4(case: W4Case, got, want, got_state, want_state):
    tolerance = case.contender.w4_tolerance
    if case.mode == INFER:
        torch.testing.assert_close(got, want, **tolerance)
        return
    if not case.contender.eager_random_numbers:
        # a training step with dropout: another generator stream, another loss
        assert torch.isfinite(torch.tensor(got)), got
        return
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **tolerance)
    assert len(got_state) == len(want_state), "gradients, parameters, buffers"
    for k, (g, w) in enumerate(zip(got_state, want_state)):
        torch.testing.assert_close(g, w, **tolerance, msg=lambda m: f"zoo.state [{k}]: {m}")


@contextlib.contextmanager
def prepared_w4(case: W4Case):
    """Set up a W4 case as `prepared_w2` does a W2 one: the first call
    (timed: the contender's setup and compilation included, the model's
    construction not), a check against eager (the output; or the loss and
    every gradient, parameter and buffer after the first SGD step), a
    warm-up, fastlazy's counters over one more call.  Raises Unsupported
    when torch._lazy or torch.compile fails in the first call, or
    torch._lazy's first call runs past its time limit."""
    model, size, mode, contender = case.model, case.size, case.mode, case.contender
    x, target = model.inputs(size)
    with fastlazy_state(False):
        step, state = Contender().w4_step(model, model.build(size, mode), x, target, mode)
        torch.manual_seed(0)                 # the dropout masks of a training step
        want = step()
        want_state = state() if mode == TRAIN else None
    module = model.build(size, mode)
    with contender.session():
        start = time.perf_counter()
        try:
            with _time_limit(contender.first_call_limit_s):
                step, state = contender.w4_step(model, module, x, target, mode)
                torch.manual_seed(0)
                got = step()
        except Exception as error:
            if not contender.skips_on_error:
                raise
            raise Unsupported(f"{contender.name} cannot run {case.label}: "
                              f"{type(error).__name__}: {str(error)[:300]}") from error
        first_call_s = time.perf_counter() - start
        _check_w4(case, got, want, state() if mode == TRAIN else None, want_state)
        contender.settle([step])
        if mode == INFER:
            # the settled program (fastlazy's default engine: maybe a
            # compiled tier, parameters frozen) still gives eager's output
            torch.testing.assert_close(step(), want, **contender.settled_w4_tolerance)
        for _ in range(WARMUP_CALLS):
            start = time.perf_counter()
            step()
            call_s = time.perf_counter() - start
        counts = fastlazy_counts(step) if isinstance(contender, FastLazy) else None
        yield W4Prepared(step, first_call_s, call_s, counts)


def first_calls_cold(case: W4Case, calls: int = W4_FIRST_CALLS,
                     timeout_s: float = W4_COLD_TIMEOUT_S) -> dict:
    """The case's first `calls` calls in a fresh process (w4_cold.py) with
    an empty inductor cache and this process's intra-op threads and
    fastlazy: {"first_call_s", "first_calls_s"} or {"error"}."""
    threads = torch.get_num_threads()
    source = str(pathlib.Path(fastlazy.__file__).resolve().parent.parent)
    cmd = [sys.executable, str(BENCH_DIR / "w4_cold.py"), case.model.name,
           str(case.size.batch), case.mode, case.contender.name,
           f"--calls={calls}", f"--threads={threads}"]
    with tempfile.TemporaryDirectory(prefix="fastlazy-w4-inductor-") as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, OMP_NUM_THREADS=str(threads),
                   PYTHONPATH=os.pathsep.join(
                       p for p in (source, os.environ.get("PYTHONPATH")) if p))
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, env=env,
                                  timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"error": f"over {timeout_s} s"}
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit {done.returncode}: {tail[:300]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])
