"""A leaf that requires grad, written: its successor.

Eager writes a parameter in place (an optimizer's step, `p.data.mul_(2)`,
`p.detach().add_(1)`): it stays the same leaf, with its gradient and hooks.
A LazyTensor never writes into the tensor it holds; the written value is a
new tensor, which `succeed` makes that leaf's successor.  Ops recorded
before the write read the old leaf, and autograd accumulates their
gradient there (a loss computed before the write, backpropagated after):
each old leaf hands what it receives on to the newest successor, where
eager's one leaf would have it.
"""
from __future__ import annotations

import weakref

import torch


def succeed(new: torch.Tensor, old: torch.Tensor) -> None:
    """Make `new` (the written value, without autograd history) the leaf
    `old` was: requiring grad, with old's gradient and hooks (the same
    dicts, so the handles register_hook gave still remove them), and the
    destination of the gradients autograd accumulates into `old` later."""
    new.requires_grad_(True)
    new.grad = old.grad
    shared = old._post_accumulate_grad_hooks is not None
    if old._backward_hooks is not None:
        new._backward_hooks = old._backward_hooks
    if shared:
        new._post_accumulate_grad_hooks = old._post_accumulate_grad_hooks
    # (held: a chain old -> new -> newer lives only as long as old does)
    old._fastlazy_successor = new
    handle = old.register_post_accumulate_grad_hook(_hand_on(weakref.ref(old)))
    if shared:
        # the dict lives on in the successors: the hook leaves it with old
        weakref.finalize(old, handle.remove)


def _hand_on(old_ref):
    def hand_on(leaf):
        if leaf is not old_ref():
            return          # a successor's accumulation (the hook dict is shared)
        heir = newest_successor(leaf)
        if heir is None or leaf.grad is None:
            return
        grad, leaf.grad = leaf.grad, None
        if heir.grad is None:
            heir.grad = grad
        elif torch.is_grad_enabled():
            heir.grad = heir.grad + grad        # create_graph: as eager, out of place
        else:
            heir.grad.add_(grad)
    return hand_on


def newest_successor(leaf: torch.Tensor) -> torch.Tensor | None:
    """The end of leaf's chain of successors (None: it has none)."""
    heir = getattr(leaf, "_fastlazy_successor", None)
    while heir is not None:
        nxt = getattr(heir, "_fastlazy_successor", None)
        if nxt is None:
            return heir
        heir = nxt
    return None
