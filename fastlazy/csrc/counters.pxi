# The hot counters: C integers bumped on the recording and flush paths, and
# their Python API (fastlazy.metrics reads them).

cdef enum:
    C_NODES = 0
    C_FLUSHES
    C_HITS
    C_MISSES
    C_MATERIALIZATIONS
    C_FALLBACKS
    C_EMPTY_FLUSHES
    C_GENERIC             # calls recorded by the generic path (counted by fastlazy.route)
    C_COUNT

COUNTER_NAMES = ("nodes_recorded", "flushes", "cache_hits", "cache_misses",
                 "materializations", "fallbacks", "empty_flushes", "generic_calls")

cdef enum:
    REASON_VALUE = 0      # a value was read
    REASON_MARK_STEP
    REASON_THRESHOLD      # the segment reached flush_threshold nodes
    REASON_OTHER_THREAD   # a tensor of a running segment was needed
    REASON_EAGER_WRITE    # an in-place op was about to write an eager tensor
    REASON_COUNT

REASON_NAMES = ("value", "mark_step", "threshold", "other_thread", "eager_write")

cdef int64_t counters[C_COUNT]
cdef int64_t flush_reasons[REASON_COUNT]


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
    """Bump a counter from Python: the paths that live there (a cache miss,
    a fallback, a generic-path record) count their events here."""
    counters[COUNTER_NAMES.index(name)] += 1
