# From an entry point's argument vector to a recorded node.
#
# fl_entry_vectorcall (_entry.h) calls lazy_call when some argument is a
# LazyTensor.  lazy_call matches the arguments to the op's parameters, sorts
# them into operands, applies the op's rule and records a node.  Anything it
# does not take (an unknown keyword such as out=, an argument type the rule
# does not cover, a call eager would reject) runs eagerly instead, so the
# result -- or the exception -- is eager's.

cdef enum Form:
    FORM_CALL = 0       # torch.X(input, ...), Tensor.X(self, ...), operators
    FORM_INPLACE = 1    # Tensor.X_(self, ...), __iX__: rebinds self

# Rules: what kind of shape/dtype logic an op needs.  Op-table rows name one.
cdef enum Rule:
    R_UNARY = 0         # same dtype as the input
    R_UNARY_FLOAT = 1   # integral inputs compute in the default float dtype
    R_ABS = 2           # complex inputs give their real dtype
    R_BINARY = 3        # result_type of the operands (alpha checked)
    R_TRUEDIV = 4       # result_type, integral -> default float
    R_DIV = 5           # div with rounding_mode
    R_COMPARE = 6       # bool result
    R_POW = 7
    R_CLAMP = 8
    R_REDUCE = 9        # sum, mean, amax, amin: dim / keepdim / dtype
    R_SOFTMAX = 10      # softmax, log_softmax: dim / dtype
    R_MM = 11
    R_BMM = 12
    R_MATMUL = 13
    R_LINEAR = 14
    R_RTRUEDIV = 15     # other / self, as eager computes it: self.reciprocal() * other
    R_LAYER_NORM = 16   # normalized_shape is structure, read by the rule
    R_DROPOUT = 17      # the input itself when not training (eager returns it)
    R_GENERIC = 18      # no C rule: the meta-signature path (fastlazy.generic)
    R_COUNT = 19

# Op flags (op table `flags`).
cdef enum OpFlags:
    OPF_NO_BOOL = 1        # a bool operand makes eager raise (sub)
    OPF_TENSORS_ONLY = 2   # every operand must be a tensor (maximum)
    OPF_INT_TO_INT64 = 8   # reductions: integral inputs accumulate in int64
    OPF_EMPTY_ERROR = 16   # reductions: eager raises on an empty reduction

cdef enum:
    MAX_OPS = 512
    MAX_PARAMS = 5

cdef int8_t op_rule[MAX_OPS]
cdef int8_t op_cats[MAX_OPS]       # allowed categories (CAT_* mask)
cdef int8_t op_flags[MAX_OPS]
cdef int8_t op_nparams[MAX_OPS]
cdef int8_t op_noperands[MAX_OPS]  # leading params that are operands
cdef int8_t op_nrequired[MAX_OPS]
cdef int8_t op_npos[MAX_OPS]       # params that may be given positionally
cdef int8_t op_inplace_param[MAX_OPS]  # index of an `inplace=` flag param, or -1
cdef int8_t op_nullable[MAX_OPS]       # bit i: operand i may be given as None
cdef int8_t op_raw[MAX_OPS]            # bit i: param i is structure its rule reads itself
cdef int8_t op_choice_param[MAX_OPS]   # index of a param with a fixed set of values, or -1
cdef list _op_choices = [None] * MAX_OPS  # op -> tuple of the allowed values

cdef enum:
    ATTR_CHOICE_SHIFT = 24   # attr bits 24-27: index of the choice param's value
cdef PyObject *op_params[MAX_OPS][MAX_PARAMS]
cdef list _op_param_names = []     # keeps the op_params strings alive
cdef int n_ops = 0
cdef object _str_input = "input"
cdef object _str_self = "self"


def register_op(int op, int rule, int cats, int flags, tuple params,
                int noperands, int nrequired, int npos, int choice_param=-1,
                tuple choices=None, int nullable=0, int raw=0):
    """Declare opcode `op` to the recorder (called by fastlazy.optable)."""
    global n_ops
    if not 0 <= op < MAX_OPS or len(params) > MAX_PARAMS or not 0 <= rule < R_COUNT:
        raise ValueError(f"op {op}: bad row")
    op_rule[op] = rule
    op_cats[op] = cats
    op_flags[op] = flags
    op_nparams[op] = len(params)
    op_noperands[op] = noperands
    op_nrequired[op] = nrequired
    op_npos[op] = npos
    op_inplace_param[op] = params.index("inplace") if "inplace" in params else -1
    op_choice_param[op] = choice_param
    op_nullable[op] = nullable
    op_raw[op] = raw
    _op_choices[op] = choices
    for i, name in enumerate(params):
        name = sys.intern(name)
        _op_param_names.append(name)
        op_params[op][i] = <PyObject*>name
    n_ops = max(n_ops, op + 1)


