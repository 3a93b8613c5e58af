# Shape and dtype rules, in C.
#
# A rule looks at the operands of one call and either fills the output Meta
# (returning RULE_OK) or answers RULE_EAGER: "this call is one the recorder
# does not take; run it eagerly".  Eager then produces exactly eager's result
# or exception, so a rule never has to reproduce an error message: it only
# has to be sure of every call it accepts.  The differential tests hold the
# rules to that.
#
# Non-operand arguments (dim, keepdim, dtype) are structure: they are packed
# into the node's attr (AttrLayout in _core.pxd), and the lowering reads them
# back from there.

cdef enum RuleResult:
    RULE_OK = 0
    RULE_EAGER = 1
    RULE_RUN_EAGER = 2      # not even the generic path: eager runs the call (it judges)



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


cdef object _is_grad_enabled = torch.is_grad_enabled

cdef inline bint grad_enabled() except -1:
    if read_grad_mode != NULL:
        return read_grad_mode()
    return _is_grad_enabled()


cdef int elementwise(Meta *out, Operand *ops, int n) except -1:
    """Shape, device and result_type for an elementwise op; dtype in out."""
    if not broadcast(out, ops, n) or not common_device(out, ops, n):
        return 0
    out.dtype = result_type(ops, n)
    # float16 with a complex scalar promotes to complex32: eager refuses it
    return out.dtype != DT_UNDEF and out.dtype != DT_COMPLEX32



