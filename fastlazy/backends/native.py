"""The native backend: fastlazy's own executor, for kernels TorchScript
cannot call.

The graph becomes steps (fastlazy/_steps.pyx) that a C loop runs: each a
call of torch's builtin with its argument tuple assembled in C, so a step
costs about what eager's call of the op costs (W1, 32 ops at n=100: 0.96-1.06x
eager, where TorchScript's interpreter reaches 1.12-1.23x).
Results are eager's, call for call: each node's program
(fastlazy.node_program) inlined, one step per aten call, as TorchScript
inlines it, with the in-place variants the torchscript backend uses where
an intermediate nobody else reads may take the result.  With one
exception:

A linear layer on one row of float32 (batch-1 inference), followed or not by
a relu, runs fastlazy's own kernel (fastlazy/small_linear.h), which is about
twice as fast as torch's BLAS call for that shape and applies the relu in the
same pass.  It accumulates in a different order, so it agrees with eager to
rounding, as another BLAS would.  Graphs that build autograd history never
take it.
"""
from __future__ import annotations

import math

import torch

from fastlazy import _steps
from fastlazy.backends.base import (REFS, Backend, Input, Program, Sizes, Value,
                                    argument_reader, as_written, builtin, resolve, reusable,
                                    run_key, written_form)


_to = torch._C.TensorBase.to
_detach = torch._C.TensorBase.detach


class NativeBackend(Backend):
    name = "native"

    def compile(self, view) -> Program:
        return Program([s.position for s in view.slots], build(view), False, str(view))


def _recorded_shapes(view):
    """{('slot' | 'node', index): shape} of the view's tensor inputs and
    nodes, as recorded."""
    shapes = {("slot", s.index): tuple(s.value.shape) for s in view.slots if s.kind == "tensor"}
    shapes.update((("node", n.index), tuple(n.shape)) for n in view.nodes)
    return shapes


def kernel_steps(view, shape=None):
    """{linear node index: (relu node index or None, keep, recorded shape of
    x)} for the linear layers of `view` the one-row kernel may take
    (float32, CPU, no autograd, a 2-d weight).  The kernel still checks each
    call's sizes: a graph serves every shape of its structure.  keep: the
    step's value is read only as the input row of other kernel steps, so its
    buffer may serve every call (LinearStep).  `shape`: _recorded_shapes(view),
    where the caller has it."""
    if view.grad or not all(s.kind != "tensor" or s.value.is_cpu for s in view.slots):
        return {}
    if shape is None:
        shape = _recorded_shapes(view)
    readers = {}
    for node in view.nodes:
        for inp in set(node.inputs):
            readers.setdefault(inp, []).append(node)
    found = {}
    for node in view.nodes:
        if not _plain(node, "linear") or node.dtype != torch.float32:
            continue
        x, w, b = _linear_operands(node)
        if not (len(shape[x]) >= 1 and len(shape[w]) == 2 and (b is None or len(shape[b]) == 1)):
            continue
        users = readers.get(("node", node.index), [])
        relu = users[0] if len(users) == 1 and not node.is_output else None
        if relu is not None and not (_plain(relu, "relu")
                                     and relu.program.calls[0].args == (Input(0),)):
            relu = None
        found[node.index] = node, relu, shape[x]
    steps = {}
    for index, (node, relu, x_shape) in found.items():
        last = relu or node
        keep = not last.is_output and all(
            n.index in found and n.inputs[0] == ("node", last.index)
            and ("node", last.index) not in n.inputs[1:]
            for n in readers.get(("node", last.index), []))
        steps[index] = (relu.index if relu is not None else None, keep, x_shape)
    return steps


