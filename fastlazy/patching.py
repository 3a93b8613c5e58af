"""enable() / disable(): install the op table's entry points into torch.

The entry points are listed here (entry_points(), and the in-place methods
without a row); LazyTensor's own methods, made from the same list, are
installed by tensor_methods.py.

Each patch remembers the object it replaced and whether the owner held it in
its own __dict__ (Tensor.__add__ is inherited from TensorBase), so disable()
puts back the identical object -- or removes our attribute -- and leaves
alone any attribute that someone else has patched since.

enable() after disable() installs the entries the last enable() made, unless
one of the attributes they replace holds another object now (then all are
made anew): the same objects, with their caches, for a `with
fastlazy.enable():` around each step.
"""
from __future__ import annotations

import inspect
import functools
import itertools
import pathlib
import threading

import torch

from fastlazy import (_core, autograd_calls, conversions, defaults, fast_paths, python_bodies,
                      value_calls, watch)
from fastlazy.optable import OPS

FORM_CALL, FORM_INPLACE = _core.Form.FORM_CALL, _core.Form.FORM_INPLACE
_MISSING = object()
# Re-entrant: a finalizer run by an allocation inside the lock may call
# back into fastlazy (read a LazyTensor: a flush) on this very thread.
_lock = threading.RLock()
_installed: list = []     # (owner, attr, original, own_attr, entry)


def _inplace_methods():
    """Every other Tensor method that writes into self (name ending in "_",
    operators like __iand__, __setitem__).  They get an entry without a row:
    with no lazy argument it computes, before the write, the pending nodes
    that may read the tensor being written (see csrc/_entry.h); with one the
    call takes the generic path, which records a LazyTensor self's write
    functionalized and runs anything else eagerly."""
    table = {attr for op in OPS for attr in op.methods + op.inplace}
    for name in sorted(dir(torch.Tensor)):
        if name in table:
            continue
        mutates = (name.endswith("_") and not name.startswith("_")
                   or name in ("__setitem__", "__iand__", "__ior__", "__ixor__",
                               "__ilshift__", "__irshift__", "__ifloordiv__", "__imod__",
                               "__imatmul__"))
        if mutates and callable(getattr(torch.Tensor, name, None)):
            yield torch.Tensor, name, -1, FORM_INPLACE


def _unbound_methods():
    """Every other public Tensor method written in C (a method descriptor,
    which refuses a self that is not a tensor): an entry without a row, so
    that `torch.Tensor.item(x)` called unbound on a LazyTensor works as
    `x.item()` does.  Without a lazy argument the entry forwards the call
    untouched (one more C call).  Methods written in Python take any self
    and need none."""
    table = {attr for op in OPS for attr in op.methods + op.inplace}
    for name in sorted(dir(torch.Tensor)):
        if name.startswith("_") or name.endswith("_") or name in table or name == "to":
            continue
        if type(inspect.getattr_static(torch.Tensor, name)) is _METHOD_DESCRIPTOR:
            yield torch.Tensor, name, -1, FORM_CALL


_METHOD_DESCRIPTOR = type(torch.Tensor.dim)


def entry_points():
    """(owner, attribute, opcode, form) for every entry point in the table."""
    for op in OPS:
        for name in op.functions:
            yield torch, name, op.opcode, FORM_CALL
        for name in op.methods:
            yield torch.Tensor, name, op.opcode, FORM_CALL
        for name in op.inplace:
            yield torch.Tensor, name, op.opcode, FORM_INPLACE
        for name in op.nn_functions:
            yield torch.nn.functional, name, op.opcode, FORM_CALL


def qualname(owner, attr):
    """The name an entry point reports (metrics, explain()): Tensor.add."""
    prefix = {torch: "torch", torch.Tensor: "Tensor", torch.nn.functional: "F"}[owner]
    return f"{prefix}.{attr}"


def enabled() -> bool:
    return bool(_installed)


_dynamo_primed = False


