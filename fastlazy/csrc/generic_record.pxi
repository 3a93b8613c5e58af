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
    global fl_autocast, _autocast_epoch
    fl_autocast += delta
    if fl_autocast < 0:
        fl_autocast = 0
    _autocast_epoch += 1


def autocast_changed():
    """An autocast setter ran (fastlazy.patching wraps torch's): the state
    read last may be stale."""
    global _autocast_epoch
    _autocast_epoch += 1


# The autocast state a generic signature holds: ((enabled, dtype) per device
# type) as this thread's torch reports it.  Reading it costs four calls into
# torch (~0.6 us, each parsing its device string), so the state read last is
# kept with the thread that read it and the epoch it was read in: an epoch
# ends wherever the state may change -- an autocast context entered or
# left, one of torch's autocast setters called (fastlazy.patching wraps
# them), a graph run with autocast suspended (flush.pxi) -- and another
# thread reads its own.  Each state met gets a small id (_autocast_ids) for
# the flat keys' first word.
cdef object _is_autocast_on_now = torch.is_autocast_enabled
cdef object _autocast_dtype_now = torch.get_autocast_dtype
cdef object _autocast_key = None
cdef int64_t _autocast_word = 0
cdef dict _autocast_ids = {}
cdef uint64_t _autocast_epoch = 1
cdef uint64_t _autocast_key_epoch = 0
cdef unsigned long _autocast_key_thread = 0


cdef object autocast_key_now():
    """This thread's autocast state, as generic signatures hold it."""
    global _autocast_key, _autocast_word, _autocast_key_epoch, _autocast_key_thread
    cdef unsigned long thread = PyThread_get_thread_ident()
    if _autocast_key_epoch == _autocast_epoch and _autocast_key_thread == thread:
        return _autocast_key
    key = ((_is_autocast_on_now("cpu"), _autocast_dtype_now("cpu")),
           (_is_autocast_on_now("cuda"), _autocast_dtype_now("cuda")))
    found = _autocast_ids.get(key)
    if found is None:
        found = _autocast_ids[key] = len(_autocast_ids) + 1
    _autocast_key = key
    _autocast_word = <int64_t>found
    _autocast_key_epoch = _autocast_epoch
    _autocast_key_thread = thread
    return key


def autocast_key():
    """This thread's autocast state as generic signatures hold it (None
    outside every autocast context)."""
    return autocast_key_now() if fl_autocast else None


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


def record_generic(int lowering, tuple inputs, list outs, bint detach, bint written=False):
    """Append one node per entry of `outs` -- (output index, dtype, shape,
    requires_grad) -- each reading all of `inputs` (LazyTensors, then any
    Python floats the program takes: fastlazy.lifted_floats); return their
    LazyTensors.  written: the call wrote its first input in place
    (NODE_WRITTEN; the program is its functional form)."""
    cdef Operand ops[MAX_IN]
    cdef int n = len(inputs), i, j
    cdef Meta m
    if n > MAX_IN or not 0 <= lowering < (1 << ATTR_GENERIC_OUT_SHIFT):
        raise ValueError("generic call out of range")
    for i in range(n):
        if type(inputs[i]) is not LazyTensor and (i == 0 or type(inputs[i]) is not float):
            raise TypeError("generic inputs are LazyTensors and floats")
        classify(&ops[i], <PyObject*>inputs[i])
    cdef int flags = (NODE_DETACH if detach else 0) | (NODE_WRITTEN if written else 0)
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
                             lowering | (<int>index << ATTR_GENERIC_OUT_SHIFT), flags, None))
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
    cdef int returns_input      # the result is tensors[returns_input] itself; -1: a node
    cdef int view_flags
    cdef bint exact_layout      # as_strided: its base's layout is asked (place_as_eager)
    cdef int view_ndim          # the view's place in its root's storage
    cdef int64_t view_size[MAX_NDIM]
    cdef int64_t view_stride[MAX_NDIM]
    cdef int64_t view_offset
    cdef int tuple_len          # > 0: the call returns a tuple of that length,
    cdef int tuple_at           # the result at tuple_at and None elsewhere
    # a call that returns several results (aten's functional batch norm,
    # chunk): the hits of the others, each at its own tuple_at; None else
    cdef tuple parts
    cdef object sequence        # ... returned as this type (a list, torch.topk's
                                #     structseq), not a tuple, where not None
    # under a flat key (FastKey): the key itself, to tell hash collisions apart
    cdef FastKey key
    cdef GenericHit next        # another signature of the same hash


