"""Sizes a captured aten program reads off its inputs instead of baking in.

make_fx records `x.view(x.size(0), -1)` or `torch.flatten(x, 1)` as
`aten.view(x, [8, 512])`: the sizes of the call that was traced.  A program
with those constants is one lowering per input shape, so every new batch
size or sequence length is a new graph structure, compiled again.  Here
each size of a view, reshape or expand that equals the size of its source
at the same position (counting from the left, or for a view that matches
more sizes so, from the right) becomes `aten.sym_size(source, dim)`, read
when the graph runs; of the view's remaining sizes the first becomes -1.  For the
common patterns (leading batch and sequence dims, trailing feature dims)
the program's code no longer depends on those sizes, and the lowerings of
all shapes intern to one (fastlazy.generic interns lowerings by code).

This is always correct, whatever the guess: each call signature (input
shapes included) is traced on its own, and the rewritten program computes
that call's sizes from that call's input shapes.  A guess that does not
generalize only leaves the program as shape-specific as it was.
"""
from __future__ import annotations

import torch
import torch.fx

aten = torch.ops.aten

# op -> how its size list aligns with its source's dims: views and reshapes
# from the left (and may take one -1), expand from the right (where -1
# means "keep the size", so it takes none)
_ALIGN = {
    aten.view.default: "left",
    aten._unsafe_view.default: "left",
    aten.reshape.default: "left",
    aten.expand.default: "right",
}


def make_sizes_symbolic(graph: torch.fx.Graph) -> bool:
    """Rewrite the graph's size arguments in place; True if any changed.
    The caller makes its code (capture.py does once, after every pass)."""
    changed = False
    for node in list(graph.nodes):
        align = _ALIGN.get(node.target) if node.op == "call_function" else None
        if align is None or len(node.args) < 2:
            continue
        source, sizes = node.args[0], node.args[1]
        value = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
        if not isinstance(value, torch.Tensor) or not isinstance(sizes, (list, tuple)) \
                or not all(type(n) is int for n in sizes):
            continue
        shape = [int(n) for n in value.shape]
        offset = 0 if align == "left" else len(shape) - len(sizes)
        if align == "left" and _matches(shape, sizes, len(shape) - len(sizes)) > \
                _matches(shape, sizes, 0):
            # aligned from the right (x.view(batch, seq, hidden) of rows
            # (batch * seq, hidden) unflattens the leading dim)
            offset = len(shape) - len(sizes)
        new, free = [], []
        with graph.inserting_before(node):
            for i, n in enumerate(sizes):
                dim = i + offset
                if 0 <= dim < len(shape) and shape[dim] == n and n >= 0:
                    new.append(graph.call_function(aten.sym_size.int, (source, dim)))
                else:
                    new.append(n)
                    if n >= 0:
                        free.append(i)
        if align == "left" and free and -1 not in sizes and all(
                n > 0 for n in sizes if type(n) is int):
            new[free[0]] = -1
        if new != list(sizes):          # (a Node never equals an int)
            node.args = (source, new, *node.args[2:])
            changed = True
    return changed


def _matches(shape, sizes, offset):
    return sum(1 for i, n in enumerate(sizes)
               if 0 <= i + offset < len(shape) and shape[i + offset] == n)
