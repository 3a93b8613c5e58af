"""The generic path: recording calls that have no C rule.

Any torch function called with LazyTensors (conv2d, cat, where, var, a view,
indexing...) is described by a *signature*: the function, each tensor
argument's dtype/shape/device/requires_grad (and view geometry), every other
argument's value, and the grad and autocast modes.  The first call of a
signature runs the function on fake tensors to check the call (eager would
raise: then eager runs it and raises) and read its results' metadata,
through make_fx to capture it as a small aten program, and -- when the
inputs are small -- once for real, because fake kernels skip some of the
real kernels' checks.  It is recorded only if that program is pure -- no op
mutates, none is random, no output shape depends on data -- and every
result is a tensor (or None).  The signature itself is built in C
(generic_record.pxi).

The verdict, the result metadata and the aten program are cached per
signature, so a repeat costs a dict lookup and the node appends; the fake
runs are never repeated per call (the lesson of the trace-time notebook).
Calls that are not recordable run eagerly, are counted, and
`fastlazy.explain()` lists them with the reason.

Lowerings are interned by their code: a program that does not depend on the
input shapes (conv2d with fixed hyperparameters) is one lowering for every
shape, so TorchScript graphs that contain it stay shape-generic; one that
bakes sizes in (a reshape to (4, -1) traced as view(4, 6)) gets one per shape.
"""
from __future__ import annotations

import contextlib
import logging
import operator
import threading

import torch
import torch.fx
import torch.utils._pytree as pytree

from fastlazy import _core, fallback, views
from fastlazy._core import LazyTensor

MAX_INPUTS = _core.MAX_IN     # tensor arguments of one node
MAX_SIGNATURES = 20_000       # signatures kept before the cache starts over

# argument types that stand for themselves in a signature (the core's
# describe_call handles tensors, containers, floats and slices)
ATOMS = frozenset({int, bool, str, type(None), type(Ellipsis), torch.dtype,
                    torch.device, torch.layout, torch.memory_format})
_REFUSED_TAGS = {
    torch.Tag.nondeterministic_seeded: "random (runs eagerly so seeded runs match eager)",
    torch.Tag.dynamic_output_shape: "output shape depends on the data",
    torch.Tag.data_dependent_output: "output depends on the data",
    torch.Tag.inplace_view: "changes a tensor's view in place",
}


# Ops whose schemas do not say that they write (in training) their running
# statistics arguments.
_UPDATES_RUNNING_STATS = frozenset(
    getattr(torch.ops.aten, name).default
    for name in ("native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm")
    if hasattr(torch.ops.aten, name))


class Unsafe(Exception):
    """A call the generic path does not record; the message is the reason."""


class Lowering:
    """One captured aten program: an FX graph whose placeholders are the
    call's tensor arguments in order and whose output is a flat tuple."""

    def __init__(self, index, gm, name):
        self.index = index
        self.gm = gm
        self.name = name
        nodes = list(gm.graph.nodes)
        self.placeholders = [n for n in nodes if n.op == "placeholder"]
        self.outputs = list(nodes[-1].args[0])

    generic = True
    lower = None

    def __repr__(self):
        return f"<generic lowering {self.index}: {self.name}>"


class Signature:
    __slots__ = ("reason", "lowering", "kinds", "recorded", "spec", "detach", "nested",
                 "constants")

    def __init__(self, reason=None):
        self.reason = reason
        self.nested = False
        self.constants = ()


# Functions of a sequence of tensors whose call over many tensors equals the
# same kind of call over the results for groups of them (cat over groups, then
# cat; stack over groups, then cat along the same dim): a node holds at most
# MAX_INPUTS tensors, so a longer sequence (DenseNet's torch.cat of every
# earlier feature map) is recorded as a tree of such calls.  Copies only, so
# the tree gives eager's values bit for bit.  function -> the function that
# joins the groups' results.
_NESTED = {torch.cat: torch.cat, torch.concat: torch.cat, torch.concatenate: torch.cat,
           torch.stack: torch.cat, torch.hstack: torch.hstack, torch.vstack: torch.vstack,
           torch.dstack: torch.dstack}