cdef dict _generic_hits = {}    # signature_key(...) -> GenericHit
cdef dict _fast_hits = {}       # flat key's hash -> GenericHit (chained by .next)
# In front of _fast_hits: the last hit found per hash bucket (borrowed; the
# dict owns every hit until forget_generic, which empties this too).
cdef enum:
    HIT_CACHE = 4096
cdef PyObject *_hit_cache[HIT_CACHE]
memset(_hit_cache, 0, sizeof(_hit_cache))


def publish_generic(tuple prepared, int lowering, list outs, bint detach, tuple constants,
                    int view_of, where, int view_flags, tuple tuple_form=None,
                    bint written=False, bint exact_layout=False):
    """Record later calls of the signature the core described as `prepared`
    (the key, tensors and flat key it handed to fastlazy.generic) in C.
    tuple_form: (length, position) of a call that returns a tuple holding
    its one result and Nones (F.multi_head_attention_forward's (out, None)).
    written: the signature is an in-place call's, recorded as its
    functional form (NODE_WRITTEN; record_inplace).  exact_layout: a view
    that addresses its base's storage (as_strided): the base's layout is
    asked before it (place_as_eager_lays_out's exact)."""
    if len(outs) != 1:
        raise ValueError("generic call out of range")
    cdef GenericHit hit = result_hit(lowering, outs[0], detach, view_of, where, view_flags)
    hit.exact_layout = exact_layout
    if written:
        hit.flags |= NODE_WRITTEN
    hit.constants = constants
    if tuple_form is not None:
        hit.tuple_len, hit.tuple_at = tuple_form
        if not 0 <= hit.tuple_at < hit.tuple_len:
            raise ValueError("generic call out of range")
    file_hit(prepared, hit)


def publish_generic_results(tuple prepared, int lowering, list outs, bint detach,
                            tuple constants, list places, int length, object sequence):
    """publish_generic for a call that returns a tuple (or a `sequence`:
    list, or a structseq such as torch.return_types.topk) of `length`
    results, each of `outs` recorded as a node:
    places[k] is (its position, view_of, where, view_flags); the others
    are None."""
    cdef Py_ssize_t k, n = len(outs)
    if n < 2 or len(places) != n or length < n:
        raise ValueError("generic call out of range")
    hits = []
    for k in range(n):
        at, view_of, where, view_flags = places[k]
        if not 0 <= at < length:
            raise ValueError("generic call out of range")
        hit = result_hit(lowering, outs[k], detach, view_of, where, view_flags)
        (<GenericHit>hit).tuple_at = at
        hits.append(hit)
    cdef GenericHit head = <GenericHit>hits[0]
    head.constants = constants
    head.tuple_len = length
    head.parts = tuple(hits[1:])
    head.sequence = sequence
    file_hit(prepared, head)


cdef GenericHit result_hit(int lowering, tuple out, bint detach, int view_of, where,
                           int view_flags):
    """The hit of one recorded result: `out` is (output index, dtype,
    shape, requires_grad); a view of the call's tensor `view_of` (-1: none)
    sits at `where`, (size, stride, offset), in its root's storage."""
    cdef GenericHit hit = GenericHit.__new__(GenericHit)
    hit.returns_input = -1
    index, dtype, shape, requires_grad = out
    if len(shape) > MAX_NDIM or index > 255 or not (
            0 <= lowering < (1 << ATTR_GENERIC_OUT_SHIFT)):
        raise ValueError("generic call out of range")
    hit.meta.dtype = dtype_code(dtype)
    hit.meta.ndim = len(shape)
    for j in range(hit.meta.ndim):
        hit.meta.shape[j] = shape[j]
    hit.meta.requires_grad = requires_grad
    hit.attr = lowering | (<int>index << ATTR_GENERIC_OUT_SHIFT)
    hit.flags = NODE_DETACH if detach else 0
    hit.constants = ()
    hit.view_of = view_of
    hit.view_flags = view_flags
    if view_of >= 0:
        size, stride, offset = where
        if len(size) > MAX_NDIM or len(stride) != len(size):
            raise ValueError("generic call out of range")
        hit.view_ndim = len(size)
        for j in range(hit.view_ndim):
            hit.view_size[j] = size[j]
            hit.view_stride[j] = stride[j]
        hit.view_offset = offset
    return hit


