# From call arguments to operands: each argument of a call sorted into a
# kind (LazyTensor, eager tensor, Python scalar, absent) with its metadata,
# which is all the rules (csrc/rules.pxi) look at.

cdef object TensorType = torch.Tensor


cdef extern from "Python.h":
    ctypedef object (*getter_fn)(object, void *)
    int64_t PyLong_AsLongLongAndOverflow(object, int *) except? -1
    double PyFloat_AS_DOUBLE(object)
    Py_ssize_t PyTuple_GET_SIZE(object)
    PyObject *PyTuple_GET_ITEM(object, Py_ssize_t)
    Py_hash_t PyObject_Hash(object) except -1
    int PyObject_RichCompareBool(object, object, int) except -1
    ctypedef struct PyGetSetDefFull "PyGetSetDef":
        getter_fn get
        void *closure
    ctypedef struct PyGetSetDescrObject:
        PyGetSetDefFull *d_getset

cdef object _Parameter = torch.nn.Parameter
cdef object _dtype_type = torch.dtype
cdef object _layout_type = torch.layout
cdef object _memory_format_type = torch.memory_format
cdef object _tensor_stride = torch._C.TensorBase.stride


# An eager tensor's metadata through its type's getters, called directly
# (torch.Tensor's attributes are these getset descriptors; checked at import,
# else the fast path leaves eager tensors to signature_key).
cdef PyGetSetDefFull *_get_dtype = NULL
cdef PyGetSetDefFull *_get_shape = NULL
cdef PyGetSetDefFull *_get_layout = NULL
cdef PyGetSetDefFull *_get_is_cpu = NULL
cdef PyGetSetDefFull *_get_is_cuda = NULL
cdef PyGetSetDefFull *_get_requires_grad = NULL
cdef PyGetSetDefFull *_get_version = NULL


cdef PyGetSetDefFull *_tensor_getter(str name):
    import types
    d = torch._C.TensorBase.__dict__.get(name)
    if (type(d) is not types.GetSetDescriptorType or getattr(TensorType, name, None) is not d
            or getattr(_Parameter, name, None) is not d):
        return NULL
    return <PyGetSetDefFull*>(<PyGetSetDescrObject*>d).d_getset


cdef bint _fast_eager = False


cdef void _init_getters():
    global _get_dtype, _get_shape, _get_layout, _get_is_cpu, _get_is_cuda
    global _get_requires_grad, _get_version, _fast_eager
    _get_dtype = _tensor_getter("dtype")
    _get_shape = _tensor_getter("shape")
    _get_layout = _tensor_getter("layout")
    _get_is_cpu = _tensor_getter("is_cpu")
    _get_is_cuda = _tensor_getter("is_cuda")
    _get_requires_grad = _tensor_getter("requires_grad")
    _get_version = _tensor_getter("_version")
    _fast_eager = (_get_dtype != NULL and _get_shape != NULL and _get_layout != NULL
                   and _get_is_cpu != NULL and _get_is_cuda != NULL
                   and _get_requires_grad != NULL and _get_version != NULL)


_init_getters()


cdef inline object tensor_get(PyGetSetDefFull *g, object x):
    return g.get(x, g.closure)


cdef extern from "tensor_facts.h":
    ctypedef struct fl_tensor_facts:
        int scalar_type
        int device
        int strided
        int requires_grad
        int64_t version
    ctypedef int (*fl_read_tensor_fn)(PyObject *, fl_tensor_facts *, int64_t *, int64_t *,
                                      int) noexcept
    ctypedef int (*fl_grad_enabled_fn)() noexcept
    ctypedef int (*fl_storage_address_fn)(PyObject *, uintptr_t *) noexcept
    ctypedef struct fl_torch_readers:
        fl_read_tensor_fn read_tensor
        fl_grad_enabled_fn grad_enabled
        fl_storage_address_fn storage_address
    enum:
        FL_UNREAD
        FL_TOO_MANY_DIMS
        FL_SCALAR_TYPES
    const char *FL_TENSOR_READER_CAPSULE

cdef extern from "Python.h":
    void *PyCapsule_GetPointer(object, const char *) except? NULL


# The C++ readers of an eager tensor's metadata and storage address and of
# grad mode (tensor_facts.h), where the step executor's extension is built
# for this torch; NULL: torch's getters, storage objects and
# torch.is_grad_enabled.
cdef fl_read_tensor_fn read_tensor = NULL
cdef fl_grad_enabled_fn read_grad_mode = NULL
cdef fl_storage_address_fn read_storage_address = NULL


