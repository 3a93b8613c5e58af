"""W4's cold starts (targets P10 and P11) in alternating fresh processes:
eager's first calls, then fastlazy's (the default engine), then eager's
again, ROUNDS times per row, each in a process of its own (w4_cold.py,
through workloads.first_calls_cold: an empty inductor cache, one intra-op
thread).  On a shared 2-core machine a fresh process's 100 calls take 30-50 %
longer in one minute than in the next; alternating the contenders puts that
drift on both, and the table gives the medians of each contender's rounds
and the median of the rounds' ratios.  report.py's W4 columns time one cold
process per contender, once, which suits a first look but not a ratio near
1.

    python benchmarks/w4_cold_pairs.py [--models resnet18,gpt2] [--rounds 3] [--out FILE]
"""
from __future__ import annotations

import argparse
import statistics
import sys

import workloads
import zoo

ROUNDS = 3
CONTENDERS = ("eager", "fastlazy[auto]")


def _pair_order(round_index: int) -> tuple:
    """The contenders in the order of this round: eager first in even
    rounds, fastlazy first in odd ones (neither always starts on a machine
    that has just finished the other's run)."""
    return CONTENDERS if round_index % 2 == 0 else CONTENDERS[::-1]


def measure(name: str, rounds: int, cold=None) -> dict:
    """Each contender's per-round results ({"first_call_s", "first_calls_s"})
    for W4 row `name` (batch 1, inference); `cold(case)` runs one process
    (workloads.first_calls_cold)."""
    cold = cold or workloads.first_calls_cold
    model, size = zoo.MODELS[name], zoo.SIZES[1]
    runs = {c: [] for c in CONTENDERS}
    for k in range(rounds):
        for contender in _pair_order(k):
            case = workloads.W4Case(model, size, zoo.INFER, workloads.contender_named(contender))
            result = cold(case)
            if "error" in result:
                raise RuntimeError(f"{name} {contender}: {result['error']}")
            runs[contender].append(result)
    return runs


def _row(name: str, runs: dict) -> str:
    eager, lazy = runs[CONTENDERS[0]], runs[CONTENDERS[1]]
    ratios = [b["first_calls_s"] / a["first_calls_s"] for a, b in zip(eager, lazy)]

    def median_ms(rs, key):
        return statistics.median(r[key] for r in rs) * 1e3
    return (f"| {name} | {median_ms(eager, 'first_call_s'):.0f} ms | "
            f"{median_ms(lazy, 'first_call_s'):.0f} ms | "
            f"{median_ms(eager, 'first_calls_s'):.0f} ms | "
            f"{median_ms(lazy, 'first_calls_s'):.0f} ms | {statistics.median(ratios):.2f}x "
            f"({min(ratios):.2f}-{max(ratios):.2f}) |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    zoo.table_options(parser, ROUNDS)
    args = parser.parse_args(argv)
    zoo.ready_to_time()
    lines = [f"| model (batch 1, inference; {args.rounds} rounds) | first call, eager | "
             "first call, fastlazy | first 100 calls, eager | first 100 calls, fastlazy | "
             "fastlazy / eager, first 100 (median, range) |",
             "|---|---|---|---|---|---|"]
    for name in args.models.split(","):
        lines.append(_row(name, measure(name, args.rounds)))
        print(lines[-1], file=sys.stderr, flush=True)
    zoo.emit(lines, args.out)


if __name__ == "__main__":
    main()
