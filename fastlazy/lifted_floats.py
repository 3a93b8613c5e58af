"""Python floats of generic calls as inputs of the program, once they vary.

A generic call's signature holds every argument's value (fastlazy.generic),
and its program has each Python float baked in: `x.masked_fill(m, v)`,
`torch.where(c, x, v)`, `torch.lerp(a, b, w)`, `torch.full_like(x, v)` with
a v that changes every call were a new signature, a new analysis and a new
graph structure -- a compile -- every call.

So once one signature has been met with two different values of some of
its floats (the *loose* key: the signature with its floats erased) in two
graphs -- a value that changes from one call of the program to the next
-- its call is traced once more with those floats symbolic (SymFloats of
a shape environment that holds nothing else: tensor sizes stay static).
If the floats reach the aten program only as arguments -- the shape
environment recorded no guard on any of them: no Python or C++ code
branched on, or specialized, a value -- the program takes them as
inputs, and every later call of the loose signature is recorded from it,
its floats appended to the node's inputs as scalar slots, with no
analysis and the same graph structure whatever the values.  Where a
guard was recorded (F.pad's and layer_norm's values reach a `float` or
`double` in C++; dropout checks 0 <= p <= 1) the values stay baked in,
as before.

Values met within one graph are constants of the model's code, not values
that vary: swin_t's attention mask is filled with -100.0 at one call and
0.0 at the next, the same two every call, and lifting them (a symbolic
trace: 7-10 ms each) had cost its first call 20 of its 90 ms.  Such values
stay baked in, each its own exact signature, until the key meets a new
value in a later graph, or SAME_GRAPH_VALUES different ones in one graph
(a loop over values before any flush).

A value eager would refuse is left to the exact path, whose analysis runs
the call and raises eager's error: lifted values must be NaN, infinite,
or within the range of the narrowest floating dtype among the call's
tensors and results, and the results must be floating (a float filled
into an integer tensor may overflow).
"""
from __future__ import annotations

import math
import threading

import torch
import torch.fx

from fastlazy import _core, capture, host_checks, views
from fastlazy._core import LazyTensor
from fastlazy.capture import Unsafe

MAX_LOOSE = 4096          # loose signatures remembered before starting over
SAME_GRAPH_VALUES = 3     # values of a loose key in one graph before they are lifted


class Lifted:
    """A loose signature's program with some floats as inputs: `sig` (the
    exact Signature it was made beside, its lowering replaced), which float
    positions are inputs, the values of the others, and the bound on
    values (`limit`), and the conditions code checked of them (`guards`:
    functions of the lifted values) that must hold."""
    __slots__ = ("sig", "positions", "fixed", "limit", "guards")

    def __init__(self, sig, positions, fixed, limit, guards):
        self.sig = sig
        self.positions = positions
        self.fixed = fixed
        self.limit = limit
        self.guards = guards

    def takes(self, hexes):
        """The floats to append as inputs, or None where this program does
        not take the call's values (`hexes`: as loose_key gives them)."""
        for k, v in self.fixed:
            if hexes[k] != v:
                return None
        lifted = tuple([float.fromhex(hexes[k]) for k in self.positions])
        for v in lifted:
            if abs(v) > self.limit and math.isfinite(v):
                return None
        for guard in self.guards:
            try:
                if not guard(*lifted):
                    return None
            except Exception:       # noqa: BLE001 - the exact path judges the call
                return None
        return lifted


_lock = threading.Lock()
# loose key -> the _Met values so far, or a Lifted, or None where lifting
# was refused
_loose: dict = {}


class _Met:
    """A loose key's values so far: the first call's floats (hex strings),
    the flush count when they were met, and the different value tuples
    met since."""
    __slots__ = ("hexes", "flushes", "values")

    def __init__(self, hexes, flushes):
        self.hexes = hexes
        self.flushes = flushes
        self.values = {tuple(hexes)}

    def varies(self, hexes, flushes) -> bool:
        """Met with `hexes` now: do the values vary from call to call (a
        new value after a flush), or are there too many to keep baked in?"""
        self.values.add(tuple(hexes))
        return flushes != self.flushes or len(self.values) >= SAME_GRAPH_VALUES


