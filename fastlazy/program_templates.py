"""Aten programs shared by call signatures that differ only in their
tensors' sizes.

A generic call's signature includes its tensors' shapes, and its first
call is analysed (capture.py): a run on fake tensors (eager's checks, the
results' metadata, the aten program), 1-5 ms, and a make_fx trace where
the fake run's calls are no program.
A model meets many signatures that trace to the same program -- conv2d
with other channel counts, the same block at a new batch size or sequence
length -- and tracing each again is most of a first call's time and of a
loop over new shapes.

So the first program traced for a *shape-erased* signature (the function,
every non-tensor argument's value -- but the sizes given to a view,
reshape or expand --, each tensor's dtype, rank, device,
requires_grad and whether it is a LazyTensor laid out contiguously, the
grad mode and default dtype) is kept as a template.  A later signature
with the same erased key runs the template instead of tracing -- on meta
tensors beside a meta run of the call itself where both run there
(capture.py), on trial values beside the call's own run where its meta
runs are slow, else on the fake tensors of the call's fake run -- and
takes it only if the template computes exactly the results the call gave:
as many, each with the same shape, strides, storage offset, dtype,
requires_grad and aliasing of the inputs.
A program that baked a size in (a view to fixed sizes the symbolic-size
pass left, a split size, a factory) fails that check -- or raises -- and
the call is traced as before.  A meta run's rejection is not final: an
op's meta kernel may lay its result out unlike the device's kernel (sdpa
takes the math path on meta), so the fake run judges again, and that
signature's meta runs stop.  A template is kept only from a signature that
passed its trial run (capture._run_small), so signatures that take one
skip theirs.  Programs that lift constants or draw
random numbers are never templates (a constant may depend on the shapes).

Nor does equal metadata prove equal values: a composite function may
compute a number from its input's sizes and pass it to an aten op
(take_along_dim wraps its indices by the dim's size, fftshift rolls by half
of it, F.kl_div with reduction="batchmean" divides by the batch), and a
template traced at one size would use that size's number at every other.
So a template whose program passes a number, or a list of numbers, to an
aten op (other than a dim) is checked where it would be taken at sizes that
differ from its own in dims where it was not checked before: the call is
traced as if there were no template, and the template is kept for those
dims only if the trace is its very program, every number the same
(`same_program`).  One that is not is dropped, with every template of its
erased signature, whose calls are traced at each new size from then on.
(A trial run on made-up values, the check before, let both examples
through: their indices and sizes showed no difference on trial values.)
Nor is such a template run on real trial values at sizes it was not
checked at, only on meta or fake tensors: a kernel may trust a number
baked from the template's sizes (mkldnn_rnn_layer an LSTM's hidden size)
and read and write out of bounds (first_fit's `real`).
"""
from __future__ import annotations

import sys
import threading

import torch
import torch.utils._pytree as pytree

from fastlazy import _core, views
from fastlazy._core import LazyTensor

MAX_TEMPLATES = 4096
MAX_PER_KEY = 4

# Functions whose int arguments are the result's shape and nothing else
# (x.view(batch, seq, heads, -1)): for them the sizes are erased too, since
# a view or expansion of a given input is fully determined by the result's
# shape and strides, which the check compares.  (An int that picks a dim,
# as sum's, is never erased: x.sum(1) and x.sum(2) can share a shape.)
_SHAPE_ARGUMENTS = frozenset((torch.Tensor.view, torch.Tensor.reshape, torch.reshape,
                              torch.Tensor.expand))

_lock = threading.Lock()
_templates: dict = {}
_meta_rejected: set = set()
_judge_costs: dict = {}
_refused: set = set()
_stats = {"reused": 0, "rejected": 0, "refused": 0}


def erased_key(func, args, kwargs, tensors):
    """The signature without tensor sizes, or None where templates do not
    apply (autocast, an argument that is not hashable)."""
    if _core.autocast_depth():
        return None
    parts = []
    shape_ints = func in _SHAPE_ARGUMENTS
    try:
        structure = (_plain_structure(args, parts, shape_ints),
                     _plain_structure(kwargs, parts, shape_ints))
    except _NotPlain:
        parts = []
        leaves, structure = pytree.tree_flatten((args, kwargs))
        for leaf in leaves:
            parts.append(_erased(leaf, shape_ints))
    try:
        return ErasedKey((func, structure, tuple(parts), len(tensors),
                          torch.is_grad_enabled(), torch.get_default_dtype()))
    except TypeError:
        return None


