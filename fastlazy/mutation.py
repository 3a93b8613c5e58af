"""In-place writes to LazyTensors, and their write-back through views.

A LazyTensor never writes into the storage of another tensor: an in-place
call on one rebinds it to a new value instead.  That value is recorded
where the call is pure -- its out-of-place version, captured through
torch.func.functionalize (record_inplace) -- or else computed eagerly on a
copy (run_inplace, and run_out for out= naming LazyTensors).

Writes must still show through views, as in eager (views.py keeps where each
view sits in its root's storage).  That is functionalization, done by
after_mutation:

- after an in-place op on a view, the root is rebound to
  as_strided_scatter(root, view) and every other live view to
  as_strided(root) -- both recorded lazily, so they fuse like the rest;
- after an in-place op on a root, every live view is rebound likewise.
"""
from __future__ import annotations

import contextlib

import torch

from fastlazy import _core, generic, leaves, views
from fastlazy._core import LazyTensor
from fastlazy.capture import Unsafe
from fastlazy.fallback import materialize
from fastlazy.views import Member


def record_inplace(func, args, kwargs, name, ruled=False, flag=None, prepared=None):
    """An in-place call on a LazyTensor, functionalized: its out-of-place
    version is recorded and the LazyTensor rebound to the result (then the
    write is carried to its views, or to its base).  Raises Unsafe for a
    call it does not take.

    prepared: the in-place call's (signature key, tensors, flat key), which
    the core built for a write to a pending result no view shares (csrc
    generic_record.pxi record_inplace): the functional form's signature is
    kept under that key, and published to the core under both keys, which
    records the later calls itself.

    flag: the position of the `inplace=True` argument of a call that has
    one (torch.nn.functional's activations): its out-of-place version is the
    same call with inplace=False, which computes the values the in-place
    one writes (some of their in-place kernels cannot be functionalized)."""
    target = args[0] if args else None
    if type(target) is not LazyTensor:
        raise Unsafe("writes an eager tensor (eager semantics)")
    if name == "Tensor.set_" and len(args) == 2 and not kwargs and isinstance(args[1], torch.Tensor):
        return _set(target, args[1])
    if name == "Tensor.detach_":
        return _detach(target)
    _refuse_resizing_a_view(name, target, args)
    if _copies_onto_itself(name, target, args):
        views.check_leaf(target)
        return target
    method = name.rpartition(".")[2]
    # a reshaping call changes a view's place, not the values: only a call
    # that writes values may be replayed as a write (backends.base.as_written),
    # and only one may meet overlapping elements (an expanded view may be
    # unsqueeze_()d as in eager)
    reshaping = method in _RESHAPING
    if method == "as_strided_":
        # a result eager lays out otherwise is placed in its storage in
        # eager's order first (a no-op for any other tensor)
        _core.place_as_eager(target)
        if type(target.family) is Member:
            # a new place in the root's storage, whose elements it then
            # holds (_reshape_view): no value of the view's own is read
            views.check_leaf(target)
            _reshape_view(target, func, args[1:], kwargs)
            return target
    if reshaping:
        views.check_leaf(target)
    else:
        if views.before_write(target, (args[1:], kwargs), name.endswith("__setitem__")):
            raise Unsafe("writes through a view whose elements overlap")
        views.check_no_overlap(target, method, args[1:], kwargs)
    if target.family is None and target.is_materialized and target.to_eager()._is_view():
        raise Unsafe("writes through a view an eager fallback made")
    # a leaf that requires grad written under no_grad: recorded, its value
    # made the leaf's successor when it runs (_core.pend_leaf); one with
    # views runs eagerly, its views refreshed after (run_inplace)
    leaf = _written_leaf(target)
    if leaf is not None and (reshaping or target.family is not None):
        raise Unsafe("writes a leaf under no_grad")
    if reshaping and (_has_views(target) or method in _RELAYING and target.family is None):
        _leave_storage_to_views(target)
    if flag is None:
        value = generic.record(_functional(func), args, kwargs, name, track_views=False,
                               ruled=ruled, written=not reshaping,
                               prepared=None if reshaping else prepared)
    else:
        if flag == "inplace":
            kwargs = dict(kwargs, inplace=False)
        else:
            args = args[:flag] + (False,) + args[flag + 1:]
        value = generic.record(func, args, kwargs, name, track_views=False, ruled=ruled,
                               written=not reshaping)
    _core.adopt(target, value)
    if leaf is not None:
        _core.pend_leaf(target, leaf)
    if type(target.family) is Member and reshaping:
        # x[:].squeeze_(0): the values stay, the view's place changes
        _reshape_view(target, func, args[1:], kwargs)
    elif target.family is not None:
        after_mutation(target)
    return None if name.endswith("__setitem__") else target


