# From an entry point's argument vector to a recorded node.
#
# fl_entry_vectorcall (_entry.h) calls lazy_call when some argument is a
# LazyTensor.  lazy_call matches the arguments to the op's parameters, sorts
# them into operands, applies the op's rule and records a node.  Anything it
# does not take (an unknown keyword such as out=, an argument type the rule
# does not cover, a call eager would reject) runs eagerly instead, so the
# result -- or the exception -- is eager's.


cdef extern from "Python.h":
    unsigned long PyType_GetFlags(PyTypeObject *tp)
    PyTypeObject *Py_TYPE(PyObject *o)
    int PyType_IsSubtype(PyTypeObject *a, PyTypeObject *b)
    PyTypeObject PyFloat_Type
    enum:
        Py_TPFLAGS_LONG_SUBCLASS
        Py_TPFLAGS_LIST_SUBCLASS
        Py_TPFLAGS_TUPLE_SUBCLASS
        Py_TPFLAGS_UNICODE_SUBCLASS
        Py_TPFLAGS_DICT_SUBCLASS

cdef unsigned long _NOT_TENSORS = (Py_TPFLAGS_LONG_SUBCLASS | Py_TPFLAGS_LIST_SUBCLASS
                                   | Py_TPFLAGS_TUPLE_SUBCLASS | Py_TPFLAGS_UNICODE_SUBCLASS
                                   | Py_TPFLAGS_DICT_SUBCLASS)
cdef object _disabled_torch_function = torch._C._disabled_torch_function_impl
cdef object _torch_function_enabled = torch._C._is_torch_function_enabled
cdef object _handle_torch_function = None      # torch.overrides', imported at first use


cdef bint overrides_torch_function(PyObject **args, Py_ssize_t total) except -1:
    """Is an argument an instance of a tensor subclass with its own
    __torch_function__ (a metadata-carrying tensor type), called with
    torch functions enabled?  Eager calls that first.  The common arguments
    are told apart by their type's pointer or flags, with no Python."""
    cdef PyTypeObject *tp
    cdef Py_ssize_t i
    for i in range(total):
        tp = Py_TYPE(args[i])
        if (tp == <PyTypeObject*>LazyTensor or tp == <PyTypeObject*>TensorType
                or tp == <PyTypeObject*>_Parameter or tp == &PyFloat_Type
                or args[i] == <PyObject*>None or PyType_GetFlags(tp) & _NOT_TENSORS
                or not PyType_IsSubtype(tp, <PyTypeObject*>TensorType)):
            continue
        if (getattr(<object>tp, "__torch_function__", None) is not _disabled_torch_function
                and _torch_function_enabled()):
            return True
    return False


cdef object subclass_first(object entry, PyObject **args, Py_ssize_t nargs, object kwnames):
    """The call as eager makes it beside a tensor subclass's
    __torch_function__: that is called, and the function it calls with
    LazyTensors records them.  A LazyTensor takes no part in the dispatch,
    as a plain tensor would not.  The function handed over is the entry
    point, not torch's own: torch.Tensor.__torch_function__ calls it with
    torch functions disabled for subclasses, where torch's own would not
    hand a LazyTensor to its __torch_function__."""
    global _handle_torch_function
    if _handle_torch_function is None:
        from torch.overrides import handle_torch_function
        _handle_torch_function = handle_torch_function
    pos = tuple([<object>args[i] for i in range(nargs)])
    kw = {} if kwnames is None else {
        kwnames[k]: <object>args[nargs + k] for k in range(len(kwnames))}
    relevant = [a for a in pos + tuple(kw.values())
                if type(a) is not LazyTensor and isinstance(a, TensorType)]
    return _handle_torch_function(entry, relevant, *pos, **kw)


