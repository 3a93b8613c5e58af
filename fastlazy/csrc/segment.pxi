# The node buffer: a segment of recorded nodes, typed C structs.
#
# Each thread records into its own current segment (threads never append to
# one buffer).  A flush hands the segment off (the thread's next record starts
# a fresh one) and only then runs it, so recording goes on while a graph
# runs, and an exception in a run leaves the current segment untouched.
# Another thread may flush a segment (it read a LazyTensor pending there);
# the owner thread then simply records into a fresh one.
#
# Python may run in the middle of any of this: a finalizer, a weakref
# callback or a signal handler runs at any allocation or reference drop, and
# may record, read or drop LazyTensors of the very segment being appended to.
# So record() does everything that can run Python before it touches the
# buffer, re-checks the segment is still recording, and then appends with C
# code only; references are let go (which can run finalizers) only once the
# buffer is consistent again.

from libc.stdlib cimport malloc, realloc, free
from libc.string cimport memcpy, memcmp, memset
from cpython.pythread cimport PyThread_get_thread_ident
from cpython.list cimport PyList_GET_ITEM, PyList_SET_ITEM, PyList_GET_SIZE
from cpython.ref cimport Py_INCREF, Py_XDECREF

cdef extern from "Python.h":
    void PyObject_GC_Track(void *op)
    void PyObject_GC_UnTrack(void *op)
    int PyObject_GC_IsTracked(PyObject *op)
    Py_ssize_t refcount "Py_REFCNT" (PyObject *op)
    # the calling thread's state: one load (PyThread_get_thread_ident
    # costs several ns per recorded op)
    void *this_thread "_PyThreadState_UncheckedGet" ()

cdef extern from "handle_alloc.h":
    int fl_handle_pending_next      # the next LazyTensor allocated stays untracked
    void fl_handle_install(object lazy_tensor_type)

cdef enum SegState:
    SEG_RECORDING = 0
    SEG_RUNNING = 1
    SEG_DONE = 2
    SEG_FAILED = 3

cdef uint64_t _next_epoch = 1
# Added to a slot's use count when the slot caches a LazyTensor's value
# (operand_ref): see Segment.kill.
cdef int32_t SLOT_HELD = 1 << 30
# A slot's use count that never reaches 0 or SLOT_HELD: kept until the flush.
cdef int32_t SLOT_KEPT = 1 << 29
# The current segment of thread _current_thread: a one-entry cache in front
# of the per-thread storage, so the hot path pays a thread-id compare.
cdef Segment _current = None
cdef void *_current_thread = NULL     # its thread's state
cdef object _thread_segments = threading.local()
cdef object _weakref = weakref.ref
# Set once a second thread records: eager writes can no longer skip the
# pending-read check on the strength of one thread's empty segment.
cdef bint _many_threads = False
cdef unsigned long _first_thread = 0
cdef Py_ssize_t flush_threshold = 10000
cdef bint _record_sites = False


cdef inline uint64_t rotl(uint64_t x, int r) noexcept:
    return (x << r) | (x >> (64 - r))

cdef inline uint64_t mix(uint64_t h, uint64_t v) noexcept:
    # One round of xxhash64's accumulator; two lanes with different seeds
    # make the 128-bit structural hash.
    h ^= rotl(v * 0xC2B2AE3D27D4EB4FULL, 31) * 0x9E3779B185EBCA87ULL
    return rotl(h, 27) * 0x9E3779B185EBCA87ULL + 0x85EBCA77C2B2AE63ULL


