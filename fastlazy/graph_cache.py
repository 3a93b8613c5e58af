"""The compiled-graph cache: structural key -> Program, bounded LRU, and the
policy of which backend compiles a graph.

The core computes the key (a 128-bit structural hash of the outputs) and
runs a hit itself: one dict lookup and the program's call.  On a miss it
calls `compile_and_run`, which builds a GraphView and has it compiled.

Policy: the active backend compiles every graph, except that

- a torchscript graph that nothing fuses (CPU without LLVM) and that has a
  linear layer recorded on one row goes to the native backend, whose kernel
  for that layer TorchScript cannot call (the graph is shape-generic, so
  its first recording decides for later calls);
- a backend that compiles in the background (inductor's `async_compile`)
  is given the eager backend's program of the same graph to run meanwhile;
- a graph a backend fails to compile or first run goes to the eager
  backend (counted as `compile_failures`).

Backends know nothing of each other; this module is where they meet.
"""
from __future__ import annotations

import collections
import time

from fastlazy import _core, backends, metrics, recompiles
from fastlazy.backends import native
from fastlazy.graph import GraphView
from fastlazy.sites import site_of_call

# key -> Program; the core reads it on every flush (a hit runs in C)
programs: collections.OrderedDict = collections.OrderedDict()
_backend = None
_capacity = 1024


def set_backend(name: str) -> None:
    global _backend
    _backend = backends.get(name)
    _core.set_backend_key(_backend.name, _backend.specializes_shapes)


def backend_name() -> str:
    return _backend.name


def active_backend():
    return _backend


def set_capacity(n: int) -> None:
    global _capacity
    if n < 1:
        raise ValueError("graph cache capacity must be at least 1")
    _capacity = n
    _trim()


def clear() -> None:
    programs.clear()
    recompiles.forget()


def size() -> int:
    return len(programs)


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
    _insert(key, program)
    used = [slot_order[p] for p in program.slots]
    seg._check_versions(used)
    inputs = seg.inputs
    try:
        return program.run([inputs[k] for k in used])
    except Exception as exc:
        if backend.name == "eager":
            raise
        # Some graphs only fail when first run (TorchScript's alias analysis
        # of an aten op it cannot type): run it on the eager backend, which
        # raises eager's own error if the values really cannot be computed.
        program = _fallback_program(view, exc, backend)
        _insert(key, program)
        return program.run([inputs[slot_order[p]] for p in program.slots])


def _choose(view):
    """The backend that compiles `view` (see the module docstring)."""
    if (_backend.name == "torchscript" and not _backend.fuses(view)
            and native.takes_one_row(view)):
        return backends.get("native")
    return _backend


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
    """The value of node `index` of a segment whose run failed, computed on
    its own by the eager backend (it may not depend on what failed)."""
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

