"""Steady state of real models outside W4 (they appear nowhere else in the
repository): eager against fastlazy's default engine, batch 1 inference
under no_grad, in one process, in alternating blocks as
benchmarks/w4_interleaved.py times W4 (that script's _round).

Per model: the first call; then two rounds of 0.3 s blocks right after it
(the fast tier, or a compile under way beside it: the graphs' tiers are
printed); then fastlazy settled as report.py settles it (every hot graph
compiled in the background and its tier chosen), its output checked against
eager's, and three rounds of 1 s blocks.  A ratio is eager's median call over
fastlazy's (higher is better).

    python benchmarks/beyond_w4_steady.py [--models t5,resnet50] [--out FILE]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import beyond_w4
import w4_interleaved
import workloads
import zoo

def _longformer():
    """Longformer's sliding-window attention builds its band by writes into
    fresh tensors (x[:, :3] = ..., masked_fill_) and chunks by as_strided:
    64 tokens, four windows of 8."""
    import transformers
    cfg = transformers.LongformerConfig(
        vocab_size=beyond_w4.VOCAB, hidden_size=beyond_w4.HIDDEN,
        num_hidden_layers=beyond_w4.LAYERS, num_attention_heads=beyond_w4.HEADS,
        intermediate_size=beyond_w4.INTERMEDIATE, attention_window=8,
        max_position_embeddings=beyond_w4.POSITIONS + 2)
    tokens = torch.randint(0, beyond_w4.VOCAB, (1, 64), generator=torch.Generator().manual_seed(0))
    return transformers.LongformerModel(cfg), (tokens,), lambda out: out.last_hidden_state


def _led():
    """LED, Longformer's encoder-decoder."""
    import transformers
    cfg = transformers.LEDConfig(
        vocab_size=beyond_w4.VOCAB, d_model=beyond_w4.HIDDEN, encoder_layers=beyond_w4.LAYERS,
        decoder_layers=beyond_w4.LAYERS, encoder_attention_heads=beyond_w4.HEADS,
        decoder_attention_heads=beyond_w4.HEADS, encoder_ffn_dim=beyond_w4.INTERMEDIATE,
        decoder_ffn_dim=beyond_w4.INTERMEDIATE, attention_window=8,
        max_encoder_position_embeddings=beyond_w4.POSITIONS,
        max_decoder_position_embeddings=beyond_w4.POSITIONS)
    model = transformers.LEDForConditionalGeneration(cfg).eval()     # (measure sees a lambda)
    n = beyond_w4.LENGTH
    return (lambda x: model(input_ids=x, decoder_input_ids=x[:, :n // 2]), (beyond_w4._tokens(),),
            lambda out: out.logits)


# beyond_w4's models and a few more of torchvision's and HuggingFace's
MODELS = dict(
    beyond_w4.MODELS,
    resnet50=beyond_w4._vision("resnet50"),
    convnext_tiny=beyond_w4._vision("convnext_tiny"),
    regnet_y_400mf=beyond_w4._vision("regnet_y_400mf"),
    mobilenet_v2=beyond_w4._vision("mobilenet_v2"),
    squeezenet1_0=beyond_w4._vision("squeezenet1_0"),
    opt=beyond_w4._causal_lm("OPTConfig", "OPTForCausalLM", ffn_dim=128,
                             word_embed_proj_dim=64, max_position_embeddings=128),
    qwen2=beyond_w4._causal_lm("Qwen2Config", "Qwen2ForCausalLM", num_key_value_heads=2,
                               intermediate_size=128),
    phi=beyond_w4._causal_lm("PhiConfig", "PhiForCausalLM", intermediate_size=128),
    longformer=_longformer,
    led=_led,
)


def _ratio(eager, lazy, seconds: float, rounds: int) -> list[float]:
    """Each round's eager median call over fastlazy's, the block order
    alternating from round to round."""
    ratios = []
    for k in range(rounds):
        if k % 2:
            f, e = w4_interleaved._round([lazy, eager], seconds, 5)
        else:
            e, f = w4_interleaved._round([eager, lazy], seconds, 5)
        ratios.append(statistics.median(e) / statistics.median(f))
    return ratios


def measure(name: str) -> str:
    import fastlazy
    torch.manual_seed(0)
    model, inputs, output = MODELS[name]()
    if isinstance(model, torch.nn.Module):
        model.eval()

    def eager():
        with torch.no_grad():
            return output(model(*inputs))

    contender = workloads.contender_named("fastlazy[auto]")
    with contender.session():
        lazy_inputs = tuple(fastlazy.lazy(t) for t in inputs)

        def lazy():
            with torch.no_grad():
                return output(model(*lazy_inputs)).to_eager()

        for _ in range(3):
            eager()
        start = time.perf_counter()
        lazy()
        first = time.perf_counter() - start
        early = _ratio(eager, lazy, 0.3, 2)
        early_tiers = fastlazy.graph_cache.tier_summary()
        start = time.perf_counter()
        contender.settle([lazy])
        settle = time.perf_counter() - start
        torch.testing.assert_close(lazy(), eager(), **contender.settled_w4_tolerance)
        settled = _ratio(eager, lazy, 1.0, 3)
        tiers = fastlazy.graph_cache.tier_summary()
    return (f"| {name} | {first * 1e3:.0f} ms | {statistics.median(early):.2f}x ({early_tiers}) "
            f"| **{statistics.median(settled):.2f}x** ({min(settled):.2f}-{max(settled):.2f}; "
            f"{tiers}) | {settle:.0f} s |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python benchmarks/beyond_w4_steady.py",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    zoo.ready_to_time()
    zoo.define_torchvision_ops()
    lines = ["| model (batch 1, inference) | fastlazy's first call | eager / fastlazy, "
             "calls right after it | eager / fastlazy, settled | settling took |",
             "|---|---|---|---|---|"]
    for name in args.models.split(","):
        lines.append(measure(name))
        print(lines[-1], file=sys.stderr, flush=True)
    zoo.emit(lines, args.out)


if __name__ == "__main__":
    main()