# In the cycle collector (a failed segment keeps its exception, whose
# traceback keeps frames that hold LazyTensors, which hold the segment), but
# never cleared by it: LazyTensors of a garbage cycle still reach their
# nodes while they are freed, and other members of any such cycle (frames,
# dicts, lists) break it.
@cython.no_gc_clear
cdef class Segment:
    def __cinit__(self):
        global _next_epoch
        self.cap = 64
        self.nodes = <Node*>malloc(self.cap * sizeof(Node))
        self.slot_cap = 16
        self.slot_keys = <uint64_t*>malloc(self.slot_cap * sizeof(uint64_t))
        self.slot_hash = <uint64_t*>malloc(self.slot_cap * sizeof(uint64_t))
        self.slot_version = <int64_t*>malloc(self.slot_cap * sizeof(int64_t))
        self.slot_uses = <int32_t*>malloc(self.slot_cap * sizeof(int32_t))
        if (self.nodes == NULL or self.slot_keys == NULL or self.slot_hash == NULL
                or self.slot_version == NULL or self.slot_uses == NULL):
            raise MemoryError()
        self.n = 0
        self.nslots = 0
        self.epoch = _next_epoch
        _next_epoch += 1
        self.inputs = []
        self.state = SEG_RECORDING
        self.sites = [] if _record_sites else None
        self.slot_addresses = set()
        self.slots_seen = 0
        self.slot_unknown = False
        self.after_run = None
        self.default_dtype = -1

    def __dealloc__(self):
        free(self.nodes)
        free(self.slot_keys)
        free(self.slot_hash)
        free(self.slot_version)
        free(self.slot_uses)

    def __len__(self):
        return self.n

    cdef Node *append(self) except NULL:
        cdef Node *grown
        if self.n == self.cap:
            grown = <Node*>realloc(self.nodes, 2 * self.cap * sizeof(Node))
            if grown == NULL:
                raise MemoryError()
            self.nodes = grown
            self.cap *= 2
        self.n += 1
        return &self.nodes[self.n - 1]

    cdef int32_t add_slot(self, object value, uint64_t key, Meta *m, int64_t version) except -1:
        """Append an external input: `value` of SlotKey `key`; for a tensor
        its metadata m and its version counter (VERSION_UNREAD: read here)."""
        cdef uint64_t *grown
        cdef int64_t *grown_versions
        cdef int32_t *grown_uses
        cdef uint64_t h
        if self.nslots == self.slot_cap:
            grown = <uint64_t*>realloc(self.slot_keys, 2 * self.slot_cap * sizeof(uint64_t))
            if grown == NULL:
                raise MemoryError()
            self.slot_keys = grown
            grown = <uint64_t*>realloc(self.slot_hash, 2 * self.slot_cap * sizeof(uint64_t))
            if grown == NULL:
                raise MemoryError()
            self.slot_hash = grown
            grown_versions = <int64_t*>realloc(self.slot_version,
                                               2 * self.slot_cap * sizeof(int64_t))
            if grown_versions == NULL:
                raise MemoryError()
            self.slot_version = grown_versions
            grown_uses = <int32_t*>realloc(self.slot_uses, 2 * self.slot_cap * sizeof(int32_t))
            if grown_uses == NULL:
                raise MemoryError()
            self.slot_uses = grown_uses
            self.slot_cap *= 2
        self.inputs.append(value)
        self.slot_keys[self.nslots] = key
        # The slot's type, not its index: which slot feeds which node is
        # numbered canonically at flush (flush.pxi), so slots that dead
        # nodes left behind never change a graph's key.
        h = mix(key, 0x51)
        if _key_shapes and m != NULL:
            # the backend compiles per shape: the shape is structure too
            for i in range(m.ndim):
                h = mix(h, <uint64_t>m.shape[i])
        self.slot_hash[self.nslots] = h
        # An input mutated in place between recording and flushing would be
        # read with its new contents; the version counter tells.
        self.slot_uses[self.nslots] = 0
        self.slot_version[self.nslots] = -1
        if m != NULL and version != VERSION_UNREAD:
            self.slot_version[self.nslots] = version
        elif m != NULL:
            try:
                self.slot_version[self.nslots] = (
                    tensor_get(_get_version, value) if _fast_eager and (
                        type(value) is TensorType or type(value) is _Parameter)
                    else value._version)
            except RuntimeError:
                pass        # inference tensors keep no version counter
        self.nslots += 1
        return self.nslots - 1

    cdef void drop_owner(self, int32_t idx) noexcept:
        """The LazyTensor of node idx is gone, or holds something else now.
        Its owner pointer is cleared whatever the state: a failed segment
        outlives its handles, and its recovery (_recover_all) walks the
        owners, so a pointer left to a freed handle would be read.  In a
        recording segment a node that nothing consumes is dead too (kill),
        and dead nodes at the end of the buffer are dropped: code that
        records and discards (a trace-only loop, a result never read) keeps
        the buffer empty instead of filling it, and holds none of the eager
        tensors it read."""
        if idx >= self.n:
            return      # released after its run: no node is read again
        self.nodes[idx].owner = NULL
        if self.state != SEG_RECORDING:
            return      # a running or failed segment's nodes are read: kept
        if self.nodes[idx].uses == 0:
            self.kill(idx)

    cdef void kill(self, int32_t idx) noexcept:
        """Node idx has no owner and no consumer, so nothing can need it
        again: it lets go of its inputs, and inputs left the same way die
        too.  Iterative (a chain of 30,000 dead nodes must not recurse), and
        the eager values of slots no live node reads are dropped only at the
        end, when the buffer is consistent: dropping one may run a
        finalizer, which may record into this very segment."""
        cdef int32_t local[32]          # the common case: no malloc
        cdef int32_t *stack = local
        cdef int32_t top = 0, cap = 32, i, k, r
        cdef int32_t *grown
        cdef Node *nd
        cdef PyObject *local_drop[8]
        cdef PyObject **drop = local_drop
        cdef int32_t ndrop = 0, dropcap = 8
        cdef PyObject **grown_drop
        cdef bint have_inputs = self.inputs is not None
        stack[top] = idx
        top += 1
        self.nodes[idx].flags |= NODE_DEAD
        while top > 0:
            top -= 1
            nd = &self.nodes[stack[top]]
            for k in range(nd.nin):
                r = nd.inputs[k]
                if r >= 0:
                    self.nodes[r].uses -= 1
                    if (self.nodes[r].uses == 0 and self.nodes[r].owner == NULL
                            and not self.nodes[r].flags & NODE_DEAD):
                        if top == cap:
                            grown = <int32_t*>malloc(2 * cap * sizeof(int32_t))
                            if grown == NULL:
                                continue        # it stays, unread, until the flush
                            memcpy(grown, stack, cap * sizeof(int32_t))
                            if stack != local:
                                free(stack)
                            stack = grown
                            cap *= 2
                        self.nodes[r].flags |= NODE_DEAD
                        stack[top] = r
                        top += 1
                else:
                    self.slot_uses[~r] -= 1
                    # No live node reads the slot: let go of its value.  The
                    # slot of a LazyTensor's value serves that LazyTensor's
                    # next op, so it keeps the value while it lives.
                    if have_inputs and (self.slot_uses[~r] == 0 or (
                            self.slot_uses[~r] == SLOT_HELD
                            and refcount(PyList_GET_ITEM(self.inputs, ~r)) == 1)):
                        if ndrop == dropcap:
                            grown_drop = <PyObject**>malloc(2 * dropcap * sizeof(PyObject*))
                            if grown_drop == NULL:
                                continue        # kept until the flush
                            memcpy(grown_drop, drop, dropcap * sizeof(PyObject*))
                            if drop != local_drop:
                                free(drop)
                            drop = grown_drop
                            dropcap *= 2
                        # the slot's value, swapped for None; released below
                        drop[ndrop] = PyList_GET_ITEM(self.inputs, ~r)
                        ndrop += 1
                        Py_INCREF(None)
                        PyList_SET_ITEM(self.inputs, ~r, None)
        if stack != local:
            free(stack)
        while self.n > 0 and self.nodes[self.n - 1].flags & NODE_DEAD:
            self.n -= 1
        if self.sites is not None and len(self.sites) > self.n:
            try:
                del self.sites[self.n:]
            except BaseException:
                pass
        for i in range(ndrop):
            Py_XDECREF(drop[i])
        if drop != local_drop:
            free(drop)

    cdef int check_versions(self, tuple slots) except -1:
        cdef Py_ssize_t k
        cdef int32_t s
        for k in range(len(slots)):
            s = slots[k]
            if self.slot_version[s] >= 0 and self.inputs[s]._version != self.slot_version[s]:
                v = self.inputs[s]
                raise RuntimeError(
                    f"fastlazy: a tensor of shape {tuple(v.shape)} and dtype {v.dtype} was "
                    f"modified in place after a lazy op used it, so the pending result "
                    f"would read the new contents.  Call fastlazy.mark_step() (or read "
                    f"the lazy result) before modifying tensors that lazy ops use.")
        return 0

    def _check_versions(self, slots):
        """Python entry for the cache-miss path (graph_cache.run)."""
        self.check_versions(tuple(slots))

    cdef void release(self) noexcept:
        # After a run nothing may point into the nodes any more; drop the
        # inputs so finished segments hold no tensors alive.
        self.inputs = None
        self.sites = None
        self.slot_addresses = None
        self.n = 0
        self.nslots = 0

    cdef bint may_read(self, object written) except -1:
        """May a node of this segment read memory of the eager tensor
        `written`?  Yes if one of its input slots shares the storage (a view
        of it, a `.data` alias, the tensor itself), or if that cannot be
        told.  The storages of the slots are looked up once per segment, into
        a set: an eager write per layer (BatchNorm's num_batches_tracked)
        costs the same in a long segment as in a short one."""
        cdef Py_ssize_t k
        cdef object address = _storage_address(written)
        if address is None:
            return True
        if address == 0:
            return False               # no memory: nothing can read it
        for k in range(self.slots_seen, self.nslots):
            other = _storage_address(self.inputs[k])
            if other is None:
                self.slot_unknown = True
            else:
                self.slot_addresses.add(other)
        self.slots_seen = self.nslots
        return self.slot_unknown or address in self.slot_addresses

    # -- read-only views for lowering and debugging (not on the hot path) --

    def graph(self, outs):
        """The nodes that the nodes `outs` need, as NodeRecords in recording
        order (`uses` counted among them), and the input slots they read in
        the graph's parameter order: the order of the cache key
        (csrc/flush.pxi), computed by the same walk (number_needed)."""
        outs = list(outs)
        for out in outs:
            if not 0 <= out < self.n:
                raise IndexError(out)
        cdef int32_t *pos = <int32_t*>malloc((self.n + self.nslots + 1) * sizeof(int32_t))
        if pos == NULL:
            raise MemoryError()
        cdef list slot_order = []
        cdef int32_t i, k, count
        cdef Node *nd
        cdef NodeRecord rec
        records = []
        try:
            count = number_needed(self, outs, pos, pos + self.n, slot_order)
            uses = [0] * count
            for i in range(self.n):
                if pos[i] < 0:
                    continue
                nd = &self.nodes[i]
                for k in range(nd.nin):
                    if nd.inputs[k] >= 0:
                        uses[pos[nd.inputs[k]]] += 1
            for i in range(self.n):
                if pos[i] >= 0:
                    rec = self.record_of(i)
                    rec.uses = uses[pos[i]]
                    records.append(rec)
        finally:
            free(pos)
        return records, tuple(slot_order)

    def live(self):
        """Indices of the nodes a LazyTensor still holds."""
        return [i for i in range(self.n) if owner_of(self, i) != NULL]

    cdef NodeRecord record_of(self, int32_t i):
        cdef Node *nd = &self.nodes[i]
        cdef NodeRecord rec = NodeRecord.__new__(NodeRecord)
        rec.index = i
        rec.op = nd.op
        rec.inputs = tuple([('node', nd.inputs[k]) if nd.inputs[k] >= 0
                            else ('slot', ~nd.inputs[k]) for k in range(nd.nin)])
        rec.attr = nd.attr
        rec.flags = nd.flags
        rec.dtype = DTYPES[nd.meta.dtype]
        rec.shape = tuple([nd.meta.shape[k] for k in range(nd.meta.ndim)])
        rec.live = owner_of(self, i) != NULL
        rec.requires_grad = nd.meta.requires_grad
        rec.uses = nd.uses
        return rec

    def node(self, Py_ssize_t i):
        """The NodeRecord of node i."""
        if not 0 <= i < self.n:
            raise IndexError(f"node {i} of a segment of {self.n}")
        return self.record_of(<int32_t>i)

    def owner(self, Py_ssize_t i):
        """The LazyTensor holding node i's value, or None."""
        if not 0 <= i < self.n:
            raise IndexError(f"node {i} of a segment of {self.n}")
        owner = owner_of(self, <int32_t>i)
        return None if owner == NULL else <object>owner

    def slot(self, Py_ssize_t k):
        """(SlotKey, value) of external input slot k."""
        if not 0 <= k < self.nslots:
            raise IndexError(f"slot {k} of a segment of {self.nslots}")
        return self.slot_keys[k], self.inputs[k]

    def site(self, Py_ssize_t i):
        return None if self.sites is None else self.sites[i]

    @property
    def state(self):
        return ("recording", "running", "done", "failed")[self.state]


