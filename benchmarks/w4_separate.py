"""W4's steady-state calls with each contender in a process of its own, the
processes alternating: eager's step as a user without fastlazy runs it,
against fastlazy's.

w4_interleaved.py times both in one process, which cancels the machine's
drift but not what one contender's memory does to the other's: malloc's
heap is shared, and whether eager's large buffers are mapped afresh on
every call (page faults: resnet18's training step takes 4,000-10,000 a
step when they are) depends on what else the process holds.  Here each
process holds one contender.  `--tunables` adds a third: eager with
glibc's malloc told to keep freed memory mapped (GLIBC_TUNABLES, as
jemalloc or tcmalloc would), which is what fastlazy's CPU pool
(fastlazy/cpu_pool.py) gives fastlazy's graphs and backwards.

Per round and contender, a fresh process: the module built, WARMUP_CALLS
calls (fastlazy settled on its tiers after them), then CALLS timed calls;
its median call and its minor page faults per call.  A round's ratio is
eager's median over the other's.

    python benchmarks/w4_separate.py [--models resnet18,gpt2] [--modes train]
        [--batch 1] [--rounds 3] [--tunables] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import zoo

ROUNDS = 3
WARMUP_CALLS = 20
CALLS = 40
# what eager gets under --tunables: no block mapped afresh (mmap) below
# 1 GiB, and no heap top handed back to the system below 2 GiB
TUNABLES = "glibc.malloc.mmap_threshold=1073741824:glibc.malloc.trim_threshold=2147483648"


def child(name: str, mode: str, batch: int, contender_name: str) -> dict:
    """Run in the fresh process: the median call and faults per call."""
    import workloads
    zoo.ready_to_time()
    model, size = zoo.MODELS[name], zoo.SIZES[batch]
    x, target = model.inputs(size)
    module = model.build(size, mode)
    contender = workloads.contender_named(contender_name)
    with contender.session():
        step, _ = contender.w4_step(model, module, x, target, mode)
        for _ in range(WARMUP_CALLS):
            step()
        contender.settle([step])
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        times = []
        for _ in range(CALLS):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        tiers = ""
        if contender_name.startswith("fastlazy"):
            import fastlazy
            tiers = fastlazy.graph_cache.tier_summary()
    return {"median_s": statistics.median(times), "faults_per_call": faults / CALLS,
            "tiers": tiers}


def _run(name, mode, batch, contender, tunables=False) -> dict:
    env = dict(os.environ)
    if tunables:
        env["GLIBC_TUNABLES"] = TUNABLES
    done = subprocess.run([sys.executable, __file__, "--child", name, mode, str(batch), contender],
                          capture_output=True, text=True, env=env, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python benchmarks/w4_separate.py",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    zoo.table_options(parser, ROUNDS, models="resnet18,gpt2")
    parser.add_argument("--modes", default=zoo.TRAIN)
    parser.add_argument("--batch", type=int, default=1, choices=sorted(zoo.SIZES))
    parser.add_argument("--tunables", action="store_true",
                        help="also time eager with malloc keeping freed memory mapped")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        name, mode, batch, contender = args.child
        print(json.dumps(child(name, mode, int(batch), contender)))
        return
    contenders = [("eager", "eager", False), ("fastlazy", "fastlazy[auto]", False)]
    if args.tunables:
        contenders.append(("eager, malloc tuned", "eager", True))
    head = " | ".join(f"{label} (median call; faults per call)" for label, _, _ in contenders)
    lines = [f"| workload | {head} | eager / fastlazy (rounds' range) |",
             "|---|" + "---|" * len(contenders) + "---|"]
    rounds = []
    for name in args.models.split(","):
        for mode in zoo.MODELS[name].modes:
            if mode not in args.modes.split(","):
                continue
            runs = {label: [] for label, _, _ in contenders}
            for k in range(args.rounds):
                # which contender's process comes first alternates
                order = contenders if k % 2 == 0 else contenders[::-1]
                for label, contender, tunables in order:
                    runs[label].append(_run(name, mode, args.batch, contender, tunables))
            ratios = [e["median_s"] / f["median_s"]
                      for e, f in zip(runs["eager"], runs["fastlazy"])]
            cells = " | ".join(
                f"{statistics.median(r['median_s'] for r in runs[label]) * 1e3:.3g} ms; "
                f"{statistics.median(r['faults_per_call'] for r in runs[label]):.0f}"
                for label, _, _ in contenders)
            what = "inference" if mode == zoo.INFER else "training step"
            lines.append(f"| W4 {name} batch {args.batch} {what} | {cells} "
                         f"| **{statistics.median(ratios):.2f}x** "
                         f"({min(ratios):.2f}-{max(ratios):.2f}) |")
            print(lines[-1], file=sys.stderr, flush=True)
            rounds.append(f"{name} {what}: " + "; ".join(
                f"{label} " + ", ".join(f"{r['median_s'] * 1e3:.3g} ms ({r['faults_per_call']:.0f})"
                                        for r in runs[label])
                for label, _, _ in contenders))
    zoo.emit(lines + ["", "Each round's median call (faults per call), in round order:", ""]
             + [f"- {r}" for r in rounds], args.out)


if __name__ == "__main__":
    main()