cdef int parse_args(int op, PyObject **args, Py_ssize_t nargs, object kwnames,
                    PyObject **p) except -1:
    cdef int n = op_nparams[op], i, j
    cdef Py_ssize_t k
    if nargs > op_npos[op]:
        return 0
    for i in range(n):
        p[i] = args[i] if i < nargs else NULL
    if kwnames is not None:
        for k in range(len(<tuple>kwnames)):
            name = (<tuple>kwnames)[k]
            j = -1
            for i in range(n):
                if <PyObject*>name == op_params[op][i] or name == <object>op_params[op][i]:
                    j = i
                    break
            if j < 0 and (name == _str_input or name == _str_self):
                j = 0
            if j < 0 or p[j] != NULL:
                return 0
            p[j] = args[nargs + k]
    for i in range(op_nrequired[op]):
        if p[i] == NULL:
            return 0
    return 1


cdef inline bint cat_ok(int op, int dtype) noexcept:
    return (op_cats[op] & category[dtype]) != 0


cdef int choice_of(int op, PyObject **p) except -2:
    """Index of the choice param's value among the row's choices; -1 if it
    is not one of them (eager judges the call)."""
    cdef PyObject *v = p[op_choice_param[op]]
    if v == NULL:
        return 0                   # not given: the row's first value is the default
    value = <object>v
    if value is not None and type(value) is not str:
        return -1
    try:
        return (<tuple>_op_choices[op]).index(value)
    except ValueError:
        return -1


cdef int apply_rule(int op, Operand *ops, int nops, PyObject **p, Meta *out,
                    int *attr) except -1:
    """Fill out (and attr) for an accepted call; RULE_EAGER otherwise."""
    cdef int rule = op_rule[op], flags = op_flags[op], i, d
    cdef Operand recip
    if not is_tensor(&ops[0]):
        return RULE_EAGER              # torch.add(2, x) and the like: eager
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
    if R_MM <= rule <= R_LINEAR:
        return matmul_rule(op, rule, ops, out)
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


cdef object lazy_call(object entry, PyObject **args, Py_ssize_t nargs, object kwnames):
    cdef int op = fl_entry_op(entry)
    cdef int form = fl_entry_form(entry)
    cdef PyObject *p[MAX_PARAMS]
    cdef Operand ops[MAX_PARAMS]
    cdef Meta out
    cdef int attr = 0, flags = 0, i, nops = op_noperands[op]
    cdef LazyTensor self_t = None

    if op < 0 or op_rule[op] == R_GENERIC or fl_autocast:
        # no C rule (a generic row, or a Tensor method without a row), or
        # autocast is on (it changes dtypes per op): the generic path
        # records it if it is pure, and runs it eagerly otherwise
        return call_generic(entry, args, nargs, kwnames, form)
    if nargs == 2 and kwnames is None and form == FORM_CALL:
        fast = same_meta_binary(op, args, &out)
        if fast is not None:
            return fast
    # A call the C rule does not take (an argument pattern, type or value
    # it does not cover) goes to the generic path, which records it if it
    # is pure and eager accepts it, and runs it eagerly otherwise.  In-place
    # calls the rule refuses only after the checks below that keep eager
    # semantics (an eager self, a fallback's view).
    if not parse_args(op, args, nargs, kwnames, p):
        return not_taken(entry, args, nargs, kwnames, form, "argument pattern (keywords, count, out=)")
    cdef int kind
    for i in range(nops):
        if p[i] == NULL or op_raw[op] >> i & 1:
            ops[i].kind = K_ABSENT
            continue
        kind = classify(&ops[i], p[i])
        # 0: a type no rule takes; 2: None, where the param may not be None
        if kind == 0 or kind == 2 and not (op_nullable[op] >> i & 1):
            return not_taken(entry, args, nargs, kwnames, form, "argument type")
    for i in range(op_nrequired[op]):
        if p[i] == NULL or ops[i].kind == K_ABSENT and not op_raw[op] >> i & 1:
            return run_eager(entry, args, nargs, kwnames, form, "None for a required operand")
    if op_rule[op] == R_DROPOUT:
        if dropout_is_identity(p):
            return <object>p[0]
        # training: random, so eager at the call (the generator advances as
        # in eager); a bad p: eager raises
        return run_eager(entry, args, nargs, kwnames, form,
                         "dropout in training (random), or arguments eager must judge")
    if op_inplace_param[op] >= 0 and p[op_inplace_param[op]] != NULL:
        # torch.nn.functional's `inplace=True` is the in-place form
        flag = <object>p[op_inplace_param[op]]
        if flag:
            form = FORM_INPLACE
        if type(flag) is not bool:
            return run_eager(entry, args, nargs, kwnames, form, "non-bool inplace flag")
    if form == FORM_INPLACE:
        # Only a LazyTensor self is rebound; an eager tensor mutated by a
        # lazy argument keeps eager semantics (run_eager).
        if ops[0].kind != K_LAZY:
            return run_eager(entry, args, nargs, kwnames, form, "in-place on an eager tensor")
        self_t = <LazyTensor>p[0]
        if self_t.meta.requires_grad and (self_t.value is not None or self_t.family is not None):
            # only a materialized value (or a view's root) can be a leaf
            _views.check_leaf(self_t)
        if self_t.family is None and self_t.value is not None and self_t.value._is_view():
            # a view of another tensor (made by an eager fallback such as
            # x[0] or x.view(-1)): writing through it must reach its base
            return run_eager(entry, args, nargs, kwnames, form, "in-place through a view")
    if apply_rule(op, ops, nops, p, &out, &attr) != RULE_OK:
        return call_generic(entry, args, nargs, kwnames, form, True)
    if not out.requires_grad:
        for i in range(nops):
            if is_tensor(&ops[i]) and ops[i].m.requires_grad:
                flags = NODE_DETACH
    if self_t is not None:
        # eager refuses in-place abs on complex tensors
        if not inplace_fits(&out, &self_t.meta) or op_rule[op] == R_ABS and is_complex(self_t.meta.dtype):
            return run_eager(entry, args, nargs, kwnames, form, "in-place result does not fit self")
        if out.dtype != self_t.meta.dtype:
            flags |= NODE_CAST
            out.dtype = self_t.meta.dtype
        if self_t.family is not None:
            _views.check_write(self_t, [<object>ops[i].obj for i in range(nops)
                                        if ops[i].kind == K_LAZY])
        record(op, ops, nops, &out, attr, flags, self_t)
        if self_t.family is not None:
            # a view or a base of views: the write shows in the others
            _views.after_mutation(self_t)
        return self_t
    return record(op, ops, nops, &out, attr, flags, None)


