"""What every backend shares: the Program shape, the Backend interface, and
helpers for lowering a node's NodeProgram (fastlazy.node_program)."""
from __future__ import annotations

# what a backend lowers (each node's NodeProgram), given to the backends from here
import collections

import torch

from fastlazy.node_program import (REFS, AtenCall, Input, NodeProgram, Sizes, Value, builtin,
                                   holds_refs)


# aten ops whose `<name>_` variant computes the same thing into its first
# argument (same shape and dtype as the result, checked per node).
INPLACE_VARIANTS = frozenset({
    "add", "sub", "mul", "div", "pow", "clamp", "neg", "abs", "relu", "exp",
    "log", "sqrt", "sigmoid", "tanh",
})


class Program:
    """A compiled graph.

    `slots` are positions in the graph's canonical input order (the order of
    GraphView.slots: first use); `call(*values)` takes the values at those
    positions and returns the output tensor (`single`) or a sequence of them.  The core calls `call`
    directly on a cache hit; `run` is the Python-side entry that also
    performs a backend's one-time `first_call` (e.g. choosing an executor).
    """

    def __init__(self, slots, call, single, source="", first_call=None):
        self.slots = tuple(slots)
        self.call = call
        self.single = single
        self._source = source      # IR or code text (or a callable making it)
        self._first_call = first_call

    @property
    def source(self) -> str:
        """The program's IR or code text, for fastlazy.debug."""
        return self._source() if callable(self._source) else self._source

    def run(self, inputs):
        first, self._first_call = self._first_call, None
        out = (first or self.call)(*inputs)
        return (out,) if self.single else tuple(out)


class Backend:
    name = "base"
    # True if a compiled program is only valid for the input shapes it was
    # compiled with (the shapes then become part of the cache key).
    specializes_shapes = False
    # The longest chain of dependent nodes the backend takes, or None: one
    # whose compiler recurses per node (on the C stack, or Python's) would
    # crash or raise RecursionError on deeper graphs, which the graph cache
    # gives to the native backend instead (fastlazy.graph_cache._choose).
    max_depth = None

    def compile(self, view) -> Program:
        raise NotImplementedError


_FIRST_INPUT = (Input(0),)


def as_written(view):
    """Which nodes of a graph that builds autograd history run as the user
    wrote them, writing into their first operand: those whose call wrote
    in place (NODE_WRITTEN) into an intermediate that no later node reads
    and no LazyTensor holds (written_form says how).  Autograd then sees the
    write as eager's did: a saved tensor modified in place makes backward
    raise eager's error, where a functional replay would give a gradient
    eager never computes."""
    if not view.grad or not any(node.written for node in view.nodes):
        return frozenset()
    by_index = {node.index: node for node in view.nodes}
    last_read = _last_reads(view)
    runs = collections.Counter(run_key(node) for node in view.nodes)
    written = set()
    for node in view.nodes:
        producer = _written_into(node, by_index, written) if node.written else None
        if (producer is not None and last_read[producer.index] == node.index
                and runs[run_key(producer)] == 1):
            written.add(node.index)
    return frozenset(written)


def written_form(node, written):
    """(the program a backend lowers for node, whether its one call runs as
    its `<name>_` variant).  A node of as_written's `written` set runs as
    `<name>_` where its call has that variant, and otherwise as its program
    followed by aten.copy_ of the result into its first input (which it
    then returns): the write autograd sees either way."""
    if node.index not in written:
        return node.program, False
    if _inplace_call(node) is not None:
        return node.program, True
    called = _as_called(node.program)
    if called is not None:
        return called, False
    return _copied_back(node.program), False


def exact_scalars(node, program, inplace, written, is_number):
    """(program, inplace) with the `<name>_` variant given up where it
    would round a Python-number operand: aten's in-place Scalar overloads
    (mul_.Scalar, add_.Scalar ...) cast the number to a float16 or
    bfloat16 self's dtype, where eager's `t.mul_(0.1)` and the functional
    op compute with it in float (bf16 (x*x)*0.1 was up to 2 ulp off).  A
    write the user made (in `written`) stays one: the functional program,
    then copy_ into the input.  is_number(k): node input k is a number."""
    if not inplace or node.dtype not in (torch.float16, torch.bfloat16):
        return program, inplace
    call = program.only_call()
    operands = (*call.args[1:], *(v for _, v in call.kwargs))
    if not any(isinstance(a, (int, float)) or isinstance(a, Input) and is_number(a.k)
               for a in operands):
        return program, inplace
    return (_copied_back(program) if node.index in written else program), False


