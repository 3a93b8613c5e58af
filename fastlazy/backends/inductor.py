"""The inductor backend: the graph as an aten-level FX graph compiled by
torch inductor -- the fused path on CPU (C++/OpenMP kernels) and on CUDA
(Triton kernels).

Shape policy: a graph is compiled for the exact input shapes first; once one
graph structure has met `dynamic_after` distinct input shapes it is compiled
once more with dynamic shapes, and that version serves every later shape, so
a loop over variable sequence lengths stops compiling.

Python scalars are graph inputs (0-dim tensors), never constants, so a new
scalar value never recompiles.  Each scalar is cast to the dtype eager would
compute the op in (torch.result_type of the op's operands), which keeps the
result dtypes of eager's scalar promotion.
"""
from __future__ import annotations

import concurrent.futures
import os
import threading
import time

import torch
import torch.fx

from fastlazy import _core, compile_process, compile_worker, fx_threads, metrics
from fastlazy.backends.base import Backend, Program
from fastlazy.inductor_graph import build_fx, input_kinds, kernel_breaks

# Inductor's compile is not thread-safe (its caches and dynamo's global
# state): one compile at a time, process-wide.  Re-entrant, since a finalizer
# run during a compile may read a LazyTensor whose graph needs one.
_compile_lock = threading.RLock()


def new_lock_after_fork():
    """A fresh lock in a forked child (fastlazy's boot registers this): one
    the compile thread held at the fork would stay held for good there."""
    global _compile_lock
    _compile_lock = threading.RLock()


_SCALAR_DTYPES = {"bool": torch.bool, "int": torch.int64, "float": torch.float64,
                  "complex": torch.complex128}


class InductorBackend(Backend):
    """`dynamic_after` (FASTLAZY_DYNAMIC_AFTER, default 3): distinct shapes
    before a graph is compiled with dynamic shapes.  `async_compile`
    (FASTLAZY_ASYNC_COMPILE=1): compile static-shape graphs on a background
    thread and replay them node by node (eager backend) until the kernels are
    ready, so a first call never waits seconds for inductor."""
    name = "inductor"
    # Inductor compiles a 10,000-node chain in minutes (2,000 in 26 s) and
    # its passes walk the graph in Python: deeper graphs run natively.
    max_depth = 4000

    def __init__(self):
        self.dynamic_after = int(os.environ.get("FASTLAZY_DYNAMIC_AFTER", "3"))
        self.async_compile = os.environ.get("FASTLAZY_ASYNC_COMPILE") == "1"

    def compile(self, view, replay=None, on_replay=None) -> Program:
        """replay: a callable computing the same graph (same inputs, a
        sequence of outputs), run while a compile for new input shapes is
        under way on the background thread; without one, compiles happen
        at the call that needs them.  on_replay(): called per replayed run
        (default: counted as a fallback)."""
        if view.grad and view.backward_paths() > 1:
            # (the tiered engine keeps such a graph on its fast tier)
            raise SeparateBackwards(
                "the graph's outputs have backwards of their own, which one compiled "
                "autograd node cannot give: it runs on the eager backend")
        dispatch = _ShapeDispatch(input_kinds(view), self, replay, on_replay, view=view)
        return Program([s.position for s in view.slots], dispatch, False, lambda: dispatch.gm.code)

    def compile_frozen(self, view, frozen) -> Program:
        """The graph with the tensors in `frozen` (slot position -> tensor)
        as constants, compiled with inductor's freezing: convolution
        weights prepacked for oneDNN, subgraphs of constants folded.  Its
        slots are the other positions; static shapes only.  The caller
        must check on every call that the same tensors, unchanged, are
        the graph's inputs at those positions (tiering does)."""
        gm = torch.fx.GraphModule(torch.nn.Module(), build_fx(view))
        kinds = _freeze(gm, view, frozen, input_kinds(view))
        dispatch = _ShapeDispatch(kinds, self, None, None, frozen=True, gm=gm,
                                  breaks=kernel_breaks(view))
        return Program([s.position for s in view.slots if s.position not in frozen],
                       dispatch, False, gm.code)

    def submit(self, fn, *args):
        """Run fn(*args) on fastlazy's one background compile thread (its
        traces made safe beside the user's thread: fastlazy.fx_threads)."""
        if not fx_threads.install():
            raise RuntimeError("this torch's FX tracer cannot run on a background thread")
        return compile_worker.submit(fn, *args)


class SeparateBackwards(Exception):
    """A training graph whose outputs are differentiated apart
    (graph.GraphView.backward_paths)."""