cdef object same_meta_binary(int op, PyObject **args, Meta *out):
    """The commonest call, `a op b` on two LazyTensors of one shape, dtype and
    device without autograd, skips argument matching and the general rules:
    broadcasting and promotion are the identity there.  None: take the
    general path."""
    if type(<object>args[0]) is not LazyTensor or type(<object>args[1]) is not LazyTensor:
        return None
    cdef int rule = op_rule[op], i
    if rule != R_BINARY and rule != R_TRUEDIV and rule != R_COMPARE:
        return None
    cdef Meta *a = &(<LazyTensor>args[0]).meta
    cdef Meta *b = &(<LazyTensor>args[1]).meta
    if (a.dtype != b.dtype or a.ndim != b.ndim or a.device != b.device
            or a.requires_grad or b.requires_grad or not cat_ok(op, a.dtype)
            or memcmp(a.shape, b.shape, a.ndim * sizeof(int64_t)) != 0
            or op_flags[op] & OPF_NO_BOOL and a.dtype == 0):
        return None
    if rule == R_TRUEDIV and is_integral(a.dtype):
        return None
    memcpy(out, a, sizeof(Meta))
    if rule == R_COMPARE:
        out.dtype = 0
    # the same operands the general path would record (alpha absent), so
    # both paths give one node and one structural hash
    cdef Operand ops[MAX_PARAMS]
    ops[0].kind = K_LAZY
    ops[0].obj = args[0]
    ops[0].m = a
    ops[1].kind = K_LAZY
    ops[1].obj = args[1]
    ops[1].m = b
    for i in range(2, op_noperands[op]):
        ops[i].kind = K_ABSENT
    return record(op, ops, op_noperands[op], out, 0, 0, None)


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


cdef tuple split_arguments(PyObject **args, Py_ssize_t nargs, object kwnames):
    """An entry's argument vector as (positional tuple, keyword dict), for
    the Python-side paths."""
    pos = tuple([<object>args[i] for i in range(nargs)])
    kw = {}
    if kwnames is not None:
        for k in range(len(<tuple>kwnames)):
            kw[(<tuple>kwnames)[k]] = <object>args[nargs + k]
    return pos, kw


cdef object run_eager(object entry, PyObject **args, Py_ssize_t nargs, object kwnames,
                      int form, str reason):
    """Run the original torch callable on materialized arguments."""
    pos, kw = split_arguments(args, nargs, kwnames)
    return _fallback.run_entry_eagerly(entry, form == FORM_INPLACE, pos, kw, reason)


cdef object not_taken(object entry, PyObject **args, Py_ssize_t nargs, object kwnames,
                      int form, str reason):
    """A call its C rule's argument parsing does not take: the generic path,
    but in-place eagerly (before the checks that keep eager semantics for
    an eager self or a fallback's view have run)."""
    if form == FORM_INPLACE:
        return run_eager(entry, args, nargs, kwnames, form, reason)
    return call_generic(entry, args, nargs, kwnames, form, True)


cdef object call_generic(object entry, PyObject **args, Py_ssize_t nargs, object kwnames,
                         int form, bint ruled=False):
    pos, kw = split_arguments(args, nargs, kwnames)
    return _generic.call(entry.__wrapped__, entry.qualname, pos, kw, form == FORM_INPLACE,
                         ruled)


def make_entry(object orig, str name, int op, int form):
    """A patched entry point for opcode `op` wrapping `orig`; op -1 makes an
    entry that always runs eagerly (Tensor methods without a row)."""
    if not -1 <= op < n_ops:
        raise ValueError(f"unregistered op {op}")
    return fl_entry_new(orig, name, op, form)


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