def takes_one_row(view):
    """Are most of `view`'s nodes linear layers recorded on one row that
    the kernel takes (with the ReLUs it fuses)?  The graph cache then runs
    the graph here rather than on an unfused TorchScript graph, which
    cannot call the kernel.  Most, not any: the kernel saves about 5 us a
    layer against TorchScript (W2's MLP at batch 1: 95 against 135 us a
    call), but every other node costs this executor about 3.5 us more than
    TorchScript's interpreter (mobilenet_v3_small, 2 such layers in 156
    nodes: 3.1-3.2 ms a call here, 2.5-2.6 ms on TorchScript; ViT 1.05
    against 0.8 ms), so the layers must be at least half the graph."""
    # each kernel step covers its linear node and at most one ReLU: a graph
    # with too few linear nodes, or too few of them on one row, is answered
    # without finding the steps (a model's graph is asked, at its compile)
    linears = [node for node in view.nodes if _plain(node, "linear")]
    if not linears or 4 * len(linears) < len(view.nodes):
        return False
    shapes = _recorded_shapes(view)
    one_row = sum(1 for node in linears if _one_row(shapes.get(_linear_operands(node)[0], ())))
    if 4 * one_row < len(view.nodes):
        return False
    covered = sum(1 + (relu is not None)
                  for relu, _, x_shape in kernel_steps(view, shapes).values()
                  if _one_row(x_shape))
    return covered > 0 and 2 * covered >= len(view.nodes)


def _one_row(shape):
    """Is a linear layer's x of this shape one row?"""
    return len(shape) >= 1 and math.prod(shape[:-1]) == 1


def _plain(node, name):
    """Is node one call of `name` by name, without a cast or detaching?"""
    return node.program.only_call(name) is not None and not node.cast and not node.detach


def _linear_operands(node):
    """The inputs a linear node reads as x, weight and bias (None: no bias)."""
    return [node.inputs[a.k] if isinstance(a, Input) else None
            for a in node.program.calls[0].args[:3]]


def build(view) -> _steps.StepProgram:
    """The steps of `view`, values numbered inputs first, then what the
    steps compute."""
    where = {("slot", s.index): p for p, s in enumerate(view.slots)}
    count = [len(view.slots)]

    def value():
        count[0] += 1
        return count[0] - 1

    tensor = {("slot", s.index) for s in view.slots if s.kind == "tensor"}
    tensor.update(("node", n.index) for n in view.nodes)
    fused = kernel_steps(view)
    by_index = {n.index: n for n in view.nodes}
    written = as_written(view)
    absorbed = {relu for relu, _, _ in fused.values() if relu is not None}
    steps, reads = [], []
    runs = {}              # base.run_key -> value indices of the program's outputs

    def add(step, inputs):
        steps.append(step)
        reads.append(inputs)

    for node in view.nodes:
        if node.index in absorbed:
            continue
        if node.index in fused:
            relu, keep, x_shape = fused[node.index]
            out = value()
            where[("node", node.index)] = out
            if relu is not None:
                where[("node", relu)] = out
            add(*_linear_step(node, out, relu is not None, keep, len(x_shape), where))
            continue
        key = run_key(node)
        program, inplace = written_form(node, written)
        # a fresh program runs for this node alone: its last call may cast
        cast = (node.dtype if node.cast and program.fresh
                and program.outputs[node.output].k == len(program.calls) - 1 else None)
        if key not in runs:
            inplace = inplace or not view.grad and reusable(node, by_index)
            runs[key] = _program_steps(node, program, where, value, add, inplace, tensor, cast)
        source = runs[key][node.output]
        if node.cast and cast is None:
            out = value()
            add(_steps.CallStep(out, _to, (None, node.dtype), [(0, source)], {}, [], None),
                [source])
            source = out
        where[("node", node.index)] = source
    outputs = tuple(where[("node", i)] for i in view.outputs)
    _set_frees(steps, reads, len(view.slots), set(outputs))
    return _steps.StepProgram(len(view.slots), count[0], steps, outputs)