cdef int apply_rule(int op, Operand *ops, int nops, PyObject **p, Meta *out,
                    int *attr) except -1:
    """Fill out (and attr) for an accepted call; RULE_EAGER otherwise."""
    cdef int rule = op_rule[op], flags = op_flags[op], i, d
    cdef Operand recip
    if not is_tensor(&ops[0]):
        return RULE_EAGER              # torch.add(2, x) and the like: eager
    if ops[0].m.device != 0 and not op_cuda_cats[op] & category[ops[0].m.dtype]:
        return RULE_RUN_EAGER          # CUDA's kernel refuses the dtype: eager's error
    for i in range(nops):
        if flags & OPF_TENSORS_ONLY and ops[i].kind == K_SCALAR:
            return RULE_EAGER
        if flags & OPF_NO_BOOL and (ops[i].kind == K_SCALAR and ops[i].scalar == SC_BOOL
                                    or is_tensor(&ops[i]) and ops[i].m.dtype == 0):
            return RULE_EAGER
    attr[0] = 0
    cdef int choice = 0
    if op_choice_param[op] >= 0:
        choice = choice_of(op, p)
        if choice < 0:
            return RULE_EAGER
        attr[0] = choice << ATTR_CHOICE_SHIFT
    if rule == R_REDUCE:
        return reduce_rule(op, ops, p, out, attr)
    if rule == R_SOFTMAX:
        return softmax_rule(op, ops, p, out, attr)
    if rule == R_LAYER_NORM:
        return layer_norm_rule(op, ops, p, out, attr)
    if rule == R_BATCH_NORM:
        return batch_norm_rule(op, ops, p, out)
    if rule == R_CONV2D:
        return conv2d_rule(op, ops, p, out, attr)
    if R_MM <= rule <= R_LINEAR:
        return matmul_rule(op, rule, ops, out)
    if rule == R_ADDMM:
        return addmm_rule(op, ops, p, out)
    if rule == R_MAX_POOL2D:
        return max_pool2d_rule(op, ops, p, out, attr)
    if rule == R_ADAPTIVE_AVG_POOL2D:
        return adaptive_avg_pool2d_rule(op, ops, p, out, attr)
    if rule == R_EMBEDDING:
        return embedding_rule(op, ops, p, out, attr)
    if rule == R_SDPA:
        return sdpa_rule(op, ops, p, out, attr)
    if rule == R_NATIVE_MHA:
        return native_mha_rule(op, ops, p, out, attr)
    if rule == R_RTRUEDIV:
        # the reciprocal makes an integral self float before promotion
        recip = ops[0]
        recip.m = &recip.own
        memcpy(&recip.own, ops[0].m, sizeof(Meta))
        if is_integral(recip.own.dtype):
            recip.own.dtype = default_float()
        return rtruediv_rule(op, &recip, &ops[1], out)

    if rule == R_DIV and choice == 0:     # rounding_mode=None
        rule = R_TRUEDIV
    if rule <= R_ABS:
        # extra operands of a unary op (leaky_relu's negative_slope) are
        # Python ints or floats; they do not take part in the result dtype
        for i in range(1, nops):
            if ops[i].kind == K_ABSENT:
                continue
            if ops[i].kind != K_SCALAR or ops[i].scalar == SC_BOOL or ops[i].scalar == SC_COMPLEX \
                    or not scalar_fits(&ops[i], ops[0].m.dtype):
                return RULE_EAGER
        if op_flags[op] & OPF_ORDERED_LIMITS and nops > 2 and (
                (ops[1].kind == K_ABSENT) != (ops[2].kind == K_ABSENT)
                or ops[1].kind != K_ABSENT and <object>ops[1].obj > <object>ops[2].obj):
            # (one limit given: the generic path weighs it against the
            # other's default)
            return RULE_EAGER

    if not elementwise(out, ops, 2 if rule == R_BINARY else (1 if rule <= R_ABS else nops)):
        return RULE_EAGER
    d = out.dtype

    if rule == R_UNARY:
        return RULE_OK if cat_ok(op, d) else RULE_EAGER
    if rule == R_UNARY_FLOAT:
        if not cat_ok(op, d):
            return RULE_EAGER
        if is_integral(d):
            out.dtype = default_float()
        return RULE_OK
    if rule == R_ABS:
        if not cat_ok(op, d):
            return RULE_EAGER
        if is_complex(d):
            out.dtype = to_real[d]
        return RULE_OK
    if rule == R_BINARY:
        if not cat_ok(op, d):
            return RULE_EAGER
        if nops > 2 and ops[2].kind != K_ABSENT:
            # alpha: eager's checks, in result-dtype terms
            if ops[2].kind != K_SCALAR or ops[2].scalar == SC_BOOL:
                return RULE_EAGER
            if ops[2].scalar == SC_FLOAT and is_integral(d):
                return RULE_EAGER
            if ops[2].scalar == SC_COMPLEX and not is_complex(d):
                return RULE_EAGER
            if not scalar_fits(&ops[2], d):
                return RULE_EAGER
        return RULE_OK
    if rule == R_TRUEDIV:
        if not cat_ok(op, d):
            return RULE_EAGER
        if is_integral(d):
            out.dtype = default_float()
        return RULE_OK
    if rule == R_DIV:
        return RULE_OK if is_float(d) or d != 0 and is_integral(d) else RULE_EAGER
    if rule == R_COMPARE:
        if not cat_ok(op, d):
            return RULE_EAGER
        out.dtype = 0
        return RULE_OK
    if rule == R_POW:
        if not cat_ok(op, d) or d == 0:
            return RULE_EAGER
        # Integers to negative integer powers raise in eager.
        if (is_integral(d) and ops[1].kind == K_SCALAR and ops[1].scalar == SC_INT
                and <object>ops[1].obj < 0):
            return RULE_EAGER
        if not scalar_fits(&ops[1], d) or not scalar_fits(&ops[0], d):
            return RULE_EAGER
        return RULE_OK
    if rule == R_CLAMP:
        if ops[1].kind == K_ABSENT and ops[2].kind == K_ABSENT:
            return RULE_EAGER
        # eager has clamp(Tensor, Scalar?, Scalar?) and clamp(Tensor,
        # Tensor?, Tensor?): a scalar beside a tensor bound is not a call
        # it accepts.
        if (ops[1].kind == K_SCALAR and is_tensor(&ops[2])
                or ops[2].kind == K_SCALAR and is_tensor(&ops[1])):
            return RULE_EAGER
        if not cat_ok(op, d) or d == 0:
            return RULE_EAGER
        if not scalar_fits(&ops[1], d) or not scalar_fits(&ops[2], d):
            return RULE_EAGER
        return RULE_OK
    return RULE_EAGER


