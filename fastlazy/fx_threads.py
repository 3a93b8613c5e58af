"""torch.fx tracing made safe beside a compile thread.

torch.fx's tracer (under make_fx, AOT autograd and inductor's pattern
matcher) patches global state for the length of a trace: `nn.Module.__call__`
and `__getattr__`, and functions in module globals.  Every thread sees the
patches, so a user's module called while the compile thread traces goes
through the tracer's wrapper and fails ("module is not installed as a
submodule").  install() makes those patches apply only to the thread that
made them -- any other thread calls the original -- and lets one trace run
at a time, so that patches and their reverts never interleave.

It reaches into torch.fx's private _Patcher and Tracer.trace; on a torch
where they are not as expected, `install()` returns False and the tiered
engine does not compile in the background.
"""
from __future__ import annotations

import functools
import threading

from fastlazy import compile_worker

_installed = None
_trace_lock = threading.RLock()


def new_lock_after_fork():
    """A fresh lock in a forked child (fastlazy's boot registers this): one
    the compile thread held at the fork would stay held for good there."""
    global _trace_lock
    _trace_lock = threading.RLock()


def install() -> bool:
    """Idempotent; True if tracing is now thread-safe."""
    global _installed
    if _installed is not None:
        return _installed
    try:
        from torch.fx import _symbolic_trace as symbolic_trace
        patcher = symbolic_trace._Patcher
        patch, patch_method = patcher.patch, patcher.patch_method
        trace = symbolic_trace.Tracer.trace
    except (ImportError, AttributeError):
        _installed = False
        return False

    def patch_here(self, frame_dict, name, new_fn, deduplicate=True):
        current = frame_dict.get(name)
        if current is None:               # a builtin: torch.fx deletes the patch
            return patch(self, frame_dict, name, new_fn, deduplicate)
        return patch(self, frame_dict, name, _in_this_thread(new_fn, current), deduplicate)

    def patch_method_here(self, cls, name, new_fn, deduplicate=True):
        return patch_method(self, cls, name, _in_this_thread(new_fn, getattr(cls, name)),
                            deduplicate)

    @functools.wraps(trace)
    def one_trace_at_a_time(self, *args, **kwargs):
        if not _trace_lock.acquire(blocking=False):
            if compile_worker.on_compile_thread():
                _trace_lock.acquire()
            else:
                # the compile thread traces: it runs unthrottled until it
                # lets go, so this thread's wait is not stretched by its sleeps
                with compile_worker.unthrottled():
                    _trace_lock.acquire()
        try:
            return trace(self, *args, **kwargs)
        finally:
            _trace_lock.release()

    patcher.patch, patcher.patch_method = patch_here, patch_method_here
    symbolic_trace.Tracer.trace = one_trace_at_a_time
    _installed = True
    return True


def _in_this_thread(patched, original):
    """`patched` in the calling thread, `original` in every other."""
    owner = threading.get_ident()

    @functools.wraps(patched)
    def dispatch(*args, **kwargs):
        if threading.get_ident() == owner:
            return patched(*args, **kwargs)
        return original(*args, **kwargs)
    return dispatch
