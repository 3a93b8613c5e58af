# Flush: run a segment's live nodes through the compiled-graph cache.
#
# Outputs are the nodes that still have a LazyTensor.  The cache key is the
# 128-bit structural hash of those outputs (it covers opcodes, wiring, the
# dtype/rank/device of tensor inputs and the *types* of scalar inputs; scalar
# values are graph inputs), folded with the backend's own key.  A hit costs a
# dict lookup and the call of the compiled program; a miss asks the backend
# (Python, fastlazy.graph_cache) to build one.

from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM
from cpython.pycapsule cimport PyCapsule_GetPointer
from libc.stdlib cimport malloc, free
from cpython.ref cimport Py_INCREF

cdef extern from "cpu_pool_scope.h":
    ctypedef struct fl_cpu_pool_scope:
        void (*enter)() noexcept nogil
        void (*exit)() noexcept nogil
    const char *FL_CPU_POOL_CAPSULE

cdef object _move_to_end = None    # the graph cache's LRU bump, bound by install()
cdef object _backend_tag = None    # the active backend's name, part of every key
cdef bint _key_shapes = False      # the active backend specializes on shapes


def set_backend_key(str name, bint specializes_shapes):
    """Called by fastlazy.graph_cache when the backend changes: its name
    joins every cache key, and a backend that compiles per shape makes
    the input shapes part of the key."""
    global _backend_tag, _key_shapes
    _backend_tag = name
    _key_shapes = specializes_shapes


# The CPU pool's scope (fastlazy.cpu_pool), entered around each graph run so
# that the run's large buffers come from the pool; NULL without the C++
# extension.
cdef void (*pool_enter)() noexcept nogil
cdef void (*pool_exit)() noexcept nogil


def set_cpu_pool_scope(capsule):
    """Enter the CPU pool's scope around each graph run with the functions
    in `capsule` (fastlazy._executor.cpu_pool_scope()), or not (None)."""
    global pool_enter, pool_exit
    cdef const fl_cpu_pool_scope *scope
    if capsule is None:
        pool_enter = pool_exit = NULL
    else:
        scope = <const fl_cpu_pool_scope *>PyCapsule_GetPointer(capsule, FL_CPU_POOL_CAPSULE)
        pool_enter, pool_exit = scope.enter, scope.exit


cdef object call_in_pool(object f, tuple args):
    """f(*args) inside the CPU pool's scope (where there is a pool)."""
    if pool_enter is NULL:
        return f(*args)
    pool_enter()
    try:
        return f(*args)
    finally:
        pool_exit()


cdef tuple canonical_key(Segment seg, list outs):
    """The cache key of the graph computing `outs`, and the segment's input
    slots in the graph's parameter order.

    Only the nodes the outputs need take part, in their canonical numbering
    (number_needed), so two recordings of one program get one key.  Each
    node contributes its recorded structural hash and its canonical wiring.
    """
    cdef int32_t n = seg.n, i, j, r
    cdef Py_ssize_t k
    cdef uint64_t h0 = 0x9E3779B97F4A7C15ULL, h1 = 0xC2B2AE3D27D4EB4FULL
    cdef int32_t *pos = <int32_t*>malloc((n + seg.nslots + 1) * sizeof(int32_t))
    if pos == NULL:
        raise MemoryError()
    cdef int32_t *slot_pos = pos + n
    cdef Node *nd
    cdef list slot_order = []
    try:
        number_needed(seg, outs, pos, slot_pos, slot_order)
        for i in range(n):                      # hash the needed nodes
            if pos[i] < 0:
                continue
            nd = &seg.nodes[i]
            h0 = mix(h0, nd.hash[0])
            h1 = mix(h1, nd.hash[1])
            for j in range(nd.nin):
                r = nd.inputs[j]
                if r >= 0:
                    h0 = mix(h0, <uint64_t>pos[r])
                    h1 = mix(h1, <uint64_t>pos[r] ^ 0xA5A5)
                else:
                    h0 = mix(h0, <uint64_t>slot_pos[~r] | (1ULL << 40))
                    h1 = mix(h1, <uint64_t>slot_pos[~r] | (3ULL << 40))
        for k in range(len(outs)):
            h0 = mix(h0, <uint64_t>pos[<int32_t>outs[k]] | (2ULL << 40))
        h1 = mix(h1, len(outs))
    finally:
        free(pos)
    return (_backend_tag, (<object>h0 << 64) | <object>h1), tuple(slot_order)