cdef int rtruediv_rule(int op, Operand *recip, Operand *other, Meta *out) except -1:
    """other / self computed as self.reciprocal() * other (eager's
    Tensor.__rtruediv__): promotion sees the reciprocal's float dtype."""
    cdef Operand pair[2]
    pair[0] = recip[0]
    pair[0].m = &pair[0].own
    pair[1] = other[0]
    if other.m == &other.own:
        pair[1].m = &pair[1].own
    if not elementwise(out, pair, 2) or not cat_ok(op, out.dtype):
        return RULE_EAGER
    return RULE_OK


cdef bint dropout_is_identity(PyObject **p) except -1:
    """F.dropout(x, p, training, inplace) returns x itself when not training
    or when p == 0 (with p a valid probability; eager validates it first)."""
    prob = 0.5 if p[1] == NULL else <object>p[1]
    training = True if p[2] == NULL else <object>p[2]
    if type(prob) is not float and type(prob) is not int or type(training) is not bool:
        return False
    if not 0.0 <= prob <= 1.0:
        return False
    if p[3] != NULL and type(<object>p[3]) is not bool:
        return False
    return not training or prob == 0


cdef bint inplace_fits(Meta *out, Meta *self_m) noexcept:
    # The result must have self's shape and be castable to self's dtype.
    if out.ndim != self_m.ndim or out.device != self_m.device:
        return False
    for i in range(out.ndim):
        if out.shape[i] != self_m.shape[i]:
            return False
    return can_cast_table[out.dtype][self_m.dtype]


cdef int wrap_dim(object d, int ndim) except -2:
    """A dim argument as a non-negative index, or -1 if eager should judge it."""
    if type(d) is not int:
        return -1
    cdef int n = ndim if ndim > 0 else 1
    cdef long long v
    try:
        v = d
    except OverflowError:
        return -1           # beyond 64 bits: eager raises its own error
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


cdef int batch_norm_rule(int op, Operand *ops, PyObject **p, Meta *out) except -1:
    # params: input, running_mean, running_var, weight, bias, training,
    # momentum, eps.  Inference only (training=False, what nn.BatchNorm's
    # eval mode passes): the running statistics are read, never written, and
    # momentum is unused -- but still of a type eager takes.  Anything else
    # (training, mixed dtypes, statistics of other sizes) the generic path
    # takes as a generic row's call (the row's OPF_RULE_IN_GENERIC).
    cdef Meta *m = ops[0].m
    cdef int i
    if p[5] != NULL and <object>p[5] is not False:
        return RULE_EAGER
    if p[6] != NULL and type(<object>p[6]) is not float and type(<object>p[6]) is not int:
        return RULE_EAGER
    if m.ndim < 2 or not cat_ok(op, m.dtype) or ops[1].kind == K_ABSENT \
            or ops[2].kind == K_ABSENT:
        return RULE_EAGER
    cdef bint rg = m.requires_grad
    for i in range(1, 5):
        if ops[i].kind == K_ABSENT:
            continue                  # (weight, bias)
        if (not is_tensor(&ops[i]) or ops[i].m.dtype != m.dtype or ops[i].m.device != m.device
                or ops[i].m.ndim != 1 or ops[i].m.shape[0] != m.shape[1]):
            return RULE_EAGER
        if i <= 2 and ops[i].m.requires_grad:
            return RULE_EAGER         # (statistics that require grad: eager judges)
        rg = rg or ops[i].m.requires_grad
    if ops[7].kind != K_ABSENT and (ops[7].kind != K_SCALAR or ops[7].scalar != SC_FLOAT):
        return RULE_EAGER             # eps is a float in aten's schema
    memcpy(out, m, sizeof(Meta))
    out.requires_grad = rg and grad_enabled()
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



