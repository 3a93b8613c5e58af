"""Running a call eagerly on behalf of LazyTensors.

Used for every call neither a C rule nor the generic path records: impure
calls (random, data-dependent shapes), argument patterns a rule does not
cover, and calls eager would reject (so the exception is eager's own).  Lazy
arguments are materialized, the original torch callable runs, and tensor
results come back as LazyTensors again: laziness is sticky.  Every such call
is counted (count()), in-place ones too, which mutation.py runs.
"""
from __future__ import annotations

import functools

import torch

from fastlazy import _core, metrics
from fastlazy._core import LazyTensor


def materialize(x):
    """x with every LazyTensor replaced by its value (inside lists, tuples
    and dicts too, and in the arguments a functools.partial holds:
    HuggingFace's gradient checkpointing hands torch's checkpoint a
    partial of the layer holding the attention mask)."""
    if type(x) is LazyTensor:
        return x.to_eager()
    if type(x) in (list, tuple):
        return type(x)(materialize(v) for v in x)
    if type(x) is dict:
        return {k: materialize(v) for k, v in x.items()}
    if type(x) is functools.partial and (has_lazy(x.args) or has_lazy(x.keywords.values())):
        return functools.partial(x.func, *materialize(x.args), **materialize(x.keywords))
    return x


# Is any of an iterable's values a LazyTensor, or holds one where
# materialize looks?  (C: eager code's calls of wrapped functions ask it.)
has_lazy = _core.has_lazy


def wrap_result(out, keep=()):
    """Eager results as LazyTensors (tensors inside tuples/lists too); an
    instance of a tensor subclass keeps its type (x.as_subclass(cls), a
    library's tensor type), which a LazyTensor would lose; and so does a
    tensor of `keep` (the eager `out=` tensors a call wrote and returned)."""
    if isinstance(out, torch.Tensor):
        if type(out) is not torch.Tensor and type(out) is not torch.nn.Parameter:
            return out
        if any(out is k for k in keep):
            return out
        return _core.lazy_or_eager(out)
    if isinstance(out, tuple):
        items = [wrap_result(v, keep) for v in out]
        if hasattr(out, "_fields"):      # a namedtuple
            return type(out)(*items)
        return type(out)(items)          # tuple, torch.return_types.*
    if type(out) is list:
        return [wrap_result(v, keep) for v in out]
    return out


def count(name, reason):
    """Count a call run eagerly: the core's fallbacks counter, and the
    metrics' count of `name` (fallback.<name>) with its reason (explain())."""
    _core.count("fallbacks")
    metrics.count_fallback(name, reason)


def run(func, args, kwargs):
    """func on the materialized arguments, its tensor results lazy -- except
    an eager `out=` tensor it returns, which eager's caller gets back itself
    (`r = torch.add(x, 1, out=o)`: r is o)."""
    written = kwargs.get("out")
    keep = ((written,) if isinstance(written, torch.Tensor) else
            tuple(written) if type(written) in (tuple, list) else ())
    return wrap_result(func(*materialize(args), **materialize(kwargs)), keep)
