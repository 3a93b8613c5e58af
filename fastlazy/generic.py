"""The generic path: recording calls that have no C rule.

Any torch function called with LazyTensors (conv2d, cat, where, var, a view,
indexing...) is described by a *signature*: the function, each tensor
argument's dtype/shape/device/requires_grad (and view geometry), every other
argument's value, and the grad and autocast modes.  The signature itself is
built in C (generic_record.pxi).  The first call of a signature is analysed
by capture.py (fake-tensor run, aten program, purity checks); the verdict,
the result metadata and the aten program are cached here per signature, so
a repeat costs a dict lookup and the node appends.  Calls that are not
recordable raise Unsafe, and route.py runs them eagerly: they are counted,
and `fastlazy.explain()` lists them with the reason.  In-place calls are
recorded (functionalized) through here by mutation.py.

Lowerings are interned by their structure (capture.program_key: ops,
targets, arguments): a program that does not depend on the
input shapes (conv2d with fixed hyperparameters) is one lowering for every
shape, so TorchScript graphs that contain it stay shape-generic; one that
bakes sizes in (a reshape to (4, -1) traced as view(4, 6)) gets one per shape.
"""
from __future__ import annotations

import operator
import os
import threading

import torch
import torch.utils._pytree as pytree

from fastlazy import _core, capture, churn, lifted_floats, program_templates, split_calls, views
from fastlazy._core import LazyTensor
from fastlazy.capture import MAX_INPUTS, Signature, Unsafe, WritesInputs

MAX_SIGNATURES = 20_000       # signatures kept before the cache starts over
MAX_LOWERINGS = 1 << _core.ATTR_GENERIC_OUT_SHIFT   # programs a node can name
MAX_LAYOUTS = 256             # result layouts kept per program output

# argument types that stand for themselves in a signature (the core's
# signature_key handles tensors, containers, floats and slices)
ATOMS = frozenset({int, bool, str, type(None), type(Ellipsis), torch.dtype,
                    torch.device, torch.layout, torch.memory_format})


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
        # output index -> {number of tensor arguments -> {their (shape,
        # strides) each: the strides eager gives that output}}, from the real
        # runs of the signatures analysed with this program (capture.Signature)
        self.result_strides = {}
        self._layouts_kept = 0

    generic = True
    lower = None

    def note_layouts(self, sig):
        """Keep what the real run of signature sig showed of its results'
        layouts (a few hundred layouts per program at most: a loop over
        ever-new shapes is no reason to grow)."""
        for index, strides in sig.result_strides.items():
            if self._layouts_kept < MAX_LAYOUTS:
                self._layouts_kept += 1
                known = self.result_strides.setdefault(index, {})
                known.setdefault(len(sig.operand_layouts), {})[sig.operand_layouts] = strides

    def strides_of(self, index, operands):
        """The strides eager gives output `index` of a call whose node reads
        `operands` ((shape, strides) of each input, None where not known or
        not a tensor; its tensor arguments come first), where a real run
        showed them; else None."""
        for n, known in self.result_strides.get(index, {}).items():
            strides = known.get(tuple(operands[:n]))
            if strides is not None:
                return strides
        return None

    def __repr__(self):
        return f"<generic lowering {self.index}: {self.name}>"


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


# Re-entrant: a finalizer run by an allocation inside the lock may call
# back into fastlazy (read a LazyTensor: a flush) on this very thread.
_lock = threading.RLock()
_signatures: dict = {}
_lowerings: list = []
_lowering_ids: dict = {}


def forget_signatures():
    """Drop the cached signatures (the default dtype changed: their result
    dtypes may be other ones now)."""
    with _lock:
        _signatures.clear()
        _core.forget_generic()
    program_templates.forget()
    lifted_floats.forget()
    churn.forget()


def lowering(index):
    return _lowerings[index]


