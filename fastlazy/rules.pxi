# Shape and dtype rules, in C.
#
# A rule looks at the operands of one call and either fills the output Meta
# (returning RULE_OK) or answers RULE_EAGER: "this call is one the recorder
# does not take; run it eagerly".  Eager then produces exactly eager's result
# or exception, so a rule never has to reproduce an error message: it only
# has to be sure of every call it accepts.  The differential tests hold the
# rules to that.

cdef enum OperandKind:
    K_ABSENT = 0      # optional argument not given, or None where the row allows it
    K_LAZY = 1
    K_TENSOR = 2      # eager torch.Tensor
    K_SCALAR = 3      # Python bool, int, float or complex

cdef enum ScalarType:
    SC_BOOL = 0
    SC_INT = 1
    SC_FLOAT = 2
    SC_COMPLEX = 3

cdef enum RuleResult:
    RULE_OK = 0
    RULE_EAGER = 1

ctypedef struct Operand:
    int kind
    int scalar         # ScalarType, for K_SCALAR
    PyObject *obj      # borrowed argument
    Meta *m            # metadata (points into `own` or into a LazyTensor)
    Meta own

cdef object TensorType = None         # torch.Tensor, bound at init


cdef int meta_from_tensor(Meta *m, object t) except -1:
    """Fill m from an eager tensor: the slow path (attribute reads), taken only
    for eager tensors passed beside LazyTensors."""
    cdef int d = dtype_code(t.dtype)
    if d == DT_UNDEF:
        return 0
    shape = t.shape
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
    return 1


cdef inline int classify(Operand *o, PyObject *p) except -1:
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
    if isinstance(x, TensorType):
        o.kind = K_TENSOR
        return meta_from_tensor(&o.own, x) and o.own.dtype != DT_COMPLEX32
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


cdef int wrapped_dtype(int scalar) except -2:
    # The dtype a Python scalar takes part in promotion with (c10's
    # "wrapped number" handling).
    if scalar == SC_BOOL:
        return 0
    if scalar == SC_INT:
        return 5  # int64
    cdef int f = default_float()
    if scalar == SC_FLOAT:
        return f
    return to_complex[f]


cdef int result_type(Operand *ops, int n) except -2:
    """torch.result_type over the present operands."""
    cdef int dim = DT_UNDEF, zero = DT_UNDEF, wrapped = DT_UNDEF
    cdef int i
    for i in range(n):
        if ops[i].kind == K_ABSENT:
            continue
        if ops[i].kind == K_SCALAR:
            wrapped = promote(wrapped, wrapped_dtype(ops[i].scalar))
        elif ops[i].m.ndim == 0:
            zero = promote(zero, ops[i].m.dtype)
        else:
            dim = promote(dim, ops[i].m.dtype)
    return combine_categories(dim, combine_categories(zero, wrapped))


cdef int broadcast(Meta *out, Operand *ops, int n) except -1:
    """Broadcast the tensor operands' shapes into out; 0 if they do not
    broadcast (eager raises the error)."""
    cdef int nd = 0, i, k, j
    cdef int64_t s, o
    for i in range(n):
        if is_tensor(&ops[i]) and ops[i].m.ndim > nd:
            nd = ops[i].m.ndim
    for k in range(nd):
        out.shape[k] = 1
    for i in range(n):
        if not is_tensor(&ops[i]):
            continue
        for j in range(ops[i].m.ndim):
            k = nd - ops[i].m.ndim + j
            s = ops[i].m.shape[j]
            o = out.shape[k]
            if s == o or s == 1:
                continue
            if o == 1:
                out.shape[k] = s
            else:
                return 0
    out.ndim = nd
    return 1


cdef int common_device(Meta *out, Operand *ops, int n) except -1:
    # Tensors must share a device, except that 0-dim CPU tensors may join
    # a CUDA computation (they act like scalars there).
    cdef int dev = -1, i
    cdef bint rg = False
    for i in range(n):
        if not is_tensor(&ops[i]):
            continue
        rg = rg or ops[i].m.requires_grad
        if ops[i].m.device == 0 and ops[i].m.ndim == 0:
            continue
        if dev == -1:
            dev = ops[i].m.device
        elif dev != ops[i].m.device:
            return 0
    if dev == -1:
        dev = 0
    out.device = dev
    out.requires_grad = rg and grad_enabled()
    return 1


cdef object _is_grad_enabled = None

cdef inline bint grad_enabled() except -1:
    return _is_grad_enabled()


cdef int elementwise(Meta *out, Operand *ops, int n) except -1:
    """Shape, device and result_type for an elementwise op; dtype in out."""
    if not broadcast(out, ops, n) or not common_device(out, ops, n):
        return 0
    out.dtype = result_type(ops, n)
    # float16 with a complex scalar promotes to complex32: eager refuses it
    return out.dtype != DT_UNDEF and out.dtype != DT_COMPLEX32
