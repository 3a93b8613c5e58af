"""A call's aten program, read off its fake run.

capture.py runs each new call signature once on fake tensors (eager's
checks, the results' metadata) and needs the call's aten program too.
make_fx gets it by running the call a second time through its proxy
tracer: 4-12 ms per signature, most of it fixed cost (the tracer, a fake
mode of its own, the GraphModule it builds), and most of a model's first
call.  The fake run already makes every aten call the program is made of,
in order: a Recorder, a dispatch mode entered above the fake mode, writes
them into an fx graph as they happen.

It gives up on what a plain list of calls on the inputs cannot express --
a tensor that is neither an input nor an earlier call's result (a constant
the call made from Python values), an op that writes an input or a view of
one (make_fx functionalizes those), an output that is not a tensor or a flat
sequence of them, a call that is not an aten operator -- and capture.py
then traces the call with make_fx, which handles those.  Writes to tensors
the call made (dropout's div_ of its noise) are recorded as they happened,
as make_fx records them, and so are random ops: capture.py lifts their
draws out of the program whichever way it was made.
"""
from __future__ import annotations

import operator

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from fastlazy.host_checks import HOST_CHECKS


class Recorder(TorchDispatchMode):
    """Enter it inside a FakeTensorMode, with the fake tensors that stand for
    the call's tensor arguments (in order: the program's placeholders); then
    program(results) is the aten program of what ran, or None."""

    def __init__(self, inputs, numbers=()):
        super().__init__()
        self.graph = torch.fx.Graph()
        self._nodes = {}            # id(fake tensor) -> the node that makes it
        self._alive = []            # (the tensors behind those ids stay alive)
        self.failed = None          # why the calls are no program, or None
        self._inputs = list(inputs)
        # the call's Python numbers and lists of them, whose tensors
        # (x[i] = 3 copies from one, x[[0, 2]] indexes with one) become
        # constants of the program: see _constant
        self._numbers = numbers
        self._last_placeholder = None
        for i, t in enumerate(inputs):
            node = self.graph.placeholder(f"arg{i}")
            node.meta["val"] = t
            self._bind(t, node)
            self._last_placeholder = node

    def _bind(self, t, node):
        self._nodes[id(t)] = node
        self._alive.append(t)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.failed is None:
            self.failed = self._record(func, args, kwargs, out)
        return out

    def _record(self, func, args, kwargs, out):
        if not isinstance(func, torch._ops.OpOverload):
            return f"calls {func}"
        if func._schema.is_mutable and self._writes_an_input(func, args, kwargs):
            return "writes an argument"
        # (a host check of a kernel's info tensor returns nothing, and is
        # recorded all the same: capture.py keeps it)
        if func not in HOST_CHECKS and not any(isinstance(v, torch.Tensor)
                                               for v in pytree.tree_leaves(out)):
            # a query of metadata (prim.device, sym_size): the value went
            # back to the Python that asked, as it does in make_fx's trace;
            # one that reads data would have raised in the fake run
            if torch.Tag.data_dependent_output in func.tags:
                return "reads data"
            return None
        outside = []

        def node_of(x):
            if isinstance(x, torch.Tensor):
                node = self._nodes.get(id(x))
                if node is None:
                    node = self._constant(x)
                if node is None:
                    outside.append(x)
                return node
            return x
        a, k = pytree.tree_map(node_of, (tuple(args), dict(kwargs)))
        if outside:
            return "reads a tensor made outside the program"
        node = self.graph.call_function(func, a, k)
        node.meta["val"] = out
        if isinstance(out, torch.Tensor):
            self._bind(out, node)
        elif isinstance(out, (tuple, list)):
            for i, v in enumerate(out):
                if isinstance(v, torch.Tensor):
                    item = self.graph.call_function(operator.getitem, (node, i))
                    item.meta["val"] = v
                    self._bind(v, item)
                elif v is not None and not isinstance(v, (int, float, bool)):
                    return "returns a nested sequence"
        elif out is not None and not isinstance(out, (int, float, bool)):
            return f"returns a {type(out).__name__}"
        return None

    def _constant(self, x):
        """A placeholder for x, made outside the program, where x is the
        tensor torch makes of one of the call's Python numbers or lists of
        them (eager's wrapped number; `x[i] = 3`'s value in x's dtype; the
        index tensor of `x[..., [-2], :]`): the program's input after the
        call's tensors, its value kept in the placeholder's "constant"
        (capture.py passes it, as it passes make_fx's lifted constants).
        None for any other tensor, whose values might be the trial run's
        own."""
        # (in a fake run, the fake tensor of a constant keeps the real one)
        value = getattr(x, "constant", None) if isinstance(x, FakeTensor) else x
        if (value is None or value.numel() > MAX_CONSTANT_NUMEL or value.layout != torch.strided
                or value.device.type != "cpu" or value.requires_grad or not self._numbers):
            return None
        if not any(_holds(value, n) for n in self._numbers):
            return None
        with self.graph.inserting_after(self._last_placeholder):
            node = self.graph.placeholder(f"constant{len(self._alive)}")
        node.meta["val"] = x
        node.meta["constant"] = value
        self._bind(x, node)
        self._last_placeholder = node
        return node

    def _writes_an_input(self, func, args, kwargs):
        """Does the call write one of the program's inputs, or a view of
        one?  (A write to a tensor the program made stays in the program.)"""
        for k, arg in enumerate(func._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = args[k] if k < len(args) else kwargs.get(arg.name)
            for written in (value if isinstance(value, (list, tuple)) else (value,)):
                if not isinstance(written, torch.Tensor):
                    continue
                if any(torch._C._is_alias_of(written, t) for t in self._inputs):
                    return True
        return False

    def program(self, results):
        """The FX graph computing `results` (the call's result tensors,
        None leaves left out) from the inputs, or None where the calls
        recorded are no such program.  (A Graph: capture checks and edits
        it before its one GraphModule, and code, is made.)"""
        if self.failed is not None:
            return None
        outputs = []
        for r in results:
            node = self._nodes.get(id(r))
            if node is None:
                return None
            outputs.append(node)
        self.graph.output(tuple(outputs))
        return self.graph


# the largest constant taken from the call's Python values (a list index)
MAX_CONSTANT_NUMEL = 4096


def _holds(x, value):
    """Is x the Python number, or (nested) list of numbers, `value`
    converted to x's dtype, as torch converts one it makes a tensor of?"""
    # (outside the fake run's mode, which would make the tensor fake)
    with _disable_current_modes():
        try:
            return torch.equal(torch.tensor(value, dtype=x.dtype), x)
        except (RuntimeError, TypeError, ValueError, OverflowError):  # (not convertible)
            return False


def no_dropout(func, args, kwargs):
    """Is this call of an op tagged random for its dropout (an attention
    kernel) made with none?  Then it is pure: recorded here, and let
    through capture.py's purity check."""
    for k, arg in enumerate(func._schema.arguments):
        if arg.name == "dropout_p":
            value = args[k] if k < len(args) else kwargs.get("dropout_p", arg.default_value)
            return value == 0
    return False
