# Flush: run a segment's live nodes through the compiled-graph cache.
#
# Outputs are the nodes that still have a LazyTensor.  The cache key is the
# 128-bit structural hash of those outputs (it covers opcodes, wiring, the
# dtype/rank/device of tensor inputs and the *types* of scalar inputs; scalar
# values are graph inputs), folded with the backend's own key.  A hit costs a
# dict lookup and the call of the compiled program; a miss asks the backend
# (Python, fastlazy.graph_cache) to build one.

from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM
from cpython.ref cimport Py_INCREF

cdef object _graph_cache = None    # fastlazy.graph_cache module: compile on a miss
cdef object _programs = None       # graph_cache's LRU (an OrderedDict): key -> Program
cdef object _move_to_end = None
cdef object _backend_tag = None    # the active backend's name, part of every key
cdef bint _key_shapes = False      # the active backend specializes on shapes


def set_backend(str name, bint specializes_shapes, programs):
    """Called by fastlazy.graph_cache when the backend changes."""
    global _backend_tag, _key_shapes, _programs, _move_to_end
    _backend_tag = name
    _key_shapes = specializes_shapes
    _programs = programs
    _move_to_end = programs.move_to_end


cdef object _output_key(Segment seg, list owners, object outs):
    # Fold the outputs' node hashes; the count and order are part of the key.
    cdef uint64_t h0 = 0x9E3779B97F4A7C15ULL, h1 = 0xC2B2AE3D27D4EB4FULL
    cdef Py_ssize_t k
    cdef int32_t i
    for k in range(len(outs)):
        i = outs[k]
        h0 = mix(h0, seg.nodes[i].hash[0])
        h1 = mix(h1, seg.nodes[i].hash[1])
    h0 = mix(h0, len(outs))
    return (_backend_tag, (<object>h0 << 64) | <object>h1)


cdef int flush(Segment seg, int reason) except -1:
    """Compute every live LazyTensor of seg and hand seg off."""
    global _current
    if seg.state != SEG_RECORDING:
        return 0
    if seg is _current:
        _current = Segment()
    seg.state = SEG_RUNNING
    flush_reasons[reason] += 1
    cdef list owners = []
    outs = []
    cdef int32_t i
    cdef bint grad = False, detached = False
    for i in range(seg.n):
        detached |= seg.nodes[i].flags & NODE_DETACH
        if seg.nodes[i].owner != NULL:
            owners.append(<object>seg.nodes[i].owner)
            outs.append(i)
            grad |= seg.nodes[i].meta.requires_grad
    if not owners:
        counters[C_EMPTY_FLUSHES] += 1
        seg.state = SEG_DONE
        seg.release()
        return 0
    counters[C_FLUSHES] += 1
    seg.lock = _new_lock()
    seg.lock.acquire()
    key = _output_key(seg, owners, outs)
    try:
        if grad:
            # recorded with grad enabled: the graph must build autograd
            # history even if the value is read inside torch.no_grad()
            with _enable_grad():
                values = run_graph(seg, key, outs)
        elif detached:
            # recorded under no_grad from inputs that require grad: no output
            # needs history, so the whole graph runs without it
            with _no_grad():
                values = run_graph(seg, key, outs)
        else:
            values = run_graph(seg, key, outs)
    except BaseException as exc:
        seg.state = SEG_FAILED
        seg.error = exc
        raise
    finally:
        seg.lock.release()
    cdef LazyTensor t
    program = _programs.get(key)
    for k in range(len(owners)):
        t = <LazyTensor>owners[k]
        if t.seg is seg:          # not rebound while the graph ran
            t.value = values[k]
            t.program = program
            t.seg = None
            t.slot_epoch = 0
    seg.state = SEG_DONE
    seg.release()
    return 0


cdef object run_graph(Segment seg, object key, list outs):
    """A cache hit runs here, in C; a miss goes to graph_cache.run."""
    program = _programs.get(key)
    if program is None:
        return _graph_cache.run(seg, key, outs)
    counters[C_HITS] += 1
    _move_to_end(key)
    cdef tuple slots = program.slots
    seg.check_versions(slots)
    cdef list inputs = seg.inputs
    cdef Py_ssize_t k, n = len(slots)
    cdef tuple args = PyTuple_New(n)
    for k in range(n):
        v = inputs[<Py_ssize_t>slots[k]]
        Py_INCREF(v)
        PyTuple_SET_ITEM(args, k, v)
    out = program.call(*args)
    return (out,) if program.single else out


cdef int run_segment_for(LazyTensor t) except -1:
    cdef Segment seg = t.seg
    if seg.state == SEG_RECORDING:
        return flush(seg, REASON_VALUE)
    if seg.state == SEG_RUNNING:
        # Another thread is running it: wait for its result.
        flush_reasons[REASON_OTHER_THREAD] += 1
        with seg.lock:
            pass
    if t.seg is seg and seg.state == SEG_FAILED:
        # The graph failed as a whole; this tensor may not depend on the
        # failing part, so compute it alone, node by node.
        t.value = _graph_cache.recover(seg, t.idx, seg.error)
        t.seg = None
    return 0


cdef int flush_pending() except -1:
    """Called by an in-place entry point before it writes an eager tensor."""
    global fl_pending
    fl_pending = 0
    if _current is not None and _current.n:
        flush(_current, REASON_EAGER_WRITE)
    return 0


def mark_step():
    """Flush the current segment: compute every live LazyTensor."""
    if _current is not None:
        flush(_current, REASON_MARK_STEP)


def live_outputs(Segment seg):
    """Indices of the nodes of seg that a LazyTensor still holds."""
    return [i for i in range(seg.n) if seg.nodes[i].owner != NULL]


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


def pending_nodes():
    """Nodes recorded and not yet flushed."""
    return 0 if _current is None else _current.n


def current():
    """The segment now recording (for debugging views)."""
    return current_segment()


def counter_values():
    d = {COUNTER_NAMES[i]: counters[i] for i in range(C_COUNT)}
    for i in range(REASON_COUNT):
        d["flush_reason." + REASON_NAMES[i]] = flush_reasons[i]
    return d


def reset_counters():
    for i in range(C_COUNT):
        counters[i] = 0
    for i in range(REASON_COUNT):
        flush_reasons[i] = 0


def count(str name):
    """Bump a counter from Python (cache hits and misses are counted by the
    cache, which lives in Python)."""
    counters[COUNTER_NAMES.index(name)] += 1
