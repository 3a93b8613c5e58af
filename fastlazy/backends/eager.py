"""The eager backend: replays the nodes one aten call at a time.  The
reference the other backends are tested against, and a debugging aid."""
from __future__ import annotations

import torch

from fastlazy.backends.base import Backend, Program, lower


class EagerBackend(Backend):
    name = "eager"

    def compile(self, view) -> Program:
        nodes = view.nodes
        keys = [("slot", s.index) for s in view.slots]
        outputs = view.outputs

        def run(*inputs):
            env = dict(zip(keys, inputs))
            for node in nodes:
                operand = env.__getitem__
                if node.detach:
                    operand = _detached(env)
                value = lower(node.op.lower, node, operand, _constant, _call)
                if node.cast:
                    value = value.to(node.dtype)
                env[("node", node.index)] = value
            return [env[("node", i)] for i in outputs]

        return Program([s.position for s in view.slots], run, False, str(view))


def _detached(env):
    def operand(inp):
        value = env[inp]
        return value.detach() if isinstance(value, torch.Tensor) else value
    return operand


def _constant(value):
    return value


def _call(name, args, kwargs):
    return getattr(torch.ops.aten, name)(*args, **dict(kwargs))