def _flushes() -> int:
    return _core.counter_values()["flushes"]


def forget():
    with _lock:
        _loose.clear()


def loose_key(key):
    """(the signature key with its floats erased, their values as hex
    strings) -- None for a key without floats.  signature_key writes a
    float as (float, its hex)."""
    parts = key[1]
    floats = [p[1] for p in parts if type(p) is tuple and len(p) == 2 and p[0] is float]
    if not floats:
        return None
    loose = tuple([_FLOAT if type(p) is tuple and len(p) == 2 and p[0] is float else p
                   for p in parts])
    return (key[0], loose) + key[2:], floats


_FLOAT = (float,)


def match(loose):
    """The Lifted program of a loose key, if one was made."""
    entry = _loose.get(loose)
    return entry if type(entry) is Lifted else None


def observe(loose, hexes, func, args, kwargs, tensors, sig, lower):
    """A call of loose signature `loose` was analysed exactly (`sig`).  If
    an earlier one had other values, try to lift the floats that differ:
    the Lifted made (its lowering interned by `lower`), else None."""
    flushes = _flushes()
    with _lock:
        met = _loose.get(loose, _MISSING)
        if met is _MISSING:
            if len(_loose) >= MAX_LOOSE:
                _loose.clear()
            _loose[loose] = _Met(hexes, flushes)
            return None
        if type(met) is not _Met or met.hexes == hexes or not met.varies(hexes, flushes):
            return None
        first = met.hexes
    positions = tuple(k for k, (a, b) in enumerate(zip(first, hexes)) if a != b)
    held = _core.hold_pending()         # (as capture.analyse: no flush meanwhile)
    try:
        lifted = _lift(func, args, kwargs, tensors, sig, positions, hexes, lower)
    except Exception:       # noqa: BLE001 - any failure leaves the exact path alone
        lifted = None
    finally:
        _core.release_pending(held)
    with _lock:
        _loose[loose] = lifted
    return lifted


_MISSING = object()


def _lift(func, args, kwargs, tensors, sig, positions, hexes, lower):
    """The Lifted program of the call, its floats at `positions` inputs;
    Unsafe where they cannot be."""
    if sig.reason is not None or sig.nested or sig.constants or sig.draws or not sig.recorded:
        raise Unsafe("not a recorded program of tensors alone")
    dtypes = [t.dtype for t in tensors] + [r[1] for r in sig.recorded]
    if not all(d.is_floating_point or d.is_complex for d in (r[1] for r in sig.recorded)):
        raise Unsafe("a result that is not floating")
    limit = min(torch.finfo(d).max for d in dtypes if d.is_floating_point or d.is_complex)
    floats = [float.fromhex(h) for h in hexes]
    if isinstance(func, torch._ops.OpOverload):
        gm, guards = _op_program(func, args, kwargs, sig, floats, positions), ()
    else:
        gm, guards = _symbolic_trace(func, args, kwargs, tensors, floats, positions)
    outputs = list(gm.graph.nodes)[-1].args[0]
    if len(outputs) != len(sig.recorded) + sum(1 for kind in sig.kinds if kind[0] == "input"):
        raise Unsafe("the symbolic program's outputs differ from the call's")
    lifted_sig = capture.Signature()
    for name in capture.Signature.__slots__:
        setattr(lifted_sig, name, getattr(sig, name))
    lifted_sig.lowering = lower(gm)
    fixed = tuple((k, hexes[k]) for k in range(len(hexes)) if k not in positions)
    return Lifted(lifted_sig, positions, fixed, limit, guards)


def _without_user_frames(env):
    """A ShapeEnv notes for each symbol and guard the user's frame that
    made it (for its messages), walking the stack past the files of
    torch's own tracing machinery -- whose list, made once per process,
    imports torch.export and dynamo: 270 ms of the first lift in a process
    (swin_t's first call).  The symbols here are fastlazy's, made in this
    module: no user frame to note.  (Where a torch has no such method,
    nothing changes.)"""
    if hasattr(env, "_get_user_frame"):
        env._get_user_frame = lambda: None


