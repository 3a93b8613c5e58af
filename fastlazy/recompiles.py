"""Why did that compile?  Every cache miss is explained.

For each compiled graph we keep its skeleton (ops, attributes and wiring)
and the types of its inputs.  A miss is then one of:

* ``first graph``        -- nothing was compiled before;
* ``new graph structure``  -- no compiled graph has this skeleton; the
  nearest one (longest common prefix) shows the first op where the new graph
  diverges, with the file:line that recorded it when sites are recorded;
* ``new input dtype`` / ``new scalar type`` / ``new input rank`` /
  ``new input shape`` (shape-specializing backends) / ``new input device`` /
  ``new requires_grad`` -- the same skeleton met with other input types.

`FASTLAZY_WARN_RECOMPILES=N` warns once a call site has caused more than N
compiles (and turns on site recording, about a microsecond per op).
"""
from __future__ import annotations

import collections
import itertools
import threading
import warnings

MAX_LOG = 200
# Skeletons kept, the most recently compiled (the graph cache keeps 1024
# programs): a program that compiles a graph per call, for good, would
# otherwise hold every skeleton and scan them all at each miss, each miss
# slower than the last.  The nearest skeleton is looked for among the
# NEAREST_AMONG most recent; each keeps its last TYPES_KEPT input types.
MAX_SEEN = 4096
NEAREST_AMONG = 64
TYPES_KEPT = 8

# Re-entrant: a finalizer run by an allocation inside the lock may call
# back into fastlazy (read a LazyTensor: a flush) on this very thread.
_lock = threading.RLock()
_seen: dict = {}          # skeleton -> input-type tuples, the least recently compiled first
_backends: collections.Counter = collections.Counter()   # skeleton without backend -> kept
log: collections.deque = collections.deque(maxlen=MAX_LOG)
by_reason: collections.Counter = collections.Counter()
by_site: collections.Counter = collections.Counter()
_warned: set = set()
# set by fastlazy's boot from FASTLAZY_WARN_RECOMPILES (which also turns on
# recording sites)
warn_after = 0


class RecompileWarning(UserWarning):
    """A call site keeps causing new compiles."""


def skeleton(view):
    """Ops, attributes and wiring of a view, independent of input types."""
    position = {n.index: k for k, n in enumerate(view.nodes)}
    slot_pos = {s.index: k for k, s in enumerate(view.slots)}
    nodes = tuple(
        (n.op.name, n.attr, n.cast, n.detach,
         tuple((kind, position[r] if kind == "node" else slot_pos[r]) for kind, r in n.inputs))
        for n in view.nodes)
    return nodes, tuple(position[i] for i in view.outputs)


def input_types(view, with_shapes):
    types = []
    for s in view.slots:
        if s.kind == "tensor":
            v = s.value
            types.append(("tensor", v.dtype, v.dim(), v.device.type, v.requires_grad,
                          tuple(v.shape) if with_shapes else None))
        else:
            types.append(("scalar", s.kind, s.value if s.kind == "bool" else None))
    return tuple(types)


def _type_difference(old, new):
    for k, (a, b) in enumerate(zip(old, new)):
        if a == b:
            continue
        if a[0] != b[0] or a[0] == "scalar":
            return "new scalar type", f"input {k}: {a[1]} -> {b[1]}"
        for field, name in ((1, "new input dtype"), (2, "new input rank"),
                            (3, "new input device"), (4, "new requires_grad"),
                            (5, "new input shape")):
            if a[field] != b[field]:
                return name, f"input {k}: {a[field]} -> {b[field]}"
    return "new input types", ""


def _nearest(nodes, seen):
    """The skeleton in `seen` sharing the longest prefix with `nodes`, and
    the length of that prefix."""
    best, best_len = None, -1
    for _backend, (other, _) in seen:
        n = 0
        for a, b in zip(nodes, other):
            if a != b:
                break
            n += 1
        if n > best_len:
            best, best_len = other, n
    return best, best_len


def explain(view, backend, with_shapes, flush_site=None):
    """Record why `view` missed the cache; return (reason, detail, site)."""
    skel = (backend, skeleton(view))
    types = input_types(view, with_shapes)
    with _lock:
        # A snapshot taken in one C call: a signal handler or finalizer run
        # between bytecodes below may flush and add to _seen (the lock is
        # re-entrant), and iterating the live dict would then raise.
        seen = list(itertools.islice(reversed(_seen), NEAREST_AMONG))
        if not seen:
            reason, detail, site = "first graph", "", None
        elif _seen.get(skel):
            reason, detail = _type_difference(_seen[skel][-1], types)
            site = None
        elif _backends[skel[1]]:
            reason, detail, site = "new backend", backend, None
        else:
            nearest, k = _nearest(skel[1][0], seen)
            reason = "new graph structure"
            if k < len(view.nodes):
                node = view.nodes[k]
                site = view.segment_sites[k]
                detail = f"diverges at op {k} ({node.op.name})"
            else:
                site = None
                detail = f"extends a compiled graph of {len(nearest)} ops"
            if site:
                detail += f" recorded at {site}"
        # (a new key stored with its entry in one step: a handler run
        # between a setdefault and its append would find an empty list)
        if skel in _seen:
            kept = _seen.pop(skel)          # (and in again: the most recent)
            kept.append(types)
            del kept[:-TYPES_KEPT]
            _seen[skel] = kept
        else:
            _seen[skel] = [types]
            _backends[skel[1]] += 1
            if len(_seen) > MAX_SEEN:
                oldest = next(iter(_seen))
                del _seen[oldest]
                _backends[oldest[1]] -= 1
                if not _backends[oldest[1]]:
                    del _backends[oldest[1]]
        site = site or flush_site or "<unknown>"
        by_reason[reason] += 1
        by_site[site] += 1
        log.append((reason, detail, site))
        count = by_site[site]
    if warn_after and count > warn_after and site not in _warned:
        _warned.add(site)
        warnings.warn(f"fastlazy: {site} has caused {count} compiles (last: {reason}"
                      f"{': ' + detail if detail else ''})", RecompileWarning, stacklevel=2)
    return reason, detail, site


def reset():
    with _lock:
        by_reason.clear()
        by_site.clear()
        log.clear()
        _warned.clear()


def forget():
    """Forget the compiled skeletons (when the graph cache is cleared)."""
    with _lock:
        _seen.clear()
        _backends.clear()
