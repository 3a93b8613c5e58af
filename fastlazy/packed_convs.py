"""The fast tier's convolutions with their weights packed once for oneDNN,
in graphs that record no autograd history: no compiler involved.

Why: ATen's CPU convolution picks its kernel by a size rule (ATen's
`use_mkldnn`).  A batch-1 image of at most 20,480 elements under a kernel
of at most 3 in a dim takes its im2col + GEMM path, which costs W4's
resnet18 at 64x64 88 % of its call: a 512-channel 2x2 layer takes 3.1 ms
there against 0.3 ms in oneDNN with its weight packed.  Where ATen does
take oneDNN it reorders the weight into oneDNN's layout at every call: a
ViT's 16x16 patch embedding (128 channels, 64x64 image) took 88 us against
43 us packed, ResNet-50's last 1x1 layers 1.3 ms against 0.5 ms.  But
oneDNN writes channels-last, and copying its result back into eager's
layout costs more than the reorder saves on a large output (a 1x1 layer of
256 channels at 56x56: 1.0 ms in ATen, 1.7 ms packed), and small layers
gain nothing.  No rule of sizes told the two apart across the layers
measured, so each convolution is timed both ways once its weight is packed.
Packing the weights once is what inductor's freezing does; here its
candidates are found at a graph's PLAN_AT-th run, and the packed program's
compile (one more fast-tier compile of the graph, milliseconds), the
reorders and the timings (a millisecond or more per weight) done on a
thread beside the user's, the plain program serving the calls meanwhile.

What is packed: a 2-d convolution of float32 CPU tensors whose weight is an
nn.Parameter input of the graph, where its packed call on an input of the
recorded size was at least 1 / MIN_GAIN times as fast as ATen's
(fastlazy::conv_times: the fastest of JUDGE_RUNS calls each, alternated,
timed in C++).  Timing needs one intra-op thread (see _packing_pays); with
more, a size rule decides: a kernel other than 1x1, groups == 1, where
ATen would take its im2col path or the weight is over LARGE_WEIGHT_BYTES.
The packed program calls fastlazy::packed_conv2d (csrc/packed_conv.h) for
every candidate; one judged not worth packing gets an empty tensor in
place of its packed weight, and the op then calls ATen's convolution,
eager's own values.  The packed call gives eager's shape, dtype and
strides (its memory format read from each call's weight and input); its
values agree with eager's to rounding (oneDNN sums in another order), as
the fast tier's one-row linear kernel's do.

The packed program is a candidate, not a given: the graph's next runs
alternate it with the plain fast tier, TRIAL_RUNS timed runs each after one
warm-up, and the faster is kept.  It serves only inputs of the sizes it was
planned for (other sizes run the plain program) and the parameters it
packed: one written since (its version counter, its data pointer, or a
write through a `.data` alias that fastlazy sees) is packed again at the
next run; another graph's parameters in their place run the plain program,
and after MAX_FOREIGN_RUNS such runs the packing is given up.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import threading
import time
import weakref

import torch

from fastlazy import _core, backends, compile_worker, metrics, step_executor, watch
from fastlazy.graph import Slot
from fastlazy.node_program import AtenCall, Input, NodeProgram, Value

PLAN_AT = 2                  # the run of a graph at which its packed program is made
TRIAL_RUNS = 5               # timed runs of each program, after one warm-up each
MAX_FOREIGN_RUNS = 8         # runs with other parameters before packing is given up
JUDGE_RUNS = 3               # timed calls of a convolution each way, after one untimed
JUDGE_BUDGET_S = 0.02        # fewer where the first took longer than this in all
MIN_GAIN = 0.9               # a packed call must take at most this share of ATen's
# where a convolution cannot be timed cleanly (below): packed where ATen
# would take its im2col path, or its weight is this large
SLOW_PATH_ELEMENTS = 20480   # ATen's use_mkldnn: an image this small takes im2col + GEMM
LARGE_WEIGHT_BYTES = 4 << 20  # oneDNN's per-call reorder of a weight this large costs ms


def enabled() -> bool:
    """Can graphs get packed convolutions here?  The step executor must be
    in use (its extension defines the op, at the first packed program's
    compile, beside the user's thread: a third of a millisecond) and torch
    built with oneDNN; FASTLAZY_PACKED_CONVS=0 switches them off."""
    return (os.environ.get("FASTLAZY_PACKED_CONVS", "1") != "0"
            and torch.backends.mkldnn.is_available()
            and step_executor.enabled())


def has_convs(view) -> bool:
    """Might the graph have a convolution to pack (looked at once per graph)?"""
    return not view.grad and any(_conv_of(n) is not None for n in view.nodes)


def _conv_of(node):
    """(stride, padding, dilation, groups, has_bias) of a node that is
    F.conv2d as the op table lowers it, else None."""
    calls = node.program.calls
    if len(calls) != 1:
        return None
    call = calls[0]
    if call.name != "conv2d" or call.overload is not None or call.kwargs or len(call.args) != 7:
        return None
    x, w, bias, stride, padding, dilation, groups = call.args
    if x != Input(0) or w != Input(1) or not (bias is None or bias == Input(2)):
        return None
    pairs = (stride, padding, dilation)
    if type(groups) is not int or not all(
            isinstance(p, (list, tuple)) and len(p) == 2 and all(type(i) is int for i in p)
            for p in pairs):
        return None
    return list(stride), list(padding), list(dilation), groups, bias is not None


def _packs_by_size(x_shape, weight, groups) -> bool:
    """ATen's convolution is slow where it takes its im2col path (ATen's
    use_mkldnn for float32 on CPU: oneDNN for a batch over 1, a kernel
    over 3 in both dims or an input over 20,480 elements), or reorders a
    large weight at every call; not on 1x1 (ATen's GEMM beats oneDNN
    there: 31 against 75 us at 64 channels of 16x16)."""
    kh, kw = weight.shape[-2:]
    if groups != 1 or (kh == 1 and kw == 1):
        return False
    if weight.numel() * weight.element_size() >= LARGE_WEIGHT_BYTES:
        return True
    n, c, h, w = x_shape
    return not (n > 1 or (kh > 3 and kw > 3) or n * c * h * w > SLOW_PATH_ELEMENTS)


# what the packed op gets for a weight judged not worth packing (it then
# calls ATen's convolution)
NOT_PACKED = torch.empty(0)


@dataclasses.dataclass
class _Weight:
    """A packed parameter: its position among the fast tier's inputs, the
    parameter (weakly), its version and data pointer when packed, how it
    was packed, and whether packing it paid (judged once, beside the
    user's thread)."""
    k: int
    ref: weakref.ref
    version: int
    pointer: int
    args: tuple          # padding, stride, dilation, groups, input sizes
    channels_last: bool  # the weight's layout, which the judge's input takes
    pays: bool = True

    def pack(self, w):
        self.version, self.pointer = w._version, w.data_ptr()
        with torch.no_grad():
            return torch.ops.mkldnn._reorder_convolution_weight(w.detach(), *self.args)


def _packing_pays(weight: _Weight, w, packed) -> bool:
    """Is the convolution `weight` takes part in faster with `packed`, on
    an input of its recorded size (in the weight's layout),
    than ATen's own call?  Called beside the user's thread, which takes
    torch's intra-op thread count from the user's torch.set_num_threads.
    Timed only where that is one thread: several would run beside the
    user's own intra-op threads, on the same cores, and measure how the two
    contend (a 1x1 layer that takes 5 us alone took 60-90 us so); there the
    size rule measured on one thread decides (_packs_by_size)."""
    padding, stride, dilation, groups, x_shape = weight.args
    if torch.get_num_threads() != 1:
        return _packs_by_size(x_shape, w, groups)
    memory_format = torch.channels_last if weight.channels_last else torch.contiguous_format
    # (not random: a draw here, beside the user's thread, would move the
    # user's random stream -- dropout's masks -- at a moment of its own;
    # a convolution's time does not depend on its values)
    x = torch.full(x_shape, 0.5).contiguous(memory_format=memory_format)
    with torch.no_grad():
        aten_s, packed_s = step_executor.conv_times_op()(
            x, w.detach(), packed, None, padding, stride, dilation, groups,
            JUDGE_RUNS, JUDGE_BUDGET_S)
    return packed_s <= MIN_GAIN * aten_s


def trial(view, positions, inputs, plain, typical, on_error=None):
    """The fast tier's call for `view` while its packed program is made and
    tried (a _Trial), or None where the graph has no convolution to pack.
    `positions`: the fast tier's input positions; `inputs`: this run's, in
    that order; `plain`: the fast tier's call (returning a sequence);
    `typical`: what a list of run times is judged by; `on_error(message)`:
    told where packing fails.  Only the candidates are found here; the
    packed program is compiled and the weights packed on a thread of
    lowered priority beside the user's (the compile's Python runs while
    the user's thread runs its graphs' kernels without the GIL, oneDNN's
    reorders and the judge's timings without it): the plain program
    serves meanwhile, so no call waits for them (the compile took 1-2 ms of
    ViT's second call, the reorders about 30 ms of resnet18's)."""
    if view.grad or not enabled() or not all(
            t.device.type == "cpu" for t in inputs if isinstance(t, torch.Tensor)):
        return None
    given = dict(zip(positions, inputs))
    found = _candidates(view, given)
    if not found:
        return None
    made = _Trial(plain, _core.ShapeGuard(inputs), typical)
    compile_worker.run_beside(made.prepare, view, positions, given, found, on_error)
    return made


def _candidates(view, given) -> list:
    """(node position, conv, weight's input position, weight, input shape)
    of each convolution of the graph that may be packed: float32, its
    weight a 4-d nn.Parameter input of the graph (not a tensor exported
    to another library, whose writes fastlazy would not see).  `given`:
    input position -> this run's value."""
    slots = {s.index: s for s in view.slots}
    found = []
    node_shapes = None
    for i, node in enumerate(view.nodes):
        conv = _conv_of(node)
        if conv is None or node.dtype != torch.float32 or node.inputs[1][0] != "slot":
            continue
        w_position = slots[node.inputs[1][1]].position
        w = given.get(w_position)
        if (type(w) is not torch.nn.Parameter or w.dtype != torch.float32
                or w.layout != torch.strided or w.dim() != 4 or watch.exported(w)):
            continue
        x_ref = node.inputs[0]
        if x_ref[0] == "slot":
            x = given.get(slots[x_ref[1]].position)
            x_shape = tuple(x.shape) if isinstance(x, torch.Tensor) else None
        else:
            if node_shapes is None:
                node_shapes = {n.index: n.shape for n in view.nodes}
            x_shape = tuple(node_shapes[x_ref[1]])
        if x_shape is None or len(x_shape) != 4:
            continue
        found.append((i, conv, w_position, w, x_shape))
    return found


def _packed_graph(view, positions, inputs_at, found):
    """The packed program's call (returning a sequence) and its weights
    (_Weight) for the candidates `found` (_candidates): each convolution
    calls fastlazy::packed_conv2d with one more input, its packed weight.
    `inputs_at`: input position -> this run's value (a parameter stands in
    for its packed copy: the compile reads the slots' values for their
    kind alone)."""
    at = {p: k for k, p in enumerate(positions)}
    nodes = list(view.nodes)
    index = max((s.index for s in view.slots), default=-1) + 1
    position = max((s.position for s in view.slots), default=-1) + 1
    weights = []             # (_Weight, the slot index and position its packed copy takes)
    seen = {}                # a parameter read by several convolutions is packed once
    for i, conv, w_position, w, x_shape in found:
        stride, padding, dilation, groups, has_bias = conv
        node = nodes[i]
        channels_last = w.is_contiguous(memory_format=torch.channels_last) \
            and not w.is_contiguous()
        key = (id(w), tuple(padding), tuple(stride), tuple(dilation), x_shape)
        if key not in seen:
            weights.append((_Weight(at[w_position], weakref.ref(w), 0, 0,
                                    (padding, stride, dilation, groups, list(x_shape)),
                                    channels_last),
                            index, position))
            seen[key] = index
            index += 1
            position += 1
        nodes[i] = dataclasses.replace(
            node, program=_packed_program(stride, padding, dilation, groups, has_bias,
                                          len(node.inputs)),
            inputs=(*node.inputs, ("slot", seen[key])))
    light = copy.copy(view)
    light.nodes = nodes
    light.slots = [dataclasses.replace(s, value=inputs_at.get(s.position, s.value))
                   for s in view.slots]
    light.slots += [Slot(index, position, "tensor", w.ref()) for w, index, position in weights]
    program = backends.get("torchscript").compile(light)
    call = program.call
    if program.single:
        call = (lambda inner: lambda *args: (inner(*args),))(call)
    return call, [w for w, _, _ in weights]


_programs: dict = {}


def _packed_program(stride, padding, dilation, groups, has_bias, n_inputs):
    """The NodeProgram of a conv2d node whose packed weight is its input
    `n_inputs` (one more than the node had)."""
    key = (tuple(stride), tuple(padding), tuple(dilation), groups, has_bias, n_inputs)
    found = _programs.get(key)
    if found is None:
        call = AtenCall("packed_conv2d", step_executor.packed_conv_op(),
                        [Input(0), Input(1), Input(n_inputs), Input(2) if has_bias else None,
                         list(padding), list(stride), list(dilation), groups])
        found = _programs[key] = NodeProgram("packed_conv2d", [call], [Value(0)], fresh=True)
    return found


class _Trial:
    """The fast tier's call of a graph with packed convolutions: the plain
    program while the weights are packed (pack_all, on a thread beside),
    then the trial (plain and packed programs in turn, timed), then the
    winner."""

    def __init__(self, plain, shapes, typical):
        self.plain = plain
        self.packed_call = None        # the packed program, once compiled (prepare)
        self.weights = []              # its _Weights
        self.packed = None             # the packed weights, once built
        self.shapes = shapes
        self.typical = typical
        self.times = ([], [])          # the plain program's runs, the packed one's
        self.written = False
        self.foreign_runs = 0
        self._given_up = False
        self._lock = threading.Lock()  # between prepare, pack_all and give_up
        self._on_write = _Notice(weakref.ref(self), "written")
        weakref.finalize(self, _core.unwatch_writes, self._on_write)
        _live.add(self)
        self.call = plain

    def prepare(self, view, positions, inputs_at, found, on_error):
        """Beside the user's thread: the packed program compiled for the
        candidates `found` (_candidates), then its weights packed
        (pack_all).  A failure leaves the plain program."""
        try:
            packed_call, weights = _packed_graph(view, positions, inputs_at, found)
        except Exception as exc:     # noqa: BLE001 - the plain program stands
            self._failed(exc, on_error)
            return
        # a parameter freed (its model dropped): its packed copy goes too
        died = _Notice(weakref.ref(self), "died")
        with self._lock:
            if self._given_up:
                return
            for w in weights:
                w.ref = weakref.ref(w.ref(), died)
            self.packed_call, self.weights = packed_call, weights
            _core.watch_writes([w.ref() for w in weights], self._on_write)
        self.pack_all(on_error)

    def _failed(self, exc, on_error):
        metrics.count_event("packed_conv_failures")
        self.give_up()
        if on_error is not None:
            on_error(f"packed convolutions: {type(exc).__name__}: {exc}"[:500])

    def pack_all(self, on_error):
        """Beside the user's thread: every weight packed, and kept packed
        where that pays (_packing_pays); the trial begins at the next call.
        A failure (or a give_up meanwhile) leaves the plain program, and so
        does a graph none of whose convolutions gains."""
        try:
            packed = []
            for weight in self.weights:
                w = weight.ref()
                if w is None or self._given_up:
                    return
                p = weight.pack(w)
                if not _packing_pays(weight, w, p):
                    weight.pays, p = False, NOT_PACKED
                packed.append(p)
        except Exception as exc:     # noqa: BLE001 - the plain program stands
            self._failed(exc, on_error)
            return
        if not any(w.pays for w in self.weights):
            self.give_up()
            return
        with self._lock:
            if self._given_up:
                return
            self.packed = packed
            metrics.count_event("packed_conv_trials")
            self.call = self._try

    def __call__(self, *inputs):
        return self.call(*inputs)

    def _try(self, *inputs):
        plain_runs, packed_runs = self.times
        packed_turn = len(packed_runs) < len(plain_runs)
        start = time.perf_counter()
        out = self._packed(*inputs) if packed_turn else self.plain(*inputs)
        self.times[packed_turn].append(time.perf_counter() - start)
        if len(packed_runs) > TRIAL_RUNS and self.call == self._try:
            self._decide()
        return out

    def _decide(self):
        plain, packed = (self.typical(t[1:]) for t in self.times)
        if packed < plain and self.packed is not None:
            self.call = self._packed
            metrics.count_event("packed_conv_graphs")
        else:
            self.give_up()

    def _packed(self, *inputs):
        if self.packed is None or not self.shapes.matches(inputs):
            return self.plain(*inputs)
        written, self.written = self.written, False
        repacked = False
        for k, w in enumerate(self.weights):
            t = inputs[w.k]
            if t is not w.ref():
                self.foreign_runs += 1
                if self.foreign_runs > MAX_FOREIGN_RUNS:
                    self.give_up()
                return self.plain(*inputs)
            if w.pays and (written or t._version != w.version or t.data_ptr() != w.pointer):
                self.packed[k] = w.pack(t)
                repacked = True
                metrics.count_event("packed_conv_repacks")
        if repacked:
            # the core tells a watcher of one write only, and a parameter
            # given new memory is watched there
            _core.unwatch_writes(self._on_write)
            _core.watch_writes([w.ref() for w in self.weights if w.ref() is not None],
                               self._on_write)
        try:
            return self.packed_call(*inputs, *self.packed)
        except Exception:     # noqa: BLE001 - the plain program judges the run
            # (oneDNN refusing what ATen takes): the plain program from now
            # on, which computes the run or raises eager's own error
            metrics.count_event("packed_conv_failures")
            self.give_up()
            return self.plain(*inputs)

    def give_up(self):
        """The plain program from now on; the packed weights let go (a
        packing under way stops)."""
        with self._lock:
            self._given_up = True
            self.call = self.plain
            self.packed = None
            self.weights = []
        _core.unwatch_writes(self._on_write)

    def forget(self, tensors) -> None:
        if not self._given_up and any(w.ref() is t for w in self.weights for t in tensors):
            self.give_up()


class _Notice:
    """A _Trial's callback for a write to its parameters' memory (the
    core's watch) or a parameter's death (its weakref), holding the trial
    weakly: neither must keep a dropped graph's packed weights alive."""
    __slots__ = ("trial", "what")

    def __init__(self, trial, what):
        self.trial = trial
        self.what = what

    def __call__(self, *_):
        trial = self.trial()
        if trial is None:
            return
        if self.what == "written":
            trial.written = True
        elif not trial._given_up:
            trial.give_up()


# every _Trial alive, for forget_parameters
_live: weakref.WeakSet = weakref.WeakSet()


def forget_parameters(*tensors) -> None:
    """No packed program holds any of `tensors` from now on (they are
    about to be swapped: watch.on_swap)."""
    for t in list(_live):
        t.forget(tensors)