cdef object _storage_address(object value):
    """The address of an eager tensor's storage; 0 for a tensor without
    memory (a meta or fake tensor: a fake storage's data_ptr warns), or for
    anything that is not a tensor (a Python scalar slot); None where it
    cannot be told (a sparse or nested tensor, a subclass's storage that
    raises its own error: nn.LazyLinear's UninitializedParameter)."""
    cdef uintptr_t address
    if read_storage_address != NULL and (type(value) is TensorType or type(value) is _Parameter):
        # (from the C++ tensor: no Python storage object, device or int)
        if read_storage_address(<PyObject*>value, &address):
            return address
    if not isinstance(value, TensorType):
        return 0
    try:
        storage = value.untyped_storage()
        if storage.device.type == "meta":
            return 0
        return storage.data_ptr()
    except Exception:
        return None


@cython.final
cdef class NodeRecord:
    def __repr__(self):
        return (f"NodeRecord(index={self.index}, op={self.op}, inputs={self.inputs}, "
                f"attr={self.attr:#x}, flags={self.flags}, dtype={self.dtype}, "
                f"shape={self.shape}, live={self.live})")


cdef int32_t number_needed(Segment seg, list outs, int32_t *pos, int32_t *slot_pos,
                           list slot_order) except -1:
    """Number the nodes the nodes `outs` need, in recording order, into
    pos (-1: not needed), and the input slots they read, by first use, into
    slot_pos (-1: unread), appending each read slot to slot_order; return
    how many nodes are needed.  This numbering is a graph's canonical form:
    two recordings of one program number alike, whatever dead nodes and
    slots surround them."""
    cdef int32_t n = seg.n, i, j, k, r, count = 0
    cdef Node *nd
    for i in range(n):
        pos[i] = -1
    for k in range(seg.nslots):
        slot_pos[k] = -1
    for k in range(len(outs)):
        pos[<int32_t>outs[k]] = 0
    for i in range(n - 1, -1, -1):          # mark what the outputs need
        if pos[i] == 0:
            nd = &seg.nodes[i]
            for k in range(nd.nin):
                if nd.inputs[k] >= 0:
                    pos[nd.inputs[k]] = 0
    for i in range(n):                      # number them
        if pos[i] != 0:
            continue
        pos[i] = count
        count += 1
        nd = &seg.nodes[i]
        for j in range(nd.nin):
            r = nd.inputs[j]
            if r < 0 and slot_pos[~r] < 0:
                slot_pos[~r] = len(slot_order)
                slot_order.append(~r)
    return count