cdef int addmm_rule(int op, Operand *ops, PyObject **p, Meta *out) except -1:
    """input + mat1 @ mat2 (torch.addmm, as GPT-2's Conv1D calls it): one
    dtype and device, no promotion, input broadcast to (n, p).  beta and
    alpha given, empty matrices and the rest: the generic path."""
    if p[3] != NULL or p[4] != NULL:
        return RULE_EAGER
    if not same_dtype_device(ops, 3, out) or not cat_ok(op, out.dtype):
        return RULE_EAGER
    cdef Meta *c = ops[0].m
    cdef Meta *a = ops[1].m
    cdef Meta *b = ops[2].m
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0] or c.ndim > 2:
        return RULE_EAGER
    if a.shape[0] == 0 or a.shape[1] == 0 or b.shape[1] == 0:
        return RULE_EAGER
    out.ndim = 2
    out.shape[0] = a.shape[0]
    out.shape[1] = b.shape[1]
    cdef int i
    for i in range(c.ndim):
        if c.shape[i] != 1 and c.shape[i] != out.shape[2 - c.ndim + i]:
            return RULE_EAGER
    return RULE_OK


cdef bint small_int(object value, int64_t low, int bits, int64_t *out) except -1:
    """value is an int in [low, low + 2**bits): stored in out."""
    if type(value) is not int:
        return False
    cdef int overflow = 0
    cdef int64_t v = PyLong_AsLongLongAndOverflow(value, &overflow)
    if overflow or not low <= v < low + (1 << bits):
        return False
    out[0] = v
    return True


cdef bint conv_pair(PyObject *p, int64_t default, int64_t low, int bits,
                    int64_t *pair) except -1:
    """One of conv2d's stride, padding, dilation: an int or a pair of ints
    (tuple or list), each in [low, low + 2**bits) -- what the attr packs;
    False for anything else (the generic path takes the call)."""
    if p == NULL:
        pair[0] = pair[1] = default
        return True
    value = <object>p
    if type(value) is int:
        if not small_int(value, low, bits, pair):
            return False
        pair[1] = pair[0]
        return True
    if type(value) is tuple and PyTuple_GET_SIZE(value) == 2:
        return (small_int(<object>PyTuple_GET_ITEM(value, 0), low, bits, pair)
                and small_int(<object>PyTuple_GET_ITEM(value, 1), low, bits, pair + 1))
    if type(value) is list and len(value) == 2:
        return small_int(value[0], low, bits, pair) and small_int(value[1], low, bits, pair + 1)
    return False


cdef inline int pack_pair(const int64_t *pair, int64_t low, int shift, int bits) noexcept:
    """The attr bits of a pair conv_pair read (each in [low, low + 2**bits)):
    height's from bit `shift`, width's right after it, less `low` -- what
    optable.PackedPair reads back."""
    return <int>((pair[0] - low) << shift | (pair[1] - low) << (shift + bits))


