"""Where a call with LazyTensors and no C rule goes.

The core hands such a call up through two hooks: record_call (no C rule
takes it) and run_eagerly (its row runs it eagerly, or a rule's checks
refused it).  call() tries, in order: LazyTensor's own method for an
unbound torch.Tensor method it implements (size, item...); the random
calls whose draw is made at the call (random_ops.py); batch norm in
training (running_stats.py); then records it -- an in-place call
functionalized (mutation.py), any other through the generic path
(generic.py) -- and runs it eagerly where it is not recordable (Unsafe).
run_eagerly() sends a write (out= naming LazyTensors, or an in-place call)
to mutation.py and anything else to fallback.py, counting every one.
"""
from __future__ import annotations

import inspect
import numbers

import torch

from fastlazy import (_core, autograd_calls, fallback, generic, mutation, random_ops,
                      running_stats, views)
from fastlazy._core import LazyTensor
from fastlazy.capture import Unsafe


def call(func, name, args, kwargs, inplace, ruled=False, prepared=None):
    """An entry point's call (or a __torch_function__ call) with LazyTensor
    arguments and no C rule (`ruled`: its row's C rule does not take these
    arguments): record it if it is pure, else run it eagerly.  `prepared`:
    the generic signature's (key, tensors), when the core built them."""
    if args and type(args[0]) is LazyTensor:
        native = _NATIVE_METHODS.get(name)
        if native is not None:
            # torch.Tensor.size(x) called unbound: LazyTensor's own method
            return native(*args, **kwargs)
    out = _with_python_numbers(name, args, kwargs)
    if out is not _NO_NUMPY:
        return out
    if func in _SIZE_TAKERS:
        sizes = _sizes_read(args, kwargs)
        if sizes is not None:
            # sizes given as 0-dim integer tensors: read, as eager's parser
            # reads them, so that the call is recorded as with ints (a view
            # recorded generically from a tensor size ran eagerly, and lost
            # its place in its base: as_strided on it read other elements)
            method = _SIZE_TAKERS[func]
            sizes, kwargs = sizes
            if method:        # through the entry point, which records ints
                return getattr(sizes[0], func.__name__)(*sizes[1:], **kwargs)
            return getattr(torch, func.__name__)(*sizes, **kwargs)
    reason = _core.eager_only_reason()
    if reason is not None:
        return run_eagerly(func, name, args, kwargs, inplace, reason)
    if _on_meta(kwargs.get("device")):
        # (zeros_like(x, device="meta"), x.new_empty(n, device="meta"): a
        # meta tensor is no value to compute, and a LazyTensor holds none)
        return run_eagerly(func, name, args, kwargs, inplace, "makes a meta tensor")
    if func is torch.autograd.grad:
        fallback.count(name, "gradients are computed eagerly")
        return autograd_calls.grad(func, args, kwargs)
    if inplace and name.startswith("_foreach_"):
        done = _foreach_in_place(name, args, kwargs)
        if done is not _NOT_SPLIT:
            # (torch's function returns the list it wrote, torch.ops' None)
            return None if isinstance(func, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) \
                else args[0]
    if name in _FLAG_SETTERS:
        # (named like an in-place call, but no write: a leaf that requires
        # grad may set it, which the write checks would refuse)
        target = args[0] if args else kwargs.get("self")
        held = type(target) is LazyTensor and target.is_materialized
        if held:
            # the pending ops that read the value were recorded with the
            # flag it has now: as in eager, they build no history from a
            # later requires_grad_() (and keep theirs after requires_grad_(False))
            _core.flush_reading(target.to_eager())
        # (on the value itself, not eager's view of its root's: fallback.as_views)
        out = run_eagerly(func, name, args, kwargs, False, "sets a flag on the value",
                          views_of_roots=False)
        if type(target) is LazyTensor:
            # its metadata follows (ops recorded on it from now on build
            # autograd history: a compiled graph is a training program),
            # a pending one's too, computed by the eager call (x.detach(),
            # a clone, a view: torch.autograd.functional's inputs)
            _core.rebind_value(target, target.to_eager())
        # (x.requires_grad_() returns x itself, as eager's does)
        return target if type(target) is LazyTensor else out
    if kwargs.get("requires_grad") is True and not inplace:
        # a factory asked for a leaf that requires grad (torch.autograd.
        # functional's zeros_like(out, requires_grad=True)): its aten program
        # has no such flag, so the call is recorded without it and the result
        # made that leaf -- never published with the flag, so every such
        # call comes here
        out = call(func, name, args, {k: v for k, v in kwargs.items() if k != "requires_grad"},
                   inplace, ruled)
        if type(out) is LazyTensor:
            out.requires_grad_()
        return out
    out = random_ops.record(func, args, kwargs)
    if out is not random_ops.NOT_HANDLED:
        return out
    # torch.nn.functional's `inplace=True` (hardswish, elu, ...) makes the
    # call the in-place form: functionalized like Tensor.X_
    flag = None if inplace else _inplace_flag(func, args, kwargs)
    inplace = inplace or flag is not None
    try:
        # (batch norm in training on an empty batch: eager's own result)
        out = running_stats.record(func, args, kwargs)
        if out is not running_stats.NOT_HANDLED:
            return out
        if inplace:
            out = mutation.record_inplace(func, args, kwargs, name, ruled=ruled, flag=flag,
                                          prepared=prepared)
        else:
            on_root = views.as_strided_of_root(args, kwargs) if name in views.AS_STRIDED_NAMES \
                else None
            if on_root is not None:
                args, kwargs = on_root
                prepared = None             # (the core's key is the view's call)
            out = generic.record(func, args, kwargs, name, ruled=ruled, prepared=prepared)
    except Unsafe as exc:
        reason = str(exc)
        written = getattr(exc, "written", None)
    else:
        _core.count("generic_calls")
        return out
    if written:
        # (a call that writes some of its LazyTensor arguments, not as its
        # in-place form: F.embedding's max_norm renormalizes the weight)
        mutation.own_values(written)
    # run outside the except block: an exception eager raises (a shape
    # error) is then the user's alone, not chained "during handling of" our
    # internal Unsafe
    return run_eagerly(func, name, args, kwargs, inplace, reason)