class _ShapeDispatch:
    """Compiled versions of one graph structure, by input shapes."""

    def __init__(self, kinds, backend, replay, on_replay, frozen=False, gm=None, view=None,
                 breaks=None):
        self._view = view         # the graph's view, or None where `gm` is given
        self._graph = None if gm is None else gm.graph
        self._gm = gm             # made when a compile on this process needs it
        self.frozen = frozen      # gm holds constants: inductor's freezing, static shapes
        self.kinds = kinds        # per input: None (a tensor) or a scalar kind
        self.backend = backend
        self.replay = replay      # runs the graph while a background compile does
        self.on_replay = on_replay
        self.by_shape = {}        # shapes -> compiled callable or pending Future
        self.dynamic = None       # the dynamic-shape version (or its Future)
        self.failed = False       # a background compile failed: replay from now on
        # the graph records autograd history: compiled as a training
        # program (forward and backward); else as an inference one
        self.grad = view is not None and view.grad
        self.detached = _read_detached(view) if self.grad else ()
        # the kernels its program ends, about (inductor_graph.kernel_breaks)
        self.breaks = kernel_breaks(view) if breaks is None else breaks
        # inputs are converted (_args) where some are scalars or detached
        self.converts = bool(self.detached) or any(k is not None for k in kinds)
        # (ShapeGuard, compiled callable) of the static-shape version run
        # last: a call with its sizes goes straight to it
        self.last = None
        self.guards = {}          # shapes -> ShapeGuard of the inputs
        self.replays = 0          # calls the replay ran: no version for their shapes
        # Set by the tiered engine (fastlazy.tiering) on its candidates:
        # `holding()`, while true, has a call with new shapes replayed
        # without queueing a compile (probation compares the program at
        # the shapes it was compiled for); `judge` puts a dynamic-shape
        # version on trial against the replay before it serves
        # (_DynamicTrial), which leaves its verdict in `dynamic_verdict`.
        self.holding = None
        self.judge = None
        self.dynamic_verdict = None

    @property
    def graph(self):
        """The FX graph, built when a compile in this process (or a reader
        of the code) needs it: a compile in the child builds its own from
        the view, so the user's process spends no GIL time on it."""
        if self._graph is None:
            self._graph = build_fx(self._view)
        return self._graph

    @property
    def gm(self):
        """The graph as a GraphModule (its code generated)."""
        if self._gm is None:
            self._gm = torch.fx.GraphModule(torch.nn.Module(), self.graph)
        return self._gm

    def _args(self, inputs):
        args = [v if kind is None else _scalar_tensor(kind, v)
                for v, kind in zip(inputs, self.kinds)]
        for k in self.detached:
            args[k] = args[k].detach()
        return args

    def warm(self, inputs):
        """Compile now, on this thread, for the shapes of `inputs` (the
        tiered engine calls this on the compile thread)."""
        args = self._args(inputs)
        self.by_shape[tuple(a.shape for a in args)] = self._compile(args, dynamic=False)

    def __call__(self, *inputs):
        last = self.last
        if last is not None and last[0].matches(inputs):
            if self.grad:
                _keep_saved_tensors()
            return last[1](*self._args(inputs)) if self.converts else last[1](*inputs)
        return self._dispatch(inputs)

    def _dispatch(self, inputs):
        """A call whose sizes are not the last static version's: the
        static version for its shapes, else the dynamic one, compiled or
        queued if there is none (the replay runs meanwhile)."""
        if self.failed:
            return self._replayed(inputs)
        if self.grad:
            _keep_saved_tensors()
        args = self._args(inputs)
        shapes = tuple(a.shape for a in args)
        fn = self.by_shape.get(shapes)
        if isinstance(fn, concurrent.futures.Future) and fn.done():
            try:
                fn = self.by_shape[shapes] = fn.result()
            except Exception:     # noqa: BLE001 - the replay keeps computing the graph
                return self._failed(inputs)
        if fn is not None and not isinstance(fn, concurrent.futures.Future):
            guard = self.guards.get(shapes)
            if guard is None:
                guard = self.guards[shapes] = _core.ShapeGuard(inputs)
            self.last = (guard, fn)
            return fn(*args)
        if self.holding is not None and self.holding():
            return self._replayed(inputs)
        if self.dynamic is not None:
            return self._run_dynamic(inputs, args)
        if fn is not None:        # its compile is under way
            return self._replayed(inputs)
        if self.judge is not None and compile_process.takes(args):
            # the tiered engine's CPU graphs: static versions only, each
            # compiled in the compile process, up to STATIC_SHAPES; other
            # shapes run the fast tier.  A dynamic version compiles on this
            # process's compile thread (10-20 s of its GIL: GPT-2's
            # `generate` calls ran 40-50 % slower beside its decode step's),
            # its guards can recompile on the calling thread (a 1.5 s stall
            # measured), and the static versions run faster (that decode
            # step: 340 us static, 560-655 us dynamic, 335-418 us fast tier).
            if len(self.by_shape) >= STATIC_SHAPES:
                self.dynamic = _REPLAY
                self.dynamic_verdict = (f"fast tier (after {STATIC_SHAPES} shapes compiled, "
                                        f"other shapes stay on it)")
                return self.replay(*inputs)
        elif len(self.by_shape) >= self.backend.dynamic_after and not self.frozen:
            metrics.count_recompile("inductor: dynamic shapes")
            if self.replay is not None:
                self.dynamic = self.backend.submit(self._compile, _examples(args), True)
                return self._replayed(inputs)
            self.dynamic = self._compile(args, dynamic=True)
            return self.dynamic(*args)
        if self.by_shape:
            metrics.count_recompile("inductor: new input shape")
        if self.replay is not None:
            self.by_shape[shapes] = self.backend.submit(self._compile, _examples(args), False)
            return self._replayed(inputs)
        fn = self.by_shape[shapes] = self._compile(args, dynamic=False)
        self.guards[shapes] = guard = _core.ShapeGuard(inputs)
        self.last = (guard, fn)
        return fn(*args)

    def _run_dynamic(self, inputs, args):
        dynamic = self.dynamic
        if isinstance(dynamic, concurrent.futures.Future):
            if not dynamic.done():
                return self._replayed(inputs)
            try:
                dynamic = dynamic.result()
            except Exception:     # noqa: BLE001 - the replay keeps computing the graph
                return self._failed(inputs)
            if self.judge is not None:
                dynamic = _DynamicTrial(dynamic, self.judge)
            self.dynamic = dynamic
        if dynamic is _REPLAY:
            return self.replay(*inputs)
        if type(dynamic) is _DynamicTrial:
            return dynamic.run(self, inputs, args)
        return dynamic(*args)

    def _failed(self, inputs):
        """A background compile failed: this and every later call replay."""
        metrics.count_event("compile_failures")
        self.failed = True
        self.last = None
        return self._replayed(inputs)

    def _replayed(self, inputs):
        self.replays += 1
        if self.on_replay is None:
            metrics.count_fallback("inductor: replayed while compiling")
        else:
            self.on_replay()
        return self.replay(*inputs)

    def _compile(self, args, dynamic):
        if not self.grad:
            # A graph run under no_grad or inference_mode is compiled as an
            # inference program, though its parameters require grad: a
            # training program saves activations for nothing, and under
            # inference_mode autograd refuses to save them at all.
            args = [a.detach() if isinstance(a, torch.Tensor) and a.requires_grad else a
                    for a in args]
        with _compile_lock:
            return self._compile_locked(args, dynamic)

    def _compile_locked(self, args, dynamic):
        if not _cpp_wrapper_pays(args, self.breaks):
            return self._compile_with(args, dynamic, cpp_wrapper=False)
        try:
            return self._compile_with(args, dynamic, cpp_wrapper=True)
        except Exception:     # noqa: BLE001 - the Python wrapper is the fallback
            if compile_worker.closing():
                raise             # (the program is exiting: no second compile)
            metrics.count_event("tier_cpp_wrapper_failures")
            return self._compile_with(args, dynamic, cpp_wrapper=False)

    def _compile_with(self, args, dynamic, cpp_wrapper):
        from torch._inductor import config
        if self.grad:
            _keep_saved_tensors()
        # Inductor's channels-last convolutions (its layout optimization, on
        # by default on CPU), not where the graph computes gradients: its
        # parameters are contiguous and change at every step, so the program
        # would convert each weight at every call and hand back each weight's
        # gradient channels-last, which AccumulateGrad then copies into the
        # parameter's layout (resnet18's training step at batch 1: 0.86x
        # eager with it, 1.00x without; 0.96x and 1.05x at batch 8).
        # Inference graphs keep it: frozen weights are converted once.
        #
        # A training program's backward is compiled with its forward, here
        # on the compile thread: AOT autograd otherwise lowers it at the
        # first backward, on the user's thread -- a compile stall there, and
        # a backward inductor cannot lower (an embedding's sparse gradient
        # under the C++ wrapper) raised from the user's `backward()`
        # instead of failing the compile (the standalone compile of the
        # compile process lowers both at once already).
        from torch._functorch import config as functorch_config
        with config.patch(cpp_wrapper=cpp_wrapper,
                          layout_optimization=config.layout_optimization and not self.grad), \
                functorch_config.patch(force_non_lazy_backward_lowering=self.grad):
            return self._compile_now(args, dynamic)

    def _compile_now(self, args, dynamic):
        start = time.perf_counter()
        compiled = None
        # (a frozen graph cannot go: inductor cannot save a program whose
        # parameters it folded)
        if not dynamic and not self.frozen and compile_worker.on_compile_thread() \
                and compile_process.takes(args):
            compiled = self._compile_in_child(args)
        if compiled is None:
            compiled = self._compile_here(args, dynamic)
        metrics.add_compile_time(time.perf_counter() - start)
        return compiled

    def _compile_here(self, args, dynamic):
        if self.frozen:
            from torch._inductor import compile as inductor_compile, config
            # freezing applies to inference graphs: compiled without grad
            with config.patch(freezing=True), torch.no_grad():
                return inductor_compile(self.gm, list(args))
        if dynamic:
            compiled = torch.compile(self.gm, backend="inductor", dynamic=True, fullgraph=True)
            compiled(*args)         # compile now, so the time is attributed here
            return compiled
        # Shapes are this dispatcher's key already: inductor straight on the
        # FX graph, without dynamo's guards on every call.  (Imported here:
        # importing inductor changes torch, and importing fastlazy must not.)
        from torch._inductor import compile as inductor_compile
        return inductor_compile(self.gm, list(args))

    def _compile_in_child(self, args):
        """The compile process's program (fastlazy.compile_process), or
        None where the job did not make it through and this thread must
        compile."""
        try:
            return compile_process.compile(self._view, args)
        except compile_process.Unavailable as exc:
            if compile_worker.closing():
                raise RuntimeError("fastlazy is exiting: compile dropped") from exc
            metrics.count_event("tier_child_compile_fallbacks")
            return None


