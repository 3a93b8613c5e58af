# Where graphs are computed other than by mark_step(): per (reason, code,
# instruction offset) of the first frame outside fastlazy and torch, how
# many (fastlazy.metrics.flushes_by_site names them as file:line, for
# explain()).  Counted at every such flush, so here in C: the same walk in
# Python cost 0.9 us a flush, a tenth of a loop iteration that reads one
# value.  Keyed by the code's id (a code object's hash reads all of its
# bytecode and constants); the codes map keeps each code alive, so that its
# id stays its own.  No line is looked up here: a frame's line number scans
# its code's line table.

from cpython.ref cimport PyObject

cdef extern from "Python.h":
    ctypedef struct PyFrameObject
    PyFrameObject *PyEval_GetFrame()     # borrowed; NULL where no Python frame runs


cdef dict _site_counts = {}
cdef dict _site_codes = {}
cdef tuple _site_skip = ()


def set_flush_sites(dict counts, dict codes, tuple skip):
    """Count flush sites into `counts` ((reason, id(code), offset) -> n),
    keep each code alive in `codes` (id -> code), and skip frames whose
    file name starts with one of `skip` (fastlazy's and torch's
    directories)."""
    global _site_counts, _site_codes, _site_skip
    _site_counts, _site_codes, _site_skip = counts, codes, skip


cdef tuple user_site(object frame):
    """(code, instruction offset) of the first frame from `frame` outward
    whose file is not under one of the skipped directories; (None, 0) if
    there is none."""
    while frame is not None:
        code = frame.f_code
        if not code.co_filename.startswith(_site_skip):
            return code, frame.f_lasti
        frame = frame.f_back
    return None, 0


def first_user_site(frame):
    """user_site for Python (fastlazy.sites.where_called)."""
    return user_site(frame)


cdef int note_flush_site(str reason) except -1:
    cdef PyFrameObject *top = PyEval_GetFrame()
    code, offset = user_site(None if top == NULL else <object><PyObject *>top)
    # the code before its count: metrics.flushes_by_site reads them so
    if id(code) not in _site_codes:
        _site_codes[id(code)] = code
    key = (reason, id(code), offset)
    _site_counts[key] = _site_counts.get(key, 0) + 1
    return 0
