"""LazyTensor's own methods, operators and attributes.

LazyTensor is not a torch.Tensor subclass, so every Tensor method it answers
is installed on it here (by fastlazy's boot): the op table's entry points,
an always-eager entry for every other public method, a property for every
attribute (a view such as .T recorded, anything else read from the value),
and .to (the core's tensor_to hook).  They work whether or not enable() has
patched torch; patching.py only patches torch itself.
"""
from __future__ import annotations

import inspect

import torch

from fastlazy import _core, autograd_calls, fallback, layouts, leaves, route, views
from fastlazy._core import LazyTensor
from fastlazy.patching import FORM_CALL, FORM_INPLACE, entry_points, qualname

# Tensor properties that are views: recorded by the generic path.
VIEW_ATTRIBUTES = frozenset({"T", "mT", "H", "mH", "real", "imag"})


def attribute(name):
    """A property of LazyTensor reading Tensor attribute `name`: a view
    (Tensor.T) is recorded; anything else (.grad, .data, .layout...) reads
    the materialized value."""
    if name in VIEW_ATTRIBUTES:
        getter = getattr(torch.Tensor, name).__get__

        def get(self):
            return route.call(getter, f"Tensor.{name}", (self,), {}, False)
    elif name == "data":
        # an alias of the same memory: a detached view, so that writes
        # through it (x.data.add_(1), x.data[0] = v) show in x, as in eager
        def get(self):
            return route.call(torch.Tensor.detach, "Tensor.data", (self,), {}, False)
        get.__name__ = name
        return property(get, _set_data, doc="Tensor.data.")
    elif name == "grad":
        # the gradient autograd accumulated into the value: the tensor
        # itself, so that x.grad.zero_() and x.grad[0] = v write it (and
        # `x.grad = None` sets it), as in eager.  A leaf's pending update
        # (an optimizer's step) has its leaf's, which its value takes when
        # it runs: reading or clearing it (zero_grad) computes nothing.
        def get(self):
            return _grad_holder(self).grad

        def set_grad(self, value):
            _grad_holder(self).grad = fallback.materialize(value)

        get.__name__ = name
        return property(get, set_grad, doc="Tensor.grad.")
    else:
        def get(self):
            return fallback.wrap_result(getattr(self.to_eager(), name))
    get.__name__ = name
    return property(get, doc=f"Tensor.{name}.")


def _grad_holder(t):
    """The eager tensor whose .grad is t's: its value, or the leaf whose
    pending update t holds."""
    leaf = _core.leaf_of(t)
    return t.to_eager() if leaf is None else leaf


def _set_data(self, value):
    """x.data = t: x holds t's memory from now on, its autograd identity
    kept (a leaf that requires grad stays one, with its gradient), as in
    eager.  Refused where eager's result would be shared memory fastlazy
    does not follow: x a view or the base of live views, or x carrying
    autograd history."""
    if self.family is not None and (type(self.family) is not views.Family
                                    or len(self.family.members)):
        raise RuntimeError("fastlazy: `x.data = t` on a LazyTensor that is a view or has live "
                           "views is not supported; assign it before taking views")
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"data must be a Tensor, not {type(value).__name__}")
    old = self.to_eager()
    if old.requires_grad and not old.is_leaf:
        raise RuntimeError("fastlazy: `x.data = t` on a LazyTensor with autograd history is "
                           "not supported; use x.detach() or assign it on the leaf")
    new = fallback.materialize(value).detach()
    if old.requires_grad:
        leaves.succeed(new, old)
    _core.rebind_value(self, new)


_TO = torch._C.TensorBase.to


def lazy_to(self, args, kwargs):
    """LazyTensor.to: "lazy" is itself; a move to another device gives an
    eager tensor there (as torch._lazy's .to("cpu") does); anything else --
    a dtype cast, `.to(other)` or `.to(device=...)` naming the device the
    value lives on (HF's attention masks) -- is recorded like any pure call."""
    if len(args) == 1 and _is_lazy_device(args[0]) and not kwargs:
        return self
    if _is_lazy_device(kwargs.get("device")):
        kwargs = {k: v for k, v in kwargs.items() if k != "device"}
        if not args and not kwargs:
            return self
    target = _target_device(args, kwargs)
    if target is None or _same_device(target, self.device):
        prepared = None
        if kwargs and not args and kwargs.keys() <= _TO_KEYWORDS:
            # (HF's `.to(dtype=..., device=..., copy=True)`: the same call
            # positionally, which the core's signature cache takes, 0.8 us
            # against 3-4 us through route.call)
            args = (kwargs.get("dtype", self.dtype), kwargs.get("non_blocking", False),
                    kwargs.get("copy", False))
            kwargs = {}
        if not kwargs and _core.eager_only_reason() is None:
            # (a cast or a move to where the value lives, per call in model
            # code: a signature seen before is recorded by the core alone)
            hit, prepared = _core.signature_hit(_TO, (self,) + args)
            if hit:
                return prepared
        return route.call(_TO, "Tensor.to", (self,) + args, kwargs, False, prepared=prepared)
    fallback.count("to", "device move (gives an eager tensor)")
    return self.to_eager().to(*args, **kwargs)