def set_tensor_reader(capsule):
    """Read eager tensors (their metadata and storage address) and grad
    mode with the C++ readers in `capsule` (fastlazy._executor.tensor_reader()),
    or with torch's getters and torch.is_grad_enabled (None)."""
    global read_tensor, read_grad_mode, read_storage_address
    cdef const fl_torch_readers *readers
    if capsule is None:
        read_tensor = NULL
        read_grad_mode = NULL
        read_storage_address = NULL
    else:
        readers = <const fl_torch_readers *>PyCapsule_GetPointer(capsule,
                                                                 FL_TENSOR_READER_CAPSULE)
        read_tensor = readers.read_tensor
        read_grad_mode = readers.grad_enabled
        read_storage_address = readers.storage_address
    _learn_scalar_types()


# dtype code of each c10::ScalarType number the reader reports (DT_UNDEF:
# a dtype the rules do not cover; the last entry stands for every number
# past the reader's bound)
cdef int8_t code_of_scalar_type[FL_SCALAR_TYPES + 1]


cdef void _learn_scalar_types() except *:
    """Fill code_of_scalar_type by reading an empty tensor of each dtype
    with the reader: the numbers are the installed torch's own, whatever
    its version numbers them."""
    cdef fl_tensor_facts facts
    cdef int64_t sizes[MAX_NDIM]
    cdef int i
    for i in range(FL_SCALAR_TYPES + 1):
        code_of_scalar_type[i] = DT_UNDEF
    if read_tensor == NULL:
        return
    for i in range(NDTYPES):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")     # (complex32's "experimental")
            probe = torch.empty(0, dtype=DTYPES[i])
        if read_tensor(<PyObject*>probe, &facts, sizes, NULL, MAX_NDIM) == FL_UNREAD:
            raise RuntimeError(f"the C++ tensor reader cannot read a {DTYPES[i]} tensor")
        if facts.scalar_type < FL_SCALAR_TYPES:
            code_of_scalar_type[facts.scalar_type] = i


def tensor_reader_installed():
    """Does the core read eager tensors with the C++ reader?"""
    return read_tensor != NULL


cdef enum:
    NOT_DESCRIBED = -3      # (FL_UNREAD, FL_TOO_MANY_DIMS: tensor_facts.h)
    # Operand.version of an eager tensor whose version counter was not read
    # with its metadata: Segment.add_slot reads it (-1: it keeps none)
    VERSION_UNREAD = -2


cdef int meta_by_reader(Meta *m, object t, int64_t *strides, int *strided,
                        int64_t *version) except -100:
    """m filled from a torch.Tensor or Parameter by the C++ reader: t's
    rank; FL_UNREAD where the reader cannot answer; NOT_DESCRIBED where a
    LazyTensor's metadata cannot describe t (too many dims, a device other
    than cpu and cuda, a dtype without a code).  `strides` (or NULL),
    *strided and *version (where not NULL) as the reader gives them."""
    cdef fl_tensor_facts facts
    cdef int nd = read_tensor(<PyObject*>t, &facts, m.shape, strides, MAX_NDIM)
    if nd == FL_UNREAD:
        return FL_UNREAD
    if nd == FL_TOO_MANY_DIMS or facts.device < 0:
        return NOT_DESCRIBED
    cdef int d = code_of_scalar_type[facts.scalar_type]
    if d == DT_UNDEF:
        return NOT_DESCRIBED
    m.dtype = d
    m.ndim = nd
    m.device = facts.device
    m.requires_grad = facts.requires_grad
    strided[0] = facts.strided
    if version != NULL:
        version[0] = facts.version
    return nd


cdef int meta_from_tensor(Meta *m, object t) except -1:
    """Fill m from an eager tensor: the slow path (attribute reads), taken only
    for eager tensors passed beside LazyTensors."""
    return meta_and_version(m, t, NULL)


cdef int meta_and_version(Meta *m, object t, int64_t *version) except -1:
    """meta_from_tensor, and *version (where not NULL) set to t's version
    counter where the C++ reader read it with the metadata (else left)."""
    cdef int read, strided
    if type(t) is TensorType or type(t) is _Parameter:
        if read_tensor != NULL:
            read = meta_by_reader(m, t, NULL, &strided, version)
            if read != FL_UNREAD:
                return read >= 0
        if _fast_eager:
            return meta_from_getters(m, t)
    cdef int d = dtype_code(t.dtype)
    if d == DT_UNDEF:
        return 0
    try:
        shape = t.shape
    except RuntimeError:
        return 0                # a nested tensor's sizes are no list: kept eager
    cdef Py_ssize_t nd = len(shape)
    if nd > MAX_NDIM:
        return 0
    m.dtype = d
    m.ndim = nd
    cdef Py_ssize_t i
    for i in range(nd):
        m.shape[i] = shape[i]
    # is_cpu / is_cuda: t.device.type costs five times as much
    if t.is_cpu:
        m.device = 0
    elif t.is_cuda:
        m.device = 1 + t.get_device()
    else:
        return 0                # mps, meta, xpu...: eager
    m.requires_grad = t.requires_grad
    m.inference = 0
    return 1


