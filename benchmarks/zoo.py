"""W4's models: real models from torchvision and HuggingFace transformers,
built from their constructors and configs with seeded random weights
(nothing is downloaded), their inputs at two sizes, and the step a run makes.

One definition for the benchmark (benchmarks/test_w4.py, through
workloads.py) and for CI's correctness check (tests/test_zoo.py, which loads
this file by its path).  This module imports neither torchvision nor
transformers: a model's constructor imports its library when it is built.

torchvision 0.28's wheel (the one matching torch 2.13) is linked against the
CUDA libtorch.  With the CPU wheel of torch its C extension does not load,
and `import torchvision` then fails where it registers fake kernels for the
`torchvision::nms` and `torchvision::qnms` ops, whose schemas the extension
would have defined.  `define_torchvision_ops()` defines those two schemas
(schemas only: the classification models here call no torchvision op) when
the extension does not load; call it before importing torchvision.
"""
from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import pathlib
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F       # F.cross_entropy looked up per call: fastlazy patches it
from torch import nn

INFER, TRAIN = "infer", "train"
LR = 0.01
CLASSES = 1000       # torchvision's default head, for all three image models
VOCAB = 1000
HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE, POSITIONS = 128, 2, 4, 2, 256, 128
VIT_PATCH = 16

# -- torchvision without its C extension ------------------------------------

