# LazyTensor: a handle on a recorded node or on a materialized value, and
# the installers that give it torch.Tensor's methods (called by the boot).

from cpython.list cimport PyList_GET_ITEM

cdef dict _torch_function_table = {}  # original torch callable -> Entry
# torch functions answered from a LazyTensor's metadata: through the generic
# path they would return a bool, which is not recordable, and materialize
# the value for a question about its dtype (torch.masked's ops ask)
cdef dict _metadata_queries = {}

# Python operators: LazyTensor's number and comparison slots dispatch through
# the entries of the op-table rows that claim these names.
cdef enum Dunder:
    D_ADD, D_RADD, D_IADD, D_SUB, D_RSUB, D_ISUB, D_MUL, D_RMUL, D_IMUL,
    D_TRUEDIV, D_RTRUEDIV, D_ITRUEDIV, D_POW, D_RPOW, D_IPOW,
    D_NEG, D_ABS, D_EQ, D_NE, D_LT, D_LE, D_GT, D_GE, D_MATMUL, D_COUNT

DUNDER_NAMES = ("__add__", "__radd__", "__iadd__", "__sub__", "__rsub__",
                "__isub__", "__mul__", "__rmul__", "__imul__", "__truediv__",
                "__rtruediv__", "__itruediv__", "__pow__", "__rpow__",
                "__ipow__", "__neg__", "__abs__", "__eq__", "__ne__", "__lt__",
                "__le__", "__gt__", "__ge__", "__matmul__")
cdef list _dunder_entries = [None] * D_COUNT


cdef inline object call_dunder(int d, object a, object b, Py_ssize_t nargs=2):
    cdef object e = <object>PyList_GET_ITEM(_dunder_entries, d)
    if e is None:
        return NotImplemented
    cdef PyObject *argv[2]
    argv[0] = <PyObject*>a
    argv[1] = <PyObject*>b
    return lazy_call(e, argv, nargs, None)


cdef object python_operator(str name, str qualname, LazyTensor self, tuple args,
                            bint inplace):
    """torch.Tensor's operator `name` with self a LazyTensor: recorded by the
    generic path, or run eagerly.  A signature recorded before (`mask & m`,
    `~mask`, `ids // n`, `ids % n`: HuggingFace's generate calls these per
    token) is recorded from its flat key, as an entry's call is
    (dispatch.pxi call_generic), without Python."""
    cdef PyObject *argv[3]
    cdef Py_ssize_t i
    func = getattr(TensorType, name)
    if (fl_saved_hooks or fl_dual_levels) and eager_only_now() or len(args) > 2:
        return _hooks.record_call(func, qualname, (self,) + args, {}, inplace, False)
    argv[0] = <PyObject*>self
    for i in range(len(args)):
        argv[1 + i] = <PyObject*>args[i]
    if inplace and writes_own_pending(self):
        # x[i] = v on a pending result: from its published signature too
        return record_inplace(func, qualname, argv, 1 + len(args), None, False)
    if inplace or len(args) > 1:
        return _hooks.record_call(func, qualname, (self,) + args, {}, inplace, False)
    fast = fast_generic_hit(func, argv, 1 + len(args), None, False)
    if fast is not None and type(fast) is not FastKey:
        return fast
    return record_by_signature(func, qualname, (self,) + args, {}, False, fast)


cdef object getitem(LazyTensor self, object idx):
    """self[idx]: a published signature is recorded from its flat key, as
    an entry's call is (dispatch.pxi call_generic); else the generic path."""
    cdef PyObject *argv[2]
    func = getattr(TensorType, "__getitem__")
    if not fl_autocast:
        # basic indexing: the view rules' steps (view_rules.pxi)
        found = getitem_view(self, idx)
        if found is not None:
            return found
    argv[0] = <PyObject*>self
    argv[1] = <PyObject*>idx
    fast = fast_generic_hit(func, argv, 2, None, False)
    if fast is not None and type(fast) is not FastKey:
        return fast
    return record_by_signature(func, "Tensor.__getitem__", (self, idx), {}, False, fast)


cdef inline void set_value(LazyTensor t, object value) noexcept:
    """t holds `value` from now on: it joins the cycle collector (a value's
    attributes or hooks may refer back to it)."""
    t.value = value
    if t.leaf_of is not None:
        take_leaf(t, value)
    if t.retains_grad:
        retain_grad_of(value)
    if not PyObject_GC_IsTracked(<PyObject*>t):
        PyObject_GC_Track(<PyObject*>t)


