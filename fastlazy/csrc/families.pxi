# Views of LazyTensors, the part a recorded call touches (fastlazy/views.py
# has the rest): a view's Member -- its root and its place in the root's
# storage, kept as C arrays so that a generic signature reads it without
# building tuples -- and a root's Family, its live views held weakly.
#
# A view holds its root strongly (as eager's `_base`); the root holds its
# views through plain weak references (no callbacks): dead ones are pruned
# as the list grows, so nothing forms a reference cycle.

from cpython.weakref cimport PyWeakref_NewRef, PyWeakref_GetObject


@cython.final
cdef class Family:
    """On a root: its live views."""
    cdef list refs                  # weakref.ref of each view (some dead)
    cdef Py_ssize_t prune_at        # prune the dead ones at this length

    def __cinit__(self):
        self.refs = []
        self.prune_at = 8

    cdef void add_view(self, object view) except *:
        cdef Py_ssize_t n = len(self.refs)
        if n >= self.prune_at:
            self.refs = [r for r in self.refs if PyWeakref_GetObject(r) != <PyObject*>None]
            n = len(self.refs)
            self.prune_at = 8 if 2 * n < 8 else 2 * n
        self.refs.append(PyWeakref_NewRef(view, None))

    def add(self, view):
        self.add_view(view)

    def discard(self, view):
        """Forget `view` (compared by identity: == on LazyTensors is an op)."""
        self.refs = [r for r in self.refs
                     if PyWeakref_GetObject(r) != <PyObject*>view
                     and PyWeakref_GetObject(r) != <PyObject*>None]

    cdef bint has_live_views(self):
        for r in self.refs:
            if PyWeakref_GetObject(r) != <PyObject*>None:
                return True
        return False

    @property
    def members(self):
        """The live views (a list, taken now)."""
        cdef PyObject *p
        out = []
        for r in self.refs:
            p = PyWeakref_GetObject(r)
            if p != <PyObject*>None:
                out.append(<object>p)
        return out


@cython.final
cdef class Member:
    """On a view: its root, its place in the root's storage (size,
    stride, offset relative to the root's contiguous layout) and how its
    values follow from the elements there (flags: ViewFlag)."""
    cdef public object root
    cdef public object family
    cdef public int flags
    cdef public int64_t offset
    cdef int ndim
    cdef int64_t size_[MAX_NDIM]
    cdef int64_t stride_[MAX_NDIM]
    # the eager view of the root's value the view was made holding
    # (view_rules' view_of_value), or None: while the view holds that very
    # tensor, calls taking it are keyed and traced as on an eager tensor of
    # its layout, whatever its offset (is_held)
    cdef public object held

    def __init__(self, root, family, geometry, int flags):
        self.root = root
        self.family = family
        self.size, self.stride, self.offset = geometry
        self.flags = flags

    @property
    def detached(self):
        """A view of a .detach(): autograd does not see writes through it."""
        return bool(self.flags & VIEW_DETACHED)

    @property
    def conj(self):
        """Its values are conjugated (a conj() view; see ViewFlag)."""
        return bool(self.flags & VIEW_CONJ)

    @property
    def size(self):
        return tuple([self.size_[i] for i in range(self.ndim)])

    @size.setter
    def size(self, value):
        value = tuple(value)
        if len(value) > MAX_NDIM:
            raise ValueError("a view of more than MAX_NDIM dims")
        self.ndim = len(value)
        for i in range(self.ndim):
            self.size_[i] = value[i]

    @property
    def stride(self):
        return tuple([self.stride_[i] for i in range(self.ndim)])

    @stride.setter
    def stride(self, value):
        value = tuple(value)
        if len(value) != self.ndim:
            raise ValueError("a view's stride has one entry per dim of its size")
        for i in range(self.ndim):
            self.stride_[i] = value[i]


cdef inline bint is_held(LazyTensor t) noexcept:
    """Does view t hold the eager view of its root's value it was made
    with (not rebound since: a write to it or to its root rebinds it)?"""
    family = t.family
    return (type(family) is Member and (<Member>family).held is not None
            and t.value is (<Member>family).held)


def held(t):
    """is_held, from Python: True for a view that holds an eager view of
    its root's value (a slice of a lazy dataset), which calls key and
    trace as an eager tensor of its layout."""
    return type(t) is LazyTensor and is_held(<LazyTensor>t)


cdef inline int64_t numel_of(Meta *m) noexcept:
    cdef int64_t n = 1
    for i in range(m.ndim):
        n *= m.shape[i]
    return n


cdef inline int64_t root_numel_as(Member m, int dtype) noexcept:
    """The root's element count in units of `dtype`, the dtype of a view of
    it: a view's geometry counts in its own elements (as torch's strides and
    storage offset do), which differ from the root's for a dtype view
    (x.view(torch.uint8))."""
    cdef Meta *root = &(<LazyTensor>m.root).meta
    return numel_of(root) * itemsize[root.dtype] // itemsize[dtype]


cdef int attach_view(LazyTensor view, object base, int ndim, int64_t *size,
                     int64_t *stride, int64_t offset, int flags) except -1:
    """Make `view` (just recorded from `base`) a view of base's root, at
    the given place in the root's storage; `flags` (ViewFlag) say how its
    values follow from base's: composed with base's own (a view of a
    detached view is detached; a conj() of a conj() view is not conjugated)."""
    cdef Member m
    family = (<LazyTensor>base).family
    if type(family) is Member:
        root = (<Member>family).root
        flags = ((flags | (<Member>family).flags) & VIEW_DETACHED) | (
            (flags ^ (<Member>family).flags) & VIEW_CONJ)
    else:
        root = base
    if type((<LazyTensor>root).family) is not Family:
        (<LazyTensor>root).family = Family.__new__(Family)
    m = Member.__new__(Member)
    # Untracked by the cycle collector, as a pending LazyTensor is: a
    # Member holds its root and the root's Family, which holds its views
    # only weakly, so it closes no cycle -- and a model makes one per view
    # per call, which would otherwise trigger collections.
    PyObject_GC_UnTrack(<PyObject*>m)
    m.root = root
    m.family = (<LazyTensor>root).family
    m.flags = flags
    m.offset = offset
    m.ndim = ndim
    memcpy(m.size_, size, ndim * sizeof(int64_t))
    memcpy(m.stride_, stride, ndim * sizeof(int64_t))
    view.family = m
    (<Family>m.family).add_view(view)
    return 0


def attach(LazyTensor view, LazyTensor base, where, int flags):
    """Make `view` (just recorded from `base`) a view of base's root;
    `where`: its (size, stride, offset) in the root's storage; `flags`:
    ViewFlag, relative to base."""
    cdef int64_t size[MAX_NDIM]
    cdef int64_t stride[MAX_NDIM]
    sz, st, offset = where
    if len(sz) > MAX_NDIM or len(st) != len(sz):
        raise ValueError("a view's place out of range")
    for i in range(len(sz)):
        size[i] = sz[i]
        stride[i] = st[i]
    attach_view(view, base, len(sz), size, stride, offset, flags)


def geometry(t):
    """(root numel in the view's elements, stride, offset) of a view, for
    generic signatures; None for anything else."""
    if type(t) is not LazyTensor:
        return None
    family = (<LazyTensor>t).family
    if type(family) is not Member:
        return None
    return (root_numel_as(<Member>family, (<LazyTensor>t).meta.dtype), (<Member>family).stride,
            (<Member>family).offset)