def _on_meta(device) -> bool:
    """Does a call's `device=` name the meta device?"""
    if device is None or type(device) is int:
        return False
    if type(device) is torch.device:
        return device.type == "meta"
    return type(device) is str and device.partition(":")[0] == "meta"


def run_eagerly(func, name, args, kwargs, inplace, reason, views_of_roots=True):
    """Run the call eagerly (counted, with `reason`): a write through
    mutation.py, anything else through fallback.py (`views_of_roots`: its
    view arguments as eager's views of their roots' values, fallback.run).
    (A call a C rule refused for a NumPy number in it, an in-place
    method's, is the call again with the Python number instead.)"""
    out = _with_python_numbers(name, args, kwargs)
    if out is not _NO_NUMPY:
        return out
    fallback.count(name, reason)
    out = kwargs.get("out")
    if type(out) is LazyTensor or (type(out) in (tuple, list)
                                   and any(type(o) is LazyTensor for o in out)):
        return mutation.run_out(func, args, kwargs)
    if inplace:
        return mutation.run_inplace(func, name, args, kwargs)
    return fallback.run(func, args, kwargs, views_of_roots)


_FLAG_SETTERS = frozenset({"Tensor.requires_grad_"})

_NOT_SPLIT = object()


def _foreach_in_place(name, args, kwargs):
    """torch._foreach_<op>_(tensors, ...) (an optimizer's foreach step, or
    torch.ops.aten._foreach_<op>_.<overload>) as the in-place call of each
    tensor in turn, its list arguments taken item by item and the others
    whole, so that every write is recorded as a LazyTensor's own (its views
    follow; the tensor it was made from is never written): run eagerly on
    the list, it wrote the values themselves.  <op>_ where Tensor has that
    method, else a copy_ of torch.<op>'s result (maximum; a number taken as
    a 0-dim tensor there).  None where done; _NOT_SPLIT where the lists
    differ in length (run eagerly, the call raises eager's error)."""
    op = name.partition(".")[0][len("_foreach_"):-1]
    method = getattr(torch.Tensor, op + "_", None)
    whole = getattr(torch, op, None)
    if not args or type(args[0]) not in (list, tuple) or (method is None and whole is None):
        return _NOT_SPLIT
    if op in ("addcmul", "addcdiv"):
        # per-item scalars given as one tensor, which eager reads on the
        # host; the scalar is Tensor.addcmul_'s keyword `value`
        args = [a.tolist() if isinstance(a, torch.Tensor) and a.dim() == 1 else a for a in args]
        kwargs = {"value" if k == "scalars" else k:
                  v.tolist() if isinstance(v, torch.Tensor) and v.dim() == 1 else v
                  for k, v in kwargs.items()}
        if len(args) > 3:
            args, kwargs = args[:3], dict(kwargs, value=args[3])
    targets = args[0]
    n = len(targets)
    for a in (*args[1:], *kwargs.values()):
        if type(a) in (list, tuple) and len(a) != n:
            return _NOT_SPLIT           # (eager raises its own error)

    def item(a, i):
        return a[i] if type(a) in (list, tuple) else a
    for i, target in enumerate(targets):
        rest = [item(a, i) for a in args[1:]]
        keywords = {k: item(v, i) for k, v in kwargs.items()}
        if method is not None:
            method(target, *rest, **keywords)
        else:
            rest = [torch.tensor(a) if type(a) in (int, float, bool) else a for a in rest]
            target.copy_(whole(target, *rest, **keywords))
    return None


