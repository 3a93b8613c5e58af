"""A read-only view of the part of a segment a flush computes.

Backends lower from this view: the needed nodes in recording order (dead ones
pruned), each with its NodeProgram (fastlazy.node_program: the aten calls it
is, whatever recorded it), the external input slots they use, and the
outputs.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from fastlazy import node_program
from fastlazy._core import NodeFlag, ScalarType, SlotKey
from fastlazy.node_program import NodeProgram


# Not frozen: a graph of n nodes makes n of them at its compile, and a
# frozen dataclass's __init__ sets each field through object.__setattr__
# (1.75 us a node against 0.28).  Only the GraphView that makes a node
# writes its fields (its `call`, while the view is built); a node changed
# after that is a dataclasses.replace copy.
@dataclass(slots=True, eq=False)
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
    call: int = -1       # the call that recorded it (see _calls_apart); -1: any


@dataclass(frozen=True)
class _Made:
    """What made a node the view adds (no recorded call): its name."""
    name: str


_CLONE = _Made("clone")
_CLONE_PROGRAM = NodeProgram(
    "clone", [node_program.AtenCall("clone", None, [node_program.Input(0)])],
    [node_program.Value(0)], fresh=True)


@dataclass(slots=True, eq=False)      # not frozen, as Node
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
        # Without an output that needs autograd history the graph runs under
        # no_grad as a whole, so per-node detaching is moot.
        self.grad = any(r.requires_grad for r in records if r.index in outset)
        detaching = NodeFlag.NODE_DETACH if self.grad else 0
        self.nodes = []
        for r in records:
            op, program, output = node_program.of_record(r.op, r.attr, r.dtype)
            self.nodes.append(Node(
                r.index, op, program, r.inputs, r.attr, bool(r.flags & NodeFlag.NODE_CAST),
                bool(r.flags & detaching), r.dtype, r.shape, r.uses,
                r.index in outset, r.requires_grad, output,
                bool(r.flags & NodeFlag.NODE_KEEPS_SHAPE),
                bool(r.flags & NodeFlag.NODE_WRITTEN)))
        self.nodes = _calls_apart(self.nodes, merge_identical=not self.grad)
        self.outputs = list(outputs)
        self.slots = [self._slot(seg, k, p) for p, k in enumerate(slot_order)]
        # (what a compile later reads of its tensors' devices: the copies
        # of the view a compile gets hold metadata or meta tensors)
        self.device_types = frozenset(s.value.device.type for s in self.slots
                                      if s.kind == "tensor")
        self.segment_sites = [seg.site(n.index) for n in self.nodes]
        if self.grad and any(n.written for n in self.nodes):
            self._clone_written_inputs()

    def _clone_written_inputs(self):
        """An in-place write through a LazyTensor made from an eager tensor
        that earlier ops of this graph read (`y = w * x; x.add_(1)`): eager
        writes the tensor those ops saved for backward, so backward raises.
        The tensor a LazyTensor was made from is never written, so those
        ops and the write read a clone of it made at their first read, which
        the write may then write (backends.base.as_written): autograd sees
        what eager's saw, and gradients flow through the clone."""
        readers: dict = {}           # tensor slot -> the nodes reading it
        for n in self.nodes:
            for kind, index in n.inputs:
                if kind == "slot":
                    readers.setdefault(index, []).append(n)
        tensors = {s.index: s.value for s in self.slots if s.kind == "tensor"}
        for n in list(self.nodes):
            kind, index = n.inputs[0] if n.inputs else (None, None)
            if (not n.written or kind != "slot" or index not in tensors
                    or readers[index][-1] is not n
                    or all(r is n for r in readers[index])
                    or not n.keeps_shape or tensors[index].dtype != n.dtype):
                continue
            self._insert_clone(index, readers[index], tensors[index])

    def _insert_clone(self, slot, readers, value):
        clone = Node(max(n.index for n in self.nodes) + 1, _CLONE, _CLONE_PROGRAM,
                     (("slot", slot),), 0, False, False, value.dtype, tuple(value.shape),
                     len(readers), False, value.requires_grad, keeps_shape=True)
        reading = {id(n) for n in readers}
        first = next(k for k, n in enumerate(self.nodes) if id(n) in reading)
        self.nodes = [dataclasses.replace(n, inputs=tuple(
                          ("node", clone.index) if ref == ("slot", slot) else ref
                          for ref in n.inputs)) if id(n) in reading else n
                      for n in self.nodes]
        self.nodes.insert(first, clone)
        self.segment_sites.insert(first, self.segment_sites[first])

    @staticmethod
    def _slot(seg, k, position):
        key, value = seg.slot(k)
        if key & SlotKey.SLOT_SCALAR:
            if key & SlotKey.SLOT_BOOL_CONSTANT:
                return Slot(k, position, "bool", value)
            return Slot(k, position, ScalarType(key & 3).name[3:].lower(), value)
        return Slot(k, position, "tensor", value)

    def backward_paths(self):
        """How many of the graph's outputs that require grad have
        backwards of their own: outputs linked by no differentiable path
        through the graph's nodes (slots -- leaves, eager tensors -- do not
        link them: their gradients accumulate).  In eager each such output
        can be differentiated apart from the others (a GAN's generator
        output, and the discriminator's loss on its detached copy); a
        compiled training graph is one autograd node, whose first backward
        frees what the others need."""
        parent = {}

        def find(i):
            while parent.setdefault(i, i) != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        first_of_call = {}
        for n in self.nodes:
            if not n.requires_grad:
                continue
            find(n.index)
            if n.call >= 0:
                # the results of one call come from one autograd node
                parent[find(n.index)] = find(first_of_call.setdefault(n.call, n.index))
            if n.detach:
                continue
            for kind, r in n.inputs:
                if kind == "node" and r in parent:
                    parent[find(n.index)] = find(r)
        return len({find(n.index) for n in self.nodes if n.is_output and n.requires_grad})

    def deeper_than(self, limit):
        """Is the longest chain of dependent nodes longer than `limit`?
        Never where the graph has no more nodes than that (no chain to
        walk at a compile)."""
        return len(self.nodes) > limit and self.depth() > limit

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


