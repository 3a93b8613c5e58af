# The op table's C half: what each opcode's rule needs to know of its row
# (filled by fastlazy's boot from fastlazy.optable through register_op), and
# the matching of an entry point's arguments to the row's parameters.

cdef int8_t op_rule[MAX_OPS]
cdef int8_t op_cats[MAX_OPS]       # allowed categories (CAT_* mask)
cdef int8_t op_cuda_cats[MAX_OPS]  # those allowed on CUDA (fewer where its kernel takes fewer)
cdef uint16_t op_flags[MAX_OPS]
cdef int8_t op_nparams[MAX_OPS]
cdef int8_t op_noperands[MAX_OPS]  # leading params that are operands
cdef int8_t op_nrequired[MAX_OPS]
cdef int8_t op_npos[MAX_OPS]       # params that may be given positionally
cdef int8_t op_inplace_param[MAX_OPS]  # index of an `inplace=` flag param, or -1
cdef uint16_t op_nullable[MAX_OPS]     # bit i: operand i may be given as None
cdef uint16_t op_raw[MAX_OPS]            # bit i: param i is structure its rule reads itself
cdef int8_t op_choice_param[MAX_OPS]   # index of a param with a fixed set of values, or -1
cdef list _op_choices = [None] * MAX_OPS  # op -> tuple of the allowed values

# the rows x[index] records its steps with (basic indexing: view_rules.pxi)
cdef int select_op = -1, slice_op = -1, unsqueeze_op = -1
# the row of the copies reshape makes where it cannot view
cdef int reshape_copy_op = -1

cdef PyObject *op_params[MAX_OPS][MAX_PARAMS]
cdef list _op_param_names = []     # keeps the op_params strings alive
cdef int n_ops = 0
cdef object _str_input = "input"


def register_op(int op, int rule, int cats, int flags, tuple params,
                int noperands, int nrequired, int npos, int choice_param=-1,
                tuple choices=None, int nullable=0, int raw=0, int cuda_cats=-1):
    """Declare opcode `op` to the recorder (called by fastlazy.optable)."""
    global n_ops, select_op, slice_op, unsqueeze_op, reshape_copy_op
    if not 0 <= op < MAX_OPS or len(params) > MAX_PARAMS or not 0 <= rule < R_COUNT:
        raise ValueError(f"op {op}: bad row")
    op_rule[op] = rule
    op_cats[op] = cats
    op_cuda_cats[op] = cats if cuda_cats < 0 else cuda_cats
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
    if rule == R_SELECT and select_op < 0:
        select_op = op
    elif rule == R_SLICE and slice_op < 0:
        slice_op = op
    elif rule == R_UNSQUEEZE and unsqueeze_op < 0:
        unsqueeze_op = op
    elif rule == R_RESHAPE_COPY and reshape_copy_op < 0:
        reshape_copy_op = op


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
            if j < 0 and name == _str_input:
                # (never self=: no torch function or method takes its tensor
                # by that keyword, and eager refuses it; the generic path
                # then raises eager's TypeError)
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