_lock = threading.Lock()
_signatures: dict = {}
_lowerings: list = []
_lowering_ids: dict = {}



def lowering(index):
    return _lowerings[index]


def call(func, name, args, kwargs, inplace, ruled=False):
    """An entry point's call (or a __torch_function__ call) with LazyTensor
    arguments and no C rule (`ruled`: its row's C rule does not take these
    arguments): record it if it is pure, else run it eagerly."""
    try:
        out = (_record_inplace if inplace else record)(func, args, kwargs, name, ruled=ruled)
    except Unsafe as exc:
        return fallback.run(func, name, args, kwargs, inplace, str(exc))
    _core.count("generic_calls")
    return out


def _record_inplace(func, args, kwargs, name, ruled=False):
    """An in-place call on a LazyTensor, functionalized: its out-of-place
    version is recorded and the LazyTensor rebound to the result (then the
    write is carried to its views, or to its base)."""
    target = args[0] if args else None
    if type(target) is not LazyTensor:
        raise Unsafe("writes an eager tensor (eager semantics)")
    views.before_write(target, (args[1:], kwargs), name.endswith("__setitem__"))
    if target.family is None and target.is_materialized and target.to_eager()._is_view():
        raise Unsafe("writes through a view an eager fallback made")
    _core.adopt(target, record(_functional(func), args, kwargs, name, track_views=False,
                               ruled=ruled))
    if target.family is not None:
        views.after_mutation(target)
    return None if name.endswith("__setitem__") else target


_functionals: dict = {}


def _functional(func):
    """func(self, ...) that writes self, as a function returning the written
    copy; traced through torch.func.functionalize, so the captured program
    has no in-place op left."""
    wrapper = _functionals.get(func)
    if wrapper is None:
        def wrapper(self, *args, **kwargs):
            out = self.clone()
            returned = func(out, *args, **kwargs)
            if returned is NotImplemented:
                raise TypeError("NotImplemented")
            return out
        wrapper.functionalize = True
        wrapper.__name__ = getattr(func, "__name__", "inplace")
        _functionals[func] = wrapper
    return wrapper


def record(func, args, kwargs, name=None, track_views=True, ruled=False):
    """Record func(*args, **kwargs); the result with LazyTensors in place of
    tensors.  Raises Unsafe for a call it does not take."""
    tensors = []
    key = (func, _core.describe_call(args, kwargs, tensors), torch.is_grad_enabled(),
           _autocast_key(), ruled)
    sig = _signatures.get(key)
    if sig is None:
        sig = _analyse(func, args, kwargs, tensors, name or getattr(func, "__name__", "?"),
                       ruled)
        with _lock:
            if len(_signatures) >= MAX_SIGNATURES:
                # a loop over ever-new shapes: start over rather than grow
                _signatures.clear()
            _signatures[key] = sig
    if sig.reason is not None:
        raise Unsafe(sig.reason)
    if sig.nested:
        return _record_nested(func, args, kwargs, name)
    inputs = tuple([t if type(t) is LazyTensor else _core.lazy(t) for t in tensors])
    if sig.constants:
        inputs += tuple([_core.lazy(c) for c in sig.constants])
    new = iter(_core.record_generic(sig.lowering.index, inputs, sig.recorded, sig.detach)
               if sig.recorded else ())
    if sig.spec is None:            # one result, recorded: the common case
        t = next(new)
        if sig.kinds[0][0] == "view" and track_views:
            views.attach(t, tensors[sig.kinds[0][1]], sig.kinds[0][2], sig.kinds[0][3])
        return t
    flat = []
    for kind in sig.kinds:
        if kind[0] == "input":
            flat.append(tensors[kind[1]])
            continue
        if kind[0] == "none":
            flat.append(None)
            continue
        t = next(new)
        if kind[0] == "view" and track_views:
            views.attach(t, tensors[kind[1]], kind[2], kind[3])
        flat.append(t)
    return pytree.tree_unflatten(flat, sig.spec)


