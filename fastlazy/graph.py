"""A read-only view of the part of a segment a flush computes.

Backends lower from this view: the needed nodes in recording order (dead ones
pruned), the external input slots they use, and the outputs.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fastlazy import generic
from fastlazy.optable import OPS, Op

SLOT_TENSOR = 1 << 30
SLOT_SCALAR = 2 << 30
SCALAR_KINDS = ("bool", "int", "float", "complex")
GENERIC_OP, GENERIC_OUT_SHIFT = 511, 20       # the core's generic_record.pxi


@dataclass(frozen=True)
class Node:
    index: int
    op: Op               # or a generic.Lowering (op.generic)
    inputs: tuple        # ('node', i) | ('slot', k)
    attr: int
    cast: bool           # in-place op: cast the result to `dtype`
    detach: bool         # recorded under no_grad: read the inputs detached
    dtype: object
    shape: tuple
    uses: int            # consumers among the needed nodes
    is_output: bool
    requires_grad: bool
    output: int = 0      # generic nodes: which output of the lowering
    keeps_shape: bool = False  # the result has its first operand's shape

    def operand(self, position):
        """The input for operand `position` of the op, or None if absent
        (absent optional operands are not stored: attr bit 16+position)."""
        if self.attr >> (16 + position) & 1:
            return None
        present = sum(1 for p in range(position) if not self.attr >> (16 + p) & 1)
        return self.inputs[present]


@dataclass(frozen=True)
class Slot:
    index: int           # in the segment
    position: int        # in the graph's parameter order (first use)
    kind: str            # 'tensor' or a scalar kind: 'bool', 'int', 'float', 'complex'
    value: object        # the value at compile time (a bool slot is a constant)


def _op(raw):
    if raw[0] == GENERIC_OP:
        return generic.lowering(raw[2] & ((1 << GENERIC_OUT_SHIFT) - 1))
    return OPS[raw[0]]


class GraphView:
    def __init__(self, seg, outputs):
        raw = [seg.node(i) for i in range(len(seg))]
        needed = set(outputs)
        for i in range(len(raw) - 1, -1, -1):
            if i in needed:
                needed.update(r for kind, r in raw[i][1] if kind == "node")
        uses = dict.fromkeys(needed, 0)
        for i in needed:
            for kind, r in raw[i][1]:
                if kind == "node":
                    uses[r] += 1
        outset = set(outputs)
        self.nodes = [
            Node(i, _op(raw[i]), raw[i][1], raw[i][2], bool(raw[i][3] & 1),
                 bool(raw[i][3] & 2), raw[i][4], raw[i][5], uses[i], i in outset,
                 raw[i][7], raw[i][2] >> GENERIC_OUT_SHIFT & 255, bool(raw[i][3] & 4))
            for i in sorted(needed)
        ]
        # Without an output that needs autograd history the graph runs under
        # no_grad as a whole, so per-node detaching is moot.
        self.grad = any(n.requires_grad for n in self.nodes if n.is_output)
        if not self.grad:
            self.nodes = [dataclasses.replace(n, detach=False) if n.detach else n
                          for n in self.nodes]
        self.outputs = list(outputs)
        # slots in order of first use: the same canonical order as the core's
        # cache key (flush.pxi canonical_key), so a program compiled for one
        # recording takes its inputs in the right order for every other
        used = list(dict.fromkeys(r for n in self.nodes for kind, r in n.inputs
                                  if kind == "slot"))
        self.slots = [self._slot(seg, k, p) for p, k in enumerate(used)]
        self.segment_sites = [seg.site(n.index) for n in self.nodes]

    @staticmethod
    def _slot(seg, k, position):
        key, value = seg.slot(k)
        if key & SLOT_SCALAR:
            return Slot(k, position, SCALAR_KINDS[key & 3] if not key & 16 else "bool", value)
        return Slot(k, position, "tensor", value)

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
