"""What fastlazy.enable() costs eager code (target P4) on W4's models and
W2's MLP: each eager step (no LazyTensor anywhere; inference, and the
training steps of the models W4 and W2 train) timed with fastlazy disabled
and enabled, in alternating blocks of about a second in one process (the
first block alternating from round to round, as w4_interleaved.py does).
A round's ratio is the enabled block's median call over the disabled
one's; the table gives the median of the rounds' ratios and their range.
A training step's fixed costs (zero_grad, backward, the optimizer's step)
weigh most on W2's small MLP.

    python benchmarks/w4_enable_cost.py [--models resnet18,gpt2] [--modes infer,train]
        [--rounds 6] [--out FILE]
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

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


def measure(name: str, mode: str, rounds: int) -> dict:
    model, size = zoo.MODELS[name], zoo.SIZES[1]
    x, target = model.inputs(size)
    module = model.build(size, mode)
    step, _ = workloads.contender_named("eager").w4_step(model, module, x, target, mode)
    return {"model": name, "ratios": _warm_and_time(step, rounds)}


def measure_w2(batch: int, mode: str, rounds: int) -> dict:
    mlp = next(m for m in workloads.W2 if m.name == "mlp")
    x, y = torch.randn(batch, *mlp.sample_shape), torch.randn(batch, *mlp.sample_shape)
    step, _ = workloads.contender_named("eager").w2_step(mlp.build(), x, y, mode)
    return {"model": f"W2 MLP batch {batch}", "ratios": _warm_and_time(step, rounds)}


def _warm_and_time(step, rounds: int) -> list:
    for _ in range(WARMUP_CALLS):
        step()
    return enable_cost(step, rounds)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python benchmarks/w4_enable_cost.py",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    zoo.table_options(parser, ROUNDS)
    parser.add_argument("--modes", default=f"{zoo.INFER},{zoo.TRAIN}")
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    zoo.ready_to_time()
    lines = ["| eager step (W4 models at batch 1) | enabled / disabled (median, rounds' range) |",
             "|---|---|"]

    def row(label, r):
        lines.append(f"| {label} | {statistics.median(r):.3f} ({min(r):.3f}-{max(r):.3f}) |")
        print(lines[-1], file=sys.stderr, flush=True)

    for mode in modes:
        what = "inference" if mode == zoo.INFER else "training step"
        for name in args.models.split(","):
            if mode in zoo.MODELS[name].modes:
                row(f"{name} {what}", measure(name, mode, args.rounds)["ratios"])
        for batch in (1, 64):
            row(f"W2 MLP batch {batch} {what}", measure_w2(batch, mode, args.rounds)["ratios"])
    zoo.emit(lines, args.out)


if __name__ == "__main__":
    main()
