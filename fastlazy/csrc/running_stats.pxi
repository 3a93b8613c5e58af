# Batch norm in training with a module's running statistics, recorded in C
# where fastlazy/running_stats.py has seen the module before.
#
# running_stats.py finds the module whose buffers the statistics are (in the
# calling frames, once) and files it in its owners table: id(running mean)
# -> (weakref to the module, (mean's name, var's name), the module's dict of
# original buffer tensors while it holds pending ones).  A call here whose
# statistics are still that module's buffers, all of one dtype on the CPU,
# is recorded as running_stats.record would record it: aten's functional
# batch norm from its published signature, the module's buffers rebound to
# the pending statistics, their write-back after the graph's run.  Any other
# call (a first one, keywords, an int momentum, a batch of one value per
# channel, whose error eager raises) goes to running_stats.py.

cdef dict _stats_owners = None     # running_stats._owners
cdef object _functional_bn = None  # aten's _native_batch_norm_legit_functional
cdef object _stats_restore = None  # running_stats._restore
cdef object _partial = None        # functools.partial
cdef str _str_buffers = "_buffers"
cdef object _training = True      # (a Python object: the literal is a C int here)


def set_running_stats(dict owners, functional, restore):
    """Hand running_stats.py's owners table, aten's functional batch norm
    and the write-back to the core (once, at boot)."""
    global _stats_owners, _functional_bn, _stats_restore, _partial
    import functools
    _stats_owners, _functional_bn, _stats_restore = owners, functional, restore
    _partial = functools.partial


cdef object training_batch_norm(PyObject **args):
    """F.batch_norm(x, mean, var, weight, bias, True, momentum, eps), every
    argument positional, recorded here; None where running_stats.py must
    take it."""
    if _stats_owners is None:
        return None
    x, mean, var = <object>args[0], <object>args[1], <object>args[2]
    momentum, eps = <object>args[6], <object>args[7]
    if (type(x) is not LazyTensor or type(momentum) is not float or type(eps) is not float
            or mean is None or var is None):
        return None
    cdef Meta *m = &(<LazyTensor>x).meta
    if m.device != 0 or m.ndim < 2:
        return None
    known = _stats_owners.get(id(mean))
    if known is None:
        return None
    module = (<tuple>known)[0]()
    if module is None:
        return None
    names = <tuple>(<tuple>known)[1]
    originals = <dict>(<tuple>known)[2]
    buffers = getattr(module, _str_buffers)
    if type(buffers) is not dict:
        return None
    mean_name, var_name = names[0], names[1]
    if (<dict>buffers).get(mean_name) is not mean or (<dict>buffers).get(var_name) is not var:
        return None
    # a LazyTensor buffer only where this module put it (a step recorded
    # before the last one's graph ran), not one the user put there
    if (type(mean) is LazyTensor and mean_name not in originals
            or type(var) is LazyTensor and var_name not in originals):
        return None
    # (the tensors' dtypes and devices are part of the signature found
    # below, which only running_stats.py publishes, from calls whose
    # tensors it checked: one dtype, the CPU)
    cdef int k
    # eager's check of the batch (more than one value per channel)
    cdef int64_t per_channel = 1
    for k in range(m.ndim):
        if k != 1:
            per_channel *= m.shape[k]
    if per_channel == 1:
        return None
    # eager's check of the statistics and affine parameters: one value per
    # channel (aten's functional kernel reads past shorter ones)
    for k in range(1, 5):
        if args[k] != NULL and <object>args[k] is not None \
                and values_held(<object>args[k]) != m.shape[1]:
            return None
    cdef PyObject *vector[8]
    vector[0] = args[0]
    vector[1] = args[3]
    vector[2] = args[4]
    vector[3] = args[1]
    vector[4] = args[2]
    vector[5] = <PyObject*>_training
    vector[6] = args[6]
    vector[7] = args[7]
    found = fast_generic_hit(_functional_bn, vector, 8, None, False)
    if type(found) is not tuple or len(<tuple>found) != 5:
        return None               # (a signature not yet published: analysed there)
    rebind(<tuple>known, <dict>buffers, mean, var, <tuple>found)
    return (<tuple>found)[0]


cdef int64_t values_held(object t) except -2:
    """A tensor's number of elements (a LazyTensor's from its metadata);
    -1 for anything else."""
    if type(t) is LazyTensor:
        return numel_of(&(<LazyTensor>t).meta)
    if isinstance(t, torch.Tensor):
        return t.numel()
    return -1


def rebind_statistics(tuple known, dict buffers, mean, var, tuple found):
    """running_stats.py's rebind (the first call of a module, or one the
    core left to it): as rebind."""
    rebind(known, buffers, mean, var, found)


cdef int rebind(tuple known, dict buffers, object mean, object var, tuple found) except -1:
    """The module's buffers hold the pending statistics of `found` (the
    functional batch norm's five results) until its graph has run; their
    original tensors are kept (the first rebinding's, where a step recorded
    before the last one's graph ran) for the write-back scheduled here."""
    names, originals = <tuple>known[1], <dict>known[2]
    mean_name, var_name = names[0], names[1]
    new_mean, new_var = found[3], found[4]
    if mean_name not in originals:
        originals[mean_name] = mean
    if var_name not in originals:
        originals[var_name] = var
    buffers[mean_name] = new_mean
    buffers[var_name] = new_var
    # a second call of the module before the graph runs passes the pending
    # mean: known too, until the write-back forgets it
    _stats_owners[id(new_mean)] = known
    after_run(new_mean, _partial(_stats_restore, known[0], originals, names,
                                 (new_mean, new_var)))
    return 0
