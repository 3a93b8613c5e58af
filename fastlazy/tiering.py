"""The tiered engine ("auto", fastlazy's default): every graph runs at once
on the fast tier, and a graph that keeps recurring is compiled by inductor
on the background compile thread, then kept only if it runs faster.

A graph's life:

1. fast -- its first call compiles it for the fast tier (TorchScript's
   interpreter; the native executor for a graph the graph cache's policy
   sends there), which takes milliseconds, and runs it.
2. compiling -- on its `hot_after`-th run the graph is handed to the
   compile thread (fastlazy.compile_worker), compiled by inductor for the
   shapes of that run.  Calls meanwhile run the fast tier: none waits.
3. probation -- once the compile is done, the next `PROBE_RUNS` calls run
   the compiled program, timed; the tier whose median run is shorter
   wins.  (A fused graph is not always faster: convolutions on CPU are
   often slower under inductor than in eager's oneDNN calls.)
4. hot, or fast for good -- the winner is called directly from then on.
   A compile that fails leaves the graph on the fast tier (counted in
   `compile_failures`, the reason in `fastlazy.metrics.tiers()`).

A hot graph met with new input shapes runs the fast tier while inductor
compiles those shapes in the background (after `dynamic_after` shapes, one
dynamic-shape version serves them all: see backends/inductor.py).

Every graph is a TieredProgram in the graph cache.  It keeps no tensor of
the recording that made it: the view it will compile later holds meta
tensors in place of the inputs.
"""
from __future__ import annotations

import collections
import copy
import dataclasses
import os
import statistics
import time

import torch

from fastlazy import backends, compile_worker, fx_threads, metrics

PROBE_RUNS = 5            # compiled runs timed before the faster tier is kept
FAST_SAMPLES = 8          # recent fast-tier run times kept for the comparison


class Engine:
    """What the graph cache holds as its backend when "auto" is active."""
    name = "auto"
    specializes_shapes = False

    def __init__(self):
        # runs of one graph before its background compile.  An inductor
        # compile costs seconds of the compile thread (0.5-18 s for W4's
        # graphs), and a program that ends while one is under way waits
        # for it at exit; the compiled graph saves at most a few hundred
        # microseconds a run.  After 10 runs a graph is a loop's body, and
        # a short script (the README's three training steps) compiles
        # nothing.
        self.hot_after = int(os.environ.get("FASTLAZY_HOT_AFTER", "10"))


ENGINE = Engine()

class TieredProgram:
    """A Program (slots, call, single, source, run) whose `call` moves from
    the fast tier to the compiled one.  `single` is always False: every
    tier's call returns a sequence of outputs."""

    single = False

    def __init__(self, view, fast):
        self.fast = fast
        self.slots = fast.slots
        self.source = fast.source
        self.tier = "fast"
        self.runs = 0
        self.compile_seconds = None
        self.error = None
        self.fast_run_seconds = self.compiled_run_seconds = None
        self._view = _without_tensors(view)
        self._bind_fast()
        self._fast_times: list[float] = []
        self._probe_times: list[float] = []
        self._future = None
        self._compiled = None
        self._constants = {}
        self.call = self._run_fast

    def run(self, inputs):
        """The first run (the graph cache's miss path)."""
        self.runs += 1
        out = self.fast.run(inputs)
        # the first run may have replaced the fast program's callable
        # (TorchScript's executor choice: backends/torchscript.py)
        self._bind_fast()
        return out

    def _bind_fast(self):
        """self._fast: the fast tier's callable, returning a sequence."""
        call = self.fast.call
        self._fast = call if not self.fast.single else (lambda *inputs: (call(*inputs),))

    # -- the fast tier ------------------------------------------------------

    def _run_fast(self, *inputs):
        self.runs += 1
        future = self._future
        if future is not None and future.done():
            return self._promote(inputs)
        start = time.perf_counter()
        out = self._fast(*inputs)
        _keep(self._fast_times, time.perf_counter() - start, FAST_SAMPLES)
        if future is not None:
            _count_fast_run()
        elif self.runs >= ENGINE.hot_after:
            self._submit(inputs)
        return out

    def _submit(self, inputs):
        if not fx_threads.install():
            # this torch's tracer cannot run beside the user's thread
            return self._stay_fast("fast (no background compiles with this torch)")
        limit = getattr(backends.get("inductor"), "max_depth", None)
        if limit is not None and self._view.depth() > limit:
            return self._stay_fast("fast (too deep to compile)")
        view, self._view = self._view, None
        examples = _examples(view, self.fast.slots, inputs)
        self._constants = {s.position: s.value for s in view.slots
                           if s.position not in self.fast.slots}
        self.tier = "compiling"
        metrics.count_event("tier_compiles_queued")
        self._future = compile_worker.submit(self._compile, view, examples)

    def _compile(self, view, examples):
        """On the compile thread: the compiled program, ready to run the
        shapes of `examples`."""
        start = time.perf_counter()
        program = backends.get("inductor").compile(
            view, replay=self._replay, on_replay=_count_fast_run)
        program.call.warm(examples)
        self.compile_seconds = time.perf_counter() - start     # (counted by the backend)
        return program

    def _replay(self, *inputs):
        """The fast tier, called with the compiled program's inputs (every
        slot, at positions 0..n-1; the fast tier may take fewer:
        TorchScript folds constant bool scalars)."""
        return self._fast(*[inputs[p] for p in self.fast.slots])

    # -- the switch -----------------------------------------------------------

    def _promote(self, inputs):
        future, self._future = self._future, None
        try:
            compiled = future.result()
        except Exception as exc:     # noqa: BLE001 - the fast tier keeps running
            self.error = f"{type(exc).__name__}: {exc}"[:500]
            metrics.count_event("compile_failures")
            metrics.count_event("tier_compiles_failed")
            self._stay_fast("fast (compile failed)")
            return self._fast(*inputs)
        metrics.count_event("tier_compiles_done")
        self._compiled = _taking(compiled, self.fast.slots, self._constants)
        self.tier = "probation"
        self.call = self._probe
        return self._probe(*inputs)

    def _probe(self, *inputs):
        start = time.perf_counter()
        out = self._compiled(*inputs)
        self._probe_times.append(time.perf_counter() - start)
        if len(self._probe_times) > PROBE_RUNS:
            self._decide()
        return out

    def _decide(self):
        compiled = statistics.median(self._probe_times[1:])    # the first warms up
        fast = statistics.median(self._fast_times) if self._fast_times else float("inf")
        if compiled <= fast:
            self.tier = "hot"
            self.call = self._compiled
            metrics.count_event("tier_promotions")
        else:
            self._stay_fast("fast (compiled was slower)")
        self.fast_run_seconds, self.compiled_run_seconds = fast, compiled

    def _stay_fast(self, tier):
        """The fast tier for good, called directly from now on."""
        self.tier = tier
        self.call = self._fast
        self._view = self._compiled = None


