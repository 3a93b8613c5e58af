"""A read-only view of the part of a segment a flush computes.

Backends lower from this view: the needed nodes in recording order (dead ones
pruned), each with its NodeProgram (fastlazy.node_program: the aten calls it
is, whatever recorded it), the external input slots they use, and the
outputs.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fastlazy import node_program
from fastlazy._core import NodeFlag, ScalarType, SlotKey
from fastlazy.node_program import NodeProgram


@dataclass(frozen=True)
class Node:
    index: int
    op: object           # what recorded it, for its name: an op-table row or a generic.Lowering
    program: NodeProgram  # what backends lower
    inputs: tuple        # ('node', i) | ('slot', k)
    attr: int
    cast: bool           # in-place op: cast the result to `dtype`
    detach: bool         # recorded under no_grad: read the inputs detached
    dtype: object
    shape: tuple
    uses: int            # consumers among the needed nodes
    is_output: bool
    requires_grad: bool
    output: int = 0      # which of the program's outputs
    keeps_shape: bool = False  # the result has its first operand's shape
    written: bool = False  # the user's call wrote its first operand in place


@dataclass(frozen=True)
class Slot:
    index: int           # in the segment
    position: int        # in the graph's parameter order (first use)
    kind: str            # 'tensor' or a scalar kind: 'bool', 'int', 'float', 'complex'
    value: object        # the value at compile time (a bool slot is a constant)


class GraphView:
    def __init__(self, seg, outputs):
        # the core's canonical form of the graph: the needed nodes and the
        # slots in parameter order are those of the cache key
        records, slot_order = seg.graph(outputs)
        outset = set(outputs)
        self.nodes = []
        for r in records:
            op, program, output = node_program.of_record(r.op, r.attr, r.dtype)
            self.nodes.append(Node(
                r.index, op, program, r.inputs, r.attr, bool(r.flags & NodeFlag.NODE_CAST),
                bool(r.flags & NodeFlag.NODE_DETACH), r.dtype, r.shape, r.uses,
                r.index in outset, r.requires_grad, output,
                bool(r.flags & NodeFlag.NODE_KEEPS_SHAPE),
                bool(r.flags & NodeFlag.NODE_WRITTEN)))
        # Without an output that needs autograd history the graph runs under
        # no_grad as a whole, so per-node detaching is moot.
        self.grad = any(n.requires_grad for n in self.nodes if n.is_output)
        if not self.grad:
            self.nodes = [dataclasses.replace(n, detach=False) if n.detach else n
                          for n in self.nodes]
        self.outputs = list(outputs)
        self.slots = [self._slot(seg, k, p) for p, k in enumerate(slot_order)]
        self.segment_sites = [seg.site(n.index) for n in self.nodes]

    @staticmethod
    def _slot(seg, k, position):
        key, value = seg.slot(k)
        if key & SlotKey.SLOT_SCALAR:
            if key & SlotKey.SLOT_BOOL_CONSTANT:
                return Slot(k, position, "bool", value)
            return Slot(k, position, ScalarType(key & 3).name[3:].lower(), value)
        return Slot(k, position, "tensor", value)

    def depth(self):
        """The longest chain of dependent nodes (1 for a lone node).  A
        loop over the nodes in recording order, where inputs come first:
        no recursion, however deep the graph."""
        depth = {}
        longest = 0
        for n in self.nodes:
            d = 1 + max((depth[r] for kind, r in n.inputs if kind == "node"), default=0)
            depth[n.index] = d
            longest = max(longest, d)
        return longest

    def slot_order(self):
        return tuple(s.index for s in self.slots)

    def __str__(self):
        lines = [f"slot {s.index}: {s.kind}" + (f" = {s.value}" if s.kind != "tensor" else
                                                 f" {tuple(s.value.shape)} {s.value.dtype}")
                 for s in self.slots]
        for n in self.nodes:
            ins = ", ".join(f"%{r}" if k == "node" else f"$slot{r}" for k, r in n.inputs)
            mark = "  <- output" if n.is_output else ""
            lines.append(f"%{n.index} = {n.op.name}({ins}) attr={n.attr & 0xFFFF} "
                         f": {n.dtype} {list(n.shape)}{mark}")
        return "\n".join(lines)