# Static versions a tiered CPU graph compiles (see _ShapeDispatch._dispatch)
STATIC_SHAPES = 8

# A dispatcher's `dynamic` once its dynamic-shape version lost its trial:
# shapes without a static version replay (the fast tier) for good.
_REPLAY = object()


class _DynamicTrial:
    """A dynamic-shape version, compiled, on trial against the replay (the
    tiered engine's fast tier) before it serves the shapes no static
    version does.  A dynamic version is not always faster: its wrapper
    computes every size and its kernels index symbolically (GPT-2's decode
    step, a new length at every token: 560-655 us a run dynamic, 340 us
    static, 335-418 us on the fast tier).  Calls alternate between the two,
    each timed by its run (a training graph's by the period to the graph's
    next call, which holds its backward), `judge.warmup + judge.runs` each;
    the dynamic version's first run is checked against the replay's values
    on the same inputs.  It is kept where its typical time is no longer."""

    def __init__(self, fn, judge):
        self.fn = fn
        self.judge = judge
        self.calls = 0
        self.times = ([], [])     # the dynamic version's, the replay's
        self.period = None        # a training graph's: (side, start of its run)

    def run(self, dispatch, inputs, args):
        judge = self.judge
        side = self.calls % 2
        self.calls += 1
        start = time.perf_counter()
        if self.period is not None:
            self.times[self.period[0]].append(start - self.period[1])
            self.period = None
        if side == 1:
            out = dispatch.replay(*inputs)
        else:
            out = self.fn(*args)
            if self.calls == 1:
                with torch.no_grad():
                    want = dispatch.replay(*inputs)
                why = judge.differ(out, want)
                if why is not None:
                    self._settle(dispatch, False, f"its results differ from the fast tier's ({why})")
                    metrics.count_event("tier_wrong_results")
                    return dispatch.replay(*inputs) if dispatch.grad else want
        if dispatch.grad:
            self.period = (side, start)
        else:
            self.times[side].append(time.perf_counter() - start)
        needed = judge.warmup + judge.runs
        if len(self.times[0]) >= needed and len(self.times[1]) >= needed:
            mine, fast = (judge.typical(t[judge.warmup:]) for t in self.times)
            what = "period" if dispatch.grad else "run"
            self._settle(dispatch, mine <= fast, f"{mine * 1e6:.0f} us a {what}, the fast "
                                                 f"tier's {fast * 1e6:.0f} us")
        return out

    def _settle(self, dispatch, keep, why):
        dispatch.dynamic = self.fn if keep else _REPLAY
        dispatch.dynamic_verdict = ("compiled" if keep else "fast tier") + f" ({why})"
        metrics.count_event("tier_dynamic_kept" if keep else "tier_dynamic_dropped")


