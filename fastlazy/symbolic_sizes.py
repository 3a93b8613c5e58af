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

A size the source no longer shows -- the leading dims of a (length, batch,
features) input folded into rows for one matmul, then unflattened after it
(nn.MultiheadAttention's projections, aten's matmul of a 3-d input) -- is
read from where the rows came from: each node's dims are followed back
through views, matmuls, transposes and same-shape ops to the dims they are
products of (`_origins`), and sizes that spell out those factors in order,
each factor of a distinct size, become their sym_size.

This is always correct, whatever the guess: each call signature (input
shapes included) is traced on its own, and the rewritten program computes
that call's sizes from that call's input shapes.  A guess that does not
generalize only leaves the program as shape-specific as it was.
"""
from __future__ import annotations

import operator

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
    origins = {}
    for node in list(graph.nodes):
        _trace_origins(node, origins)
        align = _ALIGN.get(node.target) if node.op == "call_function" else None
        if align is None or len(node.args) < 2:
            continue
        source, sizes = node.args[0], node.args[1]
        value = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
        if not isinstance(value, torch.Tensor) or not isinstance(sizes, (list, tuple)) \
                or not all(type(n) is int for n in sizes):
            continue
        shape = [int(n) for n in value.shape]
        unflattened = _unflattened(sizes, origins.get(source))
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
                elif i in unflattened:
                    new.append(graph.call_function(aten.sym_size.int, unflattened[i]))
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


# ops whose result has the shape of their first tensor argument, dim for dim
_SAME_SHAPE = {aten.clone.default, aten.contiguous.default, aten._to_copy.default,
               aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor,
               aten.relu.default, aten.gelu.default, aten.detach.default}
# attention kernels: result 0 is (batch, heads, length) of the query, then
# the value's features
_ATTENTION = {getattr(aten, name).default for name in (
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
    if hasattr(aten, name)}


def _trace_origins(node, origins):
    """origins[node]: per dim of node's value, the factors whose product is
    that dim -- (node, dim) pairs read where the graph runs, or ints where a
    dim's origin is not followed (they stay constants) -- or no entry."""
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor) or node.op not in ("placeholder", "call_function"):
        return
    shape = [int(n) for n in value.shape]
    if node.op == "placeholder":
        origins[node] = [((node, d),) for d in range(len(shape))]
        return
    target, args = node.target, node.args

    def of(arg):
        if not isinstance(arg, torch.fx.Node):
            return None
        known = origins.get(arg)
        if known is None and isinstance(arg.meta.get("val"), torch.Tensor):
            known = [(int(n),) for n in arg.meta["val"].shape]
        return known

    first = of(args[0]) if args else None
    dims = None
    if target is operator.getitem and args[1] == 0 and getattr(args[0], "target", None) in _ATTENTION:
        query, value_ = of(args[0].args[0]), of(args[0].args[2])
        if query is not None and value_ is not None and len(query) == len(value_) == 4:
            dims = [*query[:3], value_[3]]
    elif first is None:
        return
    elif target in _SAME_SHAPE:
        if list(args[0].meta["val"].shape) == shape:
            dims = list(first)
    elif target in _ALIGN and target is not aten.expand.default:
        dims = _regrouped(first, shape)
    elif target is aten.t.default:
        dims = first[::-1]
    elif target is aten.transpose.int and first:      # (a 0-dim input has no dims to swap)
        dims = list(first)
        a, b = (d % len(dims) for d in args[1:3])
        dims[a], dims[b] = dims[b], dims[a]
    elif target is aten.permute.default and first:
        dims = [first[d % len(first)] for d in args[1]]
    elif target is aten.mm.default:
        other = of(args[1])
        dims = [first[0], other[1]] if other else None
    elif target is aten.addmm.default:
        rows, cols = of(args[1]), of(args[2])
        dims = [rows[0], cols[1]] if rows and cols else None
    if dims is not None and len(dims) == len(shape):
        origins[node] = dims


def _size(factor):
    return factor if type(factor) is int else int(factor[0].meta["val"].shape[factor[1]])


def _regrouped(dims, after):
    """The origins of a view's dims from its source's (`dims`): its factors
    regrouped, in order, into the view's sizes; an int factor may be split
    (a features dim into heads and head size).  None where the sizes cannot
    be spelled so (an origin would have to be split)."""
    queue = [f for factors in dims for f in factors if _size(f) != 1]
    out, i = [], 0
    for n in after:
        taken, product = [], 1
        while product < n and i < len(queue):
            f = queue[i]
            size = _size(f)
            if product * size <= n:
                taken.append(f)
                product *= size
                i += 1
            elif type(f) is int and f % (n // product) == 0 and n % product == 0:
                part = n // product
                taken.append(part)
                queue[i] = f // part
                product *= part
            else:
                return None
        if product != n:
            return None
        out.append(tuple(taken) if taken else (1,))
    return out if i == len(queue) else None


def _unflattened(sizes, dims):
    """{position in `sizes`: (node, dim)} for each run of sizes that spells
    out, in order, the factors of one of the source's dims -- the rows a
    matmul made of several dims, unflattened again -- where those factors
    have distinct sizes (equal ones could be spelled in either order)."""
    found = {}
    for factors in dims or ():
        if len(factors) < 2 or all(type(f) is int for f in factors):
            continue
        values = [_size(f) for f in factors]
        if len(set(values)) != len(values):
            continue
        for start in range(len(sizes) - len(values) + 1):
            if list(sizes[start:start + len(values)]) == values:
                found.update({start + k: f for k, f in enumerate(factors)
                              if type(f) is not int})
                break
    return found
