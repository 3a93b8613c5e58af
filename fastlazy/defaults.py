"""torch's global default dtype, which decides recorded results.

A node's dtype is computed at the call from the default dtype then in force
(`int_tensor * 1.5`, `torch.arange(3) / 2`, `exp` of an integer tensor),
but the graph computes it when it runs -- under the default then in force.
So torch.set_default_dtype (and the deprecated set_default_tensor_type)
first computes the pending nodes, under the default they were recorded
with, and forgets the generic path's cached signatures, whose result dtypes
were found under the old default.
"""
from __future__ import annotations

import functools

import torch

from fastlazy import _core, generic


def python_patches():
    """(owner, attr, replacement) for the setters of the default dtype."""
    patches = []
    for name in ("set_default_dtype", "set_default_tensor_type"):
        original = getattr(torch, name)

        @functools.wraps(original)
        def set_default(*args, __original=original, **kwargs):
            _core.mark_step()
            try:
                return __original(*args, **kwargs)
            finally:
                generic.forget_signatures()
        patches.append((torch, name, set_default))
    return patches