cdef int flush(Segment seg, int reason) except -1:
    """Compute every live LazyTensor of seg and hand seg off.

    The segment is marked running, with its lock held and its runner
    named, before anything that can run Python (an allocation can run a
    finalizer): a read of one of its LazyTensors from then on, on another
    thread, waits for the lock; on this thread (a finalizer, weakref
    callback or signal handler run in the middle of the flush) it is
    computed apart (run_segment_for), never waits for itself."""
    global _current
    if seg.state != SEG_RECORDING:
        return 0
    if seg is _current:
        _current = None     # the cache must not keep it (nor what it holds)
    seg.runner = PyThread_get_thread_ident()
    lock = _new_lock()
    lock.acquire()
    seg.lock = lock
    seg.state = SEG_RUNNING
    _flushing[seg.runner] = _flushing.get(seg.runner, 0) + 1
    cdef list owners = []
    cdef list outs = []
    failure = None
    try:
        run_live(seg, reason, owners, outs)
    except BaseException as exc:
        seg.state = SEG_FAILED
        # pending handles stay outside the collector; these now close a
        # cycle through the error (below): the collector must see them
        track_all(owners)
        # The error explains later reads of the segment's other tensors.
        # Its traceback's frames hold LazyTensors, which hold the segment:
        # a cycle the collector frees (both types take part in it).
        seg.error = exc
        failure, values = _hooks.graph_failed(seg, outs, exc)
        # the results that do not depend on the failing op have their
        # values now, as eager computed them at their calls: a write to an
        # input from here on must not reach them
        _take_values(seg, owners, outs, values)
        if failure is exc:
            raise
    finally:
        depth = _flushing.pop(seg.runner) - 1
        if depth:
            _flushing[seg.runner] = depth
        lock.release()
        if seg.state != SEG_FAILED:
            seg.release()
        # (after a failure too: a callback bringing an eager tensor up to
        # date must put it back as it was where its value failed)
        run_after(seg)
    if failure is not None:
        # eager's exception alone, not chained to the backend's own report
        raise failure from None
    return 0


cdef int _take_values(Segment seg, list owners, list outs, list values) except -1:
    """Give each owner of a failed segment its value where `values` has one
    (graph_failed's replay), unless it left its node while the flush ran."""
    cdef LazyTensor t
    cdef Py_ssize_t k
    for k in range(len(owners)):
        t = <LazyTensor>owners[k]
        if values[k] is not None and t.seg is seg and t.idx == <int32_t>outs[k]:
            detach_handle(t, values[k])
    return 0


# thread id -> how many flushes it is running (nested: a finalizer's read)
cdef dict _flushing = {}


cdef int run_live(Segment seg, int reason, list owners, list outs) except -1:
    """flush's work, with seg marked running: values for its owners (the
    live handles, appended to `owners`, their nodes to `outs`)."""
    cdef int32_t i
    cdef bint grad = False, detached = False
    cdef int inference = 0
    for i in range(seg.n):
        detached |= seg.nodes[i].flags & NODE_DETACH
        if owner_of(seg, i) != NULL:
            owners.append(<object>seg.nodes[i].owner)
            outs.append(i)
            grad |= seg.nodes[i].meta.requires_grad
            inference += seg.nodes[i].meta.inference
    flush_reasons[reason] += 1
    if not owners:
        counters[C_EMPTY_FLUSHES] += 1
        seg.state = SEG_DONE
        return 0
    counters[C_FLUSHES] += 1
    if reason != REASON_MARK_STEP:
        # a read (or a full buffer) split the program here: where, is
        # what a user needs to remove the split (metrics.explain)
        note_flush_site(REASON_NAMES[reason])
    key, slot_order = canonical_key(seg, outs)
    cdef int now = default_float()
    if seg.default_dtype == -1 or now == seg.default_dtype:
        program, values = run_in_mode(seg, key, outs, slot_order, inference, len(owners),
                                      grad, detached)
    else:
        # The default dtype changed while fastlazy was disabled (its own
        # setter computes the pending nodes first): the nodes' dtypes were
        # found under the segment's default, which the graph runs under.
        _set_default_dtype(DTYPES[seg.default_dtype])
        try:
            program, values = run_in_mode(seg, key, outs, slot_order, inference,
                                          len(owners), grad, detached)
        finally:
            _set_default_dtype(DTYPES[now])
    if inference and inference != len(owners):
        # some results were recorded in inference mode, others not: those
        # become inference tensors by a copy made in that mode
        values = list(values)
        with _inference_mode():
            for k in range(len(owners)):
                if seg.nodes[outs[k]].meta.inference:
                    values[k] = values[k].clone()
    cdef LazyTensor t
    for k in range(len(owners)):
        t = <LazyTensor>owners[k]
        if t.seg is seg:          # not rebound, nor read apart, while it ran
            set_value(t, values[k])
            t.program = program
            t.seg = None
            t.slot_epoch = 0
    # before the lock is let go: a waiting thread finds the values set
    seg.state = SEG_DONE
    return 0