def publish_input(tuple prepared, int index):
    """Later calls of the signature return their tensor argument `index`
    itself (x.contiguous() of a contiguous x)."""
    cdef GenericHit hit = GenericHit.__new__(GenericHit)
    hit.returns_input = index
    hit.view_of = -1
    hit.constants = ()
    file_hit(prepared, hit)


cdef int file_hit(tuple prepared, GenericHit hit) except -1:
    _generic_hits[prepared[0]] = hit
    if len(prepared) > 2 and prepared[2] is not None:
        add_fast_hit(<FastKey>prepared[2], hit)
    return 0


cdef int add_fast_hit(FastKey key, GenericHit hit) except -1:
    """File `hit` under the flat key (a copy of hit if it is filed already)."""
    cdef GenericHit h
    if hit.key is not None:
        h = GenericHit.__new__(GenericHit)
        memcpy(&h.meta, &hit.meta, sizeof(Meta))
        h.attr, h.flags, h.constants = hit.attr, hit.flags, hit.constants
        h.view_of, h.view_flags, h.view_ndim = hit.view_of, hit.view_flags, hit.view_ndim
        h.exact_layout = hit.exact_layout
        h.returns_input = hit.returns_input
        h.tuple_len, h.tuple_at = hit.tuple_len, hit.tuple_at
        h.parts, h.sequence = hit.parts, hit.sequence
        memcpy(h.view_size, hit.view_size, sizeof(hit.view_size))
        memcpy(h.view_stride, hit.view_stride, sizeof(hit.view_stride))
        h.view_offset = hit.view_offset
        hit = h
    hit.key = key
    hit.next = _fast_hits.get(key.hash)
    _fast_hits[key.hash] = hit
    return 0


def forget_generic():
    """Drop every published signature (the generic path starts over)."""
    memset(_hit_cache, 0, sizeof(_hit_cache))
    _generic_hits.clear()
    _fast_hits.clear()


# Set where record_hit left a call unrecorded because its view's base
# became a view of its storage: record_by_signature keys the call again.
cdef bint _relaid_out = False


cdef inline bint relays_view_base(object base, bint exact) except -1:
    """Did `base`, the argument a published signature's result views, just
    become a view of its storage in eager's order?"""
    return type(base) is LazyTensor and place_as_eager_lays_out(<LazyTensor>base, exact) == 1


cdef object record_hit(GenericHit hit, Operand *ops, Py_ssize_t n):
    """Append the node of a published signature whose first n operands
    (the call's tensors) are sorted in ops; the constants go after them."""
    cdef Py_ssize_t nc = len(hit.constants), k
    if hit.returns_input >= 0:
        if hit.returns_input >= n:
            return None
        counters[C_GENERIC] += 1
        return <object>ops[hit.returns_input].obj
    if n + nc > MAX_IN:
        return None
    global _relaid_out
    if 0 <= hit.view_of < n and relays_view_base(<object>ops[hit.view_of].obj,
                                                  hit.exact_layout):
        # its base, a pending result eager lays out otherwise, is now a view
        # of its storage (place_as_eager_lays_out): the signature's place
        # was for the base as a root, so the call is keyed again
        _relaid_out = True
        return None
    cdef list held = None       # the LazyTensors made here, alive until recorded
    for k in range(nc):
        v = wrap_value(hit.constants[k])
        if held is None:
            held = []
        held.append(v)
        classify(&ops[n + k], <PyObject*>v)
    if hit.parts is not None:
        # the results' nodes read one slot per eager tensor, as the generic
        # path's do (an eager operand would take a slot per node): wrapped
        for k in range(n):
            if ops[k].kind == K_TENSOR:
                v = wrap_value(<object>ops[k].obj)
                if held is None:
                    held = []
                held.append(v)
                classify(&ops[k], <PyObject*>v)
    out = record_result(hit, hit.flags, ops, n + nc)
    counters[C_GENERIC] += 1
    cdef GenericHit part
    if hit.parts is not None:
        # every result a node over the same inputs (one run computes them)
        results = [None] * hit.tuple_len
        results[hit.tuple_at] = out
        for k in range(len(hit.parts)):
            part = <GenericHit>hit.parts[k]
            results[part.tuple_at] = record_result(part, hit.flags, ops, n + nc)
        if hit.sequence is None:
            return tuple(results)
        return results if hit.sequence is list else hit.sequence(results)
    if hit.tuple_len:
        result = PyTuple_New(hit.tuple_len)
        for k in range(hit.tuple_len):
            item = out if k == hit.tuple_at else None
            Py_INCREF(item)
            PyTuple_SET_ITEM(result, k, item)
        return result
    return out


