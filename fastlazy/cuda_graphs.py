"""CUDA-graph replay of a hot inference graph's program.

On a GPU a small graph is bound by its kernel launches: BERT at batch 1
launches some 400 kernels a call, each costing the CPU a few microseconds
however little the GPU does.  A CUDA graph records those launches once and
replays them with one.  For an inference graph whose tensor inputs are all
on one CUDA device, the tiered engine (fastlazy.tiering) puts the fast
tier's GraphedCall on trial against it once the graph is hot, and a
GraphedCall of each compiled candidate on probation beside it, keeping
whichever runs fastest.

A GraphedCall watches its first call, captures the program on its second
(after WARMUP_RUNS runs on the capture stream), and replays it from then
on:

- an input that was the same tensor on both calls (a parameter, a buffer:
  what a model reads on every call) is read where it lies, so its address
  must recur; every other tensor input is copied into a buffer of the
  graph's before each replay.  A call whose inputs differ from the
  capture's in dtype, device, sizes or strides, in such an address, or in
  the value of a non-tensor input (the capture baked it into the graph)
  runs the program itself (`misses`), as does a call made while another
  thread replays or captures the graph.
- the outputs are the graph's own buffers, rewritten by the next replay:
  each call returns clones of them.
- the program must not write its inputs (checked by their version counters
  on the first call, before any extra run, and again over the warm-up
  runs: a write would land in the graph's copy of the input, not the
  caller's tensor), and its outputs must not share memory
  with its inputs or with each other (a clone would undo the aliasing).
- the first replay is checked against the program's own run on the same
  inputs (`differ`); a capture that fails, for one of those reasons or
  because the program cannot run while the stream captures (a copy to the
  host, a synchronization), raises NotCaptured, and the tiered engine
  leaves the candidate out.

The graph's memory pool is its own: the capture's intermediates are kept
for the graph's replays, and freed with it (the tiered engine drops the
twins that lose their trial or probation).  Random draws never reach a graph
(fastlazy.random_ops draws them eagerly), so a replay draws nothing.
"""
from __future__ import annotations

import threading
import weakref

import torch

from fastlazy import metrics, step_executor

# runs of the program on the capture stream before its capture: the first
# run on a new stream creates what cuBLAS and cuDNN keep per stream
# (handles, workspaces), which a capture must not
WARMUP_RUNS = 2


class NotCaptured(RuntimeError):
    """The program could not be captured into a CUDA graph (the message
    says why); the call that tried it still gets the program's values from
    the tiered engine."""


def _layouts_type():
    """The core's InputLayouts (fastlazy._executor), or None where the C++
    extension was not built for this torch."""
    module = step_executor.extension()
    return getattr(module, "InputLayouts", None) if module is not None else None


def unsuitable(inputs, grad: bool) -> str | None:
    """Why a graph with these inputs gets no CUDA-graph candidate, or None."""
    if grad:
        return "a training graph"
    devices = {t.device for t in inputs if isinstance(t, torch.Tensor)}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        return "its tensor inputs are not all on one CUDA device"
    if _layouts_type() is None:
        return "fastlazy._executor was not built for this torch"
    return None