cdef object _set_default_dtype = torch._C._set_default_dtype


cdef object _is_autocast_on = torch.is_autocast_enabled
cdef object _set_autocast_on = torch.set_autocast_enabled


cdef tuple autocast_devices():
    """The device types this torch's autocast knows."""
    found = []
    for device in ("cpu", "cuda", "xpu", "mps", "hpu", "xla", "privateuseone", "mtia", "maia"):
        try:
            _is_autocast_on(device)
        except (RuntimeError, ValueError, TypeError):
            continue
        found.append(device)
    return tuple(found)


cdef tuple AUTOCAST_DEVICES = autocast_devices()


cdef tuple run_in_mode(Segment seg, object key, list outs, tuple slot_order, int inference,
                       Py_ssize_t nowners, bint grad, bint detached):
    """run_graph under the grad or inference mode its nodes were recorded
    in, and without autocast: a node recorded under autocast holds the
    casts autocast made (the generic path records the aten calls below
    it), and one recorded outside it must not be cast (a matmul recorded
    before a `with torch.autocast(...)` block and read inside it is
    eager's float32 matmul), and past saved-tensor hooks (saved_hooks.pxi)."""
    if fl_saved_hooks and hooks_open():
        push_plain_saves()
        try:
            return run_without_autocast(seg, key, outs, slot_order, inference, nowners, grad,
                                        detached)
        finally:
            pop_plain_saves()
    return run_without_autocast(seg, key, outs, slot_order, inference, nowners, grad, detached)


cdef tuple run_without_autocast(Segment seg, object key, list outs, tuple slot_order,
                                int inference, Py_ssize_t nowners, bint grad, bint detached):
    global _autocast_epoch
    if fl_autocast:
        suspended = [device for device in AUTOCAST_DEVICES if _is_autocast_on(device)]
        if suspended:
            for device in suspended:
                _set_autocast_on(device, False)
            _autocast_epoch += 1
            try:
                return run_in_grad_mode(seg, key, outs, slot_order, inference, nowners, grad,
                                        detached)
            finally:
                for device in suspended:
                    _set_autocast_on(device, True)
                _autocast_epoch += 1
    return run_in_grad_mode(seg, key, outs, slot_order, inference, nowners, grad, detached)


cdef tuple run_in_grad_mode(Segment seg, object key, list outs, tuple slot_order,
                            int inference, Py_ssize_t nowners, bint grad, bint detached):
    """run_graph under the grad or inference mode its nodes were recorded
    in."""
    if inference == nowners:
        # every result was recorded in inference mode: they are inference
        # tensors, wherever they are read
        with _inference_mode():
            return run_graph(seg, key, outs, slot_order)
    if fl_inference_hint and _is_inference_mode_enabled():
        # recorded outside inference mode, read inside it (a training
        # loss logged in `with torch.inference_mode(): loss.item()`): the
        # results are normal tensors with their autograd history, as
        # eager made them where they were recorded
        with _InferenceMode(False):
            return run_in_grad_mode(seg, key, outs, slot_order, inference, nowners, grad,
                                    detached)
    if grad:
        # recorded with grad enabled: the graph must build autograd
        # history even if the value is read inside torch.no_grad()
        with _enable_grad():
            return run_graph(seg, key, outs, slot_order)
    if detached and grad_enabled():
        # recorded under no_grad from inputs that require grad: no output
        # needs history, so the whole graph runs without it (read inside
        # no_grad, as in inference loops, it already does)
        with _no_grad():
            return run_graph(seg, key, outs, slot_order)
    return run_graph(seg, key, outs, slot_order)


cdef int run_after(Segment seg) except -1:
    """The segment's after_run callables, in registration order."""
    callbacks, seg.after_run = seg.after_run, None
    if callbacks is not None:
        for callback in callbacks:
            callback()
    return 0