def _symbolic_trace(func, args, kwargs, tensors, floats, positions):
    """(make_fx's program of the call with the floats at `positions` as
    SymFloats, placeholders after the tensors'; the conditions on their
    values the code checked, as functions of them).  Unsafe where code
    specialized a value (asked if it equals a number) or the program is not
    a pure aten program."""
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    _without_user_frames(env)
    symbols = []
    for n, k in enumerate(positions):
        source = ConstantSource(f"lifted_float{n}")
        symbol = env.create_unspecified_symbol(floats[k], source=source)
        symbols.append(env.create_symfloatnode(symbol, hint=floats[k], source=source))

    def program(*values):
        ts, fs = values[:len(tensors)], iter(values[len(tensors):])
        given = iter([next(fs) if k in positions else v for k, v in enumerate(floats)])
        a, kw = capture.substitute((args, kwargs), iter(ts), given)
        return func(*a, **kw)
    if getattr(func, "functionalize", False):
        program = torch.func.functionalize(program)
    try:
        with capture.quiet_fake_log(), FakeTensorMode(shape_env=env, static_shapes=True) as mode:
            fakes = [mode.from_tensor(capture.example_of(t)) for t in tensors]
            gm = make_fx(program, tracing_mode="real")(*fakes, *symbols)
    except Exception as exc:        # noqa: BLE001 - the exact path judges the call
        raise Unsafe(f"not traceable with symbolic floats ({type(exc).__name__})") from None
    guards = tuple(_guard(env, guard.expr, symbols) for guard in env.guards)
    for guard in guards:
        # (one that names a function of torch's sympy extensions math lacks:
        # vector_norm's `ord % 2`, PythonMod)
        try:
            guard(*[floats[k] for k in positions])
        except Exception:       # noqa: BLE001
            raise Unsafe("a condition on the floats that cannot be evaluated") from None
    # (functionalize leaves dead copies of what it saw behind: not the program)
    gm.graph.eliminate_dead_code()
    if any(node.op == "get_attr" for node in gm.graph.nodes):
        raise Unsafe("the program reads a constant tensor")
    contiguous = [type(t) is LazyTensor and views.traced_contiguous(t) for t in tensors]
    gm = capture.checked(gm, contiguous)
    host_checks.keep_argument_checks(func, args, kwargs, gm.graph)
    gm.recompile()
    return gm, guards


def _guard(env, expr, symbols):
    """A condition the traced code checked of the symbolic floats, as a
    function of their values (hardtanh's min <= max); Unsafe for one that
    pins a float to a value."""
    import sympy
    if isinstance(expr, sympy.Eq) and any(arg.is_number for arg in expr.args):
        raise Unsafe("code specialized a float's value")
    return sympy.lambdify([s.node.expr for s in symbols], expr, modules="math")


def _op_program(op, args, kwargs, sig, floats, positions):
    """An aten op's program with its float arguments at `positions` made
    inputs.  The op receives them with no code in between (a SymFloat trace
    would pin them: a schema's `float` argument takes no symbol), so the
    exact program's one call of the op takes the placeholders instead of
    the floats it was traced with."""
    if kwargs or any(type(a) in (list, tuple, dict, slice) for a in args):
        raise Unsafe("float arguments inside containers")
    at = [i for i, a in enumerate(args) if type(a) is float]
    graph = torch.fx.Graph()
    copies = {}
    for node in sig.lowering.gm.graph.nodes:
        copies[node] = graph.node_copy(node, copies.__getitem__)
    calls = [n for n in graph.nodes if n.op == "call_function" and n.target is op]
    if len(calls) != 1:
        raise Unsafe("the program is not one call of the op")
    call = calls[0]
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    made = list(call.args)
    for n, k in enumerate(positions):
        i = at[k]
        if i >= len(made) or type(made[i]) is not float or made[i].hex() != floats[k].hex():
            raise Unsafe("the op's program does not take the float as given")
        with graph.inserting_after(placeholders[-1]):
            placeholders.append(graph.placeholder(f"lifted_float{n}"))
        made[i] = placeholders[-1]
    call.args = tuple(made)
    return capture.CapturedProgram(graph)