_NO_NUMPY = object()


def _with_python_numbers(name, args, kwargs):
    """NumPy's scalars as the Python numbers eager's parser reads them as
    (`x / np.sqrt(d)`, a slice `x[:, np.int64(2):]` such as timm's Mixup
    cuts): the call again with those, through its entry point, where a C
    rule takes what it takes (the generic path's signature refuses them:
    the call ran eagerly, a graph split).  _NO_NUMPY where the arguments
    hold no NumPy number (or the entry point is not known)."""
    if not _holds_numpy_number(args, kwargs):
        return _NO_NUMPY
    entry = _entry_point(name, args)
    if entry is None:
        return _NO_NUMPY
    return entry(*_python_numbers(args), **_python_numbers(kwargs))


_OWNERS = {"torch": torch, "Tensor": torch.Tensor, "F": torch.nn.functional, "": torch}


def _entry_point(name, args):
    """What a call reported as `name` (patching.qualname's, or a bare
    operator name: __setitem__) calls: a LazyTensor self's own method,
    else torch's attribute, the entry point while fastlazy is enabled."""
    owner, _, attr = name.rpartition(".")
    if owner in ("Tensor", "") and args and type(args[0]) is LazyTensor:
        method = getattr(LazyTensor, attr, None)
        if method is not None:
            return method
    owner = _OWNERS.get(owner)
    return None if owner is None else getattr(owner, attr, None)


def _numpy_number(x) -> bool:
    """A NumPy integer, or a NumPy float64: eager's parser reads either as
    the Python number of its value wherever it reads an int (a float64 is a
    Python float).  Not a NumPy bool (eager promotes it as no Python bool
    is promoted), nor the other floating types (eager refuses to assign a
    float32 with x[i] = v, where it takes a Python float)."""
    return type(x).__module__ == "numpy" and isinstance(x, (float, numbers.Integral))


# argument types that are never, and hold no, NumPy number (checked first:
# the check runs on every call that comes up to Python)
_PLAIN = frozenset({LazyTensor, torch.Tensor, torch.nn.Parameter, int, float, bool, str,
                    type(None), torch.dtype, torch.device})


def _holds_numpy_number(args, kwargs) -> bool:
    for v in args:
        if type(v) not in _PLAIN and _holds(v):
            return True
    if kwargs:
        for v in kwargs.values():
            if type(v) not in _PLAIN and _holds(v):
                return True
    return False