# A leaf that requires grad, written under no_grad (an optimizer's step,
# `with torch.no_grad(): p -= lr * p.grad`), stays a leaf that requires
# grad in eager.  The write is recorded like any other: the handle holds
# the update's node, computed without history, and `leaf_of` the leaf it
# updates, whose gradient and hooks its value takes when the graph runs.
# Until then it answers as that leaf (requires_grad, is_leaf, grad), and an
# op recorded with grad enabled computes it first (segment.pxi record), so
# that autograd's leaf is the updated value: every parameter's update of a
# step runs in one graph, at the first read.

def leaf_of(LazyTensor t):
    """The eager leaf whose pending update t holds, or None."""
    return t.leaf_of


cdef object written_leaf(LazyTensor t):
    """With grad mode off, the leaf that requires grad a write to t
    continues: the one whose pending update t holds, or t's value if it is
    such a leaf.  Else (or with grad mode on) None."""
    if grad_enabled():
        return None
    if t.leaf_of is not None:
        return t.leaf_of
    value = t.value
    if value is not None and value.requires_grad and value.is_leaf:
        return value
    return None


def leaf_written(LazyTensor t):
    """written_leaf, for the Python write paths (fastlazy.mutation)."""
    return written_leaf(t)


def pend_leaf(LazyTensor t, leaf):
    """t, just rebound to the node of an update of `leaf` (an eager leaf
    that requires grad) recorded under no_grad, becomes that leaf's
    successor: pending, it answers as a leaf that requires grad; its value
    becomes one, with leaf's gradient and hooks."""
    t.leaf_of = leaf
    if t.value is not None:
        take_leaf(t, t.value)
        return
    t.meta.requires_grad = 1
    if not PyObject_GC_IsTracked(<PyObject*>t):
        PyObject_GC_Track(<PyObject*>t)


cdef void take_leaf(LazyTensor t, object value) noexcept:
    """value, t's update of t.leaf_of computed without history, becomes
    the leaf (fastlazy.leaves.succeed)."""
    leaf, t.leaf_of = t.leaf_of, None
    try:
        if value.grad_fn is not None:
            value = value.detach()
            t.value = value
        _hooks.succeed_leaf(value, leaf)
    except BaseException:
        # (cannot happen to a float update computed under no_grad; were it
        # to, the error is shown rather than lost)
        PyErr_WriteUnraisable(t)


cdef void retain_grad_of(object value) noexcept:
    """value.retain_grad() where it has a grad_fn (a leaf keeps its grad
    anyway; a value computed without grad has none to keep)."""
    try:
        if value.grad_fn is not None:
            value.retain_grad()
    except Exception:       # (an inference tensor: no history to retain)
        pass


def retain_grad(LazyTensor t):
    """Tensor.retain_grad() of t: of its value now, and of every value an
    in-place op gives it from now on."""
    materialize(t).retain_grad()       # (eager's error for one without grad)
    t.retains_grad = True


cdef void track_all(list handles) noexcept:
    for h in handles:
        if not PyObject_GC_IsTracked(<PyObject*>h):
            PyObject_GC_Track(<PyObject*>h)


cdef void detach_handle(LazyTensor t, object value) noexcept:
    # The handle leaves its node and holds `value` (an in-place op run
    # eagerly; a value computed apart from its segment's run).  It is
    # whole before its old node is dropped: dropping may run finalizers
    # (Segment.kill), which may read it.
    cdef Segment old = t.seg
    cdef int32_t idx = t.idx
    t.seg = None
    t.slot_epoch = 0
    previous = t.value
    set_value(t, value)
    leave_node(old, idx, t)


cdef object materialize(LazyTensor t):
    cdef int rebound = 0
    if t.value is None:
        counters[C_MATERIALIZATIONS] += 1
        run_segment_for(t)
        # Python the flush ran (a finalizer, weakref callback or signal
        # handler) may have written t in place: t then holds a node of a
        # newer segment, computed in turn
        while t.value is None:
            rebound += 1
            if rebound > 100:
                raise RuntimeError(
                    "fastlazy: this LazyTensor was written in place by a callback each "
                    "time its value was computed (100 times); read it where no "
                    "finalizer or signal handler writes it")
            run_segment_for(t)
    return t.value


