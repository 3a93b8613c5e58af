"""When a graph fails at a read: eager's exception, naming the op and where
it was recorded.

Errors that depend on values (an index out of range in `embedding`, a
target out of range in `cross_entropy`) cannot be raised at the call that
records the op; they surface when a value is read.  A compiled backend
reports them in its own terms (TorchScript: its IR, about 30 frames), far
from the line the user wrote.  So a failed graph is replayed node by node on
the eager backend, whose failing node raises eager's own exception; a note
then names the op, the line that recorded it (when recording sites are
kept: FASTLAZY_SITES=1 or debug.record_sites(), about a microsecond per
op) and the line that read the value.
"""
from __future__ import annotations

from fastlazy import sites
from fastlazy.graph import GraphView

_NOTED = "_fastlazy_noted"


def note(exc: BaseException, node, recorded_at) -> None:
    """Add to `exc` (raised computing `node`) the note that says which op
    raised it and where it was recorded; once per exception."""
    if getattr(exc, _NOTED, False):
        return
    try:
        setattr(exc, _NOTED, True)
    except AttributeError:
        return                                  # an exception without a __dict__
    shape = "x".join(map(str, node.shape)) or "0-dim"
    where = (f"recorded at {recorded_at}" if recorded_at else
             "recorded at a line fastlazy did not keep: set FASTLAZY_SITES=1 (or call "
             "fastlazy.debug.record_sites()) to have it named here, or FASTLAZY_SYNC=1 "
             "to raise this at the call that records it")
    exc.add_note(f"fastlazy: raised by {_op_name(node)} ({shape} {node.dtype}) {where}; "
                 f"computed when a value was read at {sites.site_of_call()}")


def _op_name(node):
    """The op as the user called it: a generic call's entry point (its
    lowering's name), and for a row that only torch.nn.functional calls
    reach (F.embedding, F.conv2d), that function's name."""
    op = node.op
    name = op.name
    if name.startswith("generic_"):
        return name[len("generic_"):]
    functions = getattr(op, "nn_functions", ())
    if functions and not (op.functions or op.methods or op.inplace):
        return f"F.{functions[0]}"
    return name


def graph_failed(eager, seg, outputs, error):
    """(the exception to raise for the graph of `outputs` that raised
    `error`, each output's value or None) -- the core calls this, with
    `eager` the eager backend bound by the boot.  The graph is replayed node
    by node: the first node that raises gives eager's exception (`error`
    itself where none does: the backend's own failure), and every output
    that does not depend on a failing node gets its value, as eager computed
    it at its call (a write to an input after this must not reach it)."""
    if not isinstance(error, Exception):
        return error, [None] * len(outputs)     # KeyboardInterrupt...
    view = GraphView(seg, outputs)
    order = view.slot_order()
    values, exc = eager.replay_tolerant(view, [seg.inputs[k] for k in order])
    if exc is None or not getattr(exc, _NOTED, False):
        exc = error
    # an input written since its node was recorded: the error the whole
    # graph's run raised stands, and no value is taken from the new contents
    try:
        seg._check_versions(order)
    except Exception:                           # noqa: BLE001 - the run's error stands
        return exc, [None] * len(outputs)
    return exc, values