def _program_steps(node, program, where, value, add, inplace, tensor, cast):
    """A node's program (its own, or base.written_form's) as steps: one
    torch call per aten call (as TorchScript inlines it).  Returns the value
    indices of the program's outputs.  inplace: the one call is the Tensor
    method `<name>_`, which computes into the first operand (an intermediate
    that dies here).  cast: the dtype the last call's result is cast to, or
    None."""
    ins = []
    for inp in node.inputs:
        source = where[inp]
        if node.detach and inp in tensor:
            out = value()
            add(_steps.CallStep(out, _detach, (None,), [(0, source)], {}, [], None), [source])
            source = out
        ins.append(source)
    values = []

    def index(ref):
        # the value index a reference reads
        return ins[ref.k] if type(ref) is Input else values[ref.k]

    calls = program.calls
    for j, call in enumerate(calls):
        out = value()
        fn = getattr(torch._C.TensorBase, call.name + "_") if inplace else call.fn
        add(*_call_step(call, fn, out, index, cast if j == len(calls) - 1 else None))
        values.append(out)
    return [index(o) for o in program.outputs]


def _call_step(call, fn, out, index, cast):
    """One torch call whose arguments are constants or values (a CallStep,
    its argument tuple assembled in C), or a closure where an argument is
    built from values (a list of them, an input's sizes)."""
    if not call.flat:
        def at(ref):
            return Value(index(ref))
        args = [resolve(a, at, Sizes) for a in call.args]
        kwargs = [(name, resolve(a, at, Sizes)) for name, a in call.kwargs]
        return _steps.PyStep(out, _closure(fn, args, kwargs, cast)), _reads(call, index)
    args, holes, kwargs, kwholes = [], [], {}, []
    for pos, a in enumerate(call.args):
        if isinstance(a, REFS):
            holes.append((pos, index(a)))
            a = None
        args.append(a)
    for name, a in call.kwargs:
        if isinstance(a, REFS):
            kwholes.append((name, index(a)))
        elif name not in call.optional:
            # a keyword left at its default is dropped: torch's argument
            # parser takes about 0.3 µs per keyword it is given
            kwargs[name] = a
    inputs = [src for _, src in holes + kwholes]
    return _steps.CallStep(out, fn, tuple(args), holes, kwargs, kwholes, cast), inputs


def _reads(call, index):
    found = []

    def ref(r):
        found.append(index(r))
        return r
    for a in (*call.args, *(a for _, a in call.kwargs)):
        resolve(a, ref, lambda v, count: v)
    return found


def _closure(fn, args, kwargs, cast):
    """values -> fn of the arguments (cast), Value(i) read as values[i]
    (the templates hold no Input: _call_step made them values)."""
    readers = [argument_reader(a) for a in args]
    kwreaders = [(name, argument_reader(a)) for name, a in kwargs]

    def run(values):
        result = fn(*[r(None, values) for r in readers],
                    **{name: r(None, values) for name, r in kwreaders})
        return result if cast is None else result.to(cast)
    return run


def _linear_step(node, out, relu, keep, x_rank, where):
    x, w, b = _linear_operands(node)
    linear, act = builtin("linear"), builtin("relu")
    if relu:
        def fallback(x, w, b):
            return act(linear(x, w, b))
    else:
        fallback = linear
    inputs = [where[x], where[w]] + ([where[b]] if b is not None else [])
    step = _steps.LinearStep(out, where[x], where[w], where[b] if b is not None else -1,
                             _steps.ACT_RELU if relu else _steps.ACT_NONE, fallback, x_rank, keep)
    return step, inputs


def _set_frees(steps, reads, ninputs, outputs):
    """Drop each intermediate after the last step that reads it."""
    last = {}
    for k, inputs in enumerate(reads):
        for i in inputs:
            last[i] = k
    frees = [[] for _ in steps]
    for i, k in last.items():
        if i >= ninputs and i not in outputs:
            frees[k].append(i)
    for step, dropped in zip(steps, frees):
        if dropped:
            step.set_frees(dropped)
