"""Training steps of HuggingFace language models outside W4 on fastlazy's
default engine against eager: the first step, the steps while the
background compile runs, the time until it lands, and the settled speed.

Per model, in a process of its own: a tiny random configuration (hidden 64,
2 layers, 4 heads, vocabulary 1000, 16 tokens, the library's default
dropout), built twice from one seed (eager's module and fastlazy's); SGD on
the model's own causal-LM loss (`labels=`).  The first step of each, from
one seed (dropout's draws included), must give the same loss.  Then: two
1 s blocks of each while fastlazy's graph compiles in the background
("early", the tier users run on first), fastlazy's steps until the
compiled program is in use ("settled in"), and ROUNDS rounds of a block of
each (SECONDS each, the order alternating).  A ratio is eager's median step
over fastlazy's.

    python benchmarks/beyond_w4_text_training.py [--models opt,qwen2]
        [--rounds 4] [--out FILE]
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import torch

import zoo

ROUNDS = 4
SECONDS = 1.0
SETTLE_LIMIT = 300.0          # seconds of steps before giving up on the compile
VOCAB, HIDDEN, LAYERS, HEADS, INTERMEDIATE, POSITIONS, LENGTH = 1000, 64, 2, 4, 128, 128, 16

# (config class, model class, the configuration's other fields)
MODELS = {
    "opt": ("OPTConfig", "OPTForCausalLM",
            dict(ffn_dim=INTERMEDIATE, max_position_embeddings=POSITIONS,
                 word_embed_proj_dim=HIDDEN)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(num_key_value_heads=2, intermediate_size=INTERMEDIATE)),
    "mistral": ("MistralConfig", "MistralForCausalLM",
                dict(num_key_value_heads=2, intermediate_size=INTERMEDIATE,
                     max_position_embeddings=POSITIONS)),
    "phi": ("PhiConfig", "PhiForCausalLM", dict(intermediate_size=INTERMEDIATE)),
}


def _build(name: str):
    import transformers
    config_name, model_name, fields = MODELS[name]
    config = getattr(transformers, config_name)(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, **fields)
    torch.manual_seed(0)
    return getattr(transformers, model_name)(config).train()


def _step(module, ids):
    opt = torch.optim.SGD(module.parameters(), lr=1e-3)

    def step():
        opt.zero_grad()
        loss = module(ids, labels=ids).loss
        loss.backward()
        opt.step()
        return loss.item()
    return step


def _timed(step) -> tuple[float, float]:
    start = time.perf_counter()
    loss = step()
    return loss, time.perf_counter() - start


def measure(name: str, rounds: int) -> str:
    """One table row for `name` (run in this process)."""
    zoo.ready_to_time()
    import fastlazy
    ids = torch.randint(0, VOCAB, (1, LENGTH), generator=torch.Generator().manual_seed(0))
    eager = _step(_build(name), ids)
    fastlazy.enable()
    lazy = _step(_build(name), fastlazy.lazy(ids))
    torch.manual_seed(5)
    eager_loss, eager_first = _timed(eager)
    torch.manual_seed(5)
    lazy_loss, lazy_first = _timed(lazy)
    if lazy_loss != eager_loss:
        sys.exit(f"{name}: the first step's loss is {lazy_loss!r} against eager's {eager_loss!r}")
    early = [zoo.median_block(eager, SECONDS) / zoo.median_block(lazy, SECONDS) for _ in range(2)]
    early_tiers = fastlazy.graph_cache.tier_summary()
    start = time.perf_counter()
    while "compiling" in fastlazy.graph_cache.tier_summary() \
            and time.perf_counter() - start < SETTLE_LIMIT:
        lazy()
    settled_in = time.perf_counter() - start
    pairs = zoo.alternating_rounds(eager, lazy, rounds, SECONDS)
    ratios = [e / f for e, f in pairs]
    return (f"| {name} | {eager_first * 1e3:.1f} / {lazy_first * 1e3:.1f} ms "
            f"| {statistics.median(early):.2f}x ({early_tiers}) | {settled_in:.0f} s "
            f"| {statistics.median([e for e, _ in pairs]) * 1e3:.2f} ms "
            f"| {statistics.median([f for _, f in pairs]) * 1e3:.2f} ms "
            f"| **{statistics.median(ratios):.2f}x** ({min(ratios):.2f}-{max(ratios):.2f}) "
            f"| {fastlazy.graph_cache.tier_summary()} |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python benchmarks/beyond_w4_text_training.py",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    zoo.table_options(parser, ROUNDS, models=",".join(MODELS))
    parser.add_argument("--one", help=argparse.SUPPRESS)     # (a child process's model)
    args = parser.parse_args(argv)
    if args.one:
        print(measure(args.one, args.rounds), flush=True)
        return
    missing = zoo.missing_library()
    if missing:
        sys.exit(missing)
    lines = ["| model | first step, eager / fastlazy | eager / fastlazy while compiling "
             "| settled in | eager (median step) | fastlazy (median step) "
             "| eager / fastlazy, settled (rounds' range) | fastlazy's graphs |",
             "|---|---|---|---|---|---|---|---|"]
    for name in args.models.split(","):
        # a process per model: its own compile thread and inductor state
        done = subprocess.run([sys.executable, __file__, "--one", name, "--rounds",
                               str(args.rounds)], capture_output=True, text=True)
        rows = [line for line in done.stdout.splitlines() if line.startswith("| ")]
        lines.append(rows[-1] if done.returncode == 0 and rows
                     else f"| {name} | failed: {(done.stderr or done.stdout).strip()[-300:]} |")
        print(lines[-1], flush=True)
    zoo.emit(lines, args.out)


if __name__ == "__main__":
    main()
