"""The native backend: fastlazy's own executor, for kernels TorchScript
cannot call.

The graph becomes steps (fastlazy/_steps.pyx) that a C loop runs: each a
call of torch's builtin with its argument tuple assembled in C, so a step
costs about what eager's call of the op costs (W1, 32 ops at n=100: 0.96-1.06x
eager, where TorchScript's interpreter reaches 1.12-1.23x).
Results are eager's, call for call: the builtins the eager backend replays,
their in-place variants where the torchscript backend uses them (an
intermediate nobody else reads), and a generic node's aten ops inlined, as
TorchScript inlines them.  With one exception:

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
import torch.fx

from fastlazy import _steps
from fastlazy.backends.base import Backend, Program, builtin, closure, reusable
from fastlazy.optable import AttrValue, Opt


_to = torch._C.TensorBase.to
_detach = torch._C.TensorBase.detach


class NativeBackend(Backend):
    name = "native"

    def compile(self, view) -> Program:
        return Program([s.position for s in view.slots], build(view), False, str(view))


def kernel_steps(view):
    """{linear node index: (relu node index or None, keep, recorded shape of
    x)} for the linear layers of `view` the one-row kernel may take
    (float32, CPU, no autograd, a 2-d weight).  The kernel still checks each
    call's sizes: a graph serves every shape of its structure.  keep: the
    step's value is read only as the input row of other kernel steps, so its
    buffer may serve every call (LinearStep)."""
    if view.grad or not all(s.kind != "tensor" or s.value.is_cpu for s in view.slots):
        return {}
    shape = {("slot", s.index): tuple(s.value.shape) for s in view.slots if s.kind == "tensor"}
    shape.update((("node", n.index), tuple(n.shape)) for n in view.nodes)
    readers = {}
    for node in view.nodes:
        for inp in set(node.inputs):
            readers.setdefault(inp, []).append(node)
    found = {}
    for node in view.nodes:
        if not _plain(node, "linear") or node.dtype != torch.float32:
            continue
        x, w, b = (node.operand(k) for k in range(3))
        if not (len(shape[x]) >= 1 and len(shape[w]) == 2 and (b is None or len(shape[b]) == 1)):
            continue
        users = readers.get(("node", node.index), [])
        relu = users[0] if len(users) == 1 and not node.is_output else None
        if relu is not None and not (_plain(relu, "relu") and relu.op.lower.args == (0,)):
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
    """Was a linear layer of `view` recorded on one row that the kernel
    takes?  (The graph cache then runs the graph here rather than on an
    unfused TorchScript graph, which cannot call the kernel.)"""
    return any(math.prod(x_shape[:-1]) == 1 for _, _, x_shape in kernel_steps(view).values())


def _plain(node, name):
    return (not node.op.generic and node.op.lower.name == name and not node.cast
            and not node.detach)


def build(view) -> _steps.StepProgram:
    """The steps of `view`, values numbered inputs first, then nodes."""
    where = {("slot", s.index): p for p, s in enumerate(view.slots)}

    def value(key):
        where[key] = len(where)
        return where[key]

    fused = kernel_steps(view)
    by_index = {n.index: n for n in view.nodes}
    absorbed = {relu for relu, _, _ in fused.values() if relu is not None}
    steps, reads = [], []
    generic_memo = {}      # (lowering, inputs) -> value index of its output tuple
    for node in view.nodes:
        if node.index in absorbed:
            continue
        if node.index in fused:
            relu, keep, x_shape = fused[node.index]
            out = value(("node", node.index if relu is None else relu))
            if relu is not None:
                where[("node", node.index)] = out
            step, inputs = _linear_step(node, out, relu is not None, keep, len(x_shape), where)
        elif node.op.generic:
            key = (node.op.index, node.inputs)
            if key not in generic_memo:
                generic_memo[key] = _generic_steps(node, where, value, steps, reads)
            source = generic_memo[key][node.output]
            if not node.cast:
                where[("node", node.index)] = source
                continue
            out = value(("node", node.index))
            step = _steps.CallStep(out, _to, (None, node.dtype), [(0, source)], {}, [], None)
            inputs = [source]
        else:
            out = value(("node", node.index))
            inplace = not view.grad and reusable(node, by_index)
            step, inputs = _call_step(node, out, where, inplace)
        steps.append(step)
        reads.append(inputs)
    outputs = tuple(where[("node", i)] for i in view.outputs)
    _set_frees(steps, reads, len(view.slots), set(outputs))
    return _steps.StepProgram(len(view.slots), len(where), steps, outputs)


def _call_step(node, out, where, inplace):
    """One torch call, or a closure where the lowering is more than one.
    inplace: call the Tensor method `<name>_`, which computes into the first
    operand (an intermediate that dies here)."""
    expr = node.op.lower
    cast = node.dtype if node.cast else None
    if node.detach or not all(_flat(a) for a in (*expr.args, *(v for _, v in expr.kwargs))):
        compute = closure(expr, node, where.__getitem__)
        if cast is not None:
            def compute(values, inner=compute):
                return inner(values).to(cast)
        return _steps.PyStep(out, compute), [where[i] for i in node.inputs]
    args, holes, kwargs, kwholes = [], [], {}, []
    for pos, a in enumerate(expr.args):
        args.append(_argument(a, node, where, lambda src, pos=pos: holes.append((pos, src))))
    for name, a in expr.kwargs:
        kwargs[name] = _argument(a, node, where, lambda src, name=name: kwholes.append((name, src)))
        # a keyword left at its default (an absent optional operand, or None
        # for an optional argument) is dropped: torch's argument parser
        # takes about 0.3 µs per keyword it is given.  (A hole's placeholder
        # is None too: the call fills it from kwholes.)
        if kwargs[name] is None or (isinstance(a, Opt) and node.operand(a.index) is None):
            del kwargs[name]
    inputs = [src for _, src in holes + kwholes]
    fn = getattr(torch._C.TensorBase, expr.name + "_") if inplace else builtin(expr.name)
    return _steps.CallStep(out, fn, tuple(args), holes, kwargs, kwholes, cast), inputs


def _flat(expr):
    return isinstance(expr, (int, Opt, AttrValue))


def _argument(expr, node, where, hole):
    """The constant of an argument, or None after registering it as a hole."""
    if isinstance(expr, AttrValue):
        return expr.value(node)
    inp = node.operand(expr.index if isinstance(expr, Opt) else expr)
    if inp is None:
        return expr.default
    hole(where[inp])
    return None


def _generic_steps(node, where, value, steps, reads):
    """A generic node's aten program inlined as steps (as TorchScript
    inlines it): one torch call per aten op, no GraphModule call.  Returns
    the value indices of the program's outputs."""
    fx_values = {}
    for fx, inp in zip(node.op.placeholders, node.inputs):
        fx_values[fx] = where[inp]
        if node.detach:
            out = value(("detached", node.op.index, node.inputs, fx.name))
            steps.append(_steps.CallStep(out, _detach, (None,), [(0, fx_values[fx])], {}, [], None))
            reads.append([fx_values[fx]])
            fx_values[fx] = out
    for fx in node.op.gm.graph.nodes:
        if fx.op != "call_function":
            continue
        out = fx_values[fx] = value(("fx", node.op.index, node.inputs, fx.name))
        if any(_holds_values(a) for a in (*fx.args, *fx.kwargs.values())):
            # a list of values as an argument (cat's tensors): a closure
            steps.append(_steps.PyStep(out, _fx_closure(fx, fx_values)))
            reads.append([fx_values[n] for n in fx.all_input_nodes])
            continue
        holes = [(pos, fx_values[a]) for pos, a in enumerate(fx.args) if isinstance(a, torch.fx.Node)]
        kwholes = [(name, fx_values[a]) for name, a in fx.kwargs.items()
                   if isinstance(a, torch.fx.Node)]
        args = tuple(None if isinstance(a, torch.fx.Node) else a for a in fx.args)
        kwargs = {name: a for name, a in fx.kwargs.items() if not isinstance(a, torch.fx.Node)}
        fn = getattr(fx.target, "_op", fx.target)     # an OpOverload's own builtin
        steps.append(_steps.CallStep(out, fn, args, holes, kwargs, kwholes, None))
        reads.append([src for _, src in holes + kwholes])
    return [fx_values[o] for o in node.op.outputs]


def _holds_values(a):
    return isinstance(a, (list, tuple)) and any(isinstance(v, torch.fx.Node) for v in a)


def _fx_closure(fx, fx_values):
    fn = fx.target

    def resolve(a, values):
        if isinstance(a, torch.fx.Node):
            return values[fx_values[a]]
        if isinstance(a, (list, tuple)):
            return type(a)(resolve(v, values) for v in a)
        return a

    def run(values):
        return fn(*resolve(fx.args, values), **{k: resolve(v, values) for k, v in fx.kwargs.items()})
    return run


def _linear_step(node, out, relu, keep, x_rank, where):
    x, w, b = (node.operand(k) for k in range(3))
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