def _holds(x) -> bool:
    t = type(x)
    if t is tuple or t is list:
        for v in x:
            if type(v) not in _PLAIN and _holds(v):
                return True
        return False
    if t is slice:
        # (x[:, :3, :, 4:] = ...: every write through an index comes here)
        return ((type(x.start) not in _PLAIN and _numpy_number(x.start))
                or (type(x.stop) not in _PLAIN and _numpy_number(x.stop))
                or (type(x.step) not in _PLAIN and _numpy_number(x.step)))
    if t is dict:
        return any(_holds(v) for v in x.values())
    return _numpy_number(x)


def _python_numbers(x):
    """x with every NumPy number in it (in tuples, lists, dicts, slices)
    made the Python number of its value."""
    t = type(x)
    if t is tuple or t is list:
        return t(_python_numbers(v) for v in x)
    if t is dict:
        return {k: _python_numbers(v) for k, v in x.items()}
    if t is slice:
        return slice(*_python_numbers((x.start, x.stop, x.step)))
    return x.item() if _numpy_number(x) else x

# Calls whose int arguments after the tensor are sizes (or a place: narrow's
# start and length, as_strided's offset), which eager's parser also takes as
# 0-dim integer tensors, reading their values (the original -> whether it is
# a Tensor method).
_SIZE_TAKERS = {**{getattr(torch.Tensor, name): True
                   for name in ("view", "reshape", "expand", "repeat", "as_strided",
                                "narrow", "unflatten", "new_zeros", "new_ones", "new_empty")},
                **{getattr(torch, name): False
                   for name in ("reshape", "as_strided", "narrow", "unflatten")}}


def _size_tensor(x):
    return (isinstance(x, torch.Tensor) and x.dim() == 0 and not x.dtype.is_floating_point
            and not x.dtype.is_complex and x.dtype is not torch.bool)


def _sizes_read(args, kwargs):
    """(args, kwargs) with each 0-dim integer tensor after the first
    argument (at the top or in a list of sizes, positional or a keyword:
    `x.as_strided(size=(b, n, w, d), ...)`) read as an int, or None if
    there is none."""
    def holds(a):
        return _size_tensor(a) or (type(a) in (tuple, list) and any(map(_size_tensor, a)))

    def read(a):
        if _size_tensor(a):
            return int(a)
        if type(a) in (tuple, list):
            return type(a)(int(v) if _size_tensor(v) else v for v in a)
        return a
    if not args or not any(map(holds, args[1:])) and not any(map(holds, kwargs.values())):
        return None
    return (args[0], *map(read, args[1:])), {k: read(v) for k, v in kwargs.items()}


_inplace_params: dict = {}


def _inplace_flag(func, args, kwargs):
    """Where a call of a function with an `inplace` parameter gives it True:
    "inplace" (a keyword) or its position; None for any other call."""
    if "inplace" in kwargs:
        return "inplace" if kwargs["inplace"] is True else None
    try:
        index = _inplace_params[func]
    except (KeyError, TypeError):
        index = _inplace_position(func)
        try:
            _inplace_params[func] = index
        except TypeError:
            pass                        # an unhashable callable: not cached
    return index if index is not None and index < len(args) and args[index] is True else None


def _inplace_position(func):
    try:
        names = list(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        return None                     # a builtin: its in-place form has its own name
    return names.index("inplace") if "inplace" in names else None


# "Tensor.<name>" (an entry point's name) -> LazyTensor's own method of that
# name, for the methods the compiled core implements (size, item, numpy,
# cpu...): they answer from metadata or compute the value once.  (Read off
# the class's core-defined methods; the entries the boot installs later are
# of another type.  LazyTensor.to records through call() itself.)
_NATIVE_METHODS = {
    "Tensor." + name: getattr(LazyTensor, name)
    for name, method in vars(LazyTensor).items()
    if not name.startswith("_") and name != "to" and hasattr(torch.Tensor, name)
    and type(method).__name__ in ("cython_function_or_method", "method_descriptor")}
