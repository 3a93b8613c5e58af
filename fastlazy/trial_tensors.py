"""The real tensors a trial run computes on (capture.py), kept for the next
trial run that needs the same sizes.

A trial run stands for a new call signature's fake run: the call runs once
for real on tensors of its arguments' sizes (integers and bools all 0, then
all 1; floats uniform in [0, 1)).  Drawing those floats is most of a trial
run's cost where an argument is a weight: torch.rand of GPT-2's 1000x128
embedding takes about 0.5 ms, the rest of its trial run well under that.
Every new sequence length or batch size has trial runs with the same
weights, so the tensors are kept per thread, per sizes, dtype, device and
fill, up to CACHE_BYTES, least recently used first out.

A kept tensor is handed out again only as it was made: the same version
counter (a trial run that wrote into it bumped that), sizes and strides
(an in-place view op changes those).  Within one trial run each argument
gets a tensor of its own: two arguments of the same sizes must not alias.
"""
from __future__ import annotations

import collections
import threading

import torch

CACHE_BYTES = 64 << 20      # per thread

_local = threading.local()


def maker(generator: torch.Generator, fill: int):
    """make(shape, dtype, device, requires_grad) for one trial run's
    arguments: floats drawn from `generator` (the global one is not
    touched), valid where eager checks a value's range (binary_cross_entropy's
    probabilities, multinomial's weights) and nonsingular (zeros would make
    linalg ops see singular matrices); integers and bools `fill` (0 and 1
    are valid indices of any dimension of two or more, 0 and -1 of any
    dimension)."""
    taken: collections.Counter = collections.Counter()

    def make(shape, dtype, device, requires_grad=False):
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        device = torch.device(device)
        drawn = dtype.is_floating_point or dtype.is_complex
        kind = (shape, dtype, device, None if drawn else fill)
        taken[kind] += 1
        if drawn:
            def create():
                try:
                    return torch.rand(shape, generator=generator, dtype=dtype).to(device)
                except (RuntimeError, NotImplementedError):
                    # no rand kernel for this dtype (the float8s): drawn
                    # wider, then converted
                    wide = torch.complex64 if dtype.is_complex else torch.float32
                    return torch.rand(shape, generator=generator, dtype=wide).to(device, dtype)
        else:
            def create():
                return torch.empty(shape, dtype=dtype, device=device).fill_(fill)
        t = _kept(kind + (taken[kind],), create)
        return t.requires_grad_(requires_grad)
    return make


def _kept(key, create):
    cache = getattr(_local, "tensors", None)
    if cache is None:
        cache = _local.tensors = collections.OrderedDict()
        _local.nbytes = 0
    entry = cache.pop(key, None)
    if entry is not None:
        t, version, stride = entry
        if t._version == version and t.shape == key[0] and t.stride() == stride \
                and t.grad is None:
            cache[key] = entry            # (most recently used)
            return t
        _local.nbytes -= t.nbytes
    # (made outside inference mode: an inference tensor has no version
    # counter to check, and trial runs under torch.inference_mode() read
    # theirs)
    with torch.inference_mode(False):
        t = create()
    nbytes = t.nbytes
    if nbytes > CACHE_BYTES:
        return t
    cache[key] = (t, t._version, t.stride())
    _local.nbytes += nbytes
    while _local.nbytes > CACHE_BYTES:
        _, (old, _, _) = cache.popitem(last=False)
        _local.nbytes -= old.nbytes
    return t


def clear() -> None:
    """Drop this thread's kept trial tensors."""
    _local.tensors = collections.OrderedDict()
    _local.nbytes = 0


def kept() -> int:
    """How many trial tensors this thread keeps (for tests)."""
    return len(getattr(_local, "tensors", ()))
