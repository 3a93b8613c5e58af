"""The analysis of a call signature's first call, for the generic path.

A call with no C rule is recorded as a small aten program if that program is
pure.  generic.py caches the verdict per signature; the first call of each
is analysed here: run on fake tensors, to check the call (eager would raise:
then eager runs it and raises), read its results' metadata and record the
aten calls it makes, which are its program (aten_recorder.py; make_fx
traces the calls those cannot express); and -- when the inputs are small --
once for real, because fake kernels skip some of the real kernels' checks.  The
program is taken only if it is pure -- no op mutates an input, none is
random, no output shape depends on data -- and every result is a tensor (or
None); anything else raises Unsafe, whose message is the reason the call
runs eagerly.  These runs are costly, which is why they happen once per
signature (the lesson of the trace-time notebook).
"""
from __future__ import annotations

import contextlib
import logging
import operator
import time

import torch
import torch.fx
import torch.utils._pytree as pytree

from fastlazy import _core, host_checks, program_templates, trial_tensors, views
from fastlazy.aten_recorder import Recorder, no_dropout
from fastlazy.symbolic_sizes import make_sizes_symbolic
from fastlazy._core import LazyTensor

MAX_INPUTS = _core.MAX_IN     # tensor arguments of one node

# the reasons a call's analysis gives where its result depends on values,
# and the start of the one where the fake run raised (_why)
_SHAPE_FROM_DATA = "output shape depends on the data"
_VALUES_FROM_DATA = "output depends on the data"
_FAKE_RUN_RAISED = "eager judges the arguments (the fake run raised "

_REFUSED_TAGS = {
    torch.Tag.nondeterministic_seeded: "random (runs eagerly so seeded runs match eager)",
    torch.Tag.dynamic_output_shape: _SHAPE_FROM_DATA,
    torch.Tag.data_dependent_output: _VALUES_FROM_DATA,
    torch.Tag.inplace_view: "changes a tensor's view in place",
}


def values_unseen(reason) -> bool:
    """Is `reason` (an Unsafe call's) one that a value the analysis cannot
    see may have caused?  That its result depends on data (given by the
    fake run's exception, or, where the fake run went through, by the
    refused aten op: "aten.<op>: <reason>"), or that the fake run raised:
    torch 2.14's fake tensor of an eager 0-dim tensor takes the value of
    its uninitialized example, and a size read from it overflows."""
    return reason is not None and (reason.endswith((_SHAPE_FROM_DATA, _VALUES_FROM_DATA))
                                   or reason.startswith(_FAKE_RUN_RAISED))


# Ops whose schemas do not say that they write (in training) their running
# statistics arguments.
_UPDATES_RUNNING_STATS = frozenset(
    getattr(torch.ops.aten, name).default
    for name in ("native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm")
    if hasattr(torch.ops.aten, name))


class Unsafe(Exception):
    """A call the generic path does not record; the message is the reason
    (it runs eagerly, and explain() lists it with that reason)."""


class WritesInputs(Unsafe):
    """Unsafe: the call writes some of its tensor arguments in place
    (F.embedding's max_norm renormalizes the weight's rows).  `written`:
    their positions among the call's tensors (signature_key's order), or
    None where the program does not say which; generic.py hands the
    LazyTensors themselves to the eager run, which must write them and not
    the tensors they were made from."""

    def __init__(self, reason, written):
        super().__init__(reason)
        self.written = written


class Signature:
    """What a call signature's first call showed: the `reason` it is not
    recorded (None if it is); else `kinds`, per result leaf ("new", a "view"
    of an argument, an "input" itself, "none"), `recorded`, the results that
    become nodes, the results' pytree `spec` (None for one recorded result),
    whether they are `detach`ed, the `constants` lifted from the program, the
    random `draws` made at each call (Draw), and the program's `lowering`
    (interned by generic.py); `nested`: a cat-like call recorded as a tree
    of such calls; `sequence`: tuple, list or a torch.return_types
    structseq (torch.topk's) where `spec` is that sequence
    of leaves (results rebuilt without pytree), else None; `split`: the
    fastlazy.split_calls.Plan of a call of more than MAX_INPUTS tensors;
    `retypes_held`: a result is a dtype view of a held argument (views.held), placed at
    each call (generic.record); `result_strides`: {index in `recorded`'s
    numbering: the strides eager gives that result} where a real kernel's
    run showed them, its tensor arguments laid out as `operand_layouts`
    ((shape, strides) each) -- generic.Lowering keeps them for
    fastlazy.layouts."""
    __slots__ = ("reason", "written", "lowering", "kinds", "recorded", "spec", "detach",
                 "nested", "constants", "draws", "sequence", "retypes_held",
                 "operand_layouts", "result_strides", "transient", "views", "split")

    def __init__(self, reason=None, written=()):
        self.retypes_held = False   # a result is a dtype view of a held argument
        self.views = False          # a result is a view of an argument
        self.reason = reason
        self.written = written      # a refused call's WritesInputs.written
        self.nested = False
        self.constants = ()
        self.draws = ()
        self.sequence = None
        self.operand_layouts = ()
        self.result_strides = {}
        self.transient = False      # a refusal not kept for the signature (generic.py)
        self.split = None           # a call recorded in parts (split_calls.Plan)


def substitute(x, it, floats=None):
    """x with every tensor replaced by the next item of `it` (the order of
    signature_key), and every Python float by the next of `floats` if
    given (fastlazy.lifted_floats)."""
    t = type(x)
    if t is LazyTensor or isinstance(x, torch.Tensor):
        return next(it)
    if t is float and floats is not None:
        return next(floats)
    if t is tuple or t is list:
        return t([substitute(v, it, floats) for v in x])
    if t is dict:
        return {k: substitute(v, it, floats) for k, v in x.items()}
    if t is slice:
        return slice(substitute(x.start, it, floats), substitute(x.stop, it, floats),
                     substitute(x.step, it, floats))
    return x


_AS_STRIDED = (torch.ops.aten.as_strided.default, torch.ops.aten.as_strided_.default)


def _places_absolutely(gm) -> bool:
    """Does the program make a view at a storage offset it names
    (`x.as_strided(size, stride, offset)`), not one relative to its input?"""
    return any(n.op == "call_function" and n.target in _AS_STRIDED
               and (len(n.args) > 3 and n.args[3] is not None or "storage_offset" in n.kwargs)
               for n in gm.graph.nodes)