def _prime_dynamo():
    """torch._dynamo records the identity of every torch function when it is
    first imported.  Importing it while our entry points are installed would
    make torch.compile (and the inductor backend) see them instead of torch's
    own functions, so it is imported first (about a second, once).
    fastlazy's own files are among those dynamo never traces: a compiled
    function called with a LazyTensor breaks its graph there (LazyTensor
    is no tensor dynamo traces), and the calls into fastlazy that follow
    run as Python, recording as they would uncompiled.  All but
    inductor_graph.py, whose functions the inductor backend's graphs call
    and dynamo must trace.  Once a process: enable() runs again after
    every disable(), and each addition recompiles the list's pattern."""
    global _dynamo_primed
    if _dynamo_primed:
        return
    import torch._dynamo.trace_rules as rules
    _trace_entries_as_originals()
    _lazy_frames_skipped_alone()
    package = pathlib.Path(__file__).parent
    files = [path.as_posix() for path in sorted(package.glob("*.py"))
             if path.stem not in ("__init__", "inductor_graph")]
    files.append((package / "backends").as_posix() + "/")
    _dynamo_primed = True
    if hasattr(rules, "_recompile_re"):
        # (add() per module recompiles the pattern of every skipped
        # directory each time: 55 ms for fastlazy's files)
        rules.SKIP_DIRS.extend(files)
        rules._recompile_re()
    else:
        for path in files:
            name = pathlib.PurePosixPath(path).relative_to(package.parent.as_posix())
            rules.add(".".join(name.with_suffix("").parts))


def _trace_entries_as_originals():
    """While fastlazy is enabled, the torch functions user code calls are
    its entry points and guards: dynamo would break the graph of a compiled
    function at each (an object it cannot trace).  Their types are wrapped by
    dynamo's builder as it wraps a TorchScript function: the object's
    `_torchdynamo_inline`, the original function, is what it traces (and
    it guards on the object's type).  Where this torch's dynamo has no such
    table, compiled code breaks its graph at the entries, as before."""
    from torch._dynamo.variables.builder import VariableBuilder
    table = getattr(VariableBuilder, "_type_dispatch_impl", None)
    wrap = getattr(VariableBuilder, "wrap_jit_function", None)
    if table is None or wrap is None:
        return
    for trace_numpy in (False, True):
        table(trace_numpy)[_core.ENTRY_TYPE] = wrap
        table(trace_numpy)[_core.GUARD_TYPE] = wrap
        table(trace_numpy)[_core.LazyTensor] = _skip_frame


def _skip_frame(builder, value):
    """Dynamo's builder met a LazyTensor (an argument of the frame, a
    module's lazy parameter): the frame runs as Python, uncompiled, and
    records lazily.  Traced, a LazyTensor would be an object of unknown
    type whose methods dynamo calls unbound (`x.view(-1)` as
    `TensorBase.view(-1)`).  Frames it calls are judged again, each alone."""
    from torch._dynamo.exc import unimplemented
    unimplemented(gb_type="fastlazy LazyTensor", context=type(value).__name__,
                  explanation="a LazyTensor is recorded by fastlazy, not traced: the frame "
                              "runs uncompiled",
                  hints=[], skip_frame=True)


def _lazy_frames_skipped_alone():
    """A compiled function or module called with a LazyTensor argument runs
    uncompiled, that call alone: dynamo's frame callback is answered before
    it traces, with a skip that is not kept for the frame's code.  The
    builder's refusal (_skip_frame, for a LazyTensor found deeper: a
    module's lazy parameter) makes dynamo skip the code for good, and every
    other compiled nn.Linear or Sequential -- the same code -- then ran
    uncompiled, eager tensors or not (fullgraph=True raised).  Where this
    torch's dynamo has no such answer, the builder's refusal stands."""
    try:
        from torch._dynamo import convert_frame
        from torch._dynamo.types import ConvertFrameReturn, FrameAction, FrameExecStrategy
    except ImportError:
        return
    wrapper = getattr(convert_frame, "CatchErrorsWrapper", None)
    fields = getattr(ConvertFrameReturn, "__dataclass_fields__", {})
    if wrapper is None or "apply_to_code" not in fields or "skip_reason" not in fields:
        return
    original = wrapper.__call__
    if getattr(original, "fastlazy_frames", False):
        return

    def __call__(self, frame, cache_entry, frame_state, *rest, **kwargs):
        code = frame.f_code
        count = code.co_argcount + code.co_kwonlyargcount \
            + bool(code.co_flags & inspect.CO_VARARGS) \
            + bool(code.co_flags & inspect.CO_VARKEYWORDS)
        if count:
            local = frame.f_locals
            for name in code.co_varnames[:count]:
                if _holds_lazy(local.get(name)):
                    return ConvertFrameReturn(
                        frame_exec_strategy=FrameExecStrategy(FrameAction.SKIP,
                                                              FrameAction.DEFAULT),
                        apply_to_code=False,
                        skip_reason="a LazyTensor argument (fastlazy records the call)")
        return original(self, frame, cache_entry, frame_state, *rest, **kwargs)
    __call__.fastlazy_frames = True
    wrapper.__call__ = __call__