def _detach(target):
    """target.detach_(): the handle becomes its detached value (no write:
    a leaf that requires grad may call it).  A view refuses, as eager's."""
    if type(target.family) is Member:
        raise RuntimeError("Can't detach views in-place. Use detach() instead.")
    if _core.leaf_of(target) is not None:
        target.to_eager()       # the leaf's pending update: detached as that leaf
    _core.adopt(target, generic.record(torch.Tensor.detach, (target,), {}, "Tensor.detach_",
                                       track_views=False))
    return target


def _set(target, source):
    """target.set_(source): target shares source's memory from now on, as
    in eager.  A LazyTensor source: target becomes a view of it (writes
    through either show in the other).  An eager source: target holds a
    view of it, so reads see its writes and target's writes reach it
    (in-place ops through an eager view run eagerly)."""
    if source is target:
        return target           # its own storage, sizes and strides: eager's no-op
    if source.dtype != target.dtype:
        # eager's refusal, raised by eager's own check
        torch.empty(0, dtype=target.dtype).set_(torch.empty(0, dtype=source.dtype))
    if _has_views(target):
        _leave_storage_to_views(target)
    old = target.family
    if type(old) is Member:
        _leave(old.family, target)
    target.family = None
    if type(source) is not LazyTensor:
        _core.rebind_value(target, source.view_as(source))
        return target
    alias = generic.record(torch.Tensor.view_as, (source, source), {}, "Tensor.set_")
    _core.adopt(target, alias)
    if type(alias.family) is Member:
        _leave(alias.family.family, alias)
    alias.family = None
    views.attach(target, source, views.place(source)[1:], 0)
    return target


def _leave(family, view):
    family.discard(view)


def _has_views(target) -> bool:
    return type(target.family) is views.Family and bool(target.family.members)


def _leave_storage_to_views(root):
    """`root`, a base (with live views, or none), is about to take another
    place in its storage (t_, transpose_, as_strided_...) or to leave it
    (set_): its views keep the storage, as eager's do.  A copy of its
    values becomes their root -- the storage -- and `root` a view of that
    copy, at the place it holds now, so that writes through either still
    show in the other."""
    family = root.family
    storage = generic.record(torch.Tensor.clone, (root,), {}, "view storage",
                             track_views=False)
    if family is not None:
        for view in family.members:
            view.family.root = storage
    storage.family = family
    root.family = None
    views.attach(root, storage, (tuple(root.shape), views.contiguous_strides(root.shape), 0), 0)


