"""Counters: what was recorded, flushed, compiled and run eagerly.

The hot counters (nodes recorded, flushes, cache hits...) are C integers in
the core (csrc/counters.pxi); the rest are kept here, counted by the modules
that see the events.  `counters()` is a plain dict of both; `report()` a
readable table; `reset()` zeroes everything.
"""
from __future__ import annotations

import collections
import threading

from fastlazy import _core, _steps, compile_log, cpu_pool, recompiles, sites, step_executor

# Re-entrant: a finalizer run by an allocation inside the lock may call
# back into fastlazy (read a LazyTensor: a flush) on this very thread.
_lock = threading.RLock()
fallbacks_by_op: collections.Counter = collections.Counter()
fallback_reasons: collections.Counter = collections.Counter()   # (op, reason) -> n
compile_seconds: list[float] = []
recompile_reasons: collections.Counter = collections.Counter()
# (reason, id(code), instruction offset) -> graphs computed there other
# than by mark_step, counted by the core (csrc/flush_sites.pxi says why it
# is keyed so; flushes_by_site() names the sites as file:line); the codes
# themselves, by id, in _flush_codes
_flush_sites: dict = {}
_flush_codes: dict = {}
_events: collections.Counter = collections.Counter()    # count_event's names
# set by the boot: the graph cache's per-graph tiers (fastlazy.tiering) as
# a list of dicts, and as one line ("hot 2, fast 5")
tier_listing = None
tier_summary = None
# set by the boot: per cached graph that TorchScript compiled to fuse, what
# its graph executor fused (fastlazy.graph_cache.fusion)
fusion_listing = None
_TIER_EVENTS = ("tier_compiles_queued", "tier_compiles_done", "tier_compiles_failed",
                "tier_promotions", "tier_fast_runs_while_compiling",
                "tier_frozen_compiles_failed", "tier_frozen_misses",
                "tier_cpp_wrapper_failures", "tier_compiles_in_child",
                "tier_child_compile_fallbacks", "tier_wrong_dtypes", "tier_wrong_results",
                "tier_candidate_errors",
                "tier_dynamic_kept", "tier_dynamic_dropped",
                "packed_conv_trials", "packed_conv_graphs", "packed_conv_repacks",
                "packed_conv_failures",
                "cuda_graph_captures", "cuda_graph_failures", "cuda_graph_misses")


def count_fallback(name: str, reason: str = "") -> None:
    """A call of `name` ran eagerly (a fallback), for `reason`."""
    with _lock:
        fallbacks_by_op[name] += 1
        if reason:
            fallback_reasons[name, reason] += 1


def count_flush_sites() -> None:
    """Have the core count where graphs are computed (flushes_by_site)."""
    _core.set_flush_sites(_flush_sites, _flush_codes, sites.SKIP)


def flushes_by_site() -> collections.Counter:
    """(reason, "file:line") -> graphs computed there other than by
    mark_step() since the last reset()."""
    found = collections.Counter()
    # The core counts without a lock, holding the GIL, a site's code stored
    # before its count: the counts are copied with dict.copy(), then the
    # codes, which then hold every copied count's code -- but for a count
    # reset() has not cleared yet, whose code it has (left out here, as the
    # reset will leave it out).  dict.copy() runs no Python code while it
    # copies; iterating the dict itself, even inside list(d.items()), makes
    # a tuple per item, and a garbage collection one of them sets off can
    # run finalizers, switch threads and let the dict grow mid-copy.
    counts = _flush_sites.copy()
    codes = _flush_codes.copy()
    for (reason, code, offset), n in counts.items():
        if code in codes:
            found[reason, sites.site_name(codes[code], offset)] += n
    return found


def add_compile_time(seconds: float) -> None:
    with _lock:
        compile_seconds.append(seconds)


def count_recompile(reason: str) -> None:
    with _lock:
        recompile_reasons[reason] += 1


def count_event(name: str) -> None:
    """cache_evictions, compile_failures, deep_graphs or one of _TIER_EVENTS."""
    with _lock:
        _events[name] += 1