def record(func, args, kwargs, name=None, track_views=True, ruled=False, prepared=None,
           written=False, churns=True):
    """Record func(*args, **kwargs); the result with LazyTensors in place of
    tensors.  Raises Unsafe for a call it does not take.  `prepared`: the
    (key, tensors) the core built for this call (route.call), which also
    lets this signature's later calls be recorded by the core alone.
    written: func is the functional form of a call that wrote its first
    argument in place (mutation.record_inplace; backends.base.as_written).
    churns: a new value of its numbers counts towards running the call
    eagerly (fastlazy.churn); not for fastlazy's own write-backs through
    views, whose numbers are places, and which have no eager run."""
    if prepared:
        key, tensors = prepared[0], prepared[1]
    else:
        tensors = []
        key = _core.signature_key(func, args, kwargs, tensors, ruled, _core.autocast_key())
    sig = _signatures.get(key)
    if sig is None and len(tensors) > MAX_INPUTS and func in _NESTED:
        # a long sequence (densenet's torch.cat of every earlier layer's
        # features): its groups and their join are calls of their own,
        # each judged as eager judges it, with no analysis of the whole
        # for each new length.  One that raises is judged whole below,
        # whose error is eager's for the whole sequence (the tensor's
        # number in it)
        try:
            return _record_nested(func, args, kwargs, name, by_entries=True)
        except Exception:          # noqa: BLE001 - raised again by the analysis
            pass
    scalars = ()
    if sig is None:
        loose = lifted_floats.loose_key(key)
        lifted = None if loose is None else lifted_floats.match(loose[0])
        if lifted is not None:
            scalars = lifted.takes(loose[1])
            if scalars is not None:
                sig, prepared = lifted.sig, None
        if sig is None:
            if churns and churn.runs_eagerly(key):
                raise Unsafe(churn.REASON)
            scalars = ()
            title = name or getattr(func, "__name__", "?")
            sig = _analyse(func, args, kwargs, tensors, title, ruled)
            if (churns and sig.reason is None and sig.split is None
                    and any(k[0] in _ALIASING for k in sig.kinds)):
                churn.aliases(key)
            with _lock:
                if len(_signatures) >= MAX_SIGNATURES:
                    # a loop over ever-new shapes: start over rather than grow
                    _signatures.clear()
                    _core.forget_generic()
                if not sig.transient:
                    _signatures[key] = sig
            if loose is not None and sig.reason is None and sig.split is None:
                lifted_floats.observe(loose[0], loose[1], func, args, kwargs, tensors, sig,
                                      lambda gm: _intern(gm, title))
    if sig.reason is not None:
        if capture.values_unseen(sig.reason):
            read = _sizes_read(args, kwargs)
            if read is not None:
                # the sizes eager reads from 0-dim integer tensors
                return record(func, *read, name, track_views, ruled, None, written, churns)
        if sig.written != ():
            # the eager run writes these arguments (all of them where the
            # program did not say which)
            raise WritesInputs(sig.reason, [t for i, t in enumerate(tensors)
                                            if sig.written is None or i in sig.written])
        raise Unsafe(sig.reason)
    if sig.nested:
        return _record_nested(func, args, kwargs, name)
    if sig.split is not None:
        return split_calls.record(sig.split, tensors)
    exact = sig.views and _addresses_storage(func)
    if track_views and sig.views and _lays_out_as_eager(sig, tensors, exact):
        # a view of a root eager lays out otherwise, now a view of its
        # storage: recorded as a view of that view
        return record(func, args, kwargs, name, track_views, ruled, None, written, churns)
    if sig.retypes_held:
        _check_retyped_places(sig, tensors)
        prepared = None             # placed here at each call, never by the core
    inputs = tuple([t if type(t) is LazyTensor else _core.lazy_or_eager(t) for t in tensors])
    for t in inputs:
        if type(t) is not LazyTensor:
            # an eager operand of a dtype a LazyTensor cannot hold (uint16,
            # uint32, uint64, float8...): the call runs eagerly, as eager
            # takes it
            raise Unsafe(f"an eager operand of dtype {t.dtype} (a LazyTensor cannot hold it)")
    if sig.constants:
        inputs += tuple([_core.lazy(c) for c in sig.constants])
    if sig.draws:
        # drawn now, in the call's order, as eager draws them
        inputs += tuple([_core.lazy(draw()) for draw in sig.draws])
    inputs += scalars
    new = iter(_core.record_generic(sig.lowering.index, inputs, sig.recorded, sig.detach,
                                    written)
               if sig.recorded else ())
    if sig.spec is None:            # one result, recorded: the common case
        t = next(new)
        view = sig.kinds[0][0] == "view"
        if view and track_views:
            views.attach_result(t, tensors[sig.kinds[0][1]], sig.kinds[0][2], sig.kinds[0][3])
        if view and sig.kinds[0][3] & _CONJ:
            _resolve_conj(t)
        elif (prepared and len(sig.recorded) == 1 and not sig.draws
              and (not written or sig.kinds[0][0] == "new")):
            # the core records this signature's later calls itself (an
            # in-place call's functional form: its fresh result, which the
            # core moves the written tensor onto)
            _publish(prepared, sig, sig.kinds[0], written=written, exact_layout=exact)
        return t
    resolves = getattr(func, "__name__", None) in _RESOLVERS
    if resolves and sig.kinds[0][0] == "input" and _has_bit(tensors[sig.kinds[0][1]]):
        # eager copies a tensor whose bit it resolves (a conj() view): a
        # write to the copy must not reach the view's root
        return record(torch.clone, (tensors[sig.kinds[0][1]],), {}, name)
    if (prepared and not sig.recorded and not sig.draws and len(sig.kinds) == 1
            and sig.kinds[0][0] == "input" and sig.spec.is_leaf() and not resolves):
        # the call returns a tensor argument itself: so do its later calls,
        # from the core
        _core.publish_input(prepared, sig.kinds[0][1])
    form = _tuple_form(sig) if prepared and len(sig.recorded) == 1 and not sig.draws else None
    if form is not None:
        # a tuple of one result and Nones: the core records it too
        _publish(prepared, sig, sig.kinds[form[1]], form)
    elif prepared and not sig.draws and not resolves:
        places = _places(sig)
        if places is not None:
            # a tuple or list of several results: so does it
            _core.publish_generic_results(prepared, sig.lowering.index, sig.recorded,
                                          sig.detach, tuple(sig.constants or ()), places,
                                          len(sig.kinds),
                                          None if sig.sequence is tuple else sig.sequence)
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
            views.attach_result(t, tensors[kind[1]], kind[2], kind[3])
        if kind[0] == "view" and kind[3] & _CONJ:
            _resolve_conj(t)
        flat.append(t)
    return sig.sequence(flat) if sig.sequence is not None else pytree.tree_unflatten(flat, sig.spec)