def example_of(t, make=torch.empty):
    """A real tensor standing for argument t in the fake runs (never
    written, so never touched), with t's view geometry."""
    if type(t) is LazyTensor and views.held(t):
        # a slice of a value, keyed by its layout alone: traced as a
        # tensor of its own (its results' places relative to it)
        t = t.to_eager()
    if type(t) is LazyTensor:
        shape, dtype, device, geometry = tuple(t.shape), t.dtype, t.device, views.geometry(t)
        grad = t.requires_grad and (dtype.is_floating_point or dtype.is_complex)
        if geometry is None:
            return make(shape, dtype=dtype, device=device, requires_grad=grad)
        numel, stride, offset = geometry
        base = make(numel, dtype=dtype, device=device, requires_grad=grad)
        return base.as_strided(shape, stride, offset)
    if t.stride() == views.contiguous_strides(t.shape):
        # (a parameter, mostly: a plain tensor becomes a fake one about
        # three times sooner than a view made by as_strided)
        return make(t.shape, dtype=t.dtype, device=t.device).requires_grad_(t.requires_grad)
    # storage for the eager tensor's strides (a slice x[:, ::2] spans more
    # elements than it has)
    span = 0 if 0 in t.shape else 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    example = make(span, dtype=t.dtype, device=t.device).as_strided(t.shape, t.stride())
    return example.requires_grad_(t.requires_grad)


def analyse(func, args, kwargs, tensors, ruled, nestable):
    """(the Signature of func(*args, **kwargs), its aten program or None
    where no result is recorded); `tensors` are the call's tensor arguments
    in signature_key's order.  `ruled`: its row's C rule does not take these
    arguments; `nestable`: a cat-like call, which may hold more than
    MAX_INPUTS tensors (the Signature is then only checked, and `nested`).
    Raises Unsafe with the reason it is not recorded."""
    with _analysing():
        return _analyse(func, args, kwargs, tensors, ruled, nestable)


def aten_program(func, args, kwargs, tensors):
    """(func's aten program as its fake run recorded it -- an FX Graph whose
    placeholders are `tensors`, in signature_key's order, and whose output
    is the tuple of its result tensors --, the result's pytree spec, and
    per leaf whether it is None).  For a call recorded in parts
    (fastlazy.split_calls).  Raises Unsafe where the fake run raises or its
    calls are no such program."""
    if getattr(func, "__wrapped__", func) in _NEVER_ON_FAKES:
        raise Unsafe("calls Python back or reads the tensor's memory (never traced)")
    if len({t.device for t in tensors if t.dim() > 0}) > 1:
        raise Unsafe("tensors on several devices (eager judges)")
    with _analysing():
        _, out, _, recorder = _fake_run(func, args, kwargs, [example_of(t) for t in tensors])
    leaves, spec = pytree.tree_flatten(out)
    graph = recorder.program(_held_results(leaves))
    if graph is None:
        raise Unsafe(f"more than {MAX_INPUTS} tensor arguments, and no plain aten program "
                     f"({recorder.failed or 'a result not made by its calls'})")
    return graph, spec, [v is None for v in leaves]


def _held_results(leaves):
    """A call's result tensors (its result's leaves but None: attn_output,
    None), where LazyTensors can hold them; else Unsafe."""
    results = [v for v in leaves if v is not None]
    if not results or not all(isinstance(v, torch.Tensor) for v in results):
        raise Unsafe("returns something other than tensors")
    for v in results:
        if v.is_nested or v.layout is not torch.strided:
            # (x.to_sparse(), a nested tensor: a LazyTensor's metadata is
            # strided; checked before the program's sizes are traced, which
            # a nested result has none of)
            raise Unsafe(f"a result LazyTensor cannot hold (layout {v.layout}"
                         f"{', nested' if v.is_nested else ''})")
    return results


