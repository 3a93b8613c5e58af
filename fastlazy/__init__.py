"""fastlazy: lazy tensors for PyTorch that cost almost nothing to record.

    import torch, fastlazy
    fastlazy.enable()
    a = torch.rand(100, 100).to("lazy")
    r = (a + 1) * a            # recorded, ~100 ns per op
    print(r)                   # one compiled graph runs, result kept

The torch._lazy functions have the same names here: mark_step,
wait_device_ops, sync_multi, to_cpu, add_step_closure, metrics.counter_names,
metrics.counter_value, metrics.metrics_report, debug.dump_ir,
debug.render_ir_graph.
"""
from __future__ import annotations

import contextlib as _contextlib

from fastlazy import boot as _boot
from fastlazy import _core
from fastlazy import closures as _closures
from fastlazy import debug, metrics, optable
from fastlazy import graph_cache as _graph_cache
from fastlazy import patching as _patching
from fastlazy._core import LazyTensor, lazy

_boot.boot()

__all__ = ["LazyTensor", "lazy", "enable", "disable", "enabled", "mark_step",
           "wait_device_ops", "sync_multi", "to_cpu", "add_step_closure",
           "metrics", "debug", "optable", "explain", "set_flush_threshold", "set_backend",
           "backend"]


def enable(backend: str | None = None) -> "_contextlib.AbstractContextManager":
    """Patch torch's entry points so that calls with a LazyTensor record.

    Idempotent.  `backend` ("torchscript", "inductor", "native" or "eager")
    picks the backend (default: $FASTLAZY_BACKEND or "torchscript").  Also a context
    manager: ``with fastlazy.enable(): ...`` disables again on exit if it
    was not enabled before.
    """
    if backend is not None:
        _graph_cache.set_backend(backend)
    was_enabled = _patching.enabled()
    _patching.enable()
    return _Restore(was_enabled)


class _Restore(_contextlib.AbstractContextManager):
    def __init__(self, was_enabled):
        self._was_enabled = was_enabled

    def __exit__(self, *exc):
        if not self._was_enabled:
            disable()
        return False


def disable() -> None:
    """Put every patched torch attribute back (the identical objects)."""
    _patching.disable()


def enabled() -> bool:
    """True while torch's entry points are patched."""
    return _patching.enabled()


def mark_step(device: str = "", wait: bool = False) -> None:
    """Compute every live LazyTensor this thread recorded now (one graph),
    then run the step closures.  As torch._lazy.mark_step; `device` is
    accepted for compatibility and ignored (fastlazy has one buffer per
    thread for all devices);
    `wait=True` also waits for queued CUDA work and asynchronous closures."""
    _core.mark_step()
    _closures.run_step_closures()
    if wait:
        wait_device_ops()


def wait_device_ops(devices=None) -> None:
    """Wait for outstanding device work (CUDA) and asynchronous step closures."""
    import torch
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    _closures.wait_async_closures()


def sync_multi(tensors, devices=None) -> None:
    """Compute the given LazyTensors (and every other live one: fastlazy
    flushes whole segments, so a later read of those is free)."""
    for t in tensors:
        if type(t) is LazyTensor:
            t.to_eager()


def to_cpu(tensors, devices=None):
    """A pytree with every LazyTensor replaced by its value on the CPU."""
    from torch.utils._pytree import tree_flatten, tree_unflatten
    flat, spec = tree_flatten(tensors)
    sync_multi(flat)
    return tree_unflatten([t.to_eager().cpu() if type(t) is LazyTensor else t for t in flat],
                          spec)


def add_step_closure(closure, args=(), run_async: bool = False) -> None:
    """Run `closure(*args)` after the next mark_step(), when every live
    tensor is computed (see fastlazy.closures)."""
    _closures.add_step_closure(closure, args, run_async)


def explain() -> str:
    """Which calls ran eagerly instead of being recorded, and why."""
    return metrics.explain()


def set_flush_threshold(nodes: int) -> None:
    """Flush automatically once this many nodes are pending (default 10000)."""
    _core.set_flush_threshold(nodes)


def set_backend(name: str) -> None:
    """Choose the backend for graphs compiled from now on."""
    _graph_cache.set_backend(name)


def backend() -> str:
    """The active backend's name."""
    return _graph_cache.backend_name()

