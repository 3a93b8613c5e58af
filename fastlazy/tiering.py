"""The tiered engine ("auto", fastlazy's default): every graph runs at once
on the fast tier, and a graph that keeps recurring is compiled by inductor
on the background compile thread, then kept only if it runs faster.

A graph's life:

1. fast -- its first call compiles it for the fast tier (TorchScript's
   interpreter; the native executor for a graph the graph cache's policy
   sends there), which takes milliseconds, and runs it.
2. compiling -- once it has run `hot_after` times and its fast-tier runs
   add up to `hot_seconds`, at an average of at least `hot_min_run` (a
   graph of shorter runs is judged again after its next `hot_seconds` of
   runs), the graph is handed to the compile thread
   (fastlazy.compile_worker), compiled by inductor for the shapes of that
   run.  Calls meanwhile run the fast tier: none waits.
3. probation -- once the compile is done, the next calls run each
   candidate in turn, timed, `PROBE_RUNS` times (after `PROBE_WARMUP`): the
   compiled program and the fast tier again; a compiled program's first
   run is checked against the fast tier's on the same inputs, and one that
   computes other values (beyond rounding: _results_differ) is left out.
   For an inference graph that reads parameters (nn.Parameter), the graph
   is then compiled a second time with them frozen (inductor's freezing: weights prepacked for
   oneDNN, constants folded), while the tier chosen runs; a frozen program
   is valid only while the same parameters, unwritten, come in -- checked
   on every call -- and it goes on probation with the other two once it
   is ready.  (It is compiled second because it cannot go to the compile
   process -- inductor cannot save a program whose parameters it folded --
   and so costs the user's process seconds of throttled compile: ViT's
   took 21 s of a cold process's busy loop, after the plain program's
   12.5 s; the tier the first probation chose runs meanwhile.)  The
   candidate with the shortest typical run (the median of its faster half:
   other work on the machine only ever adds time) wins.  A training graph's candidates are timed by the
   period from one run of the graph to the next instead: most of what a
   candidate changes in a training step is its backward, which autograd
   runs after the graph's run returns (resnet18's training step at batch
   1: the compiled forward ran 4 % faster than the fast tier's, and the
   step with it 1.5-4 % slower or faster as the backward went).  (A fused
   graph is not always faster: convolutions on CPU are often slower under
   inductor than in eager's oneDNN calls.)
   On a GPU, each candidate of an inference graph also has a twin on
   probation that replays it from a CUDA graph (fastlazy.cuda_graphs:
   one launch in place of the graph's kernel launches).  The fast tier's
   twin goes on trial against it as soon as the graph is hot (_TwinTrial),
   so that the replay serves while inductor compiles, and serves a graph
   whose runs are too short to compile at all.
4. hot, or fast for good -- the winner is called directly from then on.
   A compile that fails leaves the graph on the fast tier (counted in
   `compile_failures`, the reason in `fastlazy.metrics.tiers()`).

A hot graph met with new input shapes runs the fast tier while inductor
compiles those shapes in the background: on CPU a static version per shape
in the compile process, up to inductor.STATIC_SHAPES, and the fast tier for
the shapes after them; elsewhere, after `dynamic_after` shapes, one
dynamic-shape version, which serves them only if it wins a trial against
the fast tier on probation's rules (see backends/inductor.py: a dynamic
version's wrapper and symbolic indexing can cost more than fusion saves).
Only a graph whose compiled program gained NEW_SHAPES_MIN_GAIN at its own
shapes compiles others.  On probation a candidate is compared at the shapes
it was compiled for: a call with others runs the fast tier, queues no
compile and is not one of the candidate's timed runs.  The frozen second
compile (above) is queued only for a graph that met no other shapes and
whose runs took FROZEN_MIN_SHARE of the program's time.

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
import threading
import time
import weakref

import torch

from fastlazy import (_core, backends, compile_worker, cuda_graphs, fx_threads, metrics,
                      packed_convs, watch)
from fastlazy.backends.torchscript import TorchScriptProgram
from fastlazy.graph import Slot, describe_input, example_input

PROBE_RUNS = 8            # timed runs of each candidate before the fastest is kept
PROBE_WARMUP = 2          # runs of each candidate before those (caches, allocator)
CANDIDATES = 3            # at most: compiled, compiled with parameters frozen, fast
# A hot graph met with new input shapes compiles them (on CPU static
# versions in the compile process; elsewhere a dynamic-shape version on this
# process's compile thread, 10-30 s of its GIL beside the user's calls) only
# where its compiled program gained at least this much over the fast tier
# at its own shapes; else those shapes run the fast tier.  GPT-2's decode
# step (a new length at every token) ran 0.3 ms a call either way, and a
# loop of `generate` calls ran at 0.6-0.7x eager's speed for the minute its
# new shapes took to compile.
NEW_SHAPES_MIN_GAIN = 0.10
# The second compile, with parameters frozen, runs on this process's compile
# thread (the compile process cannot save its program) for 10-35 s, and the
# user's calls run slower beside it (a loop of GPT-2 `generate` calls: 34 ->
# 50 ms each while its prefill graph compiled so), to make the graph's runs
# faster.  It pays only for a graph that takes a good share of the program's
# time: queued where the graph's fast-tier runs took at least this share of
# the time from its first run to its compile (a model's forward graph: most,
# and 25-35 % where a benchmark calls eager's model in turn; the prefill of
# `generate`, run once per 32 tokens: 1.5 %).
FROZEN_MIN_SHARE = 0.1


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
        # ... and seconds its fast-tier runs must add up to.  While a
        # compile runs (3-40 s of CPU for W4's graphs) the user's calls run
        # 5-10 % slower beside it (GPT-2's calls 11-100 of a cold process:
        # 108-118 ms, 98-101 ms with no compile), and the compiled program
        # saves 10-30 % of the graph's run time once ready: a graph whose
        # runs have cost the program less than this has not shown that
        # the program will run it long enough to repay a compile.  A graph
        # of a few milliseconds is compiled after hot_after runs; a 0.5 ms
        # one after 200.
        self.hot_seconds = float(os.environ.get("FASTLAZY_HOT_SECONDS", "0.1"))
        # ... and those runs must have taken this long each, on average.
        # A compiled program's call costs more than the fast tier's on a
        # graph of a few small ops (inductor's wrapper and guards: a
        # five-op graph on 64 floats ran 3 us slower compiled), so such a
        # graph is never kept compiled, and its compile only costs the
        # user's thread: a loop reading one value per iteration ran at
        # 0.65x eager's speed for the 20 s its 3-us graph was compiling.
        # A graph whose runs lengthen (larger inputs, shape-generic) is
        # judged again on each new window of hot_seconds.
        self.hot_min_run = float(os.environ.get("FASTLAZY_HOT_MIN_RUN_US", "10")) * 1e-6


ENGINE = Engine()

_TOO_SHORT = "fast (runs too short to repay a compile)"


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
        self.fast_seconds = 0.0     # the fast tier's runs until its compile is queued
        self._born = time.perf_counter()
        self._share = None          # of the time until the compile, the fast tier's runs'
        # (runs, fast_seconds) where the window judged for a compile began
        self._window = (0, 0.0)
        self.compile_seconds = None
        self.error = None
        # the tier named where probation left every compiled candidate out
        self._left_out = "fast (compiled results differ)"
        self.fast_run_seconds = self.compiled_run_seconds = None
        self._view = _without_tensors(view)
        self.grad = view.grad       # a training graph (it records autograd history)
        self._bind_fast()
        self._future = None
        self._compiled = None
        # a graph's runs on several threads share it: its moves between
        # tiers (submit, promote, decide) happen once
        self._lock = threading.Lock()
        self._period_of = None      # probation, training: (candidate, start of its run)
        self._plain = None          # the compiled program, kept for the second probation
        self._settled = None        # the call in use while the second compile runs
        # (view, described inputs, _Frozen parameters) of the second compile,
        # from the first compile's end until it is queued
        self._frozen_job = None
        self._constants = {}
        self._dtypes = None         # the fast tier's results' (compiled ones must agree)
        self._dispatchers = []      # the candidates' shape dispatchers (inductor's)
        # why the graph's candidates get no CUDA-graph twin (cuda_graphs), or
        # None where they do; what became of the twins (metrics.tiers())
        self._no_cuda_graph = "not judged yet"
        self.cuda_graph = None      # the probation's twins
        self._fast_twin = None      # the fast tier's trial (_TwinTrial)
        # an inference graph with convolutions may get its weights packed
        # on the fast tier (fastlazy.packed_convs) at its PLAN_AT-th run
        self._packable = packed_convs.has_convs(view)
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
        if future is not None:
            if future.done():
                self.runs -= 1          # (counted by the tier that runs it)
                return self._promote(inputs)
            _count_fast_run()
            return self._fast(*inputs)
        if self._packable and self.runs == packed_convs.PLAN_AT:
            self._pack(inputs)
        start = time.perf_counter()
        out = self._fast(*inputs)
        self.fast_seconds += time.perf_counter() - start
        window = self.fast_seconds - self._window[1]
        if self.runs >= ENGINE.hot_after and window >= ENGINE.hot_seconds:
            if self._no_cuda_graph == "not judged yet":
                self._try_fast_twin(inputs)
            if window < ENGINE.hot_min_run * (self.runs - self._window[0]):
                # too short to repay a compile: judged again after the next window
                self._window = (self.runs, self.fast_seconds)
                self.tier = _TOO_SHORT
            else:
                self._dtypes = _dtypes(out)
                self._submit(inputs)
        return out

    def _try_fast_twin(self, inputs):
        """On a GPU, once the graph is hot: the fast tier on trial beside
        its CUDA-graph twin (_TwinTrial), whatever becomes of the compile
        -- a graph too short to compile gets one too, and the twin serves
        while inductor compiles."""
        self._no_cuda_graph = cuda_graphs.unsuitable(inputs, self.grad)
        if self._no_cuda_graph is None:
            self._fast = _TwinTrial(self, self._fast)

    def _pack(self, inputs):
        """The fast tier with packed convolutions on trial, where the
        graph has any to pack (a failure leaves the plain fast tier)."""
        self._packable = False
        view = self._view
        # (a graph on the native backend keeps its own kernels; one that
        # fuses runs on TorchScript's executor, not step by step)
        if view is None or not isinstance(self.fast, TorchScriptProgram) or self.fast.fuses:
            return
        try:
            found = packed_convs.trial(view, self.fast.slots, inputs, self._fast, _typical,
                                       self._packing_failed)
        except Exception as exc:     # noqa: BLE001 - the plain fast tier stands
            self._packing_failed(f"packed convolutions: {type(exc).__name__}: {exc}"[:500])
            metrics.count_event("packed_conv_failures")
            return
        if found is not None:
            self._fast = found

    def _packing_failed(self, message):
        """Packing the weights failed (called on packed_convs' thread
        beside the user's, or here)."""
        self.error = message

    def _submit(self, inputs):
        if not fx_threads.install():
            # this torch's tracer cannot run beside the user's thread
            return self._stay_fast("fast (no background compiles with this torch)")
        with self._lock:
            view, self._view = self._view, None
        if view is None:
            return None       # another thread's run of this graph submitted it
        if self.grad and _training_graphs_stay_fast:
            return self._stay_fast(_training_graphs_stay_fast)
        if self.grad and view.backward_paths() > 1:
            return self._stay_fast(SEPARATE_BACKWARDS)
        limit = getattr(backends.get("inductor"), "max_depth", None)
        if limit is not None and view.deeper_than(limit):
            return self._stay_fast("fast (too deep to compile)")
        # the tensors the compile needs are made on the compile thread:
        # a graph of many inputs took milliseconds of the user's call here
        # (mobilenet_v3_small's 245: 2.8 ms)
        described = _described(view, self.fast.slots, inputs)
        self._constants = {s.position: s.value for s in view.slots
                           if s.position not in self.fast.slots}
        frozen = _frozen_inputs(inputs)
        self._share = self.fast_seconds / max(time.perf_counter() - self._born, 1e-9)
        self.tier = "compiling"
        metrics.count_event("tier_compiles_queued")
        self._future = compile_worker.submit(self._compile, view, described, frozen)

    def _compile(self, view, described, frozen):
        """On the compile thread: the compiled candidate, ready to run
        inputs like those `described` (_described).  Where the graph reads
        parameters (`frozen`: a _Frozen, or None), the view and the
        descriptions are kept for the second compile (_compile_frozen):
        not the example inputs, which would hold a copy of every parameter
        until then."""
        start = time.perf_counter()
        view = _with_meta_tensors(view)
        program = backends.get("inductor").compile(view, replay=self._replay,
                                                   on_replay=_count_fast_run)
        program.call.warm([example_input(d) for d in described])
        self._plain = program
        if frozen is not None:
            self._frozen_job = (view, described, frozen)
        self.compile_seconds = time.perf_counter() - start     # (counted by the backend)
        return [("compiled", program, None)]

    def _compile_frozen(self, view, described, frozen):
        """On the compile thread: the candidates of the second probation
        -- the compiled program again, and the graph compiled with the
        parameters in `frozen` as constants -- or None where the frozen
        one could not be compiled (the tier in use stays)."""
        start = time.perf_counter()
        try:
            by_position = {self.fast.slots[k]: t for k, t in frozen.tensors()}
            if any(t is None for t in by_position.values()):
                raise RuntimeError("a parameter was freed before its compile")
            program = backends.get("inductor").compile_frozen(view, by_position)
            program.call.warm([example_input(d) for s, d in zip(view.slots, described)
                               if s.position not in by_position])
        except Exception as exc:     # noqa: BLE001 - the tier in use stands
            self.error = f"frozen: {type(exc).__name__}: {exc}"[:500]
            metrics.count_event("tier_frozen_compiles_failed")
            return None
        finally:
            self.compile_seconds = (self.compile_seconds or 0.0) + time.perf_counter() - start
        return [("compiled", self._plain, None), ("compiled, parameters frozen", program, frozen)]

    def _replay(self, *inputs):
        """The fast tier, called with the compiled program's inputs (every
        slot, at positions 0..n-1; the fast tier may take fewer:
        TorchScript folds constant bool scalars)."""
        return self._fast(*[inputs[p] for p in self.fast.slots])

    # -- the switch -----------------------------------------------------------

    def _promote(self, inputs):
        with self._lock:
            future, self._future = self._future, None
            if future is not None:
                self._take(future)
        return self.call(*inputs)

    def _take(self, future):
        """The compile's candidates on probation (or the fast tier for good
        if it failed; the tier in use if a second compile found nothing)."""
        try:
            candidates = future.result()
        except Exception as exc:     # noqa: BLE001 - the fast tier keeps running
            self.error = f"{type(exc).__name__}: {exc}"[:500]
            metrics.count_event("compile_failures")
            metrics.count_event("tier_compiles_failed")
            self._stay_fast("fast (compile failed)")
            return
        metrics.count_event("tier_compiles_done")
        if candidates is None:
            self.call = self._settled
            return
        self._candidates = []
        for name, program, frozen in candidates:
            call = _taking(program, self.fast.slots, self._constants)
            if frozen is not None:
                call = frozen.guarding(call, self._frozen_changed)
            dispatch = _dispatcher(program)
            if dispatch is not None:
                dispatch.holding = self._on_probation
                dispatch.judge = JUDGE
                self._dispatchers.append(dispatch)
            self._candidates.append(_Candidate(name, call, frozen is not None, dispatch))
        self._compiled = self._candidates[0].call
        # the fast tier is timed again beside them: its runs while the
        # compile thread was busy were slowed by it
        graphed = isinstance(self._fast, cuda_graphs.GraphedCall)
        self._fast_candidate = _Candidate("fast, CUDA graph" if graphed else "fast", self._fast,
                                          False)
        self._candidates.append(self._fast_candidate)
        if self._no_cuda_graph is None:
            # each candidate also replayed from a CUDA graph: on a GPU a
            # small graph's run is mostly its kernel launches
            # (the fast tier's own twin may have won its trial already)
            self._candidates += [
                _Candidate(f"{c.name}, CUDA graph", cuda_graphs.GraphedCall(c.call, _results_differ),
                           c.frozen)
                for c in list(self._candidates) if not _graphed(c.call)]
        self.tier = "probation"
        self.call = self._probe

    def _probe(self, *inputs):
        """Each candidate in turn, timed, until each has PROBE_WARMUP +
        PROBE_RUNS runs: an inference graph's by its run, a training
        graph's by the period until the graph's next run (its backward
        and the rest of the step included)."""
        start = time.perf_counter()
        period, self._period_of = self._period_of, None
        if period is not None and not period[0].stale:
            period[0].times.append(start - period[1])
        pending = [c for c in self._candidates
                   if not c.stale and c.runs < PROBE_WARMUP + PROBE_RUNS]
        if not pending:
            with self._lock:
                if self.tier == "probation":    # not decided by another thread
                    self._decide()
            return self.call(*inputs)
        self.runs += 1
        candidate = min(pending, key=lambda c: c.runs)
        candidate.runs += 1
        dispatch = candidate.dispatch
        replays = dispatch.replays if dispatch is not None else 0
        try:
            out = candidate.call(*inputs)
        except cuda_graphs.NotCaptured as exc:
            # the twin is left out; the program it replays stays on probation
            candidate.stale = True
            candidate.note = f"not captured: {exc}"[:300]
            metrics.count_event("cuda_graph_failures")
            return self._fast(*inputs)
        except Exception as exc:      # noqa: BLE001 - the fast tier's run decides
            if candidate is self._fast_candidate:
                raise
            # a compiled program that raises where the fast tier does not
            # (an AOT autograd assertion on an LSTM's saved tensors) is left
            # out; the fast tier's run gives the call its values, or
            # eager's error where the call has one
            candidate.stale = True
            self.error = (f"the {candidate.name} program raised {type(exc).__name__}: "
                          f"{exc}: left out")[:500]
            self._left_out = "fast (compiled program raised)"
            metrics.count_event("tier_candidate_errors")
            return self._fast(*inputs)
        if dispatch is not None and dispatch.replays != replays:
            # no version for these shapes: the fast tier ran, not the candidate
            candidate.runs -= 1
            return out
        if self.grad:
            self._period_of = (candidate, start)
        elif not candidate.stale:
            candidate.times.append(time.perf_counter() - start)
        got = None if candidate is self._fast_candidate else _dtypes(out)
        if got is not None and self._dtypes is not None and got != self._dtypes:
            # (inductor computes any/all of a uint8 tensor as bool)
            candidate.stale = True
            self.error = (f"the {candidate.name} program's results are {got}, "
                          f"the graph's {self._dtypes}: left out")
            metrics.count_event("tier_wrong_dtypes")
            return self._fast(*inputs)
        if got is not None and candidate.runs == 1:
            # its first run (a warm-up, untimed) checked against the fast
            # tier's on the same inputs: a lowering that computes other
            # values (an upstream inductor bug: multilabel_margin_loss; a
            # float cast to int8 saturating where eager's wraps) is left
            # out, and the graph keeps the values its fast tier gives
            with torch.no_grad():
                want = self._fast(*inputs)
            why = _results_differ(out, want)
            if why is not None:
                candidate.stale = True
                self.error = (f"the {candidate.name} program's results differ from the fast "
                              f"tier's ({why}): left out")[:500]
                metrics.count_event("tier_wrong_results")
                return self._fast(*inputs) if self.grad else want
        return out

    def _on_probation(self):
        return self.tier == "probation"

    def _decide(self):
        fast = _typical(self._fast_candidate.times[PROBE_WARMUP:])
        ranked = sorted((_typical(c.times[PROBE_WARMUP:]), k, c)
                        for k, c in enumerate(self._candidates)
                        if c is not self._fast_candidate and not c.stale
                        and len(c.times) > PROBE_WARMUP)
        self.fast_run_seconds = fast
        # (the fast tier's own twin reports its trial: _fast_twin)
        graphed = [c for c in self._candidates
                   if _graphed(c.call) and c is not self._fast_candidate]
        if graphed:
            self.cuda_graph = "; ".join(f"{c.name}: {_outcome(c)}" for c in graphed)
        if ranked and ranked[0][0] <= fast:
            compiled, _, best = ranked[0]
            self.tier = "hot" if best is self._candidates[0] else f"hot ({best.name})"
            self.call = self._counting(best.call)
            # where a frozen winner's inputs change: the next best
            self._fallback = next((c.call for t, _, c in ranked[1:] if t <= fast), self._fast)
            self._compiled = best.call
            metrics.count_event("tier_promotions")
            self.compiled_run_seconds = compiled
            for seconds, _, c in ranked:
                # (the winner, and the fallback a frozen winner's misses go to)
                if c.dispatch is not None and seconds * (1 + NEW_SHAPES_MIN_GAIN) > fast:
                    c.dispatch.holding = _always
                    c.dispatch.dynamic_verdict = (
                        f"fast tier (the compiled program gained under "
                        f"{NEW_SHAPES_MIN_GAIN:.0%} at its own shapes: none compiled)")
        else:
            self.compiled_run_seconds = ranked[0][0] if ranked else None
            self._stay_fast("fast (compiled was slower)" if ranked or self.error is None
                            else self._left_out)
        self._candidates = []
        self._queue_frozen()

    def _queue_frozen(self):
        """After the first probation of an inference graph that reads
        parameters: its second compile, with them frozen, queued; the tier
        chosen runs until it is done (_awaiting)."""
        job, self._frozen_job = self._frozen_job, None
        inductor = backends.get("inductor")
        if job is None or job[2].written or compile_worker.closing() \
                or not hasattr(inductor, "compile_frozen"):
            return
        if any(d.replays for d in self._dispatchers):
            # the graph meets other shapes (its probation replayed them),
            # and a frozen program serves one: not worth the seconds of
            # this process's GIL its compile takes
            return
        if self._share is not None and self._share < FROZEN_MIN_SHARE:
            return
        metrics.count_event("tier_compiles_queued")
        self._settled = self.call
        self._future = compile_worker.submit(self._compile_frozen, *job)
        self.call = self._awaiting

    def _awaiting(self, *inputs):
        """The settled tier's call while the second compile runs."""
        future = self._future
        if future is not None and future.done():
            return self._promote(inputs)
        return self._settled(*inputs)

    def _frozen_changed(self, inputs, for_good):
        """A frozen candidate met other tensors (or the same ones changed)
        where it froze parameters: this call runs elsewhere; `for_good`
        (the parameters were replaced or written) drops the candidate."""
        metrics.count_event("tier_frozen_misses")
        if self.tier == "probation":
            if for_good:
                for c in self._candidates:
                    c.stale |= c.frozen
            return self._candidates[0].call(*inputs)
        fallback = getattr(self, "_fallback", self._fast)
        if for_good and self.tier.startswith("hot ("):
            self.tier = "hot" if fallback is not self._fast else "fast (parameters changed)"
            self._compiled = fallback
            self.call = self._counting(fallback)
        return fallback(*inputs)

    def _counting(self, call):
        """call, counting its runs in self.runs (metrics.tiers()): the
        graph cache calls a settled graph's program directly."""
        def counted(*inputs):
            self.runs += 1
            return call(*inputs)
        return counted

    def _stay_fast(self, tier):
        """The fast tier, called directly from now on (a second compile
        may still put a frozen program on probation: _queue_frozen)."""
        self.tier = tier
        self.call = self._counting(self._fast)
        self._view = self._compiled = None


def _graphed(call) -> bool:
    """Is `call` a CUDA-graph replay, or a trial of one?"""
    return isinstance(call, (cuda_graphs.GraphedCall, _TwinTrial))


class _TwinTrial:
    """The fast tier of a hot GPU inference graph and its CUDA-graph twin
    (cuda_graphs.GraphedCall), called in turn and timed, PROBE_WARMUP +
    PROBE_RUNS runs each, as probation times candidates; then the faster
    becomes the program's fast tier.  A twin that cannot be captured
    leaves the fast tier as it was, the reason in the program's
    `cuda_graph`.  Calls during the trial get the values of whichever ran
    (the twin's first replay was checked against the program's own run)."""

    def __init__(self, program, fast):
        self._program = program
        self._plain = _Candidate("fast", fast, False)
        self._twin = _Candidate("fast, CUDA graph",
                                cuda_graphs.GraphedCall(fast, _results_differ), False)
        self._winner = None
        self._lock = threading.Lock()

    def __call__(self, *inputs):
        if self._winner is not None:
            # (a caller that took the trial before it settled)
            return self._winner(*inputs)
        plain, twin = self._plain, self._twin
        if plain is None:           # (settled by another thread meanwhile)
            return self._winner(*inputs)
        candidate = twin if twin.runs < plain.runs else plain
        candidate.runs += 1
        start = time.perf_counter()
        try:
            out = candidate.call(*inputs)
        except cuda_graphs.NotCaptured as exc:
            metrics.count_event("cuda_graph_failures")
            self._settle(plain, f"fast, CUDA graph: not captured: {exc}"[:500])
            return plain.call(*inputs)
        candidate.times.append(time.perf_counter() - start)
        if min(plain.runs, twin.runs) >= PROBE_WARMUP + PROBE_RUNS:
            fast = _typical(plain.times[PROBE_WARMUP:])
            graphed = _typical(twin.times[PROBE_WARMUP:])
            verdict = "kept" if graphed < fast else "left out"
            self._settle(twin if graphed < fast else plain,
                         f"fast, CUDA graph: {verdict} ({graphed * 1e6:.1f} us a run against "
                         f"the fast tier's {fast * 1e6:.1f} us)")
        return out

    def _settle(self, winner, outcome):
        with self._lock:
            if self._winner is not None:        # (settled by another thread)
                return
            self._winner = winner.call
            # the loser let go: a CUDA graph holds its intermediates' memory
            self._plain = self._twin = None
            program = self._program
            program._fast_twin = outcome
            if program._fast is self:
                program._fast = winner.call
            if program.tier.startswith("fast") and program.call != program._run_fast:
                # a graph left on the fast tier for good calls it directly
                program.call = program._counting(winner.call)


class _Candidate:
    """A program on probation: its call, whether it holds parameters
    frozen, its shape dispatcher (or None), and its timed runs."""

    def __init__(self, name, call, frozen, dispatch=None):
        self.name = name
        self.call = call
        self.frozen = frozen
        self.dispatch = dispatch
        self.runs = 0
        self.times: list[float] = []      # of its runs, or a training graph's periods
        self.stale = False
        self.note = None                  # why a CUDA-graph twin was left out


class _Frozen:
    """The parameters an inference graph read on its hot_after-th run,
    as a frozen candidate takes them: by input index, held weakly, with
    the version and data pointer each had, and the sizes of the tensor
    inputs (a _core.ShapeGuard: the frozen program is compiled for those
    alone).

    Their memory is watched from then on (_core.watch_writes): a write
    through a `.data` alias (`p.data.mul_(0.5)`, an EMA update written
    the old way) changes a parameter without bumping its version counter,
    and the frozen program would go on computing with the old values."""

    def __init__(self, parameters, shapes):
        self.parameters = parameters      # ((index, weakref, version, data_ptr), ...)
        self.shapes = shapes              # _core.ShapeGuard of the run's inputs
        self.written = False
        on_write = _Written(weakref.ref(self))
        _core.watch_writes([ref() for _, ref, _, _ in parameters], on_write)
        weakref.finalize(self, _core.unwatch_writes, on_write)
        _live_frozen.add(self)

    def forget(self, tensors) -> None:
        """Give up the frozen program if it holds one of `tensors`, and
        with it its weak references to them (torch.utils.swap_tensors
        refuses a tensor that has any)."""
        if any(ref() is t for _, ref, _, _ in self.parameters for t in tensors):
            self.written = True
            self.parameters = ()

    def tensors(self):
        return [(k, ref()) for k, ref, _, _ in self.parameters]

    def guarding(self, call, changed):
        """call(*inputs) where the frozen tensors are the inputs, unchanged,
        and the sizes the compiled ones; else changed(inputs, for_good)
        computes the call."""
        shapes = self.shapes

        def guarded(*inputs):
            if self.written:
                return changed(inputs, True)
            for k, ref, version, pointer in self.parameters:
                t = inputs[k]
                if t is not ref() or t._version != version or t.data_ptr() != pointer:
                    return changed(inputs, True)
            if not shapes.matches(inputs):
                return changed(inputs, False)
            return call(*inputs)
        return guarded


# every _Frozen alive, for forget_parameters
_live_frozen: weakref.WeakSet = weakref.WeakSet()


def forget_parameters(*tensors) -> None:
    """No frozen program holds any of `tensors` from now on (they are
    about to be swapped: watch.on_swap)."""
    for frozen in list(_live_frozen):
        frozen.forget(tensors)
    packed_convs.forget_parameters(*tensors)


class _Written:
    """A _Frozen's watch callback: holds it weakly (the core's watch list
    must not keep a dropped program's parameters alive)."""
    __slots__ = ("frozen",)

    def __init__(self, frozen):
        self.frozen = frozen

    def __call__(self):
        frozen = self.frozen()
        if frozen is not None:
            frozen.written = True


def _frozen_inputs(inputs):
    """The parameters (nn.Parameter inputs) of a run without autograd,
    which a frozen candidate may hold as constants; None for a run that
    records autograd history or reads no parameter."""
    if torch.is_grad_enabled():
        return None
    parameters = [(k, weakref.ref(t), t._version, t.data_ptr()) for k, t in enumerate(inputs)
                  # (memory handed to NumPy may be written later, unseen:
                  # such a parameter stays an input of the frozen program)
                  if type(t) is torch.nn.Parameter and not watch.exported(t)]
    return _Frozen(tuple(parameters), _core.ShapeGuard(inputs)) if parameters else None


# A compiled training graph is one autograd node for all its outputs, and
# some programs need eager's autograd graph op by op, which the fast tier
# builds.  AOT autograd's compiled backward cannot itself be differentiated
# ("torch.compile with aot_autograd does not currently support double
# backward"): once the program asks for gradients of gradients (a gradient
# penalty's create_graph=True), or for gradients with respect to a pending
# result whose graph also computes the outputs differentiated (Grad-CAM's
# torch.autograd.grad(score, activation): in the compiled node the score
# does not depend on its sibling output, and eager's autograd raises "One of
# the differentiated Tensors appears to not have been used in the graph"),
# its training graphs stay on the fast tier (the reason, else None).
_training_graphs_stay_fast = None
TWICE_DIFFERENTIATED = "fast (gradients of gradients: a compiled training graph has none)"
# (graph.GraphView.backward_paths)
SEPARATE_BACKWARDS = ("fast (outputs with backwards of their own: a compiled training "
                      "graph's first backward frees what the others need)")
INTERMEDIATES_DIFFERENTIATED = ("fast (gradients with respect to a graph's own results: "
                                 "a compiled training graph has no path between them)")


def keep_training_graphs_fast(programs, reason=TWICE_DIFFERENTIATED) -> None:
    """From now on (autograd_calls.on_create_graph, on_intermediate_inputs),
    training graphs stay on the fast tier, for `reason`: those queued or
    compiled go back to it."""
    global _training_graphs_stay_fast
    if _training_graphs_stay_fast is None:
        _training_graphs_stay_fast = reason
    for program in programs:
        if isinstance(program, TieredProgram) and program.grad \
                and program.tier != _training_graphs_stay_fast:
            with program._lock:
                program._future = None
                program._stay_fast(_training_graphs_stay_fast)


def forget_training_graphs_stay_fast() -> None:
    """Training graphs compiled again (the graph cache was cleared)."""
    global _training_graphs_stay_fast
    _training_graphs_stay_fast = None


def probe_calls() -> int:
    """Calls after a compile is done by which the graph's tier is chosen
    (twice as many where CUDA is available: each candidate of a graph on
    a GPU has a CUDA-graph twin)."""
    twins = 2 if torch.cuda.is_available() else 1
    return (PROBE_WARMUP + PROBE_RUNS) * CANDIDATES * twins + 1


def _outcome(candidate):
    """What probation found of a candidate: why it was left out, or its
    typical run."""
    if candidate.note is not None:
        return candidate.note
    if len(candidate.times) <= PROBE_WARMUP:
        return "not timed"
    return f"{_typical(candidate.times[PROBE_WARMUP:]) * 1e6:.1f} us a run"


def _always():
    return True


def _dispatcher(program):
    """The inductor backend's shape dispatcher behind a compiled program
    (it replays the fast tier for shapes it has no version for, and takes
    a judge of its dynamic-shape version: backends/inductor.py), or None
    for another program, or one with no replay (a frozen program, whose
    guard sends other shapes elsewhere)."""
    call = program.call
    if not (hasattr(call, "holding") and hasattr(call, "replays")):
        return None
    return call if call.replay is not None else None


class _Judge:
    """Probation's rules, as the inductor backend applies them to a hot
    graph's dynamic-shape version before it replaces the fast tier for
    the shapes no static version serves (inductor._DynamicTrial)."""

    @property
    def warmup(self):
        return PROBE_WARMUP

    @property
    def runs(self):
        return PROBE_RUNS

    def typical(self, times):
        return _typical(times)

    def differ(self, got, want):
        return _results_differ(got, want)


JUDGE = _Judge()


def _dtypes(outputs):
    return tuple(getattr(o, "dtype", None) for o in outputs)


# A compiled program's floating results may differ from the fast tier's by
# rounding (a fused kernel sums in its own order, a bfloat16 result rounds
# once); a bound this loose, relative to each result's largest finite
# magnitude, passes that and catches a lowering that computes other values.
RESULTS_RTOL = 2e-2


def _results_differ(got, want):
    """Why a compiled program's results `got` are not the fast tier's
    `want` on the same inputs, or None.  Floating and complex results are
    compared within RESULTS_RTOL of their scale (NaN and infinities where
    the fast tier's are); the others exactly."""
    for k, (g, w) in enumerate(zip(got, want)):
        if not isinstance(w, torch.Tensor):
            continue
        g, w = g.detach(), w.detach()
        if g.shape != w.shape:
            return f"result {k}: shape {tuple(g.shape)}, not {tuple(w.shape)}"
        if not (w.is_floating_point() or w.is_complex()):
            if not torch.equal(g, w):
                return f"result {k}: other values"
            continue
        finite = torch.isfinite(w)
        scale = float(w[finite].abs().max()) if bool(finite.any()) else 0.0
        if not torch.allclose(g, w, rtol=RESULTS_RTOL, atol=RESULTS_RTOL * scale + 1e-6,
                              equal_nan=True):
            return f"result {k}: other values"
    return None


def _typical(times):
    """The median of the faster half of `times`: a run's own cost, with
    the time other work on the machine took from it mostly left out."""
    fastest = sorted(times)[:max(1, (len(times) + 1) // 2)]
    return statistics.median(fastest)


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


def _described(view, positions, inputs):
    """Every slot of the view as describe_input gives it (a slot whose
    tensor was let go, by its _TensorMeta, on the meta device), read on
    the user's thread: the compile thread must not read tensors the user's
    thread may be writing."""
    given = dict(zip(positions, inputs))
    described = []
    for s in view.slots:
        value = given.get(s.position, s.value)
        if isinstance(value, _TensorMeta):
            described.append(("tensor", value.shape, value.stride, value.dtype, "meta", False))
        else:
            described.append(describe_input(value))
    return described


class _TensorMeta:
    """A tensor slot's metadata, kept in place of the tensor: a graph that
    never turns hot must not keep its first inputs alive, and most graphs
    never do, so the meta tensors a compile needs are made only when one
    is submitted (_with_meta_tensors)."""

    __slots__ = ("shape", "stride", "dtype")

    def __init__(self, t):
        self.shape, self.stride, self.dtype = t.shape, t.stride(), t.dtype


def _without_tensors(view):
    """A copy of the view whose tensor slots hold their _TensorMeta."""
    light = copy.copy(view)
    light.slots = [Slot(s.index, s.position, s.kind, _TensorMeta(s.value))
                   if s.kind == "tensor" else s for s in view.slots]
    return light


def _with_meta_tensors(view):
    """The view (from _without_tensors) with meta tensors in its tensor
    slots, as a compile reads them."""
    view.slots = [dataclasses.replace(s, value=_meta(s.value))
                  if isinstance(s.value, _TensorMeta) else s for s in view.slots]
    return view


def _meta(m):
    return torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device="meta")


def describe(program) -> dict:
    """A cached program's tier, runs, compile time and probed times (of a
    run, or for a training graph of the period between two runs: `timed`
    says which), and any compile error (fastlazy.metrics.tiers())."""
    if not isinstance(program, TieredProgram):
        return {"tier": "not tiered", "runs": None}
    return {"tier": program.tier, "runs": program.runs,
            "fast_seconds": program.fast_seconds,
            "compile_seconds": program.compile_seconds,
            "timed": "period" if program.grad else "run",
            "fast_run_seconds": program.fast_run_seconds,
            "compiled_run_seconds": program.compiled_run_seconds, "error": program.error,
            "cuda_graph": "; ".join(o for o in (program._fast_twin, program.cuda_graph) if o)
                          or None,
            "dynamic_shapes": next((d.dynamic_verdict for d in program._dispatchers
                                    if d.dynamic_verdict is not None), None)}


def forget_compiles_after_fork(programs):
    """In a forked child: the compile thread stayed behind, so a compile it
    had under way never finishes here -- those graphs stay on the fast tier
    for good -- and a program's lock may be held by a thread that is gone."""
    for p in programs:
        if isinstance(p, TieredProgram):
            p._lock = threading.Lock()
            future = p._future
            if future is not None and not future.done():
                p._future = None
                if p.call == p._awaiting:       # a second compile: the tier in use stays
                    p.call = p._settled
                else:
                    p._stay_fast("fast (its compile was under way at a fork)")


def runs_until_hot(programs) -> int:
    """How many more runs the graphs of `programs` still on the fast tier,
    their compiles not yet queued, need to reach both thresholds, at their
    mean run time so far (the most any one needs).  A graph whose runs were
    judged too short to compile is not waited for."""
    needed = 0
    for p in programs:
        if isinstance(p, TieredProgram) and p.tier == "fast" and p.runs:
            mean = p.fast_seconds / p.runs
            seconds = ENGINE.hot_seconds - (p.fast_seconds - p._window[1])
            by_time = int(seconds / mean) + 1 if seconds > 0 and mean > 0 else 0
            needed = max(needed, ENGINE.hot_after - p.runs, by_time)
    return needed


def unsettled(programs) -> int:
    """How many of `programs` have a compile queued or under way, or are on
    probation (benchmarks settle graphs until none has)."""
    return sum(1 for p in programs if isinstance(p, TieredProgram)
               and (p._future is not None or p.tier in ("compiling", "probation")))


def summary(programs) -> str:
    """One line: how many of `programs` are on each tier."""
    counts = collections.Counter(p.tier for p in programs if isinstance(p, TieredProgram))
    return ", ".join(f"{tier} {n}" for tier, n in sorted(counts.items())) or "no tiered graphs"


def wait(timeout: float | None = None) -> bool:
    """Block until the compile thread is idle (tests and benchmarks use this
    to measure the hot tier); False if `timeout` seconds passed first."""
    return compile_worker.idle(timeout)