def lay_out_as_eager(root, strides):
    """Before the first view of `root`, a result eager lays out in
    `strides` -- not contiguously, but its dims in some order with no gap
    or overlap (an elementwise op of a transposed tensor, a convolution of
    a channels-last input; pending, or computed already and so laid out):
    make it a view of its storage, the permutation
    of it that eager lays out contiguously, now a root of its own.  Views
    are placed in their root's contiguous layout, so its views are then
    placed, and judged by view() and reshape(), in eager's storage order:
    a view of `(x.t() * 2).t()` is contiguous, as eager's is.  Anything
    else is left as it is (its views placed in its contiguous layout).
    True where `root` became such a view."""
    shape = tuple(root.shape)
    # dims from the outermost in eager's memory; a dim of size 1 has no
    # place in that order (any stride), so it goes where it stands
    order = sorted(range(len(shape)), key=lambda d: (-strides[d] if shape[d] > 1 else 0, d))
    order = [d for d in order if shape[d] > 1]
    ones = [d for d in range(len(shape)) if shape[d] <= 1]
    for d in ones:
        order.insert(d, d)
    placed = views.contiguous_strides(tuple(shape[d] for d in order))
    stride = [0] * len(shape)
    for k, d in enumerate(order):
        stride[d] = placed[k]
    if any(stride[d] != strides[d] for d in range(len(shape)) if shape[d] > 1):
        return False                # gaps or overlaps: not a permutation of its storage
    for d in ones:
        stride[d] = strides[d]      # (never stepped: eager's, which its views keep)
    storage = generic.record(_in_storage_order, (root, order), {}, "eager's storage order",
                             track_views=False)
    back = [order.index(d) for d in range(len(shape))]
    alias = generic.record(torch.permute, (storage, back), {}, "eager's storage order",
                           track_views=False)
    if type(storage) is not LazyTensor or type(alias) is not LazyTensor:
        return False
    _core.adopt(root, alias)
    root.family = None
    views.attach(root, storage, (shape, tuple(stride), 0), 0)
    return True


def _in_storage_order(t, order):
    """t's dims in `order`, contiguous: a value laid out as its places say,
    whatever layout the program gave t (a backend may lay a result out
    other than eager does)."""
    return t.permute(order).contiguous()


# In-place ops that change a view's shape and strides, never its values;
# those of them that can leave a contiguous tensor non-contiguous (a
# LazyTensor that is no view reports a contiguous layout: one written so
# becomes a view of its own storage, whose layout it then reports)
_RESHAPING = frozenset({"squeeze_", "unsqueeze_", "transpose_", "t_", "swapdims_",
                        "swapaxes_", "as_strided_"})
_RELAYING = frozenset({"transpose_", "t_", "swapdims_", "swapaxes_", "as_strided_"})


def _reshape_view(target, func, args, kwargs):
    """The view's new place in its root's storage: the op run on a meta
    tensor at the old place."""
    where = target.family
    base = _storage_as(torch.empty(where.root.shape, dtype=where.root.dtype, device="meta"),
                       target.dtype)
    view = base.as_strided(where.size, where.stride, where.offset)
    func(view, *materialize(args), **materialize(kwargs))
    where.size, where.stride = tuple(view.shape), tuple(view.stride())
    where.offset = view.storage_offset()
    if func.__name__ == "as_strided_":
        # its values are the storage's at the new place, which the
        # functional form, run on the view's own value, did not read
        _core.adopt(target, generic.record(
            _view_of, (where.root, where.size, where.stride, where.offset, where.detached,
                       target.dtype, where.conj), {}, "view refresh", track_views=False,
            churns=False))


_functionals: dict = {}


def _written_leaf(target):
    """The leaf that requires grad a write to `target` with grad mode off
    continues (an optimizer's update, `with torch.no_grad(): p.add_(1)`),
    or None: eager writes the leaf, which stays a leaf that requires grad,
    so the written value is made its successor (recorded: record_inplace,
    _core.pend_leaf; or run eagerly on a copy: run_inplace).  Not a view:
    a leaf with views (the forward's `w.t()`) is one, its views refreshed
    after the write, as after any write to their root."""
    return None if type(target.family) is Member else _core.leaf_written(target)


