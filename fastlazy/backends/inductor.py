"""The inductor backend: the graph as an aten-level FX graph compiled by
torch inductor -- the fused path on CPU (C++/OpenMP kernels) and on CUDA
(Triton kernels).

Shape policy: a graph is compiled for the exact input shapes first; once one
graph structure has met `dynamic_after` distinct input shapes it is compiled
once more with dynamic shapes, and that version serves every later shape, so
a loop over variable sequence lengths stops compiling.

Python scalars are graph inputs (0-dim tensors), never constants, so a new
scalar value never recompiles.  Each scalar is cast to the dtype eager would
compute the op in (torch.result_type of the op's operands), which keeps the
result dtypes of eager's scalar promotion.
"""
from __future__ import annotations

import os
import time

import torch
import torch.fx

from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

from fastlazy import stats
from fastlazy.backends.base import Backend, Program, lower

DEFAULT_PROMOTION = ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT
_SCALAR_DTYPES = {"bool": torch.bool, "int": torch.int64, "float": torch.float64,
                  "complex": torch.complex128}


class InductorBackend(Backend):
    name = "inductor"

    def __init__(self):
        self.dynamic_after = int(os.environ.get("FASTLAZY_DYNAMIC_AFTER", "3"))

    def compile(self, view) -> Program:
        gm, scalar_kinds = _build_fx(view)
        dispatch = _ShapeDispatch(gm, scalar_kinds, self)
        return Program([s.index for s in view.slots], dispatch, False, gm.code)


class _ShapeDispatch:
    """Compiled versions of one graph structure, by input shapes."""

    def __init__(self, gm, scalar_kinds, backend):
        self.gm = gm
        self.scalar_kinds = scalar_kinds      # per input: None (tensor) or a kind
        self.backend = backend
        self.by_shape = {}
        self.dynamic = None

    def __call__(self, *inputs):
        args = [v if kind is None else torch.tensor(v, dtype=_SCALAR_DTYPES[kind])
                for v, kind in zip(inputs, self.scalar_kinds)]
        if self.dynamic is not None:
            return self.dynamic(*args)
        shapes = tuple(a.shape for a in args)
        fn = self.by_shape.get(shapes)
        if fn is None:
            if len(self.by_shape) >= self.backend.dynamic_after:
                self.dynamic = self._compile(args, dynamic=True)
                stats.count_recompile("inductor: dynamic shapes")
                return self.dynamic(*args)
            if self.by_shape:
                stats.count_recompile("inductor: new input shape")
            fn = self.by_shape[shapes] = self._compile(args, dynamic=False)
        return fn(*args)

    def _compile(self, args, dynamic):
        compiled = torch.compile(self.gm, backend="inductor", dynamic=dynamic, fullgraph=True)
        start = time.perf_counter()
        compiled(*args)             # compile now, so the time is attributed here
        stats.add_compile_time(time.perf_counter() - start)
        return compiled


def _example(node_or_slot):
    """A one-element tensor of the operand's dtype and rank, or the scalar."""
    dtype, ndim, scalar = node_or_slot
    if scalar is not None:
        return scalar
    return torch.zeros((1,) * ndim, dtype=dtype)


def _build_fx(view):
    graph = torch.fx.Graph()
    env = {}
    meta = {}                       # ('node'|'slot', i) -> (dtype, ndim, scalar)
    scalar_kinds = []
    for s in view.slots:
        env[("slot", s.index)] = graph.placeholder(f"x{s.index}")
        if s.kind == "tensor":
            meta[("slot", s.index)] = (s.value.dtype, s.value.dim(), None)
            scalar_kinds.append(None)
        else:
            meta[("slot", s.index)] = (None, 0, s.value)
            scalar_kinds.append(s.kind)
    casts = {}
    for node in view.nodes:
        common = _common_dtype(node, meta)

        def operand(inp, common=common, detach=node.detach):
            value = env[inp]
            if meta[inp][2] is None and detach:
                return graph.call_function(torch.ops.aten.detach.default, (value,))
            if meta[inp][2] is None or common is None:
                return value
            key = (inp, common)
            if key not in casts:
                casts[key] = graph.call_function(
                    torch.ops.aten._to_copy.default, (value,), {"dtype": common})
            return casts[key]

        def call(name, args, kwargs):
            kwargs = dict(kwargs)
            alpha = kwargs.get("alpha")
            if isinstance(alpha, torch.fx.Node):
                # alpha must be a Python number in aten; as a graph input it
                # becomes a multiply
                del kwargs["alpha"]
                args = [args[0], graph.call_function(torch.ops.aten.mul, (args[1], alpha))]
            return graph.call_function(getattr(torch.ops.aten, name), tuple(args), kwargs)

        value = lower(node.op.lower, node, operand, _constant, call)
        if node.cast:
            value = graph.call_function(torch.ops.aten._to_copy.default, (value,),
                                        {"dtype": node.dtype})
        env[("node", node.index)] = value
        meta[("node", node.index)] = (node.dtype, len(node.shape), None)
    graph.output(tuple(env[("node", i)] for i in view.outputs))
    return torch.fx.GraphModule(torch.nn.Module(), graph), scalar_kinds


def _constant(value):
    return value


def _common_dtype(node, meta):
    """The dtype eager computes `node` in, if a Python scalar takes part."""
    params = node.op.params
    operands = []
    has_scalar = False
    for position, name in enumerate(params[: node.op.noperands or len(params)]):
        if name == "alpha":
            continue
        inp = node.operand(position)
        if inp is None:
            continue
        operands.append(_example(meta[inp]))
        has_scalar = has_scalar or meta[inp][2] is not None
    if not has_scalar:
        return None
    # N operands, Python scalars included, with eager's category rules
    return elementwise_dtypes(*operands, type_promotion_kind=DEFAULT_PROMOTION)[1]
