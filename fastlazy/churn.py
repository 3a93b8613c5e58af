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
# how many segments had one]
_counts: dict = {}
_NUMBER = (int,)


def forget():
    with _lock:
        _counts.clear()


def runs_eagerly(key) -> bool:
    """A call of signature `key` (generic.py's), never analysed, is about
    to be: count its new value, and say whether it should run eagerly
    instead.  signature_key writes an int as itself and a float as (float,
    its hex), everything flattened into key[1]."""
    parts = key[1]
    erased = tuple([_NUMBER if type(p) is int else
                    _NUMBER if type(p) is tuple and len(p) == 2 and p[0] is float else p
                    for p in parts])
    if erased == parts:
        return False
    erased = (key[0], erased) + key[2:]
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
        if count[0] != segment:
            count[0] = segment
            count[1] += 1
        return False