def _functional(func):
    """func(self, ...) that writes self, as a function returning the written
    copy; traced through torch.func.functionalize, so the captured program
    has no in-place op left."""
    wrapper = _functionals.get(func)
    if wrapper is None:
        def wrapper(self, *args, **kwargs):
            out = self.clone()
            returned = func(out, *args, **kwargs)
            if returned is NotImplemented:
                raise TypeError("NotImplemented")
            return out
        wrapper.functionalize = True
        wrapper.__wrapped__ = func          # what capture checks before tracing
        wrapper.__name__ = getattr(func, "__name__", "inplace")
        _functionals[func] = wrapper
    return wrapper


_RESIZES = frozenset({"Tensor.resize_", "Tensor.resize_as_"})


def _copies_onto_itself(name, target, args):
    """target.copy_(src) where src is the same elements as target (two
    views of one place, or target itself): eager's copy_ returns at once,
    even where those elements overlap (two equal expand()s)."""
    if name != "Tensor.copy_" or len(args) < 2 or type(args[1]) is not LazyTensor:
        return False
    src = args[1]
    if src is target:
        return True
    if src.dtype != target.dtype:
        return False
    a, b = target.family, src.family
    if type(a) is not Member or type(b) is not Member:
        return False
    return (a.root is b.root and a.flags == b.flags and a.offset == b.offset
            and a.size == b.size and a.stride == b.stride)


def _refuse_resizing_a_view(name, target, args):
    """Raise, before anything is written, for resize_ (or resize_as_) of a
    view to another shape."""
    if name in _RESIZES and type(target.family) is Member \
            and _resized_to(name, args) != tuple(target.family.size):
        raise RuntimeError(
            f"fastlazy: {name}() of a view of a LazyTensor: eager resizes the view inside "
            f"its base's memory, which fastlazy does not follow.  Resize a copy "
            f"(v.clone().{name.rpartition('.')[2]}(...)) or the base itself.")


def _resized_to(name, args):
    """The shape a resize_ or resize_as_ call asks for (None where it is
    not read here: eager's call judges it)."""
    if name == "Tensor.resize_as_":
        return tuple(args[1].shape) if len(args) > 1 and isinstance(args[1], torch.Tensor) else None
    sizes = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:]
    return tuple(sizes) if all(type(n) is int for n in sizes) else None


def run_inplace(func, name, args, kwargs):
    """An in-place call run eagerly, on materialized arguments."""
    if args and type(args[0]) is LazyTensor:
        target = args[0]
        _refuse_resizing_a_view(name, target, args)
        if _copies_onto_itself(name, target, args):
            views.check_leaf(target)
            return target
        if views.before_write(target, (args[1:], kwargs), name.endswith("__setitem__")):
            return write_overlapping(func, name, args, kwargs)
        views.check_no_overlap(target, name.rpartition(".")[2], args[1:], kwargs)
        value = target.to_eager()
        if target.family is None and value._is_view():
            # The value views another tensor (x[0], x.view(-1) ran eagerly):
            # write through, as eager does, so the base sees the change --
            # after computing the pending nodes that may read it.
            _core.mark_step()
            func(value, *materialize(args[1:]), **materialize(kwargs))
            # (an in-place view op, x.t_() or x.squeeze_(), changed the
            # value's sizes: the handle reads them again)
            _core.rebind_value(target, value)
            return target
        # Otherwise mutate a copy and rebind the handle: a LazyTensor never
        # writes into the tensor it was made from.
        clone = value.clone()
        if func(clone, *materialize(args[1:]), **materialize(kwargs)) is NotImplemented:
            return NotImplemented     # x += None: Python goes on to raise TypeError
        leaf = _written_leaf(target)
        if leaf is not None:
            # eager writes the leaf itself: it stays a leaf that requires
            # grad, with its gradient (an optimizer's step, then p.grad read)
            leaves.succeed(clone, leaf)
        _core.rebind_value(target, clone)
        if target.family is not None:
            after_mutation(target)
        return target
    # An eager tensor is written: pending nodes that read it must see
    # the contents they were recorded with.
    _core.mark_step()
    return func(*materialize(args), **materialize(kwargs))   # stays eager