cdef object lazy_call(object entry, PyObject **args, Py_ssize_t nargs, object kwnames):
    if overrides_torch_function(args, nargs + (0 if kwnames is None else len(kwnames))):
        return subclass_first(entry, args, nargs, kwnames)
    cdef int op = fl_entry_op(entry)
    cdef int form = fl_entry_form(entry)
    cdef PyObject *p[MAX_PARAMS]
    cdef Operand ops[MAX_PARAMS]
    cdef Meta out
    cdef int attr = 0, flags = 0, i, nops = op_noperands[op]
    cdef LazyTensor self_t = None
    cdef object leaf = None     # a leaf written under no_grad: its old value

    if (fl_saved_hooks or fl_dual_levels) and eager_only_now():
        return run_eager_only(entry, args, nargs, kwnames, form)
    if op < 0 or op_rule[op] == R_GENERIC or fl_autocast:
        # no C rule (a generic row, or a Tensor method without a row), or
        # autocast is on (it changes dtypes per op): the generic path
        # records it if it is pure, and runs it eagerly otherwise
        return call_generic(entry, args, nargs, kwnames, form)
    if R_VIEW <= op_rule[op] <= R_CONTIGUOUS or R_SQUEEZE <= op_rule[op] <= R_EXPAND:
        return view_call(entry, op, args, nargs, kwnames, form)
    if op_rule[op] == R_CAT:
        return cat_call(entry, op, args, nargs, kwnames, form)
    if op_rule[op] == R_SPLIT:
        return split_call(entry, op, args, nargs, kwnames, form)
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
        # (a required param past the operands is structure its rule reads:
        # pooling's kernel_size)
        if p[i] == NULL or i < nops and ops[i].kind == K_ABSENT and not op_raw[op] >> i & 1:
            return run_eager(entry, args, nargs, kwnames, form, "None for a required operand")
    if op_rule[op] == R_DROPOUT:
        if dropout_is_identity(p):
            return <object>p[0]
        # training: the noise is drawn at the call (dropout_draws.pxi, else
        # fastlazy.random_ops), so the generator advances as in eager; a bad
        # p: eager raises
        recorded = training_dropout(p)
        if recorded is not None:
            return recorded
        return call_generic(entry, args, nargs, kwnames, form, True)
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
        if (self_t.value is not None or self_t.family is not None or self_t.meta.inference
                or self_t.leaf_of is not None):
            # only a materialized value, a leaf's pending update (or a view's
            # root) can be a leaf; an inference tensor may also be pending
            _hooks.check_leaf(self_t)
            if self_t.meta.requires_grad:
                # a leaf that requires grad written under no_grad stays one:
                # recorded, its value made that leaf when it runs
                # (tensor.pxi pend_leaf); one with views (a tied `w.t()`)
                # runs eagerly, its views refreshed (fastlazy.mutation)
                leaf = written_leaf(self_t)
                if leaf is not None and self_t.family is not None:
                    return run_eager(entry, args, nargs, kwnames, form,
                                     "writes a leaf with views under no_grad")
        if self_t.family is None and self_t.value is not None and self_t.value._is_view():
            # a view of another tensor (made by an eager fallback such as
            # x[0] or x.view(-1)): writing through it must reach its base
            return run_eager(entry, args, nargs, kwnames, form, "in-place through a view")
    cdef int verdict = apply_rule(op, ops, nops, p, &out, &attr)
    if verdict == RULE_RUN_EAGER:
        return run_eager(entry, args, nargs, kwnames, form, "its C rule leaves it to eager")
    if verdict != RULE_OK:
        if op_rule[op] == R_BATCH_NORM and p[5] != NULL and <object>p[5] is True:
            # training: recorded with the module's statistics, here
            # (running_stats.pxi) or by fastlazy.running_stats (no signature
            # of this call is ever published)
            if nargs == 8 and kwnames is None:
                recorded = training_batch_norm(args)
                if recorded is not None:
                    return recorded
            pos, kw = split_arguments(args, nargs, kwnames)
            return _hooks.record_call(<object>fl_entry_orig(entry), entry.qualname, pos, kw,
                                      False, False)
        return call_generic(entry, args, nargs, kwnames, form,
                            not op_flags[op] & OPF_RULE_IN_GENERIC)
    if out.requires_grad and not (is_float(out.dtype) or is_complex(out.dtype)):
        # a comparison's bool, an integer result: eager's never requires grad
        out.requires_grad = 0
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
        flags |= NODE_WRITTEN
        if self_t.family is not None:
            if _hooks.check_write(self_t, [<object>ops[i].obj for i in range(nops)
                                           if ops[i].kind == K_LAZY]):
                return run_eager(entry, args, nargs, kwnames, form,
                                 "writes through a view whose elements overlap")
        record(op, ops, nops, &out, attr, flags, self_t)
        if leaf is not None:
            pend_leaf(self_t, leaf)
        if self_t.family is not None:
            # a view or a base of views: the write shows in the others
            _hooks.after_mutation(self_t)
        return self_t
    if op_flags[op] & OPF_PAIR_WITH_NONE:
        return (record(op, ops, nops, &out, attr, flags, None), None)
    return record(op, ops, nops, &out, attr, flags, None)


