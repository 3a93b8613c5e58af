"""Autograd calls that take LazyTensors.

- A custom torch.autograd.Function: Function.apply hands its arguments to
  C++ (functorch's unwrap_dead_wrappers, then the autograd node), which
  would read a LazyTensor as a tensor it is not (a crash) and, without the
  C++ node, the result loses requires_grad and the gradient.  Where the
  call records autograd history (grad mode on, an input requiring grad),
  apply runs eagerly on the values -- which carry the autograd history of
  the lazy computation -- and its results become LazyTensors again.  Where
  it records none (inference: no_grad, or no input requiring grad), apply
  is its forward and nothing more: the forward is called on the
  LazyTensors, with a context that keeps what it is given, and its ops are
  recorded like any others (a custom activation in a model's inference no
  longer splits the graph).
- The C++ autograd functions Python constructs and calls on tensors
  (gradcheck's UndefinedGrad, DelayedError) read their argument as a
  tensor: their call runs on the value.
- Gradient hooks (Tensor.register_hook, nn.Module's backward hooks): a
  hook's results are read, for autograd checks them as tensors.
- torch.autograd.backward: its LazyTensor arguments (an eager output's
  lazy gradient) are read first.  A backward of LazyTensors takes its
  large CPU buffers from fastlazy.cpu_pool, as torch.autograd.grad's does.
- torch.autograd.grad: a gradient is lazy where its input is, and a plain
  tensor for an eager input, as eager returns (code that checks
  `type(g) is torch.Tensor`, gradcheck, must see eager's types).
"""
from __future__ import annotations

import inspect
import types

import torch

from fastlazy import _core, cpu_pool, fallback
from fastlazy._core import LazyTensor, lazy_or_eager


def python_patches():
    """(owner, attr, replacement) for Function.apply."""
    function = torch.autograd.function.Function
    # (a classmethod written in Python, or in C from torch 2.14: bound to
    # the class the call names either way)
    original = vars(function)["apply"]

    def apply(cls, *args, **kwargs):
        return original.__get__(None, cls)(*args, **kwargs)

    def lazy_aware_apply(cls, *args, **kwargs):
        if not (fallback.has_lazy(args) or fallback.has_lazy(kwargs.values())):
            return apply(cls, *args, **kwargs)
        if not _makes_history(args, kwargs) and not torch._C._are_functorch_transforms_active():
            return _forward(cls, args, kwargs)
        fallback.count(f"{cls.__name__}.apply", "a custom autograd.Function runs eagerly")
        out = apply(cls, *fallback.materialize(args), **fallback.materialize(kwargs))
        return fallback.wrap_result(out)

    lazy_aware_apply.__doc__ = original.__doc__
    lazy_aware_apply.__wrapped__ = apply
    # eager code's calls go to torch's own from C (a Python frame here cost
    # 900 ns of a custom Function's 5.5 us call): apply called with the
    # class first is the Python classmethod's function, or the C one itself
    if isinstance(original, classmethod) and inspect.isfunction(original.__func__):
        lazy_aware_apply = _core.lazy_arguments_first(original.__func__, lazy_aware_apply)
    elif isinstance(original, types.ClassMethodDescriptorType):
        lazy_aware_apply = _core.lazy_arguments_first(original, lazy_aware_apply)
    patches = [(function, "apply", classmethod(lazy_aware_apply)),
               (torch.autograd, "backward", _backward_on_values(torch.autograd.backward))]
    for name in ("UndefinedGrad", "DelayedError"):
        patches.append((torch._C._functions, name, _on_values(getattr(torch._C._functions, name))))
    patches.append((torch.Tensor, "register_hook", registering_on_values(torch.Tensor.register_hook)))
    for name in ("register_full_backward_hook", "register_full_backward_pre_hook",
                 "register_backward_hook"):
        patches.append((torch.nn.Module, name,
                        registering_on_values(getattr(torch.nn.Module, name))))
    return patches


def registering_on_values(register):
    """register(self, hook, ...) of a gradient hook, the hook's results
    read: autograd checks a hook's result as a tensor, which a LazyTensor
    it computed (`g * mask` with a lazy mask) is not."""
    def register_on_values(self, hook, *args, **kwargs):
        return register(self, _results_read(hook), *args, **kwargs)

    register_on_values.__doc__ = register.__doc__
    register_on_values.__wrapped__ = register
    register_on_values.__name__ = register_on_values.__qualname__ = register.__name__
    return register_on_values


def _results_read(hook):
    def hook_on_values(*args, **kwargs):
        return fallback.materialize(hook(*args, **kwargs))

    hook_on_values.__wrapped__ = hook
    return hook_on_values


