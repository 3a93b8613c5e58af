"""A loop of HuggingFace `generate` calls from a cold start, as a server
runs one: W4's GPT-2 (or Llama) greedily decoding 32 tokens from an
8-token prompt, again and again for SECONDS, with fastlazy's default
engine; eager's median call, timed first in the same process, is the
reference.

Decoding is the workload where background compiles cost the user most:
every token is a graph of a new length (the key/value cache grows), so a
hot graph meets new shapes at every call, and whatever its compiles hold of
the user's process (its GIL) shows in the loop.  The table gives, per
window of WINDOW seconds, the calls made, their median and mean time, and
eager's median over fastlazy's mean (higher is better), then the loop's
calls against the calls eager's median makes in the same time, and the
graphs' tiers at the end.

    python benchmarks/generate_loop.py [--model gpt2] [--seconds 90] [--out FILE]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import zoo

WINDOW = 15.0
NEW_TOKENS = 32
PROMPT = 8


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2", choices=("gpt2", "llama"))
    parser.add_argument("--seconds", type=float, default=90.0)
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    import fastlazy
    model = zoo.MODELS[args.model]
    module = model.build(zoo.SIZES[1], zoo.INFER)
    ids = model.inputs(zoo.SIZES[1])[0][:, :PROMPT]

    def generate(x):
        with torch.no_grad():
            out = module.generate(x, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                  do_sample=False, pad_token_id=0)
        return out.to_eager() if isinstance(out, fastlazy.LazyTensor) else out

    want = generate(ids)
    times = []
    for _ in range(30):
        start = time.perf_counter()
        generate(ids)
        times.append(time.perf_counter() - start)
    eager = statistics.median(times)
    fastlazy.enable()
    lines = [f"{args.model}, greedy, {NEW_TOKENS} new tokens a call; eager's median call "
             f"{eager * 1e3:.1f} ms", "",
             "| seconds | calls | median call | mean call | eager / fastlazy (mean) |",
             "|---|---|---|---|---|"]
    begin = window_start = time.perf_counter()
    window, calls = [], 0
    while time.perf_counter() - begin < args.seconds:
        start = time.perf_counter()
        got = generate(fastlazy.lazy(ids))
        window.append(time.perf_counter() - start)
        calls += 1
        if calls == 1 and not torch.equal(got, want):
            sys.exit("fastlazy's tokens differ from eager's")
        now = time.perf_counter()
        if now - window_start >= WINDOW or now - begin >= args.seconds:
            mean = statistics.mean(window)
            lines.append(f"| {window_start - begin:.0f}-{now - begin:.0f} | {len(window)} | "
                         f"{statistics.median(window) * 1e3:.1f} ms | {mean * 1e3:.1f} ms | "
                         f"{eager / mean:.2f}x |")
            window, window_start = [], now
    lines += ["", f"{calls} calls in {args.seconds:.0f} s, against {args.seconds / eager:.0f} "
              f"at eager's median; graphs: {fastlazy.metrics.tier_summary()}"]
    zoo.emit(lines, args.out)


if __name__ == "__main__":
    main()
