"""Batch normalization in training, recorded: the normalization and the
running-statistics update are nodes of the graph, and the module's buffers
follow them.

Eager `F.batch_norm(x, running_mean, running_var, ..., training=True)`
writes the running statistics in place, and a module's buffers are eager
tensors that any code may read.  Here the call is recorded as aten's
functional batch norm, which computes the same kernel into new tensors
(output, and the updated running mean and variance: eager's values and
gradients bit for bit).  The module that owns the two buffers (found among
the calling frames: the `self` whose buffers they are) gets the pending
results as its buffers, so `bn.running_mean`, `state_dict()` and the next
training step read the updated values; once the graph has run, the results
are copied into the original buffer tensors and those are put back, so the
module holds the very tensors it held before.

Not taken (the call runs eagerly, as before): running statistics that are
not both buffers of one module found among the calling frames (at this
call, or at an earlier one while it still holds them), a call under
inference_mode, CUDA (where eager runs cuDNN's kernel), mixed dtypes
other than eager's CPU mix (a bfloat16 or float16 input, every other
tensor float32: a convolution's output under autocast).  A reference to a
buffer taken before the step sees the update once the step's graph has
run, not before.
"""
from __future__ import annotations

import inspect
import sys
import weakref

import torch
import torch.nn.functional as F

from fastlazy import _core, generic
from fastlazy._core import LazyTensor
from fastlazy.capture import Unsafe

NOT_HANDLED = object()
_FUNCTIONAL = torch.ops.aten._native_batch_norm_legit_functional.default
# torch's own function (imported before enable() patches torch.nn.functional)
_BATCH_NORM = F.batch_norm
_SIGNATURE = inspect.signature(_BATCH_NORM)
_FRAMES = 8            # caller frames searched for the module owning the buffers
_REDUCED = (torch.bfloat16, torch.float16)

# module -> {buffer name: the eager tensor it held before fastlazy rebound it}
_originals: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# id(running mean) -> (weakref to the module whose buffer it is, (mean's
# name, var's name), the module's entry in _originals): the frames are
# searched once per module, not at every call (an entry is used only while
# that module still holds both tensors as those buffers, so a reused id
# finds nothing); the core records the calls it finds here itself
# (csrc/running_stats.pxi)
_owners: dict = {}
_MAX_OWNERS = 4096


def record(func, args, kwargs):
    """F.batch_norm in training with a module's running statistics,
    recorded; NOT_HANDLED for any other call."""
    if func is not _BATCH_NORM:
        return NOT_HANDLED
    if len(args) == 8 and not kwargs:
        # nn.BatchNorm's call, every argument positional (binding a
        # signature costs more than the rest of a recorded call)
        x, mean, var, weight, bias, training, momentum, eps = args
    else:
        try:
            bound = _SIGNATURE.bind(*args, **kwargs)
        except TypeError:
            return NOT_HANDLED                # eager raises its own error
        bound.apply_defaults()
        a = bound.arguments
        x, mean, var = a["input"], a["running_mean"], a["running_var"]
        weight, bias, training = a["weight"], a["bias"], a["training"]
        momentum, eps = a["momentum"], a["eps"]
    if (training is not True or type(x) is not LazyTensor or mean is None or var is None
            or x.device.type != "cpu" or type(momentum) not in (float, int)
            or type(eps) not in (float, int)):
        return NOT_HANDLED
    if torch.is_inference_mode_enabled() and isinstance(mean, torch.Tensor) \
            and not mean.is_inference():
        # pending statistics would be inference tensors, which the next
        # training step could not save for backward; eager writes the
        # buffers, which stay normal tensors: the call runs eagerly
        raise Unsafe("updates running statistics under inference_mode")
    # the statistics and affine parameters all in x's dtype, or all float32
    # beside a reduced-precision x (autocast's convolution output: eager's
    # CPU kernel takes that mix, and so does the functional one)
    dtype = mean.dtype if isinstance(mean, torch.Tensor) else None
    if dtype != x.dtype and not (dtype == torch.float32 and x.dtype in _REDUCED):
        return NOT_HANDLED
    for t in (mean, var, weight, bias):
        if t is not None and (not isinstance(t, torch.Tensor) or t.dtype != dtype):
            return NOT_HANDLED
    if not _one_per_channel(x, (mean, var, weight, bias)):
        return NOT_HANDLED            # (eager raises: the call runs so)
    if _awaiting_update(mean) or _awaiting_update(var):
        # another module's statistics too (tied buffers), whose pending
        # step has their update: computed first, so this step reads it
        _core.mark_step()
    owner = _owner(mean, var)
    if owner is None:
        return NOT_HANDLED
    module, names = owner
    known = _owners[id(mean)]           # (filed by _owner)
    buffers, originals = module._buffers, known[2]
    if not (_ours_to_rebind(buffers, originals, names[0])
            and _ours_to_rebind(buffers, originals, names[1])):
        return NOT_HANDLED
    F._verify_batch_size(x.size())        # eager's check, at the call
    # (the graph reads the module's own tensors: an eager write to one
    # through another reference computes the graph first, as for any eager
    # input, so that write lands after the update, as in eager)
    args = (x, weight, bias, mean, var, True, float(momentum), float(eps))
    hit, found = _core.signature_hit(_FUNCTIONAL, args)
    if not hit:        # (a new signature: analysed, then the core's from now on)
        found = generic.record(_FUNCTIONAL, args, {}, "F.batch_norm", prepared=found)
    _core.rebind_statistics(known, buffers, mean, var, found)
    return found[0]