cdef object record_result(GenericHit hit, int flags, Operand *ops, Py_ssize_t n):
    """The node of one result of a published signature, over ops[:n]."""
    cdef Meta m = hit.meta
    m.device = ops[0].m.device if n else 0
    out = record(GENERIC_OP, ops, <int>n, &m, hit.attr, flags, None)
    if hit.view_of >= 0:
        base = <object>ops[hit.view_of].obj
        if type(base) is not LazyTensor:
            raise SystemError("fastlazy: a generic view of an eager tensor")
        # a held base was traced as a tensor of its own: the place is
        # relative to it (capture keeps such views to the base's dtype)
        attach_view(out, base, hit.view_ndim, hit.view_size, hit.view_stride,
                    hit.view_offset + ((<Member>(<LazyTensor>base).family).offset
                                       if is_held(<LazyTensor>base) else 0),
                    hit.view_flags)
    return out


cdef object record_by_signature(object func, object name, tuple pos, dict kw, bint ruled,
                                object fast):
    """func(*pos, **kw) recorded from its published signature; on a miss,
    handed to the generic path (Hooks.record_call) with the key and tensors
    built here and `fast`, the call's flat key (or None) -- or with () if
    the arguments have no signature here (the generic path describes them
    itself and decides)."""
    cdef list tensors = []
    try:
        key = signature_key(func, pos, kw, tensors, ruled,
                            autocast_key_now() if fl_autocast else None)
    except Exception:
        return _hooks.record_call(func, name, pos, kw, False, ruled, ())
    global _relaid_out
    _relaid_out = False
    out = record_by_key(key, tensors, fast)
    if out is not None:
        return out
    if _relaid_out:
        _relaid_out = False
        return record_by_signature(func, name, pos, kw, ruled, None)
    return _hooks.record_call(func, name, pos, kw, False, ruled, (key, tensors, fast))


cdef inline bint writes_own_pending(LazyTensor target):
    """Is an in-place call on target one whose functional form the generic
    path may publish (fastlazy.mutation.record_inplace): a pending result
    that is no view, has no live view (`m[:, :n] = m[:, :n].masked_fill(..)`:
    the view read is gone by the write) and no inference mode made --
    eager's refusals of a write (a leaf, an inference tensor, overlapping
    views) cannot apply to it, and the write is the node alone, with
    nothing to carry to views.  A leaf's pending update (tensor.pxi
    pend_leaf) is one under no_grad (with grad, eager refuses the write:
    the Python path raises its error)."""
    if target.value is not None or target.meta.inference:
        return False
    if target.leaf_of is not None and grad_enabled():
        return False
    family = target.family
    return family is None or type(family) is Family and not (<Family>family).has_live_views()


cdef object writes_own_value(LazyTensor target):
    """For an in-place call on materialized target: the leaf it updates
    (a leaf that requires grad, written under no_grad: the write pends as
    its successor, tensor.pxi pend_leaf), True for any other value whose
    write is the node alone (no view shares it, it views no other tensor,
    nothing of autograd's or inference mode's refuses the write, laid out
    contiguously), else None: the Python path's checks."""
    if target.value is None or target.family is not None or target.meta.inference:
        return None
    value = target.value
    if value._is_view() or not value.is_contiguous() or value.is_inference():
        return None
    if not target.meta.requires_grad:
        return True
    return written_leaf(target)


cdef object record_inplace(object func, object name, PyObject **args, Py_ssize_t nargs,
                           object kwnames, bint ruled, object leaf=None):
    """An in-place call on a LazyTensor that writes_own_pending (or
    writes_own_value; `leaf`: the leaf it updates): its functional form's
    node recorded from the signature the generic path published under the
    in-place call's flat key (or, on a miss there, its signature key), and
    the target moved onto it; on a miss, handed to the generic path with
    both keys and the tensors (which publishes it)."""
    fast = fast_generic_hit(func, args, nargs, kwnames, ruled)
    if type(fast) is LazyTensor:
        return wrote(name, <LazyTensor>args[0], <LazyTensor>fast, leaf)
    pos, kw = split_arguments(args, nargs, kwnames)
    cdef list tensors = []
    try:
        key = signature_key(func, pos, kw, tensors, ruled,
                            autocast_key_now() if fl_autocast else None)
    except Exception:
        return _hooks.record_call(func, name, pos, kw, True, ruled)
    value = record_by_key(key, tensors, fast)
    if type(value) is LazyTensor:
        return wrote(name, <LazyTensor>pos[0], <LazyTensor>value, leaf)
    return _hooks.record_call(func, name, pos, kw, True, ruled, (key, tensors, fast))