def segments_begun():
    """How many segments have begun recording, on every thread: a count
    that moves on at each flush (fastlazy.churn)."""
    return _next_epoch


cdef inline Segment current_segment():
    """The calling thread's recording segment (a fresh one if its last
    was flushed, here or by another thread)."""
    if (_current is not None and _current.state == SEG_RECORDING
            and _current_thread == this_thread()):
        return _current
    return _switch_segment()


cdef object _thread_segment():
    # Per-thread storage holds a weak reference: a segment lives as long as
    # its pending LazyTensors (or the one-entry cache) need it, so a flushed
    # or failed one -- and what it holds -- is not kept by the thread.
    ref = getattr(_thread_segments, "segment", None)
    return None if ref is None else ref()


cdef Segment _switch_segment():
    # The slow path: another thread recorded last, or this thread's segment
    # was flushed.
    global _current, _current_thread, _many_threads, _first_thread
    cdef unsigned long me = PyThread_get_thread_ident()
    seg = _thread_segment()
    if seg is None or (<Segment>seg).state != SEG_RECORDING:
        seg = Segment()          # may run a finalizer, which may record
        mine = _thread_segment()
        if mine is not None and (<Segment>mine).state == SEG_RECORDING:
            seg = mine           # ... and so have made this thread's segment
        else:
            _thread_segments.segment = _weakref(seg)
    if _first_thread == 0:
        _first_thread = me
    elif me != _first_thread:
        _many_threads = True
    if (<Segment>seg).default_dtype == -1:
        (<Segment>seg).default_dtype = _note_default_dtype()
    _current = <Segment>seg
    _current_thread = this_thread()
    return <Segment>seg