def counters() -> dict:
    """All counters as a plain dict.

    Keys: nodes_recorded, flushes, cache_hits, cache_misses, materializations,
    fallbacks, empty_flushes, flush_reason.<reason>, fallback.<op>,
    compiles, compile_seconds, cache_size, cache_evictions, compile_failures,
    deep_graphs (graphs deeper than the backend takes, run natively),
    executor_refusals (graphs the step executor could not run),
    kernel_layers (linear layers computed by the native backend's one-row
    kernel; 0 means torch computed every one).
    """
    d = _core.counter_values()
    with _lock:
        for name, n in sorted(fallbacks_by_op.items()):
            d["fallback." + name] = n
        for reason, n in sorted((recompiles.by_reason + recompile_reasons).items()):
            d["recompile." + reason] = n
        d["compiles"] = len(compile_seconds)
        d["compile_seconds"] = sum(compile_seconds)
        d["cache_size"] = _core.cache_size()
        d["cache_evictions"] = _events["cache_evictions"]
        d["compile_failures"] = _events["compile_failures"]
        d["deep_graphs"] = _events["deep_graphs"]
        # graphs the step executor could not take (they ran on TorchScript's
        # interpreter): a node without an operator to call
        d["executor_refusals"] = _events["executor_refusals"]
        # the tiered engine (fastlazy.tiering): background compiles queued,
        # done and failed, graphs promoted to the compiled tier, and runs
        # on the fast tier while a compile of their graph was under way;
        # compiles made by the compile process, and those that fell back
        # to the compile thread (fastlazy.compile_process); graphs whose
        # convolutions' packed weights were tried on the fast tier and
        # kept, weights packed again after a write, and failures
        # (fastlazy.packed_convs); dynamic-shape versions of hot graphs kept
        # or dropped after their trial against the fast tier; CUDA-graph
        # twins captured, not captured, and their calls that ran the
        # program itself (inputs unlike the capture's: fastlazy.cuda_graphs)
        for name in _TIER_EVENTS:
            d[name] = _events[name]
    d["kernel_layers"] = _steps.kernel_calls()
    return d


def tiers() -> list:
    """Per cached graph, oldest first: its tier with the tiered engine
    ("fast", "compiling", "probation", "hot", "fast (compile failed)",
    "fast (compiled was slower)"), runs, background compile time, the two
    tiers' probed times (`timed`: "run", or "period" for a training graph,
    timed from one of its runs to the next, its backward included), any
    compile error, and `dynamic_shapes`: which tier serves the shapes a hot
    graph has no static version for once its dynamic-shape version was
    tried, and the two times (None before); `cuda_graph`: on a GPU, each
    candidate's CUDA-graph twin's probed time or why it was not captured
    (None for a graph that had none)."""
    return tier_listing()


def fusion() -> list:
    """Per cached graph that TorchScript compiled to fuse (CUDA inputs; CPU
    only with LLVM or NNC's IR evaluator switched on), oldest first: its
    position in the cache (`graph`), `state` ("optimized", or "not optimized
    yet": the profiling executor optimizes a graph at its second run;
    "autograd": a graph building autograd history runs unoptimized),
    `groups` (fusion groups in the optimized graph), `fused` (aten ops
    inside them) and `unfused` (aten ops left outside, by name).  A property
    of the cached graphs, like cache_size: reset() keeps it."""
    return fusion_listing() if fusion_listing is not None else []


def _fusion_lines(limit: int = 20) -> list:
    """fusion() in words: totals, then one line per graph."""
    graphs = fusion()
    if not graphs:
        return []
    done = [g for g in graphs if g["state"] == "optimized"]
    groups = sum(g["groups"] for g in done)
    fused = sum(g["fused"] for g in done)
    outside = sum(sum(g["unfused"].values()) for g in done)
    waiting = len(graphs) - len(done)
    lines = [f"TorchScript fusion: {len(done)} optimized graph(s) hold {groups} fusion "
             f"group(s) covering {fused} aten op(s), {outside} outside"
             + (f"; {waiting} graph(s) not optimized (yet)" if waiting else "")]
    for g in graphs[:limit]:
        if g["state"] != "optimized":
            lines.append(f"  graph {g['graph']}: {g['state']}")
            continue
        left = ", ".join(f"{k} x{n}" for k, n in sorted(g["unfused"].items()))
        lines.append(f"  graph {g['graph']}: {g['groups']} group(s), {g['fused']} op(s) "
                     f"fused" + (f"; outside: {left}" if left else ""))
    if len(graphs) > limit:
        lines.append(f"  ... and {len(graphs) - limit} more")
    return lines


