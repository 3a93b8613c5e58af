"""Writes through a detached view (`y.detach()[0] = v`, `y.data.zero_()`).

Eager writes y's memory in place without autograd seeing it: y keeps its
grad_fn, and a gradient reaching y flows on through it whole -- to the
elements written too.  A LazyTensor never writes memory: the write
rebinds y's root to a new value (mutation.after_mutation), whose
derivative must then be the identity towards the root as it was, while its
value is the written one, bit for bit.  No aten expression gives both
exactly (`root + (written - root).detach()` rounds, and turns inf into
nan), so the op `fastlazy::written_under(before, written)` does: it returns
a copy of `written`, and its derivative passes the gradient to `before`.

(What eager does beyond that is not followed: writing through `detach()`
a tensor that a backward saved makes eager's backward raise, and through
`.data` makes it use the written values; here the backward uses the
values saved before the write.)
"""
from __future__ import annotations

import torch


def _written_under(before: torch.Tensor, written: torch.Tensor) -> torch.Tensor:
    return written.clone()


def _written_under_fake(before, written):
    return torch.empty_like(written)


def _written_under_backward(ctx, grad):
    return grad, None


def define() -> None:
    """Define the op `fastlazy::written_under` (once, by fastlazy's boot)."""
    op = torch.library.custom_op("fastlazy::written_under", mutates_args=())(_written_under)
    op.register_fake(_written_under_fake)
    op.register_autograd(_written_under_backward)