# The default dtype the cached signatures were found under (-1: none read).
cdef int _known_default = -1


cdef int _note_default_dtype() except -2:
    """The default dtype's code now.  fastlazy's own setter computes the
    pending nodes and forgets the signatures before the default changes; a
    change made while fastlazy was disabled is seen here, when a segment
    opens, and forgets the signatures found under the old default."""
    global _known_default
    cdef int now = default_float()
    if now != _known_default:
        if _known_default != -1:
            _hooks.forget_signatures()
        _known_default = now
    return now


def sync_default_dtype():
    """enable() calls this: if the default dtype changed while fastlazy
    was disabled, the calling thread's pending nodes are computed (under
    the default they were recorded with: flush) and the signatures found
    under the old default forgotten, before anything records under the
    new one."""
    if default_float() != _known_default and _known_default != -1:
        seg = peek_segment()
        if seg is not None:
            flush(<Segment>seg, REASON_MARK_STEP)
        _note_default_dtype()


cdef Segment peek_segment():
    """The calling thread's recording segment, or None (never makes one)."""
    if _current is not None and _current_thread == this_thread():
        seg = _current
    else:
        seg = _thread_segment()
    if seg is None or (<Segment>seg).state != SEG_RECORDING:
        return None
    return <Segment>seg


cdef uint64_t slot_key(Operand *o):
    if o.kind == K_SCALAR:
        if o.scalar == SC_BOOL:
            # bools are constants of the graph (TorchScript has no bool
            # Scalar), so their value is part of the structure.
            return SLOT_SCALAR | SLOT_BOOL_CONSTANT | (<object>o.obj is True)
        return SLOT_SCALAR | o.scalar
    return (SLOT_TENSOR | <uint64_t>(o.m.dtype + 1) | (<uint64_t>o.m.ndim << 8)
            | (<uint64_t>o.m.device << 16) | (<uint64_t>o.m.requires_grad << 24))


