"""fastlazy: lazy tensors for PyTorch that cost almost nothing to record.

    import torch, fastlazy
    fastlazy.enable()
    a = torch.rand(100, 100).to("lazy")
    r = (a + 1) * a            # recorded, ~tens of ns per op
    print(r)                   # one compiled graph runs, result kept
"""
from __future__ import annotations

import contextlib as _contextlib

from fastlazy import _core
from fastlazy import fallback as _fallback
from fastlazy import graph_cache as _graph_cache

_core.init(_fallback, _graph_cache)

from fastlazy import metrics, optable, patching as _patching  # noqa: E402
from fastlazy._core import LazyTensor, lazy  # noqa: E402

__all__ = ["LazyTensor", "lazy", "enable", "disable", "enabled", "mark_step",
           "metrics", "set_flush_threshold", "set_backend", "backend"]


def enable(backend: str | None = None) -> "_contextlib.AbstractContextManager":
    """Patch torch's entry points so that calls with a LazyTensor record.

    Idempotent.  `backend` ("torchscript" or "eager") picks the backend
    (default: $FASTLAZY_BACKEND or "torchscript").  Also usable as a context
    manager: ``with fastlazy.enable(): ...`` disables again on exit.
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
    return _patching.enabled()


def mark_step() -> None:
    """Compute every live LazyTensor now (one graph)."""
    _core.mark_step()


def set_flush_threshold(nodes: int) -> None:
    """Flush automatically once this many nodes are pending (default 10000)."""
    _core.set_flush_threshold(nodes)


def set_backend(name: str) -> None:
    """Choose the backend for graphs compiled from now on."""
    _graph_cache.set_backend(name)


def backend() -> str:
    return _graph_cache.backend_name()
