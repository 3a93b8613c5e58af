"""Counters: what was recorded, flushed, compiled and run eagerly.

`counters()` is a plain dict; `report()` a readable table; `reset()` zeroes
everything.
"""
from __future__ import annotations

from fastlazy import _core, _steps, graph_cache, recompiles, stats


def counters() -> dict:
    """All counters as a plain dict.

    Keys: nodes_recorded, flushes, cache_hits, cache_misses, materializations,
    fallbacks, empty_flushes, flush_reason.<reason>, fallback.<op>,
    compiles, compile_seconds, cache_size, cache_evictions, compile_failures,
    kernel_layers (linear layers computed by the native backend's one-row
    kernel; 0 means torch computed every one).
    """
    d = _core.counter_values()
    for name, n in sorted(stats.fallbacks_by_op.items()):
        d["fallback." + name] = n
    for reason, n in sorted((recompiles.by_reason + stats.recompile_reasons).items()):
        d["recompile." + reason] = n
    d["compiles"] = len(stats.compile_seconds)
    d["compile_seconds"] = sum(stats.compile_seconds)
    d["cache_size"] = graph_cache.size()
    d["cache_evictions"] = graph_cache.evictions
    d["compile_failures"] = graph_cache.compile_failures
    d["kernel_layers"] = _steps.kernel_calls()
    return d


def reset() -> None:
    """Zero every counter (the graph cache itself is kept)."""
    _core.reset_counters()
    stats.reset()
    recompiles.reset()
    graph_cache.evictions = 0
    graph_cache.compile_failures = 0
    _steps.reset_kernel_calls()


def report() -> str:
    """The counters as a table, fallbacks by op last."""
    d = counters()
    width = max(len(k) for k in d)
    lines = ["fastlazy metrics", "-" * (width + 14)]
    for key, value in d.items():
        shown = f"{value:.4f}" if isinstance(value, float) else str(value)
        lines.append(f"{key:<{width}}  {shown:>12}")
    if recompiles.log:
        lines += ["", "compiles, most recent last (reason: detail @ site)"]
        for reason, detail, site in list(recompiles.log)[-20:]:
            lines.append(f"  {reason}{': ' + detail if detail else ''} @ {site}")
    return "\n".join(lines)


def explain() -> str:
    """Which calls ran eagerly instead of being recorded since the last
    reset(), and why, most frequent first."""
    rows = sorted(stats.fallback_reasons.items(), key=lambda kv: (-kv[1], kv[0]))
    if not rows:
        return "every call with a LazyTensor argument was recorded"
    width = max(len(op) for (op, _), _ in rows)
    lines = [f"{'op':<{width}}  {'calls':>6}  why it ran eagerly"]
    lines += [f"{op:<{width}}  {n:>6}  {reason}" for (op, reason), n in rows]
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
