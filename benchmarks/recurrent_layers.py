"""Recurrent layers of more tensors than one node reads: a 2-layer
bidirectional nn.GRU and nn.LSTM (16 weights, the input and the state:
recorded in parts, fastlazy/split_calls.py), alone and in a small tagger
(embedding, LSTM, layer norm, linear head), batch inference under no_grad,
one intra-op thread.

Per model, in one process: the calls run on fastlazy's default engine for
SETTLE seconds (the graph compiles in the background meanwhile), then
ROUNDS blocks of 0.5 s alternate between eager and fastlazy; the ratio is
eager's median call over fastlazy's (higher is better).  The table also
gives the calls that ran eagerly per model call and the graphs' tiers.

    python benchmarks/recurrent_layers.py [--models gru,lstm,tagger] [--settle 60] [--rounds 8]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

BLOCK_S = 0.5


class Tagger(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(1000, 64)
        self.rnn = torch.nn.LSTM(64, 64, num_layers=2, bidirectional=True, batch_first=True)
        self.norm = torch.nn.LayerNorm(128)
        self.out = torch.nn.Linear(128, 10)

    def forward(self, ids):
        h, _ = self.rnn(self.emb(ids))
        return self.out(torch.relu(self.norm(h)).mean(1))


def _models():
    g = torch.Generator().manual_seed(0)
    rnn = dict(num_layers=2, bidirectional=True, batch_first=True)
    return {
        "gru": (lambda: torch.nn.GRU(32, 64, **rnn), lambda: torch.randn(4, 20, 32, generator=g)),
        "lstm": (lambda: torch.nn.LSTM(32, 64, **rnn), lambda: torch.randn(4, 20, 32, generator=g)),
        "tagger": (Tagger, lambda: torch.randint(0, 1000, (8, 32), generator=g)),
    }


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _block(call):
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < BLOCK_S:
        call()
        n += 1
    return (time.perf_counter() - start) / n


def measure(name: str, settle: float, rounds: int) -> str:
    import fastlazy
    from fastlazy import graph_cache
    graph_cache.clear()             # (the tiers column: this model's graphs)
    torch.manual_seed(0)
    make, inputs = _models()[name]
    module, x = make().eval(), inputs()
    with torch.no_grad():
        want = _first(module(x))
        fastlazy.enable()
        lazy_x = fastlazy.lazy(x)
        got = _first(module(lazy_x)).to_eager()
        torch.testing.assert_close(got, want)

        def lazy_call():
            _first(module(lazy_x)).sum().item()

        def eager_call():
            _first(module(x)).sum().item()
        start = time.perf_counter()
        while time.perf_counter() - start < settle:
            lazy_call()
        before = fastlazy.metrics.counters().get("fallbacks", 0)
        lazy_call()
        eager_calls = fastlazy.metrics.counters().get("fallbacks", 0) - before
        eager, lazy = [], []
        for _ in range(rounds):
            fastlazy.disable()
            eager.append(_block(eager_call))
            fastlazy.enable()
            lazy.append(_block(lazy_call))
        tiers = ",".join(t["tier"] for t in fastlazy.metrics.tiers())
        fastlazy.disable()
    e, f = statistics.median(eager), statistics.median(lazy)
    return (f"| {name} | {e * 1e3:.2f} ms | {f * 1e3:.2f} ms | {e / f:.2f}x | "
            f"{eager_calls} | {tiers} |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gru,lstm,tagger")
    parser.add_argument("--settle", type=float, default=60.0, help="seconds")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"| model (settled {args.settle:.0f} s) | eager | fastlazy | eager / fastlazy | "
          "calls run eagerly per call | tiers |")
    print("|---|---|---|---|---|---|")
    for name in args.models.split(","):
        print(measure(name, args.settle, args.rounds), flush=True)


if __name__ == "__main__":
    main()