# the kernel breaks (inductor_graph.kernel_breaks) from which the C++
# wrapper pays: see _cpp_wrapper_pays
CPP_WRAPPER_BREAKS = 2


def _cpp_wrapper_pays(args, breaks):
    """Whether to compile with inductor's C++ wrapper: on fastlazy's compile
    thread (where nobody waits for the compile), for CPU graphs that launch
    several kernels.  The wrapper calls the kernels from C++ instead of a
    Python function: W4's compiled transformer graphs at batch 1 ran 10-25 %
    faster (GPT-2 602 -> 516 us, BERT 443 -> 369 us), for 4-7 s more of
    background compile.  But its call costs more than the Python wrapper's
    where one kernel does the work (it hands every input to C++ as a
    pointer): about 1 us more a call for one fused kernel over 1-50
    inputs, 1.3-2 us more for W1's 32-op chain over 9; a chain of k
    matmuls, each followed by a fused relu and add, ran 0.2 us slower with
    it at k=1, 0.9 us faster at k=2 and 2.8 us at k=3 (4x16 inputs)."""
    return breaks >= CPP_WRAPPER_BREAKS and compile_worker.on_compile_thread() and all(
        a.device.type == "cpu" for a in args if isinstance(a, torch.Tensor))


_thread = threading.local()


