"""Running a call eagerly on behalf of LazyTensors.

Used for every call neither a C rule nor the generic path records: impure
calls (random, in-place writes of eager tensors, data-dependent shapes),
argument patterns a rule does not cover, and calls eager would reject (so
the exception is eager's own).  Lazy arguments are
materialized, the original torch callable runs, and tensor results come back
as LazyTensors again: laziness is sticky.
"""
from __future__ import annotations

import torch

from fastlazy import _core, metrics, views
from fastlazy._core import LazyTensor


def _materialize(x):
    if type(x) is LazyTensor:
        return x.to_eager()
    if type(x) in (list, tuple):
        return type(x)(_materialize(v) for v in x)
    if type(x) is dict:
        return {k: _materialize(v) for k, v in x.items()}
    return x


def wrap_result(out):
    """Eager results as LazyTensors (tensors inside tuples/lists too)."""
    if isinstance(out, torch.Tensor):
        return _core.lazy_or_eager(out)
    if isinstance(out, tuple):
        items = [wrap_result(v) for v in out]
        if hasattr(out, "_fields"):      # a namedtuple
            return type(out)(*items)
        return type(out)(items)          # tuple, torch.return_types.*
    if type(out) is list:
        return [wrap_result(v) for v in out]
    return out


def run(func, name, args, kwargs, inplace, reason):
    _core.count("fallbacks")
    metrics.count_fallback(name, reason)
    out = kwargs.get("out")
    if type(out) is LazyTensor or (type(out) in (tuple, list)
                                   and any(type(o) is LazyTensor for o in out)):
        return _run_out(func, args, kwargs)
    if inplace and args and type(args[0]) is LazyTensor:
        target = args[0]
        views.before_write(target, (args[1:], kwargs), name.endswith("__setitem__"))
        value = target.to_eager()
        if target.family is None and value._is_view():
            # The value views another tensor (x[0], x.view(-1) ran eagerly):
            # write through, as eager does, so the base sees the change --
            # after computing the pending nodes that may read it.
            _core.mark_step()
            func(value, *_materialize(args[1:]), **_materialize(kwargs))
            return target
        # Otherwise mutate a copy and rebind the handle: a LazyTensor never
        # writes into the tensor it was made from.
        clone = value.clone()
        if func(clone, *_materialize(args[1:]), **_materialize(kwargs)) is NotImplemented:
            return NotImplemented     # x += None: Python goes on to raise TypeError
        _core.rebind_value(target, clone)
        if target.family is not None:
            views.after_mutation(target)
        return target
    if inplace:
        # An eager tensor is written: pending nodes that read it must see
        # the contents they were recorded with.
        _core.mark_step()
        return func(*_materialize(args), **_materialize(kwargs))   # stays eager
    return wrap_result(func(*_materialize(args), **_materialize(kwargs)))


def _run_out(func, args, kwargs):
    """out= naming LazyTensors: write into copies of their values and rebind
    them, so the tensors they were made from are never written."""
    out = kwargs["out"]
    targets = [out] if type(out) is LazyTensor else list(out)
    copies = [t.to_eager().clone() if type(t) is LazyTensor else t for t in targets]
    kw = dict(_materialize(kwargs), out=copies[0] if type(out) is LazyTensor else type(out)(copies))
    func(*_materialize(args), **kw)
    for t, c in zip(targets, copies):
        if type(t) is LazyTensor:
            _core.rebind_value(t, c)
            if t.family is not None:
                views.after_mutation(t)
    return out