cdef int32_t operand_ref(Segment seg, Operand *o) except? -2147483648:
    """The node input for one operand: a node index, or ~slot for an
    external value (eager tensor, materialized LazyTensor, scalar)."""
    cdef LazyTensor t
    cdef int32_t k
    if o.kind == K_LAZY:
        t = <LazyTensor>o.obj
        if t.seg is seg:
            return t.idx
        if t.seg is not None:
            # record() materializes operands pending elsewhere first
            raise SystemError("fastlazy: an operand is pending in another segment")
        # the slot this value took in this segment, unless dead nodes let
        # it go since (then it holds None)
        if (t.slot_epoch == seg.epoch
                and PyList_GET_ITEM(seg.inputs, t.slot) == <PyObject*>t.value):
            seg.slot_uses[t.slot] += 1
            return ~t.slot
        t.slot = seg.add_slot(t.value, slot_key(o), o.m, VERSION_UNREAD)
        t.slot_epoch = seg.epoch
        seg.slot_uses[t.slot] = SLOT_HELD + 1
        return ~t.slot
    if o.kind == K_TENSOR:
        k = seg.add_slot(<object>o.obj, slot_key(o), o.m, o.version)
        seg.slot_uses[k] = 1
    else:
        # a Python scalar: too small to be worth letting go early
        k = seg.add_slot(<object>o.obj, slot_key(o), NULL, VERSION_UNREAD)
        seg.slot_uses[k] = SLOT_KEPT
    return ~k


cdef void retarget(LazyTensor t, Segment seg, int32_t idx) noexcept:
    """Point t at node idx of seg (whose owner it already is), letting its
    old node go.  t is consistent before the old node is dropped, since
    dropping may run finalizers (kill), which may read t."""
    cdef Segment old = t.seg
    cdef int32_t old_idx = t.idx
    t.seg = seg
    t.idx = idx
    t.slot_epoch = 0
    value, t.value = t.value, None
    leave_node(old, old_idx, t)


cdef inline PyObject *owner_of(Segment seg, int32_t idx) noexcept:
    """The LazyTensor holding node idx of seg, or NULL: none does, or the
    one that does is being freed.  A weakref callback on a handle runs in
    its deallocation before it lets its node go (leave_node), and may
    flush the segment; taking the handle as a live owner then would bring
    it back from the dead, and free it twice."""
    cdef PyObject *owner = seg.nodes[idx].owner
    if owner != NULL and refcount(owner) <= 0:
        return NULL
    return owner


cdef inline void leave_node(Segment seg, int32_t idx, LazyTensor t) noexcept:
    """t no longer holds node idx of seg (None: it held no node): the node
    loses its owner if t still is it (in a recording segment it may die)."""
    if seg is not None and idx < seg.n and seg.nodes[idx].owner == <PyObject*>t:
        seg.drop_owner(idx)


