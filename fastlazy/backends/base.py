"""What every backend shares: the Program shape and the walk over a row's
lowering expression (fastlazy.optable.Call / Opt / Attr)."""
from __future__ import annotations

import functools
from typing import Callable

import torch

from fastlazy.optable import AttrValue, Call, Opt, TrailingDims


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
        self.source = source       # IR or code text, for fastlazy.debug
        self._first_call = first_call

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


def lower(expr, node, operand: Callable, constant: Callable, call: Callable,
          trailing_dims: Callable = None):
    """Evaluate a row's lowering expression for one node, with the backend's
    own meaning of an operand, a constant, a call and the runtime sizes of
    an input (trailing_dims(value, k))."""
    if isinstance(expr, int):
        return operand(node.operand(expr))
    if isinstance(expr, TrailingDims):
        return trailing_dims(operand(node.operand(expr.index)), node.attr & 15)
    if isinstance(expr, Opt):
        inp = node.operand(expr.index)
        return constant(expr.default) if inp is None else operand(inp)
    if isinstance(expr, AttrValue):
        return constant(expr.value(node))
    if isinstance(expr, Call):
        args = [lower(a, node, operand, constant, call, trailing_dims) for a in expr.args]
        kwargs = [(k, lower(v, node, operand, constant, call, trailing_dims))
                  for k, v in expr.kwargs]
        return call(expr.name, args, kwargs)
    raise TypeError(f"bad lowering expression {expr!r}")


@functools.lru_cache(maxsize=None)
def builtin(name):
    """torch's own builtin for an aten name (torch.add, torch._C._nn.linear,
    ...): never fastlazy's entry point, and much cheaper to call than an
    aten OpOverloadPacket, which matches schemas on every call."""
    for namespace in (torch._C._VariableFunctions, torch._C._nn):
        fn = getattr(namespace, name, None)
        if fn is not None:
            return fn
    return getattr(torch.ops.aten, name)


def reusable(node, by_index):
    """May node compute into its first input's storage?  Only if that input
    is an intermediate read by nobody else, of the result's shape and dtype."""
    expr = node.op.lower
    if (node.op.generic or node.cast or expr.name not in INPLACE_VARIANTS
            or expr.args[0] != 0):
        return False
    kind, index = node.operand(expr.args[0])
    if kind != "node":
        return False
    producer = by_index[index]
    # a generic node's value may be a view of one of its inputs
    # keeps_shape, not the shapes at hand: the graph is reused for every
    # shape of this structure, and a broadcast elsewhere must not write
    # a larger result into the producer
    return (not producer.op.generic and producer.uses == 1 and not producer.is_output
            and node.keeps_shape and producer.dtype == node.dtype)


def _same(inp):
    return inp


def closure(expr, node, where=_same):
    """env -> value of a row's lowering expression for one node; an input
    ('node', i) or ('slot', k) is read at env[where(input)]."""
    if isinstance(expr, Call):
        fn = builtin(expr.name)
        args = [closure(a, node, where) for a in expr.args]
        kwargs = [(k, closure(v, node, where)) for k, v in expr.kwargs]

        def call(env):
            return fn(*[a(env) for a in args], **{k: v(env) for k, v in kwargs})
        return call
    if isinstance(expr, AttrValue):
        return _constant(expr.value(node))
    if isinstance(expr, TrailingDims):
        source, k = closure(expr.index, node, where), node.attr & 15
        return lambda env: list(source(env).shape[-k:])
    inp = node.operand(expr.index if isinstance(expr, Opt) else expr)
    if inp is None:
        return _constant(expr.default)
    inp = where(inp)
    if node.detach:
        def detached(env):
            value = env[inp]
            return value.detach() if isinstance(value, torch.Tensor) else value
        return detached
    return lambda env: env[inp]


def _constant(value):
    return lambda env: value
