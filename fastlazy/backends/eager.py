"""The eager backend: replays the nodes one torch call at a time.  The
reference the other backends are tested against, the debugging aid behind
FASTLAZY_SYNC=1, and what the inductor backend replays while it compiles.

Each node's program is turned into a closure once, at compile time, so a
replay costs the torch calls and little else.
"""
from __future__ import annotations

import torch

from fastlazy import failures
from fastlazy.backends.base import (Backend, Program, argument_reader, as_written, run_key,
                                    written_form)


class EagerBackend(Backend):
    name = "eager"

    def compile(self, view, diagnose=False) -> Program:
        """`diagnose`: an exception a node raises gets a note naming its op
        and the line that recorded it (fastlazy.failures; the view's sites
        are those of this recording, so such a program is not cached)."""
        keys = [("slot", s.index) for s in view.slots]
        steps = _steps(view)
        outputs = [("node", i) for i in view.outputs]
        nodes, sites = view.nodes, view.segment_sites

        def run(*inputs):
            env = dict(zip(keys, inputs))
            for k, (key, _, compute, cast) in enumerate(steps):
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

    def replay_tolerant(self, view, inputs):
        """Every output of `view` that does not depend on a failing node,
        computed node by node: (each output's value, or None where it failed
        or read a node that did; the first exception raised, with its note).
        For a graph whose run failed: its other results are eager's."""
        nodes, sites = view.nodes, view.segment_sites
        env = {("slot", s.index): v for s, v in zip(view.slots, inputs)}
        failed, first = set(), None
        for k, (key, reads, compute, cast) in enumerate(_steps(view)):
            if any(i in failed for i in reads):
                failed.add(key)
                continue
            try:
                value = compute(env)
            except Exception as exc:    # noqa: BLE001 - the nodes after it go on
                failures.note(exc, nodes[k], sites[k])
                first = first or exc
                failed.add(key)
                continue
            env[key] = value if cast is None else value.to(cast)
        return [env.get(("node", i)) for i in view.outputs], first


def _steps(view):
    """Per node of `view`, in order: (its env key, the keys it reads, env ->
    its value, the dtype it is cast to or None)."""
    written = as_written(view)
    return [(("node", node.index), node.inputs, _closure(node, *written_form(node, written)),
             node.dtype if node.cast else None) for node in view.nodes]


def _closure(node, program, inplace=False):
    """env -> the node's value: `program`'s output `node.output` (the node's
    program, or base.written_form's).  Nodes that share a run (base.run_key)
    find its outputs in env.  inplace: the program's one call is the Tensor
    method `<name>_` (base.written_form)."""
    inputs, detach, k = node.inputs, node.detach, node.output
    calls = [(getattr(torch._C.TensorBase, call.name + "_") if inplace else call.fn,
              [argument_reader(a) for a in call.args],
              [(name, argument_reader(a)) for name, a in call.kwargs]) for call in program.calls]
    outputs = [argument_reader(o) for o in program.outputs]

    def run(env):
        ins = [env[i] for i in inputs]
        if detach:
            ins = [v.detach() if isinstance(v, torch.Tensor) else v for v in ins]
        values = []
        for fn, args, kwargs in calls:
            values.append(fn(*[a(ins, values) for a in args],
                             **{name: a(ins, values) for name, a in kwargs}))
        return [o(ins, values) for o in outputs]

    key = run_key(node)
    if key == node.index:
        return lambda env: run(env)[k]
    memo = ("run", key)

    def shared(env):
        outs = env.get(memo)
        if outs is None:
            outs = env[memo] = run(env)
        return outs[k]
    return shared

