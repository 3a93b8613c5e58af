"""Eager writes that no recording entry point sees.

A pending node reads its eager inputs when the graph runs, not when it was
recorded; the graph must still see the contents they had at the call,
whatever writes them afterwards.  Every way Python code can write an eager
tensor therefore computes first the pending nodes that may read its memory
(the core's flush_pending: a storage comparison, so a write through a view,
a `.data` alias or another tensor set_ to the same storage counts too):

- Tensor methods that write self (Tensor.add_, __setitem__, set_ ...): the
  entry points of patching.py, FORM_INPLACE;
- torch functions that write (torch.relu_, torch.index_put_,
  torch._foreach_add_, torch._fused_adam_, torch._C._nn.elu_ -- which
  F.relu(inplace=True), nn.ReLU(inplace=True) and the optimizers call, and
  which torch.nn.functional also holds under its own names, F.relu_), and
  out= of any torch function: watch entries (FORM_WATCH*, csrc/_entry.h),
  which never record, so a LazyTensor argument still reaches
  LazyTensor.__torch_function__ as before; the factories' out=
  (`torch.zeros(..., out=t)`) through the guard that reads their 0-dim
  LazyTensor numbers (csrc/guards.h, GUARD_DATA);
- the rest, patched here in Python: torch.ops (OpOverload and its packet,
  which call the dispatcher directly), `x.data = y`, torch.utils.swap_tensors,
  writes through a storage (UntypedStorage.fill_/copy_/[i] = v), and the
  ways memory leaves torch (Tensor.numpy, __array__, __dlpack__): what is
  written through the array later cannot be seen, so the nodes run first.

The same points tell the storages watched for writes (_core.watch_writes)
of every write to them, with or without pending nodes: a program holding a
copy of a tensor's contents (inductor's frozen parameters, tiering.py) must
give way when they change, and a write through a `.data` alias bumps no
version counter.

What still writes unseen -- memory handed out before the node was recorded
(a NumPy array, a DLPack capsule, a data_ptr) and then written, or C++ code
such as autograd accumulating into an existing .grad -- bumps no version
counter in the first case (README, Semantics: call mark_step() first) and
is caught in the second by the version check at flush, which raises.

An eager tensor's `.data` or `.grad` assigned a LazyTensor takes its value
(a tensor's gradient is a tensor): both setters are patched here anyway.
"""
from __future__ import annotations

import weakref

import torch

from fastlazy import _core

FORM_WATCH, FORM_WATCH_INPLACE = _core.Form.FORM_WATCH, _core.Form.FORM_WATCH_INPLACE

# Modules whose C functions may write: torch itself, and those F and the
# optimizers call (F.dropout(inplace=True) calls torch._VF.dropout_, which
# a module attribute set here answers before VFModule.__getattr__ does).
_MODULES = (("torch", torch), ("torch._VF", torch._VF), ("torch._C._nn", torch._C._nn),
            ("torch.linalg", torch.linalg), ("torch.special", torch.special),
            ("torch.fft", torch.fft))
_BUILTIN = type(torch.relu_)


def watch_entries(taken):
    """(owner, attribute, qualified name, form) of every C torch function
    that may write an eager tensor and has no entry yet (`taken`: the
    (owner, attr) pairs patched already): the in-place ones (name ending
    in "_") and those documented to take out=."""
    for prefix, module in _MODULES:
        names = dir(torch._C._VariableFunctions) if module is torch._VF else dir(module)
        for name in sorted(names):
            if name.startswith("__") or (module, name) in taken:
                continue
            func = getattr(module, name, None)
            if type(func) is not _BUILTIN:
                continue
            if name.endswith("_"):
                yield module, name, f"{prefix}.{name}", FORM_WATCH_INPLACE
            elif "out=" in (func.__doc__ or "") or "out (Tensor" in (func.__doc__ or ""):
                yield module, name, f"{prefix}.{name}", FORM_WATCH


# Modules holding torch's writing functions under their own names, bound
# when they were imported: F.relu_ is torch.relu_ itself, F.elu_ is
# torch._C._nn.elu_, F.threshold_ is torch._VF.threshold_ -- and so they
# kept the original after enable() replaced torch's attribute.
_ALIAS_MODULES = (torch.nn.functional,)


def aliases(taken, watched):
    """(owner, attribute, original) for every attribute of _ALIAS_MODULES
    holding an original that a watch entry replaced (`watched`: by id) and
    not patched already (`taken`): it gets that same entry."""
    for module in _ALIAS_MODULES:
        for name, value in sorted(vars(module).items()):
            if type(value) is _BUILTIN and id(value) in watched and (module, name) not in taken:
                yield module, name, value


def _written_args(schema):
    """Positions and names of the arguments an op's schema writes
    (Tensor(a!) self, Tensor(a!)[] out ...)."""
    return tuple((i, a.name) for i, a in enumerate(schema.arguments)
                 if a.alias_info is not None and a.alias_info.is_write)