class GraphedCall:
    """`call` (a program's call: inputs -> a sequence of tensors), replayed
    from a CUDA graph from its second call on.  `differ(got, want)` says
    why two runs' results are not the same values, or None."""

    def __init__(self, call, differ):
        self._call = call
        self._differ = differ
        self._seen = None          # the first call's tensor inputs, by position, held weakly
        self._refused = None       # why the first call showed it cannot be captured
        self._graph = None
        self._layouts = None
        self._copied = ()          # (position, the graph's buffer for it)
        self._outputs = ()
        self._lock = threading.Lock()
        self.replays = 0
        self.misses = 0

    def __call__(self, *inputs):
        if not self._lock.acquire(False):
            # another thread is replaying or capturing the graph (its
            # buffers are in use): this call runs the program itself
            return self._miss(inputs)
        try:
            if self._graph is None:
                if self._seen is None:
                    return self._observe(inputs)
                if self._refused is not None:
                    raise NotCaptured(self._refused)
                try:
                    self._capture(inputs)
                except NotCaptured as exc:
                    self._refused = str(exc)
                    raise
            if not self._layouts.matches(inputs):
                return self._miss(inputs)
            return self._replay(inputs)
        finally:
            self._lock.release()

    def _miss(self, inputs):
        self.misses += 1
        metrics.count_event("cuda_graph_misses")
        return self._call(*inputs)

    def _replay(self, inputs):
        for k, buffer in self._copied:
            buffer.copy_(inputs[k])
        self._graph.replay()
        self.replays += 1
        return tuple(o.clone() for o in self._outputs)

    def _observe(self, inputs):
        """The first call: which tensors it read, and whether the program
        wrote any of them (the capture runs it again on the same tensors:
        it must not write them)."""
        tensors = {k: t for k, t in enumerate(inputs) if isinstance(t, torch.Tensor)}
        versions = [t._version for t in tensors.values()]
        out = self._call(*inputs)
        self._seen = {k: weakref.ref(t) for k, t in tensors.items()}
        if [t._version for t in tensors.values()] != versions:
            self._refused = "the program writes its inputs"
        return out

    def _capture(self, inputs):
        seen, self._seen = self._seen, {}
        in_place = {k for k, ref in seen.items() if ref() is inputs[k]}
        try:
            layouts = _layouts_type()(inputs, in_place)
        except ValueError as exc:
            raise NotCaptured(str(exc)) from None
        device = next(t.device for t in inputs if isinstance(t, torch.Tensor))
        static = list(inputs)
        copied = []
        for k, t in enumerate(inputs):
            if isinstance(t, torch.Tensor) and k not in in_place:
                buffer = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
                buffer.copy_(t)
                static[k] = buffer
                copied.append((k, buffer))
        tensors = [t for t in static if isinstance(t, torch.Tensor)]
        versions = [t._version for t in tensors]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(device), torch.no_grad():
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(WARMUP_RUNS):
                    want = self._call(*static)
            torch.cuda.current_stream().wait_stream(stream)
            if [t._version for t in tensors] != versions:
                raise NotCaptured("the program writes its inputs")
            try:
                # (thread_local: the compile thread's CUDA work meanwhile
                # neither breaks the capture nor is refused)
                with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                    outputs = tuple(self._call(*static))
            except Exception as exc:     # noqa: BLE001 - the tiered engine leaves it out
                _end_capture_mode(device)
                raise NotCaptured(f"{type(exc).__name__}: {exc}"[:300]) from None
        _check_outputs(outputs, tensors)
        self._graph, self._layouts, self._outputs = graph, layouts, outputs
        self._copied = tuple(copied)
        metrics.count_event("cuda_graph_captures")
        # the static inputs, replayed: the program's own run's values
        graph.replay()
        why = self._differ(outputs, want)
        if why is not None:
            self._graph = None
            raise NotCaptured(f"its replay's results differ from the program's ({why})")


def _end_capture_mode(device):
    """After a capture that failed: torch takes the device's default random
    generator out of its capture mode only when a capture ends well, and
    every random draw on the device raises ("Offset increment outside graph
    capture encountered unexpectedly") until one does.  A capture of one
    small kernel (on torch's own capture stream) ends well."""
    with torch.cuda.device(device):
        scratch = torch.zeros(1, device=device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            scratch.add_(1)


def _check_outputs(outputs, inputs):
    """NotCaptured where an output is no CUDA tensor, or shares memory with
    an input or another output."""
    taken = {t.untyped_storage().data_ptr() for t in inputs}
    for k, o in enumerate(outputs):
        if not isinstance(o, torch.Tensor) or not o.is_cuda:
            raise NotCaptured(f"output {k} is not a CUDA tensor")
        address = o.untyped_storage().data_ptr()
        if address in taken:
            raise NotCaptured(f"output {k} shares memory with an input or another output")
        taken.add(address)
