"""Calls whose Python numbers take a new value at every flush.

A generic call's signature holds the values of its numbers (generic.py),
so a new value is a new signature: analysed (a fake run, about a
millisecond), recorded as a new program, and the graph holding it is a new
structure, compiled once more.  Floats that reach their op as a Scalar
become program inputs once they vary (lifted_floats.py); any other number
-- an int (`torch.where(m, x, step)`, `x.roll(step)`, `topk(k)`), a float
that C++ reads as a double (`F.pad`'s value, `rms_norm`'s eps) -- costs
all that at each new value.  A value met again costs nothing more; a
stream of new ones (a step counter, a number computed from the last value
read) costs a millisecond or more at every call, where eager's call costs
microseconds.

So the signature with its numbers erased counts the segments (the spans
between flushes) in which it met a new value.  Once NEW_VALUE_SEGMENTS
have, its calls with a value not analysed yet run eagerly (route.py's
fallback, counted with REASON: a flush of the inputs and eager's call,
tens of microseconds), and the graphs around the call keep one structure
each.  Values analysed before are still recorded.  The many values of a
loop unrolled into one graph count once.

A call whose results alias its arguments (`x.unfold(0, size, step)`,
`x.as_strided(...)`, `x.narrow(0, start, n)`) is never sent to eager: run
eagerly, its result would be a copy of the lazy value, not a view that
writes reach, so such a signature is always analysed (aliases()).
"""
from __future__ import annotations

import threading

from fastlazy import _core

NEW_VALUE_SEGMENTS = 16   # segments with a new value of one call, before new values run eagerly
MAX_KEYS = 4096           # number-erased signatures counted before starting over
REASON = ("a Python number argument takes a new value at every call (each value a new "
          "program): new values run eagerly")

_lock = threading.Lock()
# signature with its numbers erased -> [the last segment with a new value,
# how many segments had one (ALIASES: never run eagerly)]
_counts: dict = {}
_NUMBER = (int,)
ALIASES = -1


def forget():
    with _lock:
        _counts.clear()


def _erased(key):
    """key with its numbers erased, or None where it holds none.
    signature_key writes an int as itself and a float as (float, its hex),
    everything flattened into key[1]."""
    parts = key[1]
    erased = tuple([_NUMBER if type(p) is int else
                    _NUMBER if type(p) is tuple and len(p) == 2 and p[0] is float else p
                    for p in parts])
    if erased == parts:
        return None
    return (key[0], erased) + key[2:]


def aliases(key):
    """The analysed call of signature `key` returns views of its arguments
    (or an argument itself): its new values are always analysed."""
    erased = _erased(key)
    if erased is None:
        return
    with _lock:
        count = _counts.get(erased)
        if count is not None:
            count[1] = ALIASES


def runs_eagerly(key) -> bool:
    """A call of signature `key` (generic.py's), never analysed, is about
    to be: count its new value, and say whether it should run eagerly
    instead."""
    erased = _erased(key)
    if erased is None:
        return False
    segment = _core.segments_begun()
    with _lock:
        count = _counts.get(erased)
        if count is None:
            if len(_counts) >= MAX_KEYS:
                _counts.clear()
            _counts[erased] = [segment, 1]
            return False
        if count[1] >= NEW_VALUE_SEGMENTS:
            return True
        if count[0] != segment and count[1] != ALIASES:
            count[0] = segment
            count[1] += 1
        return False