cdef object wrote(object name, LazyTensor target, LazyTensor value, object leaf):
    """target moved onto the node of its written value; what the call
    returns (x[i] = v: None, as eager's __setitem__; else the target).
    A leaf's pending update stays one, and a leaf's write becomes one
    (`leaf`; tensor.pxi pend_leaf)."""
    if leaf is None:
        leaf = target.leaf_of
    adopt(target, value)
    if leaf is not None:
        pend_leaf(target, leaf)
    return None if name.endswith("__setitem__") else target


cdef object record_by_key(object key, list tensors, object fast):
    """The call recorded from the signature published under `key` (its
    `tensors` as signature_key sorted them), or None on a miss.  A hit also
    files the call's flat key `fast`, which missed it (a signature
    published from another call)."""
    found = _generic_hits.get(key)
    cdef GenericHit hit
    cdef Py_ssize_t n = len(tensors)
    if found is None or n > MAX_IN:
        return None
    hit = <GenericHit>found
    out = None
    if hit.returns_input >= 0:
        if hit.returns_input < n:
            out = tensors[hit.returns_input]
            counters[C_GENERIC] += 1
    else:
        out = record_published(hit, tensors)
    if out is not None and fast is not None:
        add_fast_hit(<FastKey>fast, hit)
    return out


def signature_hit(object func, tuple args):
    """(True, the result) where func(*args) -- positional arguments only --
    is recorded from a published signature; else (False, prepared): what
    fastlazy.generic.record takes as `prepared` to analyse the call and
    publish its signature (None where the arguments have none here)."""
    cdef PyObject *vector[MAX_PARAMS]
    cdef Py_ssize_t k, n = len(args)
    if n > MAX_PARAMS:
        return False, None
    for k in range(n):
        vector[k] = PyTuple_GET_ITEM(args, k)
    fast = fast_generic_hit(func, vector, n, None, False)
    if fast is not None and type(fast) is not FastKey:
        return True, fast
    cdef list tensors = []
    try:
        key = signature_key(func, args, {}, tensors, False,
                            autocast_key_now() if fl_autocast else None)
    except Exception:
        return False, None
    out = record_by_key(key, tensors, fast)
    if out is not None:
        return True, out
    return False, (key, tensors, fast)


cdef object record_published(GenericHit hit, list tensors):
    """record_hit of the call's tensors (eager ones wrapped), or None."""
    cdef Operand ops[MAX_IN]
    cdef Py_ssize_t k
    cdef list held = []         # the LazyTensors made here, alive until recorded
    for k in range(len(tensors)):
        v = tensors[k]
        if type(v) is not LazyTensor:
            v = wrap_value(v)
            held.append(v)
        classify(&ops[k], <PyObject*>v)
    return record_hit(hit, ops, len(tensors))


# -- flat keys: the signature of a call from its argument vector --
#
# A call's flat key is a run of int64 words -- a tag per argument and its
# value: an int's value, a float's bits, a LazyTensor's dtype, shape,
# device, requires_grad and view geometry, an eager tensor's the same and
# its strides, a sequence's length -- and the few objects that are not
# numbers (strings, torch.device...), compared by ==.  It tells apart
# everything signature_key does, and is built without a Python object per
# argument; arguments it does not describe (dicts, complex numbers, tensor
# subclasses) leave the call to signature_key.

cdef enum:
    FK_WORDS = 160
    FK_OBJS = 8

cdef enum FastTag:
    FT_INT = 1
    FT_FALSE
    FT_TRUE
    FT_NONE
    FT_ELLIPSIS
    FT_FLOAT
    FT_TUPLE
    FT_LIST
    FT_SIZE
    FT_SLICE
    FT_OBJ
    FT_LAZY
    FT_EAGER
    FT_KW

ctypedef struct FastDesc:
    int nwords
    int nobjs
    int ntensors
    int64_t words[FK_WORDS]
    PyObject *objs[FK_OBJS]     # borrowed: the call's arguments
    Operand ops[MAX_IN]         # the call's tensors, sorted as operands


@cython.final
@cython.no_gc
cdef class FastKey:
    """A call's flat key, kept (a miss's, then a published signature's)."""
    cdef object hash            # the words' and objects' hash, a Python int
    cdef uint64_t h             # the same, in C
    cdef object func
    cdef bytes words
    cdef tuple objs