def _lays_out_as_eager(sig, tensors, exact=False) -> bool:
    """Did a root this call views become a view of its storage in eager's
    order (_core.place_as_eager: a pending result eager lays out other than
    contiguously, before its first view)?  exact: a call that addresses
    the storage itself (as_strided), for which eager's layout is asked
    wherever it is taken as contiguous otherwise."""
    changed = False
    for kind in sig.kinds:
        if kind[0] == "view":
            t = tensors[kind[1]]
            if type(t) is LazyTensor and type(t.family) is not views.Member:
                changed = _core.place_as_eager(t, exact) or changed
    return changed


def _addresses_storage(func) -> bool:
    """as_strided in any of its spellings (Tensor.as_strided, torch's,
    aten's overloads): its result's elements are read off the storage at
    the offsets it names, so its input must sit there in eager's order."""
    return getattr(func, "__name__", "").partition(".")[0] == "as_strided"


def _check_retyped_places(sig, tensors):
    """Raise Unsafe where a dtype view of a held argument would start
    within one of its elements (`x[1:5].view(torch.float64)` of int32
    values): traced at the start of a tensor of its own, the call passed
    eager's check of the storage offset, which its place in the root can
    fail; eager's run then raises eager's error."""
    results = iter(sig.recorded)
    for kind in sig.kinds:
        if kind[0] in ("input", "none"):
            continue
        dtype = next(results)[1]
        if kind[0] == "view" and views.held(tensors[kind[1]]):
            base = tensors[kind[1]]
            # (in the root's storage, which may itself start at an offset)
            start = (base.family.offset * base.dtype.itemsize
                     + base.family.root.to_eager().storage_offset() * base.family.root.dtype.itemsize)
            if start % dtype.itemsize:
                raise Unsafe("a dtype view starting within an element of its held argument")


