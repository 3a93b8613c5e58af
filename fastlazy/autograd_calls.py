"""Autograd calls that take LazyTensors but cannot be recorded.

- A custom torch.autograd.Function: Function.apply hands its arguments to
  C++ (functorch's unwrap_dead_wrappers, then the autograd node), which
  would read a LazyTensor as a tensor it is not (a crash) and, without the
  C++ node, the result loses requires_grad and the gradient.  So apply runs
  eagerly on the values -- which carry the autograd history of the lazy
  computation -- and its results become LazyTensors again.
- The C++ autograd functions Python constructs and calls on tensors
  (gradcheck's UndefinedGrad, DelayedError) read their argument as a
  tensor: their call runs on the value.
- torch.autograd.grad: a gradient is lazy where its input is, and a plain
  tensor for an eager input, as eager returns (code that checks
  `type(g) is torch.Tensor`, gradcheck, must see eager's types).
"""
from __future__ import annotations

import torch

from fastlazy import fallback
from fastlazy._core import LazyTensor, lazy_or_eager


def _has_lazy(values):
    for v in values:
        if type(v) is LazyTensor:
            return True
        if type(v) in (list, tuple) and _has_lazy(v):
            return True
    return False


def python_patches():
    """(owner, attr, replacement) for Function.apply."""
    function = torch.autograd.function.Function
    apply = vars(function)["apply"].__func__

    def lazy_aware_apply(cls, *args, **kwargs):
        if not (_has_lazy(args) or _has_lazy(kwargs.values())):
            return apply(cls, *args, **kwargs)
        fallback.count(f"{cls.__name__}.apply", "a custom autograd.Function runs eagerly")
        out = apply(cls, *fallback.materialize(args), **fallback.materialize(kwargs))
        return fallback.wrap_result(out)

    lazy_aware_apply.__doc__ = apply.__doc__
    lazy_aware_apply.__wrapped__ = apply
    patches = [(function, "apply", classmethod(lazy_aware_apply))]
    for name in ("UndefinedGrad", "DelayedError"):
        patches.append((torch._C._functions, name, _on_values(getattr(torch._C._functions, name))))
    return patches


def _on_values(cpp_function):
    """A C++ autograd function class whose instances, called on
    LazyTensors, run on their values."""
    class OnValues:
        def __init__(self, *args, **kwargs):
            self._function = cpp_function(*args, **kwargs)

        def __call__(self, *args):
            if not _has_lazy(args):
                return self._function(*args)
            return fallback.wrap_result(self._function(*fallback.materialize(args)))

    OnValues.__name__ = OnValues.__qualname__ = cpp_function.__name__
    OnValues.__doc__ = cpp_function.__doc__
    return OnValues


def grad(func, args, kwargs):
    """torch.autograd.grad with LazyTensor arguments, run eagerly: each
    gradient lazy if its input is."""
    inputs = args[1] if len(args) > 1 else kwargs.get("inputs")
    out = func(*fallback.materialize(args), **fallback.materialize(kwargs))
    if isinstance(out, dict):
        return {k: _like(inputs[k], g) for k, g in out.items()}
    if type(inputs) is LazyTensor or isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    return tuple(_like(i, g) for i, g in zip(inputs, out, strict=True))


def _like(inp, g):
    if type(inp) is LazyTensor and isinstance(g, torch.Tensor):
        return lazy_or_eager(g)
    return g