# the keywords of Tensor.to(dtype, non_blocking, copy) (a device among them
# is the value's own here)
_TO_KEYWORDS = frozenset({"dtype", "device", "non_blocking", "copy"})

# (a tensor argument is never taken for one: == would be an op of its own)
_is_lazy_device = _core.is_lazy_device


def _target_device(args, kwargs):
    """The device a .to() call names, or None where it names none (a dtype
    cast).  Anything torch would reject is returned as is, for eager to judge."""
    if "device" in kwargs:
        return kwargs["device"]
    if "tensor" in kwargs:
        return getattr(kwargs["tensor"], "device", kwargs["tensor"])
    if args:
        first = args[0]
        if isinstance(first, torch.Tensor):          # LazyTensors too
            return first.device
        if isinstance(first, (str, torch.device)) or type(first) is int:
            return first
    return None


def _same_device(target, device):
    key = (target, device)
    try:
        return _same_devices[key]
    except (KeyError, TypeError):      # (TypeError: an unhashable argument)
        pass
    try:
        target = torch.device(target)
    except (TypeError, RuntimeError, ValueError):
        return False                                 # eager raises its own error
    if target.type != device.type:
        same = False
    elif target.index is None:
        # "cuda" means the current device, which may change: not kept
        if device.type != "cpu":
            return device.index == torch.cuda.current_device()
        same = True                                  # ("cpu" has one)
    else:
        same = target.index == (device.index or 0)
    if len(_same_devices) < 64:
        _same_devices[key] = same
    return same


# (target named in .to(), a LazyTensor's device) -> same device?  Model code
# moves its masks to their own device at every call (HuggingFace's
# `mask.to(x.device)`), and torch.device() of a string costs a microsecond.
_same_devices: dict = {}


def install_lazy_tensor_methods():
    """LazyTensor's methods, operators and attributes, from the op table and
    torch.Tensor.  Called once, by fastlazy's boot."""
    _install_table_methods()
    _install_other_methods()
    _install_numpy_protocol()
    # eager's conjugate and negative bits, which a LazyTensor keeps on its
    # view (views.py: VIEW_CONJ), answered without computing the value
    _core.set_method("is_conj", _is_conj)
    _core.set_method("is_neg", _is_neg)
    _core.set_method("retain_grad", _core.retain_grad)
    register_hook = torch.Tensor.register_hook
    _core.set_method("register_hook", autograd_calls.registering_on_values(
        lambda self, hook: register_hook(self.to_eager(), hook)))
    for query in ("is_complex", "is_floating_point", "numel"):
        _core.set_metadata_query(getattr(torch, query), getattr(LazyTensor, query))
    # layout queries libraries ask on every call (`if not x.is_contiguous():
    # x = x.contiguous()`; Longformer's chunking reads x.stride()), answered
    # from what is known where that is eager's answer
    for name in ("stride", "is_contiguous"):
        _core.set_method(name, _layout_query(name))
    _core.set_method("storage_offset", _storage_offset_query())


def _layout_query(name):
    """Tensor.stride / Tensor.is_contiguous of a LazyTensor: answered on a
    meta tensor of its eager strides where those are known without
    computing it (eager_strides), else by the value, as any other method."""
    on_value = _core.make_entry(getattr(torch.Tensor, name), f"Tensor.{name}", -1, FORM_CALL)
    on_meta = getattr(torch.Tensor, name)
    stride = name == "stride"

    def query(self, *args, **kwargs):
        strides = eager_strides(self)
        if strides is None:
            return on_value(self, *args, **kwargs)
        if not args and not kwargs:
            # the common questions, answered without a meta tensor
            # (HuggingFace's chunking asks x.stride() at every call)
            return tuple(strides) if stride else views.contiguous(tuple(self.shape), strides)
        # (the meta tensor answers with eager's own checks and errors:
        # a dim out of range, a memory format)
        return on_meta(torch.empty_strided(tuple(self.shape), strides, dtype=self.dtype,
                                           device="meta"), *args, **kwargs)
    query.__name__ = name
    query.__doc__ = getattr(torch.Tensor, name).__doc__
    return query