# How many torch.inference_mode contexts are open, over all threads (kept by
# fastlazy.patching): only while some is does a record ask torch for the
# calling thread's mode, which costs a Python call.
cdef int fl_inference_hint = 0
cdef object _is_inference_mode_enabled = torch.is_inference_mode_enabled


def inference_mode_entered(int delta):
    global fl_inference_hint
    fl_inference_hint += delta
    if fl_inference_hint < 0:
        fl_inference_hint = 0


def inference_mode_depth():
    return fl_inference_hint


cdef inline int8_t is_inference(LazyTensor t) except -1:
    if t.value is not None:
        return t.value.is_inference()
    return t.meta.inference


cdef int8_t recorded_in_inference_mode(LazyTensor rebind) except -1:
    """A node's result is an inference tensor if it is recorded in inference
    mode -- except an in-place op's, whose tensor stays what it was (eager
    writes a normal tensor in inference mode and it stays normal)."""
    if not fl_inference_hint or not _is_inference_mode_enabled():
        return 0
    return 1 if rebind is None else is_inference(rebind)


cdef bint operand_is_inference(Operand *o) except -1:
    if o.kind == K_LAZY:
        return is_inference(<LazyTensor>o.obj)
    return o.kind == K_TENSOR and (<object>o.obj).is_inference()


cdef bint reads_inference(Operand *ops, int nops) except -1:
    """Is an operand an inference tensor?  (Asked only of a node that builds
    autograd history, where eager may refuse to save one.)"""
    cdef int i
    for i in range(nops):
        if operand_is_inference(&ops[i]):
            return True
    return False


cdef int check_saved_inference(int op, Operand *ops, int nops, int attr, int dtype) except -1:
    """Raise eager's error if the node would save an inference tensor for
    backward (fastlazy.inference_saves): at the call, as eager raises it."""
    cdef int i
    operands = []
    for i in range(nops):
        if ops[i].kind == K_ABSENT:
            attr |= 1 << (ATTR_ABSENT_SHIFT + i)
        else:
            operands.append((<object>ops[i].obj, operand_is_inference(&ops[i])))
    _hooks.check_saved_inference(op, attr, DTYPES[dtype], operands)
    return 0


# Inputs the next record() gives its node after its operands' (the nodes a
# view's sizes are read from: view_rules.pxi), valid in one segment.  Set
# just before that call, and taken by it before anything can run Python
# (which might record other nodes).
cdef int32_t _extra_refs[MAX_IN]
cdef int _n_extra = 0
cdef Segment _extra_seg = None


cdef int give_next_node(Segment seg, int32_t *refs, int n) except -1:
    global _n_extra, _extra_seg
    memcpy(_extra_refs, refs, n * sizeof(int32_t))
    _n_extra = n
    _extra_seg = seg
    return 0


cdef inline void forget_versions(Operand *ops, int nops) noexcept:
    for i in range(nops):
        if ops[i].kind == K_TENSOR:
            ops[i].version = VERSION_UNREAD