def _sequence(args, kwargs):
    """(the tensors, the positional arguments after them) of a cat-like
    call; Unsafe where they are not a plain list of tensors or the call
    writes out=."""
    if "out" in kwargs:
        raise Unsafe("writes its out= argument")
    if args:
        seq, rest = args[0], tuple(args[1:])
    elif "tensors" in kwargs:
        seq, rest = kwargs["tensors"], ()
    else:
        raise Unsafe("no sequence of tensors")
    if type(seq) not in (list, tuple) or not all(
            type(t) is LazyTensor or isinstance(t, torch.Tensor) for t in seq):
        raise Unsafe("the sequence holds something other than tensors")
    return seq, rest


def _record_nested(func, args, kwargs, name):
    """func over a long sequence as func over groups of MAX_INPUTS tensors,
    joined by _NESTED[func] (itself nested if there are many groups)."""
    seq, rest = _sequence(args, kwargs)
    kwargs = {k: v for k, v in kwargs.items() if k != "tensors"}
    groups = [list(seq[i:i + MAX_INPUTS]) for i in range(0, len(seq), MAX_INPUTS)]
    parts = [record(func, (group,) + rest, kwargs, name) for group in groups]
    return record(_NESTED[func], (parts,) + rest, kwargs, name)


def _substitute(x, it):
    """x with every tensor replaced by the next item of `it` (the order of
    describe_call)."""
    t = type(x)
    if t is LazyTensor or isinstance(x, torch.Tensor):
        return next(it)
    if t is tuple or t is list:
        return t([_substitute(v, it) for v in x])
    if t is dict:
        return {k: _substitute(v, it) for k, v in x.items()}
    if t is slice:
        return slice(_substitute(x.start, it), _substitute(x.stop, it), _substitute(x.step, it))
    return x


