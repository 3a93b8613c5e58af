"""Calls whose Python float changes at every call, in a loop: eager's time
per call beside fastlazy's (default engine), and how many graphs fastlazy
compiled for the loop (fastlazy/lifted_floats.py: one structure for all
values once a float is seen to vary, where no code branches on it).

Each case runs LOOP calls, each with a new value, its result read (a
flush per call, as a loop that reads a value per step does), eager's and
fastlazy's loops alternating ROUNDS times in one process, one intra-op
thread; the figure is each side's best loop.  The last column counts the
graphs fastlazy analysed and compiled and the calls it ran eagerly.  The training case is a step
of a small MLP with BatchNorm1d(momentum=None), whose running-statistics
factor is 1 / batches seen.

    python benchmarks/varying_floats.py [--out FILE]
"""
from __future__ import annotations

import argparse
import pathlib
import time

import torch
import torch.nn.functional as F

import fastlazy

LOOP = 50
ROUNDS = 5


_TARGET = torch.arange(64) % 10


def _cases():
    x0 = torch.randn(64, 64)
    x = fastlazy.lazy(x0)
    calls = {
        "x.masked_fill(x > 0, v)": lambda x, v: x.masked_fill(x > 0, v).relu(),
        "torch.where(x > 0, x, v)": lambda x, v: torch.where(x > 0, x, v).relu(),
        "torch.full_like(x, v) * x": lambda x, v: torch.full_like(x, v) * x,
        "torch.lerp(x, y, v)": lambda x, v: torch.lerp(x, x.relu(), v),
        "F.softplus(x, beta=v)": lambda x, v: F.softplus(x, beta=v).relu(),
        "F.hardtanh(x, -v, v)": lambda x, v: F.hardtanh(x * 2, -v, v),
        # baked in (their floats reach C++ as doubles): new values run
        # eagerly once churn.NEW_VALUE_SEGMENTS segments have met a new one
        "F.pad(x, (1, 1), value=v) (baked in)": lambda x, v: F.pad(x, (1, 1), value=v).relu(),
        "F.rms_norm(x, (64,), eps=v) (baked in)": lambda x, v: F.rms_norm(x, (64,), eps=v).relu(),
        "F.cross_entropy(x, t, label_smoothing=v / 10) (baked in)":
            lambda x, v: F.cross_entropy(x.relu(), _TARGET, label_smoothing=v / 10),
    }
    for name, fn in calls.items():
        yield (name, lambda i, fn=fn: fn(x0, 0.5 + 0.01 * i),
               lambda i, fn=fn: fn(x, 0.5 + 0.01 * i).to_eager())
    yield ("BatchNorm1d(momentum=None) training step",) + _bn_steps()


def _bn_steps():
    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.BatchNorm1d(64, momentum=None),
                                   torch.nn.ReLU(), torch.nn.Linear(64, 10))
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))

    def stepper(model, inp):
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def step(i):
            opt.zero_grad()
            loss = F.cross_entropy(model(inp), y)
            loss.backward()
            opt.step()
            return float(loss.detach())
        return step
    return stepper(make(), x), stepper(make(), x.to("lazy"))


def _loop(step, start):
    t = time.perf_counter()
    for i in range(start, start + LOOP):
        step(i)
    return (time.perf_counter() - t) / LOOP


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    fastlazy.enable()
    lines = ["| call, a new float each time | eager (per call) | fastlazy (per call) "
             "| eager / fastlazy | fastlazy's graphs compiled, calls run eagerly |",
             "|---|---|---|---|---|"]
    for name, eager, lazy in _cases():
        fastlazy.metrics.reset()
        best = {"eager": float("inf"), "lazy": float("inf")}
        for r in range(ROUNDS):
            best["eager"] = min(best["eager"], _loop(eager, r * LOOP))
            best["lazy"] = min(best["lazy"], _loop(lazy, r * LOOP))
        counters = fastlazy.metrics.counters()
        lines.append(f"| `{name}` | {best['eager'] * 1e6:.0f} us | {best['lazy'] * 1e6:.0f} us "
                     f"| {best['eager'] / best['lazy']:.2f}x | {counters['cache_misses']}, "
                     f"{counters['fallbacks']} in {ROUNDS * LOOP} calls |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