def own_values(targets):
    """Give each LazyTensor in `targets` a value of its own, which a call
    run eagerly then writes (F.embedding with max_norm, whose eager run
    renormalizes its weight's rows): a LazyTensor never writes into the
    tensor it was made from.  Views and their roots keep theirs (a write
    through a view reaches its root: mutation's own paths)."""
    seen = set()
    for target in targets:
        if type(target) is not LazyTensor or id(target) in seen or target.family is not None:
            continue
        seen.add(id(target))
        value = target.to_eager()
        if value._is_view():
            continue
        if value.is_leaf and value.requires_grad:
            # a leaf that requires grad (a parameter) stays one, with its
            # gradient, as eager's leaf would when written under no_grad
            with torch.no_grad():
                clone = value.clone()
            leaves.succeed(clone, value)
        else:
            clone = value.clone()
        _core.rebind_value(target, clone)


def _leaf_view(view):
    """The value of a view that is a leaf requiring grad, or None."""
    if not view.is_materialized or not view.requires_grad:
        return None
    value = view.to_eager()
    return value if value.is_leaf else None


def write_overlapping(func, name, args, kwargs):
    """An in-place op through a view whose elements overlap in memory
    (expand, unfold, as_strided): eager's result depends on its kernel --
    fill_ writes every alias, add_ through an expanded view raises, add_
    through unfold adds once per alias -- so the op runs eagerly, at the
    view's place in a copy of its root's value (raising eager's error if it
    does), and the root is rebound to that copy, its views refreshed."""
    target = args[0]
    root, base, view = _in_a_copy(target)
    if func(view, *materialize(args[1:]), **materialize(kwargs)) is NotImplemented:
        return NotImplemented
    _core.rebind_value(root, base)
    after_mutation(root)
    return None if name.endswith("__setitem__") else target


def _in_a_copy(target):
    """(root, a copy of the root's value, eager's view of that copy at view
    `target`'s place): where an eager call may write through the view."""
    where = target.family
    root = where.root
    base = root.to_eager().clone(memory_format=torch.contiguous_format)
    view = _storage_as(base, target.dtype).as_strided(where.size, where.stride, where.offset)
    if where.conj:
        view = view.conj() if view.is_complex() else (
            torch._neg_view(view) if views.imaginary(where.offset) else view)
    if where.detached:
        view = view.detach()
    return root, base, view


def _out_overlapping(func, args, kwargs, target):
    """out= a view whose elements overlap in memory (an expanded or
    as_strided view): eager's kernel judges it (most refuse it), so the
    call runs eagerly into the view's place in a copy of its root's value,
    and the root is rebound to that copy, its views refreshed."""
    root, base, view = _in_a_copy(target)
    func(*materialize(args), **dict(materialize(kwargs), out=view))
    if view.shape != target.shape:
        raise RuntimeError(_resizes_view(target, view))
    _core.rebind_value(root, base)
    after_mutation(root)
    return target


def _resizes_view(target, result):
    return (f"fastlazy: out= names a view of a LazyTensor, of shape {tuple(target.shape)}, "
            f"that the result, of shape {tuple(result.shape)}, would resize; eager resizes "
            f"the view inside its base's memory, which fastlazy does not follow.  Pass "
            f"an out= tensor of the result's shape, or no out=.")