def _holds_lazy(value) -> bool:
    """A LazyTensor, or a tuple, list or dict holding one at its top."""
    kind = type(value)
    if kind is _core.LazyTensor:
        return True
    if kind is tuple or kind is list:
        return any(type(v) is _core.LazyTensor for v in value)
    if kind is dict:
        return any(type(v) is _core.LazyTensor for v in value.values())
    return False


def enable() -> None:
    with _lock:
        if _installed:
            return
        _core.sync_default_dtype()
        _prime_dynamo()
        if _last_rows and _unchanged():
            # torch as the last enable() found it: the same entries again
            # (building them takes ~10 ms, and entries made anew would find
            # cold caches: `with fastlazy.enable():` around each step)
            for owner, attr, original, own, entry in _last_rows:
                setattr(owner, attr, entry)
            _installed.extend(_last_rows)
        else:
            _last_rows.clear()
            _last_expected.clear()
            _install_all()
            _last_rows.extend(_installed)
        _count_open_contexts()


# The rows the last enable() installed, and per owner, per attribute, what
# it held before that enable() patched it first (an attribute patched twice
# -- an entry a conversion wraps -- is checked as it was before the first):
# (the object in the owner's own __dict__ or _MISSING, and for a class's
# inherited attribute the object getattr found, else _MISSING).  A module's
# attribute it does not hold, torch._VF's, comes from a C class's table,
# which nothing rewrites.
_last_rows: list = []
_last_expected: dict = {}


def _unchanged() -> bool:
    """Whether every attribute the last enable() patched holds again what
    it held before (_last_expected)."""
    for owner, expected in _last_expected.items():
        stored = vars(owner)
        for attr, (held, inherited) in expected.items():
            if stored.get(attr, _MISSING) is not held:
                return False
            if inherited is not _MISSING and getattr(owner, attr, _MISSING) is not inherited:
                return False
    return True


def _install(owner, attr, original, own, entry):
    held = vars(owner).get(attr, _MISSING)
    inherited = (getattr(owner, attr, _MISSING) if held is _MISSING and isinstance(owner, type)
                 else _MISSING)
    _last_expected.setdefault(owner, {}).setdefault(attr, (held, inherited))
    setattr(owner, attr, entry)
    _installed.append((owner, attr, original, own, entry))


def _install_all():
    for owner, attr, opcode, form in itertools.chain(entry_points(), _inplace_methods(),
                                                     _unbound_methods()):
        original = getattr(owner, attr)
        entry = _core.make_entry(original, qualname(owner, attr), opcode, form)
        _install(owner, attr, original, attr in vars(owner), entry)
    original_to = torch.Tensor.to
    _install(torch.Tensor, "to", original_to, "to" in vars(torch.Tensor),
             _core.make_to_entry(original_to))
    for owner, attr, make in conversions.wrappers():
        # the attribute as stored (Parameter.__new__ is a staticmethod in
        # its class's dict), so that disable() puts back that object
        original = vars(owner).get(attr, _MISSING)
        _install(owner, attr, original, original is not _MISSING, make(getattr(owner, attr)))
    _watch_writes()
    for owner in (torch.jit, torch.jit._script):
        script = vars(owner)["script"]
        _install(owner, "script", script, True, _unpatched_while(script))
    _patch_contexts(torch.amp.autocast_mode.autocast, _core.autocast_entered)
    _patch_autocast_setters()
    _patch_contexts(torch.autograd.grad_mode.inference_mode, _core.inference_mode_entered)
    _patch_contexts(torch.autograd.graph.saved_tensors_hooks, _core.saved_hooks_entered)
    _count_dual_levels()


def _watch_writes():
    """The eager writes no entry above sees (watch.py): watch entries for
    torch's writing functions, Python patches for the rest."""
    taken = {(owner, attr) for owner, attr, *_ in _installed}
    watched = {}                 # id(original) -> its watch entry
    for owner, attr, name, form in list(watch.watch_entries(taken)):
        original = getattr(owner, attr)
        entry = _core.make_entry(original, name, -1, form)
        watched.setdefault(id(original), entry)
        _install(owner, attr, original, attr in vars(owner), entry)
    for owner, attr, original in list(watch.aliases(taken, watched)):
        _install(owner, attr, original, True, watched[id(original)])
    for owner, attr, patched in itertools.chain(watch.python_patches(),
                                                autograd_calls.python_patches(),
                                                value_calls.python_patches(),
                                                fast_paths.python_patches(),
                                                defaults.python_patches(),
                                                python_bodies.python_patches()):
        # the owner's own attribute as stored (Function.apply: a classmethod)
        original = vars(owner)[attr] if attr in vars(owner) else getattr(owner, attr)
        _install(owner, attr, original, attr in vars(owner), patched)