def _sizes_read(args, kwargs):
    """(args, kwargs) with each eager 0-dim integer tensor in a list or
    tuple argument read as the int it holds, or None where there is none.
    Eager reads such a tensor in a list of sizes (`x.new_zeros((b, n + 1))`
    where n = torch.div(length, w, rounding_mode="trunc"), as Longformer
    computes its chunk counts) through __index__ when the call is made;
    the analysis makes it a fake tensor, whose value it cannot know.  Only
    for a call whose analysis a value it could not see may have failed
    (capture.values_unseen): a list of 0-dim tensors that are operands
    (torch.stack) analyses as it is.  Where the call with ints is refused
    too, the call runs eagerly on its own arguments."""
    def read(value):
        if type(value) in (list, tuple) and any(_index_tensor(v) for v in value):
            return type(value)(operator.index(v) if _index_tensor(v) else v for v in value)
        return value
    new_args = tuple(read(a) for a in args)
    new_kwargs = {k: read(v) for k, v in kwargs.items()}
    if all(a is b for a, b in zip(new_args, args)) and all(
            new_kwargs[k] is kwargs[k] for k in kwargs):
        return None
    return new_args, new_kwargs


def _index_tensor(v) -> bool:
    return (type(v) is not LazyTensor and isinstance(v, torch.Tensor) and v.dim() == 0
            and not v.dtype.is_floating_point and not v.dtype.is_complex
            and v.dtype is not torch.bool)


_CONJ = _core.ViewFlag.VIEW_CONJ
# result kinds that share an argument's storage (churn.aliases)
_ALIASING = ("view", "input")
# calls that return their argument itself unless it has eager's conjugate
# (or negative) bit, which a LazyTensor keeps as its view's VIEW_CONJ flag
_RESOLVERS = frozenset({"resolve_conj", "resolve_neg"})


def _has_bit(t):
    """Would eager's value of LazyTensor t have its conjugate bit, or (an
    imaginary part of a conj() view, x.conj().imag) its negative bit?"""
    return t.is_conj() or t.is_neg()


def _resolve_conj(t):
    """t, a conj() view, holds its values physically conjugated from now
    on.  The op's program leaves eager's conjugate bit on its result when
    the graph runs, which the programs of later calls were not traced
    with (they see plain values on fake tensors: `.imag` traced as
    view_as_real, which refuses a conjugate bit).  Views stay views by
    their place and flags (views.py), not by sharing storage.  (Such a
    signature is never handed to the core: its later calls come here.)"""
    _core.adopt(t, record(_physical, (t,), {}, "conj() resolved", track_views=False))


def _physical(t):
    # t's logical values, with no conjugate bit, whether or not t has one
    # when the graph runs (a fused backend computes conj() as values)
    return torch.conj_physical(t.conj())


def _publish(prepared, sig, kind, form=None, written=False, exact_layout=False):
    """Hand the signature's one recorded result (`kind`: new, or a view and
    its place) to the core, which records its later calls itself."""
    view = kind[0] == "view"
    _core.publish_generic(prepared, sig.lowering.index, sig.recorded, sig.detach,
                          tuple(sig.constants or ()), kind[1] if view else -1,
                          kind[2] if view else None, kind[3] if view else 0, form, written,
                          exact_layout)


def _places(sig):
    """Per recorded result, (its position, the tensor it is a view of or
    -1, its place, its view flags), if the signature returns a plain tuple
    or list (or torch.return_types structseq) of several recorded results
    and Nones; else None."""
    if sig.sequence is None or len(sig.recorded) < 2:
        return None
    places = []
    for k, kind in enumerate(sig.kinds):
        if kind[0] == "new":
            places.append((k, -1, None, 0))
        elif kind[0] == "view" and not kind[3] & _CONJ:
            places.append((k, kind[1], kind[2], kind[3]))
        elif kind[0] != "none":
            return None
    return places if len(places) == len(sig.recorded) else None


def _tuple_form(sig):
    """(length, position) if the signature returns a plain tuple of one
    recorded result and Nones; else None."""
    spec = sig.spec
    # TreeSpec.child(k) where this torch has it (children_specs, before it,
    # warns on torch 2.13)
    children = ([spec.child(k) for k in range(spec.num_children)]
                if hasattr(spec, "child") else spec.children_specs)
    if spec.type is not tuple or spec.num_children != len(sig.kinds) or not all(
            child.is_leaf() for child in children):
        return None
    made = [k for k, kind in enumerate(sig.kinds) if kind[0] != "none"]
    if len(made) != 1 or sig.kinds[made[0]][0] not in ("new", "view"):
        return None
    return len(sig.kinds), made[0]


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


