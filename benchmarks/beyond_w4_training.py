"""Training steps of torchvision models outside W4 on fastlazy's fast tier
(no compiled program: the tier a graph runs on from its first call, and
where the default engine leaves a training graph its compile did not beat),
against eager, in one process, in alternating blocks.

Per model: batch 1 at 64x64, 10 classes, SGD; eager's module and fastlazy's
(the same seeded weights; fastlazy's input and target made lazy once, the
loss read with .item()) warmed up, then ROUNDS rounds of a block of each
(SECONDS each, the order alternating), each step timed.  A round's ratio is
eager's median step over fastlazy's.  Compiles are held off by a hot
threshold no graph reaches (FASTLAZY_HOT_AFTER, set here before fastlazy is
imported).  Eager's step time depends on its process's malloc state (see
w4_separate.py): run the script a few times.

    python benchmarks/beyond_w4_training.py [--models mobilenet_v2,densenet121]
        [--rounds 4] [--out FILE]
"""
from __future__ import annotations

import argparse
import os
import statistics

os.environ.setdefault("FASTLAZY_HOT_AFTER", str(10 ** 9))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import zoo  # noqa: E402

ROUNDS = 4
SECONDS = 1.0
WARMUP_STEPS = 5


def _step(module, x, target):
    opt = torch.optim.SGD(module.parameters(), lr=1e-3)

    def step():
        opt.zero_grad()
        loss = F.cross_entropy(module(x), target)
        loss.backward()
        opt.step()
        return loss.item()
    return step


def measure(name: str, rounds: int) -> str:
    import torchvision

    import fastlazy

    def build():
        torch.manual_seed(0)
        return getattr(torchvision.models, name)(num_classes=10).train()
    gen = torch.Generator().manual_seed(1)
    x, target = torch.randn(1, 3, 64, 64, generator=gen), torch.randint(0, 10, (1,), generator=gen)
    eager = _step(build(), x, target)
    lazy_module = build()
    with _enabled():
        fastlazy.graph_cache.clear()        # (the graphs listed are this model's)
        lazy = _step(lazy_module, fastlazy.lazy(x), fastlazy.lazy(target))
        for _ in range(WARMUP_STEPS):
            eager()
            lazy()
        pairs = zoo.alternating_rounds(eager, lazy, rounds, SECONDS)
        tiers = fastlazy.graph_cache.tier_summary()
    ratios = [e / f for e, f in pairs]
    return (f"| {name} | {statistics.median([e for e, _ in pairs]) * 1e3:.1f} ms "
            f"| {statistics.median([f for _, f in pairs]) * 1e3:.1f} ms "
            f"| **{statistics.median(ratios):.2f}x** ({min(ratios):.2f}-{max(ratios):.2f}) "
            f"| {tiers} |")


class _enabled:
    """fastlazy enabled for the block (disabled after, as it was)."""

    def __enter__(self):
        import fastlazy
        self.was = fastlazy.enabled()
        fastlazy.enable()

    def __exit__(self, *exc):
        import fastlazy
        fastlazy.mark_step()
        if not self.was:
            fastlazy.disable()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python benchmarks/beyond_w4_training.py",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    zoo.table_options(parser, ROUNDS, models="mobilenet_v2,densenet121")
    args = parser.parse_args(argv)
    zoo.ready_to_time()
    lines = ["| model | eager (median step) | fastlazy, fast tier (median step) "
             "| eager / fastlazy (rounds' range) | fastlazy's graphs |",
             "|---|---|---|---|---|"]
    for name in args.models.split(","):
        lines.append(measure(name, args.rounds))
        print(lines[-1], flush=True)
    zoo.emit(lines, args.out)


if __name__ == "__main__":
    main()
