# cython: boundscheck=False, wraparound=False
"""The native backend's executor: a graph as a flat list of steps that a C
loop runs over one list of values.

A step is one torch call with its argument tuple built in C from constants
and earlier values (CallStep), a Python closure for the few lowerings that
are not a single call (PyStep), or fastlazy's own one-row linear kernel
(LinearStep).  fastlazy.backends.native decides which; this file only runs
them.  A call here costs about what eager's call of the same op costs,
torch's argument parsing included (TorchScript's interpreter, which skips
the parsing, is a little cheaper per op): what the executor buys is a place
to run kernels TorchScript cannot call.
"""
from cpython.dict cimport PyDict_Copy, PyDict_SetItem
from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM
from libc.stdlib cimport free, malloc

import torch

cdef extern from "Python.h":
    # kw may be NULL (no keywords), which cpython.object's declaration cannot say
    object PyObject_Call(object callable, object args, PyObject *kw)

cdef extern from "small_linear.h":
    int FL_ACT_NONE
    int FL_ACT_RELU
    int FL_HAVE_AVX2_PATH
    int fl_use_avx2()
    int fl_avx2                  # the vector path's switch (tests turn it off)
    int _cpu_has_avx2 "fl_cpu_has_avx2"()
    void fl_linear_f32(const float *x, const float *w, const float *b, float *y,
                       Py_ssize_t M, Py_ssize_t N, Py_ssize_t K, int act)

ACT_NONE = FL_ACT_NONE
ACT_RELU = FL_ACT_RELU

cdef Py_ssize_t _kernel_calls = 0


def kernel_calls():
    """How many linear layers the kernel has computed since the last
    reset_kernel_calls() (fastlazy.metrics' kernel_layers)."""
    return _kernel_calls


def reset_kernel_calls():
    global _kernel_calls
    _kernel_calls = 0


def use_vector_kernel(bint on):
    """Switch between the AVX2 kernel and the portable one (for tests: both
    must agree with eager).  Returns whether the vector kernel was in use;
    turning it on where the CPU lacks AVX2 keeps the portable one."""
    global fl_avx2
    if not FL_HAVE_AVX2_PATH:
        return False
    was = fl_use_avx2()
    fl_avx2 = on and _cpu_has_avx2()
    return bool(was)

cdef object _to = torch._C.TensorBase.to        # never fastlazy's entry point
# w's dtype and device (float32, CPU), whatever torch's defaults are set to
cdef object _new_empty = torch._C.TensorBase.new_empty
# The kernel reads the whole weight once per row: above this many weight
# elements the product is memory-bound and the BLAS (threaded) is as good.
cdef Py_ssize_t KERNEL_MAX_WEIGHT = 1 << 20


cdef class Step:
    cdef Py_ssize_t out          # where the value goes in the values list
    cdef Py_ssize_t nfrees
    cdef Py_ssize_t *frees       # values last read by this step: dropped after it

    def set_frees(self, list frees):
        free(self.frees)
        self.frees, self.nfrees = NULL, 0
        self.frees = <Py_ssize_t *>malloc(max(len(frees), 1) * sizeof(Py_ssize_t))
        if self.frees == NULL:
            raise MemoryError()
        for i, index in enumerate(frees):
            self.frees[i] = index
        self.nfrees = len(frees)

    def __dealloc__(self):
        free(self.frees)

    cdef object run(self, list values, bint exclusive):
        """The step's value.  exclusive: no other call of the program is
        running (another thread may enter while torch releases the GIL),
        so buffers the program keeps between calls are free to use."""
        raise NotImplementedError


cdef class CallStep(Step):
    """fn(*args, **kwargs) where some arguments are earlier values: `args`
    and `kwargs` hold the constants, `holes` says which entries to fill."""
    cdef object fn
    cdef tuple args
    cdef dict kwargs
    cdef tuple kwarg_names       # keyword holes: names, in hole order
    cdef Py_ssize_t nargs, nholes, nkwholes
    cdef Py_ssize_t *hole_pos    # argument position of each positional hole
    cdef Py_ssize_t *hole_src    # value index of each hole, keyword holes last
    cdef object cast             # dtype to cast the result to, or None

    def __cinit__(self, Py_ssize_t out, fn, tuple args, list holes, dict kwargs,
                  list kwholes, cast):
        self.out, self.fn, self.args, self.cast = out, fn, args, cast
        self.kwargs = kwargs or None
        self.nargs, self.nholes, self.nkwholes = len(args), len(holes), len(kwholes)
        self.kwarg_names = tuple(name for name, _ in kwholes)
        n = self.nholes + self.nkwholes
        self.hole_pos = <Py_ssize_t *>malloc(max(n, 1) * sizeof(Py_ssize_t))
        self.hole_src = <Py_ssize_t *>malloc(max(n, 1) * sizeof(Py_ssize_t))
        if self.hole_pos == NULL or self.hole_src == NULL:
            raise MemoryError()
        for i, (pos, src) in enumerate(holes):
            self.hole_pos[i], self.hole_src[i] = pos, src
        for i, (_, src) in enumerate(kwholes):
            self.hole_src[self.nholes + i] = src

    def __dealloc__(self):
        # (Cython runs Step's __dealloc__ after this one)
        free(self.hole_pos)
        free(self.hole_src)

    cdef object run(self, list values, bint exclusive):
        cdef Py_ssize_t i
        cdef object item
        cdef tuple args = PyTuple_New(self.nargs)
        for i in range(self.nargs):
            item = self.args[i]
            Py_INCREF(item)
            PyTuple_SET_ITEM(args, i, item)
        for i in range(self.nholes):
            # replace the placeholder constant: drop its reference first
            item = values[self.hole_src[i]]
            Py_INCREF(item)
            _replace(args, self.hole_pos[i], item)
        kwargs = self.kwargs
        if self.nkwholes:
            kwargs = PyDict_Copy(self.kwargs) if self.kwargs is not None else {}
            for i in range(self.nkwholes):
                PyDict_SetItem(kwargs, self.kwarg_names[i], values[self.hole_src[self.nholes + i]])
        value = PyObject_Call(self.fn, args, <PyObject *>kwargs if kwargs is not None else NULL)
        if self.cast is not None:
            value = _to(value, self.cast)
        return value


