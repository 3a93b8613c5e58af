# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# cython: embedsignature=True, binding=True
"""fastlazy's compiled core: LazyTensor, the node buffer, the rules and the
lazy-first entry points, in one translation unit so that `cdef inline` calls
cross the included files at C speed."""

cimport cython
import sys
import threading
from cpython.object cimport PyObject, PyTypeObject
from libc.stdint cimport int8_t, int16_t, int32_t, int64_t, uint64_t

cdef extern from "Python.h":
    void PyType_Modified(PyTypeObject *)

# The entry-point type, written in C (see _entry.h for why).
cdef extern from "_entry.h":
    ctypedef object (*fl_handler_t)(object, PyObject**, Py_ssize_t, object)
    int fl_entry_setup(type lazy_type, fl_handler_t handler,
                       int (*flush_pending)() except -1) except -1
    int fl_pending
    object fl_entry_new(object orig, object name, int op, int form)
    int fl_entry_op(object e)
    int fl_entry_form(object e)

include "dtypes.pxi"
include "counters.pxi"
include "rules.pxi"
include "segment.pxi"
include "tensor.pxi"
include "shape_rules.pxi"
include "dispatch.pxi"
include "flush.pxi"
include "generic_record.pxi"

cdef object _new_lock = threading.Lock
cdef object _enable_grad = None
cdef object _no_grad = None
cdef object _site_of_call = None


def init(fallback_module, graph_cache_module, site_of_call):
    """Bind torch and the Python-side helpers once (called by fastlazy)."""
    global _torch, _Size, _device_type, TensorType, _fallback, _graph_cache
    global _is_grad_enabled, _site_of_call, _enable_grad, _no_grad, _tensor_getitem
    import torch
    _tensor_getitem = torch.Tensor.__getitem__
    _torch = torch
    _Size = torch.Size
    _device_type = torch.device
    TensorType = torch.Tensor
    _is_grad_enabled = torch.is_grad_enabled
    _enable_grad = torch.enable_grad
    _no_grad = torch.no_grad
    _fallback = fallback_module
    _graph_cache = graph_cache_module
    _site_of_call = site_of_call
    init_dtypes()
    fl_entry_setup(LazyTensor, lazy_call, flush_pending)
    global _entry_type
    _entry_type = type(fl_entry_new(lazy, "probe", -1, 0))


def lazy(value):
    """A LazyTensor holding `value` (an eager tensor; not copied, never
    mutated: in-place ops on the LazyTensor rebind it to a new node)."""
    if type(value) is LazyTensor:
        return value
    if not isinstance(value, TensorType):
        raise TypeError(f"fastlazy.lazy() takes a torch.Tensor, not {type(value).__name__}")
    return wrap_value(value)


def lazy_or_eager(value):
    """lazy(value), or value itself if a LazyTensor cannot hold it (a dtype
    the rules do not cover, such as uint64 or float8, or more than MAX_NDIM
    dims): such results of eager fallbacks stay eager."""
    if type(value) is LazyTensor:
        return value
    t = try_wrap(value)
    return value if t is None else t


def rebind_value(LazyTensor t, value):
    """Point t at a new eager value (used by in-place ops run eagerly)."""
    detach_handle(t)
    if not meta_from_tensor(&t.meta, value):
        raise_cannot_hold(value)
    t._device = None
    t.value = value


def pending_in(LazyTensor t):
    """(segment, node index) of a pending LazyTensor, or None."""
    return None if t.seg is None else (t.seg, t.idx)


def dtype_of_code(int code):
    return DTYPES[code]


cdef object _orig_to = None


def make_to_entry(orig):
    """Tensor.to that also understands the device string "lazy"."""
    global _orig_to
    _orig_to = orig
    return _tensor_to


def _tensor_to(self, *args, **kwargs):
    if (len(args) == 1 and type(args[0]) is str and args[0] == "lazy" and not kwargs
            or not args and len(kwargs) == 1 and kwargs.get("device") == "lazy"):
        return lazy(self)
    if kwargs:
        return _orig_to(self, *args, **kwargs)
    return _orig_to(self, *args)
