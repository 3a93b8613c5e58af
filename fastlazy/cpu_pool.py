"""A pool of large CPU buffers for fastlazy's graph runs and for the
backward of a graph it recorded (csrc/cpu_pool.h): a loop's outputs,
gradients and work buffers keep their pages from one step to the next.

torch's CPU allocator is malloc, which maps a large block afresh (or the
top of its heap again, after handing it back to the system) each time one
is freed and allocated again: resnet18's training step at batch 1 spent a
quarter of its time in page faults, 7,000-10,000 a step.  (Eager PyTorch
avoids them with another malloc -- jemalloc, tcmalloc -- or glibc's
tunables `glibc.malloc.mmap_threshold` and `glibc.malloc.trim_threshold`;
the pool gives a fastlazy backward the same without them.)

While a graph runs, and while `torch.autograd.backward` or
`torch.autograd.grad` runs on LazyTensors, allocations of at least 128 KiB
on that thread come from the pool; every other allocation goes to torch's
allocator as before.  A pooled buffer freed (at `zero_grad()`, when the
backward drops it, when a graph's output dies) returns to the pool, which
keeps at most FASTLAZY_CPU_POOL_MB (default 1024; 0 switches the pool off)
of idle buffers; `empty()` gives them back, as does any allocation that
fails for want of memory (it is then tried again).  The pool's allocator
is put in front of torch's at the first graph run, and stays (it passes
everything else through).  It needs fastlazy's C++ extension
(fastlazy.step_executor.available()).
"""
from __future__ import annotations

import contextlib
import os

from fastlazy import _core, step_executor

_MIB = 1 << 20
_module = step_executor.extension()


def _cap_megabytes() -> int:
    return max(0, int(os.environ.get("FASTLAZY_CPU_POOL_MB", "1024")))


def configure() -> None:
    """Set the pool's cap from the environment and have the core enter the
    pool's scope around each graph run (once, at boot)."""
    if _module is not None:
        _module.cpu_pool_set_cap(_cap_megabytes() * _MIB)
        _core.set_cpu_pool_scope(_module.cpu_pool_scope())


class _Scope:
    """The pool's scope on this thread, for a `with` block."""
    __slots__ = ()

    def __enter__(self):
        _module.cpu_pool_enter()

    def __exit__(self, *exc):
        _module.cpu_pool_exit()


_SCOPE, _NO_SCOPE = _Scope(), contextlib.nullcontext()


def scope():
    """A context manager: large CPU allocations on this thread inside it
    come from the pool (nothing where the pool is off)."""
    return _NO_SCOPE if _module is None else _SCOPE


def why_not() -> str | None:
    """Why allocations are not pooled (None where they are, or will be
    from the first graph run)."""
    if _module is None:
        return f"fastlazy's C++ extension is {step_executor.why_not()}"
    if _module.cpu_pool_stats()["cap"] == 0:
        return "switched off (FASTLAZY_CPU_POOL_MB=0, or set_cap(0))"
    if _module.cpu_pool_refused():
        return "another CPU allocator is installed in torch above its default"
    return None


def stats() -> dict:
    """hits and misses (pooled allocations served from an idle buffer, or
    from torch's allocator), returned (buffers freed into the pool),
    given_back (idle buffers handed back to torch's allocator), idle_bytes,
    in_use (pooled buffers alive), cap (bytes); {} while no allocator is
    pooled."""
    if _module is None or not _module.cpu_pool_installed():
        return {}
    return _module.cpu_pool_stats()


def empty() -> None:
    """Give the pool's idle buffers back to torch's allocator (malloc)."""
    if _module is not None:
        _module.cpu_pool_empty()


def set_cap(megabytes: int) -> None:
    """Keep at most `megabytes` MiB of idle buffers from now on (0: the pool
    is off: buffers freed are given back at once, nothing new is pooled)."""
    if _module is not None:
        _module.cpu_pool_set_cap(max(0, int(megabytes)) * _MIB)


def after_fork() -> None:
    """In a forked child: a lock the pool held in another thread is free."""
    if _module is not None:
        _module.cpu_pool_after_fork()