cdef object same_meta_binary(int op, PyObject **args, Meta *out):
    """The commonest call, `a op b` on two LazyTensors of one shape, dtype and
    device without autograd, skips argument matching and the general rules:
    broadcasting and promotion are the identity there.  None: take the
    general path."""
    if type(<object>args[0]) is not LazyTensor or type(<object>args[1]) is not LazyTensor:
        return None
    cdef int rule = op_rule[op], i
    if rule == R_DIV:
        rule = R_TRUEDIV        # two arguments: no rounding_mode (attr 0)
    if rule != R_BINARY and rule != R_TRUEDIV and rule != R_COMPARE:
        return None
    cdef Meta *a = &(<LazyTensor>args[0]).meta
    cdef Meta *b = &(<LazyTensor>args[1]).meta
    if (a.dtype != b.dtype or a.ndim != b.ndim or a.device != b.device
            or a.requires_grad or b.requires_grad or not cat_ok(op, a.dtype)
            or not equal_sizes(a.shape, b.shape, a.ndim)
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



cdef bint names_twice(PyObject **args, Py_ssize_t nargs, object kwnames) noexcept:
    """Is the first argument (a write's target) also another argument
    (`b.index_add_(0, i, b)`: eager's refusal, or its reading of what the
    write changes, is the Python path's)?"""
    cdef Py_ssize_t i, n = nargs + (0 if kwnames is None else PyTuple_GET_SIZE(kwnames))
    for i in range(1, n):
        if args[i] == args[0]:
            return True
    return False


cdef tuple split_arguments(PyObject **args, Py_ssize_t nargs, object kwnames):
    """An entry's argument vector as (positional tuple, keyword dict), for
    the Python-side paths."""
    pos = tuple([<object>args[i] for i in range(nargs)])
    kw = {}
    if kwnames is not None:
        for k in range(len(<tuple>kwnames)):
            kw[(<tuple>kwnames)[k]] = <object>args[nargs + k]
    return pos, kw


SAVED_HOOKS_OPEN = "saved-tensor hooks are open (torch.utils.checkpoint, save_on_cpu)"
FORWARD_AD_OPEN = "a forward-AD dual level is open (torch.autograd.forward_ad)"


cdef object run_eager_only(object entry, PyObject **args, Py_ssize_t nargs, object kwnames,
                           int form):
    """run_eager where the thread's state asks it (saved_hooks.pxi
    eager_only): apart from lazy_call, whose every call pays for each local
    it holds."""
    return run_eager(entry, args, nargs, kwnames, form, eager_only())


cdef object run_eager(object entry, PyObject **args, Py_ssize_t nargs, object kwnames,
                      int form, str reason):
    """Run the original torch callable on materialized arguments."""
    pos, kw = split_arguments(args, nargs, kwnames)
    return _hooks.run_eagerly(entry.__wrapped__, entry.qualname, pos, kw,
                              form == FORM_INPLACE, reason)


cdef object not_taken(object entry, PyObject **args, Py_ssize_t nargs, object kwnames,
                      int form, str reason):
    """A call its C rule's argument parsing does not take: the generic path,
    but in-place eagerly (before the checks that keep eager semantics for
    an eager self or a fallback's view have run)."""
    if form == FORM_INPLACE:
        return run_eager(entry, args, nargs, kwnames, form, reason)
    return call_generic(entry, args, nargs, kwnames, form,
                        not op_flags[fl_entry_op(entry)] & OPF_RULE_IN_GENERIC)


cdef object call_generic(object entry, PyObject **args, Py_ssize_t nargs, object kwnames,
                         int form, bint ruled=False):
    func = <object>fl_entry_orig(entry)
    fast = None
    if form != FORM_INPLACE:
        # a signature the generic path has seen and recorded before: its
        # node is appended here (generic_record.pxi), without Python --
        # found by the call's flat key, read off the argument vector (whose
        # first word holds the autocast state)
        fast = fast_generic_hit(func, args, nargs, kwnames, ruled)
        if fast is not None and type(fast) is not FastKey:
            return fast
        pos, kw = split_arguments(args, nargs, kwnames)
        return record_by_signature(func, entry.qualname, pos, kw, ruled, fast)
    if nargs and type(<object>args[0]) is LazyTensor:
        if writes_own_pending(<LazyTensor>args[0]):
            # a write to a pending result: from its published signature too
            return record_inplace(func, entry.qualname, args, nargs, kwnames, ruled)
        own = writes_own_value(<LazyTensor>args[0])
        if own is not None and not names_twice(args, nargs, kwnames):
            # a value's write (an optimizer's state, a parameter's update)
            return record_inplace(func, entry.qualname, args, nargs, kwnames, ruled,
                                  None if own is True else own)
    pos, kw = split_arguments(args, nargs, kwnames)
    return _hooks.record_call(func, entry.qualname, pos, kw, True, ruled)


def make_entry(object orig, str name, int op, int form):
    """A patched entry point for opcode `op` wrapping `orig`; op -1 makes an
    entry without a row (the other Tensor methods): with a lazy argument its
    calls take the generic path, without one they fall through to `orig`."""
    if not -1 <= op < n_ops:
        raise ValueError(f"unregistered op {op}")
    return fl_entry_new(orig, name, op, form)



cdef object _orig_to = None


def make_to_entry(orig):
    """Tensor.to that also understands the device string "lazy"."""
    global _orig_to
    _orig_to = orig
    return _tensor_to


def is_lazy_device(device):
    """Does `device` name the lazy device, as torch_xla- and
    torch._lazy-style code names it: "lazy", "lazy:0", torch.device("lazy")?"""
    kind = type(device)
    if kind is str:
        return device == "lazy" or (<str>device).startswith("lazy:")
    return kind is _torch_device and device.type == "lazy"


cdef object _torch_device = torch.device


def _tensor_to(self, *args, **kwargs):
    """Tensor.to, where a lazy device makes a LazyTensor of the tensor --
    converted first as the call's other arguments ask (`x.to("lazy",
    torch.float16)`, `x.to(device, non_blocking=True)`)."""
    if args:
        if is_lazy_device(args[0]):
            rest = args[1:]
            return lazy(_orig_to(self, *rest, **kwargs) if rest or kwargs else self)
    elif kwargs and is_lazy_device(kwargs.get("device")):
        del kwargs["device"]
        return lazy(_orig_to(self, **kwargs) if kwargs else self)
    if kwargs:
        return _orig_to(self, *args, **kwargs)
    return _orig_to(self, *args)
