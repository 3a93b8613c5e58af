"""Views of LazyTensors: where each sits in its root's storage, and eager's
checks on writes through them.

A view recorded by the generic path (x[0], x.view(-1), x.transpose(0, 1),
split...) is a node like any other: LazyTensors never share storage.  What
makes it a view is that writes must show through, as in eager; mutation.py
carries them (after_mutation), from what is kept here:

- every view remembers its *root* base and where it sits in the root's
  storage: size, stride and storage offset, taken from the fake run that
  recorded it (geometry relative to the root's contiguous layout);
- before an in-place write, eager's refusals are raised at the call: a leaf
  that requires grad (check_leaf), and memory overlap between views of one
  root (check_write).

The root holds its views weakly; a view holds its root strongly (as eager's
`_base`), so nothing forms a reference cycle (LazyTensor is not tracked by
the cyclic GC).  Family and Member live in the core (csrc/families.pxi).
"""
from __future__ import annotations

import torch

# Family, Member, attach, geometry and held are the compiled core's
# (csrc/families.pxi): a recorded view is attached there, without Python.
from fastlazy._core import Family, LazyTensor, Member, attach, geometry, held  # noqa: F401


def attach_result(t, base, where, flags):
    """Attach t, a generic call's result that views its argument `base`,
    at `where` (size, stride, offset) as the call's analysis found it: in
    base's root, or, for a held base (a slice of a value, traced as a
    tensor of its own: held()), relative to base's own place (a dtype
    view's start in its own elements: generic.record checked that it is
    a whole number of them)."""
    if held(base):
        size, stride, offset = where
        # base's place counts base's elements; t's counts its own
        start = base.family.offset * base.dtype.itemsize // t.dtype.itemsize
        where = (size, stride, offset + start)
    attach(t, base, where, flags)


def place(t):
    """(root, size, stride, offset) of a LazyTensor in its root's storage."""
    family = t.family
    if type(family) is Member:
        return family.root, family.size, family.stride, family.offset
    size = tuple(t.shape)
    return t, size, contiguous_strides(size), 0


def contiguous_strides(size):
    """The strides of a contiguous tensor of `size` (a dim of size 0 or 1
    counted as 1, as torch does)."""
    stride, step = [], 1
    for n in reversed(size):
        stride.insert(0, step)
        step *= max(n, 1)
    return tuple(stride)


def traced_contiguous(t) -> bool:
    """Is LazyTensor t contiguous in the fake and trial runs that trace the
    calls it is passed to?  A root always is (a LazyTensor that is not a
    view reports a contiguous layout); a view where its geometry is, size-1
    dims aside, as torch judges.  Either may have another layout when its
    graph runs -- a root made from a permuted or channels-last eager tensor,
    a slice of one -- so programs traced on such an input make it
    contiguous first (capture.checked): a `.contiguous()` the trace left
    out, or a `view`, then sees what the trace saw."""
    where = geometry(t)
    return where is None or contiguous(tuple(t.shape), where[1])


def contiguous(size, stride) -> bool:
    """c10's is_contiguous of this geometry: dims of size 1 may have any
    stride, and an empty tensor is contiguous."""
    if 0 in size:
        return True
    expected = 1
    for n, st in zip(reversed(size), reversed(stride)):
        if n != 1:
            if st != expected:
                return False
            expected *= n
    return True


def imaginary(offset) -> bool:
    """Whether a real view of a complex root, at this offset in real
    elements, holds its imaginary parts (x.imag, x.conj().imag) rather than
    its real ones."""
    return offset % 2 == 1


def dense(size, stride):
    """Non-overlapping and dense: some permutation of the dims is contiguous."""
    dims = sorted((st, n) for n, st in zip(size, stride) if n != 1)
    expected = 1
    for st, n in dims:
        if st != expected:
            return False
        expected *= n
    return True


def overlapping(size, stride):
    """May two elements of this geometry share memory (x.expand(3, 4),
    x.unfold(0, 3, 1), an as_strided with overlapping windows)?"""
    reach = 0
    for st, n in sorted((st, n) for n, st in zip(size, stride) if n > 1):
        if st <= reach:
            return True
        reach += (n - 1) * st
    return False


_PARTIAL = ("unsupported operation: some elements of the input tensor and the written-to "
            "tensor refer to a single memory location. Please clone() the tensor before "
            "performing the operation.")


