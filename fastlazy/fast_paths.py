"""torch modules whose eager fast path computes other values than their
ordinary path, and which a LazyTensor would send down the ordinary one.

`nn.TransformerEncoder` in inference with a `src_key_padding_mask` runs its
layers on a nested tensor built from the mask, and pads the result back
with zeros: its output is 0.0 at every padded position.  Among the many
conditions it checks first is `torch.overrides.has_torch_function` of its
tensor arguments, which a LazyTensor makes true, so recorded lazily it takes
the ordinary path, whose padded positions hold the layers' values (the
other positions agree).  With a LazyTensor argument, where the fast path is
possible at all (inference, a padding mask, nested tensors in use, torch's
MHA fast path on), the forward runs on the arguments' values: the module
itself then decides its path exactly as eager does, and its result comes
back as a LazyTensor.  The call is counted as a fallback (explain()).

`nn.MultiheadAttention` in inference calls one fused kernel
(`torch._native_multi_head_attention`) where eager tensors come in; its
ordinary path is a dozen ops (ViT's attention: 0.77 ms a call on the fast
tier against eager's 0.71).  The fast path's only objection to a
LazyTensor is that same `has_torch_function` question: with a LazyTensor
argument its forward runs with it answered as for eager tensors (once, on
this thread: `torch.overrides.has_torch_function` is gated while fastlazy
is enabled, as python_bodies gates torch.nn.functional's), so it takes
eager's path, and the kernel is recorded -- by its C rule (R_NATIVE_MHA)
for self-attention without a mask or weights, by the generic path
otherwise: eager's values, bit for bit.

`nn.TransformerEncoderLayer` in inference likewise calls one fused kernel
(`torch._transformer_encoder_layer_fwd`, of 13 tensors, 14 with a mask)
after the same question, and its forward is gated the same way: the call
is recorded by the generic path as one node (under CPU autocast, whose
casts that kernel makes inside itself, the analysis sees eager's dtype
differ from the recorded program's, and the call runs on the values:
capture._run_small).  Its ordinary path costs a LazyTensor several times eager's
Python (the attention's forward, a dozen module calls) for the same
kernels: a layer of width 256 at sequence 32 ran at 0.83x eager's speed on
the fast tier that way, 0.92x as the one call.

Whether those fast paths exist at all is decided when a layer is built:
`nn.TransformerEncoderLayer` takes them only for an activation that `is`
`F.relu` or `F.gelu`, and while fastlazy is enabled those names hold its
entry points, so a layer built then with the default activation (torch's
own `F.relu`, bound when the class was defined) would lose them -- for
eager tensors too, and its encoder with it.  A layer built while fastlazy
is enabled takes them as eager would: its activation is compared with the
functions fastlazy's entries wrap.
"""
from __future__ import annotations

import functools
import inspect

import torch

from fastlazy import _core, fallback, python_bodies, views
from fastlazy._core import LazyTensor


def _encoder_forward(forward):
    signature = inspect.signature(forward)

    def call(self, *args, **kwargs):
        if self.training or next(views.lazy_operands(args, kwargs), None) is None:
            return forward(self, *args, **kwargs)
        given = signature.bind(self, *args, **kwargs).arguments
        if (given.get("src_key_padding_mask") is not None
                and getattr(self, "use_nested_tensor", False)
                and torch.backends.mha.get_fastpath_enabled()):
            fallback.count("TransformerEncoder.forward",
                           "its nested-tensor fast path pads with zeros (run on the values)")
            return fallback.run(forward, (self, *args), kwargs)
        return forward(self, *args, **kwargs)
    # (eager calls go to torch's own from C)
    return _core.lazy_arguments_first(forward, call)


# the "no" a gated forward's fast-path question gets
_answer = python_bodies.OneNo()


def _about_lazy_tensors(relevant_args):
    """Is the question about LazyTensors (and tensors eager would answer
    "no" for)?  Not torch's own questions about the fake tensors of an
    analysis the forward's calls start: those get torch's answer."""
    others = tuple(a for a in relevant_args if type(a) is not LazyTensor)
    return len(others) < len(relevant_args) and not _HAS_TORCH_FUNCTION(others)


_HAS_TORCH_FUNCTION = torch.overrides.has_torch_function


def _eager_path_forward(forward):
    """A module forward that asks has_torch_function only to refuse its
    fast path: asked about LazyTensors, answered as for eager tensors."""

    def call(self, *args, **kwargs):
        if next(views.lazy_operands(args, kwargs), None) is None:
            return forward(self, *args, **kwargs)
        was = _answer.pending
        _answer.pending = True
        try:
            return forward(self, *args, **kwargs)
        finally:
            _answer.pending = was
    # (eager calls go to torch's own from C)
    return _core.lazy_arguments_first(forward, call)


def _layer_init(init):
    @functools.wraps(init)
    def call(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if getattr(self, "activation_relu_or_gelu", None) == 0:
            activation = _unwrapped(self.activation)
            functional = torch.nn.functional
            if activation is _unwrapped(functional.relu):
                self.activation_relu_or_gelu = 1
            elif activation is _unwrapped(functional.gelu):
                self.activation_relu_or_gelu = 2
    return call


def _unwrapped(function):
    """The torch function a fastlazy entry point wraps; anything else as it is."""
    return getattr(function, "__wrapped__", function)


def python_patches():
    """(owner, attr, replacement) for each module this torch has."""
    patches = []
    encoder = getattr(torch.nn, "TransformerEncoder", None)
    if encoder is not None:
        patches.append((encoder, "forward", _encoder_forward(vars(encoder)["forward"])))
    layer = getattr(torch.nn, "TransformerEncoderLayer", None)
    if layer is not None:
        patches.append((layer, "__init__", _layer_init(vars(layer)["__init__"])))
    if layer is not None and "has_torch_function" in inspect.getsource(layer.forward):
        patches.append((layer, "forward", _eager_path_forward(vars(layer)["forward"])))
    attention = torch.nn.MultiheadAttention
    if "has_torch_function" in inspect.getsource(attention.forward):
        patches.append((attention, "forward", _eager_path_forward(vars(attention)["forward"])))
    patches.append((torch.overrides, "has_torch_function",
                    python_bodies.gate(_HAS_TORCH_FUNCTION, _answer, _about_lazy_tensors)))
    return patches
