"""Training steps of models outside W4, fastlazy against eager from the
same seeds: are the losses and every parameter after the steps eager's,
bit for bit?

A check of real models the tests do not hold, rather than a timing: each
model is built twice from one seed (tiny configurations: hidden 64, 2
layers, 4 heads, vocabulary 1000, 16 tokens, batch 2; images 1x3x64x64,
10 classes), and STEPS SGD steps are taken with the library's own loss (a
HuggingFace model's `labels=`, cross-entropy on a torchvision or timm
model's logits), the global seed set to the same value before each step
so that dropout draws alike.  fastlazy runs on its fast tier (compiles
held off: its kernels are eager's, so equality is exact; a compiled
program's fused arithmetic would round differently).  Each model runs in
a process of its own.  timm's models are included where timm is
installed.

    python benchmarks/training_sweep.py [--models bert,whisper] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

os.environ.setdefault("FASTLAZY_HOT_AFTER", str(10 ** 9))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import zoo  # noqa: E402

STEPS = 3
LR = 1e-2
VOCAB, HIDDEN, LAYERS, HEADS, INTERMEDIATE, POSITIONS, LENGTH, BATCH = 1000, 64, 2, 4, 128, 128, 16, 2


def _ids(seed=0):
    return torch.randint(3, VOCAB, (BATCH, LENGTH), generator=torch.Generator().manual_seed(seed))


def _lm():
    x = _ids()
    return dict(input_ids=x, labels=x)


def _classes():
    x = _ids()
    return dict(input_ids=x, attention_mask=torch.ones_like(x), labels=torch.tensor([1, 0]))


def _masked():
    x = _ids()
    labels = x.clone()
    labels[:, ::3] = -100
    return dict(input_ids=x, attention_mask=torch.ones_like(x), labels=labels)


def _seq2seq():
    x = _ids()
    return dict(input_ids=x, attention_mask=torch.ones_like(x), labels=_ids(1)[:, :8].contiguous())


def _images():
    return dict(pixel_values=torch.randn(BATCH, 3, 64, 64, generator=torch.Generator().manual_seed(0)),
                labels=torch.tensor([1, 7]))


def _audio():
    return dict(input_features=torch.randn(BATCH, 16, 64, generator=torch.Generator().manual_seed(0)),
                labels=_ids(1)[:, :8].contiguous())


def _sizes(**fields):
    return dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, **fields)


# name: (transformers config, model class, inputs, the configuration's fields)
HUGGINGFACE = {
    "bert": ("BertConfig", "BertForSequenceClassification", _classes,
             _sizes(intermediate_size=INTERMEDIATE, max_position_embeddings=POSITIONS, num_labels=3)),
    "roberta": ("RobertaConfig", "RobertaForMaskedLM", _masked,
                _sizes(intermediate_size=INTERMEDIATE, max_position_embeddings=POSITIONS)),
    "albert": ("AlbertConfig", "AlbertForMaskedLM", _masked,
               _sizes(intermediate_size=INTERMEDIATE, embedding_size=32,
                      max_position_embeddings=POSITIONS)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", _lm,
             dict(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=POSITIONS)),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", _lm,
             dict(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=POSITIONS,
                  rotary_dim=8, n_inner=INTERMEDIATE)),
    "bloom": ("BloomConfig", "BloomForCausalLM", _lm,
              dict(vocab_size=VOCAB, hidden_size=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                   hidden_dropout=0.1, attention_dropout=0.1)),
    "opt": ("OPTConfig", "OPTForCausalLM", _lm,
            _sizes(ffn_dim=INTERMEDIATE, max_position_embeddings=POSITIONS, word_embed_proj_dim=HIDDEN)),
    "llama": ("LlamaConfig", "LlamaForCausalLM", _lm,
              _sizes(num_key_value_heads=2, intermediate_size=INTERMEDIATE, attention_dropout=0.1)),
    "mistral": ("MistralConfig", "MistralForCausalLM", _lm,
                _sizes(num_key_value_heads=2, intermediate_size=INTERMEDIATE, sliding_window=8)),
    "phi": ("PhiConfig", "PhiForCausalLM", _lm,
            _sizes(intermediate_size=INTERMEDIATE, resid_pdrop=0.1, embd_pdrop=0.1)),
    "t5": ("T5Config", "T5ForConditionalGeneration", _seq2seq,
           dict(vocab_size=VOCAB, d_model=HIDDEN, d_kv=16, d_ff=INTERMEDIATE, num_layers=LAYERS,
                num_decoder_layers=LAYERS, num_heads=HEADS, decoder_start_token_id=0)),
    "bart": ("BartConfig", "BartForConditionalGeneration", _seq2seq,
             dict(vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=LAYERS, decoder_layers=LAYERS,
                  encoder_attention_heads=HEADS, decoder_attention_heads=HEADS,
                  encoder_ffn_dim=INTERMEDIATE, decoder_ffn_dim=INTERMEDIATE,
                  max_position_embeddings=POSITIONS)),
    "whisper": ("WhisperConfig", "WhisperForConditionalGeneration", _audio,
                dict(vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=LAYERS, decoder_layers=LAYERS,
                     encoder_attention_heads=HEADS, decoder_attention_heads=HEADS,
                     encoder_ffn_dim=INTERMEDIATE, decoder_ffn_dim=INTERMEDIATE, num_mel_bins=16,
                     max_source_positions=32, max_target_positions=64, decoder_start_token_id=1,
                     pad_token_id=0, dropout=0.1)),
    "vit_hf": ("ViTConfig", "ViTForImageClassification", _images,
               dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                    intermediate_size=INTERMEDIATE, image_size=64, patch_size=16, num_labels=10,
                    hidden_dropout_prob=0.1)),
}
TORCHVISION = ("resnext50_32x4d", "mnasnet0_5", "squeezenet1_1", "vgg11_bn", "convnext_tiny",
               "swin_t", "efficientnet_v2_s", "regnet_y_400mf")
TIMM = ("resnet26d", "efficientnet_b0", "convnext_atto", "ghostnet_100")


def _build(name: str):
    """(module, inputs: dict, loss(module, inputs)) of a sweep model."""
    zoo.define_torchvision_ops()
    if name in HUGGINGFACE:
        import transformers
        config_name, model_name, inputs, fields = HUGGINGFACE[name]
        config = getattr(transformers, config_name)(**fields)
        return (getattr(transformers, model_name)(config), inputs(),
                lambda module, given: module(**given).loss)
    if name in TORCHVISION:
        import torchvision
        module = getattr(torchvision.models, name)(num_classes=10)
    else:
        import timm
        module = timm.create_model(name, pretrained=False, num_classes=10)
    inputs = dict(x=torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(0)),
                  target=torch.tensor([3]))
    return module, inputs, lambda module, given: F.cross_entropy(module(given["x"]), given["target"])


def check(name: str) -> dict:
    """Train eager's and fastlazy's copies of `name` STEPS steps; what
    differed (run in this process)."""
    import fastlazy
    torch.set_num_threads(1)
    torch.manual_seed(0)
    eager, inputs, loss_of = _build(name)
    lazy = _build(name)[0]
    lazy.load_state_dict(eager.state_dict())
    eager.train()
    lazy.train()
    fastlazy.enable()
    lazy_inputs = {k: fastlazy.lazy(v) if isinstance(v, torch.Tensor) else v
                   for k, v in inputs.items()}
    losses = []
    for module, given in ((eager, inputs), (lazy, lazy_inputs)):
        opt = torch.optim.SGD(module.parameters(), lr=LR)
        steps = []
        for step in range(STEPS):
            torch.manual_seed(100 + step)
            opt.zero_grad()
            loss = loss_of(module, given)
            loss.backward()
            opt.step()
            steps.append(loss.item())
        losses.append(steps)
    expected, got = eager.state_dict(), fastlazy.to_cpu(lazy.state_dict())
    differ = [k for k, e in expected.items() if not torch.equal(e, got[k])]
    counters = fastlazy.metrics.counters()
    return {"model": name, "losses_equal": losses[0] == losses[1], "losses": losses,
            "tensors": len(expected), "differ": differ, "fallbacks": counters["fallbacks"],
            "flushes_per_step": counters["flushes"] / STEPS}


def _row(r: dict) -> str:
    if "error" in r:
        return f"| {r['model']} | error: {r['error']} | | | |"
    same = "yes" if r["losses_equal"] else f"no: {r['losses'][0][0]:.7g} against {r['losses'][1][0]:.7g}"
    state = (f"all {r['tensors']} equal" if not r["differ"]
             else f"{len(r['differ'])} of {r['tensors']} differ ({', '.join(r['differ'][:3])})")
    return f"| {r['model']} | {same} | {state} | {r['fallbacks']} | {r['flushes_per_step']:.0f} |"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python benchmarks/training_sweep.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    names = list(HUGGINGFACE) + list(TORCHVISION)
    try:
        import timm  # noqa: F401
        names += list(TIMM)
    except ImportError:
        pass
    parser.add_argument("--models", default=",".join(names))
    parser.add_argument("--out", help="also write the table to this file")
    parser.add_argument("--one", help=argparse.SUPPRESS)     # (a child process's model)
    args = parser.parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(check(args.one)), flush=True)
        return
    missing = zoo.missing_library()
    if missing:
        sys.exit(missing)
    lines = [f"| model | losses of {STEPS} steps equal | parameters and buffers after them "
             "| fallbacks | graphs a step |", "|---|---|---|---|---|"]
    for name in args.models.split(","):
        try:
            done = subprocess.run([sys.executable, __file__, "--one", name], capture_output=True,
                                  text=True, timeout=600)
            results = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            row = (json.loads(results[-1][7:]) if results
                   else {"model": name, "error": (done.stderr or done.stdout).strip()[-200:]})
        except subprocess.TimeoutExpired:
            row = {"model": name, "error": "timed out"}
        lines.append(_row(row))
        print(lines[-1], flush=True)
    zoo.emit(lines, args.out)


if __name__ == "__main__":
    main()
