# Rules for ops that are not elementwise: reductions, softmax, matmul.
#
# Non-operand arguments (dim, keepdim, dtype) are structure: they are packed
# into the node's attr, and the lowering reads them back from there.
#   reductions: bits 0-7 dim mask, bit 8 keepdim, bit 9 "dim given",
#               bits 10-14 dtype code + 1 (0: no dtype argument)
#   softmax:    bits 0-3 dim, bits 10-14 dtype code + 1

cdef enum:
    ATTR_KEEPDIM = 1 << 8
    ATTR_DIM_GIVEN = 1 << 9
    ATTR_DTYPE_SHIFT = 10


cdef int wrap_dim(object d, int ndim) except -2:
    """A dim argument as a non-negative index, or -1 if eager should judge it."""
    if type(d) is not int:
        return -1
    cdef int n = ndim if ndim > 0 else 1
    cdef long v = d
    if v < -n or v >= n:
        return -1
    return v + n if v < 0 else v


cdef int dtype_arg(PyObject *p) except -2:
    """A dtype= argument: its code + 1, 0 for absent/None, -1 for anything
    the recorder does not take."""
    if p == NULL or <object>p is None:
        return 0
    cdef int d = dtype_code(<object>p)
    return -1 if d == DT_UNDEF else d + 1


cdef int reduce_rule(int op, Operand *ops, PyObject **p, Meta *out, int *attr) except -1:
    # params: input, dim, keepdim[, dtype]
    cdef Meta *m = ops[0].m
    cdef int nd = m.ndim, mask = 0, k, j, dt
    cdef bint keep = False
    if not is_tensor(&ops[0]):
        return RULE_EAGER
    if p[1] != NULL and <object>p[1] is not None:
        dims = <object>p[1]
        if type(dims) is int:
            dims = (dims,)
        elif type(dims) is not tuple and type(dims) is not list:
            return RULE_EAGER
        for d in dims:
            k = wrap_dim(d, nd)
            if k < 0 or mask & (1 << k):
                return RULE_EAGER
            mask |= 1 << k
        if len(dims) == 0:
            return RULE_EAGER          # dim=() means "all" for some ops: eager judges
        attr[0] |= ATTR_DIM_GIVEN
    else:
        mask = (1 << nd) - 1
    if op_nparams[op] > 2 and p[2] != NULL:
        if type(<object>p[2]) is not bool:
            return RULE_EAGER
        keep = <object>p[2]
    dt = dtype_arg(p[3]) if op_nparams[op] > 3 else 0
    if dt < 0:
        return RULE_EAGER
    # output shape
    out.ndim = 0
    for k in range(nd):
        if mask & (1 << k):
            if op_flags[op] & OPF_EMPTY_ERROR and m.shape[k] == 0:
                return RULE_EAGER      # eager raises for an empty reduction
            if keep:
                out.shape[out.ndim] = 1
                out.ndim += 1
        else:
            out.shape[out.ndim] = m.shape[k]
            out.ndim += 1
    if op_flags[op] & OPF_EMPTY_ERROR and nd > 0 and mask == (1 << nd) - 1:
        for k in range(nd):
            if m.shape[k] == 0:
                return RULE_EAGER
    out.device = m.device
    out.requires_grad = m.requires_grad and grad_enabled()
    # output dtype
    if dt > 0:
        out.dtype = dt - 1
        if not cat_ok(op, out.dtype) or not cat_ok(op, m.dtype):
            return RULE_EAGER
        if category[out.dtype] < category[m.dtype] and category[m.dtype] > CAT_INT:
            return RULE_EAGER          # e.g. a float sum into an int dtype
    else:
        if not cat_ok(op, m.dtype):
            return RULE_EAGER
        out.dtype = m.dtype
        if op_flags[op] & OPF_INT_TO_INT64 and is_integral(m.dtype):
            out.dtype = 5              # int64
    attr[0] |= mask | (ATTR_KEEPDIM if keep else 0) | (dt << ATTR_DTYPE_SHIFT)
    return RULE_OK


cdef int softmax_rule(int op, Operand *ops, PyObject **p, Meta *out, int *attr) except -1:
    # params: input, dim[, _stacklevel], dtype (the last one)
    cdef Meta *m = ops[0].m
    if not is_tensor(&ops[0]) or p[1] == NULL:
        return RULE_EAGER              # dim=None: eager picks one (and warns)
    cdef int k = wrap_dim(<object>p[1], m.ndim)
    cdef int dt = dtype_arg(p[op_nparams[op] - 1])
    if k < 0 or dt < 0:
        return RULE_EAGER
    memcpy(out, m, sizeof(Meta))
    out.requires_grad = m.requires_grad and grad_enabled()
    if dt > 0:
        out.dtype = dt - 1
    if not cat_ok(op, m.dtype) or not cat_ok(op, out.dtype):
        return RULE_EAGER
    attr[0] |= k | (dt << ATTR_DTYPE_SHIFT)
    return RULE_OK


