"""A clear error where torch itself meets the device "lazy".

With fastlazy enabled, `t.to("lazy")` is fastlazy's entry point and never
reaches torch.  Without enable() (or for `torch.rand(..., device="lazy")`,
which no LazyTensor takes part in) torch tries to allocate on its own Lazy
backend, which has no kernels until torch._lazy's TorchScript backend is
initialized, and fails with a dispatcher message that says nothing useful
("Could not run 'aten::empty.memory_format' with arguments from the 'Lazy'
backend ... Facebook employee").  The two allocation kernels every such
call ends in get one that says what to do instead.

It changes nothing else: the Lazy dispatch key had no kernel for them.  If
torch._lazy's backend is initialized later its kernels replace these (torch
warns once that it overrides a kernel); call remove() first to avoid that.
"""
from __future__ import annotations

import torch

_OPS = ("empty.memory_format", "empty_strided")
_library = None


def _refuse(*args, **kwargs):
    from fastlazy import patching
    if not patching.enabled():
        raise RuntimeError(
            "fastlazy is not enabled, so torch took .to('lazy') (or device='lazy') as "
            "its own torch._lazy device, which is not set up. Call fastlazy.enable() "
            "first (once, before making lazy tensors), then t.to('lazy'); "
            "fastlazy.lazy(t) also makes a LazyTensor without it. Modules stay eager: "
            "after enable(), model.to('lazy') leaves the model as it is and only the "
            "inputs need x.to('lazy'); factories take a real device "
            "(torch.rand(...).to('lazy')).")
    raise RuntimeError(
        "torch cannot allocate a tensor on the device 'lazy' (torch._lazy's device, "
        "which fastlazy does not use). With fastlazy a LazyTensor is made from an "
        "existing tensor: t.to('lazy') (or 'lazy:0', torch.device('lazy')), or "
        "fastlazy.lazy(t); make the tensor on its real device first "
        "(torch.rand(...).to('lazy')). A "
        "LazyTensor's device is where its value will live (cpu or cuda).")


def install() -> None:
    """Register the kernels (fastlazy's boot), unless torch._lazy's backend
    already has its own."""
    global _library
    if _library is not None or any(
            torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{op}", "Lazy")
            for op in _OPS):
        return
    library = torch.library.Library("aten", "IMPL", "Lazy")
    for op in _OPS:
        library.impl(op, _refuse)
    _library = library


def remove() -> None:
    """Unregister them, e.g. before initializing torch._lazy's backend."""
    global _library
    if _library is not None:
        _library._destroy()
        _library = None