cdef LazyTensor try_wrap(object value):
    """A materialized LazyTensor around an eager tensor (no copy), or None
    if its dtype, rank or device is one LazyTensor cannot describe."""
    cdef LazyTensor t = LazyTensor.__new__(LazyTensor)
    if not meta_from_tensor(&t.meta, value):
        return None
    t.value = value
    return t


cdef int raise_cannot_hold(object value) except -1:
    raise TypeError(
        f"fastlazy cannot hold a tensor of dtype {value.dtype}, "
        f"{value.dim()} dims on {value.device}; keep it eager")


cdef LazyTensor wrap_value(object value):
    cdef LazyTensor t = try_wrap(value)
    if t is None:
        raise_cannot_hold(value)
    return t


# torch's C++ takes any object that isinstance() calls a torch.Tensor for a
# THPVariable, and its argument parser reads such an argument's at::Tensor
# where a signature allows a 0-dim tensor for a number (torch.remainder(x,
# 3) tries remainder(Scalar self, Tensor other) first; torch.full's
# fill_value): a LazyTensor there was memory read as a tensor, a crash.  So
# a LazyTensor's first words are those of a stand-in tensor's THPVariable:
# an empty 1-d meta tensor, which no number parameter takes (it is not
# 0-dim), so the parser goes on to the signature whose Tensor parameter
# hands the call to LazyTensor.__torch_function__, or raises its TypeError.
# C++ that computes with it without asking __torch_function__ first reaches
# its __torch_dispatch__, which raises: never a silent empty result.
class _StandIn(torch.Tensor):
    @staticmethod
    def __new__(cls):
        return torch.Tensor._make_wrapper_subclass(cls, (0,), dtype=torch.float32,
                                                   device="meta")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(
            f"fastlazy: a LazyTensor reached torch C++ code that does not hand it to "
            f"__torch_function__ (it called {func}); pass x.to_eager() there instead")

    __torch_function__ = torch._C._disabled_torch_function_impl


cdef object _STANDIN = _StandIn()
cdef void *_standin_words[2]
memcpy(_standin_words, (<char *><PyObject *>_STANDIN) + sizeof(PyObject), sizeof(_standin_words))


cdef int size_dim(LazyTensor t, dim) except -1:
    cdef long long d
    cdef int nd = t.meta.ndim
    # eager's parser takes an int, or an object with __index__ (an
    # integer 0-dim tensor), never a float
    dim = _operator_index(dim)
    try:
        d = dim
    except OverflowError:
        # eager's exception for a dim beyond 64 bits
        raise ValueError("Overflow when unpacking long long") from None
    if nd == 0:
        nd = 1
    if d < -nd or d >= nd:
        raise IndexError(f"Dimension out of range (expected to be in range of "
                         f"[{-nd}, {nd - 1}], but got {d})")
    return d + nd if d < 0 else d


from copy import deepcopy as _deepcopy


cdef extern from "Python.h":
    int PyObject_GenericSetAttr(object o, object name, PyObject *value) except -1


@cython.final
cdef class UserAttribute:
    """An attribute name user code set on some LazyTensor: each instance
    holds its own value (or has none, and reading it raises eager's
    AttributeError)."""
    cdef str name

    def __cinit__(self, str name):
        self.name = name

    def __get__(self, obj, owner):
        if obj is None:
            return self
        attributes = (<LazyTensor>obj).attributes
        if attributes is None or self.name not in attributes:
            raise AttributeError(f"'LazyTensor' object has no attribute '{self.name}'")
        return attributes[self.name]

    def __set__(self, obj, value):
        cdef LazyTensor t = <LazyTensor>obj
        if t.attributes is None:
            t.attributes = {}
        t.attributes[self.name] = value

    def __delete__(self, obj):
        attributes = (<LazyTensor>obj).attributes
        if attributes is None or self.name not in attributes:
            raise AttributeError(self.name)
        del attributes[self.name]