def check_write(target, operands, index=None):
    """Eager's memory-overlap checks for an in-place op on `target`, a view
    or a base of views, reading `operands`: the error eager raises for
    reading a view that partly overlaps the written one, at the call.
    True if target's own elements overlap: eager's result then depends on
    its kernel (fill_ of an expanded view succeeds, add_ raises, add_
    through unfold adds once per alias), so the caller runs the write
    eagerly on a copy of the root's value (mutation.write_overlapping).
    `index`: the call is target[index] = value, which writes only the
    elements of target[index] (eager copies a value that is exactly those
    elements onto themselves: `x[1:] += 1`)."""
    root, size, stride, offset = place(target)
    if target.dtype != root.dtype and root.requires_grad \
            and not complex_of(target.dtype, root.dtype) \
            and not complex_of(root.dtype, target.dtype):
        # eager writes the bits under the root's autograd history; a recorded
        # graph's write-back is a reinterpretation autograd cannot follow
        raise RuntimeError(
            f"fastlazy: an in-place write through a {target.dtype} view of a {root.dtype} "
            f"tensor that requires grad is not supported; write through a view of its "
            f".detach() instead")
    if overlapping(size, stride):
        return True
    if index is not None:
        size, stride, offset = _indexed(target, size, stride, offset, index)
    size_a = target.dtype.itemsize
    span = _byte_span(size_a, size, stride, offset)
    if span is None or not dense(size, stride):
        return False
    for other in operands:
        if other is target or other.family is None:
            continue
        o_root, o_size, o_stride, o_offset = place(other)
        if o_root is not root:
            continue
        size_b = other.dtype.itemsize
        o_span = _byte_span(size_b, o_size, o_stride, o_offset)
        if o_span is None or not dense(o_size, o_stride):
            continue
        full = (span == o_span
                and [s * size_a for s in stride] == [s * size_b for s in o_stride])
        if not full and _meet(span, o_span):
            raise RuntimeError(_PARTIAL)
    return False


# in-place ops whose kernel refuses any overlap, full or partial, between
# the tensor written and these operands (ATen's assert_no_overlap): the
# operand's position after self, and its keyword
NO_OVERLAP_OPERANDS = {
    "scatter_": (2, "src"), "scatter_add_": (2, "src"), "scatter_reduce_": (2, "src"),
    "index_copy_": (2, "source"), "index_add_": (2, "source"), "index_put_": (1, "values"),
}


def check_no_overlap(target, method, args, kwargs):
    """Eager's refusal of `target.<method>(*args, **kwargs)` where the
    operand NO_OVERLAP_OPERANDS names shares memory with target at all
    (`b.scatter_(0, index, b)`): the values a recorded write would compute
    (read before the write) are not eager's, which has none."""
    where = NO_OVERLAP_OPERANDS.get(method)
    if where is None:
        return
    position, keyword = where
    other = args[position] if len(args) > position else kwargs.get(keyword)
    if type(other) is not LazyTensor:
        return
    if other is target:
        raise RuntimeError(_PARTIAL)
    root, size, stride, offset = place(target)
    o_root, o_size, o_stride, o_offset = place(other)
    if o_root is not root:
        return
    span = _byte_span(target.dtype.itemsize, size, stride, offset)
    o_span = _byte_span(other.dtype.itemsize, o_size, o_stride, o_offset)
    if span is not None and o_span is not None and _meet(span, o_span):
        raise RuntimeError(_PARTIAL)


def _byte_span(itemsize, size, stride, offset):
    """(first byte, byte past the last) of a place in its root's storage,
    from its first element to its last (a view's geometry counts its own
    elements, of `itemsize` bytes: places of other dtypes compare in
    bytes, as eager's overlap checks compare memory); None if it holds no
    element."""
    if 0 in size:
        return None
    last = offset + sum((n - 1) * st for n, st in zip(size, stride))
    return offset * itemsize, (last + 1) * itemsize


def _meet(span, other) -> bool:
    """Do two byte spans share a byte?"""
    return span[0] < other[1] and other[0] < span[1]


def _basic_index(index):
    """The index with each 0-dim integer tensor read as its int (eager's
    indexing selects with it: `x[t, 2] += 1` writes one element), if it
    then holds ints, slices, None and Ellipsis only (a view); else
    _GATHER."""
    items = index if type(index) is tuple else (index,)
    if any(isinstance(i, torch.Tensor) for i in items):
        items = tuple(_as_int(i) for i in items)
        index = items if type(index) is tuple else items[0]
    for i in items:
        t = type(i)
        if t is slice:
            if not (type(i.start) in _BOUNDS and type(i.stop) in _BOUNDS
                    and type(i.step) in _BOUNDS):
                return _GATHER
        elif not (t is int or i is None or i is Ellipsis):
            return _GATHER
    return index


_BOUNDS = (int, type(None))
_GATHER = object()          # an index that gathers (tensors, lists, bools)
# the dtypes of a 0-dim tensor eager's indexing reads as an int (a bool or
# uint8 one is a mask)
_INT_INDEX_DTYPES = frozenset((torch.int8, torch.int16, torch.int32, torch.int64))


def _as_int(item):
    """A 0-dim integer tensor's int, where reading it costs no graph run (an
    eager tensor, or a LazyTensor holding its value); any other item as
    it is."""
    if (isinstance(item, torch.Tensor) and item.dim() == 0
            and item.dtype in _INT_INDEX_DTYPES
            and (type(item) is not LazyTensor or item.is_materialized)):
        return int(item)
    return item


