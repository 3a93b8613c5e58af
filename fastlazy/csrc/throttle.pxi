# A thread that runs compilers (fastlazy/compile_worker.py) holds the GIL
# for as long as the interpreter lets it: the user's thread, asking for it
# back, waits up to the switch interval (5 ms) each time.  throttle_this_thread
# installs a C profile hook on the calling thread that, every `run_us` of
# the thread's running time, releases the GIL and sleeps `sleep_us`: the
# compile gets at most run/(run+sleep) of a core and of the GIL, and the
# user's thread takes the GIL at once while it sleeps.  The hook costs a
# counter per Python call; the clock is read every 256 calls.

cdef extern from "Python.h":
    ctypedef struct PyFrameObject:
        pass
    ctypedef int (*Py_tracefunc)(PyObject *, PyFrameObject *, int, PyObject *) noexcept
    void PyEval_SetProfile(Py_tracefunc func, PyObject *obj)
from posix.time cimport clock_gettime, timespec, CLOCK_MONOTONIC
from posix.unistd cimport usleep

cdef long _throttle_run_ns = 0
cdef unsigned int _throttle_sleep_us = 0
# per thread, but only the compile thread installs the hook
cdef long _throttle_since = 0
cdef unsigned int _throttle_events = 0


cdef inline long monotonic_ns() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec * 1000000000 + ts.tv_nsec


cdef int throttle_hook(PyObject *obj, PyFrameObject *frame, int what,
                       PyObject *arg) noexcept:
    global _throttle_events, _throttle_since
    _throttle_events += 1
    if _throttle_events & 255:
        return 0
    if _throttle_run_ns == 0:
        return 0
    cdef long now = monotonic_ns()
    if now - _throttle_since < _throttle_run_ns:
        return 0
    with nogil:
        usleep(_throttle_sleep_us)
    _throttle_since = monotonic_ns()
    return 0


def throttle_this_thread():
    """Install the hook on the calling thread (fastlazy.compile_worker's);
    set_throttle() sets its limit."""
    global _throttle_since
    _throttle_since = monotonic_ns()
    PyEval_SetProfile(throttle_hook, NULL)


def set_throttle(int run_us, int sleep_us):
    """Limit the hooked thread to about run_us of every run_us + sleep_us
    microseconds; run_us <= 0 lifts the limit (the hook then only counts)."""
    global _throttle_run_ns, _throttle_sleep_us
    _throttle_run_ns = run_us * 1000 if run_us > 0 else 0
    _throttle_sleep_us = sleep_us if run_us > 0 else 0