def reset() -> None:
    """Zero every counter (the graph cache itself is kept)."""
    _core.reset_counters()
    with _lock:
        fallbacks_by_op.clear()
        fallback_reasons.clear()
        compile_seconds.clear()
        recompile_reasons.clear()
        # (codes first: a count the core adds in between keeps its code)
        _flush_codes.clear()
        _flush_sites.clear()
        _events.clear()
    recompiles.reset()
    _steps.reset_kernel_calls()


def report() -> str:
    """The counters as a table, fallbacks by op last."""
    d = counters()
    width = max(len(k) for k in d)
    lines = ["fastlazy metrics", "-" * (width + 14)]
    for key, value in d.items():
        shown = f"{value:.4f}" if isinstance(value, float) else str(value)
        lines.append(f"{key:<{width}}  {shown:>12}")
    if tier_summary is not None:
        lines += ["", f"graphs by tier (tiered engine): {tier_summary()}"]
    pool = cpu_pool.stats()
    if pool:
        lines += ["", f"CPU pool (large buffers of graph runs and backwards): "
                      f"{pool['hits']} reused, {pool['misses']} new, "
                      f"{pool['idle_bytes'] / (1 << 20):.1f} MiB idle"]
    fused = _fusion_lines()
    if fused:
        lines += ["", *fused]
    if recompiles.log:
        lines += ["", "compiles, most recent last (reason: detail @ site)"]
        for reason, detail, site in list(recompiles.log)[-20:]:
            lines.append(f"  {reason}{': ' + detail if detail else ''} @ {site}")
    logged = compile_log.messages()
    if logged:
        lines += ["", "torch's log during background compiles, kept off stderr "
                      "(fastlazy.compile_log.messages()), most recent last"]
        lines += [f"  {message}" for message in logged[-5:]]
    return "\n".join(lines)


def explain() -> str:
    """Since the last reset(): which calls ran eagerly instead of being
    recorded, and why, most frequent first; then where graphs were computed
    other than by mark_step() (each such read splits the program into more
    graphs), by reason and line; then, where TorchScript can fuse, what it
    fused per graph and which ops it left outside its fusion groups."""
    with _lock:
        rows = sorted(fallback_reasons.items(), key=lambda kv: (-kv[1], kv[0]))
        splits = flushes_by_site()
        splits = sorted(splits.items(), key=lambda kv: (-kv[1], kv[0]))
    if not rows:
        lines = ["every call with a LazyTensor argument was recorded"]
    else:
        width = max(len(op) for (op, _), _ in rows)
        lines = [f"{'op':<{width}}  {'calls':>6}  why it ran eagerly"]
        lines += [f"{op:<{width}}  {n:>6}  {reason}" for (op, reason), n in rows]
    if splits:
        lines += ["", "graphs computed before mark_step(), by reason and line:"]
        lines += [f"  {n:>6}  {reason:<12}  {site}" for (reason, site), n in splits]
    fused = _fusion_lines()
    if fused:
        lines += ["", *fused]
    why_not = step_executor.why_not()
    if why_not:
        lines += ["", f"graphs run on TorchScript's interpreter: fastlazy's step executor is {why_not}"]
    return "\n".join(lines)


# torch._lazy.metrics names

def counter_names() -> list:
    """Names of the counters that are non-zero (as torch._lazy's)."""
    return [name for name, value in counters().items() if value]


def counter_value(name: str):
    """The value of one counter (None if unknown, as torch._lazy)."""
    return counters().get(name)


def metrics_report() -> str:
    """The report as text (torch._lazy.metrics.metrics_report)."""
    return report()