@contextlib.contextmanager
def _analysing():
    """What a call's analysis runs in: the pending graph held (an
    analysis records nothing), the random generators and the autocast
    cache restored after it, fake_tensor's tracebacks unlogged."""
    held = _core.hold_pending()
    # Tracing a random op (attention with dropout) may draw from the global
    # generator; the call itself then runs eagerly, and must draw what eager
    # would have, so the analysis leaves the generators as it found them.
    cpu_state = torch.random.get_rng_state()
    cuda_states = (torch.cuda.get_rng_state_all()
                   if torch.cuda.is_available() and torch.cuda.is_initialized() else None)
    # Autocast keeps the casts of leaf tensors that require grad for the
    # rest of its context, so a trial tensor (kept for later trial runs:
    # trial_tensors) cast once would come out of that cache in a later
    # analysis, with no cast for the program to record: the cache is off
    # while a call is analysed.
    cache_casts = torch.is_autocast_cache_enabled()
    try:
        torch.set_autocast_cache_enabled(False)
        # fake_tensor logs a traceback for a call its kernel rejects, in the
        # trial run and in the trace (functionalized in-place calls): the
        # user gets eager's own exception from the eager run instead
        with _quiet(_FAKE_LOG):
            yield
    finally:
        torch.set_autocast_cache_enabled(cache_casts)
        torch.random.set_rng_state(cpu_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
        _core.release_pending(held)


# torch.Tensor's methods that call Python back (apply_, map_) or read a
# tensor's memory directly: run on a fake tensor, which has no memory, they
# can crash the process, so they are never analysed; they run eagerly, where
# eager's own checks raise for bad arguments.
_NEVER_ON_FAKES = frozenset(
    getattr(torch.Tensor, name) for name in (
        "apply_", "map_", "map2_", "data_ptr", "storage", "untyped_storage", "_storage",
        "share_memory_", "pin_memory", "is_pinned", "numpy", "tolist", "item",
        "__array__", "__dlpack__", "__dlpack_device__", "element_size", "nbytes")
    if callable(getattr(torch.Tensor, name, None)))


# Indexing takes index tensors on the CPU for a tensor on another device
# (eager moves them there): those do not make a call one of several devices.
_INDEXING = frozenset(
    getattr(torch.Tensor, name) for name in ("__getitem__", "__setitem__", "index_put_",
                                             "index_put"))


def _indexes(func) -> bool:
    while func not in _INDEXING:
        func = getattr(func, "__wrapped__", None)     # (an in-place call's wrapper)
        if func is None:
            return False
    return True


def _host_index(t) -> bool:
    return t.device.type == "cpu" and not t.is_floating_point() and not t.is_complex()


def _analyse(func, args, kwargs, tensors, ruled, nestable, templates=True):
    if getattr(func, "__wrapped__", func) in _NEVER_ON_FAKES:
        raise Unsafe("calls Python back or reads the tensor's memory (never traced)")
    if not any(type(t) is LazyTensor for t in tensors):
        raise Unsafe("no LazyTensor argument at the top of a list")
    if len(tensors) > MAX_INPUTS and not nestable:
        raise Unsafe(f"more than {MAX_INPUTS} tensor arguments")
    if len({t.device for t in tensors if t.dim() > 0}) > 1 and (
            not _indexes(func)
            or len({t.device for t in tensors if t.dim() > 0 and not _host_index(t)}) > 1):
        raise Unsafe("tensors on several devices (eager judges)")
    erased = program_templates.erased_key(func, args, kwargs, tensors) if templates else None
    # 1. the call itself, on fake tensors (eager's checks, the results'
    # metadata), and 2. its aten program -- or both on meta tensors, where a
    # signature of other sizes left a template that computes these results
    on_meta = (_trial_judged(erased, func, args, kwargs, tensors)
               if program_templates.judge_by_trial(erased) and _trial_takes(func, tensors)
               else _meta_run(erased, func, args, kwargs, tensors))
    fakes, out, gm = on_meta or (None, None, None)
    # 1b. or once for real, on trial values, where that run's aten calls are
    # the whole program (no fake run then: 1-7 ms saved per signature)
    trial = None if gm is not None else _trial_run(func, args, kwargs, tensors)
    if trial is not None:
        fakes, out, recorded = trial
    elif gm is None:
        examples = [example_of(t) for t in tensors]
        fakes, out, mode, recorder = _fake_run(func, args, kwargs, examples)
        out = _undefined_as_none(func, args, kwargs, tensors, out)
    leaves, spec = pytree.tree_flatten(out)
    results = _held_results(leaves)
    if len(tensors) > MAX_INPUTS:
        # the whole call was checked on fake tensors just now, so a bad one
        # raised eager's own error for the whole sequence; generic.py
        # records the tree
        sig = Signature()
        sig.nested = True
        return sig, None

    # 2. the aten program: a signature of other sizes' (program_templates)
    # where it computes these very results, else traced
    if gm is None:
        # (also where the meta run rejected the template: an op's meta
        # kernel may lay out its result unlike the device's own -- sdpa on
        # meta takes the math path, whose output strides differ from the
        # CPU flash kernel's -- and the fake or trial run is the judge then)
        gm = (program_templates.first_fit(erased, lambda gm: gm(*fakes), fakes, results,
                                          real=True)[0]
              if trial is not None else program_templates.lookup(erased, mode, fakes, results))
    templated = gm is not None
    if templated and program_templates.needs_check(erased, gm, tensors):
        # its program passes numbers, which may be its own sizes': the call
        # traced judges it (and is the call's program either way)
        sig, traced = _analyse(func, args, kwargs, tensors, ruled, nestable, templates=False)
        if traced is not None:
            program_templates.check_against(erased, gm, tensors, traced)
        return sig, traced
    if templated:
        constants, draws = [], []
    else:
        contiguous = [type(t) is LazyTensor and views.traced_contiguous(t) for t in tensors]
        # the aten calls the fake run made, where they are the program (not
        # for a call functionalized: its writes become copies in make_fx's trace)
        if trial is None:
            recorded = (None if getattr(func, "functionalize", False)
                        else recorder.program(results))
        if recorded is not None:
            constants = tuple(n.meta["constant"] for n in recorded.nodes
                              if n.op == "placeholder" and "constant" in n.meta)
            draws = lift_draws(recorded)
            gm = checked(recorded, contiguous)
        else:
            gm, constants, draws = _trace(func, args, kwargs, examples, contiguous)
        host_checks.keep_argument_checks(func, args, kwargs, gm.graph)
    if len(tensors) + len(constants) + len(draws) > MAX_INPUTS:
        raise Unsafe(f"more than {MAX_INPUTS} tensor arguments, constants and random draws")
    outputs = list(gm.graph.nodes)[-1].args[0]
    if len(outputs) != len(results):
        raise Unsafe("the traced program's outputs differ from the call's")

    sig = Signature()
    sig.constants = constants
    sig.draws = draws
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
        if node in placeholders and placeholders.index(node) >= len(tensors):
            raise Unsafe("returns a constant or a random draw itself")
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
            if views.held(tensors[i]) and _places_absolutely(gm):
                # traced as a tensor of its own, the held view's place is
                # not the storage offset the call names
                raise Unsafe("as_strided with a storage offset, of a held slice")
            if views.held(tensors[i]) and leaf.dtype.itemsize != fakes[i].dtype.itemsize:
                # placed in bytes from the held view's place, where that
                # is a whole number of the result's elements (checked at
                # each call: generic.record)
                sig.retypes_held = True
            # how its values follow from its place (ViewFlag): a detached
            # view, a conj() view (eager's conjugate bit, which the place
            # alone does not say: writes through it and refreshes after a
            # write to its root conjugate, mutation.py)
            flags = ((_core.ViewFlag.VIEW_DETACHED if fakes[i].requires_grad and not leaf.requires_grad
                      else 0)
                     | (_core.ViewFlag.VIEW_CONJ if leaf.is_conj() != fakes[i].is_conj() else 0))
            sig.kinds.append(("view", i, (tuple(leaf.shape), leaf.stride(),
                                          leaf.storage_offset()), flags))
            sig.views = True
        else:
            sig.kinds.append(("new",))
        sig.recorded.append((index, leaf.dtype, tuple(leaf.shape), leaf.requires_grad))
    if single and sig.kinds[0][0] != "input":
        sig.spec = None
    elif (spec.type in (tuple, list) or is_structseq(spec.type)) \
            and spec.num_children == len(leaves) \
            and pytree.tree_structure(spec.type([0] * len(leaves))) == spec:
        sig.sequence = spec.type
    # A template's own signature passed its trial run (it is kept only
    # then), and a signature that takes it differs in sizes alone, which the
    # fake or meta run checked: no second trial.
    # (Under autocast the trial run is no plain run: the recorder's
    # dispatch mode runs the kernel with autocast's keys excluded, so a
    # kernel that casts inside itself under autocast -- the fused
    # transformer layer's -- gave its results without the casts, as the
    # recorded program, run without autocast, will; eager's kernel casts.)
    trial_under_autocast = trial is not None and _core.autocast_depth()
    # Nor is it eager's run in another way: ATen's composite functions
    # take their tensor-subclass branch under any dispatch mode
    # (isTensorSubclassLike), where eager's own branch may refuse the
    # arguments (max_pool1d of an int64 tensor) or lay its result out
    # otherwise.  So a plain run judges too, where it draws nothing from
    # the user's random stream; it costs a few microseconds beside the
    # trial's hundreds.
    plain_run = trial is not None and not templated and not draws
    real = None
    if (trial is None and (not templated or ruled)) or trial_under_autocast or plain_run:
        real = _run_small(func, args, kwargs, tensors, results, ruled,
                          "the fake kernel's result metadata differs from eager's"
                          if trial is None else
                          "its kernel casts inside itself under autocast"
                          if trial_under_autocast else
                          "its result's metadata under a dispatch mode differs from eager's")
    if real is None and trial is not None:
        real = results              # (the trial run's: the real kernel's)
    if real is not None:
        # a result's strides as the real kernel laid it out, from arguments
        # laid out as the fake or trial ones were (fastlazy.layouts: a
        # pending result's stride() then needs no value)
        sig.operand_layouts = tuple((tuple(f.shape), tuple(f.stride())) for f in fakes)
        sig.result_strides = {index: tuple(real[index].stride())
                              for index, *_ in sig.recorded}
    if trial is not None and not templated:
        _forget_values(gm.graph)
    if not templated and erased is not None and not (
            trial is not None and program_templates.check_unrun(erased, tensors, gm)):
        program_templates.keep(erased, gm, constants, draws, [t.shape for t in tensors])
    sig.detach = (not torch.is_grad_enabled()
                  and any(t.requires_grad for t in tensors))
    sig.lowering = None       # generic.py interns the program
    return sig, (gm if sig.recorded else None)


def _undefined_as_none(func, args, kwargs, tensors, out):
    """The fake run's result `out`, with None where the real kernel leaves
    a result undefined, which eager returns as None: a fake kernel makes an
    empty tensor there (_native_multi_head_attention's attention weights
    without need_weights), which recorded would be a LazyTensor where
    eager gives None.  Where the fake run made an empty result of inputs
    that are not empty, one real run on trial values, whatever their size
    (the trial run that takes smaller calls shows it already), says which
    results are None."""
    leaves, spec = pytree.tree_flatten(out)
    if not any(isinstance(v, torch.Tensor) and v.numel() == 0 for v in leaves) \
            or any(t.numel() == 0 for t in tensors):
        return out
    trial = _trial_tensors(tensors)
    a, k = substitute((args, kwargs), iter(trial))
    try:
        real = pytree.tree_leaves(func(*a, **k))
    except Exception:     # noqa: BLE001 - eager judges the arguments where the graph runs
        return out
    if len(real) != len(leaves):
        return out
    return pytree.tree_unflatten(
        [None if r is None and isinstance(f, torch.Tensor) and f.numel() == 0 else f
         for f, r in zip(leaves, real)], spec)


def _meta_run(erased, func, args, kwargs, tensors):
    """(meta tensors standing for `tensors`, func's result on them, the
    template of signature `erased` if it computes that result, else None),
    or None where there is no template or the meta run cannot judge it (it
    raises, or makes a tensor off the meta device) -- the fake run then
    decides.  A meta run is the fake run without FakeTensorMode's
    dispatch: 20-50x cheaper for the ops models repeat at many sizes (a
    batch_norm 0.8 ms against 15-50 ms, a conv2d 25 us against 1.2 ms), and
    as good a judge where a template exists, since the op's program already
    passed the fake run at other sizes."""
    if not program_templates.templates(erased) or len({t.device for t in tensors}) > 1 \
            or not program_templates.meta_judges(erased):
        return None
    if any(t.numel() == 0 for t in tensors):
        # the checks eager makes of empty inputs (a reduction over an empty
        # dim) are its kernels', which a meta run does not call
        return None
    warm = program_templates.meta_kernels_warm()
    start = time.perf_counter()
    try:
        return _meta_judged(erased, func, args, kwargs, tensors)
    finally:
        program_templates.judged(erased, False, time.perf_counter() - start, warm)


def _meta_judged(erased, func, args, kwargs, tensors):
    try:
        metas = [example_of(t, _meta_empty) for t in tensors]
        ma, mk = substitute((args, kwargs), iter(metas))
        out = func(*ma, **mk)
    except Exception:     # noqa: BLE001 - no meta kernel, or eager would raise
        return None
    results = [v for v in pytree.tree_leaves(out) if v is not None]
    if not all(isinstance(v, torch.Tensor) and v.is_meta for v in results):
        return None
    gm, disagreed = program_templates.first_fit(erased, lambda gm: gm(*metas), metas,
                                                results, final=False)
    if disagreed and gm is None:
        program_templates.meta_rejected(erased)
    return metas, out, gm


def _trial_judged(erased, func, args, kwargs, tensors):
    """As _meta_run, for a signature whose meta runs are the slower
    (program_templates.judge_by_trial: addmm, cat, sdpa have Python meta
    kernels): the call and its templates run on trial values instead,
    without the aten recorder, which only a signature no template fits
    needs (its trial run follows); None where there is no template, the
    call raises there, or none fits."""
    if not program_templates.templates(erased):
        return None
    start = time.perf_counter()
    try:
        return _trial_judged_run(erased, func, args, kwargs, tensors)
    finally:
        program_templates.judged(erased, True, time.perf_counter() - start)


def _trial_judged_run(erased, func, args, kwargs, tensors):
    trial = _trial_tensors(tensors)
    a, k = substitute((args, kwargs), iter(trial))
    try:
        out = func(*a, **k)
    except Exception:     # noqa: BLE001 - the trial run judges, and raises Unsafe
        return None
    results = [v for v in pytree.tree_leaves(out) if v is not None]
    if not all(isinstance(v, torch.Tensor) for v in results):
        return None
    gm = program_templates.first_fit(erased, lambda gm: gm(*trial), trial, results,
                                     final=False, real=True)[0]
    return None if gm is None else (trial, out, gm)


def _meta_empty(shape, dtype, device, requires_grad=False):
    return torch.empty(shape, dtype=dtype, device="meta", requires_grad=requires_grad)


def _fake_run(func, args, kwargs, examples):
    """(the fake tensors standing for `examples`, func's result on them, the
    fake mode, the Recorder of the aten calls it made)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    try:
        # (fake_tensor logs a traceback for a call its kernel rejects; the
        # user gets eager's own exception from the eager run instead)
        with _quiet(_FAKE_LOG), FakeTensorMode(allow_non_fake_inputs=False) as mode:
            fakes = [mode.from_tensor(e) for e in examples]
            fa, fk = substitute((args, kwargs), iter(fakes))
            with Recorder(fakes, _numbers((args, kwargs))) as recorder:
                out = func(*fa, **fk)
            return fakes, out, mode, recorder
    except Exception as exc:     # eager raises too, or the op has no fake kernel
        raise Unsafe(_why(exc)) from None


_FAKE_LOG = logging.getLogger("torch._subclasses.fake_tensor")


def quiet_fake_log():
    """A context in which fake_tensor logs no traceback for a call its
    kernel rejects (eager's own error reaches the user instead)."""
    return _quiet(_FAKE_LOG)


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
        return _SHAPE_FROM_DATA
    if isinstance(exc, fake_tensor.DataDependentOutputException):
        return _VALUES_FROM_DATA
    if isinstance(exc, fake_tensor.UnsupportedOperatorException):
        return "no fake-tensor kernel"
    return f"{_FAKE_RUN_RAISED}{type(exc).__name__})"


# Inputs up to this many elements in all get a real run when a signature is
# first seen; larger ones rely on the fake run's checks alone.
REAL_CHECK_NUMEL = 1 << 20


def _trial_tensors(tensors, fill=0):
    """Real tensors standing for `tensors` in a trial run, with their view
    geometry and trial values (fastlazy.trial_tensors: floats uniform in
    [0, 1), integers and bools all `fill`)."""
    make = trial_tensors.maker(torch.Generator().manual_seed(0), fill)
    return [example_of(t, make) for t in tensors]


# A trial run whose aten calls include one of these read the trial values
# to decide a shape or a Python value: its program would hold the trial's
# decision, so the fake run (which raises for them) judges instead.
_READS_VALUES = (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output)


def _trial_takes(func, tensors):
    """May a trial run stand for the fake run of this call (before its
    aten calls are seen)?  (A call functionalized, mutation.py's in-place
    write of a copy, may: its writes are to the copy, which the program
    makes, and a write to an input fails the recording.)"""
    return sum(t.numel() for t in tensors) <= REAL_CHECK_NUMEL


def _trial_run(func, args, kwargs, tensors):
    """(the trial tensors standing for `tensors`, func's result on them, its
    aten program as recorded) from a real run on trial values, or None
    where that cannot stand for the fake run: inputs larger than a trial
    run's budget; aten calls that are no plain program or read values.  The real run is the better judge where it
    applies: its results' metadata are the kernel's own (fake kernels
    differ in corners: sdpa's strides, pow's dtype), and it is the trial
    run _run_small would make anyway.

    Integer and bool tensor arguments (indices, masks) are run twice, all
    zeros and all ones (all -1 where ones raise: an index into a dim of
    size 1): a C++ kernel may read their values on the host
    without an aten call (tensor_split's indices) and pass what it read to
    the aten calls it makes, which would bake the trial's values into the
    program.  The two runs must make the same program with results of the
    same metadata; where they differ, or either raises (eager judges those
    values when the graph runs), the fake run judges.  A floating-point
    call that raises raises Unsafe (eager judges the arguments at the
    call, as after a failed trial)."""
    if not _trial_takes(func, tensors):
        return None
    indices = not all(t.dtype.is_floating_point or t.dtype.is_complex for t in tensors)
    first = _recorded_trial(func, args, kwargs, tensors, 0, judges=not indices)
    if first is None or not indices:
        return first
    # all ones, or where that is no valid index (a dim of size 1), all -1
    second = (_recorded_trial(func, args, kwargs, tensors, 1, judges=False)
              or _recorded_trial(func, args, kwargs, tensors, -1, judges=False))
    return first if second is not None and _same_run(first, second) else None


def _recorded_trial(func, args, kwargs, tensors, fill, judges):
    """(trial tensors, result, recorded program) of one trial run with
    integer values `fill`, or None where it is no plain program; a run
    that raises raises Unsafe if the trial `judges` the arguments, else
    gives None."""
    trial = _trial_tensors(tensors, fill)
    a, k = substitute((args, kwargs), iter(trial))
    try:
        with Recorder(trial, _numbers((args, kwargs))) as recorder:
            out = func(*a, **k)
    except Exception as exc:
        if not judges:
            return None
        raise Unsafe(f"eager judges the arguments (a trial run raised "
                     f"{type(exc).__name__})") from None
    results = [v for v in pytree.tree_leaves(out) if v is not None]
    if not all(isinstance(v, torch.Tensor) for v in results):
        return None
    recorded = recorder.program(results)
    if recorded is None or any(_reads_values(node) for node in recorded.nodes):
        return None
    if getattr(func, "functionalize", False) and any(
            node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
            and _SEEDED in node.target.tags for node in recorded.nodes):
        # a random fill of the written copy (x.uniform_()): make_fx's
        # functionalized trace is the form whose draw lift_draws lifts
        return None
    return trial, out, recorded


def _reads_values(node):
    """Did this recorded aten call read its inputs' values to decide a
    shape or a Python value?  Indexing with integer index tensors is
    tagged so for the boolean masks it also takes, but its shape is the
    indices' (as in checked's exception for the fake run)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    if not any(tag in node.target.tags for tag in _READS_VALUES):
        return False
    if node.target in _SHAPE_FROM_FAKE:
        indices = [i for i in node.args[1] if i is not None]
        return not all(i.meta["val"].dtype in (torch.int64, torch.int32) for i in indices)
    return True


_NUMBER_TYPES = (bool, int, float, complex)


def _numbers(arguments):
    """The Python numbers among a call's arguments (a bool is one too),
    and the lists of them (an index [0, 2]; nested lists of one depth
    each), anywhere in its lists, tuples and dicts."""
    found = []

    def visit(value):
        if type(value) in _NUMBER_TYPES:
            found.append(value)
        elif type(value) is dict:
            for item in value.values():
                visit(item)
        elif type(value) in (list, tuple) and value:
            if type(value) is list and _number_list(value):
                found.append(value)
            for item in value:
                visit(item)
    visit(arguments)
    return tuple(found)


def _number_list(value):
    """A list of numbers, or of such lists of one length."""
    if all(type(v) in _NUMBER_TYPES for v in value):
        return True
    return (all(type(v) is list and v and _number_list(v) for v in value)
            and len({len(v) for v in value}) == 1)


def _same_run(first, second):
    """Did two trial runs make the same program, with results of the same
    structure and metadata?"""
    (_, out1, program1), (_, out2, program2) = first, second
    leaves1, spec1 = pytree.tree_flatten(out1)
    leaves2, spec2 = pytree.tree_flatten(out2)
    return (spec1 == spec2 and program_key(program1) == program_key(program2)
            and [_layout(v) for v in leaves1] == [_layout(v) for v in leaves2])


def _layout(value):
    if not isinstance(value, torch.Tensor):
        return value
    return value.dtype, value.shape, value.stride(), value.storage_offset()


def _forget_values(graph):
    """Drop the trial run's tensors from a program kept in the caches (its
    nodes' metadata): only its code is used from now on."""
    for node in graph.nodes:
        node.meta.pop("val", None)


def is_structseq(kind) -> bool:
    """Is `kind` a struct sequence type (torch.return_types.topk, max...):
    a tuple subclass made from a sequence of its fields?"""
    return isinstance(kind, type) and issubclass(kind, tuple) and hasattr(kind, "n_fields")


def _run_small(func, args, kwargs, tensors, fakes, ruled,
               differs="the fake kernel's result metadata differs from eager's"):
    """Run the call once for real when that is cheap: fake kernels do not
    make every check the real kernel makes (var of an int64 tensor passes on
    fake tensors), and eager's error belongs at the call.  (An error that
    depends on the values can only surface when the graph runs, as in every
    lazy tensor system; a call the trial values make fail runs eagerly.)
    Nor do they always agree with the real kernel on the results' dtype
    (pow of a bool tensor and a bool is int64 on fake tensors, bool in
    eager): such a call runs eagerly too.  Without a trial run, a call its
    row's C rule does not take (these are the corners where fake kernels
    and eager part ways) runs eagerly.  Under autocast the run is made
    whatever the size: a kernel that casts inside itself gives its dtypes
    in no other run (and a signature is analysed once).  The real results,
    or None where the call was too large to run."""
    if sum(t.numel() for t in tensors) > REAL_CHECK_NUMEL and not _core.autocast_depth():
        if ruled:
            raise Unsafe("its C rule does not take these arguments, and they are too "
                         "large for a trial run")
        return
    trial = _trial_tensors(tensors)
    try:
        a, k = substitute((args, kwargs), iter(trial))
        out = func(*a, **k)
    except Exception as exc:
        raise Unsafe(f"eager judges the arguments (a trial run raised "
                     f"{type(exc).__name__})") from None
    real = [v for v in pytree.tree_leaves(out) if v is not None]
    if [(v.dtype, v.shape) for v in real] != [(v.dtype, v.shape) for v in fakes]:
        raise Unsafe(differs)
    return real


# Exceptions to _REFUSED_TAGS: an attention kernel tagged random for its
# dropout, called with none (no_dropout); an in-place view op on the
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
    return _written_inputs(node, inputs) != frozenset()


def _written_inputs(node, inputs):
    """The positions of the program's inputs this aten call writes (or
    writes a view of): a frozenset, or None where it cannot tell."""
    found = set()
    for k, arg in enumerate(node.target._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = node.args[k] if k < len(node.args) else node.kwargs.get(arg.name)
        for written in (value if isinstance(value, (list, tuple)) else [value]):
            fake = written.meta.get("val") if isinstance(written, torch.fx.Node) else None
            if not isinstance(fake, torch.Tensor):
                return None             # cannot tell: assume the worst
            found.update(i for i, t in enumerate(inputs)
                         if isinstance(t, torch.Tensor) and torch._C._is_alias_of(fake, t))
    return frozenset(found)


def _trace(func, args, kwargs, examples, contiguous):
    """The aten program of the call.  Inputs flagged `contiguous` were traced
    as contiguous tensors, but their values may have any layout at run time
    (a LazyTensor that is not a view is contiguous as far as its user can
    tell): the program starts by making them so, as it would have had to
    (a kernel that wants contiguous input, a view(-1))."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def program(*ts):
        a, k = substitute((args, kwargs), iter(ts))
        return func(*a, **k)
    if getattr(func, "functionalize", False):
        program = torch.func.functionalize(program)
    try:
        gm = make_fx(program, tracing_mode="fake")(*examples)
    except Exception as exc:
        raise Unsafe(f"not traceable to aten ({type(exc).__name__})") from None
    constants = lift_constants(gm)
    draws = lift_draws(gm)
    return checked(gm, contiguous), constants, draws


# aten ops whose kernels take any strides and lay their results out from
# their inputs' as eager's call does.  A program made only of them runs on
# its inputs as they are laid out; any other program was traced on
# contiguous inputs and gets them so (a kernel may read memory as laid out
# in the trace: a composite's .contiguous() of a contiguous trial input
# left no call in the program -- embedding_bag's offsets).
_aten = torch.ops.aten
_TAKES_ANY_LAYOUT = frozenset({
    _aten.convolution.default, _aten._native_batch_norm_legit_functional.default,
    _aten._native_batch_norm_legit_no_training.default, _aten._native_batch_norm_legit.default,
    _aten._native_batch_norm_legit.no_stats, _aten.native_batch_norm.default,
    _aten.max_pool2d_with_indices.default, _aten.avg_pool2d.default,
    _aten._adaptive_avg_pool2d.default, _aten.mean.dim, _aten.sum.dim_IntList,
    _aten.amax.default, _aten.cat.default, _aten.clone.default, _aten._to_copy.default,
    _aten.slice.Tensor, _aten.select.int, _aten.permute.default, _aten.transpose.int,
    _aten.expand.default, _aten.unsqueeze.default, _aten.squeeze.dim, _aten.alias.default,
    _aten.detach.default})


def _takes_any_layout(graph):
    return all(n.op != "call_function" or n.target is operator.getitem
               or n.target in _TAKES_ANY_LAYOUT or torch.Tag.pointwise in n.target.tags
               for n in graph.nodes)


def checked(program, contiguous):
    """A call's aten program (a GraphModule traced, or a Graph recorded) as
    a GraphModule, once it has passed the purity checks (else Unsafe), with
    sizes read from its inputs and its outputs a flat tuple; `contiguous`
    as for _trace."""
    graph = program if isinstance(program, torch.fx.Graph) else program.graph
    inputs = [n.meta.get("val") for n in graph.nodes if n.op == "placeholder"]
    for node in graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        target = node.target
        if not isinstance(target, torch._ops.OpOverload):
            raise Unsafe(f"calls {target} (not an aten op)")
        if target._schema.is_mutable:
            written = _written_inputs(node, inputs)
            if written != frozenset():
                raise WritesInputs(f"{target} mutates its input", written)
        if target in _UPDATES_RUNNING_STATS and node.args[5] and node.args[3] is not None:
            raise Unsafe("updates batch-norm running statistics in place (eager buffers)")
        for tag, reason in _REFUSED_TAGS.items():
            if tag in target.tags \
                    and not (tag is _SEEDED and no_dropout(target, node.args, node.kwargs)) \
                    and not (tag is _DYNAMIC_SHAPE and target in _SHAPE_FROM_FAKE) \
                    and not (tag is _INPLACE_VIEW and not _writes_an_input(node, inputs)):
                raise Unsafe(f"{target}: {reason}")
        if target is torch.ops.aten._local_scalar_dense.default:
            raise Unsafe("reads a tensor's value")
    host_checks.keep(graph)
    _differentiable_copies(graph)
    make_sizes_symbolic(graph)         # (before the nodes below, which have no metadata)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if any(contiguous) and _takes_any_layout(graph):
        # (a convolution or batch norm of a channels-last tensor is
        # channels-last, computed by the channels-last kernel, as in eager)
        contiguous = ()
    for node, flag in zip(placeholders, contiguous):
        if flag and node.users:
            with graph.inserting_after(placeholders[-1]):
                made = graph.call_function(torch.ops.aten.contiguous.default, (node,))
            node.replace_all_uses_with(made, delete_user_cb=lambda user: user is not made)
    output = list(graph.nodes)[-1]
    leaves = [v for v in pytree.tree_leaves(output.args[0]) if v is not None]
    if not all(isinstance(v, torch.fx.Node) for v in leaves):
        raise Unsafe("returns something other than tensors")
    output.args = (tuple(leaves),)
    if isinstance(program, torch.fx.Graph):
        return CapturedProgram(graph)
    program.recompile()
    return program


class CapturedProgram:
    """A recorded aten program: its FX graph (placeholders, aten calls, one
    output), and the GraphModule showing its code, made when asked for.
    Making one generates and compiles Python code, 0.4-0.7 ms a program:
    backends lower the graph, programs are interned by program_key, and a
    program template judged at another size runs by walking its graph
    (a few nodes, run once or twice per new signature)."""
    __slots__ = ("graph", "_module", "_key")

    def __init__(self, graph):
        self.graph = graph
        self._module = None
        self._key = None

    @property
    def key(self):
        """program_key of its graph, made once: a template's program is
        interned again by every signature that takes it (20-40 us a key)."""
        if self._key is None:
            self._key = program_key(self.graph)
        return self._key

    @property
    def module(self) -> torch.fx.GraphModule:
        if self._module is None:
            self._module = torch.fx.GraphModule(torch.nn.Module(), self.graph)
        return self._module

    @property
    def code(self) -> str:
        return self.module.code

    def __call__(self, *args):
        values = {}
        given = iter(args)
        for node in self.graph.nodes:
            if node.op == "placeholder":
                values[node] = next(given)
            elif node.op == "call_function":
                # (an aten op's own callable: OpOverload.__call__ is patched to
                # watch for writes, which a run on fake, meta or trial tensors
                # cannot make)
                op = getattr(node.target, "_op", node.target)
                values[node] = op(*torch.fx.node.map_arg(node.args, values.__getitem__),
                                  **torch.fx.node.map_arg(node.kwargs, values.__getitem__))
            else:
                return torch.fx.node.map_arg(node.args[0], values.__getitem__)
        raise AssertionError("a captured program without an output")


def program_key(graph):
    """What makes two captured programs the same program (generic.py
    interns them by it): each node's op, target and arguments, with nodes
    as their positions and every constant with its type (0.0 and -0.0, 1
    and True stay apart, as they do in code)."""
    position = {}
    key = []
    for k, node in enumerate(graph.nodes):
        position[node] = k
        key.append((node.op, node.target, _key_of(node.args, position),
                    _key_of(tuple(node.kwargs.items()), position)))
    return tuple(key)


def _key_of(value, position):
    if isinstance(value, torch.fx.Node):
        return ("node", position[value])
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(_key_of(v, position) for v in value))
    if isinstance(value, slice):
        return ("slice", _key_of((value.start, value.stop, value.step), position))
    if isinstance(value, torch.Tensor):      # (a constant: this very one)
        return ("tensor", id(value))
    return (type(value).__name__, repr(value))


def _differentiable_copies(graph):
    """Functionalization turns a write of a tensor's elements (`y[1] = v`,
    `y.copy_(v)`) into aten.copy(y, v), which has no derivative: a program
    that builds autograd history through it would fail at backward where
    eager's copy_ succeeds.  The same values as v broadcast to y's shape and
    cast to its dtype and device (what copy computes, contiguous as a copy
    of a contiguous y is) come from expand and _to_copy, which have
    derivatives."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.copy.default:
            continue
        into, source = node.args[0], node.args[1]
        value, made = into.meta["val"], source.meta["val"]
        with graph.inserting_before(node):
            spread = graph.call_function(torch.ops.aten.expand.default,
                                            (source, list(value.shape)))
            spread.meta["val"] = made.expand(value.shape)
            copied = graph.call_function(
                torch.ops.aten._to_copy.default, (spread,),
                {"dtype": value.dtype, "device": value.device,
                 "memory_format": torch.contiguous_format})
            copied.meta["val"] = node.meta["val"]
        node.replace_all_uses_with(copied)
        graph.erase_node(node)


class Draw:
    """A random draw of a captured program, made at each call instead of in
    the graph: `target` (a random aten op) on fresh tensors of the
    `carriers`' metadata (shape, stride, dtype, device: the values are never
    read), with constant `args`.  It consumes the generator exactly as the
    eager call does at that point, so seeded runs stay eager's bit for bit."""
    __slots__ = ("target", "args", "kwargs", "_op", "_carried")

    def __init__(self, target, args, kwargs):
        self.target, self.args, self.kwargs = target, args, kwargs
        # the operator itself, not OpOverload.__call__: watch.py's wrapper
        # of that flushes pending nodes that read what the call writes, and
        # a draw writes only the fresh tensors made here (a transformer's
        # training step draws a dozen times)
        self._op = getattr(target, "_op", target)
        self._carried = [k for k, a in enumerate(args) if type(a) is _Carrier]

    def __call__(self):
        args = list(self.args)
        for k in self._carried:
            a = args[k]
            args[k] = torch.empty_strided(a.shape, a.stride, dtype=a.dtype, device=a.device)
        if not self.kwargs:
            return self._op(*args)
        return self._op(*args, **{k: _real(v) for k, v in self.kwargs.items()})


def _real(a):
    if type(a) is _Carrier:
        return torch.empty_strided(a.shape, a.stride, dtype=a.dtype, device=a.device)
    return a


class _Carrier:
    __slots__ = ("shape", "stride", "dtype", "device")

    def __init__(self, fake):
        self.shape, self.stride = tuple(fake.shape), fake.stride()
        self.dtype, self.device = fake.dtype, fake.device


# ops that make a tensor whose values no one reads before a random fill
# overwrites them
_CARRIERS = frozenset({torch.ops.aten.empty_like.default, torch.ops.aten.empty.memory_format,
                       torch.ops.aten.empty_strided.default,
                       torch.ops.aten.new_empty.default,
                       torch.ops.aten.new_empty_strided.default})
# random ops whose tensor arguments give only metadata (functional fills,
# the form in-place fills take in a functionalized program)
_METADATA_ONLY = frozenset(
    getattr(getattr(torch.ops.aten, name), overload)
    for name, overload in (("rand_like", "default"), ("randn_like", "default"),
                           ("uniform", "default"), ("bernoulli", "p"),
                           ("normal_functional", "default"), ("exponential", "default"),
                           ("geometric", "default"), ("log_normal", "default"),
                           ("cauchy", "default"), ("random", "default"),
                           ("random", "from"), ("random", "to"))
    if hasattr(getattr(torch.ops.aten, name, None), overload))


def lift_draws(program):
    """Random ops whose draw depends on metadata and constants alone -- an
    in-place fill (bernoulli_, uniform_, normal_...) of a freshly made
    tensor, rand_like, randn_like -- become inputs of the program, drawn at
    each call (Draw): dropout inside a decomposed kernel (attention's math
    path) is then recorded like the rest.  Any other random op stays, and
    the purity check refuses the call.  `program`: a GraphModule (traced)
    or a Graph (recorded)."""
    graph = program if isinstance(program, torch.fx.Graph) else program.graph
    draws = []
    order = {n: k for k, n in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        target = node.target
        if (node.op != "call_function" or not isinstance(target, torch._ops.OpOverload)
                or _SEEDED not in target.tags or no_dropout(target, node.args, node.kwargs)):
            continue
        carrier = _fill_carrier(node, order)
        if carrier is None and target not in _METADATA_ONLY:
            continue
        if any(isinstance(a, torch.fx.Node) and (a is not carrier and target not in _METADATA_ONLY)
               for a in (*node.args, *node.kwargs.values())):
            continue                   # reads another tensor's values (bernoulli(p))
        def template(a):
            if isinstance(a, torch.fx.Node):
                return _Carrier(a.meta["val"])
            if isinstance(a, (list, tuple)) and any(isinstance(v, torch.fx.Node) for v in a):
                raise Unsafe("a random op with a list of tensors")
            return a
        draw = Draw(target, tuple(template(a) for a in node.args),
                    {k: template(v) for k, v in node.kwargs.items()})
        last = [n for n in graph.nodes if n.op == "placeholder"][-1]
        with graph.inserting_after(last):
            placeholder = graph.placeholder(f"draw{len(draws)}")
        placeholder.meta.update(node.meta)
        # the program may write the drawn tensor (dropout's div_): a copy of
        # its own, so the input stays as drawn
        with graph.inserting_after(placeholder):
            drawn = graph.call_function(torch.ops.aten.clone.default, (placeholder,))
        drawn.meta.update(node.meta)
        drawn.meta["val"] = node.meta["val"].clone()    # its own storage, as a copy has
        node.replace_all_uses_with(drawn)
        if carrier is not None:
            carrier.replace_all_uses_with(drawn, delete_user_cb=lambda u: u is not node)
        graph.erase_node(node)
        if carrier is not None and not carrier.users:
            graph.erase_node(carrier)
        draws.append(draw)
    if draws and not isinstance(program, torch.fx.Graph):
        program.recompile()
    return tuple(draws)


def _fill_carrier(node, order):
    """The tensor an in-place random fill overwrites, if it was made in the
    program for it (empty_like...) and nothing reads it before the fill."""
    schema = node.target._schema
    if not schema.arguments or not node.args:
        return None
    first = schema.arguments[0]
    if first.alias_info is None or not first.alias_info.is_write:
        return None
    carrier = node.args[0]
    if not isinstance(carrier, torch.fx.Node) or carrier.target not in _CARRIERS:
        return None
    if any(order[user] < order[node] for user in carrier.users if user is not node):
        return None
    return carrier


def lift_constants(gm):
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