def _autocast_key():
    if not _core.autocast_depth():
        return None
    return tuple((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                 for d in ("cpu", "cuda"))


def _example(t, make=torch.empty):
    """A real tensor standing for argument t in the fake runs (never
    written, so never touched), with t's view geometry."""
    if type(t) is LazyTensor:
        shape, dtype, device, geometry = tuple(t.shape), t.dtype, t.device, views.geometry(t)
        grad = t.requires_grad and (dtype.is_floating_point or dtype.is_complex)
        if geometry is None:
            return make(shape, dtype=dtype, device=device, requires_grad=grad)
        numel, stride, offset = geometry
        base = make(numel, dtype=dtype, device=device, requires_grad=grad)
        return base.as_strided(shape, stride, offset)
    # storage for the eager tensor's strides (a slice x[:, ::2] spans more
    # elements than it has)
    span = 0 if 0 in t.shape else 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    example = make(span, dtype=t.dtype, device=t.device).as_strided(t.shape, t.stride())
    return example.requires_grad_(t.requires_grad)


def _analyse(func, args, kwargs, tensors, name, ruled):
    held = _core.hold_pending()
    try:
        return _analyse_or_raise(func, args, kwargs, tensors, name, ruled)
    except Unsafe as exc:
        return Signature(str(exc))
    finally:
        _core.release_pending(held)


def _analyse_or_raise(func, args, kwargs, tensors, name, ruled):
    if not any(type(t) is LazyTensor for t in tensors):
        raise Unsafe("no LazyTensor argument at the top of a list")
    if len(tensors) > MAX_INPUTS and func not in _NESTED:
        raise Unsafe(f"more than {MAX_INPUTS} tensor arguments")
    if len({t.device for t in tensors if t.dim() > 0}) > 1:
        raise Unsafe("tensors on several devices (eager judges)")
    from torch._subclasses.fake_tensor import FakeTensorMode
    examples = [_example(t) for t in tensors]

    # 1. the call itself, on fake tensors: eager's checks, results' metadata
    try:
        # (fake_tensor logs a traceback for a call its kernel rejects; the
        # user gets eager's own exception from the eager run instead)
        with _quiet(_FAKE_LOG), FakeTensorMode(allow_non_fake_inputs=False) as mode:
            fakes = [mode.from_tensor(e) for e in examples]
            fa, fk = _substitute((args, kwargs), iter(fakes))
            out = func(*fa, **fk)
    except Exception as exc:     # eager raises too, or the op has no fake kernel
        raise Unsafe(_why(exc)) from None
    leaves, spec = pytree.tree_flatten(out)
    results = [v for v in leaves if v is not None]     # (attn_output, None)
    if not results or not all(isinstance(v, torch.Tensor) for v in results):
        raise Unsafe("returns something other than tensors")
    if len(tensors) > MAX_INPUTS:
        # the whole call was checked on fake tensors just now, so a bad one
        # raised eager's own error for the whole sequence; record the tree
        _sequence(args, kwargs)
        sig = Signature()
        sig.nested = True
        return sig

    # 2. the aten program
    gm, constants = _trace(func, args, kwargs, examples,
                           [type(t) is LazyTensor and views.geometry(t) is None
                            for t in tensors])
    if len(tensors) + len(constants) > MAX_INPUTS:
        raise Unsafe(f"more than {MAX_INPUTS} tensor arguments and constants")
    outputs = list(gm.graph.nodes)[-1].args[0]
    if len(outputs) != len(results):
        raise Unsafe("the traced program's outputs differ from the call's")

    sig = Signature()
    sig.constants = constants
    single = spec.is_leaf() and results[0] is not None
    sig.spec = spec
    sig.kinds = []
    sig.recorded = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    pairs = enumerate(zip(results, outputs))
    for leaf in leaves:
        if leaf is None:
            sig.kinds.append(("none",))
            continue
        index, (leaf, node) = next(pairs)
        same = [i for i, f in enumerate(fakes) if leaf is f]
        if same or node in placeholders:
            i = same[0] if same else placeholders.index(node)
            sig.kinds.append(("input", i))
            continue
        if leaf.dim() > _core.MAX_NDIM or _core.dtype_code_of(leaf.dtype) < 0:
            raise Unsafe("a result LazyTensor cannot hold (dtype or rank)")
        aliased = [i for i, f in enumerate(fakes) if torch._C._is_alias_of(leaf, f)]
        if aliased:
            i = aliased[0]
            if type(tensors[i]) is not LazyTensor:
                raise Unsafe("returns a view of an eager tensor (eager semantics)")
            if leaf.dtype != fakes[i].dtype:
                raise Unsafe("a view with another dtype (writes through it are not tracked)")
            detached = fakes[i].requires_grad and not leaf.requires_grad
            sig.kinds.append(("view", i, (tuple(leaf.shape), leaf.stride(),
                                          leaf.storage_offset()), detached))
        else:
            sig.kinds.append(("new",))
        sig.recorded.append((index, leaf.dtype, tuple(leaf.shape), leaf.requires_grad))
    if single and sig.kinds[0][0] != "input":
        sig.spec = None
    _run_small(func, args, kwargs, tensors, results, ruled)
    sig.detach = (not torch.is_grad_enabled()
                  and any(t.requires_grad for t in tensors))
    sig.lowering = _intern(gm, name) if sig.recorded else None
    return sig


_FAKE_LOG = logging.getLogger("torch._subclasses.fake_tensor")


@contextlib.contextmanager
def _quiet(logger):
    was = logger.disabled
    logger.disabled = True
    try:
        yield
    finally:
        logger.disabled = was


def _why(exc):
    from torch._subclasses import fake_tensor
    if isinstance(exc, fake_tensor.DynamicOutputShapeException):
        return "output shape depends on the data"
    if isinstance(exc, fake_tensor.DataDependentOutputException):
        return "output depends on the data"
    if isinstance(exc, fake_tensor.UnsupportedOperatorException):
        return "no fake-tensor kernel"
    return f"eager judges the arguments (the fake run raised {type(exc).__name__})"


# Inputs up to this many elements in all get a real run when a signature is
# first seen; larger ones rely on the fake run's checks alone.
REAL_CHECK_NUMEL = 1 << 20


def _run_small(func, args, kwargs, tensors, fakes, ruled):
    """Run the call once for real when that is cheap: fake kernels do not
    make every check the real kernel makes (var of an int64 tensor passes on
    fake tensors), and eager's error belongs at the call.  (An error that
    depends on the values can only surface when the graph runs, as in every
    lazy tensor system; a call the trial values make fail runs eagerly.)
    Nor do they always agree with the real kernel on the results' dtype
    (pow of a bool tensor and a bool is int64 on fake tensors, bool in
    eager): such a call runs eagerly too.  Without a trial run, a call its
    row's C rule does not take (these are the corners where fake kernels
    and eager part ways) runs eagerly."""
    if sum(t.numel() for t in tensors) > REAL_CHECK_NUMEL:
        if ruled:
            raise Unsafe("its C rule does not take these arguments, and they are too "
                         "large for a trial run")
        return
    generator = torch.Generator().manual_seed(0)   # the global one is not touched

    def trial_values(shape, dtype, device, requires_grad=False):
        # floats: uniform in [0, 1), valid where eager checks a value's range
        # (binary_cross_entropy's probabilities, multinomial's weights) and
        # nonsingular (zeros would make linalg ops see singular matrices);
        # integers and bools: zeros, which are valid indices
        if dtype.is_floating_point or dtype.is_complex:
            t = torch.rand(shape, generator=generator, dtype=dtype).to(device)
        else:
            t = torch.zeros(shape, dtype=dtype, device=device)
        return t.requires_grad_(requires_grad)

    trial = [_example(t, trial_values) for t in tensors]
    try:
        a, k = _substitute((args, kwargs), iter(trial))
        out = func(*a, **k)
    except Exception as exc:
        raise Unsafe(f"eager judges the arguments (a trial run raised "
                     f"{type(exc).__name__})") from None
    real = [v for v in pytree.tree_leaves(out) if v is not None]
    if [(v.dtype, v.shape) for v in real] != [(v.dtype, v.shape) for v in fakes]:
        raise Unsafe("the fake kernel's result metadata differs from eager's")


# Exceptions to _REFUSED_TAGS: an attention kernel tagged random for its
# dropout, called with none (_no_dropout); an in-place view op on the
# program's own intermediate (quantile's squeeze_), as pure as seen from
# outside as any other write to an intermediate; and ops tagged
# data-dependent for one kind of argument only (a boolean mask index), whose
# fake kernels raise for that kind, so a call that got through the fake run
# has a static output shape (integer indices).
_SEEDED = torch.Tag.nondeterministic_seeded
_INPLACE_VIEW = torch.Tag.inplace_view
_DYNAMIC_SHAPE = torch.Tag.dynamic_output_shape
_SHAPE_FROM_FAKE = frozenset({torch.ops.aten.index.Tensor})


def _writes_an_input(node, inputs):
    """Does this in-place aten call write one of the program's inputs (or a
    view of one)?  Writes into the program's own intermediates (GRU's cells
    add in place) keep the program pure as seen from outside; the backends
    run them as written."""
    for k, arg in enumerate(node.target._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = node.args[k] if k < len(node.args) else node.kwargs.get(arg.name)
        for written in (value if isinstance(value, (list, tuple)) else [value]):
            fake = written.meta.get("val") if isinstance(written, torch.fx.Node) else None
            if not isinstance(fake, torch.Tensor):
                return True             # cannot tell: assume the worst
            if any(isinstance(i, torch.Tensor) and torch._C._is_alias_of(fake, i)
                   for i in inputs):
                return True
    return False


def _no_dropout(node):
    """An attention kernel tagged random for its dropout, called with none."""
    for k, arg in enumerate(node.target._schema.arguments):
        if arg.name == "dropout_p":
            value = (node.args[k] if k < len(node.args)
                     else node.kwargs.get("dropout_p", arg.default_value))
            return value == 0
    return False


def _trace(func, args, kwargs, examples, contiguous):
    """The aten program of the call.  Inputs flagged `contiguous` were traced
    as contiguous tensors, but their values may have any layout at run time
    (a LazyTensor that is not a view is contiguous as far as its user can
    tell): the program starts by making them so, as it would have had to
    (a kernel that wants contiguous input, a view(-1))."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def program(*ts):
        a, k = _substitute((args, kwargs), iter(ts))
        return func(*a, **k)
    if getattr(func, "functionalize", False):
        program = torch.func.functionalize(program)
    try:
        gm = make_fx(program, tracing_mode="fake")(*examples)
    except Exception as exc:
        raise Unsafe(f"not traceable to aten ({type(exc).__name__})") from None
    constants = _lift_constants(gm)
    inputs = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        target = node.target
        if not isinstance(target, torch._ops.OpOverload):
            raise Unsafe(f"calls {target} (not an aten op)")
        if target._schema.is_mutable and _writes_an_input(node, inputs):
            raise Unsafe(f"{target} mutates its input")
        if target in _UPDATES_RUNNING_STATS and node.args[5] and node.args[3] is not None:
            raise Unsafe("updates batch-norm running statistics in place (eager buffers)")
        for tag, reason in _REFUSED_TAGS.items():
            if tag in target.tags and not (tag is _SEEDED and _no_dropout(node)) \
                    and not (tag is _DYNAMIC_SHAPE and target in _SHAPE_FROM_FAKE) \
                    and not (tag is _INPLACE_VIEW and not _writes_an_input(node, inputs)):
                raise Unsafe(f"{target}: {reason}")
        if target is torch.ops.aten._local_scalar_dense.default:
            raise Unsafe("reads a tensor's value")
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, flag in zip(placeholders, contiguous):
        if flag and node.users:
            with gm.graph.inserting_after(placeholders[-1]):
                made = gm.graph.call_function(torch.ops.aten.contiguous.default, (node,))
            node.replace_all_uses_with(made, delete_user_cb=lambda user: user is not made)
    output = list(gm.graph.nodes)[-1]
    leaves = [v for v in pytree.tree_leaves(output.args[0]) if v is not None]
    if not all(isinstance(v, torch.fx.Node) for v in leaves):
        raise Unsafe("returns something other than tensors")
    output.args = (tuple(leaves),)
    gm.recompile()
    return gm, constants


def _lift_constants(gm):
    """The tensors the program made from the call's Python values (x[[0, 2]]
    traces the list as a constant index tensor), turned into inputs after the
    call's own: per signature, so per value; the lowerings stay plain aten
    programs of their inputs."""
    constants = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node in list(gm.graph.nodes):
        if node.op != "get_attr":
            continue
        value = getattr(gm, node.target)
        if not isinstance(value, torch.Tensor) or value.layout != torch.strided:
            raise Unsafe("creates a constant that is not a dense tensor")
        with gm.graph.inserting_after(placeholders[-1]):
            placeholder = gm.graph.placeholder(f"constant{len(constants)}")
        placeholder.meta.update(node.meta)
        placeholders.append(placeholder)
        node.replace_all_uses_with(placeholder)
        gm.graph.erase_node(node)
        delattr(gm, node.target)
        constants.append(value)
    return tuple(constants)


def _intern(gm, name):
    with _lock:
        index = _lowering_ids.get(gm.code)
        if index is None:
            index = _lowering_ids[gm.code] = len(_lowerings)
            _lowerings.append(Lowering(index, gm, name))
        return _lowerings[index]


def reset():
    """Forget every signature (not the lowerings: graphs refer to them)."""
    with _lock:
        _signatures.clear()