def _indexed(target, size, stride, offset, index):
    """(size, stride, offset) of target[index] in target's root, for a
    basic index; target's own place for any other (a gather: eager's
    index_put_ reads its values apart from the written elements)."""
    index = _basic_index(index)
    if index is _GATHER:
        return size, stride, offset
    key = (tuple(size), tuple(stride), offset, _index_key(index))
    found = _indexed_places.get(key)
    if found is None:
        # eager's own indexing on a meta tensor of the geometry (tens of
        # microseconds: a model's x[:, :3] = ... writes meet the same few
        # geometries at every call)
        span = offset + 1 + sum((n - 1) * st for n, st in zip(size, stride) if n > 0)
        region = torch.empty(span, dtype=target.dtype, device="meta").as_strided(
            size, stride, offset)[index]
        found = (tuple(region.shape), region.stride(), region.storage_offset())
        if len(_indexed_places) >= _MAX_INDEXED_PLACES:
            _indexed_places.clear()
        _indexed_places[key] = found
    return found


# (size, stride, offset, _index_key) -> the indexed region's place
_indexed_places: dict = {}
_MAX_INDEXED_PLACES = 4096


def _index_key(index):
    """A basic index as a hashable value (slices are not, before Python
    3.12); an int and a slice never compare equal."""
    items = index if type(index) is tuple else (index,)
    return (type(index) is tuple,) + tuple(
        (i.start, i.stop, i.step) if type(i) is slice else i for i in items)


def lazy_operands(*items):
    """The LazyTensors among call arguments (inside lists and dicts too)."""
    for x in items:
        if type(x) in (list, tuple):
            yield from lazy_operands(*x)
        elif type(x) is dict:
            yield from lazy_operands(*x.values())
        elif type(x) is LazyTensor:
            yield x


def before_write(target, operands, setitem=False):
    """Eager's refusals of an in-place write to `target` reading `operands`
    (the call's (args after the target, kwargs)), raised at the call: a
    leaf that requires grad, and memory overlap between views of one root.
    True if target's elements overlap each other (check_write).  `setitem`:
    the call is target[index] = value, index the first of the args, which
    writes through a view of target."""
    check_leaf(target, setitem)
    if target.family is not None:
        args = operands[0]
        index = args[0] if setitem and args else None
        return check_write(target, list(lazy_operands(operands)), index)
    return False


def check_leaf(target, through_view=False):
    """Eager refuses in-place ops on a leaf that requires grad (or a view of
    one: __setitem__ writes through one) while grad mode is on; a LazyTensor
    made from such a leaf is it.  Likewise an inference tensor (made under
    torch.inference_mode()) outside inference mode."""
    family = target.family
    root = family.root if type(family) is Member else target
    if not torch.is_inference_mode_enabled() and root.is_inference():
        raise RuntimeError("Inplace update to inference tensor outside InferenceMode is not "
                           "allowed.You can make a clone to get a normal tensor before doing "
                           "inplace update.See https://github.com/pytorch/rfcs/pull/17 for "
                           "more details.")
    if not target.requires_grad or not torch.is_grad_enabled():
        return                  # a detached view of a leaf may be written, as in eager
    # (a pending result that requires grad is no leaf; a leaf's pending
    # update is one: LazyTensor.is_leaf)
    if root.is_leaf and root.requires_grad:
        what = ("a leaf Variable" if root is target and not through_view
                else "a view of a leaf Variable")
        raise RuntimeError(f"{what} that requires grad is being used in an in-place "
                           f"operation.")


# as_strided's entry points, by route's names for them
AS_STRIDED_NAMES = frozenset({"Tensor.as_strided", "as_strided"})


def as_strided_of_root(args, kwargs):
    """(args, kwargs) of `view.as_strided(size, stride, offset)` as a call
    on the view's root, or None where the call is not one on a view.
    as_strided places its result in its input's storage, at the offset it
    names (the input's own where it names none), whatever the input's own
    place there: the root's storage is the view's, so the root's call is
    the view's.  A program recorded on the view itself would run on the
    view's value alone, a tensor of its own, where the offset counts from
    the view's first element; and a view held from an eager value, traced
    as a tensor of its own, could not be recorded at all (capture: its
    eager call returned a copy, which writes did not reach).  Not for a
    detached or conj() view (its flags are not the root's) or a dtype view
    (its elements are not the root's)."""
    if not args or type(args[0]) is not LazyTensor:
        return None
    t = args[0]
    family = t.family
    if type(family) is not Member or family.flags or family.root.dtype != t.dtype:
        return None
    rest = list(args[1:])
    kwargs = dict(kwargs)
    if len(rest) >= 3:
        if rest[2] is None:
            rest[2] = t.storage_offset()
    elif kwargs.get("storage_offset") is None:
        kwargs["storage_offset"] = t.storage_offset()
    return (family.root, *rest), kwargs


def complex_of(real, complex_):
    """Is complex_ the complex dtype whose parts are of dtype `real`?  (A
    view between the two -- view_as_complex, .real, view_as_real -- is one
    autograd follows: mutation writes back through it.)"""
    return _PARTS.get(complex_) == real


_PARTS = {torch.complex32: torch.float16, torch.complex64: torch.float32,
          torch.complex128: torch.float64}