# aten activations whose `<name>_` variant eager's in-place call runs
# (torch.selu_, F.elu_, F.leaky_relu(x, inplace=True) ...), the same
# arguments computing into the first: some save their result for backward
# where the functional form saves its input, so only the in-place call
# makes a later write to that result raise eager's error at backward
ACTIVATION_VARIANTS = frozenset({
    "elu", "selu", "celu", "leaky_relu", "hardtanh", "silu", "hardswish", "hardsigmoid",
    "mish", "threshold",
})

_as_called_programs: dict = {}      # NodeProgram -> its in-place form, or None


def _as_called(program):
    """The program of a written node as the user's in-place call ran it in
    eager, writing the node's first input, or None where it has none:

    - an activation's one call (ACTIVATION_VARIANTS), as its `<name>_`;
    - a captured in-place call (torch.relu_, F.elu_ recorded through
      mutation.py): clone the input, write the clone in place, and alias
      ops no output reads, as the write of the input itself.

    The clone-and-copy-back form (_copied_back) computes the values, but
    autograd then sees the write as a copy: the saved result of an
    in-place activation is the clone, so a later write to the result
    never made backward raise eager's error."""
    made = _as_called_programs.get(program, False)
    if made is False:
        made = _in_place_program(program)
        if len(_as_called_programs) >= _MAX_COPIED_BACK:
            _as_called_programs.clear()
        _as_called_programs[program] = made
    return made


def _in_place_program(program):
    calls = program.calls
    if len(calls) == 1 and program.outputs == (Value(0),):
        call = calls[0]
        if call.name not in ACTIVATION_VARIANTS or call.args[:1] != _FIRST_INPUT:
            return None
        if call.overload is None:
            overload = None
        else:
            packet = getattr(torch.ops.aten, call.name + "_", None)
            overload = getattr(packet, call.overload._overloadname, None)
            if overload is None:
                return None
        return NodeProgram(call.name + "_", (AtenCall(call.name + "_", overload, call.args,
                                                      call.kwargs, call.optional),),
                           (Value(0),), fresh=False, new_output=False)
    if (len(calls) < 2 or program.outputs != (Value(1),) or calls[0].overload is not _CLONE
            or calls[0].args != _FIRST_INPUT or calls[0].kwargs
            or not _writes_first_argument(calls[1]) or calls[1].args[:1] != (Value(0),)
            or any(c.overload not in _ALIASES for c in calls[2:])):
        return None
    write = calls[1]
    if _reads_a_value((write.args[1:], tuple(v for _, v in write.kwargs))):
        return None
    return NodeProgram(program.name, (AtenCall(write.name, write.overload,
                                               _FIRST_INPUT + write.args[1:], write.kwargs,
                                               write.optional),),
                       (Value(0),), fresh=False, new_output=False)


def _reads_a_value(template):
    """Does the argument read a value an earlier call of the program made?"""
    if isinstance(template, Value):
        return True
    if isinstance(template, Sizes):
        return _reads_a_value(template.of)
    if isinstance(template, (list, tuple)):
        return any(_reads_a_value(t) for t in template)
    return False


_CLONE = torch.ops.aten.clone.default
_ALIASES = frozenset({torch.ops.aten.detach.default, torch.ops.aten.alias.default})


def _writes_first_argument(call):
    """Is call an aten overload that writes its first argument and
    returns it (an in-place op: `relu_`, `add_.Tensor`)?"""
    overload = call.overload
    if not isinstance(overload, torch._ops.OpOverload):
        return False
    schema = overload._schema
    if not schema.arguments or len(schema.returns) != 1:
        return False
    written, returned = schema.arguments[0].alias_info, schema.returns[0].alias_info
    return (written is not None and written.is_write and returned is not None
            and returned.before_set == written.before_set)


_copied_back_programs: dict = {}     # NodeProgram -> its copied-back form
_MAX_COPIED_BACK = 4096


def _copied_back(program):
    """The program computed from a clone of its first input, its result
    then copied into that input: the written form of a program with no
    in-place form (_as_called), such as a decomposed call.  From the clone:
    a call that saves its input for backward must not see it overwritten
    by the copy; the copy still bumps the input's version, so a tensor
    saved by an earlier call raises eager's error at backward."""
    made = _copied_back_programs.get(program)
    if made is None:
        if len(_copied_back_programs) >= _MAX_COPIED_BACK:
            _copied_back_programs.clear()
        clone = AtenCall("clone", torch.ops.aten.clone.default, (Input(0),))
        calls = [clone] + [AtenCall(c.name, c.overload, _from_clone(c.args),
                                    tuple((k, _from_clone(v)) for k, v in c.kwargs),
                                    c.optional)
                           for c in program.calls]
        copy = AtenCall("copy_", torch.ops.aten.copy_.default,
                        (Input(0), _from_clone(program.outputs[0])))
        made = NodeProgram(program.name + "_", (*calls, copy),
                           (Value(len(calls)),), fresh=False)
        made = _copied_back_programs.setdefault(program, made)
    return made