cdef int conv2d_rule(int op, Operand *ops, PyObject **p, Meta *out, int *attr) except -1:
    # params: input, weight, bias, stride, padding, dilation, groups.  A
    # batch (N, C, H, W) of floats, the weight and bias of its dtype and
    # device, and the sizes nn.Conv2d passes; an unbatched input, padding
    # 'same' or 'valid', sizes beyond the attr's fields and every call eager
    # refuses take the generic path (OPF_RULE_IN_GENERIC),
    # as a generic row's calls: no trial run, so a large one is recorded.
    # Empty tensors run eagerly: the generic path may judge such a call by
    # a template on meta tensors, and meta's convolution does not refuse a
    # weight with no output channels as the CPU kernel does.
    cdef Meta *x = ops[0].m
    cdef Meta *w
    cdef int64_t stride[2]
    cdef int64_t padding[2]
    cdef int64_t dilation[2]
    cdef int64_t groups = 1, extent
    cdef int i
    if not is_tensor(&ops[0]) or not is_tensor(&ops[1]):
        return RULE_EAGER
    if not same_dtype_device(ops, 3, out) or not cat_ok(op, out.dtype):
        return RULE_EAGER
    w = ops[1].m
    if x.ndim != 4 or w.ndim != 4:
        return RULE_EAGER
    if ops[2].kind != K_ABSENT and (ops[2].m.ndim != 1 or ops[2].m.shape[0] != w.shape[0]):
        return RULE_EAGER
    if (not conv_pair(p[3], 1, 1, ATTR_CONV_STRIDE_BITS, stride)
            or not conv_pair(p[4], 0, 0, ATTR_CONV_PADDING_BITS, padding)
            or not conv_pair(p[5], 1, 1, ATTR_CONV_DILATION_BITS, dilation)):
        return RULE_EAGER
    if p[6] != NULL and not small_int(<object>p[6], 1, ATTR_CONV_GROUPS_BITS, &groups):
        return RULE_EAGER
    for i in range(4):
        if x.shape[i] == 0 or w.shape[i] == 0:
            return RULE_RUN_EAGER
    if x.shape[1] != w.shape[1] * groups or w.shape[0] % groups != 0:
        return RULE_EAGER
    out.ndim = 4
    out.shape[0] = x.shape[0]
    out.shape[1] = w.shape[0]
    for i in range(2):
        extent = dilation[i] * (w.shape[2 + i] - 1) + 1
        if x.shape[2 + i] + 2 * padding[i] < extent:
            return RULE_EAGER          # the kernel is larger than the padded input
        out.shape[2 + i] = (x.shape[2 + i] + 2 * padding[i] - extent) // stride[i] + 1
    attr[0] |= (pack_pair(stride, 1, ATTR_CONV_STRIDE_SHIFT, ATTR_CONV_STRIDE_BITS)
                | pack_pair(padding, 0, ATTR_CONV_PADDING_SHIFT, ATTR_CONV_PADDING_BITS)
                | pack_pair(dilation, 1, ATTR_CONV_DILATION_SHIFT, ATTR_CONV_DILATION_BITS)
                | (groups - 1) << ATTR_CONV_GROUPS_SHIFT)
    return RULE_OK


cdef int pooled_input(int op, Operand *ops, Meta *out) except -1:
    """A pooling op's input: a 3-d or 4-d tensor of a dtype the row takes,
    no empty dims (RULE_RUN_EAGER: eager's checks of those differ by
    kernel); out takes its metadata."""
    cdef Meta *x = ops[0].m
    cdef int i
    if not is_tensor(&ops[0]) or x.ndim < 3 or x.ndim > 4 or not cat_ok(op, x.dtype):
        return RULE_EAGER
    for i in range(x.ndim):
        if x.shape[i] == 0:
            return RULE_RUN_EAGER
    memcpy(out, x, sizeof(Meta))
    out.requires_grad = x.requires_grad and grad_enabled()
    return RULE_OK