class ErasedKey:
    """An erased signature, hashed once: an analysis looks its key up in
    several tables (templates, meta verdicts), and a tuple's hash is
    computed anew at every lookup."""

    __slots__ = ("parts", "_hash")

    def __init__(self, parts):
        self.parts = parts
        self._hash = hash(parts)

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return self is other or (type(other) is ErasedKey and self._hash == other._hash
                                 and self.parts == other.parts)


class _NotPlain(Exception):
    pass


# The containers _plain_structure takes apart as pytree does; any other type
# pytree treats as a node (a namedtuple, an OrderedDict, torch.return_types)
# sends the call to pytree itself.
_PLAIN_CONTAINERS = (tuple, list, torch.Size)


def _plain_structure(value, parts, shape_ints):
    """The arguments' nesting, as plain tuples, their leaves' erased parts
    appended to `parts` in pytree's leaf order: what tree_flatten's TreeSpec
    says, at a fraction of its cost (flattening and hashing a TreeSpec was
    a tenth of a new signature's analysis).  Raises _NotPlain where a
    container is not a tuple, list, torch.Size or dict."""
    kind = type(value)
    if kind in _PLAIN_CONTAINERS:
        return (kind, tuple([_plain_structure(v, parts, shape_ints) for v in value]))
    if kind is dict:
        return (dict, tuple(value), tuple([_plain_structure(v, parts, shape_ints)
                                           for v in value.values()]))
    if kind in pytree.SUPPORTED_NODES or isinstance(value, (tuple, list, dict)):
        raise _NotPlain
    parts.append(_erased(value, shape_ints))
    return None


def _erased(leaf, shape_ints):
    """One argument leaf's part of the erased key."""
    if shape_ints and type(leaf) is int:
        return ("size",)
    if isinstance(leaf, torch.Tensor):
        lazy = type(leaf) is LazyTensor
        return ("tensor", lazy, leaf.dtype, leaf.dim(), leaf.device,
                leaf.requires_grad, lazy and views.traced_contiguous(leaf))
    if type(leaf) is float:
        return (float, leaf.hex())      # -0.0 and nan are values of their own
    if type(leaf) is slice:
        # (x[:, 0]: slices are unhashable before Python 3.12)
        return (slice, leaf.start, leaf.stop, leaf.step)
    return (type(leaf), leaf)


class _Template:
    """A kept program, the input sizes it was traced at, and the sets of
    input dims that differed from those where its values were checked."""
    __slots__ = ("gm", "shapes", "numbers", "checked")

    def __init__(self, gm, shapes):
        self.gm = gm
        self.shapes = shapes
        self.numbers = _passes_numbers(gm)
        self.checked = set()


# An aten argument of these names picks dims, or (a convolution's groups)
# must agree with the weight's shape, or (an adaptive pool's output_size)
# is the result's shape, which the metadata check compares: not a number a
# template could have baked in unseen.
_DIM_ARGUMENTS = frozenset(("dim", "dim0", "dim1", "dims", "start_dim", "end_dim",
                            "source", "destination", "axis", "axis0", "axis1", "groups",
                            "output_size"))


def _passes_numbers(gm) -> bool:
    """Does the program give an aten op a Python number, or a list holding
    one, anywhere but a dim argument (a number its tracing may have
    computed from sizes)?  (The sizes a view takes are the symbolic-size
    pass's nodes, not numbers, but for a -1 it infers.)"""
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        for k, arg in enumerate(node.target._schema.arguments):
            if arg.name in _DIM_ARGUMENTS:
                continue
            value = node.args[k] if k < len(node.args) else node.kwargs.get(arg.name)
            if type(value) in (int, float) or (isinstance(value, (list, tuple)) and any(
                    type(v) in (int, float) and v != -1 for v in value)):
                return True
    return False


def templates(key) -> tuple:
    """The templates kept for erased signature `key`, newest first."""
    return () if key is None else tuple(t.gm for t in _templates.get(key, ()))


def needs_check(key, gm, tensors) -> bool:
    """Must the call on `tensors` be traced to check template `gm` of `key`
    (check_against) before the template computes it?  Where its program
    passes numbers to aten ops and it was not checked at sizes differing
    from its own in the same dims."""
    template = _template(key, gm)
    if template is None or not template.numbers:
        return False
    changed = _changed(template, tensors)
    return bool(changed) and changed not in template.checked


def check_against(key, gm, tensors, traced) -> bool:
    """Judge template `gm` of `key` by `traced`, the call on `tensors`
    traced without it: the same program keeps the template for sizes that
    differ from its own in these dims; another drops the key's templates
    for good (a number it took from its sizes).  Whether it was the same."""
    template = _template(key, gm)
    if template is None:
        return False
    if not same_program(gm, traced):
        refuse(key)
        return False
    template.checked.add(_changed(template, tensors))
    return True