# In the cycle collector: user code makes cycles through LazyTensors (its
# value's attributes, a hook closing over it, a failed flush's traceback).
# Never cleared by it (no_gc_clear): a node's owner pointer must stay valid
# until the LazyTensor is freed; the other members of a cycle break it.
# Pending handles stay out of it until they hold a value or attributes
# (handle_alloc.h, set_value); its free list replaces Cython's.
@cython.final
@cython.no_gc_clear
cdef class LazyTensor:
    """A tensor whose value is computed when it is needed.

    Made by ``fastlazy.lazy(t)``, ``t.to("lazy")`` or by any recorded op on a
    LazyTensor.  Shape, dtype and device are known at once; reading a value
    (``to_eager()``, ``item()``, ``print``...) runs the pending graph once and
    keeps the result.
    """

    def __cinit__(self):
        self.variable_words[0] = _standin_words[0]
        self.variable_words[1] = _standin_words[1]

    def __init__(self, *args, **kwargs):
        raise TypeError("LazyTensor is made by fastlazy.lazy(tensor) or "
                        "tensor.to('lazy'), not constructed directly")

    # Attributes of its own (t.tag = 1; torch._dynamo.mark_static_address,
    # which HuggingFace's recurrent caches call), as an eager tensor takes
    # them.  Not in an instance __dict__: a type with one loses CPython's
    # specialized method calls (x.add(y) about 15 ns slower).  Each name
    # set becomes a data descriptor of the type (UserAttribute) reading the
    # instance's own `attributes`.
    def __setattr__(self, str name, value):
        cdef PyTypeObject *tp
        if not hasattr(LazyTensor, name):
            tp = <PyTypeObject*>LazyTensor
            (<dict>tp.tp_dict)[name] = UserAttribute(name)
            PyType_Modified(tp)
        PyObject_GenericSetAttr(self, name, <PyObject*>value)
        # an attribute may close a cycle (t.me = t): a pending handle joins
        # the cycle collector as one holding a value does
        if not PyObject_GC_IsTracked(<PyObject*>self):
            PyObject_GC_Track(<PyObject*>self)

    def __delattr__(self, str name):
        PyObject_GenericSetAttr(self, name, NULL)

    def __dealloc__(self):
        leave_node(self.seg, self.idx, self)

    # -- metadata, known without running anything --

    @property
    def shape(self):
        return _Size([self.meta.shape[i] for i in range(self.meta.ndim)])

    def size(self, dim=None):
        if dim is None:
            return self.shape
        return self.meta.shape[size_dim(self, dim)]

    @property
    def dtype(self):
        return DTYPES[self.meta.dtype]

    @property
    def device(self):
        if self._device is None:
            self._device = (_device_type("cpu") if self.meta.device == 0
                            else _device_type("cuda", self.meta.device - 1))
        return self._device

    @property
    def ndim(self):
        return self.meta.ndim

    def dim(self):
        return self.meta.ndim

    def numel(self):
        cdef int64_t n = 1
        for i in range(self.meta.ndim):
            n *= self.meta.shape[i]
        return n

    nelement = numel

    @property
    def requires_grad(self):
        if self.value is not None:
            return self.value.requires_grad
        return bool(self.meta.requires_grad)

    @requires_grad.setter
    def requires_grad(self, value):
        if type(value) is not bool:
            raise RuntimeError("requires_grad must be a bool")
        self.requires_grad_(value)

    @property
    def is_lazy(self):
        return True

    # Metadata a library reads to choose a code path (nn.MultiheadAttention
    # reads is_nested on every call): answered from what is known, so
    # reading it never runs the graph.  A pending value is always a dense,
    # strided tensor on a CPU or CUDA device; a materialized one answers
    # for itself.

    @property
    def is_cpu(self):
        return self.meta.device == 0

    @property
    def layout(self):
        return _torch.strided if self.value is None else self.value.layout

    @property
    def is_nested(self):
        return False if self.value is None else self.value.is_nested

    @property
    def is_sparse(self):
        return False if self.value is None else self.value.is_sparse

    @property
    def is_sparse_csr(self):
        return False if self.value is None else self.value.is_sparse_csr

    @property
    def is_quantized(self):
        return False if self.value is None else self.value.is_quantized

    @property
    def is_meta(self):
        return False if self.value is None else self.value.is_meta

    @property
    def is_mkldnn(self):
        return False if self.value is None else self.value.is_mkldnn

    @property
    def itemsize(self):
        return self.dtype.itemsize

    @property
    def nbytes(self):
        return self.numel() * self.dtype.itemsize

    @property
    def is_leaf(self):
        # A pending result that requires grad is an op's output with a
        # grad_fn; one that does not is a leaf, as in eager.
        if self.value is not None:
            return self.value.is_leaf
        return self.leaf_of is not None or not self.meta.requires_grad

    @property
    def grad_fn(self):
        if self.value is None and (not self.meta.requires_grad or self.leaf_of is not None):
            return None
        return materialize(self).grad_fn

    @property
    def __class__(self):
        # Libraries branch on isinstance(x, torch.Tensor) and torch.is_tensor(x);
        # isinstance consults __class__ when type(x) is not a subclass, so
        # both answer True while type(x) stays LazyTensor and the core's
        # checks (type(x) is LazyTensor, in C) pay nothing.
        return TensorType

    @property
    def is_cuda(self):
        return self.meta.device > 0

    def is_inference(self):
        return bool(is_inference(self))

    @property
    def is_materialized(self):
        """True once the value has been computed (reading it is free)."""
        return self.value is not None

    def is_floating_point(self):
        return is_float(self.meta.dtype)

    def is_complex(self):
        return is_complex(self.meta.dtype)

    def is_signed(self):
        return self.dtype.is_signed

    def element_size(self):
        return self.dtype.itemsize

    def __len__(self):
        if self.meta.ndim == 0:
            raise TypeError("len() of a 0-d tensor")
        return self.meta.shape[0]

    # -- value reads: materialize once, keep the result --

    def to_eager(self):
        """The value as an ordinary torch.Tensor (computed once, then kept)."""
        return materialize(self)

    def cpu(self):
        return materialize(self).cpu()

    def numpy(self, *, force=False):
        return materialize(self).numpy(force=force)

    def item(self):
        return materialize(self).item()

    def tolist(self):
        return materialize(self).tolist()

    def backward(self, gradient=None, retain_graph=None, create_graph=False, inputs=None):
        """Eager autograd from the value: reading it runs the pending graph,
        whose outputs carry grad_fn back to the eager leaves.  Its large
        CPU buffers come from fastlazy.cpu_pool."""
        if type(gradient) is LazyTensor:
            gradient = materialize(gradient)
        value = materialize(self)
        with _hooks.backward_scope():
            value.backward(gradient, retain_graph, create_graph, inputs)

    def __repr__(self):
        text = repr(materialize(self))
        return "LazyTensor" + text[len("tensor"):] if text.startswith("tensor") else text

    def __format__(self, spec):
        return materialize(self).__format__(spec)

    def __bool__(self):
        return bool(materialize(self))

    def __float__(self):
        return float(materialize(self))

    def __int__(self):
        return int(materialize(self))

    def __index__(self):
        return materialize(self).__index__()

    def __complex__(self):
        return complex(materialize(self))

    def __iter__(self):
        return iter([wrap_value(v) for v in materialize(self)])

    def __array__(self, dtype=None, copy=None):
        a = materialize(self).numpy()
        return a if dtype is None else a.astype(dtype)

    def __dlpack__(self, *args, **kwargs):
        # the value's memory, handed out as eager's is (watch.py sees it)
        return materialize(self).__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return materialize(self).__dlpack_device__()

    def __hash__(self):
        return id(self)

    def __reversed__(self):
        # torch.Tensor.__reversed__: the tensor flipped along dim 0, a
        # 0-dim one itself
        return self if self.meta.ndim == 0 else self.flip(0)

    def __reduce_ex__(self, proto):
        # Saved as its value, a plain tensor: the graph is not part of a
        # tensor's state, and a checkpoint must load without fastlazy
        # (torch.load's default weights_only=True allows only torch's types).
        return materialize(self).__reduce_ex__(proto)

    def __copy__(self):
        # eager's copy.copy: a new tensor over the same memory (writes
        # through either show in both, a shape change does not), no view
        # and no autograd history: a leaf, requiring grad as the original
        t = self.detach()
        if self.meta.requires_grad:
            t.requires_grad_()
        return t

    def __deepcopy__(self, memo):
        # a LazyTensor of a copy of the value (copies stay lazy, as the
        # results of every other op on a LazyTensor do)
        cdef LazyTensor t = wrap_value(materialize(self).__deepcopy__(memo))
        if self.attributes:
            t.attributes = _deepcopy(self.attributes, memo)
        return t

    def to(self, *args, **kwargs):
        # x.to(its own dtype) is x itself, as in eager: no signature to analyse
        if (len(args) == 1 and not kwargs and type(args[0]) is _dtype_type
                and dtype_code(args[0]) == self.meta.dtype):
            return self
        return _hooks.tensor_to(self, args, kwargs)

    # -- Python operators: the op table's entries --

    def __add__(self, other): return call_dunder(D_ADD, self, other)
    def __radd__(self, other): return call_dunder(D_RADD, self, other)
    def __iadd__(self, other): return call_dunder(D_IADD, self, other)
    def __sub__(self, other): return call_dunder(D_SUB, self, other)
    def __rsub__(self, other): return call_dunder(D_RSUB, self, other)
    def __isub__(self, other): return call_dunder(D_ISUB, self, other)
    def __mul__(self, other): return call_dunder(D_MUL, self, other)
    def __rmul__(self, other): return call_dunder(D_RMUL, self, other)
    def __imul__(self, other): return call_dunder(D_IMUL, self, other)
    def __truediv__(self, other): return call_dunder(D_TRUEDIV, self, other)
    def __rtruediv__(self, other): return call_dunder(D_RTRUEDIV, self, other)
    def __itruediv__(self, other): return call_dunder(D_ITRUEDIV, self, other)
    def __pow__(self, other, mod):
        if mod is not None:
            return NotImplemented
        return call_dunder(D_POW, self, other)
    def __rpow__(self, other, mod):
        if mod is not None:
            return NotImplemented
        return call_dunder(D_RPOW, self, other)
    def __ipow__(self, other): return call_dunder(D_IPOW, self, other)
    def __matmul__(self, other): return call_dunder(D_MATMUL, self, other)
    def __neg__(self): return call_dunder(D_NEG, self, None, 1)
    def __abs__(self): return call_dunder(D_ABS, self, None, 1)

    def __richcmp__(self, other, int cmp):
        return call_dunder((D_LT, D_LE, D_EQ, D_NE, D_GT, D_GE)[cmp], self, other)

    # -- operators without a row: torch.Tensor's own, on the generic path --

    def __getitem__(self, idx):
        return getitem(self, index_as_tuple(idx))
    def __setitem__(self, idx, value):
        python_operator("__setitem__", "__setitem__", self, (index_as_tuple(idx), value), True)
    def __rmatmul__(self, other): return python_operator("__rmatmul__", "__rmatmul__", self, (other,), False)
    def __floordiv__(self, other): return python_operator("__floordiv__", "__floordiv__", self, (other,), False)
    def __rfloordiv__(self, other): return python_operator("__rfloordiv__", "__rfloordiv__", self, (other,), False)
    def __mod__(self, other): return python_operator("__mod__", "__mod__", self, (other,), False)
    def __rmod__(self, other): return python_operator("__rmod__", "__rmod__", self, (other,), False)
    def __and__(self, other): return python_operator("__and__", "__and__", self, (other,), False)
    def __rand__(self, other): return python_operator("__rand__", "__rand__", self, (other,), False)
    def __or__(self, other): return python_operator("__or__", "__or__", self, (other,), False)
    def __ror__(self, other): return python_operator("__ror__", "__ror__", self, (other,), False)
    def __xor__(self, other): return python_operator("__xor__", "__xor__", self, (other,), False)
    def __rxor__(self, other): return python_operator("__rxor__", "__rxor__", self, (other,), False)
    def __lshift__(self, other): return python_operator("__lshift__", "__lshift__", self, (other,), False)
    def __rshift__(self, other): return python_operator("__rshift__", "__rshift__", self, (other,), False)
    def __rlshift__(self, other): return python_operator("__rlshift__", "__rlshift__", self, (other,), False)
    def __rrshift__(self, other): return python_operator("__rrshift__", "__rrshift__", self, (other,), False)
    # in place, as eager: `x &= m` writes x (its views and base see it)
    def __iand__(self, other): return python_operator("__iand__", "__iand__", self, (other,), True)
    def __ior__(self, other): return python_operator("__ior__", "__ior__", self, (other,), True)
    def __ixor__(self, other): return python_operator("__ixor__", "__ixor__", self, (other,), True)
    def __ilshift__(self, other): return python_operator("__ilshift__", "__ilshift__", self, (other,), True)
    def __irshift__(self, other): return python_operator("__irshift__", "__irshift__", self, (other,), True)
    def __ifloordiv__(self, other): return python_operator("__ifloordiv__", "__ifloordiv__", self, (other,), True)
    def __imod__(self, other): return python_operator("__imod__", "__imod__", self, (other,), True)
    def __invert__(self): return python_operator("__invert__", "__invert__", self, (), False)
    def __pos__(self): return python_operator("__pos__", "__pos__", self, (), False)
    def __contains__(self, item): return python_operator("__contains__", "__contains__", self, (item,), False)

    # -- every other torch function --

    # dynamo (torch.compile) reads this off a tensor's type to tell plain
    # tensors and traceable subclasses, which it traces, from the rest: a
    # LazyTensor is neither (torch never dispatches to it: its stand-in's
    # raises), so a compiled function called with one is not traced.
    __torch_dispatch__ = _StandIn.__torch_dispatch__

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        query = _metadata_queries.get(func)
        if query is not None and len(args) == 1 and not kwargs and type(args[0]) is LazyTensor:
            return query(args[0])
        entry = _torch_function_table.get(func)
        if kwargs is None:
            kwargs = {}
        if entry is None and type(func) is _entry_type:
            # torch.nn.functional's Python functions hand themselves to
            # handle_torch_function by module-global name, which enable()
            # has pointed at our entry: it takes lazy arguments itself
            entry = func
        if entry is not None:
            if fl_entry_op(entry) >= 0 and op_rule[fl_entry_op(entry)] == R_CAT:
                # its LazyTensors sit inside a list, where the entry does
                # not look: its rule is called here
                return call_row(entry, args, kwargs)
            if fl_entry_op(entry) >= 0 and op_rule[fl_entry_op(entry)] != R_GENERIC:
                return entry(*args, **kwargs)
            # a generic row: its LazyTensors may sit inside a list (torch.cat),
            # where the entry does not look, so take the generic path here --
            # through the core's signature hits, as the entry would
            if fl_entry_form(entry) != FORM_INPLACE and fl_entry_form(entry) != FORM_WATCH_INPLACE:
                return generic_call_of(entry, args, kwargs)
            # (a write: torch._C._nn.elu_, whose builtin hands __torch_function__
            # the watch entry enable() put in its module, returns x itself)
            func = entry.__wrapped__
        name = getattr(func, "__name__", None) or repr(func)
        # (an aten overload names its overload after the op's name:
        # torch.ops.aten.mul_.Scalar is "mul_.Scalar", a write as mul_ is)
        base = name.partition(".")[0] if type(func) is _op_overload_type else name
        if base.endswith("_") and not base.endswith("__"):
            return _hooks.record_call(func, name, args, kwargs, True, False)
        # a Python function of torch's (F.multi_head_attention_forward):
        # its body recorded call by call (fastlazy.python_bodies), or the
        # function recorded whole, by signature
        ran, result = _hooks.run_body(func, args, kwargs)
        if ran:
            return result
        return record_by_signature(func, name, args, kwargs, False, None)