cdef extern from *:
    """
    /* Swap item i of a tuple under construction, releasing the old one. */
    static void fl_tuple_replace(PyObject *t, Py_ssize_t i, PyObject *item) {
        PyObject *old = PyTuple_GET_ITEM(t, i);
        PyTuple_SET_ITEM(t, i, item);
        Py_XDECREF(old);
    }
    """
    void _replace "fl_tuple_replace" (object t, Py_ssize_t i, object item)


cdef class PyStep(Step):
    """A Python closure over the values list, for lowerings that are not one
    call (nested calls, detached operands, generic aten programs)."""
    cdef object compute

    def __cinit__(self, Py_ssize_t out, compute):
        self.out, self.compute = out, compute

    cdef object run(self, list values, bint exclusive):
        return self.compute(values)


cdef class LinearStep(Step):
    """act(linear(x, w, b)) for float32 CPU tensors recorded without
    autograd.  A one-row x takes fastlazy's kernel; anything else (more
    rows, non-contiguous operands, a large weight) calls `fallback`, torch's
    own functions, with the same arguments.

    `keep`: the result is an intermediate only other LinearSteps read (they
    copy nothing out of it and alias nothing), so one buffer, allocated on
    the first call, serves every call; an allocation costs as much as a
    quarter of the kernel."""
    cdef Py_ssize_t x, w, b
    cdef int act
    cdef object fallback         # (x, w, b) -> act(linear(x, w, b))
    cdef tuple lead              # x's leading sizes when it is one row: (1,) * (rank - 1)
    cdef bint keep
    cdef object kept             # the buffer, once allocated
    cdef Py_ssize_t kept_n       # its last size

    def __cinit__(self, Py_ssize_t out, Py_ssize_t x, Py_ssize_t w, Py_ssize_t b, int act,
                  fallback, Py_ssize_t rank, bint keep):
        self.out, self.x, self.w, self.b, self.act, self.fallback = out, x, w, b, act, fallback
        self.lead, self.keep = (1,) * (rank - 1), keep

    cdef object run(self, list values, bint exclusive):
        x, w = values[self.x], values[self.w]
        b = values[self.b] if self.b >= 0 else None
        cdef Py_ssize_t n, k
        n, k = w.shape
        if not (k > 0 and n * k <= KERNEL_MAX_WEIGHT and x.numel() == k
                and (b is None or (b.numel() == n and b.is_contiguous()))
                and x.is_contiguous() and w.is_contiguous()):
            return self.fallback(x, w, b)
        y = self.kept
        if y is None or not exclusive or self.kept_n != n:
            y = _new_empty(w, *self.lead, n)
            if self.keep and exclusive:
                self.kept, self.kept_n = y, n
        cdef size_t bp = b.data_ptr() if b is not None else 0
        global _kernel_calls
        _kernel_calls += 1
        fl_linear_f32(<const float *><size_t>x.data_ptr(), <const float *><size_t>w.data_ptr(),
                      <const float *>bp, <float *><size_t>y.data_ptr(), 1, n, k, self.act)
        return y


cdef class StepProgram:
    """The compiled graph: call it with the graph's inputs."""
    cdef list steps
    cdef Py_ssize_t ninputs, nvalues
    cdef tuple outputs           # value indices of the graph's outputs
    cdef bint running

    def __init__(self, Py_ssize_t ninputs, Py_ssize_t nvalues, list steps, tuple outputs):
        self.ninputs, self.nvalues, self.steps, self.outputs = ninputs, nvalues, steps, outputs

    def __call__(self, *inputs):
        cdef list values = list(inputs)
        cdef Step step
        cdef Py_ssize_t i
        cdef bint exclusive = not self.running
        if len(values) != self.ninputs:
            raise TypeError(f"graph takes {self.ninputs} inputs, got {len(values)}")
        values.extend([None] * (self.nvalues - self.ninputs))
        self.running = True
        try:
            for step in self.steps:
                values[step.out] = step.run(values, exclusive)
                # an intermediate dies at its last reader, as in eager: a long
                # chain of large tensors must not hold every one of them
                for i in range(step.nfrees):
                    values[step.frees[i]] = None
        finally:
            if exclusive:
                self.running = False
        return [values[i] for i in self.outputs]
