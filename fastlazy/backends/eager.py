"""The eager backend: replays the nodes one torch call at a time.  The
reference the other backends are tested against, the debugging aid behind
FASTLAZY_SYNC=1, and what the inductor backend replays while it compiles.

Each node's lowering expression is turned into a closure once, at compile
time, so a replay costs the torch calls and little else.
"""
from __future__ import annotations

import torch

from fastlazy import failures
from fastlazy.backends.base import Backend, Program, closure


class EagerBackend(Backend):
    name = "eager"

    def compile(self, view, diagnose=False) -> Program:
        """`diagnose`: an exception a node raises gets a note naming its op
        and the line that recorded it (fastlazy.failures; the view's sites
        are those of this recording, so such a program is not cached)."""
        keys = [("slot", s.index) for s in view.slots]
        steps = [(("node", node.index),
                  _generic_closure(node) if node.op.generic else closure(node.op.lower, node),
                  node.dtype if node.cast else None) for node in view.nodes]
        outputs = [("node", i) for i in view.outputs]
        nodes, sites = view.nodes, view.segment_sites

        def run(*inputs):
            env = dict(zip(keys, inputs))
            for k, (key, compute, cast) in enumerate(steps):
                try:
                    value = compute(env)
                except Exception as exc:
                    # a value error (an index out of range): name the op
                    # and the line that recorded it
                    if diagnose:
                        failures.note(exc, nodes[k], sites[k])
                    raise
                env[key] = value if cast is None else value.to(cast)
            return [env[k] for k in outputs]

        return Program([s.position for s in view.slots], run, False, str(view))


def _generic_closure(node):
    """env -> output `node.output` of a generic node's aten program; the
    program runs once per distinct input tuple (its other outputs are
    nodes of their own)."""
    program, inputs, k, detach = node.op.gm, list(node.inputs), node.output, node.detach
    memo = ("generic", node.op.index, tuple(node.inputs))

    def call(env):
        outs = env.get(memo)
        if outs is None:
            args = [env[i] for i in inputs]
            if detach:
                args = [a.detach() for a in args]
            outs = env[memo] = program(*args)
        return outs[k]
    return call
