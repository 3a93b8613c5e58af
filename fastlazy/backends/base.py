"""What every backend shares: the Program shape and the walk over a row's
lowering expression (fastlazy.optable.Call / Opt / Attr)."""
from __future__ import annotations

from typing import Callable

from fastlazy.optable import Attr, Call, Opt


class Program:
    """A compiled graph: `run(inputs)` with inputs = values of `slots`."""

    def __init__(self, slots, run, source=""):
        self.slots = tuple(slots)
        self.run = run
        self.source = source       # IR or code text, for fastlazy.debug


class Backend:
    name = "base"

    def compile(self, view) -> Program:
        raise NotImplementedError


def lower(expr, node, operand: Callable, constant: Callable, call: Callable):
    """Evaluate a row's lowering expression for one node, with the backend's
    own meaning of an operand, a constant and a call."""
    if isinstance(expr, int):
        return operand(node.operand(expr))
    if isinstance(expr, Opt):
        inp = node.operand(expr.index)
        return constant(expr.default) if inp is None else operand(inp)
    if isinstance(expr, Attr):
        return constant(expr.values[node.attr & 0xFFFF])
    if isinstance(expr, Call):
        args = [lower(a, node, operand, constant, call) for a in expr.args]
        kwargs = [(k, lower(v, node, operand, constant, call)) for k, v in expr.kwargs]
        return call(expr.name, args, kwargs)
    raise TypeError(f"bad lowering expression {expr!r}")
