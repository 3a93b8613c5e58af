# Guards (csrc/guards.h): the stand-ins for torch's Python-level functions
# and tensor attributes that eager code calls all the time and fastlazy
# must see only in a rare case -- an argument holding a LazyTensor, nodes
# pending, a gate's "no" to give.  The rare case is a Python function;
# the common one goes to torch's own in C.

from functools import partial as _partial

cdef extern from "guards.h":
    int GUARD_LAZY, GUARD_WRITES, GUARD_GATES, GUARD_DATA
    int fl_gates_open
    int fl_holds_lazy(object v, int depth) except -1
    int fl_data_lazy(object v)
    object fl_guard_new(object orig, object slow, int when)
    object fl_tensor_attr_new(object base, object slow, int writes)
    int fl_guards_setup(object partial_type, int (*writes_matter)() except -1) except -1


cdef int _writes_matter() except -1:
    # (fl_pending alone may be another thread's: it stays set once several
    # threads have recorded)
    if fl_watching:
        return 1
    cdef Segment seg = peek_segment()
    return seg is not None and seg.n > 0


fl_guards_setup(_partial, _writes_matter)
GUARD_TYPE = type(fl_guard_new(len, len, GUARD_LAZY))


def has_lazy(values):
    """Is any of `values` a LazyTensor, or holds one in a list, tuple or
    dict, or in the arguments of a functools.partial (where
    fallback.materialize looks)?"""
    for v in values:
        if fl_holds_lazy(v, 0):
            return True
    return False


def data_holds_lazy(data):
    """A LazyTensor at the top of `data`, among its top-level items, or
    along its first elements (torch.tensor([[x0, x1]])): where torch's
    constructors would meet one (not every element of a long list)."""
    return fl_data_lazy(data) != 0


def lazy_arguments_first(original, on_lazy):
    """A callable calling `original(*args, **kwargs)`, or `on_lazy(...)`
    where an argument holds a LazyTensor (as has_lazy looks)."""
    return fl_guard_new(original, on_lazy, GUARD_LAZY)


def data_lazy_first(original, on_lazy):
    """A callable calling `original(...)`, or `on_lazy(...)` where an
    argument holds a LazyTensor as data_holds_lazy looks (torch's
    constructors and factories)."""
    return fl_guard_new(original, on_lazy, GUARD_DATA)


def writes_seen(method, on_pending):
    """A callable calling `method(...)`, or `on_pending(...)` while nodes
    are pending or storages watched (what the call may write is then
    computed first: torch.ops calls)."""
    return fl_guard_new(method, on_pending, GUARD_WRITES)


def gated(check, on_open):
    """A callable calling `check(...)`, or `on_open(...)` while some
    thread's gate has a "no" to give (python_bodies)."""
    return fl_guard_new(check, on_open, GUARD_GATES)


def gates_opened(int change):
    """Count gates with a "no" to give, over all threads (+1 when one is
    set, -1 when it is taken or cleared)."""
    global fl_gates_open
    fl_gates_open += change
    if fl_gates_open < 0:
        fl_gates_open = 0


def tensor_attribute(descriptor, on_lazy, bint writes=False):
    """A descriptor standing for torch.Tensor's C attribute `descriptor`:
    reads are torch's own; a write of a LazyTensor (or, with `writes`, any
    write while nodes are pending or storages watched) calls
    `on_lazy(tensor, value)` instead of torch's setter."""
    return fl_tensor_attr_new(descriptor, on_lazy, writes)