cdef int max_pool2d_rule(int op, Operand *ops, PyObject **p, Meta *out, int *attr) except -1:
    # params: input, kernel_size, stride, padding, dilation, ceil_mode,
    # return_indices.  Output sizes as aten's pooling_output_shape; a
    # padding over half the kernel, an empty output, indices: generic.
    cdef int64_t kernel[2]
    cdef int64_t stride[2]
    cdef int64_t padding[2]
    cdef int64_t dilation[2]
    cdef int64_t size, n
    cdef bint ceil = False
    cdef int i, verdict = pooled_input(op, ops, out)
    if verdict != RULE_OK:
        return verdict
    if p[6] != NULL and <object>p[6] is not False:
        return RULE_EAGER
    if p[5] != NULL:
        if type(<object>p[5]) is not bool:
            return RULE_EAGER
        ceil = <object>p[5]
    if p[1] == NULL or not conv_pair(p[1], 1, 1, ATTR_POOL_KERNEL_BITS, kernel):
        return RULE_EAGER
    if p[2] == NULL or <object>p[2] is None or (
            type(<object>p[2]) in (tuple, list) and len(<object>p[2]) == 0):
        stride[0], stride[1] = kernel[0], kernel[1]     # eager's default
    elif not conv_pair(p[2], 1, 1, ATTR_POOL_STRIDE_BITS, stride):
        return RULE_EAGER
    if (not conv_pair(p[3], 0, 0, ATTR_POOL_PADDING_BITS, padding)
            or not conv_pair(p[4], 1, 1, ATTR_POOL_DILATION_BITS, dilation)):
        return RULE_EAGER
    for i in range(2):
        if padding[i] > kernel[i] // 2:
            return RULE_EAGER
        size = out.shape[out.ndim - 2 + i]
        n = size + 2 * padding[i] - dilation[i] * (kernel[i] - 1) - 1 + (stride[i] - 1 if ceil else 0)
        if n < 0:
            return RULE_EAGER
        n = n // stride[i] + 1
        if ceil and (n - 1) * stride[i] >= size + padding[i]:
            n -= 1
        if n < 1:
            return RULE_EAGER
        out.shape[out.ndim - 2 + i] = n
    attr[0] |= (pack_pair(kernel, 1, ATTR_POOL_KERNEL_SHIFT, ATTR_POOL_KERNEL_BITS)
                | pack_pair(stride, 1, ATTR_POOL_STRIDE_SHIFT, ATTR_POOL_STRIDE_BITS)
                | pack_pair(padding, 0, ATTR_POOL_PADDING_SHIFT, ATTR_POOL_PADDING_BITS)
                | pack_pair(dilation, 1, ATTR_POOL_DILATION_SHIFT, ATTR_POOL_DILATION_BITS)
                | (ATTR_POOL_CEIL_MODE if ceil else 0))
    return RULE_OK


cdef int adaptive_avg_pool2d_rule(int op, Operand *ops, PyObject **p, Meta *out,
                                  int *attr) except -1:
    # params: input, output_size -- an int or a pair of ints; None for a
    # dim (keep the input's size) is the generic path's
    cdef int64_t size[2]
    cdef int verdict = pooled_input(op, ops, out)
    if verdict != RULE_OK:
        return verdict
    if p[1] == NULL or not conv_pair(p[1], 1, 1, ATTR_ADAPTIVE_SIZE_BITS, size):
        return RULE_EAGER
    out.shape[out.ndim - 2] = size[0]
    out.shape[out.ndim - 1] = size[1]
    attr[0] |= pack_pair(size, 1, 0, ATTR_ADAPTIVE_SIZE_BITS)
    return RULE_OK


cdef int embedding_rule(int op, Operand *ops, PyObject **p, Meta *out, int *attr) except -1:
    # params: input, weight, padding_idx, max_norm, norm_type,
    # scale_grad_by_freq, sparse.  Integer indices of any shape into a 2-d
    # weight; max_norm (which writes the weight), sparse gradients and
    # gradients scaled by frequency are the generic path's.  An index out
    # of range raises when the graph runs (a value, as in every lazy
    # tensor system).
    cdef Meta *ids = ops[0].m
    cdef Meta *w = ops[1].m
    cdef int64_t padding = -1
    cdef int i, overflow = 0
    if not is_tensor(&ops[0]) or not is_tensor(&ops[1]) or ids.device != w.device:
        return RULE_EAGER
    if ids.dtype != DT_INT64 and ids.dtype != DT_INT32 or w.ndim != 2 or not cat_ok(op, w.dtype):
        return RULE_EAGER
    if ids.ndim + 1 > MAX_NDIM or w.shape[0] == 0:
        return RULE_EAGER
    if p[3] != NULL and <object>p[3] is not None:
        return RULE_EAGER
    if p[4] != NULL and type(<object>p[4]) is not float and type(<object>p[4]) is not int:
        return RULE_EAGER
    for i in (5, 6):
        if p[i] != NULL and <object>p[i] is not False:
            return RULE_EAGER
    if p[2] != NULL and <object>p[2] is not None:
        # F.embedding counts a negative padding_idx from the end
        if type(<object>p[2]) is not int:
            return RULE_EAGER
        padding = PyLong_AsLongLongAndOverflow(<object>p[2], &overflow)
        if overflow or not -w.shape[0] <= padding < w.shape[0]:
            return RULE_EAGER
        if padding < 0:
            padding += w.shape[0]
        if padding + 1 >= 1 << ATTR_EMBEDDING_PADDING_BITS:
            return RULE_EAGER
    out.ndim = ids.ndim + 1
    for i in range(ids.ndim):
        out.shape[i] = ids.shape[i]
    out.shape[ids.ndim] = w.shape[1]
    out.dtype = w.dtype
    out.device = w.device
    out.requires_grad = w.requires_grad and grad_enabled()
    attr[0] |= padding + 1
    return RULE_OK