cdef inline bint put(FastDesc *d, int64_t w) noexcept:
    if d.nwords >= FK_WORDS:
        return False
    d.words[d.nwords] = w
    d.nwords += 1
    return True


cdef inline bint put_obj(FastDesc *d, object x) noexcept:
    cdef PyObject *t = <PyObject*>(<PyObject*>x).ob_type
    if d.nobjs >= FK_OBJS or not put(d, FT_OBJ) or not put(d, <int64_t>t):
        return False
    d.objs[d.nobjs] = <PyObject*>x
    d.nobjs += 1
    return True


cdef int fast_describe(FastDesc *d, object x) except -1:
    """Append x's words to d (its tensors to d.ops); 0: x is not described
    here."""
    cdef type t = type(x)
    cdef int overflow = 0
    cdef int64_t v
    cdef double f
    if t is int:
        v = PyLong_AsLongLongAndOverflow(x, &overflow)
        return not overflow and put(d, FT_INT) and put(d, v)
    if t is LazyTensor:
        return describe_lazy(d, <LazyTensor>x)
    if x is None:
        return put(d, FT_NONE)
    if t is bool:
        return put(d, FT_TRUE if x is True else FT_FALSE)
    if t is tuple or t is list or t is _Size:
        if not put(d, FT_TUPLE if t is tuple else FT_LIST if t is list else FT_SIZE):
            return 0
        if not put(d, len(x)):
            return 0
        for item in x:
            if not fast_describe(d, item):
                return 0
        return 1
    if t is float:
        f = PyFloat_AS_DOUBLE(x)
        memcpy(&v, &f, sizeof(v))
        return put(d, FT_FLOAT) and put(d, v)
    if t is TensorType or t is _Parameter:
        return describe_eager(d, x)
    if t is slice:
        return (put(d, FT_SLICE) and fast_describe(d, (<slice>x).start)
                and fast_describe(d, (<slice>x).stop) and fast_describe(d, (<slice>x).step))
    if x is Ellipsis:
        return put(d, FT_ELLIPSIS)
    if (t is str or t is _dtype_type or t is _device_type or t is _layout_type
            or t is _memory_format_type):
        return put_obj(d, x)
    return 0


cdef int describe_lazy(FastDesc *d, LazyTensor lt) except -1:
    cdef int grad = lt.meta.requires_grad != 0
    cdef int kind = 0, i
    cdef Member where = None
    cdef Operand *o
    if d.ntensors >= MAX_IN or d.nwords + 2 * MAX_NDIM + 4 > FK_WORDS:
        return 0
    if lt.value is not None:
        grad = (tensor_get(_get_requires_grad, lt.value) if _fast_eager
                else lt.value.requires_grad) is True
    if lt.family is not None:
        kind = 1
        if type(lt.family) is Member:
            kind = 3 if is_held(lt) else 2
            where = <Member>lt.family
    put(d, FT_LAZY | (<int64_t>(lt.meta.dtype & 0xff) << 8) | (<int64_t>lt.meta.ndim << 16)
        | (<int64_t>(lt.meta.device & 0xff) << 24) | (<int64_t>grad << 32)
        | (<int64_t>kind << 40))
    for i in range(lt.meta.ndim):
        put(d, lt.meta.shape[i])
    if where is not None:
        if kind == 2:
            put(d, root_numel_as(where, lt.meta.dtype))
            put(d, where.offset)
        put(d, where.ndim)
        for i in range(where.ndim):
            put(d, where.stride_[i])
    o = &d.ops[d.ntensors]
    o.kind = K_LAZY
    o.obj = <PyObject*>lt
    o.m = &lt.meta
    d.ntensors += 1
    return 1


cdef int describe_eager(FastDesc *d, object x) except -1:
    """An eager tensor's words, read once: they describe the operand too."""
    cdef Operand *o
    cdef int i, nd
    cdef int64_t strides[MAX_NDIM]
    if d.ntensors >= MAX_IN or d.nwords + 2 * MAX_NDIM + 1 > FK_WORDS:
        return 0
    o = &d.ops[d.ntensors]
    o.version = VERSION_UNREAD
    nd = FL_UNREAD
    if read_tensor != NULL:
        nd = eager_by_reader(o, x, strides)
    if nd == FL_UNREAD:
        nd = eager_by_getters(o, x, strides) if _fast_eager else 0
    if nd < 0:
        return 0
    o.kind = K_TENSOR
    o.obj = <PyObject*>x
    o.m = &o.own
    put(d, FT_EAGER | (<int64_t>o.own.dtype << 8) | (<int64_t>nd << 16)
        | (<int64_t>o.own.device << 24) | (<int64_t>o.own.requires_grad << 32))
    for i in range(nd):
        put(d, o.own.shape[i])
    for i in range(nd):
        put(d, strides[i])
    d.ntensors += 1
    return 1


