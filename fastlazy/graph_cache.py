"""The compiled-graph cache: structural key -> Program, bounded LRU, and the
policy of which backend compiles a graph.

The core computes the key (a 128-bit structural hash of the outputs) and
runs a hit itself: one dict lookup and the program's call.  On a miss it
calls `compile_and_run`, which builds a GraphView and has it compiled.

Policy: the active backend compiles every graph -- with the tiered engine
("auto", the default: fastlazy.tiering) the torchscript backend compiles it
for the fast tier and the engine takes it from there -- except that

- a torchscript graph that nothing fuses (CPU without LLVM) and that has a
  linear layer recorded on one row goes to the native backend, whose kernel
  for that layer TorchScript cannot call (the graph is shape-generic, so
  its first recording decides for later calls);
- a graph deeper than the backend's `max_depth` (a chain of dependent
  nodes its compiler would recurse through: TorchScript's code emitter on
  the C stack, inductor's passes) goes to the native backend, whose
  executor and lowering are loops (set_flush_threshold(10**9) and a
  30,000-op chain must not crash);
- a backend that compiles in the background (inductor's `async_compile`)
  is given the eager backend's program of the same graph to run meanwhile;
- a graph a backend fails to compile or first run goes to the eager
  backend (counted as `compile_failures`).

Backends know nothing of each other; this module is where they meet.
"""
from __future__ import annotations

import collections
import time

from fastlazy import _core, backends, metrics, recompiles, tiering
from fastlazy.backends import native, torchscript
from fastlazy.graph import GraphView
from fastlazy.sites import site_of_call

# key -> Program; the core reads it on every flush (a hit runs in C)
programs: collections.OrderedDict = collections.OrderedDict()
_backend = None
_capacity = 1024


def set_backend(name: str) -> None:
    global _backend
    if name not in backend_names():
        raise ValueError(f"unknown fastlazy backend {name!r}; choose one of "
                         f"{', '.join(backend_names())}")
    _backend = tiering.ENGINE if name == tiering.ENGINE.name else backends.get(name)
    _core.set_backend_key(_backend.name, _backend.specializes_shapes)


def backend_names() -> tuple:
    """What set_backend accepts."""
    return (tiering.ENGINE.name, *backends.names())


def backend_name() -> str:
    return _backend.name


def active_backend():
    """The backend that compiles a new graph (with the tiered engine: the
    fast tier's)."""
    return backends.get("torchscript") if _backend is tiering.ENGINE else _backend


def set_capacity(n: int) -> None:
    global _capacity
    if n < 1:
        raise ValueError("graph cache capacity must be at least 1")
    _capacity = n
    _trim()


def clear() -> None:
    """Forget every compiled graph, and what the graphs showed of the
    program (tiering: gradients of gradients asked for)."""
    programs.clear()
    recompiles.forget()
    tiering.forget_training_graphs_stay_fast()


def size() -> int:
    return len(programs)


def tiers() -> list[dict]:
    """Per cached graph, oldest first: its tier and what the tiered engine
    measured (fastlazy.tiering.describe)."""
    return [tiering.describe(p) for p in list(programs.values())]


def tier_summary() -> str:
    return tiering.summary(list(programs.values()))


def fusion() -> list[dict]:
    """Per cached graph that TorchScript compiled to fuse (the tiered
    engine's fast tier included), oldest first: what the graph executor
    fused (backends.torchscript.TorchScriptProgram.fusion) and its position
    in the cache.  Empty, at no cost, where nothing can fuse."""
    if not torchscript.any_fusing():
        return []
    found = []
    for position, program in enumerate(list(programs.values())):
        info = torchscript.fusion_of(program)
        if info is not None and info["state"] != "no fuser":
            found.append(dict(info, graph=position))
    return found


def _insert(key, program):
    programs[key] = program
    _trim()


def _trim():
    while len(programs) > _capacity:
        programs.popitem(last=False)
        metrics.count_event("cache_evictions")


def compile_and_run(seg, key, outputs):
    """Compile and run the graph of `outputs` in `seg` (the core calls this
    on a cache miss; hits run in the core)."""
    _core.count("cache_misses")
    view = GraphView(seg, outputs)
    slot_order = view.slot_order()
    recompiles.explain(view, _backend.name, _backend.specializes_shapes,
                       site_of_call())
    backend = _choose(view)
    program = _compile(backend, view)
    if _backend is tiering.ENGINE and backend.name != "eager":
        program = tiering.TieredProgram(view, program)
    _insert(key, program)
    used = [slot_order[p] for p in program.slots]
    seg._check_versions(used)
    inputs = seg.inputs
    try:
        return program.run([inputs[k] for k in used])
    except Exception as exc:
        if backend.name == "eager":
            raise
        failed = exc
    # Some graphs only fail when first run (TorchScript's alias analysis
    # of an aten op it cannot type): run it on the eager backend, which
    # raises eager's own error if the values really cannot be computed
    # (outside the except block: that error is not chained to the backend's).
    program = _fallback_program(view, failed, backend)
    _insert(key, program)
    return program.run([inputs[slot_order[p]] for p in program.slots])


def _choose(view):
    """The backend that compiles `view` (see the module docstring)."""
    backend = active_backend()
    if backend.max_depth is not None and view.deeper_than(backend.max_depth):
        metrics.count_event("deep_graphs")
        return backends.get("native")
    if (backend.name == "torchscript" and not backend.fuses(view)
            and native.takes_one_row(view)):
        return backends.get("native")
    return backend


def _compile(backend, view):
    start = time.perf_counter()
    try:
        if getattr(backend, "async_compile", False):
            program = backend.compile(view, replay=backends.get("eager").compile(view).call)
        else:
            program = backend.compile(view)
    except Exception as exc:     # a backend bug must not lose the user's values
        if backend.name == "eager":
            raise
        program = _fallback_program(view, exc, backend)
    metrics.add_compile_time(time.perf_counter() - start)
    return program


def _fallback_program(view, exc, backend):
    metrics.count_event("compile_failures")
    metrics.count_fallback(f"compile:{backend.name}:{type(exc).__name__}")
    return backends.get("eager").compile(view)


def recover(seg, index, error):
    """The value of node `index` of a segment whose run failed (`error`),
    computed on its own by the eager backend (it may not depend on what
    failed); or, with error None, of a segment whose run is under way on
    this thread (a finalizer read it in the middle of the flush)."""
    view = GraphView(seg, [index])
    program = backends.get("eager").compile(view)
    order = view.slot_order()
    used = [order[p] for p in program.slots]
    try:
        value = program.run([seg.inputs[k] for k in used])[0]
    except Exception as exc:
        # eager's exception, its type kept: reading a failed tensor again
        # raises what the first read raised (IndexError, not RuntimeError)
        exc.add_note("fastlazy: this LazyTensor's value could not be computed")
        raise exc from error
    # an input written since the node was recorded: the error the whole
    # graph's run raises, never a value from the new contents
    seg._check_versions(used)
    return value