# Floats a lowering reads back from a node's attr by index (sdpa's scale):
# a model passes the same few, and the attr holds no float.  Keyed by their
# bits (-0.0 and 0.0, and each nan, apart); index 0 stands for None.
cdef dict _float_ids = {}
cdef list _floats = [None]


cdef int intern_float(object value, int bits) except -2:
    """value's index among the interned floats, interning it; -1 when the
    attr field of `bits` bits cannot hold another."""
    cdef double d = PyFloat_AS_DOUBLE(value)
    cdef int64_t key
    memcpy(&key, &d, sizeof(double))
    found = _float_ids.get(key)
    if found is not None:
        return found
    cdef int index = len(_floats)
    if index >= 1 << bits:
        return -1
    _floats.append(d)
    _float_ids[key] = index
    return index


def interned_float(int index):
    """The float interned at `index` (None at 0): a lowering reads it."""
    return _floats[index]


cdef int sdpa_rule(int op, Operand *ops, PyObject **p, Meta *out, int *attr) except -1:
    # params: query, key, value, attn_mask, dropout_p, is_causal, scale,
    # enable_gqa.  q (..., L, E), k (..., S, E), v (..., S, Ev) of one dtype
    # and device, 3-d or 4-d, q's leading dims broadcast with k's (with
    # enable_gqa, k's heads divide q's); a bool or query-dtype mask that
    # broadcasts into (..., L, S).  The row lowers to the same aten op, so
    # the graph's run picks eager's kernel.  Dropout (random) and calls
    # outside these shapes take the generic path -- but shapes eager's
    # kernel refuses run eagerly: under the trial run's dispatch mode sdpa
    # takes the math path, which broadcasts where eager's kernels raise.
    cdef Meta *q = ops[0].m
    cdef Meta *k = ops[1].m
    cdef Meta *v = ops[2].m
    cdef Meta *mask
    cdef int i, n, scale = 0
    cdef bint causal = False, gqa = False
    if not same_dtype_device(ops, 3, out) or not cat_ok(op, out.dtype):
        return RULE_EAGER
    n = q.ndim
    if n < 3 or n > 4 or k.ndim != n or v.ndim != n:
        return RULE_EAGER
    if p[4] != NULL and (type(<object>p[4]) is not float and type(<object>p[4]) is not int
                         or <object>p[4] != 0):
        return RULE_EAGER
    for i in (5, 7):
        if p[i] != NULL and type(<object>p[i]) is not bool:
            return RULE_EAGER
    causal = p[5] != NULL and <object>p[5] is True
    gqa = p[7] != NULL and <object>p[7] is True
    if p[6] != NULL and <object>p[6] is not None:
        if type(<object>p[6]) is not float:
            return RULE_EAGER
        scale = intern_float(<object>p[6], ATTR_SDPA_SCALE_BITS)
        if scale < 0:
            return RULE_EAGER
    for i in range(n):
        if q.shape[i] == 0 or k.shape[i] == 0 or v.shape[i] == 0:
            return RULE_EAGER
    if q.shape[n - 1] != k.shape[n - 1] or k.shape[n - 2] != v.shape[n - 2] or gqa and n != 4:
        return RULE_RUN_EAGER
    out.ndim = n
    for i in range(n - 2):
        if k.shape[i] != v.shape[i]:
            return RULE_RUN_EAGER
        if gqa and i == 1:
            if q.shape[1] % k.shape[1] != 0:
                return RULE_RUN_EAGER
            out.shape[i] = q.shape[i]
        elif q.shape[i] == k.shape[i] or k.shape[i] == 1:
            out.shape[i] = q.shape[i]
        elif q.shape[i] == 1:
            out.shape[i] = k.shape[i]
        else:
            return RULE_RUN_EAGER
    out.shape[n - 2] = q.shape[n - 2]
    out.shape[n - 1] = v.shape[n - 1]
    if ops[3].kind != K_ABSENT:
        if not is_tensor(&ops[3]):
            return RULE_EAGER
        mask = ops[3].m
        if mask.ndim < 2 or mask.ndim > n:
            return RULE_RUN_EAGER
        for i in range(mask.ndim):
            # broadcast into (..., L, S)
            if mask.shape[i] != 1 and mask.shape[i] != (
                    k.shape[n - 2] if i == mask.ndim - 1 else out.shape[n - mask.ndim + i]):
                return RULE_RUN_EAGER
        if causal or mask.device != q.device or mask.dtype != 0 and mask.dtype != q.dtype:
            return RULE_EAGER             # (bool, or the query's dtype)
        out.requires_grad = out.requires_grad or mask.requires_grad and grad_enabled()
    attr[0] |= ((ATTR_SDPA_CAUSAL if causal else 0) | (ATTR_SDPA_GQA if gqa else 0)
                | scale << ATTR_SDPA_SCALE_SHIFT)
    return RULE_OK