def run_out(func, args, kwargs):
    """out= naming LazyTensors: write into copies of their values and rebind
    them, so the tensors they were made from are never written."""
    out = kwargs["out"]
    targets = [out] if type(out) is LazyTensor else list(out)
    read = list(views.lazy_operands(args, {k: v for k, v in kwargs.items() if k != "out"}))
    for t in targets:
        if type(t) is LazyTensor and t.family is not None:
            # eager's error for an input that partly overlaps the output
            if views.check_write(t, read) and type(out) is LazyTensor:
                return _out_overlapping(func, args, kwargs, t)
    copies = [t.to_eager().clone() if type(t) is LazyTensor else t for t in targets]
    # a target that is also an input (torch.add(a, b, out=a)) is its copy
    # there too: eager's call sees them aliased, as in eager
    own = {id(t): c for t, c in zip(targets, copies) if type(t) is LazyTensor}
    kw = dict(materialize(_substituted(kwargs, own)),
              out=copies[0] if type(out) is LazyTensor else type(out)(copies))
    func(*materialize(_substituted(args, own)), **kw)
    for t, c in zip(targets, copies):
        if type(t) is LazyTensor and type(t.family) is Member and c.shape != t.shape:
            # (checked before any target is rebound: every tensor stays as it was)
            raise RuntimeError(_resizes_view(t, c))
    for t, c in zip(targets, copies):
        if type(t) is LazyTensor:
            _core.rebind_value(t, c)
            if t.family is not None:
                after_mutation(t)
    return out


def _substituted(value, own):
    """`value` (args, kwargs, or a list in them) with each LazyTensor that
    `own` names by id replaced by its copy there."""
    if type(value) is LazyTensor:
        return own.get(id(value), value)
    if type(value) in (list, tuple):
        return type(value)(_substituted(v, own) for v in value)
    if type(value) is dict:
        return {k: _substituted(v, own) for k, v in value.items()}
    return value


def _storage_as(value, dtype):
    """A contiguous `value`'s storage as elements of `dtype`, where a view's
    geometry counts (a dtype view, x.view(torch.uint8), counts in its own
    elements, as torch's strides and storage offsets do)."""
    if value.dtype == dtype:
        return value
    if views.complex_of(value.dtype, dtype):
        # (view_as_complex: a view autograd follows, as eager's complex
        # view of a real tensor; view(dtype) of another element size is not)
        return torch.view_as_complex(value.reshape(-1, 2))
    if views.complex_of(dtype, value.dtype):
        return torch.view_as_real(value).reshape(-1)
    return value.reshape(-1).view(dtype)


def _from_storage(written, root):
    """_storage_as undone: the elements `written` (1-d, of a view's dtype)
    as a tensor of `root`'s dtype and shape."""
    if views.complex_of(root.dtype, written.dtype):          # a complex view of a real root
        return torch.view_as_real(written).reshape(root.shape)
    if views.complex_of(written.dtype, root.dtype):          # a real view of a complex root
        return torch.view_as_complex(written.reshape(-1, 2)).reshape(root.shape)
    return written.view(root.dtype).view(root.shape)


def _view_of(root, size, stride, offset, detached, dtype, conj=False):
    # the root's value may have any layout at run time; the geometry is in
    # its contiguous layout
    base = _storage_as(root.clone(memory_format=torch.contiguous_format), dtype)
    value = _conjugated(base.as_strided(size, stride, offset), offset, conj)
    return value.detach() if detached else value


def _conjugated(value, offset, conj):
    """The values of a view with the VIEW_CONJ flag from the elements at its
    place, or (the same map: it is its own inverse) the elements to write
    there from a written view's values: conjugates for a complex view;
    for a real view of a complex root (x.conj().imag) the imaginary parts
    negated -- its elements are all real parts or all imaginary ones (eager
    refuses view_as_real of a conj() view), which the offset's parity
    tells."""
    if not conj:
        return value
    if value.is_complex():
        return value.conj()
    return -value if views.imaginary(offset) else value


def _scatter_into(root, view, size, stride, offset, conj=False):
    view = _conjugated(view, offset, conj)
    base = root.clone(memory_format=torch.contiguous_format)
    if view.dtype == root.dtype:
        return _scattered(base, view, size, stride, offset)
    written = _scattered(_storage_as(base, view.dtype), view, size, stride, offset)
    return _from_storage(written, root)