def _backward_on_values(original):
    """torch.autograd.backward (which Tensor.backward calls), its LazyTensor
    arguments read first: an eager output's backward given a lazy gradient
    (`y.backward(lazy_g)`) hands the engine a tensor, as eager's does.
    (The check is C: every eager `loss.backward()` makes it.)"""
    def on_values(*args, **kwargs):
        _note_pending(args[_BACKWARD_INPUTS_AT] if len(args) > _BACKWARD_INPUTS_AT
                      else kwargs.get("inputs"))
        args, kwargs = fallback.materialize(args), fallback.materialize(kwargs)
        with cpu_pool.scope():
            return original(*args, **kwargs)

    return _core.lazy_arguments_first(original, on_values)


def _makes_history(args, kwargs) -> bool:
    """Would Function.apply record an autograd node for these arguments?"""
    if not torch.is_grad_enabled():
        return False
    stack = [*args, *kwargs.values()]
    while stack:
        v = stack.pop()
        if type(v) in (list, tuple):
            stack.extend(v)
        elif isinstance(v, (torch.Tensor, LazyTensor)) and v.requires_grad:
            return True
    return False


class _Context:
    """The ctx a forward is given where apply records no autograd node:
    it keeps what forward saves and marks (backward never runs)."""

    def __init__(self, count):
        self.needs_input_grad = (False,) * count
        self.saved_tensors = ()
        self.materialize_grads = True
        self.dirty = ()

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors

    def save_for_forward(self, *tensors):
        pass

    def mark_dirty(self, *tensors):
        self.dirty = tensors

    def mark_non_differentiable(self, *tensors):
        pass

    def set_materialize_grads(self, value):
        self.materialize_grads = value


def _forward(cls, args, kwargs):
    """apply without an autograd node: the forward (with setup_context's
    new-style signature, which takes no ctx, where the class defines
    setup_context); a result that is an input forward did not mark dirty
    comes back as a view of it, a new tensor object, as apply returns."""
    ctx = _Context(len(args))
    if torch.autograd.function._is_setup_context_defined(cls.setup_context):
        out = cls.forward(*args, **kwargs)
    else:
        out = cls.forward(ctx, *args, **kwargs)
    inputs = [*args, *kwargs.values()]

    def fresh(v):
        if any(v is i for i in inputs) and not any(v is d for d in ctx.dirty):
            return v.view_as(v)
        return v
    if isinstance(out, tuple):
        return tuple(fresh(v) for v in out)
    return fresh(out)


def _on_values(cpp_function):
    """A C++ autograd function class whose instances, called on
    LazyTensors, run on their values."""
    class OnValues:
        def __init__(self, *args, **kwargs):
            self._function = cpp_function(*args, **kwargs)

        def __call__(self, *args):
            if not fallback.has_lazy(args):
                return self._function(*args)
            return fallback.wrap_result(self._function(*fallback.materialize(args)))

    OnValues.__name__ = OnValues.__qualname__ = cpp_function.__name__
    OnValues.__doc__ = cpp_function.__doc__
    return OnValues


# Called (no arguments) when a gradient autograd may differentiate again is
# asked for (create_graph=True): compiled training programs cannot be
# differentiated twice (set by fastlazy.boot: tiering keeps training graphs
# on the fast tier from then on).
on_create_graph = None
# called before a grad with respect to a pending result (tiering)
on_intermediate_inputs = None
_CREATE_GRAPH_AT = 4          # torch.autograd.grad's create_graph, by position
_BACKWARD_INPUTS_AT = 5       # torch.autograd.backward's inputs, by position


def grad(func, args, kwargs):
    """torch.autograd.grad with LazyTensor arguments, run eagerly: each
    gradient lazy if its input is."""
    create_graph = (args[_CREATE_GRAPH_AT] if len(args) > _CREATE_GRAPH_AT
                    else kwargs.get("create_graph"))
    if create_graph and on_create_graph is not None:
        on_create_graph()
    inputs = args[1] if len(args) > 1 else kwargs.get("inputs")
    _note_pending(inputs)
    args, kwargs = fallback.materialize(args), fallback.materialize(kwargs)
    with cpu_pool.scope():
        out = func(*args, **kwargs)
    if isinstance(out, dict):
        return {k: _like(inputs[k], g) for k, g in out.items()}
    if type(inputs) is LazyTensor or isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    return tuple(_like(i, g) for i, g in zip(inputs, out, strict=True))


def _note_pending(inputs):
    """Tell tiering (on_intermediate_inputs) where gradients are asked with
    respect to a pending result: it is computed in one graph with the
    outputs differentiated."""
    if on_intermediate_inputs is not None and any(
            type(t) is LazyTensor and not t.is_materialized and t.requires_grad
            for t in ((inputs,) if type(inputs) is LazyTensor else
                      inputs if isinstance(inputs, (tuple, list)) else ())):
        on_intermediate_inputs()


def _like(inp, g):
    if type(inp) is LazyTensor and isinstance(g, torch.Tensor):
        return lazy_or_eager(g)
    return g
