"""Looking inside: the pending graph, compiled graphs, Graphviz dumps.

Set FASTLAZY_SYNC=1 to run every op at its call (eager backend, flush after
each node): a wrong result or an error then points at the op that made it.
"""
from __future__ import annotations

from fastlazy import _core
from fastlazy._core import LazyTensor
from fastlazy.graph import GraphView


def _tensors(tensors):
    """A list of tensors: one LazyTensor is taken as itself (iterating over
    it would compute it and give its rows)."""
    if tensors is None or type(tensors) is LazyTensor:
        return tensors if tensors is None else [tensors]
    return list(tensors)


def _view(tensors=None):
    """The GraphView of the pending nodes the given tensors need (all live
    tensors when None)."""
    seg = _core.current()
    tensors = _tensors(tensors)
    if tensors is None:
        return GraphView(seg, seg.live())
    outs = []
    for t in tensors:
        pending = _core.pending_in(t) if type(t) is LazyTensor else None
        if pending is not None and pending[0] is seg:
            outs.append(pending[1])
    return GraphView(seg, sorted(set(outs)))


def pending_graph(tensors=None) -> str:
    """The nodes waiting in the buffer (for `tensors` -- one LazyTensor or a
    list -- or all live ones), as text: one line per node with its op,
    inputs, dtype and shape.  Empty when nothing is pending."""
    return str(_view(tensors))


def compiled_graph(tensor: LazyTensor) -> str:
    """The TorchScript IR or inductor FX code that computed `tensor`."""
    if type(tensor) is not LazyTensor:
        raise TypeError("compiled_graph() takes a LazyTensor")
    if tensor.program is None:
        if _core.pending_in(tensor) is not None:
            raise ValueError("this LazyTensor is not computed yet: read its value "
                             "(or call fastlazy.mark_step()) first")
        raise ValueError("this LazyTensor was not computed by a graph (it wraps an "
                         "eager tensor or came from an eager fallback)")
    return tensor.program.source


def to_dot(tensors=None) -> str:
    """The pending graph in Graphviz dot format."""
    view = _view(tensors)
    lines = ["digraph fastlazy {", "  rankdir=TB;", "  node [shape=box, fontname=monospace];"]
    for s in view.slots:
        label = s.kind if s.kind != "tensor" else f"{tuple(s.value.shape)} {s.value.dtype}"
        lines.append(f'  s{s.index} [label="input {s.index}\\n{label}", shape=ellipse];')
    for n in view.nodes:
        style = ", style=bold" if n.is_output else ""
        dtype = str(n.dtype).replace("torch.", "")
        lines.append(f'  n{n.index} [label="{n.op.name}\\n{dtype} {list(n.shape)}"{style}];')
        for kind, r in n.inputs:
            lines.append(f"  {'n' if kind == 'node' else 's'}{r} -> n{n.index};")
    lines.append("}")
    return "\n".join(lines)


def record_sites(on: bool = True) -> None:
    """Keep the file:line that recorded each node (about a microsecond per
    op; FASTLAZY_SITES=1 does it from the start): an error raised when a
    value is read (an index out of range) then names the line that recorded
    the op that raised it, and recompiles name where graphs diverge.  Takes
    effect from the next graph recorded (after the next mark_step() or
    read)."""
    _core.set_record_sites(on)


# torch._lazy.debug names

def dump_ir(tensors, ir_format: str) -> str:
    """torch._lazy.debug.dump_ir: "text" is the pending graph of `tensors`
    (one LazyTensor or a list), nothing computed; "backend" is the code the
    active backend generates for it (compiled, not run) -- for tensors
    already computed, the code that computed them."""
    if ir_format not in ("text", "backend"):
        raise ValueError(f'dump_ir format must be "text" or "backend", not {ir_format!r}')
    if ir_format == "text":
        return pending_graph(tensors)
    view = _view(tensors)
    if view.nodes:
        from fastlazy import graph_cache
        return graph_cache.active_backend().compile(view).source
    done = [t for t in _tensors(tensors) or () if type(t) is LazyTensor and t.program is not None]
    if not done:
        raise ValueError("dump_ir(tensors, 'backend'): nothing to compile -- no LazyTensor "
                         "given is pending or was computed by a graph (pass LazyTensors "
                         "before reading their values)")
    return "\n".join(dict.fromkeys(t.program.source for t in done))


def render_ir_graph(tensors) -> str:
    """torch._lazy.debug.render_ir_graph: the graph of `tensors` as dot."""
    return to_dot(tensors)


__all__ = ["pending_graph", "compiled_graph", "to_dot", "record_sites", "dump_ir",
           "render_ir_graph"]