def _from_clone(template):
    """An argument of the original program, in the copied-back one: its
    first input is the clone (call 0), its calls one further on."""
    if isinstance(template, Input):
        return Value(0) if template.k == 0 else template
    if isinstance(template, Value):
        return Value(template.k + 1)
    if isinstance(template, Sizes):
        return Sizes(_from_clone(template.of), template.count)
    if isinstance(template, (list, tuple)):
        return type(template)(_from_clone(v) for v in template)
    return template


def _last_reads(view):
    """node index -> the index of the last node (in recording order, which
    is every backend's run order) that reads it."""
    last = {}
    for node in view.nodes:
        for kind, index in node.inputs:
            if kind == "node":
                last[index] = node.index
    return last


def run_key(node):
    """Nodes with one key share one run of their program.  A program whose
    outputs may alias its inputs or each other (a captured one) runs once
    per distinct input tuple (per call where the graph records autograd
    history: graph._calls_apart), its other outputs being nodes of their
    own; a fresh one (which a later op may compute into) runs per node."""
    return node.index if node.program.fresh else (node.program, node.inputs, node.call)


def argument_reader(template):
    """(a node's inputs, its program's values so far) -> the argument
    `template` stands for: built once per call of a program, so running it
    walks no templates."""
    if isinstance(template, Input):
        return lambda ins, values, k=template.k: ins[k]
    if isinstance(template, Value):
        return lambda ins, values, k=template.k: values[k]
    if isinstance(template, Sizes):
        of, count = argument_reader(template.of), template.count
        return lambda ins, values: list(of(ins, values).shape[-count:])
    if isinstance(template, (list, tuple)) and holds_refs(template):
        items, kind = [argument_reader(t) for t in template], type(template)
        return lambda ins, values: kind([a(ins, values) for a in items])
    return lambda ins, values: template


def resolve(template, ref, sizes):
    """A call argument in a backend's own terms: ref(Input | Value) for a
    value, sizes(value, count) for an input's trailing sizes; constants as
    they are."""
    if isinstance(template, REFS):
        return ref(template)
    if isinstance(template, Sizes):
        return sizes(ref(template.of), template.count)
    if isinstance(template, (list, tuple)) and holds_refs(template):
        return type(template)(resolve(t, ref, sizes) for t in template)
    return template


def reusable(node, by_index):
    """May node compute into its first input's storage (the `<name>_`
    variant of its one call) where no autograd sees it?  Only if that input
    is an intermediate read by nobody else, of the result's shape and
    dtype."""
    producer = _into_first_input(node, by_index)
    return producer is not None and producer.uses == 1


def _into_first_input(node, by_index):
    """The node producing node's first input if node's one call has a
    `<name>_` variant writing that input, and the input is an intermediate
    no LazyTensor holds, of the result's shape and dtype; else None.  (Who
    else reads it is each caller's own condition.)"""
    if _inplace_call(node) is None:
        return None
    # the producer's output must be its node's alone: a captured program's
    # run is shared by the nodes of that program over the same inputs (run_key)
    producer = _written_into(node, by_index)
    return producer if producer is not None and producer.program.fresh else None


def _inplace_call(node):
    """node's one call, if it has a `<name>_` variant computing into its
    first argument; else None."""
    call = node.program.only_call()
    if (call is None or node.cast or call.name not in INPLACE_VARIANTS
            or call.args[:1] != _FIRST_INPUT):
        return None
    return call


def _written_into(node, by_index, written=frozenset()):
    """The node producing node's first input if that input is an
    intermediate no LazyTensor holds, of the result's shape and dtype, which
    node's one result could be written into; else None.  A producer in
    `written` (as_written's so far) returns the intermediate it wrote
    (`y.relu_().mul_(3)`: both calls write y's storage, as in eager)."""
    if len(node.program.outputs) != 1:
        return None
    kind, index = node.inputs[0]
    if kind != "node":
        return None
    producer = by_index[index]
    # a program may return a view of one of its inputs (new_output: it
    # does not).  keeps_shape, not the shapes at hand: the graph is reused
    # for every shape of this structure, and a broadcast elsewhere must
    # not write a larger result into the producer
    if ((producer.program.new_output or producer.index in written) and not producer.is_output
            and node.keeps_shape and producer.dtype == node.dtype):
        return producer
    return None