def _record_nested(func, args, kwargs, name, by_entries=False):
    """func over a long sequence as func over groups of MAX_INPUTS tensors,
    joined by _NESTED[func] (itself nested if there are many groups).
    by_entries: each group and the join are called as a user's call is
    (torch.cat's C rule takes them, with eager's checks and errors)."""
    seq, rest = _sequence(args, kwargs)
    kwargs = {k: v for k, v in kwargs.items() if k != "tensors"}
    groups = [list(seq[i:i + MAX_INPUTS]) for i in range(0, len(seq), MAX_INPUTS)]
    if by_entries:
        call, join = getattr(torch, func.__name__), getattr(torch, _NESTED[func].__name__)
        parts = [call(group, *rest, **kwargs) for group in groups]
        return join(parts, *rest, **kwargs)
    parts = [record(func, (group,) + rest, kwargs, name) for group in groups]
    return record(_NESTED[func], (parts,) + rest, kwargs, name)


def _analyse(func, args, kwargs, tensors, name, ruled):
    """The Signature of a call signature's first call (capture.py), its
    program interned; a refused call's holds the reason."""
    try:
        if len(tensors) > MAX_INPUTS and func not in _NESTED:
            sig = Signature()
            sig.split = split_calls.plan(func, args, kwargs, tensors)
            return sig
        sig, program = capture.analyse(func, args, kwargs, tensors, ruled, func in _NESTED)
        if sig.nested:
            _sequence(args, kwargs)     # Unsafe unless a plain list of tensors
        elif program is not None:
            sig.lowering = _intern(program, name)
            sig.lowering.note_layouts(sig)
        return sig
    except WritesInputs as exc:
        return Signature(str(exc), exc.written)
    except Unsafe as exc:
        sig = Signature(str(exc))
        cause = exc.__cause__ or exc.__context__
        if cause is not None and _ran_other_code(cause):
            # Python outside torch and fastlazy ran in the middle of the
            # analysis (a signal handler, a finalizer, a library's own op)
            # and raised: no verdict kept for the signature.  An exception
            # of a type of its own (a handler's timeout) belongs to this
            # call, as in eager; another one runs the call eagerly, where
            # eager judges it
            if not _torch_or_builtin(type(cause)):
                raise cause from None
            sig.transient = True
        return sig


# where the code of torch, of fastlazy and of Python's own library lives
_LIBRARY_FILES = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep
                       for m in (torch, _core, os))


def _ran_other_code(exc) -> bool:
    """Was `exc` raised in, or did it pass through, code outside torch,
    fastlazy and Python's library?"""
    tb = exc.__traceback__
    while tb is not None:
        if not os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(_LIBRARY_FILES):
            return True
        tb = tb.tb_next
    return False


def _torch_or_builtin(kind) -> bool:
    module = kind.__module__ or ""
    return module == "builtins" or module == "torch" or module.startswith("torch.")


def _intern(gm, name):
    key = gm.key if type(gm) is capture.CapturedProgram else capture.program_key(gm.graph)
    with _lock:
        while key not in _lowering_ids:
            index = len(_lowerings)
            if index >= MAX_LOWERINGS:
                # (a node names its lowering in ATTR_GENERIC_OUT_SHIFT bits)
                raise Unsafe(f"{MAX_LOWERINGS} programs were recorded in this process: "
                             "new ones run eagerly")
            lowering = Lowering(index, gm, name)
            # that allocation may have run a finalizer that interned one
            if len(_lowerings) == index and key not in _lowering_ids:
                _lowerings.append(lowering)
                _lowering_ids[key] = index
        return _lowerings[_lowering_ids[key]]


def reset():
    """Forget every signature (not the lowerings: graphs refer to them)."""
    with _lock:
        _signatures.clear()
        _core.forget_generic()
    lifted_floats.forget()
    churn.forget()

