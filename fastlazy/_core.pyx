# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# cython: embedsignature=True, binding=True
"""fastlazy's compiled core: LazyTensor, the node buffer, the rules and the
lazy-first entry points, in one translation unit so that `cdef inline` calls
cross the included files at C speed.

The parts, in csrc/, in the order a call goes through them:

    _entry.h            the patched entry point (C): a LazyTensor argument?
    dispatch.pxi        lazy_call: match the arguments, apply the rule, record
    optable.pxi         what each opcode's rule needs of its op-table row
    operands.pxi        arguments sorted into operands with their metadata
    rules.pxi           every shape and dtype rule
    dtypes.pxi          dtype codes and type promotion tables
    segment.pxi         the node buffer: record() appends a node
    tensor.pxi          LazyTensor, and the installers of its methods
    generic_record.pxi  the C half of the generic path (calls with no rule)
    flush.pxi           a value is needed: key the live graph, run it
    counters.pxi        the hot counters and their Python API
    input_guard.pxi     ShapeGuard: a compiled program's input sizes checked in C
    patch_wrappers.pxi  the C halves of the patches installed at Python level

_core.pxd declares the constants the core shares with Python, the types, and
the functions the parts call across files.  The core calls up into Python
only through the one Hooks object that fastlazy's boot installs.
"""

cimport cython
import operator
import sys
import threading
import weakref
import warnings

import torch
from cpython.object cimport PyObject, PyTypeObject
from cpython.exc cimport PyErr_WriteUnraisable
from cpython.pythread cimport PyThread_get_thread_ident
from libc.stdint cimport int8_t, int16_t, int32_t, int64_t, uint16_t, uint64_t, uintptr_t

cdef extern from "Python.h":
    void PyType_Modified(PyTypeObject *)

# The entry-point type, written in C (see csrc/_entry.h for why).
cdef extern from "_entry.h":
    ctypedef object (*fl_handler_t)(object, PyObject**, Py_ssize_t, object)
    int fl_entry_setup(type lazy_type, fl_handler_t handler,
                       int (*flush_pending)(PyObject *) except -1) except -1
    int fl_pending
    int fl_watching
    object fl_entry_new(object orig, object name, int op, int form)
    int fl_entry_op(object e)
    int fl_entry_form(object e)
    PyObject *fl_entry_orig(object e)
    int fl_flush_written(PyObject *written) except -1

# torch, bound once to C variables: no module dictionary lookups per call
cdef object _torch = torch
cdef object _Size = torch.Size
cdef object _device_type = torch.device
cdef object _enable_grad = torch.enable_grad
cdef object _no_grad = torch.no_grad
cdef object _InferenceMode = torch._C._InferenceMode
cdef object _strided = torch.strided
cdef object _operator_index = operator.index
cdef object _new_lock = threading.Lock


cdef inline object _inference_mode():
    # torch's own context, not torch.inference_mode: that one fastlazy
    # patches to count contexts (segment.pxi's fl_inference_hint)
    return _InferenceMode(True)


include "csrc/counters.pxi"
include "csrc/dtypes.pxi"
include "csrc/optable.pxi"
include "csrc/operands.pxi"
include "csrc/rules.pxi"
include "csrc/segment.pxi"
include "csrc/tensor.pxi"
include "csrc/families.pxi"
include "csrc/view_rules.pxi"
include "csrc/dispatch.pxi"
include "csrc/generic_record.pxi"
include "csrc/saved_hooks.pxi"
include "csrc/running_stats.pxi"
include "csrc/dropout_draws.pxi"
include "csrc/flush_sites.pxi"
include "csrc/flush.pxi"
include "csrc/throttle.pxi"
include "csrc/input_guard.pxi"
include "csrc/patch_wrappers.pxi"


# -- the upward interface --

@cython.final
cdef class Hooks:
    def __init__(self, **functions):
        for name, value in functions.items():
            setattr(self, name, value)

    def missing(self):
        """Names of the hooks not set yet (the fields _core.pxd declares)."""
        return [name for name, field in vars(Hooks).items()
                if type(field) is _getset_descriptor and getattr(self, name) is None]


