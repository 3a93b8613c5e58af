"""First calls of real models outside W4's six, eager against fastlazy's
default engine, each call in a fresh process (target P11's measure, on
models the zoo does not hold).

The models are built from their libraries' constructors with seeded random
weights and small configs (nothing is downloaded), in inference under
no_grad at batch 1; the clock covers the first call, the output read
(imports and construction not counted).  Each model runs ROUNDS rounds,
eager's process then fastlazy's; the table gives each one's mean.

    python benchmarks/beyond_w4.py [--models swin_t,falcon] [--rounds 2] [--out FILE]
    python benchmarks/beyond_w4.py --one MODEL eager|fastlazy     (one process's call)
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

import zoo

ROUNDS = 2
VOCAB, HIDDEN, LAYERS, HEADS, INTERMEDIATE, POSITIONS, LENGTH = 1000, 64, 2, 4, 128, 128, 16


def _vision(name):
    def build():
        import torchvision
        return (getattr(torchvision.models, name)(num_classes=100),
                (torch.randn(1, 3, 64, 64),), lambda out: out)
    return build


def _tokens():
    return torch.randint(0, VOCAB, (1, LENGTH), generator=torch.Generator().manual_seed(0))


def _causal_lm(config_name, model_name, **config):
    def build():
        import transformers
        cfg = getattr(transformers, config_name)(
            vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
            num_attention_heads=HEADS, **config)
        return (getattr(transformers, model_name)(cfg), (_tokens(),), lambda out: out.logits)
    return build


def _distilbert():
    import transformers
    cfg = transformers.DistilBertConfig(vocab_size=VOCAB, dim=HIDDEN, n_layers=LAYERS,
                                        n_heads=HEADS, hidden_dim=INTERMEDIATE,
                                        max_position_embeddings=POSITIONS, dropout=0.0,
                                        attention_dropout=0.0)
    return transformers.DistilBertModel(cfg), (_tokens(),), lambda out: out.last_hidden_state


def _t5():
    import transformers
    cfg = transformers.T5Config(vocab_size=VOCAB, d_model=HIDDEN, d_kv=16, d_ff=INTERMEDIATE,
                                num_layers=LAYERS, num_decoder_layers=LAYERS, num_heads=HEADS,
                                dropout_rate=0.0, decoder_start_token_id=0)
    model = transformers.T5ForConditionalGeneration(cfg)
    return (lambda x: model(input_ids=x, decoder_input_ids=x[:, :LENGTH // 2]), (_tokens(),),
            lambda out: out.logits)


MODELS = {
    "swin_t": _vision("swin_t"),
    "densenet121": _vision("densenet121"),
    "efficientnet_b0": _vision("efficientnet_b0"),
    "shufflenet_v2_x0_5": _vision("shufflenet_v2_x0_5"),
    "falcon": _causal_lm("FalconConfig", "FalconForCausalLM", hidden_dropout=0.0,
                         attention_dropout=0.0),
    "mistral": _causal_lm("MistralConfig", "MistralForCausalLM", num_key_value_heads=2,
                          intermediate_size=INTERMEDIATE, max_position_embeddings=POSITIONS),
    "distilbert": _distilbert,
    "t5": _t5,
}


def one(name: str, contender: str) -> float:
    """The first call's seconds in this process."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    zoo.define_torchvision_ops()        # (transformers may import torchvision)
    model, inputs, output = MODELS[name]()
    if isinstance(model, torch.nn.Module):
        model.eval()
    if contender == "fastlazy":
        import fastlazy
        fastlazy.enable()
        start = time.perf_counter()
        inputs = tuple(fastlazy.lazy(t) for t in inputs)
        with torch.no_grad():
            output(model(*inputs)).to_eager()
    else:
        start = time.perf_counter()
        with torch.no_grad():
            output(model(*inputs))
    return time.perf_counter() - start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python benchmarks/beyond_w4.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    zoo.table_options(parser, ROUNDS, models=",".join(MODELS))
    parser.add_argument("--one", nargs=2, metavar=("MODEL", "CONTENDER"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps({"first_call_s": one(*args.one)}))
        return
    zoo.ready_to_time()
    lines = ["| model | eager's first call | fastlazy's first call | fastlazy / eager |",
             "|---|---|---|---|"]
    for name in args.models.split(","):
        times = {"eager": [], "fastlazy": []}
        for _ in range(args.rounds):
            for contender in times:
                run = subprocess.run([sys.executable, __file__, "--one", name, contender],
                                     capture_output=True, text=True, check=True)
                times[contender].append(json.loads(run.stdout.splitlines()[-1])["first_call_s"])
        eager, lazy = statistics.mean(times["eager"]), statistics.mean(times["fastlazy"])
        lines.append(f"| {name} | {eager * 1e3:.0f} ms | {lazy * 1e3:.0f} ms "
                     f"| {lazy / eager:.1f}x |")
        print(lines[-1], file=sys.stderr, flush=True)
    zoo.emit(lines, args.out)


if __name__ == "__main__":
    main()
