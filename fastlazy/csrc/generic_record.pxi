# The C half of the generic path (fastlazy/generic.py): appending the nodes
# of a call that has no C rule, whose output metadata the generic path
# computed once per signature on fake tensors.
#
# A generic node's opcode is GENERIC_OP; its attr holds the id of the
# lowering (an aten program, fastlazy.generic.Lowering) and, from bit
# ATTR_GENERIC_OUT_SHIFT, which of that program's outputs the node is.  Every output of one call is a node with the
# same inputs; backends compute the program once per distinct input tuple.

# torch.autocast contexts entered (fastlazy.patching counts them): under
# autocast the C rules' dtypes would be wrong, so every call takes the
# generic path, whose signatures include the autocast state.
cdef int fl_autocast = 0


def autocast_entered(int delta):
    global fl_autocast
    fl_autocast += delta
    if fl_autocast < 0:
        fl_autocast = 0


def hold_pending():
    """Clear the flag that makes in-place entry points flush (returning it):
    the generic path's fake runs call in-place methods on fake tensors,
    which must not run the pending graph -- inside a fake mode at that."""
    global fl_pending
    held = fl_pending
    fl_pending = 0
    return held


def release_pending(int held):
    global fl_pending
    fl_pending = fl_pending or held


def autocast_depth():
    return fl_autocast


def dtype_code_of(dtype):
    """The core's code for a torch.dtype; -1 for one it cannot hold."""
    cdef int d = dtype_code(dtype)
    return -1 if d == DT_UNDEF or d == DT_COMPLEX32 else d


def record_generic(int lowering, tuple inputs, list outs, bint detach):
    """Append one node per entry of `outs` -- (output index, dtype, shape,
    requires_grad) -- each reading all of `inputs` (LazyTensors); return
    their LazyTensors."""
    cdef Operand ops[MAX_IN]
    cdef int n = len(inputs), i, j
    cdef Meta m
    if n > MAX_IN or not 0 <= lowering < (1 << ATTR_GENERIC_OUT_SHIFT):
        raise ValueError("generic call out of range")
    for i in range(n):
        if type(inputs[i]) is not LazyTensor:
            raise TypeError("generic inputs are LazyTensors")
        classify(&ops[i], <PyObject*>inputs[i])
    result = []
    for index, dtype, shape, requires_grad in outs:
        if len(shape) > MAX_NDIM or index > 255:
            raise ValueError("generic output out of range")
        m.dtype = dtype_code(dtype)
        m.ndim = len(shape)
        for j in range(m.ndim):
            m.shape[j] = shape[j]
        m.device = ops[0].m.device if n else 0
        m.requires_grad = requires_grad
        result.append(record(GENERIC_OP, ops, n, &m,
                             lowering | (<int>index << ATTR_GENERIC_OUT_SHIFT),
                             NODE_DETACH if detach else 0, None))
    return result


from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM
from cpython.ref cimport Py_INCREF


# -- signature hits in C --
#
# The generic path (fastlazy/generic.py) analyses a call signature once
# and then records every call of it from its cached Signature.  For the
# common signatures -- one result, recorded as one node, no random draws --
# it also publishes a GenericHit here under the same key, and a later call
# of that signature is recorded without going up into Python: describe the
# arguments, look the key up, append the node.

@cython.final
@cython.no_gc
cdef class GenericHit:
    cdef Meta meta              # the one result's (its device: the first input's)
    cdef int attr               # lowering id | output index << ATTR_GENERIC_OUT_SHIFT
    cdef int flags
    cdef tuple constants        # eager tensors the program reads, appended as inputs
    cdef int view_of            # the result is a view of tensors[view_of]; -1: not a view
    cdef object where           # the view's place in its base (fastlazy.views.attach)
    cdef bint detached_view


cdef dict _generic_hits = {}


def publish_generic(key, int lowering, list outs, bint detach, tuple constants,
                    int view_of, where, bint detached_view):
    """Record later calls of signature `key` in C (fastlazy.generic)."""
    cdef GenericHit hit = GenericHit.__new__(GenericHit)
    index, dtype, shape, requires_grad = outs[0]
    if len(outs) != 1 or len(shape) > MAX_NDIM or index > 255 or not (
            0 <= lowering < (1 << ATTR_GENERIC_OUT_SHIFT)):
        raise ValueError("generic call out of range")
    hit.meta.dtype = dtype_code(dtype)
    hit.meta.ndim = len(shape)
    for j in range(hit.meta.ndim):
        hit.meta.shape[j] = shape[j]
    hit.meta.requires_grad = requires_grad
    hit.attr = lowering | (<int>index << ATTR_GENERIC_OUT_SHIFT)
    hit.flags = NODE_DETACH if detach else 0
    hit.constants = constants
    hit.view_of = view_of
    hit.where = where
    hit.detached_view = detached_view
    _generic_hits[key] = hit


def forget_generic():
    """Drop every published signature (the generic path starts over)."""
    _generic_hits.clear()