def after_run(LazyTensor t, callback):
    """Call `callback()` once the graph computing `t` has run (at once if
    t is not pending): how an eager tensor is brought up to date with a
    value computed lazily (BatchNorm's running statistics)."""
    cdef Segment seg = t.seg
    if seg is None or seg.state != SEG_RECORDING:
        callback()
        return
    if seg.after_run is None:
        seg.after_run = []
    seg.after_run.append(callback)


cdef tuple run_graph(Segment seg, object key, list outs, tuple slot_order):
    """(program, output values).  A cache hit runs here, in C; a miss goes
    to graph_cache.compile_and_run, which compiles and caches the program."""
    cdef object programs = _hooks.programs
    program = programs.get(key)
    if program is None:
        values = call_in_pool(_hooks.compile_and_run, (seg, key, outs))
        return programs.get(key), values
    counters[C_HITS] += 1
    _move_to_end(key)
    # program.slots: positions in the canonical slot order
    cdef tuple positions = program.slots
    cdef list inputs = seg.inputs
    cdef Py_ssize_t k, n = len(positions)
    cdef tuple used = PyTuple_New(n)
    cdef tuple args = PyTuple_New(n)
    for k in range(n):
        s = slot_order[<Py_ssize_t>positions[k]]
        Py_INCREF(s)
        PyTuple_SET_ITEM(used, k, s)
        v = inputs[<Py_ssize_t>s]
        Py_INCREF(v)
        PyTuple_SET_ITEM(args, k, v)
    seg.check_versions(used)
    out = call_in_pool(program.call, args)
    return program, ((out,) if program.single else out)


cdef int run_segment_for(LazyTensor t) except -1:
    cdef Segment seg = t.seg
    if seg is None:
        raise RuntimeError(
            "fastlazy: this LazyTensor was read while an in-place update rebound "
            "it (from a finalizer or callback run in the middle of that update); "
            "read it after the update returns")
    cdef object failure = None, value = None
    cdef bint computed = False
    if seg.state == SEG_RECORDING:
        try:
            return flush(seg, REASON_VALUE)
        except Exception as exc:
            if t.value is not None and seg.state == SEG_FAILED:
                return 0        # another result failed; this one's value is eager's
            if t.seg is not seg or seg.state != SEG_FAILED:
                raise
            failure = exc       # (computed alone below)
    if seg.state == SEG_RUNNING:
        if seg.runner == PyThread_get_thread_ident() or PyThread_get_thread_ident() in _flushing:
            # Read on the thread that runs the segment (a finalizer, weakref
            # callback or signal handler run in the middle of the flush), or
            # on a thread that is itself in a flush (waiting could close a
            # cycle of threads waiting for each other): compute this value
            # apart, node by node, from the nodes the running flush reads
            # too (they stay intact until it ends).
            flush_reasons[REASON_OTHER_THREAD] += 1
            detach_handle(t, _hooks.recover(seg, t.idx, None))
            return 0
        # Another thread is running it: wait for its result.
        flush_reasons[REASON_OTHER_THREAD] += 1
        with seg.lock:
            pass
    if t.seg is seg and seg.state == SEG_FAILED:
        # The graph failed as a whole (an index out of range in another
        # tensor); this tensor may not depend on the failing part, so
        # compute it alone, node by node: its value is eager's, where the
        # error was the other tensor's call's.  Where it does depend on it
        # and this read ran the graph, the graph's own error is raised (it
        # names the op that failed and where it was recorded), outside the
        # handler so that no second error is chained to it.
        try:
            value = _hooks.recover(seg, t.idx, seg.error)
            computed = True
        except Exception:
            if failure is None:
                raise
        if not computed:
            raise failure
        detach_handle(t, value)
    elif t.seg is seg:
        raise SystemError("fastlazy: a flushed segment left a LazyTensor without its value")
    return 0


