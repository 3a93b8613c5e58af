"""What fastlazy.enable() costs eager code (target P4) on W4's models: each
model's eager step (no LazyTensor anywhere) timed with fastlazy disabled
and enabled, in alternating blocks of about a second in one process (the
first block alternating from round to round, as w4_interleaved.py does).
A round's ratio is the enabled block's median call over the disabled
one's; the table gives the median of the rounds' ratios and their range.

    python benchmarks/w4_enable_cost.py [--models resnet18,gpt2] [--rounds 6] [--out FILE]
"""
from __future__ import annotations

import argparse
import statistics
import sys

import workloads
import zoo
from w4_interleaved import MIN_CALLS, ROUND_SECONDS, WARMUP_CALLS, _round

ROUNDS = 6


def enable_cost(step, rounds: int, seconds: float = ROUND_SECONDS, calls: int = MIN_CALLS):
    """Per round, the enabled block's median call over the disabled one's
    (fastlazy is left as it was found)."""
    import fastlazy
    was = fastlazy.enabled()

    ratios = []
    try:
        for k in range(rounds):
            order = (True, False) if k % 2 else (False, True)
            timed = {}
            for on in order:
                (fastlazy.enable if on else fastlazy.disable)()
                for _ in range(3):          # the first calls after a switch find cold caches
                    step()
                timed[on] = statistics.median(_round([step], seconds, calls)[0])
            ratios.append(timed[True] / timed[False])
    finally:
        (fastlazy.enable if was else fastlazy.disable)()
    return ratios


def measure(name: str, rounds: int) -> dict:
    model, size = zoo.MODELS[name], zoo.SIZES[1]
    x, target = model.inputs(size)
    module = model.build(size, zoo.INFER)
    step, _ = workloads.contender_named("eager").w4_step(model, module, x, target, zoo.INFER)
    for _ in range(WARMUP_CALLS):
        step()
    return {"model": name, "ratios": enable_cost(step, rounds)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python benchmarks/w4_enable_cost.py",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    zoo.table_options(parser, ROUNDS)
    args = parser.parse_args(argv)
    zoo.ready_to_time()
    lines = ["| W4 model, batch 1 inference, eager step | enabled / disabled (median, rounds' range) |",
             "|---|---|"]
    for name in args.models.split(","):
        r = measure(name, args.rounds)["ratios"]
        lines.append(f"| {name} | {statistics.median(r):.3f} ({min(r):.3f}-{max(r):.3f}) |")
        print(lines[-1], file=sys.stderr, flush=True)
    zoo.emit(lines, args.out)


if __name__ == "__main__":
    main()