_op_overload_type = torch._ops.OpOverload

fl_handle_install(LazyTensor)


cdef enum:
    MAX_VECTOR = 32


cdef object generic_call_of(object entry, tuple args, dict kwargs):
    """call_generic of an entry's call given as a tuple and a dict (a
    __torch_function__ call): the same argument vector the entry sees."""
    cdef PyObject *vector[MAX_VECTOR]
    cdef Py_ssize_t nargs = len(args), i = 0
    if nargs + len(kwargs) > MAX_VECTOR:
        func = entry.__wrapped__
        return _hooks.record_call(func, entry.qualname, args, kwargs, False, False)
    for i in range(nargs):
        vector[i] = <PyObject*>args[i]          # borrowed: args and kwargs hold them
    kwnames = None
    if kwargs:
        kwnames = tuple(kwargs)
        i = nargs
        for value in kwargs.values():
            vector[i] = <PyObject*>value
            i += 1
    return call_generic(entry, vector, nargs, kwnames, FORM_CALL)


# -- installers: LazyTensor's methods, operators and torch functions --

def set_dunder(str name, object entry):
    """Make LazyTensor's operator `name` dispatch through `entry`."""
    _dunder_entries[DUNDER_NAMES.index(name)] = entry


def set_method(str name, object entry):
    """Install `entry` as LazyTensor.<name> (the type's dict is not writable
    from Python, so it is written here, once, at import)."""
    cdef PyTypeObject *tp = <PyTypeObject*>LazyTensor
    (<dict>tp.tp_dict)[name] = entry
    PyType_Modified(tp)


def set_torch_function(object orig, object entry):
    _torch_function_table[orig] = entry


def set_metadata_query(object func, object method):
    """torch function `func` of one LazyTensor answered by `method`."""
    _metadata_queries[func] = method