cdef int native_mha_rule(int op, Operand *ops, PyObject **p, Meta *out, int *attr) except -1:
    # params: query, key, value, embed_dim, num_head, qkv_weight, qkv_bias,
    # proj_weight, proj_bias, mask, need_weights, average_attn_weights,
    # mask_type.  The call nn.MultiheadAttention's fast path makes for
    # self-attention without a mask or weights, in inference: query, key
    # and value one (B, T, E) tensor, the projections (3E, E), (3E), (E, E),
    # (E), one dtype and device, no autograd.  The result is (B, T, E) and
    # the call returns it with None (OPF_PAIR_WITH_NONE); the attr holds
    # num_head, and embed_dim is the query's size read when the graph runs.
    # Anything else is the generic path's (its analysis: eager's values
    # and errors).
    cdef Meta *q = ops[0].m
    cdef int64_t e, h
    if ops[1].obj != ops[0].obj or ops[2].obj != ops[0].obj or ops[9].kind != K_ABSENT:
        return RULE_EAGER
    if p[10] == NULL or <object>p[10] is not False:
        return RULE_EAGER
    if p[11] != NULL and type(<object>p[11]) is not bool:
        return RULE_EAGER
    if p[12] != NULL and <object>p[12] is not None:
        return RULE_EAGER
    cdef int overflow = 0
    if type(<object>p[3]) is not int or type(<object>p[4]) is not int:
        return RULE_EAGER
    e = PyLong_AsLongLongAndOverflow(<object>p[3], &overflow)
    h = PyLong_AsLongLongAndOverflow(<object>p[4], &overflow)
    if overflow or q.ndim != 3 or e != q.shape[2] or h <= 0 or h > 255 or e % h != 0 or e == 0:
        return RULE_EAGER
    # (key and value are the query: the node reads it three times)
    if not same_dtype_device(ops, 9, out) or not cat_ok(op, out.dtype) or out.requires_grad:
        return RULE_EAGER
    if not (shaped(&ops[5], 3 * e, e) and shaped(&ops[6], 3 * e, -1)
            and shaped(&ops[7], e, e) and shaped(&ops[8], e, -1)):
        return RULE_EAGER
    memcpy(out, q, sizeof(Meta))
    out.requires_grad = False
    attr[0] |= <int>h
    return RULE_OK


cdef inline bint shaped(Operand *o, int64_t rows, int64_t cols) noexcept:
    """Is operand o a (rows, cols) matrix, or where cols is -1 a (rows,)
    vector?"""
    if o.kind == K_ABSENT or o.m.ndim != (1 if cols < 0 else 2) or o.m.shape[0] != rows:
        return False
    return cols < 0 or o.m.shape[1] == cols
