"""torch's constructors and conversions given a LazyTensor, under enable().

A LazyTensor answers isinstance(x, torch.Tensor) (its __class__), so torch's
C constructors that take "a tensor or data" (torch.tensor, torch.as_tensor,
torch.asarray, the legacy torch.Tensor(...)) would unpack it as a C tensor it is not: a crash.  They, and
the Python constructors that cannot hold a LazyTensor (nn.Parameter,
nn.Buffer: a module's state is eager), get a wrapper that gives them the
value instead.  nn.Module.to("lazy") leaves the module as it is: modules
stay eager, their parameters join graphs as inputs, so code written for a
lazy device (torch._lazy, torch_xla) runs unchanged.

Each wrapper passes a call without a LazyTensor straight to the original:
the constructors and factories eager code calls all the time from C (a
guard, csrc/guards.h), the others one Python frame later.
patching.enable() installs them (wrappers()), and disable() puts the
originals back.
"""
from __future__ import annotations

import warnings

import torch

from fastlazy import _core
from fastlazy._core import LazyTensor
from fastlazy.fallback import materialize


# A LazyTensor at the top of data, among its top-level items, or along its
# first elements (torch.tensor([[x0, x1]])); not every element: torch.tensor
# of a million floats must stay as cheap.  (The guards' own look, in C.)
_holds_lazy = _core.data_holds_lazy


def _to(x, dtype, device):
    """x converted as torch.as_tensor converts a tensor: itself when nothing
    changes, else recorded (a dtype cast) or moved as LazyTensor.to does."""
    kwargs = {k: v for k, v in (("dtype", dtype), ("device", device)) if v is not None}
    return x.to(**kwargs) if kwargs else x


def _tensor(original):
    def tensor(data, *args, **kwargs):
        """torch.tensor: a LazyTensor (or a list of them) is copied from its
        value, with eager's copy-construct warning, at the caller's line."""
        if not _holds_lazy(data):
            return original(data, *args, **kwargs)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = original(materialize(data), *args, **kwargs)
        for w in caught:
            warnings.warn(w.message, w.category, stacklevel=2)
        return out
    return _core.data_lazy_first(original, tensor)


def _as_tensor(original):
    def as_tensor(data, dtype=None, device=None):
        """torch.as_tensor: a LazyTensor is returned as itself (eager returns
        the tensor itself), cast or moved if dtype or device asks."""
        if type(data) is LazyTensor:
            return _to(data, dtype, device)
        if _holds_lazy(data):
            data = materialize(data)
        return original(data, dtype=dtype, device=device)
    return _core.data_lazy_first(original, as_tensor)


def _asarray(original):
    def asarray(obj, *args, **kwargs):
        """torch.asarray: as as_tensor for a LazyTensor with at most dtype and
        device; from its value for anything else (copy=, requires_grad=)."""
        if type(obj) is LazyTensor and not args and set(kwargs) <= {"dtype", "device"}:
            return _to(obj, kwargs.get("dtype"), kwargs.get("device"))
        if _holds_lazy(obj):
            obj = materialize(obj)
        return original(obj, *args, **kwargs)
    return _core.data_lazy_first(original, asarray)


def _eager_data(original):
    def __new__(cls, data=None, *args, **kwargs):
        """nn.Parameter / nn.Buffer of a LazyTensor: of its value (an
        optimizer updates a parameter in place; a module's state is eager)."""
        if type(data) is LazyTensor:
            data = data.to_eager()
        return original(cls, data, *args, **kwargs)
    return staticmethod(__new__)


def _tensor_new(original):
    def __new__(cls, *args, **kwargs):
        """torch.Tensor(...), the legacy constructor, given a LazyTensor:
        torch.Tensor(x) is an alias of x in eager (whatever x's dtype), so
        a lazy view of x; a LazyTensor inside data is read, as eager copies
        data."""
        if len(args) == 1 and not kwargs and type(args[0]) is LazyTensor and cls is torch.Tensor:
            return args[0].view_as(args[0])
        if any(_holds_lazy(a) for a in args) or any(_holds_lazy(v) for v in kwargs.values()):
            args, kwargs = materialize(args), materialize(kwargs)
        return original(cls, *args, **kwargs)
    return staticmethod(__new__)


_is_lazy = _core.is_lazy_device


def _module_to(original):
    def to(self, *args, **kwargs):
        """nn.Module.to: "lazy" moves nothing (modules stay eager; their
        parameters join graphs as inputs); a dtype given with it still
        applies."""
        if any(_is_lazy(a) for a in args) or _is_lazy(kwargs.get("device")):
            args = tuple(a for a in args if not _is_lazy(a))
            kwargs = {k: v for k, v in kwargs.items() if not (k == "device" and _is_lazy(v))}
            if not args and not kwargs:
                return self
        return original(self, *args, **kwargs)
    return to


