# A compiled program specialized to its inputs' sizes is called only when a
# call's tensors have them.  Checked in Python (a torch.Size per tensor,
# then a tuple of them hashed) that cost about 220 ns a tensor: 11 us a call
# of a GPT-2 graph's 49 inputs, 45 us of mobilenet_v3_small's 245.  Here the
# sizes are compared in C, read by the C++ reader where it is installed.

from cpython.mem cimport PyMem_Malloc, PyMem_Free


cdef class ShapeGuard:
    """ShapeGuard(inputs): `guard.matches(other)` says whether `other` (a
    tuple as long as `inputs`) holds a tensor of the same sizes at each
    position where `inputs` holds a torch.Tensor.  Other positions are not
    looked at (a scalar's 0-dim tensor always has the same sizes)."""

    cdef Py_ssize_t length      # of the inputs
    cdef Py_ssize_t count       # tensors among them
    cdef Py_ssize_t *positions  # of the tensors
    cdef int *ranks
    cdef int64_t *sizes         # every tensor's sizes, one after the other

    def __cinit__(self, inputs):
        inputs = tuple(inputs)
        self.length = len(inputs)
        tensors = [(k, tuple(t.shape)) for k, t in enumerate(inputs)
                   if isinstance(t, TensorType)]
        self.count = len(tensors)
        cdef Py_ssize_t total = sum(len(shape) for _, shape in tensors)
        self.positions = <Py_ssize_t *>PyMem_Malloc(max(self.count, 1) * sizeof(Py_ssize_t))
        self.ranks = <int *>PyMem_Malloc(max(self.count, 1) * sizeof(int))
        self.sizes = <int64_t *>PyMem_Malloc(max(total, 1) * sizeof(int64_t))
        if self.positions == NULL or self.ranks == NULL or self.sizes == NULL:
            raise MemoryError()
        cdef Py_ssize_t i, j, at = 0
        for i in range(self.count):
            k, shape = tensors[i]
            self.positions[i] = k
            self.ranks[i] = len(shape)
            for j in range(len(shape)):
                self.sizes[at] = shape[j]
                at += 1

    def __dealloc__(self):
        PyMem_Free(self.positions)
        PyMem_Free(self.ranks)
        PyMem_Free(self.sizes)

    def matches(self, tuple inputs):
        if PyTuple_GET_SIZE(inputs) != self.length:
            return False
        cdef Py_ssize_t i, at = 0
        cdef object t
        for i in range(self.count):
            t = <object>PyTuple_GET_ITEM(inputs, self.positions[i])
            if not same_sizes(t, self.sizes + at, self.ranks[i]):
                return False
            at += self.ranks[i]
        return True


cdef bint same_sizes(object t, const int64_t *sizes, int rank) except -1:
    """Has the tensor `t` these sizes?  (False for anything not a tensor.)"""
    cdef fl_tensor_facts facts
    cdef int64_t read[MAX_NDIM]
    cdef int nd, j
    if type(t) is TensorType or type(t) is _Parameter:
        if read_tensor != NULL:
            nd = read_tensor(<PyObject *>t, &facts, read, NULL, MAX_NDIM)
            if nd >= 0:
                if nd != rank:
                    return False
                for j in range(rank):
                    if read[j] != sizes[j]:
                        return False
                return True
        if _fast_eager:
            return same_as_size(tensor_get(_get_shape, t), sizes, rank)
    elif not isinstance(t, TensorType):
        return False
    return same_as_size(tuple(t.shape), sizes, rank)


cdef bint same_as_size(object shape, const int64_t *sizes, int rank) except -1:
    # (a torch.Size: a tuple)
    if PyTuple_GET_SIZE(shape) != rank:
        return False
    cdef int j
    for j in range(rank):
        if <int64_t>(<object>PyTuple_GET_ITEM(shape, j)) != sizes[j]:
            return False
    return True