def _unpatched_while(call):
    """call(...) with torch's own attributes in place of fastlazy's patches
    (then the same patches again).  For torch.jit.script, which compiles
    the functions a scripted one calls from their source, found by name:
    an entry point in torch.nn.functional is no function it can compile.
    Other threads' calls meanwhile reach LazyTensor.__torch_function__."""
    def unpatched(*args, **kwargs):
        with _lock:
            lifted = _put_back(_installed)
            try:
                return call(*args, **kwargs)
            finally:
                for owner, attr, original, own, entry in reversed(lifted):
                    setattr(owner, attr, entry)
    unpatched.__wrapped__ = call
    unpatched.__name__ = unpatched.__qualname__ = call.__name__
    unpatched.__doc__ = call.__doc__
    return unpatched


def _count_open_contexts():
    """Start the core's counts of open torch.autocast,
    torch.inference_mode and saved_tensors_hooks contexts and forward-AD
    levels (patched below: inside one, every call takes the generic path,
    whose signatures include the autocast state; a recorded result asks
    whether its thread is in inference mode; a call runs eagerly where its
    thread's hooks would see its saved tensors, or a level its tangents)
    from one where enable() runs inside such a context."""
    autocast = any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda"))
    _core.autocast_entered(-_core.autocast_depth() + int(autocast))
    _core.inference_mode_entered(-_core.inference_mode_depth()
                                 + int(torch.is_inference_mode_enabled()))
    _core.saved_hooks_entered(-_core.saved_hooks_depth() + int(
        torch._C._autograd._top_saved_tensors_default_hooks(False) is not None))
    _core.dual_levels_entered(-_core.dual_levels_depth()
                              + torch.autograd.forward_ad._current_level + 1)


def _count_dual_levels():
    """The core's count of open forward-AD levels follows
    torch.autograd.forward_ad's enter/exit_dual_level (which its dual_level
    context calls by module-global name)."""
    fwad = torch.autograd.forward_ad
    enter, exit_ = fwad.enter_dual_level, fwad.exit_dual_level

    def enter_dual_level():
        level = enter()
        _core.dual_levels_entered(1)
        return level

    def exit_dual_level(*, level=None):
        exit_(level=level)
        _core.dual_levels_entered(-1)

    for attr, patched in (("enter_dual_level", enter_dual_level),
                          ("exit_dual_level", exit_dual_level)):
        _install(fwad, attr, vars(fwad)[attr], True, patched)


def _patch_autocast_setters():
    """torch's autocast setters (set_autocast_enabled, set_autocast_dtype and
    the older per-device ones), each followed by the core's note that this
    thread's autocast state may have changed: generic signatures hold the
    state, which the core keeps until then (csrc/generic_record.pxi)."""
    for attr in sorted(vars(torch)):
        if attr.startswith("set_autocast_") and attr != "set_autocast_cache_enabled" \
                and callable(vars(torch)[attr]):
            setter = vars(torch)[attr]
            _install(torch, attr, setter, True, _noting_autocast_change(setter))


def _noting_autocast_change(setter):
    @functools.wraps(setter)
    def set_and_note(*args, **kwargs):
        try:
            return setter(*args, **kwargs)
        finally:
            _core.autocast_changed()
    return set_and_note


def _patch_contexts(cls, entered):
    """Patch context manager class `cls` so that the core's counter
    (entered(delta)) follows its open contexts."""
    enter, exit_ = cls.__enter__, cls.__exit__

    def __enter__(self):
        out = enter(self)
        entered(1)
        return out

    def __exit__(self, *exc):
        entered(-1)
        return exit_(self, *exc)

    for attr, patched in (("__enter__", __enter__), ("__exit__", __exit__)):
        _install(cls, attr, vars(cls)[attr], True, patched)


def _put_back(rows) -> list:
    """Put back what each of `rows` replaced, last first, where the
    attribute still holds its entry (one patched again by someone else is
    theirs now); the rows put back, in that order."""
    put_back = []
    for row in reversed(rows):
        owner, attr, original, own, entry = row
        if vars(owner).get(attr, _MISSING) is not entry:
            continue
        if own:
            setattr(owner, attr, original)
        else:
            delattr(owner, attr)
        put_back.append(row)
    return put_back


def disable() -> None:
    with _lock:
        _put_back(_installed)
        _installed.clear()
        _core.end_watches()
        _core.autocast_entered(-_core.autocast_depth())
        _core.inference_mode_entered(-_core.inference_mode_depth())
        _core.saved_hooks_entered(-_core.saved_hooks_depth())
        _core.dual_levels_entered(-_core.dual_levels_depth())