def _lazy_number(x):
    return type(x) is LazyTensor and x.dim() == 0


def _numbers_read(original):
    def read(*args, **kwargs):
        """A torch factory whose numbers eager also takes as 0-dim tensors
        (torch.arange(mask.sum()), a fill value, a size), reading their
        values: a LazyTensor there is read too (torch's parser cannot hand
        it to __torch_function__; it raised a TypeError)."""
        for a in args:
            kind = type(a)
            if kind is LazyTensor or ((kind is tuple or kind is list)
                                      and LazyTensor in map(type, a)):
                return _read_numbers(original, args, kwargs)
        if kwargs and LazyTensor in map(type, kwargs.values()):
            return _read_numbers(original, args, kwargs)
        return original(*args, **kwargs)
    return _core.data_lazy_first(original, read)


def _read_numbers(original, args, kwargs):
    return original(*[_read(a) for a in args], **{k: _read(v) for k, v in kwargs.items()})


def _read(x):
    if _lazy_number(x):
        return x.item()
    if type(x) in (tuple, list):
        return type(x)(_read(v) for v in x)
    return x


# torch's factories whose number arguments (ends, steps, fill values, sizes)
# eager reads from 0-dim tensors
NUMBER_FACTORIES = ("arange", "range", "linspace", "logspace", "full", "zeros", "ones",
                    "empty", "rand", "randn", "randint", "randperm", "eye",
                    "tril_indices", "triu_indices")


# functions that take tensors and numbers, whose numbers eager also takes as
# 0-dim tensors (reading their values): name -> the positions and keywords
# of those numbers.  torch's parser refuses a LazyTensor there before
# __torch_function__ could see it ("must be Number, not LazyTensor").
NUMBER_ARGUMENTS = {
    (torch, "histc"): ((1, 2, 3), ("bins", "min", "max")),
    (torch, "full_like"): ((1,), ("fill_value",)),
    (torch, "nan_to_num"): ((1, 2, 3), ("nan", "posinf", "neginf")),
    (torch, "diag"): ((1,), ("diagonal",)),
    (torch, "round"): ((), ("decimals",)),
    (torch, "logit"): ((1,), ("eps",)),
    (torch, "combinations"): ((1,), ("r",)),
    (torch, "mvlgamma"): ((1,), ("p",)),
    (torch, "polygamma"): ((0,), ("n",)),
    (torch, "dist"): ((2,), ("p",)),
    (torch, "threshold"): ((1, 2), ("threshold", "value")),
    (torch.nn.functional, "one_hot"): ((1,), ("num_classes",)),
    (torch.nn.functional, "threshold"): ((1, 2), ("threshold", "value")),
    (torch.nn.functional, "celu"): ((1,), ("alpha",)),
    (torch.nn.functional, "pdist"): ((1,), ("p",)),
    (torch.nn.functional, "huber_loss"): ((3,), ("delta",)),
    (torch.nn.functional, "smooth_l1_loss"): ((5,), ("beta",)),
    (torch.nn.functional, "margin_ranking_loss"): ((3,), ("margin",)),
    (torch.nn.functional, "triplet_margin_loss"): ((3, 4, 5), ("margin", "p", "eps")),
}


def _number_arguments_read(positions, keywords):
    def make(original):
        def read(*args, **kwargs):
            """A function whose number arguments eager also takes as 0-dim
            tensors (torch.histc(x, min=x.min()), F.one_hot(y, y.max() + 1)),
            reading them: a 0-dim LazyTensor there is read too, a graph
            computed as eager reads the value on the host.  Its tensor
            arguments stay as they are."""
            if any(p < len(args) and _lazy_number(args[p]) for p in positions) \
                    or any(_lazy_number(kwargs.get(k)) for k in keywords):
                args = tuple(_read(a) if p in positions else a for p, a in enumerate(args))
                kwargs = {k: _read(v) if k in keywords else v for k, v in kwargs.items()}
            return original(*args, **kwargs)
        return _core.lazy_arguments_first(original, read)
    return make


def wrappers():
    """(owner, attribute, make_wrapper) for every wrapper enable() installs;
    make_wrapper takes the attribute's current value."""
    yield torch, "tensor", _tensor
    yield torch, "as_tensor", _as_tensor
    yield torch, "asarray", _asarray
    yield torch.Tensor, "__new__", _tensor_new
    yield torch.nn.Parameter, "__new__", _eager_data
    if hasattr(torch.nn, "Buffer"):
        yield torch.nn.Buffer, "__new__", _eager_data
    yield torch.nn.Module, "to", _module_to
    for name in NUMBER_FACTORIES:
        yield torch, name, _numbers_read
    for (owner, name), (positions, keywords) in NUMBER_ARGUMENTS.items():
        yield owner, name, _number_arguments_read(positions, keywords)
