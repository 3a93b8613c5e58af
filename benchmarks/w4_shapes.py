"""W4 over changing input sizes (target P14): each model's inference at 8
batch sizes (image models) or 8 sequence lengths (text models), the loop
run twice, in this process, eager and then fastlazy (the default engine).

Prints a Markdown table: per model, the graph structures fastlazy compiled
for the whole loop (one means every size ran the same compiled graph), and
the loop's total time for eager and for fastlazy -- new sizes included,
which cost fastlazy one analysis of each new call signature (make_fx) but
no new graph.

    python benchmarks/w4_shapes.py [--models resnet18,bert] [--out FILE]
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import torch

import zoo

ROUNDS = 2


def sizes(model) -> list:
    base = zoo.SIZES[1]
    if model.name in ("bert", "gpt2", "llama"):
        return [dataclasses.replace(base, seq=8 * (k + 1)) for k in range(8)]
    return [dataclasses.replace(base, batch=k + 1) for k in range(8)]


def loop(model, module, inputs, lazy: bool) -> float:
    import fastlazy
    start = time.perf_counter()
    for _ in range(ROUNDS):
        for x in inputs:
            if lazy:
                zoo.step(model, module, module, fastlazy.lazy(x), None, zoo.INFER,
                         read=fastlazy.LazyTensor.to_eager)()
            else:
                zoo.step(model, module, module, x, None, zoo.INFER)()
    return time.perf_counter() - start


def measure(name: str) -> dict:
    import fastlazy
    model = zoo.MODELS[name]
    module = model.build(zoo.SIZES[1])
    inputs = [model.inputs(s)[0] for s in sizes(model)]
    fastlazy.disable()
    eager_s = loop(model, module, inputs, lazy=False)
    fastlazy.enable()
    fastlazy.graph_cache.clear()
    fastlazy.metrics.reset()
    lazy_s = loop(model, module, inputs, lazy=True)
    structures = fastlazy.metrics.counters()["cache_misses"]
    fastlazy.disable()
    return {"model": name, "structures": structures, "eager_s": eager_s, "fastlazy_s": lazy_s}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(m.name for m in zoo.W4))
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args(argv)
    zoo.define_torchvision_ops()
    torch.set_num_threads(1)
    lines = ["| model (8 sizes, twice) | graph structures | eager | fastlazy | fastlazy / eager |",
             "|---|---|---|---|---|"]
    for name in args.models.split(","):
        r = measure(name)
        lines.append(f"| {name} | {r['structures']} | {r['eager_s']:.2f} s | "
                     f"{r['fastlazy_s']:.2f} s | {r['fastlazy_s'] / r['eager_s']:.1f}x |")
        print(lines[-1], file=sys.stderr, flush=True)
    zoo.emit(lines, args.out)


if __name__ == "__main__":
    main()
