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

from fastlazy import _core, metrics, views
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


def wrap_result(out, keep=(), roots=None):
    """Eager results as LazyTensors (tensors inside tuples/lists too); an
    instance of a tensor subclass keeps its type (x.as_subclass(cls), a
    library's tensor type), which a LazyTensor would lose; and so does a
    tensor of `keep` (the eager `out=` tensors a call wrote and returned).
    `roots`: as_views' record of the roots' values handed over, whose views
    among the results come back as views of those roots (_viewing_root)."""
    if isinstance(out, torch.Tensor):
        if type(out) is not torch.Tensor and type(out) is not torch.nn.Parameter:
            return out
        if any(out is k for k in keep):
            return out
        if roots and type(out) is torch.Tensor:
            viewing = _viewing_root(out, roots)
            if viewing is not None:
                return viewing
        return _core.lazy_or_eager(out)
    if isinstance(out, tuple):
        items = [wrap_result(v, keep, roots) for v in out]
        if hasattr(out, "_fields"):      # a namedtuple
            return type(out)(*items)
        return type(out)(items)          # tuple, torch.return_types.*
    if type(out) is list:
        return [wrap_result(v, keep, roots) for v in out]
    return out


def count(name, reason):
    """Count a call run eagerly: the core's fallbacks counter, and the
    metrics' count of `name` (fallback.<name>) with its reason (explain())."""
    _core.count("fallbacks")
    metrics.count_fallback(name, reason)


def run(func, args, kwargs, views_of_roots=True):
    """func on the materialized arguments, its tensor results lazy -- except
    an eager `out=` tensor it returns, which eager's caller gets back itself
    (`r = torch.add(x, 1, out=o)`: r is o).  A view argument whose root
    holds its value laid out contiguously is handed over as eager's view of
    that value (as_views), and a result that views a root so handed over
    comes back as a view of that root (x.unfold(...) run eagerly: writes
    through it reach x, as in eager).  Not with `views_of_roots` False (a
    call that sets a flag on its argument's own value)."""
    written = kwargs.get("out")
    keep = ((written,) if isinstance(written, torch.Tensor) else
            tuple(written) if type(written) in (tuple, list) else ())
    roots = {}
    if views_of_roots:
        args, kwargs = as_views(args, roots), as_views(kwargs, roots)
    return wrap_result(func(*materialize(args), **materialize(kwargs)), keep, roots)


def as_views(x, roots):
    """x with each LazyTensor view in it (top level, or in a list, tuple or
    dict) replaced by eager's view of its root's value at its place, where
    that is eager's own view: the root holds its value, laid out
    contiguously (places are in that layout), that requires no grad (the
    view would carry as_strided's backward), and the view is of the root's
    dtype, neither detached nor conjugated.  Eager's kernels then see the
    view's strides and offset, and judge it as eager's (`v.view(-1)` of a
    non-contiguous slice raises), where the view's own computed value, a
    tensor of its own once a write has moved it off its root, is laid out
    contiguously.  `roots` collects, for the results, ("storage", address):
    (root, its value) of each value handed over, and ("argument", id):
    the LazyTensor of each view handed over."""
    t = type(x)
    if t is LazyTensor:
        where = x.family
        if type(where) is not views.Member:
            # a root: handed over as its value (materialize), and noted,
            # so that a result viewing that value (x.as_strided(...) run
            # eagerly) comes back as a view of x, placed in x's own
            # elements, which need not start its storage (lazy(t[2:]));
            # as a LazyTensor of its own, a write through it wrote the
            # value's storage itself, the tensor x was made from (a pending
            # x is computed here, as materialize would)
            _note_root(x, x.to_eager(), roots)
            return x
        root = where.root
        if where.flags or root.dtype != x.dtype:
            return x
        if views.held(x):
            # handed over as the view of its root's value it holds; noted
            # as a root's is
            _note_root(root, root.to_eager(), roots)
            return x
        value = root.to_eager()
        if not _note_root(root, value, roots):
            return x
        view = value.as_strided(where.size, where.stride, value.storage_offset() + where.offset)
        roots["argument", id(view)] = x   # (a call that returns its argument returns x itself)
        return view
    if t in (list, tuple):
        return t([as_views(v, roots) for v in x])
    if t is dict:
        return {k: as_views(v, roots) for k, v in x.items()}
    return x


def _note_root(root, value, roots) -> bool:
    """Note `root`'s `value` for _viewing_root where its views can be
    eager's: laid out contiguously (places are in that layout), requiring
    no grad (a view would carry as_strided's backward), no conj or neg
    bit, with storage."""
    if value.requires_grad or not value.is_contiguous() or value.is_conj() \
            or value.is_neg() or value.untyped_storage().data_ptr() == 0:
        return False
    roots["storage", value.untyped_storage().data_ptr()] = (root, value)
    return True


def _viewing_root(out, roots):
    """The LazyTensor for result `out` where it is an argument handed over
    (that argument itself), a root's value (the root) or a view of one (a
    view of that root, holding eager's view, as the core's slices of a value
    hold theirs: views.held); else None."""
    handed = roots.get(("argument", id(out)))
    if handed is not None:
        return handed
    if out.layout is not torch.strided or out.is_nested or not out.numel():
        return None             # (a sparse or nested result has no storage to share)
    try:
        address = out.untyped_storage().data_ptr()
    except (NotImplementedError, RuntimeError):
        return None             # (functorch's wrapper of a result has none either)
    found = roots.get(("storage", address))
    if found is None or found[1].dtype != out.dtype:
        return None
    root, value = found
    if out is value:
        return root
    t = _core.lazy_or_eager(out)
    if type(t) is not LazyTensor:
        # (a view of more dims than a LazyTensor holds: as an eager tensor
        # it would hold the root's value, and a write through it reach the
        # tensor the root was made from, a later write to the root not it)
        raise TypeError(f"fastlazy cannot hold a view of {out.dim()} dims ({out.dtype}) of a "
                        f"LazyTensor (at most {_core.MAX_NDIM}); take its value first "
                        f"(x.to_eager()) to work with it eagerly")
    views.attach(t, root, (tuple(out.shape), out.stride(),
                           out.storage_offset() - value.storage_offset()), 0)
    t.family.held = out
    return t
