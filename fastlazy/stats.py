"""Counters kept in Python: per-op fallbacks, compile times, cache events.
The hot counters (nodes recorded, flushes...) are C integers in the core."""
from __future__ import annotations

import collections
import threading

fallbacks_by_op: collections.Counter = collections.Counter()
fallback_reasons: collections.Counter = collections.Counter()   # (op, reason) -> n
compile_seconds: list[float] = []
recompile_reasons: collections.Counter = collections.Counter()
_lock = threading.Lock()


def count_fallback(name: str, reason: str = "") -> None:
    with _lock:
        fallbacks_by_op[name] += 1
        if reason:
            fallback_reasons[name, reason] += 1


def add_compile_time(seconds: float) -> None:
    with _lock:
        compile_seconds.append(seconds)


def count_recompile(reason: str) -> None:
    with _lock:
        recompile_reasons[reason] += 1


def reset() -> None:
    with _lock:
        fallbacks_by_op.clear()
        fallback_reasons.clear()
        compile_seconds.clear()
        recompile_reasons.clear()