def check_unrun(key, tensors, traced) -> bool:
    """After a call on `tensors` was traced (`traced`) where first_fit
    would not run templates on real values at these sizes: a template
    whose program the trace is, every number the same, is checked for
    sizes that differ from its own in these dims (as by check_against),
    and True returned (the trace need not be kept as a template).  The
    others are left as they are: another erased-alike call's program
    (x.view(2, n, 3, 4) and x.view(2, n, 4, 3) share a key), or one that
    is never run on real values at such sizes unchecked."""
    for gm in templates(key):
        template = _template(key, gm)
        if template is not None and needs_check(key, gm, tensors) and same_program(gm, traced):
            template.checked.add(_changed(template, tensors))
            return True
    return False


def _template(key, gm):
    return next((t for t in _templates.get(key, ()) if t.gm is gm), None)


def _changed(template, tensors):
    return frozenset((i, d) for i, (t, shape) in enumerate(zip(tensors, template.shapes))
                     for d, n in enumerate(shape) if t.shape[d] != n)


def same_program(a, b) -> bool:
    """Do two programs make the same calls on the same arguments, node for
    node (each argument node by its place, every number equal)?"""
    nodes_a, nodes_b = list(a.graph.nodes), list(b.graph.nodes)
    if len(nodes_a) != len(nodes_b):
        return False
    place_a = {n: k for k, n in enumerate(nodes_a)}
    place_b = {n: k for k, n in enumerate(nodes_b)}

    def placed(value, place):
        return pytree.tree_map(
            lambda v: ("node", place[v]) if isinstance(v, torch.fx.Node)
            else (type(v), v.hex() if type(v) is float else v), value)
    for x, y in zip(nodes_a, nodes_b):
        if x.op != y.op or x.target != y.target:
            return False
        if x.op == "placeholder":
            continue
        if placed((x.args, x.kwargs), place_a) != placed((y.args, y.kwargs), place_b):
            return False
    return True


def refuse(key):
    """Drop `key`'s templates and keep none from now on: a template of it
    computed other values than the call at another size."""
    with _lock:
        _templates.pop(key, None)
        if len(_refused) >= MAX_TEMPLATES:
            _refused.clear()
        _refused.add(key)
    _stats["refused"] += 1


def first_fit(key, run, inputs, results, final=True, real=False):
    """(the first of `key`'s templates that computes `results` -- the call's
    own results on `inputs` -- when `run(gm)` runs it on those inputs, else
    None; whether a template ran and computed other results).  A template
    that raises does not fit (a size baked in).  Counted as a reuse, or as
    a rejection where the verdict is `final` (a meta run's is not: the fake
    run judges again).  `real`: the inputs are real tensors (trial values),
    on which a template that passes numbers not checked at their sizes is
    not run at all: a number baked from its own sizes (an LSTM's hidden
    size in mkldnn_rnn_layer) reaches kernels that do not check it against
    the tensors, and they read and write out of bounds (a heap corrupted by
    a bidirectional LSTM of another width).  The call is traced instead
    (capture.py), and that trace checks the template (check_unrun)."""
    disagreed = False
    for gm in templates(key):
        if real and needs_check(key, gm, inputs):
            continue
        try:
            outs = run(gm)
        except Exception:     # noqa: BLE001 - a size baked in
            continue
        if _same_results(outs, inputs, results):
            _stats["reused"] += 1
            return gm, disagreed
        disagreed = True
    _stats["rejected"] += bool(final and templates(key))
    return None, disagreed


def lookup(key, mode, fakes, results):
    """The template for `key` that computes `results` from `fakes` (the
    call's own fake run, in fake mode `mode`), else None."""

    def run(gm):
        with mode:
            return gm(*fakes)
    return first_fit(key, run, fakes, results)[0]


def meta_judges(key) -> bool:
    """May a meta run judge a template for erased signature `key`?  Not
    once it has rejected one there: the op's meta kernel then lays its
    result out unlike the device's (capture.py runs the fake run alone)."""
    return key not in _meta_rejected


def meta_rejected(key):
    _remember(_meta_rejected, key)


# A meta run slower than this (a trial run of a small call takes 0.1-0.5
# ms) lets a trial run judge its erased signature's next call, where a
# trial run can take it.
META_SLOW_SECONDS = 0.5e-3


