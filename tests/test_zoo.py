"""W4's real models (benchmarks/zoo.py: torchvision's resnet18,
mobilenet_v3_small and a small ViT; HuggingFace's BERT, GPT-2 and Llama) at
batch 1 on fastlazy's default backend, the modules eager and their inputs
lazy: eager's output in inference, eager's loss, gradients, parameters and
buffers over three SGD steps in training; and on a steady-state call (the
second inference, the third training step) at most BOUNDS' fallbacks and
graphs.  Each on the CPU and on CUDA (the `device` fixture), against eager
on the same device.

Skipped without torchvision or transformers: install them with
`pip install --no-deps torchvision==0.28.0 && pip install -e ".[zoo]"`.
"""
import contextlib
import warnings

import pytest
import torch

import fastlazy

from helpers import import_benchmark

zoo = import_benchmark("zoo")
zoo.define_torchvision_ops()            # before torchvision's import (see zoo's docstring)
pytest.importorskip("torchvision")
pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("lazy_on")

# Per model and mode, on one steady-state call at batch 1: the most
# fallbacks (calls run eagerly, counters()["fallbacks"]) and graphs computed
# (counters()["flushes"]) allowed.  The target of every one is one graph
# per call with no fallback; a regression fails here, and fastlazy.explain()
# in the message names the call.
BOUNDS = {key: dict(fallbacks=0, graphs=1) for key in (
    ("resnet18", "infer"), ("mobilenet_v3_small", "infer"), ("vit", "infer"),
    ("bert", "infer"), ("gpt2", "infer"), ("llama", "infer"),
    ("resnet18", "train"), ("gpt2", "train"))}

CUDA_TRAINING_EAGER = ("F.scaled_dot_product_attention", "F.batch_norm")

SIZE = zoo.SIZES[1]
TOLERANCE = dict(rtol=1e-4, atol=1e-5)
TRAIN_STEPS = 3


@contextlib.contextmanager
def _fastlazy_off():
    """The eager reference runs with fastlazy disabled (the lazy_on fixture
    enabled it)."""
    fastlazy.disable()
    try:
        yield
    finally:
        fastlazy.enable()


def _to_eager(t):
    assert isinstance(t, fastlazy.LazyTensor), f"the output is a {type(t).__name__}"
    return t.to_eager()


def _as_eager(t):
    return t.to_eager() if isinstance(t, fastlazy.LazyTensor) else t


def _check_bounds(name, mode, counters, device="cpu"):
    bound = BOUNDS[name, mode]
    fallbacks = {k: v for k, v in counters.items() if k.startswith("fallback.")}
    # What a CUDA training step runs eagerly, each call ending a graph:
    # attention with dropout (the efficient-attention kernel draws its mask
    # from the CUDA generator at the call, so seeded runs match eager's) and
    # cuDNN's batch norm (fastlazy.running_stats)
    excused = (sum(counters.get(f"fallback.{op}", 0) for op in CUDA_TRAINING_EAGER)
               if device == "cuda" and mode == zoo.TRAIN else 0)
    measured = dict(fallbacks=counters["fallbacks"] - excused,
                    graphs=counters["flushes"] - excused)
    for key, limit in bound.items():
        assert measured[key] <= limit, (
            f"{name} {mode}: {measured[key]} {key} per call, bound {limit}; "
            f"fallbacks by op: {fallbacks}\n{fastlazy.metrics.explain()}")
    if measured != bound:
        warnings.warn(f"{name} {mode} does better than BOUNDS ({measured} against "
                      f"{bound}): lower its bound in tests/test_zoo.py")


@pytest.mark.parametrize("name", [m.name for m in zoo.W4])
def test_inference_matches_eager(name, device):
    model = zoo.MODELS[name]
    module = model.build(SIZE).to(device)
    x = model.inputs(SIZE)[0].to(device)
    with _fastlazy_off():
        want = zoo.step(model, module, module, x, None, zoo.INFER)()
    lazy_call = zoo.step(model, module, module, fastlazy.lazy(x), None, zoo.INFER,
                         read=_to_eager)
    torch.testing.assert_close(lazy_call(), want, **TOLERANCE)   # first call: compiles
    fastlazy.metrics.reset()
    got = lazy_call()
    counters = fastlazy.metrics.counters()
    torch.testing.assert_close(got, want, **TOLERANCE)
    _check_bounds(name, zoo.INFER, counters, device)


@pytest.mark.parametrize("name", [m.name for m in zoo.W4 if zoo.TRAIN in m.modes])
def test_training_steps_match_eager(name, device):
    """Forward, loss, backward, SGD step, three times, on two copies of the
    model: the lazy input's loss and the copy's gradients, parameters and
    buffers (batch-norm statistics) are eager's after every step.  On CUDA,
    where eager's own training step is not deterministic (cuDNN's algorithms,
    atomic additions in backward kernels), within eager's distance from a
    third copy trained eagerly too: four times its spread, per tensor, beyond
    the tolerance."""
    model = zoo.MODELS[name]
    x, target = (t.to(device) for t in model.inputs(SIZE))
    eager_module = model.build(SIZE, zoo.TRAIN).to(device)
    lazy_module = model.build(SIZE, zoo.TRAIN).to(device)
    eager_step = zoo.step(model, eager_module, eager_module, x, target, zoo.TRAIN)
    lazy_step = zoo.step(model, lazy_module, lazy_module, fastlazy.lazy(x),
                         fastlazy.lazy(target), zoo.TRAIN)
    twin_module = twin_step = None
    if device != "cpu":
        twin_module = model.build(SIZE, zoo.TRAIN).to(device)
        twin_step = zoo.step(model, twin_module, twin_module, x, target, zoo.TRAIN)
    for k in range(TRAIN_STEPS):
        with _fastlazy_off():
            torch.manual_seed(k)                  # the dropout masks
            want = eager_step()
            want_state = zoo.state(eager_module)
            spread = [0.0] * (len(want_state) + 1)
            if twin_step is not None:
                torch.manual_seed(k)
                twin = [twin_step(), *zoo.state(twin_module)]
                spread = [(torch.as_tensor(a, dtype=torch.float64)
                           - torch.as_tensor(b, dtype=torch.float64)).abs().max().item()
                          for a, b in zip(twin, [want, *want_state])]
        fastlazy.metrics.reset()
        torch.manual_seed(k)
        got = lazy_step()
        counters = fastlazy.metrics.counters()
        got_state = zoo.state(lazy_module, _as_eager)
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=TOLERANCE["rtol"],
                                   atol=TOLERANCE["atol"] + 4 * spread[0],
                                   msg=lambda m: f"loss, step {k}: {m}")
        assert len(got_state) == len(want_state)
        for i, (g, w) in enumerate(zip(got_state, want_state)):
            torch.testing.assert_close(g, w, rtol=TOLERANCE["rtol"],
                                       atol=TOLERANCE["atol"] + 4 * spread[i + 1],
                                       msg=lambda m: f"step {k}, tensor {i} of "
                                                     f"zoo.state: {m}")
    _check_bounds(name, zoo.TRAIN, counters, device)      # the last step's