cdef int layer_norm_rule(int op, Operand *ops, PyObject **p, Meta *out, int *attr) except -1:
    # params: input, normalized_shape, weight, bias, eps; attr: len(normalized_shape)
    cdef Meta *m = ops[0].m
    cdef int k, i, j
    shape = <object>p[1]
    if type(shape) is not tuple and type(shape) is not list and type(shape) is not _Size:
        return RULE_EAGER             # an int is a TypeError in eager
    k = len(shape)
    if k < 1 or k > m.ndim or not cat_ok(op, m.dtype):
        return RULE_EAGER
    for j in range(k):
        if type(shape[j]) is not int or shape[j] != m.shape[m.ndim - k + j]:
            return RULE_EAGER
    cdef bint rg = m.requires_grad
    for i in (2, 3):                  # weight, bias: exactly normalized_shape
        if ops[i].kind == K_ABSENT:
            continue
        if (not is_tensor(&ops[i]) or ops[i].m.dtype != m.dtype or ops[i].m.device != m.device
                or ops[i].m.ndim != k):
            return RULE_EAGER
        for j in range(k):
            if ops[i].m.shape[j] != m.shape[m.ndim - k + j]:
                return RULE_EAGER
        rg = rg or ops[i].m.requires_grad
    if ops[4].kind != K_ABSENT and (ops[4].kind != K_SCALAR or ops[4].scalar != SC_FLOAT):
        return RULE_EAGER             # eps is a float in aten's schema
    memcpy(out, m, sizeof(Meta))
    out.requires_grad = rg and grad_enabled()
    attr[0] |= k
    return RULE_OK


cdef int same_dtype_device(Operand *ops, int n, Meta *out) except -1:
    cdef int i
    cdef bint rg = False
    for i in range(n):
        if ops[i].kind == K_ABSENT:
            continue
        if not is_tensor(&ops[i]) or ops[i].m.dtype != ops[0].m.dtype \
                or ops[i].m.device != ops[0].m.device:
            return 0
        rg = rg or ops[i].m.requires_grad
    out.dtype = ops[0].m.dtype
    out.device = ops[0].m.device
    out.requires_grad = rg and grad_enabled()
    return 1


cdef int matmul_rule(int op, int rule, Operand *ops, Meta *out) except -1:
    """mm, bmm, matmul and linear: same dtype and device, no promotion (eager
    raises on mixed dtypes), shapes as the aten ops check them."""
    cdef int nops = 3 if rule == R_LINEAR else 2
    if not same_dtype_device(ops, nops, out) or not cat_ok(op, out.dtype):
        return RULE_EAGER
    cdef Meta *a = ops[0].m
    cdef Meta *b = ops[1].m
    cdef int i, na = a.ndim, nb = b.ndim, nbatch
    cdef int64_t s, t
    if rule == R_MM:
        if na != 2 or nb != 2 or a.shape[1] != b.shape[0]:
            return RULE_EAGER
        out.ndim = 2; out.shape[0] = a.shape[0]; out.shape[1] = b.shape[1]
        return RULE_OK
    if rule == R_BMM:
        if na != 3 or nb != 3 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
            return RULE_EAGER
        out.ndim = 3; out.shape[0] = a.shape[0]; out.shape[1] = a.shape[1]
        out.shape[2] = b.shape[2]
        return RULE_OK
    if rule == R_LINEAR:
        # input [..., in] x weight [out, in] (+ bias [out]) -> [..., out]
        if na < 1 or nb != 2 or a.shape[na - 1] != b.shape[1]:
            return RULE_EAGER
        if ops[2].kind != K_ABSENT and (ops[2].m.ndim != 1 or ops[2].m.shape[0] != b.shape[0]):
            return RULE_EAGER
        out.ndim = na
        for i in range(na - 1):
            out.shape[i] = a.shape[i]
        out.shape[na - 1] = b.shape[0]
        return RULE_OK
    # matmul: 1-d operands are promoted to matrices and the added dim removed
    if na == 0 or nb == 0:
        return RULE_EAGER
    if na == 1 and nb == 1:
        if a.shape[0] != b.shape[0]:
            return RULE_EAGER
        out.ndim = 0
        return RULE_OK
    cdef int64_t k_a = a.shape[na - 1]
    cdef int64_t k_b = b.shape[nb - 2] if nb >= 2 else b.shape[0]
    if k_a != k_b:
        return RULE_EAGER
    # batch dims: everything but the last two (one for a 1-d operand)
    cdef int ba = na - 2 if na >= 2 else 0
    cdef int bb = nb - 2 if nb >= 2 else 0
    nbatch = ba if ba > bb else bb
    for i in range(nbatch):
        s = a.shape[ba - nbatch + i] if ba - nbatch + i >= 0 else 1
        t = b.shape[bb - nbatch + i] if bb - nbatch + i >= 0 else 1
        if s != t and s != 1 and t != 1:
            return RULE_EAGER
        out.shape[i] = s if t == 1 else t
    out.ndim = nbatch
    if na >= 2:
        out.shape[out.ndim] = a.shape[na - 2]
        out.ndim += 1
    if nb >= 2:
        out.shape[out.ndim] = b.shape[nb - 1]
        out.ndim += 1
    return RULE_OK