def _calls_apart(nodes, merge_identical=False):
    """The nodes with `call` set: the index of the first node its call
    recorded.  Nodes of one program over the same inputs share one run
    (backends.base.run_key) -- a call returning several tensors records
    one node per tensor -- but two calls that happen to be the same (a
    model pooling one input twice) are two runs in a graph that records
    autograd history: merged, their gradients would be summed before the
    op's backward instead of each reaching the input on its own, as in
    eager (the same values, rounded otherwise).  A call's nodes are
    recorded back to back with their outputs in increasing order, some
    maybe pruned as dead: a node continues the call of the last node of
    its program and inputs if its output comes later and no more nodes
    lie between them than outputs.

    `merge_identical` (a graph without autograd history): identical calls
    share one run after all -- common subexpressions computed once --
    except where two graph outputs would then be one tensor object (two
    `zeros_like(x)` read together: an eager write to one value, as
    Adam's foreach step makes, would show in the other)."""
    last = {}
    for n in nodes:
        if not n.program.fresh:
            key = (n.program, n.inputs)
            m = last.get(key)
            same = (m is not None and n.output > m.output
                    and n.index - m.index <= n.output - m.output)
            # (the view's own new nodes: set in place, not copied -- a copy
            # per node was a fifth of a view's cost)
            n.call = m.call if same else n.index
            last[key] = n
    if merge_identical:
        _merge_identical_calls(nodes)
    return nodes


def _merge_identical_calls(nodes):
    """Give each call of a program over the same inputs as an earlier one
    that call's `call` (the view's new nodes, in place) -- one run for
    both -- unless both have a graph output at the same output position."""
    held = {}        # call -> output positions its graph outputs hold
    for n in nodes:
        if n.call >= 0 and n.is_output:
            held.setdefault(n.call, set()).add(n.output)
    into = {}        # call -> the call whose run it shares
    runs = {}        # (program, inputs) -> [(call, output positions held), ...]
    for n in nodes:
        if n.call < 0 or n.call in into:
            continue
        mine = held.get(n.call, set())
        for k, (call, taken) in enumerate(runs.setdefault((n.program, n.inputs), [])):
            if not (taken & mine):
                into[n.call] = call
                runs[(n.program, n.inputs)][k] = (call, taken | mine)
                break
        else:
            into[n.call] = n.call
            runs[(n.program, n.inputs)].append((n.call, mine))
    for n in nodes:
        if n.call >= 0:
            n.call = into[n.call]


# -- example inputs: what a compile runs its program on ----------------------
# (made from a description, on the compile thread or in the compile process:
# neither holds nor reads the user's tensors)

def describe_input(value):
    """("tensor", sizes, strides, dtype, device, requires_grad) for a
    tensor; ("value", value) for anything else."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.stride(), value.dtype, value.device,
                value.requires_grad)
    return ("value", value)


def example_input(described, zeroed: bool = False):
    """Fresh memory like a described tensor (`zeroed`: filled with zeros,
    not left as it was allocated), or the described value."""
    if described[0] != "tensor":
        return described[1]
    _, shape, stride, dtype, device, requires_grad = described
    t = torch.empty_strided(shape, stride, dtype=dtype, device=device)
    if zeroed:
        t.zero_()
    return t.requires_grad_(requires_grad)