def _keep(samples, value, limit):
    samples.append(value)
    if len(samples) > limit:
        del samples[0]


def _count_fast_run():
    metrics.count_event("tier_fast_runs_while_compiling")


def _taking(compiled, slots, constants):
    """compiled.call taking the inputs at `slots` (the fast tier's) and
    returning a sequence.  `constants`: position -> value of the slots
    the fast tier does not take (constant bool scalars, part of the key)."""
    call = compiled.call
    if compiled.single:
        call = (lambda inner: lambda *inputs: (inner(*inputs),))(call)
    if tuple(compiled.slots) == tuple(slots):
        return call
    given = {p: k for k, p in enumerate(slots)}
    order = [(given[p], None) if p in given else (None, constants[p]) for p in compiled.slots]

    def reordered(*inputs):
        return call(*[c if k is None else inputs[k] for k, c in order])
    return reordered


def _examples(view, positions, inputs):
    """Tensors like the inputs of one run, for every slot of the view:
    fresh memory of the same sizes, strides and dtypes (the compile thread
    must not read tensors the user's thread may be writing)."""
    given = dict(zip(positions, inputs))
    examples = []
    for s in view.slots:
        value = given.get(s.position, s.value)
        if isinstance(value, torch.Tensor):
            value = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype,
                                        device=value.device).requires_grad_(value.requires_grad)
        examples.append(value)
    return examples


def _without_tensors(view):
    """A copy of the view whose tensor slots hold meta tensors: the
    compile that may come later needs their metadata, and a graph that
    never turns hot must not keep its first inputs alive."""
    light = copy.copy(view)
    light.slots = [dataclasses.replace(s, value=_meta(s.value)) if s.kind == "tensor" else s
                   for s in view.slots]
    return light


def _meta(t):
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def describe(program) -> dict:
    """A cached program's tier, runs, compile time and run times, and any
    compile error (fastlazy.metrics.tiers())."""
    if not isinstance(program, TieredProgram):
        return {"tier": "not tiered", "runs": None}
    return {"tier": program.tier, "runs": program.runs,
            "compile_seconds": program.compile_seconds,
            "fast_run_seconds": program.fast_run_seconds,
            "compiled_run_seconds": program.compiled_run_seconds, "error": program.error}


def summary(programs) -> str:
    """One line: how many of `programs` are on each tier."""
    counts = collections.Counter(p.tier for p in programs if isinstance(p, TieredProgram))
    return ", ".join(f"{tier} {n}" for tier, n in sorted(counts.items())) or "no tiered graphs"


def wait(timeout: float | None = None) -> bool:
    """Block until the compile thread is idle (tests and benchmarks use this
    to measure the hot tier); False if `timeout` seconds passed first."""
    return compile_worker.idle(timeout)