def eager_operand_facts(x):
    """What the flat key reads of the eager tensor x, with the reader now
    installed: (dtype, sizes, strides, device code, requires_grad), or None
    where x has no flat key.  For tests."""
    cdef FastDesc d
    d.nwords = d.nobjs = d.ntensors = 0
    if not (type(x) is TensorType or type(x) is _Parameter) or not describe_eager(&d, x):
        return None
    cdef Operand *o = &d.ops[0]
    cdef int nd = o.own.ndim
    words = [d.words[i] for i in range(1, 1 + 2 * nd)]
    return (DTYPES[o.own.dtype], tuple(words[:nd]), tuple(words[nd:]), o.own.device,
            bool(o.own.requires_grad))


cdef int eager_by_reader(Operand *o, object x, int64_t *strides) except -100:
    """describe_eager's reading of x through the C++ reader: its rank with
    o.own and `strides` filled; FL_UNREAD where the reader cannot answer,
    NOT_DESCRIBED where x has no flat key."""
    cdef int strided
    cdef int nd = meta_by_reader(&o.own, x, strides, &strided, &o.version)
    if nd >= 0 and not strided:
        return NOT_DESCRIBED    # sparse, mkldnn: signature_key decides
    return nd


cdef int eager_by_getters(Operand *o, object x, int64_t *strides) except -100:
    """eager_by_reader through torch.Tensor's getters."""
    cdef Py_ssize_t nd, i
    if tensor_get(_get_layout, x) is not _strided:
        return NOT_DESCRIBED
    code = dtype_code(tensor_get(_get_dtype, x))
    if code == DT_UNDEF:
        return NOT_DESCRIBED
    shape = tensor_get(_get_shape, x)
    nd = PyTuple_GET_SIZE(shape)
    if nd > MAX_NDIM:
        return NOT_DESCRIBED
    if tensor_get(_get_is_cpu, x) is True:
        o.own.device = 0
    elif tensor_get(_get_is_cuda, x) is True:
        o.own.device = 1 + x.get_device()
    else:
        return NOT_DESCRIBED      # mps, meta, xpu...: signature_key decides
    stride = _tensor_stride(x)
    if PyTuple_GET_SIZE(stride) != nd:
        return NOT_DESCRIBED
    for i in range(nd):
        o.own.shape[i] = <object>PyTuple_GET_ITEM(shape, i)
        strides[i] = <object>PyTuple_GET_ITEM(stride, i)
    o.own.dtype = code
    o.own.ndim = nd
    o.own.requires_grad = tensor_get(_get_requires_grad, x) is True
    return nd


cdef uint64_t fast_hash(FastDesc *d, object func) except? 0:
    cdef uint64_t h = mix(0x9E3779B97F4A7C15ULL, <uint64_t><PyObject*>func)
    cdef int i
    for i in range(d.nwords):
        h = mix(h, <uint64_t>d.words[i])
    for i in range(d.nobjs):
        h = mix(h, <uint64_t>PyObject_Hash(<object>d.objs[i]))
    return h | 1


cdef bint fast_matches(FastKey key, FastDesc *d, object func) except -1:
    cdef Py_ssize_t nbytes = d.nwords * sizeof(int64_t)
    if key.func is not func or len(key.words) != nbytes or len(key.objs) != d.nobjs:
        return False
    if memcmp(<char*>key.words, d.words, nbytes) != 0:
        return False
    for i in range(d.nobjs):
        if not PyObject_RichCompareBool(<object>PyTuple_GET_ITEM(key.objs, i),
                                        <object>d.objs[i], 2):
            return False
    return True