cdef object generic_hit(object func, tuple pos, dict kw, bint ruled):
    """The result of recording func(*pos, **kw) from a published signature;
    on a miss, (key, tensors) for the generic path to go on with -- or ()
    if the arguments have no signature here (the generic path describes
    them itself and decides)."""
    if fl_autocast:
        return ()          # the key holds the autocast state: Python builds it
    cdef list tensors = []
    try:
        key = signature_key(func, pos, kw, tensors, ruled, None)
    except Exception:
        return ()
    found = _generic_hits.get(key)
    if found is None:
        return key, tensors
    cdef GenericHit hit = <GenericHit>found
    cdef Py_ssize_t n = len(tensors), nc = len(hit.constants), k
    if n + nc > MAX_IN:
        return key, tensors
    cdef Operand ops[MAX_IN]
    cdef list held = []         # the LazyTensors made here, alive until recorded
    for k in range(n + nc):
        v = tensors[k] if k < n else hit.constants[k - n]
        if type(v) is not LazyTensor:
            v = wrap_value(v)
            held.append(v)
        classify(&ops[k], <PyObject*>v)
    cdef Meta m = hit.meta
    m.device = ops[0].m.device if n + nc else 0
    out = record(GENERIC_OP, ops, <int>(n + nc), &m, hit.attr, hit.flags, None)
    if hit.view_of >= 0:
        _hooks.attach_view(out, tensors[hit.view_of], hit.where, hit.detached_view)
    counters[C_GENERIC] += 1
    return out


def adopt(LazyTensor target, LazyTensor source):
    """Move target onto source's node (or value), leaving source empty: how
    a view or its base is rebound to the node that recomputes it after a
    write through another view."""
    if target is source:
        return
    cdef Segment seg = source.seg
    if seg is not None and seg.state == SEG_RECORDING:
        # the node gets its new owner before target lets its old node go,
        # so dropping that one can never drop this one
        seg.nodes[source.idx].owner = <PyObject*>target
        source.seg = None
        memcpy(&target.meta, &source.meta, sizeof(Meta))
        target._device = None
        retarget(target, seg, source.idx)
    else:
        value = materialize(source)
        memcpy(&target.meta, &source.meta, sizeof(Meta))
        target._device = None
        detach_handle(target, value)


cpdef tuple signature_key(object func, tuple args, dict kwargs, list tensors, bint ruled,
                          object autocast):
    """A call's signature (fastlazy.generic): the function; a tuple with
    each LazyTensor's dtype/shape/device/requires_grad (and view geometry),
    each eager tensor's metadata, and every other argument's value; the
    grad mode; the autocast state (`autocast`, built by the caller); and
    `ruled`.  The tensors are appended to `tensors` in order.  In C: it
    runs on every call the generic path records."""
    cdef list parts = []
    describe(args, tensors, parts)
    describe(kwargs, tensors, parts)
    return (func, tuple(parts), grad_enabled(), autocast, ruled)


cdef int describe(object x, list tensors, list parts) except -1:
    cdef type t = type(x)
    cdef LazyTensor lt
    cdef Py_ssize_t i
    if t is int:
        # an int stands for itself (the commonest argument: sizes, dims);
        # every other type is tagged, so that 1, True and 1.0 differ
        parts.append(x)
    elif t is LazyTensor:
        lt = <LazyTensor>x
        tensors.append(x)
        shape = PyTuple_New(lt.meta.ndim)
        for i in range(lt.meta.ndim):
            v = lt.meta.shape[i]
            Py_INCREF(v)
            PyTuple_SET_ITEM(shape, i, v)
        grad = lt.value.requires_grad if lt.value is not None else lt.meta.requires_grad != 0
        if lt.family is None:
            parts.append((lt.meta.dtype, shape, lt.meta.device, grad))
        else:
            parts.append((lt.meta.dtype, shape, lt.meta.device, grad, _hooks.geometry(x)))
    elif t is tuple or t is list:
        parts.append((t, len(x)))
        for v in x:
            describe(v, tensors, parts)
    elif t is float:
        parts.append((float, x.hex()))       # -0.0 and nan are values of their own
    elif t in _hooks.atoms:
        parts.append((t, x))
    elif t is dict:
        parts.append((dict, tuple(x)))
        for v in (<dict>x).values():
            describe(v, tensors, parts)
    elif t is slice:
        parts.append(slice)
        describe(x.start, tensors, parts)
        describe(x.stop, tensors, parts)
        describe(x.step, tensors, parts)
    elif t is _Size:
        parts.append((t, tuple(x)))
    elif isinstance(x, TensorType):
        if x.layout is not _torch.strided or (t is not TensorType and
                                              t is not _torch.nn.Parameter):
            raise _hooks.unsafe("a sparse tensor or a tensor subclass")
        tensors.append(x)
        parts.append(("eager", x.dtype, tuple(x.shape), x.stride(), x.device,
                      x.requires_grad))
    elif t is complex:
        parts.append((complex, repr(x)))
    else:
        raise _hooks.unsafe(f"an argument of type {t.__name__}")
    return 0