cdef LazyTensor record(int op, Operand *ops, int nops, Meta *out, int attr,
                       int flags, LazyTensor rebind):
    """Append one node; return its LazyTensor (a new one, or `rebind` for an
    in-place op, which moves that handle to the new node).  None, recording
    nothing, where give_next_node() named inputs in a segment that is no
    longer the one recording (a flush ran in between)."""
    global fl_pending, _n_extra, _extra_seg, fl_handle_pending_next
    cdef Segment seg
    cdef int32_t refs[MAX_IN]
    cdef int nin, i
    cdef int attr0 = attr, flags0 = flags
    cdef LazyTensor t
    cdef int32_t extra[MAX_IN]
    cdef int n_extra = _n_extra
    cdef Segment extra_seg = None
    if n_extra:
        memcpy(extra, _extra_refs, n_extra * sizeof(int32_t))
        extra_seg = _extra_seg
        _n_extra = 0
        _extra_seg = None
    out.inference = recorded_in_inference_mode(rebind)
    if out.requires_grad and reads_inference(ops, nops):
        check_saved_inference(op, ops, nops, attr, out.dtype)
    # First what may run Python (see the top of this file): the handle's
    # allocation (the cyclic GC may run), and the values of operands pending
    # in another segment (another thread's, or one that failed).
    if rebind is None:
        # A pending handle holds nothing but its segment, so it stays out of
        # the cycle collector until it holds a value (set_value): the cost
        # of being tracked is for objects that can close a cycle.
        fl_handle_pending_next = 1
        t = LazyTensor.__new__(LazyTensor)
    else:
        t = rebind
    while True:
        seg = current_segment()
        i = 0
        while i < nops:
            if (ops[i].kind == K_LAZY and (<LazyTensor>ops[i].obj).seg is not None
                    and ((<LazyTensor>ops[i].obj).seg is not seg
                         # a leaf's pending update read by an op with grad:
                         # autograd's leaf is its value (tensor.pxi pend_leaf)
                         or out.requires_grad and (<LazyTensor>ops[i].obj).leaf_of is not None)):
                materialize(<LazyTensor>ops[i].obj)
                seg = current_segment()
                # that ran Python: check them all again, and read the eager
                # operands' versions again (the graph may have written one)
                forget_versions(ops, nops)
                i = 0
                continue
            i += 1
        attr = attr0
        flags = flags0
        nin = 0
        for i in range(nops):
            if ops[i].kind != K_ABSENT:
                refs[nin] = operand_ref(seg, &ops[i])
                nin += 1
            else:
                # which optional operands are present is structure (lowering
                # needs it): bits 16+ of attr
                attr |= 1 << (ATTR_ABSENT_SHIFT + i)
        # A tensor subclass's _version (add_slot) is Python, which may have
        # flushed seg: then start over on the thread's fresh segment.
        if seg.state == SEG_RECORDING:
            break
        forget_versions(ops, nops)
    if n_extra and seg is not extra_seg:
        return None
    # From here to the owner's assignment: C only.
    if (nops and ops[0].kind != K_ABSENT and ops[0].m.ndim == out.ndim
            and equal_sizes(ops[0].m.shape, out.shape, out.ndim)):
        flags |= NODE_KEEPS_SHAPE
    cdef Node *nd = seg.append()
    cdef int32_t idx = seg.n - 1
    nd.op = op
    nd.nin = nin
    nd.attr = attr
    nd.flags = flags
    memcpy(&nd.meta, out, sizeof(Meta))
    nd.owner = NULL
    nd.uses = 0
    cdef uint64_t h0 = mix(0x27D4EB2F165667C5ULL, op | (<uint64_t>attr << 16) | (<uint64_t>flags << 48))
    cdef uint64_t h1 = mix(0x165667B19E3779F9ULL, op | (<uint64_t>out.dtype << 16) | (<uint64_t>attr << 24))
    cdef int32_t r
    for i in range(nin):
        r = refs[i]
        nd.inputs[i] = r
        if r >= 0:
            seg.nodes[r].uses += 1
            h0 = mix(h0, seg.nodes[r].hash[0])
            h1 = mix(h1, seg.nodes[r].hash[1])
        else:
            h0 = mix(h0, seg.slot_hash[~r])
            h1 = mix(h1, seg.slot_hash[~r] ^ 0x5851F42D4C957F2DULL)
    for i in range(n_extra):
        r = extra[i]                # a node of seg (view_rules.pxi: size_sources)
        nd.inputs[nin + i] = r
        seg.nodes[r].uses += 1
        h0 = mix(h0, seg.nodes[r].hash[0])
        h1 = mix(h1, seg.nodes[r].hash[1])
    nd.nin = nin + n_extra
    nd.hash[0] = h0
    nd.hash[1] = h1

    # The new node owns the handle before the old node lets it go, so
    # dropping the old one can never drop the new one.
    nd.owner = <PyObject*>t
    memcpy(&t.meta, out, sizeof(Meta))
    if rebind is None:
        t.seg = seg             # a new handle: nothing to let go
        t.idx = idx
    else:
        retarget(t, seg, idx)
    if seg.sites is not None:
        seg.sites.append(_hooks.site_of_call())
    counters[C_NODES] += 1
    fl_pending = 1
    if seg.n >= flush_threshold or seg.nslots >= flush_threshold:
        try:
            flush(seg, REASON_THRESHOLD)
        except Exception:
            # the graph failed: the call that filled the buffer is not the
            # one that failed; each tensor of the segment raises when read
            pass
    return t
