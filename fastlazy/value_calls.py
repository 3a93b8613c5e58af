"""torch functions bound in C++ without __torch_function__ handling that
torch's own Python code calls on user tensors.

A LazyTensor passes `isinstance(x, torch.Tensor)` (so that user code and
torch's Python treat it as a tensor), and so does C++'s THPVariable_Check:
a pybind-bound function would read the LazyTensor's memory as a tensor it
is not, and the process dies (SIGSEGV).  The bindings below are those that
torch's Python API hands user tensors to; each is replaced where that API
looks it up, and with a LazyTensor argument it runs on the values:

- non-reentrant activation checkpointing (`torch.utils.checkpoint`,
  HuggingFace's gradient_checkpointing_enable()) saves the inputs with
  `_make_saved_tensor`: the value is saved.  The checkpointed forward is
  recorded lazily and runs when its graph does, outside the checkpoint's
  saved-tensor hooks: gradients are eager's, and the activations are kept
  rather than recomputed;
- `torch.utils.dlpack.to_dlpack` exports the value's memory;
- `torch.vmap` (and functorch's transforms built on `_add_batch_dim`)
  batches the value: the function runs eagerly, as do its results;
- `torch.jit.trace` traces on the values of its example inputs;
- `torch.Tensor._make_subclass` (tensor subclasses' constructors) makes the
  subclass instance around the value;
- a TorchScript function (`torch.jit.script(fn)`, `torch.jit.trace(fn)`)
  runs on the values, and its tensor results come back as LazyTensors, as
  an op run eagerly does (it hands its arguments to its graph without
  asking `__torch_function__`, and read a LazyTensor as an empty tensor).
"""
from __future__ import annotations

import functools
import importlib

import torch

from fastlazy import fallback

# (module, attribute) where torch's Python finds each binding
_BINDINGS = (
    ("torch.utils.checkpoint", "_make_saved_tensor"),
    ("torch.utils.dlpack", "to_dlpack"),
    ("torch", "to_dlpack"),
    ("torch._functorch.vmap", "_add_batch_dim"),
    ("torch._functorch.eager_transforms", "_wrap_for_grad"),
    ("torch.jit", "trace"),
    ("torch.jit._trace", "trace"),
)


def _on_values(function):
    @functools.wraps(function)
    def call(*args, **kwargs):
        if not (fallback.has_lazy(args) or fallback.has_lazy(kwargs.values())):
            return function(*args, **kwargs)
        return function(*fallback.materialize(args), **fallback.materialize(kwargs))
    return call


def _script_function_call(call):
    @functools.wraps(call)
    def __call__(self, *args, **kwargs):
        if not (fallback.has_lazy(args) or fallback.has_lazy(kwargs.values())):
            return call(self, *args, **kwargs)
        fallback.count("ScriptFunction", "a TorchScript function runs on the values")
        return fallback.run(functools.partial(call, self), args, kwargs)
    return __call__


def python_patches():
    """(owner, attr, replacement) for each binding this torch has."""
    patches = [(torch._C.ScriptFunction, "__call__",
                _script_function_call(torch._C.ScriptFunction.__call__)),
               (torch.Tensor, "_make_subclass",
                staticmethod(_on_values(torch.Tensor._make_subclass)))]
    for module_name, attr in _BINDINGS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        function = getattr(module, attr, None)
        if function is not None:
            patches.append((module, attr, _on_values(function)))
    return patches