cdef object fast_generic_hit(object func, PyObject **args, Py_ssize_t nargs, object kwnames,
                             bint ruled):
    """The result of recording the call from a published signature, found
    by its flat key; on a miss, the FastKey to publish it under; None if
    the arguments have no flat key."""
    cdef FastDesc d
    cdef Py_ssize_t i, nk = 0
    d.nwords = 0
    d.nobjs = 0
    d.ntensors = 0
    if fl_autocast:
        autocast_key_now()      # (its id: _autocast_word)
    put(&d, ruled | (<int64_t>grad_enabled() << 1) | (<int64_t>nargs << 2)
        | ((_autocast_word if fl_autocast else 0) << 32))
    for i in range(nargs):
        if not fast_describe(&d, <object>args[i]):
            return None
    if kwnames is not None:
        nk = PyTuple_GET_SIZE(kwnames)
        for i in range(nk):
            if not put(&d, FT_KW) or not put_obj(&d, <object>PyTuple_GET_ITEM(kwnames, i)):
                return None
            if not fast_describe(&d, <object>args[nargs + i]):
                return None
    cdef uint64_t h = fast_hash(&d, func)
    cdef GenericHit hit
    cdef PyObject *cached = _hit_cache[h & (HIT_CACHE - 1)]
    if cached != NULL:
        hit = <GenericHit>cached
        if hit.key.h == h and fast_matches(hit.key, &d, func):
            out = record_hit(hit, d.ops, d.ntensors)
            if out is not None:
                return out
    hashed = h
    found = _fast_hits.get(hashed)
    while found is not None:
        hit = <GenericHit>found
        if fast_matches(hit.key, &d, func):
            _hit_cache[h & (HIT_CACHE - 1)] = <PyObject*>hit
            out = record_hit(hit, d.ops, d.ntensors)
            if out is not None:
                return out
            break
        found = hit.next
    cdef FastKey key = FastKey.__new__(FastKey)
    key.hash = hashed
    key.h = h
    key.func = func
    key.words = (<char*>d.words)[:d.nwords * sizeof(int64_t)]
    key.objs = tuple([<object>d.objs[i] for i in range(d.nobjs)])
    return key

def adopt(LazyTensor target, LazyTensor source):
    """Move target onto source's node (or value), leaving source empty: how
    a view or its base is rebound to the node that recomputes it after a
    write through another view."""
    if target is source:
        return
    cdef Segment seg = source.seg
    cdef int8_t inference
    if seg is not None and seg.state == SEG_RECORDING:
        # an in-place write or a view's refresh: target stays an inference
        # tensor or not, as it was
        inference = is_inference(target) if fl_inference_hint else 0
        # the node gets its new owner before target lets its old node go,
        # so dropping that one can never drop this one
        seg.nodes[source.idx].owner = <PyObject*>target
        source.seg = None
        memcpy(&target.meta, &source.meta, sizeof(Meta))
        target.meta.inference = inference
        seg.nodes[source.idx].meta.inference = inference
        target._device = None
        retarget(target, seg, source.idx)
    else:
        value = materialize(source)
        memcpy(&target.meta, &source.meta, sizeof(Meta))
        target._device = None
        detach_handle(target, value)


cdef bint eager_words(object x, list parts) except -1:
    """signature_key's entry for a plain eager tensor as the C++ reader
    reads it: dtype code, sizes, strides, device code, requires_grad (a
    quarter of the attribute reads' cost: the 19 tensors of a 2-layer
    bidirectional LSTM's call keyed in 4.3 against 18 us); False where the
    reader cannot answer (a sparse tensor: the attribute reads then
    decide)."""
    cdef Operand o
    cdef int64_t strides[MAX_NDIM]
    cdef int nd = eager_by_reader(&o, x, strides), i
    cdef object v           # (an object: the tuples steal the references taken)
    if nd < 0:
        return False
    shape = PyTuple_New(nd)
    stride = PyTuple_New(nd)
    for i in range(nd):
        v = o.own.shape[i]
        Py_INCREF(v)
        PyTuple_SET_ITEM(shape, i, v)
        v = strides[i]
        Py_INCREF(v)
        PyTuple_SET_ITEM(stride, i, v)
    parts.append(("eager", o.own.dtype, shape, stride, o.own.device, o.own.requires_grad != 0))
    return True


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
        elif is_held(lt):
            # keyed by its layout alone: a result that views it is placed
            # relative to it (record_result, views.attach_result)
            parts.append((lt.meta.dtype, shape, lt.meta.device, grad, (<Member>lt.family).stride))
        else:
            parts.append((lt.meta.dtype, shape, lt.meta.device, grad, geometry(x)))
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
    elif (t is TensorType or t is _Parameter) and read_tensor != NULL and eager_words(x, parts):
        tensors.append(x)
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