def _keep_saved_tensors():
    """Training programs whose backward may run twice
    (`backward(retain_graph=True)`, as eager allows): AOT autograd's
    donated buffers let a compiled backward overwrite the tensors saved for
    it, and its runtime then refuses retain_graph.  The flag is read where
    a program is compiled (here, and in the compile process, which turns
    it off too) and where its backward runs -- on CPU the thread that runs
    the program -- and torch's config settings hold per thread: it is
    turned off on each thread that compiles or runs one (a memory saving of
    torch.compile's training graphs there, not a change of values)."""
    if not getattr(_thread, "kept", False):
        from torch._functorch import config as functorch_config
        functorch_config.donated_buffer = False
        _thread.kept = True


# A scalar input's 0-dim tensor, made once per value: torch.tensor costs
# ~2.5 us, and a transformer's graph passes a dozen scalars (eps, the GELU
# constants) on every call.  Compiled graphs only read their inputs, and no
# graph output is a view of a scalar slot (scalars are the non-tensor
# operands of ops), so sharing one tensor per value is safe.
_scalar_tensors: dict = {}
_MAX_SCALAR_TENSORS = 4096


def _scalar_tensor(kind, value):
    # -0.0 == 0.0 and 1 == 1.0 == True: the key keeps them apart
    key = (kind, type(value), value if value or kind == "bool" else repr(value))
    t = _scalar_tensors.get(key)
    if t is None:
        t = torch.tensor(value, dtype=_SCALAR_DTYPES[kind])
        if len(_scalar_tensors) >= _MAX_SCALAR_TENSORS:
            _scalar_tensors.clear()
        _scalar_tensors[key] = t
    return t


def _freeze(gm, view, frozen, kinds):
    """Make the placeholders of the slots in `frozen` attributes of gm
    holding those tensors (buffers: inductor's freezing folds a graph's
    parameters and buffers); the kinds of the placeholders left."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    first_op = next(n for n in gm.graph.nodes if n.op != "placeholder")
    kept = []
    for s, node, kind in zip(view.slots, placeholders, kinds):
        if s.position not in frozen:
            kept.append(kind)
            continue
        name = f"frozen{s.index}"
        gm.register_buffer(name, frozen[s.position].detach())
        with gm.graph.inserting_before(first_op):
            attr = gm.graph.get_attr(name)
        node.replace_all_uses_with(attr)
        gm.graph.erase_node(node)
    gm.recompile()
    return kept


def _read_detached(view):
    """The tensor inputs (by position) that the graph only reads detached
    (`running = running + loss.detach()` beside the next step's forward
    reads the last step's loss).  They are passed detached: one requiring
    grad would tie the compiled program's backward to the graph that made
    it (the last step's, already run backward), and the next backward
    raised "Trying to backward through the graph a second time"."""
    readers = {}
    for node in view.nodes:
        detached = node.detach or _is_detach(node.program)
        for kind, k in node.inputs:
            if kind == "slot":
                readers[k] = readers.get(k, True) and detached
    return tuple(p for p, s in enumerate(view.slots)
                 if s.kind == "tensor" and readers.get(s.index, False))


def _is_detach(program):
    return (len(program.calls) == 1 and program.calls[0].name == "detach"
            and len(program.outputs) == 1)


def _examples(args):
    """Copies of the inputs for a compile on the background thread (the
    user's thread may write the inputs meanwhile), requiring grad as they
    do (a training graph's new shape is a training program too)."""
    return [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