def _flush_schema_writes(op, args, kwargs):
    written = op.__dict__.get("_fastlazy_written")
    if written is None:
        written = op._fastlazy_written = _written_args(op._schema)
    for i, name in written:
        value = args[i] if i < len(args) else kwargs.get(name)
        if value is not None:
            _core.flush_reading(value)


def _no_swap_hook(t1, t2):
    pass


# Called with two tensors torch.utils.swap_tensors is about to swap, which
# it refuses to do while any weak reference to them lives: the tiered
# engine's frozen programs let go of theirs (set by boot).
on_swap = _no_swap_hook


def python_patches():
    """(owner, attr, replacement) for the writes patched in Python."""
    ops = torch._ops
    overload_call = ops.OpOverload.__call__
    packet_call = ops.OpOverloadPacket.__call__

    # (called by the C guards below only while nodes are pending or
    # storages watched: the optimizers' record_function calls are torch.ops)
    def overload_checked(self, /, *args, **kwargs):
        if _core.pending_nodes() or _core.watching():
            _flush_schema_writes(self, args, kwargs)
        return overload_call(self, *args, **kwargs)

    def packet_checked(self, /, *args, **kwargs):
        if _core.pending_nodes() or _core.watching():
            # which overload runs is the dispatcher's choice: whatever any
            # of them may write
            for name in self.overloads():
                _flush_schema_writes(getattr(self, name), args, kwargs)
        return packet_call(self, *args, **kwargs)

    base_data = torch._C.TensorBase.data

    def _data_set(self, value):
        _core.flush_reading(self)
        if type(value) is _core.LazyTensor:
            # an eager tensor takes the memory of a LazyTensor's value
            # (nn.utils.vector_to_parameters of a lazy vector)
            value = value.to_eager()
        base_data.__set__(self, value)

    base_grad = torch._C.TensorBase.grad

    def _grad_set(self, value):
        # an eager tensor's gradient is a tensor (`p.grad = p.grad * lazy_mask`)
        base_grad.__set__(self, value.to_eager())

    swap = torch.utils.swap_tensors

    def swap_tensors(t1, t2):
        _core.flush_reading((t1, t2))
        on_swap(t1, t2)
        return swap(t1, t2)

    # (C guards, whose reads and common calls cost what torch's own do:
    # optimizers read and set p.grad and enter record_function every step)
    patches = [(ops.OpOverload, "__call__", _core.writes_seen(overload_call, overload_checked)),
               (ops.OpOverloadPacket, "__call__", _core.writes_seen(packet_call, packet_checked)),
               (torch.Tensor, "data", _core.tensor_attribute(base_data, _data_set, writes=True)),
               (torch.Tensor, "grad", _core.tensor_attribute(base_grad, _grad_set)),
               (torch.utils, "swap_tensors", swap_tensors)]
    for attr in ("fill_", "copy_", "__setitem__"):
        patches.append((torch.UntypedStorage, attr, _storage_write(getattr(torch.UntypedStorage, attr))))
    for attr in ("numpy", "__array__", "__dlpack__"):
        patches.append((torch.Tensor, attr, _export(getattr(torch.Tensor, attr))))
    return patches


def _storage_write(method):
    def write(self, *args, **kwargs):
        if _core.pending_nodes() or _core.watching():
            # the storage as a tensor: the core compares storages
            _core.flush_reading(torch.empty(0, dtype=torch.uint8, device=self.device).set_(self))
        return method(self, *args, **kwargs)
    write.__name__ = write.__qualname__ = method.__name__
    write.__doc__ = method.__doc__
    return write


# storage address -> what holds memory exported from it to NumPy while
# enabled (the array's base tensor), held weakly: an address stays here
# while an array may still write the memory.  (A DLPack capsule cannot be
# held weakly: memory handed out that way is seen only while written
# later through the watch, as before.)
_exported: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def exported(tensor) -> bool:
    """Has memory of `tensor` been handed to NumPy or DLPack (since
    enable(), by a tensor still alive), to be written where nothing sees?"""
    try:
        return tensor.untyped_storage().data_ptr() in _exported
    except (RuntimeError, NotImplementedError, TypeError):
        return True


def _export(method):
    def export(self, *args, **kwargs):
        if type(self) is _core.LazyTensor:
            return method(self, *args, **kwargs)
        if _core.pending_nodes() or _core.watching():
            _core.flush_reading(self)
        out = method(self, *args, **kwargs)
        holder = getattr(out, "base", None)
        try:
            _exported[self.untyped_storage().data_ptr()] = (
                holder if isinstance(holder, torch.Tensor) else out)
        except (RuntimeError, NotImplementedError, TypeError):
            pass          # (no storage to tell, or a capsule)
        return out
    export.__name__ = export.__qualname__ = method.__name__
    export.__doc__ = method.__doc__
    export.__wrapped__ = method
    return export