def eager_strides(x):
    """The strides eager's value of LazyTensor x has, or None where they
    are not known without computing it: a view's place in its root, where
    the root is laid out contiguously in eager (a view's computed value is
    a tensor of its own once a write has moved it off the root's value,
    laid out contiguously); a value's own; a pending result's (a base of
    views too) as its recorded producers lay it out (fastlazy.layouts)."""
    where = views.geometry(x)
    if where is not None:
        return tuple(where[1]) if _root_laid_out(x.family.root) else None
    if x.is_materialized:
        return x.to_eager().stride()
    return layouts.pending_strides(x)   # (a base with live views too: they keep its layout)


def _root_laid_out(root) -> bool:
    """Is a view's root laid out contiguously in eager (so that the view's
    place, counted in the root's contiguous layout, is its eager layout)?"""
    if root.is_materialized:
        return root.to_eager().is_contiguous()
    strides = layouts.pending_strides(root)
    return strides is not None and views.contiguous(tuple(root.shape), strides)


def _storage_offset_query():
    """Tensor.storage_offset() of a LazyTensor: a view's place in its root
    (and the root's own offset in its storage, where its value is a slice
    of another tensor), counted in its own elements; else the value's."""
    on_value = _core.make_entry(torch.Tensor.storage_offset, "Tensor.storage_offset", -1,
                                FORM_CALL)

    def storage_offset(self):
        if self.family is None and not self.is_materialized:
            return 0            # a pending result: eager's is a new tensor
        where = views.geometry(self)
        if where is not None and _root_laid_out(self.family.root):
            root = self.family.root
            start = (root.to_eager().storage_offset() * root.dtype.itemsize // self.dtype.itemsize
                     if root.is_materialized else 0)
            return where[2] + start
        return on_value(self)
    storage_offset.__doc__ = torch.Tensor.storage_offset.__doc__
    return storage_offset


def _is_conj(self):
    """Tensor.is_conj(): a conj() view of a complex tensor."""
    where = self.family
    return type(where) is views.Member and where.conj and self.dtype.is_complex


def _is_neg(self):
    """Tensor.is_neg(): the imaginary parts of a conj() view (x.conj().imag)."""
    where = self.family
    return (type(where) is views.Member and where.conj and not self.dtype.is_complex
            and views.imaginary(where.offset))


def _install_numpy_protocol():
    """numpy meets a LazyTensor as it meets a tensor: torch.Tensor's
    __array_priority__ makes numpy scalars and arrays defer to the tensor's
    operators (np.float64(2) * x is x.__rmul__), and the result of a ufunc
    numpy computes on its value (x + ndarray, where eager's operator also
    declines the array) comes back as a tensor, not an ndarray."""
    _core.set_method("__array_priority__", torch.Tensor.__array_priority__)
    _core.set_method("__array_wrap__", _array_wrap)


def _array_wrap(self, array, context=None, return_scalar=False):
    # torch.Tensor.__array_wrap__'s answer (bool arrays as uint8, as eager),
    # as a LazyTensor: results of ops on a LazyTensor stay lazy
    return fallback.wrap_result(torch.Tensor.__array_wrap__(torch.empty(0), array))


def _install_table_methods():
    """The op table's entry points as LazyTensor's methods and operators, and
    as the answers of its __torch_function__."""
    for owner, attr, opcode, form in entry_points():
        original = getattr(owner, attr)
        entry = _core.make_entry(original, qualname(owner, attr), opcode, form)
        _core.set_torch_function(original, entry)
        if owner is torch.Tensor:
            if attr in _core.DUNDER_NAMES:
                _core.set_dunder(attr, entry)
            else:
                _core.set_method(attr, entry)


def _install_other_methods():
    """Every other public Tensor method and attribute, on LazyTensor too:
    methods run eagerly through an always-eager entry (one C check, no
    __getattr__ on the hot path), attributes read the materialized value."""
    for name in dir(torch.Tensor):
        if name.startswith("_") or name in vars(LazyTensor):
            continue
        attr = inspect.getattr_static(torch.Tensor, name)
        if isinstance(attr, (staticmethod, classmethod)):
            continue
        if callable(attr):
            form = FORM_INPLACE if name.endswith("_") else FORM_CALL
            _core.set_method(name, _core.make_entry(getattr(torch.Tensor, name),
                                                    f"Tensor.{name}", -1, form))
        else:
            _core.set_method(name, attribute(name))