cdef int flush_pending(PyObject *written) except -1:
    """Called by an in-place entry point before it writes the eager tensor
    `written`: the pending nodes are computed first if they may read its
    memory (an eager write elsewhere, such as BatchNorm's
    num_batches_tracked.add_(1), leaves the graph whole).  A watched
    storage's watchers hear of the write first (watch_writes)."""
    global fl_pending
    cdef LazyTensor lazy
    if type(<object>written) is LazyTensor:
        # an item of a list an eager call writes (torch._foreach_lerp_ over
        # an optimizer's lazy states runs on their values): a pending one has
        # no memory yet -- reading its value computes the segment first --
        # and a computed one's value is what gets written
        lazy = <LazyTensor>written
        if lazy.value is None:
            return 0
        written = <PyObject*>lazy.value
    if fl_watching:
        _note_watched_write(<object>written)
    if not fl_pending:
        return 0          # (held while a fake run calls in-place methods)
    cdef Segment seg = peek_segment()
    if seg is None or not seg.n:
        if not _many_threads:
            fl_pending = 0      # another thread's pending nodes would need it
        return 0
    if not seg.may_read(<object>written):
        return 0
    if not _many_threads:
        fl_pending = 0
    try:
        flush(seg, REASON_EAGER_WRITE)
    except Exception:
        # The graph failed (an index out of range...).  The eager write that
        # merely ran it goes on, as in eager, where the error was raised at
        # its own call; each tensor of the segment is computed on its own
        # now, before the write, and one that fails raises when read.
        _recover_all(seg)
    return 0


# storage address -> the callbacks watching it (watch_writes)
cdef dict _watched = {}


def watch_writes(tensors, on_write):
    """Call on_write() once, at the first write to the memory of one of
    `tensors` that fastlazy sees: every write an in-place entry point, a
    watch entry, out=, torch.ops, `.data =`, swap_tensors or a storage
    write makes -- through the tensor itself, a view, a `.data` alias or
    any tensor sharing its storage -- and its memory handed to NumPy or
    DLPack (written later unseen).  For programs that hold a copy of a
    tensor's contents (inductor's frozen parameters): a write through a
    `.data` alias bumps no version counter.  on_write runs inside the
    writing call, before the write, and must not raise."""
    global fl_watching
    for t in tensors:
        address = _storage_address(t)
        if address:
            _watched.setdefault(address, []).append(on_write)
    fl_watching = 1 if _watched else 0


def unwatch_writes(on_write):
    """Forget every watch of on_write (its program is gone)."""
    global fl_watching
    for address in [a for a, calls in _watched.items() if on_write in calls]:
        calls = _watched[address]
        calls.remove(on_write)
        if not calls:
            del _watched[address]
    fl_watching = 1 if _watched else 0


def end_watches():
    """Tell every watcher its storages were written, and watch nothing:
    disable() takes away the entry points that see writes, so from then on
    any write may go unseen."""
    global fl_watching
    calls = [on_write for watchers in _watched.values() for on_write in watchers]
    _watched.clear()
    fl_watching = 0
    for on_write in calls:
        on_write()


def watching():
    """Are storages watched for writes?  (The Python-level write patches
    of watch.py then report their writes with no node pending.)"""
    return fl_watching


def watched_storages():
    """How many storages are watched (for tests)."""
    return len(_watched)


cdef int _note_watched_write(object written) except -1:
    global fl_watching
    address = _storage_address(written)
    if not address:
        return 0          # no memory, or no storage to tell (sparse, fake)
    calls = _watched.pop(address, None)
    if calls is None:
        return 0
    fl_watching = 1 if _watched else 0
    for on_write in calls:
        on_write()
    return 0


cdef void _recover_all(Segment seg):
    cdef list owners = []
    cdef int32_t i
    for i in range(seg.n):
        if owner_of(seg, i) != NULL:
            owners.append(<object>seg.nodes[i].owner)
    for t in owners:
        try:
            materialize(<LazyTensor>t)
        except Exception:
            pass


def mark_step():
    """Flush the calling thread's segment: compute every LazyTensor it
    recorded that is still pending."""
    cdef Segment seg = peek_segment()
    if seg is not None:
        flush(seg, REASON_MARK_STEP)


def set_record_sites(bint on):
    """Remember the Python file and line of every recorded node (for
    recompile diagnosis and graph dumps; costs about a microsecond per op).
    Takes effect from the next segment."""
    global _record_sites
    _record_sites = on


def set_flush_threshold(Py_ssize_t n):
    global flush_threshold
    if n < 1:
        raise ValueError("flush threshold must be at least 1 node")
    flush_threshold = n


def get_flush_threshold():
    return flush_threshold


def cache_size():
    """Compiled programs the graph cache holds."""
    return 0 if _hooks is None else len(_hooks.programs)


def pending_nodes():
    """Nodes the calling thread recorded and has not flushed."""
    cdef Segment seg = peek_segment()
    return 0 if seg is None else seg.n


def current():
    """The calling thread's recording segment (for debugging views)."""
    return current_segment()