def _scattered(base, view, size, stride, offset):
    """as_strided_scatter(base, view, ...), with eager's gradients where
    autograd records it: torch's as_strided_scatter hands its input's
    gradient to the elements it overwrote and none to the others (torch
    2.13: x.grad [1, 10, 0] for an upstream gradient [1, 10, 100] with
    the first two overwritten), so the untouched elements are taken from
    `base` by a mask and the written ones from a scatter into zeros."""
    if not (torch.is_grad_enabled() and (base.requires_grad or view.requires_grad)):
        return torch.as_strided_scatter(base, view, size, stride, offset)
    kept = torch.as_strided_scatter(
        torch.ones(base.shape, dtype=torch.bool, device=base.device),
        torch.zeros(size, dtype=torch.bool, device=base.device), size, stride, offset)
    written = torch.as_strided_scatter(torch.zeros_like(base), view, size, stride, offset)
    return torch.where(kept, base, written)


def _grad_leaf(t):
    """A leaf that requires grad (a parameter), materialized or its pending
    update (_core.pend_leaf; LazyTensor.is_leaf answers for both)."""
    return t.requires_grad and t.is_leaf


def _write_leaf(root, view, where):
    """A write through `p.data` or `p.detach()` of a leaf that requires
    grad, or through any view of it under no_grad (a hand-written optimizer
    step): eager writes the leaf's memory,
    and it stays a leaf that requires grad, with its gradient.  So the
    write runs now, into a copy made such a leaf."""
    value = root.to_eager()
    with torch.no_grad():
        written = _scatter_into(value.detach(), view.to_eager().detach(), where.size,
                                where.stride, where.offset, where.conj)
    leaves.succeed(written, value)
    _core.rebind_value(root, written)


def _scatter_detached(root, view, size, stride, offset, conj=False):
    """_scatter_into as autograd sees a write through a detached view: not
    at all (fastlazy/detached_writes.py)."""
    written = _scatter_into(root.detach(), view.detach(), size, stride, offset, conj)
    return torch.ops.fastlazy.written_under(root, written)


def after_mutation(t):
    """t was just rebound by an in-place op: carry the write to its root
    and to every other view of that root."""
    family = t.family
    if type(family) is Member:
        # (a view that held eager's view of its root's value holds it no
        # more: let that tensor, and the root's old storage, go)
        family.held = None
        root = family.root
        if (family.detached or not torch.is_grad_enabled()) and _grad_leaf(root):
            # (under no_grad a write through any view of a parameter --
            # `w[:, 0] -= lr * g` -- is one autograd does not see either)
            _write_leaf(root, t, family)
        else:
            new_root = generic.record(_scatter_detached if family.detached else _scatter_into,
                                      (root, t, family.size, family.stride, family.offset,
                                       family.conj), {}, "view write-back", track_views=False,
                                      churns=False)
            _core.adopt(root, new_root)
        members, skip = family.family.members, t
    else:
        root, members, skip = t, family.members, None
    for view in list(members):
        if view is skip:
            continue
        where = view.family
        try:
            # (a view that carried its root's gradient carries it on: eager's
            # view of a leaf written under no_grad -- an optimizer's step --
            # still requires grad, its backward rebuilt as the leaf's view)
            with torch.enable_grad() if view.requires_grad else contextlib.nullcontext():
                fresh = generic.record(_view_of, (root, where.size, where.stride, where.offset,
                                                  where.detached, view.dtype, where.conj), {},
                                       "view refresh",
                                       track_views=False, churns=False)
        except Unsafe:
            # its place is no longer in the root (`x.resize_` to fewer
            # elements): eager's view keeps the storage's elements there,
            # which the write did not reach, so the view keeps its values
            continue
        where.held = None
        leaf = _leaf_view(view)
        _core.adopt(view, fresh)
        if leaf is not None:
            # a view made a leaf (`x[4:8].requires_grad_()`) stays one, with
            # its gradient and hooks, as eager's does
            value = view.to_eager().detach()
            leaves.succeed(value, leaf)
            _core.rebind_value(view, value)