_TORCHVISION_SCHEMAS = {
    # as torchvision 0.28 defines them (csrc/ops/nms.cpp, quantized/qnms)
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_torchvision_library: list = []      # the Library holding the schemas, kept alive


def _has_schema(qualified_name: str) -> bool:
    return bool(torch._C._jit_get_schemas_for_operator(qualified_name))


def _torchvision_extension_loads(package: pathlib.Path) -> bool:
    """Load torchvision's C extension as its import would; False if it does
    not load against this torch."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = package / f"_C{suffix}"
        if path.exists():
            try:
                torch.ops.load_library(str(path))
                return True
            except OSError:
                return False
    return False


def define_torchvision_ops() -> None:
    """Make `import torchvision` work where its C extension does not load
    (see the module's docstring).  Idempotent; does nothing when
    torchvision is not installed or its extension loads."""
    if _has_schema("torchvision::nms"):
        return
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return
    if _torchvision_extension_loads(pathlib.Path(spec.submodule_search_locations[0])):
        return
    library = torch.library.Library("torchvision", "DEF")
    for name, schema in _TORCHVISION_SCHEMAS.items():
        if not _has_schema(f"torchvision::{name}"):
            library.define(schema)
    _torchvision_library.append(library)


# -- sizes and models ------------------------------------------------------------

@dataclass(frozen=True)
class Size:
    """One input size: batch 1 (per-op overhead counts) or batch 8 on larger
    inputs (kernels dominate).  Images are batch x 3 x image x image, texts
    batch x seq token ids."""
    batch: int
    image: int
    seq: int


SIZES = {1: Size(1, 64, 32), 8: Size(8, 128, 128)}     # by batch


def _torchvision():
    define_torchvision_ops()
    import torchvision.models
    return torchvision.models


def _transformers():
    define_torchvision_ops()      # transformers imports torchvision where it is installed
    import transformers
    transformers.logging.set_verbosity_error()   # config notes on every build
    return transformers


def resnet18(size: Size) -> nn.Module:
    return _torchvision().resnet18(num_classes=CLASSES)


def mobilenet_v3_small(size: Size) -> nn.Module:
    return _torchvision().mobilenet_v3_small(num_classes=CLASSES)


def vit(size: Size) -> nn.Module:
    """A small ViT: 2 layers, 4 heads, width 128, 16x16 patches (16 patches
    at 64x64, 64 at 128x128: its position embedding is sized for the image)."""
    return _torchvision().VisionTransformer(
        image_size=size.image, patch_size=VIT_PATCH, num_layers=LAYERS, num_heads=HEADS,
        hidden_dim=HIDDEN, mlp_dim=INTERMEDIATE, num_classes=CLASSES)


# Dropout is the libraries' default (0.1 in BERT and GPT-2): a training step
# is then the real one, random numbers included.  (Contenders that draw them
# differently from eager, torch.compile and torch._lazy, cannot have their
# training losses checked against eager's: see workloads._check_w4.)

def bert(size: Size) -> nn.Module:
    t = _transformers()
    return t.BertModel(t.BertConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, intermediate_size=INTERMEDIATE,
        max_position_embeddings=POSITIONS))


def gpt2(size: Size) -> nn.Module:
    t = _transformers()
    return t.GPT2LMHeadModel(t.GPT2Config(
        vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_inner=INTERMEDIATE,
        n_positions=POSITIONS, bos_token_id=0, eos_token_id=0))


def llama(size: Size) -> nn.Module:
    t = _transformers()
    return t.LlamaForCausalLM(t.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        intermediate_size=INTERMEDIATE, max_position_embeddings=POSITIONS))


@dataclass(frozen=True)
class ZooModel:
    """A W4 model: its library, its constructor, whether it takes images or
    token ids, the output attribute read (HuggingFace returns a ModelOutput;
    None: the output is the tensor), and the modes it runs in."""
    name: str
    library: str
    make: Callable[[Size], nn.Module]
    text: bool
    output: str | None
    modes: tuple = (INFER,)

    def build(self, size: Size, mode: str = INFER) -> nn.Module:
        """The model with seeded random weights, in eval or train mode."""
        torch.manual_seed(0)
        return self.make(size).train(mode == TRAIN)

    def inputs(self, size: Size) -> tuple[torch.Tensor, torch.Tensor]:
        """The input (images or token ids) and the training target (class
        labels; for a language model the ids themselves: HuggingFace shifts
        them), seeded."""
        gen = torch.Generator().manual_seed(1)
        if self.text:
            ids = torch.randint(0, VOCAB, (size.batch, size.seq), generator=gen)
            return ids, ids.clone()
        images = torch.randn(size.batch, 3, size.image, size.image, generator=gen)
        return images, torch.randint(0, CLASSES, (size.batch,), generator=gen)

    def describe(self, size: Size) -> str:
        """The input's shape in words."""
        if self.text:
            return f"{size.batch}x{size.seq} tokens"
        return f"{size.batch}x3x{size.image}x{size.image}"

    def read(self, result) -> torch.Tensor:
        """The tensor of a forward's result that a step reads."""
        return result if self.output is None else getattr(result, self.output)

    def loss(self, forward: Callable, x, target) -> torch.Tensor:
        """Cross-entropy on the class logits; HuggingFace's own causal-LM
        loss (`labels=`) for a language model."""
        if self.text:
            return forward(x, labels=target).loss
        return F.cross_entropy(forward(x), target)


W4 = (
    ZooModel("resnet18", "torchvision", resnet18, False, None, (INFER, TRAIN)),
    ZooModel("mobilenet_v3_small", "torchvision", mobilenet_v3_small, False, None),
    ZooModel("vit", "torchvision", vit, False, None),
    ZooModel("bert", "transformers", bert, True, "last_hidden_state"),
    ZooModel("gpt2", "transformers", gpt2, True, "logits", (INFER, TRAIN)),
    ZooModel("llama", "transformers", llama, True, "logits"),
)
MODELS = {m.name: m for m in W4}


def missing_library() -> str | None:
    """Why W4 cannot run here (a library is missing), or None."""
    define_torchvision_ops()
    for library in ("torchvision", "transformers"):
        try:
            importlib.import_module(library)
        except ImportError as error:
            return f"W4 needs {library}: {error}"
    return None


def table_options(parser, rounds: int, models: str | None = None) -> None:
    """Add the options the scripts that print a W4 table share to
    `parser`: --models (default: W4's, or `models`), --rounds, --out."""
    parser.add_argument("--models", default=models or ",".join(m.name for m in W4))
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--out", help="also write the table to this file")


def ready_to_time() -> None:
    """Exit naming the missing library where W4 cannot run; else time with
    one intra-op thread."""
    missing = missing_library()
    if missing:
        sys.exit(missing)
    torch.set_num_threads(1)


def emit(lines: list[str], out: str | None) -> None:
    """Print a table, and write it to the file `out` where one is given."""
    print("\n".join(lines))
    if out:
        pathlib.Path(out).write_text("\n".join(lines) + "\n")


def step(model: ZooModel, module: nn.Module, forward: Callable, x, target, mode: str,
         read: Callable = lambda t: t, after_step: Callable = lambda: None) -> Callable:
    """One W4 call as a zero-argument function.  Inference: under no_grad,
    `read` of the output tensor.  Training: zero_grad, forward, loss,
    backward, SGD step on `module`'s parameters, `after_step()`, then the
    loss as a float."""
    if mode == INFER:
        def infer():
            with torch.no_grad():
                return read(model.read(forward(x)))
        return infer
    opt = torch.optim.SGD(module.parameters(), lr=LR)

    def train():
        opt.zero_grad()
        loss = model.loss(forward, x, target)
        loss.backward()
        opt.step()
        after_step()
        return loss.item()
    return train


def median_block(step: Callable, seconds: float) -> float:
    """The median time of step() called without pause for `seconds`."""
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def alternating_rounds(eager: Callable, lazy: Callable, rounds: int,
                       seconds: float) -> list[tuple[float, float]]:
    """(eager's, fastlazy's) median_block per round, which contender's
    block comes first alternating from round to round."""
    pairs = []
    for k in range(rounds):
        if k % 2:
            f, e = median_block(lazy, seconds), median_block(eager, seconds)
        else:
            e, f = median_block(eager, seconds), median_block(lazy, seconds)
        pairs.append((e, f))
    return pairs


def state(module: nn.Module, read: Callable = lambda t: t) -> list[torch.Tensor]:
    """After a training step: every gradient, parameter and buffer of the
    module, through `read` (to an eager tensor), cloned."""
    tensors = [p.grad for p in module.parameters() if p.grad is not None]
    tensors += list(module.parameters()) + list(module.buffers())
    return [read(t.detach()).clone() for t in tensors]

