"""Inference tensors that a recorded op would save for backward.

Eager raises at the call when an op that builds autograd history saves an
inference tensor (`x * w` with x made under torch.inference_mode and w
requiring grad) -- but not when the op saves nothing (`x + w`): which
operands an op saves is its derivative formula's business.  The core asks
here (Hooks.check_saved_inference) before recording such a node, and the
node's own program answers: it runs on meta tensors of the operands' shapes
and dtypes, once with the inference operands made in inference mode and,
if that raises, once with none; an error only the first run raises is the
one eager raises at this call.
"""
from __future__ import annotations

import torch

from fastlazy import node_program
from fastlazy.backends.base import resolve


def check_saved(op, attr, dtype, operands):
    """Raise eager's error if node (op, attr, dtype) over `operands` -- the
    present operands as (value, is an inference tensor) -- saves an
    inference tensor for backward; else return None."""
    program = node_program.of_record(op, attr, dtype)[1]
    try:
        _run(program, [_meta(value, inference) for value, inference in operands])
    except Exception as exc:
        try:
            _run(program, [_meta(value, False) for value, _ in operands])
        except Exception:
            return None      # the meta run cannot judge this op
        raise exc.with_traceback(None) from None
    return None


def _meta(value, inference):
    if not isinstance(value, torch.Tensor):
        return value          # a Python number
    if inference:
        with torch._C._InferenceMode(True):
            return torch.empty(value.shape, dtype=value.dtype, device="meta")
    return torch.empty(value.shape, dtype=value.dtype, device="meta",
                       requires_grad=value.requires_grad)


def _run(program, inputs):
    values = []

    def ref(r):
        return inputs[r.k] if type(r) is node_program.Input else values[r.k]

    def sizes(of, count):
        return list(of.shape[-count:])

    for call in program.calls:
        args = [resolve(a, ref, sizes) for a in call.args]
        kwargs = {name: resolve(a, ref, sizes) for name, a in call.kwargs}
        values.append(call.fn(*args, **kwargs))