class _JudgeCosts:
    """What judging a template cost an erased signature: its latest meta
    run and its latest trial run, in seconds, how many meta runs, and
    whether its first imported nothing (meta_kernels_warm: then it tells
    what the signature's meta runs cost)."""
    __slots__ = ("meta", "trial", "meta_runs", "warm")

    def __init__(self):
        self.meta = self.trial = None
        self.meta_runs = 0
        self.warm = False


# the modules whose import makes a process's first meta calls slow (torch's
# Python meta kernels and the decompositions they call)
_META_MODULES = ("torch._meta_registrations", "torch._decomp.decompositions")


def judge_by_trial(key) -> bool:
    """Should a trial run on real values judge a template of erased
    signature `key`, rather than a meta run?  Where its meta runs are the
    slower: an op whose meta kernel is a Python decomposition (addmm, cat,
    sdpa: 0.3-2 ms a meta run) runs its real kernel on small trial tensors
    in less, while a convolution's meta run (30-90 us) beats a trial run
    that computes the convolution twice at the model's sizes (ms).  Judged
    by the latest run of each kind, so a key moves to trial runs when its
    meta runs are slow and back when its trial runs grow slower with the
    sizes; a key's first meta run decides alone only where it imported
    nothing (the first meta call in a process imports torch's meta kernels
    and decompositions: conv2d's took 0.3 s, then 0.05 ms; upsample_bilinear2d's
    Python decomposition takes 8 ms a meta run after that, against
    0.1-0.2 ms for its kernel on trial values, and a segmentation model
    meets it at four sizes in its first call)."""
    if key in _meta_rejected:
        return True               # (its meta runs cannot judge it)
    costs = _judge_costs.get(key)
    if costs is None or costs.meta is None:
        return False
    if costs.trial is None:
        return (costs.meta_runs > 1 or costs.warm) and costs.meta > META_SLOW_SECONDS
    return costs.trial < costs.meta


def meta_kernels_warm() -> bool:
    """Were torch's Python meta kernels imported already (asked before a
    meta run: one that imports them takes a second)?"""
    return all(name in sys.modules for name in _META_MODULES)


def judged(key, by_trial: bool, seconds: float, warm: bool = False):
    """Note what a meta run (or a trial run, `by_trial`) judging a
    template of `key` took; `warm`: a meta run that imported nothing
    (meta_kernels_warm before it), whose time tells."""
    with _lock:
        costs = _judge_costs.get(key)
        if costs is None:
            if len(_judge_costs) >= MAX_TEMPLATES:
                _judge_costs.clear()
            costs = _judge_costs[key] = _JudgeCosts()
    if by_trial:
        costs.trial = seconds
    else:
        if not costs.meta_runs:
            costs.warm = warm
        costs.meta = seconds
        costs.meta_runs += 1


def _remember(keys, key):
    """Add key to one of the sets of erased keys, which start over rather
    than grow past MAX_TEMPLATES (a loop over ever-new signatures)."""
    with _lock:
        if len(keys) >= MAX_TEMPLATES:
            keys.clear()
        keys.add(key)


def keep(key, gm, constants, draws, shapes):
    """Make a freshly traced program a template of its erased signature,
    tried first from now on: it was traced because none of the key's
    templates fit (a size-1 dim makes a transposed input contiguous, and
    its trace takes the view path where larger sizes take a copy), and the
    sizes that come next are likelier to be like this one."""
    if key is None or constants or draws or key in _refused:
        return
    template = _Template(gm, tuple(tuple(shape) for shape in shapes))
    with _lock:
        if len(_templates) >= MAX_TEMPLATES:
            _templates.clear()
        _templates[key] = (template, *_templates.get(key, ()))[:MAX_PER_KEY]


def forget():
    with _lock:
        _templates.clear()
        _meta_rejected.clear()
        _judge_costs.clear()
        _refused.clear()


def stats() -> dict:
    """How many analyses took a template, and how many templates did not
    fit (tests and fastlazy.explain)."""
    return dict(_stats)


def _same_results(outs, fakes, results):
    outs = [v for v in pytree.tree_leaves(outs) if v is not None]
    if len(outs) != len(results):
        return False
    for got, want in zip(outs, results):
        if not isinstance(got, torch.Tensor) or (
                got.shape != want.shape or got.stride() != want.stride()
                or got.storage_offset() != want.storage_offset()
                or got.dtype != want.dtype or got.requires_grad != want.requires_grad):
            return False
        for f in fakes:
            if torch._C._is_alias_of(got, f) != torch._C._is_alias_of(want, f):
                return False
    return True
