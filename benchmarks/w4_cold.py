"""The time a user waits for W4's first calls: one zoo model, batch, mode
and contender, in this fresh process (no graph, compiled program or dynamo
cache from before it; workloads.first_calls_cold gives it an empty inductor
cache).  The clock starts at the contender's setup (the model moved or
compiled, the inputs made lazy) and stops at the end of the first call and
of the last; the imports and the model's construction are not counted.
Prints one JSON line: {"first_call_s": ..., "first_calls_s": ..., "calls": n}.

    python benchmarks/w4_cold.py MODEL BATCH MODE CONTENDER [--calls 100] [--threads 1]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

import workloads
import zoo


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python benchmarks/w4_cold.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", choices=list(zoo.MODELS))
    parser.add_argument("batch", type=int, choices=list(zoo.SIZES))
    parser.add_argument("mode", choices=(zoo.INFER, zoo.TRAIN))
    parser.add_argument("contender", help="eager, torch._lazy, torch.compile, fastlazy[torchscript]...")
    parser.add_argument("--calls", type=int, default=workloads.W4_FIRST_CALLS)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    contender = workloads.contender_named(args.contender)
    model, size = zoo.MODELS[args.model], zoo.SIZES[args.batch]
    x, target = model.inputs(size)
    module = model.build(size, args.mode)
    with contender.session():
        start = time.perf_counter()
        step, _ = contender.w4_step(model, module, x, target, args.mode)
        step()
        first_call_s = time.perf_counter() - start
        for _ in range(args.calls - 1):
            step()
        first_calls_s = time.perf_counter() - start
    print(json.dumps({"first_call_s": first_call_s, "first_calls_s": first_calls_s,
                      "calls": args.calls}))


if __name__ == "__main__":
    main()