def _awaiting_update(t) -> bool:
    """Is eager tensor t the original of a module's buffer that holds a
    pending update of it (a step recorded, its graph not yet run)?"""
    if type(t) is LazyTensor:
        return False
    known = _owners.get(id(t))
    if known is None:
        return False
    module = known[0]()
    if module is None:
        return False
    originals = known[2]
    return any(originals.get(name) is t and module._buffers.get(name) is not t
               for name in known[1])


def _one_per_channel(x, tensors) -> bool:
    """Does each of `tensors` (None aside) hold one value per channel of
    x, as eager's batch_norm checks (aten's functional kernel does not: it
    read past statistics of 3 values given 5 channels, and crashed given
    100)?"""
    if x.dim() < 2:
        return False
    channels = x.shape[1]
    return all(t is None or t.numel() == channels for t in tensors)


def install():
    """Let the core record the calls of modules found before itself
    (csrc/running_stats.pxi), from this module's table."""
    _core.set_running_stats(_owners, _FUNCTIONAL, _restore)


def _owner(mean, var):
    """(module, (mean's name, var's name)) of the nn.Module whose buffers
    `mean` and `var` are: the one found for them before, while they are
    still its buffers, else one among the calling frames; None if none
    is."""
    known = _owners.get(id(mean))
    if known is not None:
        module = known[0]()
        names = known[1]
        if (module is not None and module._buffers.get(names[0]) is mean
                and module._buffers.get(names[1]) is var):
            return module, names
    found = _owner_among_callers(mean, var)
    if found is not None:
        if len(_owners) >= _MAX_OWNERS:
            _owners.clear()            # (modules come and go: start over)
        _owners[id(mean)] = (weakref.ref(found[0]), found[1],
                             _originals.setdefault(found[0], {}))
    return found


def _owner_among_callers(mean, var):
    """_owner's search of the calling frames."""
    frame = sys._getframe(3)      # (past this function, _owner and record)
    for _ in range(_FRAMES):
        if frame is None:
            return None
        module = frame.f_locals.get("self")
        if isinstance(module, torch.nn.Module):
            names = [None, None]
            for name, buffer in module._buffers.items():
                if buffer is mean:
                    names[0] = name
                elif buffer is var:
                    names[1] = name
            if None not in names:
                return module, tuple(names)
        frame = frame.f_back
    return None


def _ours_to_rebind(buffers, originals, name):
    """An eager buffer, or one this module rebound and not yet restored (a
    step recorded before the last one's graph ran); not a LazyTensor the
    user put there.  `originals`: the module's entry in _originals."""
    return type(buffers[name]) is not LazyTensor or name in originals


def _restore(module_ref, originals, names, news):
    """The graph computing `news` has run (or failed): copy each into its
    buffer's original tensor (`originals`: the module's entry in
    _originals) and put that back, unless a later step rebound the buffer
    to its own pending statistics.  A module gone meanwhile, or one whose
    buffer was set to another tensor meanwhile (torch.func.functional_call
    puts the module's own buffers back after the call), still has its
    originals written: a reference to a buffer (a state_dict,
    `bn.running_mean` kept by the caller, functional_call's dict) sees the
    step's update as eager's does.  Where the step's graph
    failed before its update (an index out of range in an embedding ahead
    of the batch norm), the original goes back as it was: eager raised
    before the batch norm ran, and the module's statistics must not stay an
    error that every later step and read raises.  The pending tensor itself
    becomes a view of the original, as if the buffer had been that tensor
    all along: a reference to it taken meanwhile (load_state_dict's,
    copying a state into it while the step's graph ran) writes the
    buffer."""
    _owners.pop(id(news[0]), None)
    module = module_ref()
    buffers = None if module is None else module._buffers
    with torch.no_grad():
        for name, new in zip(names, news):
            held = None if buffers is None else buffers.get(name)
            if held is not None and held is not new and type(held) is LazyTensor:
                continue            # a later step's pending statistics: its write-back
            original = originals.pop(name, None)
            if original is None:
                continue
            try:
                value = new.to_eager()
            except Exception:     # noqa: BLE001 - raised at the failed step's own reads
                value = None
            if value is not None:
                # through `.data`, whose version counter is its own: the
                # graph's autograd saved the original (the functional batch
                # norm's backward keeps its running statistics, though
                # training reads none of them), and a write it saw would
                # make the backward refuse to run
                original.data.copy_(value)
            if held is new:
                buffers[name] = original
            _core.rebind_value(new, original.view_as(original))