cdef int meta_from_getters(Meta *m, object t) except -1:
    """meta_from_tensor for a torch.Tensor or Parameter, through the getters."""
    cdef int d = dtype_code(tensor_get(_get_dtype, t))
    if d == DT_UNDEF:
        return 0
    try:
        shape = tensor_get(_get_shape, t)
    except RuntimeError:
        return 0                # a nested tensor's sizes are no list: kept eager
    cdef Py_ssize_t nd = PyTuple_GET_SIZE(shape), i
    if nd > MAX_NDIM:
        return 0
    if tensor_get(_get_is_cpu, t) is True:
        m.device = 0
    elif tensor_get(_get_is_cuda, t) is True:
        m.device = 1 + t.get_device()
    else:
        return 0
    m.dtype = d
    m.ndim = nd
    for i in range(nd):
        m.shape[i] = <object>PyTuple_GET_ITEM(shape, i)
    m.requires_grad = tensor_get(_get_requires_grad, t) is True
    return 1


cdef int classify(Operand *o, PyObject *p) except -1:
    """Sort one argument into an operand kind; 0 means not recordable."""
    cdef object x = <object>p
    o.obj = p
    if type(x) is LazyTensor:
        o.kind = K_LAZY
        o.m = &(<LazyTensor>x).meta
        # complex32 values can be held, but most kernels refuse them: eager
        return o.m.dtype != DT_COMPLEX32
    o.m = &o.own
    if type(x) is float:
        o.kind = K_SCALAR; o.scalar = SC_FLOAT; o.own.dtype = -1; o.own.ndim = 0
        return 1
    if type(x) is int:
        if not -9223372036854775808 <= <object>x <= 9223372036854775807:
            return 0          # outside int64: eager decides (OverflowError, uint64)
        o.kind = K_SCALAR; o.scalar = SC_INT; o.own.dtype = -1; o.own.ndim = 0
        return 1
    if type(x) is bool:
        o.kind = K_SCALAR; o.scalar = SC_BOOL; o.own.dtype = -1; o.own.ndim = 0
        return 1
    if x is None:
        o.kind = K_ABSENT
        o.own.ndim = 0
        o.own.dtype = -1
        o.own.requires_grad = 0
        return 2              # None: the caller checks the param accepts it
    if type(x) is complex:
        o.kind = K_SCALAR; o.scalar = SC_COMPLEX; o.own.dtype = -1; o.own.ndim = 0
        return 1
    # (the exact types first: isinstance on a Parameter costs ~100 ns)
    if type(x) is TensorType or type(x) is _Parameter or isinstance(x, TensorType):
        o.kind = K_TENSOR
        o.version = VERSION_UNREAD
        return meta_and_version(&o.own, x, &o.version) and o.own.dtype != DT_COMPLEX32
    return 0


cdef double FLOAT16_MAX = 65504.0
cdef double FLOAT32_MAX = 3.4028234663852886e38


cdef bint scalar_fits(Operand *o, int d) except -1:
    """Does a Python-number argument convert to dtype d without overflow?
    Eager checks this where a number is converted to the computation dtype
    (pow exponent, clamp bounds, alpha, negative_slope) and raises at the
    call; such calls go to eager."""
    if o.kind != K_SCALAR:
        return True
    if o.scalar == SC_COMPLEX:
        return is_complex(d)
    if o.scalar == SC_BOOL or is_complex(d):
        return True
    v = <object>o.obj
    if is_integral(d):
        if o.scalar == SC_FLOAT:
            return True                  # alpha: checked by its rule
        if d == 0:
            return True
        return int_min[d] <= v <= int_max[d]
    f = abs(float(v))
    if f != f or f == float("inf"):
        return True
    if d == 6:                           # float16
        return f <= FLOAT16_MAX
    if d == 7 or d == 8:                 # bfloat16, float32
        return f <= FLOAT32_MAX
    return True


cdef inline bint is_tensor(Operand *o) noexcept:
    return o.kind == K_LAZY or o.kind == K_TENSOR


cdef inline bint equal_sizes(const int64_t *a, const int64_t *b, int ndim) noexcept:
    """a[:ndim] == b[:ndim]: a loop, not libc's memcmp, whose call costs
    more than the two or three compares a recorded op's shape needs."""
    cdef int i
    for i in range(ndim):
        if a[i] != b[i]:
            return False
    return True