cdef object _getset_descriptor = type(type.__dict__["__dict__"])

cdef Hooks _hooks = None


def install(Hooks hooks):
    """Install the Python functions the core calls (once, from the boot)."""
    global _hooks, _move_to_end
    missing = hooks.missing()
    if missing:
        raise ValueError(f"fastlazy core hooks not set: {', '.join(missing)}")
    hooks.atoms = frozenset(hooks.atoms)
    _hooks = hooks
    _move_to_end = hooks.programs.move_to_end


# -- set up at import: the dtype tables and the entry type --

init_dtypes()
# (the cast: C's handler takes `PyObject *const *`, which Cython's
# PyObject** is in all but name; gcc 14 refuses the implicit conversion)
fl_entry_setup(LazyTensor, <fl_handler_t>lazy_call, flush_pending)
cdef object _entry_type = type(fl_entry_new(sys.intern, "probe", -1, 0))
ENTRY_TYPE = _entry_type      # the type of every entry point enable() installs


# -- making LazyTensors --

def lazy(value):
    """A LazyTensor holding `value` (an eager tensor; never mutated: in-place
    ops on the LazyTensor rebind it to a new node, also where `value` is a
    view of another tensor).  Not copied, unless it
    is laid out other than contiguously or channels-last (permuted, a slice
    with steps): a LazyTensor that is not a view is traced as contiguous,
    and its views are placed in its contiguous layout, so such a value is
    made contiguous first.  (Channels-last is kept: the ops that take it
    run eager's channels-last kernels on it.)"""
    if type(value) is LazyTensor:
        return value
    if not isinstance(value, TensorType):
        raise TypeError(f"fastlazy.lazy() takes a torch.Tensor, not {type(value).__name__}")
    if value.layout is not _strided:
        raise TypeError(f"fastlazy cannot hold a tensor of layout {value.layout} (a "
                        f"LazyTensor's metadata is strided); keep it eager")
    if not value.is_contiguous() and not (
            value.dim() == 4 and value.is_contiguous(memory_format=_torch.channels_last)
            or value.dim() == 5 and value.is_contiguous(memory_format=_torch.channels_last_3d)):
        value = value.contiguous()
    elif value._is_view() and not value.requires_grad:
        # a view of another tensor (a slice of a batch): held through an
        # alias of its memory that is no view, so that a write to the
        # LazyTensor rebinds it, as for any other tensor, rather than
        # writing through to the base (the path of a view an eager
        # fallback made, whose writes eager's base must see)
        value = _torch.empty(0, dtype=value.dtype, device=value.device).set_(
            value.untyped_storage(), value.storage_offset(), value.size(), value.stride())
    return wrap_value(value)


def lazy_or_eager(value):
    """lazy(value), or value itself if a LazyTensor cannot hold it (a dtype
    the rules do not cover, such as uint64 or float8, or more than MAX_NDIM
    dims): such results of eager fallbacks stay eager."""
    if type(value) is LazyTensor:
        return value
    if value.layout is not _strided:
        return value            # sparse, mkldnn...: metadata a LazyTensor has not
    t = try_wrap(value)
    return value if t is None else t


def rebind_value(LazyTensor t, value):
    """Point t at a new eager value (used by in-place ops run eagerly)."""
    cdef Meta m
    if not meta_from_tensor(&m, value):
        raise_cannot_hold(value)
    memcpy(&t.meta, &m, sizeof(Meta))
    t._device = None
    detach_handle(t, value)


def flush_reading(written):
    """Compute the pending nodes that may read the memory of `written` (an
    eager tensor, or a list or tuple of them) before something writes it
    that no entry point sees: a `.data` assignment, a storage write,
    torch.ops, swap_tensors (watch.py)."""
    if fl_pending or fl_watching:
        fl_flush_written(<PyObject*>written)


def pending_in(LazyTensor t):
    """(segment, node index) of a pending LazyTensor, or None."""
    return None if t.seg is None else (t.seg, t.idx)


def dtype_of_code(int code):
    return DTYPES[code]
