"""Calls real models make that used to split the graph (run eagerly, or
compute a pending value), now recorded with eager's exact semantics:
dropout and *_like random draws, nn.functional activations with
inplace=True, and .to() naming the device a value already lives on."""
import copy
import inspect

import pytest
import torch
import torch.nn.functional as F

import fastlazy
from fastlazy import LazyTensor

pytestmark = pytest.mark.usefixtures("lazy_on", "backend")


def _no_split():
    c = fastlazy.metrics.counters()
    assert c["fallbacks"] == 0, fastlazy.explain()
    assert c["flushes"] == 0, fastlazy.explain()


DROPOUTS = [
    (F.dropout, (4, 6), dict(p=0.3, training=True)),
    (F.dropout, (4, 6), dict(p=0.5)),                      # training defaults to True
    (F.dropout1d, (2, 3, 5), dict(p=0.4, training=True)),
    (F.dropout2d, (2, 3, 4, 4), dict(p=0.5, training=True)),
    (F.dropout3d, (1, 2, 3, 2, 2), dict(p=0.25, training=True)),
    (torch.dropout, (5, 7), dict(p=0.2, train=True)),
    (torch.feature_dropout, (2, 3, 4), dict(p=0.5, train=True)),
    (F.dropout, (3, 3), dict(p=1.0, training=True)),
    (F.dropout, (3, 3), dict(p=0.0, training=True)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("func,shape,kwargs", DROPOUTS,
                         ids=[f"{f.__name__}-{k}" for f, _, k in DROPOUTS])
def test_dropout_is_recorded_bit_equal(func, shape, kwargs, dtype):
    x = torch.randn(shape).to(dtype)
    torch.manual_seed(7)
    expected = func(x * 2, **kwargs)
    after = torch.rand(3)                      # the generator advanced alike
    torch.manual_seed(7)
    got = func(fastlazy.lazy(x) * 2, **kwargs)
    got_after = torch.rand(3)
    assert type(got) is LazyTensor
    _no_split()
    assert torch.equal(got.to_eager(), expected)
    assert torch.equal(got_after, after)


@pytest.mark.parametrize("kwargs", [dict(p=0.1, training=False), dict(p=0.0, training=True)],
                         ids=["eval", "p0"])
@pytest.mark.parametrize("dropout", [F.dropout, F.dropout2d])
def test_a_dropout_that_draws_nothing_leaves_an_autocast_result_pending(dropout, kwargs):
    """Under autocast a generic result's layout is not told by its
    producers; where the dropout draws nothing, none is needed."""
    x = torch.randn(2, 3, 4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = F.gelu(fastlazy.lazy(x) * 2)
        got = dropout(h, **kwargs)
        expected = dropout(F.gelu(x * 2), **kwargs)
    _no_split()
    assert torch.equal(got.to_eager(), expected)


@pytest.mark.parametrize("plain", [True, False], ids=["plain-draw", "call-on-ones"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("layout", ["transposed", "strided-slice", "expanded",
                                    "transposed-strided-slice", "permuted-strided-slice"])
def test_dropout_noise_of_a_view_is_eagers(layout, dtype, plain, monkeypatch):
    """Both ways of drawing the noise (the plain calls eager's CPU dropout
    makes, and the call on a tensor of ones) lay it out as eager's
    empty_like does, so each number lands where eager's would."""
    from fastlazy import random_ops
    if not plain:
        monkeypatch.setattr(random_ops, "draws_plainly", lambda device, dtype: False)
    drawn = []
    real_noise = random_ops._noise
    monkeypatch.setattr(random_ops, "_noise",
                        lambda *a: drawn.append(real_noise(*a)) or drawn[-1])
    base = torch.randn(6, 8).to(dtype)
    # (a view that skips elements in another order than its base's: eager
    # lays its empty_like out densely in the order of the view's strides)
    view = {"transposed": lambda t: t.t(), "strided-slice": lambda t: t[:, ::2],
            "expanded": lambda t: t[:1].expand(6, 8),
            "transposed-strided-slice": lambda t: t.t()[::2],
            "permuted-strided-slice": lambda t: t.view(2, 3, 8).permute(2, 0, 1)[::2]}[layout]
    torch.manual_seed(11)
    expected = F.dropout(view(base * 2), 0.4, True)
    after = torch.rand(3)
    torch.manual_seed(11)
    got = F.dropout(view(fastlazy.lazy(base) * 2), 0.4, True)
    assert torch.equal(torch.rand(3), after)
    assert torch.equal(got.to_eager(), expected)
    assert [d is not None for d in drawn] == [plain]


def test_plain_dropout_draws_are_checked_per_device_and_dtype(monkeypatch):
    from fastlazy import random_ops
    assert random_ops.draws_plainly.__wrapped__("cpu", torch.float32)
    assert not random_ops.draws_plainly.__wrapped__("cuda", torch.float32)
    # a torch whose CPU dropout drew otherwise keeps the call on ones
    real = torch.dropout
    monkeypatch.setattr(torch, "dropout",
                        lambda x, p, train: real(x, p, train) * (1 - p))
    assert not random_ops.draws_plainly.__wrapped__("cpu", torch.float32)
    # feature dropout's noise has another shape: never drawn plainly
    assert random_ops._noise(F.dropout2d, {"input": None, "p": 0.5}, None) is None


def test_dropout_gradient_is_eagers():
    w = torch.randn(4, 5, requires_grad=True)
    torch.manual_seed(3)
    F.dropout(w * 3, 0.5, True).sum().backward()
    expected, w.grad = w.grad, None
    torch.manual_seed(3)
    out = F.dropout(fastlazy.lazy(torch.ones(4, 5)) * w * 3, 0.5, True)
    out.sum().backward()
    assert torch.equal(w.grad, expected)


def test_dropout_inplace_writes_the_lazy_tensor_only():
    x = torch.randn(6)
    torch.manual_seed(1)
    expected = x.clone()
    F.dropout(expected, 0.5, True, inplace=True)
    torch.manual_seed(1)
    lazy = fastlazy.lazy(x) * 1
    assert F.dropout(lazy, 0.5, True, inplace=True) is lazy
    assert torch.equal(lazy.to_eager(), expected)


def _no_python_dropout(monkeypatch):
    """random_ops (the Python path) refuses every call: what passes was
    drawn and recorded by the core."""
    from fastlazy import random_ops

    def refuse(*args):
        raise AssertionError("F.dropout went up into Python")
    monkeypatch.setattr(random_ops, "record", refuse)


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_dropout_in_training_is_drawn_by_the_core(inplace, dtype, monkeypatch):
    """F.dropout of a tensor that is not a view, as a transformer's training
    step calls it: eager's noise and generator state, no Python frame."""
    _no_python_dropout(monkeypatch)
    x, w = torch.randn(3, 5, 7).to(dtype), torch.randn(7, 4).to(dtype)
    torch.manual_seed(4)
    expected = F.dropout(x @ w, 0.1, True, inplace)
    after = torch.rand(3)
    torch.manual_seed(4)
    lazy = fastlazy.lazy(x) @ w
    got = F.dropout(lazy, 0.1, True, inplace)
    assert torch.equal(torch.rand(3), after)
    assert (got is lazy) == inplace
    _no_split()
    assert torch.equal(got.to_eager(), expected)


def test_dropout_of_a_contiguous_view_is_drawn_by_the_core(monkeypatch):
    """GPT-2's projections reshape a matmul's result before dropout."""
    _no_python_dropout(monkeypatch)
    x, w = torch.randn(6, 8), torch.randn(8, 4)
    torch.manual_seed(12)
    expected = F.dropout((x @ w).view(2, 3, 4), 0.2, True)
    torch.manual_seed(12)
    got = F.dropout((fastlazy.lazy(x) @ w).view(2, 3, 4), 0.2, True)
    _no_split()
    assert torch.equal(got.to_eager(), expected)


def test_dropout_of_a_channels_last_value_is_eagers(monkeypatch):
    """A computed value keeps its own layout: the noise is drawn in it, as
    eager's empty_like would, so each number lands where eager's does."""
    _no_python_dropout(monkeypatch)
    x = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    torch.manual_seed(9)
    expected = F.dropout(x, 0.5)
    torch.manual_seed(9)
    assert torch.equal(F.dropout(fastlazy.lazy(x), 0.5).to_eager(), expected)


def test_dropout_in_place_on_a_leaf_raises_eagers_error_after_the_draw():
    w = torch.randn(4, requires_grad=True)
    torch.manual_seed(2)
    with pytest.raises(RuntimeError) as eager_error:
        F.dropout(w, 0.3, True, inplace=True)
    after = torch.rand(3)
    torch.manual_seed(2)
    with pytest.raises(RuntimeError) as lazy_error:
        F.dropout(fastlazy.lazy(w), 0.3, True, inplace=True)
    assert torch.equal(torch.rand(3), after)
    assert "leaf Variable" in str(eager_error.value) and "leaf Variable" in str(lazy_error.value)


@pytest.mark.parametrize("p", [0, 1, torch.tensor(0.5)], ids=["int-0", "int-1", "tensor"])
def test_dropout_probabilities_the_core_leaves_to_python_keep_eagers_result(p):
    x = torch.randn(4, 4)
    torch.manual_seed(6)
    try:
        expected = F.dropout(x * 1, p, True)
    except Exception as error:           # (eager's own judgement of p)
        with pytest.raises(type(error)):
            F.dropout(fastlazy.lazy(x) * 1, p, True)
        return
    torch.manual_seed(6)
    assert torch.equal(F.dropout(fastlazy.lazy(x) * 1, p, True).to_eager(), expected)


_KEPT = []
_PERMUTED = torch.randn(2, 5, 6)
LAID_OUT = {
    # an audio encoder's front: conv, permute, position added (Whisper's);
    # a view no tensor holds is laid out as its program lays it out
    "permuted-plus-contiguous": (lambda x, pos: x.permute(0, 2, 1) + pos, True),
    "through-two-elementwise-ops": (lambda x, pos: (x.permute(0, 2, 1) * 2 + pos).relu(), True),
    # generic calls: as the real run of their signatures laid them out
    "generic-of-a-permuted-view": (lambda x, pos: torch.flip(x.permute(0, 2, 1), [1]) * pos,
                                   True),
    "generic-reshape-copy": (lambda x, pos: x.transpose(1, 2).reshape(2, 5, 6) - pos, True),
    # a view a tensor still holds: its strides are known, nothing computed
    "transposed-kept-alive": (lambda x, pos: _KEPT.append(x.transpose(1, 2)) or _KEPT[-1] - pos,
                              True),
    # an eager operand's layout decides (it comes first)
    "permuted-eager-operand": (lambda x, pos: _PERMUTED.transpose(1, 2) + x, True),
    "broadcast-position": (lambda x, pos: x + pos.t(), True),
    "contiguous-operands": (lambda x, pos: x * 3 + 1, True),
}


@pytest.mark.parametrize("name", LAID_OUT)
@pytest.mark.parametrize("p_kind", ["float", "int"])
def test_dropout_of_an_elementwise_result_draws_in_eagers_layout(name, p_kind):
    """An elementwise op of a permuted tensor keeps its layout in eager, and
    eager's noise is drawn in it: the same seed gives eager's numbers (the
    graph is computed up to the input where the layout is not known to be
    contiguous, and only there)."""
    make, stays_pending = LAID_OUT[name]
    x, pos = torch.randn(2, 6, 5), torch.randn(5, 6)
    p = 0.5 if p_kind == "float" else 1
    torch.manual_seed(8)
    expected = F.dropout(make(x, pos), p, True)
    after = torch.rand(3)
    torch.manual_seed(8)
    lazy_x = fastlazy.lazy(x) * 1
    got = F.dropout(make(lazy_x, pos), p, True)
    assert torch.equal(torch.rand(3), after)
    if stays_pending:
        _no_split()
    assert torch.equal(got.to_eager(), expected)


def test_elementwise_result_strides_are_tensor_iterators():
    """fastlazy.layouts' copy of TensorIterator's layout rule against eager's
    results, over permuted, broadcast and channels-last operands."""
    from fastlazy import layouts
    gen = torch.Generator().manual_seed(0)
    checked = 0
    for _ in range(300):
        ndim = int(torch.randint(2, 5, (), generator=gen))
        shape = [int(v) for v in torch.randint(1, 4, (ndim,), generator=gen)]
        operands = []
        for _ in range(int(torch.randint(1, 4, (), generator=gen))):
            order = torch.randperm(ndim, generator=gen).tolist()
            t = torch.empty([shape[d] for d in order]).permute(*torch.argsort(torch.tensor(order)).tolist())
            if torch.rand((), generator=gen) < 0.3:       # broadcast along one dim
                d = int(torch.randint(0, ndim, (), generator=gen))
                t = t.narrow(d, 0, 1)
            operands.append(t)
        out = operands[0]
        for t in operands[1:]:
            out = out + t
        if len(operands) > 2:       # a chain's layout is the last add's
            continue
        got = layouts.iterator_strides(tuple(out.shape),
                                           [(tuple(t.shape), t.stride()) for t in operands])
        order = lambda strides: [d for d in sorted(range(ndim), key=lambda d: strides[d])
                                 if out.shape[d] != 1]
        assert order(got) == order(out.stride()), (shape, [t.stride() for t in operands])
        checked += 1
    assert checked > 100


_CL = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
_W = torch.randn(4, 3, 3, 3)
# (the draw's input from a lazy x of shape (6, 5) and a lazy channels-last
# image; whether it stays pending: its layout is known without a run)
PRODUCED = {
    "conv-of-channels-last": (lambda x, im: F.conv2d(im, _W), True),
    "conv-of-channels-last-plus-one": (lambda x, im: F.conv2d(im, _W) + 1, True),
    "relu-of-channels-last-conv": (lambda x, im: F.relu(F.conv2d(im, _W)), True),
    "max-pool-of-channels-last": (lambda x, im: F.max_pool2d(im, 2), True),
    "batch-norm-of-channels-last": (
        lambda x, im: F.batch_norm(im, torch.zeros(3), torch.ones(3)), True),
    "cat-of-channels-last": (lambda x, im: torch.cat([im * 1, im * 2], 1), True),
    "conv-of-contiguous": (lambda x, im: F.conv2d(im.contiguous(), _W), True),
    "softmax-of-transposed": (lambda x, im: F.softmax(x.transpose(0, 1), -1), True),
    "matmul-of-transposed": (lambda x, im: x.t() @ x, True),
    # t() takes the generic path, which does not tell a view's layout:
    # computed first
    "transposed-by-t-plus-one": (lambda x, im: x.t() + 1, False),
    "mT-times-two": (lambda x, im: x.mT * 2, False),
}


@pytest.mark.parametrize("name", PRODUCED)
@pytest.mark.parametrize("func", ["dropout", "rand_like"])
def test_random_draws_of_other_producers_are_eagers(name, func):
    """A convolution, pooling or batch norm of a channels-last input gives
    a channels-last result in eager, so eager's noise is drawn in that
    order; matmuls and softmax give contiguous results whatever their
    operands; a generic view that no tensor holds is not followed (the
    graph is computed up to the draw's input)."""
    make, stays_pending = PRODUCED[name]
    draw = (lambda t: F.dropout(t, 0.5, True)) if func == "dropout" else torch.rand_like
    x = torch.randn(6, 5)
    torch.manual_seed(5)
    expected = draw(make(x, _CL))
    after = torch.rand(3)
    torch.manual_seed(5)
    got = draw(make(fastlazy.lazy(x), fastlazy.lazy(_CL)))
    assert torch.equal(torch.rand(3), after)
    if stays_pending:
        _no_split()
    assert torch.equal(got.to_eager(), expected)


@pytest.mark.parametrize("func", [torch.rand_like, torch.randn_like])
def test_random_like_of_an_elementwise_result_is_eagers(func):
    x, pos = torch.randn(2, 6, 5), torch.randn(5, 6)
    torch.manual_seed(3)
    expected = func(x.permute(0, 2, 1) + pos)
    torch.manual_seed(3)
    got = func(fastlazy.lazy(x).permute(0, 2, 1) + pos)
    assert torch.equal(got.to_eager(), expected)


def test_dropout_bad_probability_raises_eagers_error():
    with pytest.raises(ValueError, match="dropout probability"):
        F.dropout(fastlazy.lazy(torch.rand(3)) * 1, 1.5, True)


@pytest.mark.parametrize("func,args", [(torch.rand_like, ()), (torch.randn_like, ()),
                                       (torch.randint_like, (10,))])
def test_random_like_is_drawn_at_the_call(func, args):
    x = torch.rand(3, 4)
    torch.manual_seed(5)
    expected = func(x * 2, *args)
    torch.manual_seed(5)
    got = func(fastlazy.lazy(x) * 2, *args)
    _no_split()
    assert type(got) is LazyTensor
    assert torch.equal(got.to_eager(), expected)


ACTIVATIONS = [(F.hardswish, ()), (F.hardsigmoid, ()), (F.relu6, ()), (F.elu, (0.5,)),
               (F.selu, ()), (F.celu, ()), (F.hardtanh, (-0.5, 0.5)), (F.mish, ()),
               (F.leaky_relu, (0.2,)), (F.threshold, (0.1, 2.0)), (F.silu, ()),
               (F.relu, ())]


@pytest.mark.parametrize("func,args", ACTIVATIONS, ids=[f.__name__ for f, _ in ACTIVATIONS])
@pytest.mark.parametrize("as_keyword", [True, False])
def test_activation_inplace_is_recorded(func, args, as_keyword):
    x = torch.randn(5, 6)
    if not as_keyword:
        # every argument up to `inplace` given positionally
        params = list(inspect.signature(func).parameters.values())
        position = [p.name for p in params].index("inplace")
        args = args + tuple(p.default for p in params[1 + len(args):position])
    expected = x * 3
    returned = (func(expected, *args, inplace=True) if as_keyword
                else func(expected, *args, True))
    assert returned is expected
    lazy = fastlazy.lazy(x) * 3
    got = func(lazy, *args, inplace=True) if as_keyword else func(lazy, *args, True)
    assert got is lazy                    # the same tensor, written
    _no_split()
    assert torch.equal(lazy.to_eager(), expected)


def test_activation_inplace_through_a_view_reaches_the_base():
    x = torch.randn(4, 6)
    expected = x * 1
    F.hardswish(expected[1], inplace=True)
    base = fastlazy.lazy(x) * 1
    F.hardswish(base[1], inplace=True)
    _no_split()
    assert torch.equal(base.to_eager(), expected)


def test_activation_inplace_on_a_leaf_requiring_grad_raises_eagers_error():
    leaf = torch.randn(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        F.hardswish(leaf, inplace=True)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        F.hardswish(fastlazy.lazy(leaf), inplace=True)


@pytest.mark.parametrize("call", [
    lambda m, x: m.to(device=x.device, dtype=torch.float32),
    lambda m, x: m.to(x),
    lambda m, x: m.to(tensor=x),
    lambda m, x: m.to("cpu"),
    lambda m, x: m.to(torch.device("cpu"), torch.float64),
    lambda m, x: m.to(torch.float16),
    lambda m, x: m.to(dtype=torch.int64, copy=True),
    lambda m, x: m.type_as(x),
], ids=["device+dtype", "other", "tensor=", "cpu", "device,dtype", "dtype", "copy",
        "type_as"])
def test_to_on_the_same_device_is_recorded(call):
    a = torch.rand(3, 4)
    x = fastlazy.lazy(a) + 1
    mask = x > 1.5
    got = call(mask, x)
    assert type(got) is LazyTensor
    _no_split()
    expected = call(a + 1 > 1.5, a + 1)
    assert got.dtype == expected.dtype
    assert torch.equal(got.to_eager(), expected)


def test_to_another_device_gives_an_eager_tensor_and_counts_a_fallback():
    x = fastlazy.lazy(torch.rand(3)) * 2
    out = x.to("meta")
    assert type(out) is torch.Tensor and out.device.type == "meta"
    c = fastlazy.metrics.counters()
    assert c["fallbacks"] == 1 and c["fallback.to"] == 1


def _bn_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4),
                               torch.nn.ReLU(), torch.nn.Conv2d(4, 2, 1),
                               torch.nn.BatchNorm2d(2, momentum=None)).train()


def _train_bn_nets(autocast=None):
    """Three SGD steps of _bn_net, eager and with lazy inputs (under CPU
    autocast to `autocast` where given), checked to be one graph a step
    with nothing run eagerly and to end in eager's state bit for bit:
    (eager, lazy) nets, and the lazy net's buffers before the steps."""
    eager, lazy = _bn_net(), _bn_net()
    buffers_before = [b for b in lazy.buffers()]
    xs = [torch.randn(2, 3, 6, 6) for _ in range(3)]
    for x in xs:
        for model, inp in ((eager, x), (lazy, fastlazy.lazy(x))):
            model.zero_grad()
            with torch.autocast("cpu", dtype=autocast or torch.bfloat16,
                                enabled=autocast is not None):
                out = model(inp)
            assert out.dtype == (autocast or torch.float32)
            out.float().pow(2).mean().backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
    c = fastlazy.metrics.counters()
    assert c["fallbacks"] == 0, fastlazy.explain()
    assert c["flushes"] == 3
    for mine, want in zip(lazy.state_dict().values(), eager.state_dict().values()):
        assert type(mine) is torch.Tensor
        assert torch.equal(mine, want)
    return lazy, buffers_before


def test_batch_norm_training_is_recorded_with_eagers_statistics():
    """Three SGD steps: eager's outputs, gradients, running statistics and
    num_batches_tracked, bit for bit; one graph per step (the backward's
    read), none of them run eagerly; the module's buffers are the tensors
    it had before, updated."""
    lazy, buffers_before = _train_bn_nets()
    assert all(a is b for a, b in zip(lazy.buffers(), buffers_before))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_batch_norm_training_under_autocast_is_recorded_with_eagers_statistics(dtype):
    """Under CPU autocast a convolution's output is bfloat16 (or float16)
    and the batch norm's statistics and parameters stay float32, a mix
    eager's kernel takes: recorded as in float32, one graph a step (each
    batch norm ran eagerly, a graph split apiece), eager's outputs,
    gradients and statistics bit for bit."""
    _train_bn_nets(autocast=dtype)


def test_batch_norm_training_steps_are_one_graph_structure():
    """The first step records batch norm through the generic path's
    analysis, the later ones from the signature it published: every step's
    graph has the same structure (one compile).  (The later steps' nodes
    once read each eager operand through a slot per result: a second
    structure.)"""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4),
                              torch.nn.ReLU(), torch.nn.Conv2d(4, 2, 1),
                              torch.nn.BatchNorm2d(2)).train()
    x = fastlazy.lazy(torch.randn(2, 3, 6, 6))
    fastlazy.graph_cache.clear()
    for _ in range(4):
        net.zero_grad()
        net(x).pow(2).mean().backward()
    c = fastlazy.metrics.counters()
    assert c["flushes"] == 4 and c["cache_misses"] == 1, fastlazy.explain()


def test_batch_norm_training_of_a_module_seen_before_is_recorded_by_the_core(monkeypatch):
    """Once running_stats.py has found a module, the core records its calls
    (csrc/running_stats.pxi) -- a module called twice in a step included
    (the second call passes its pending statistics) -- with eager's
    outputs, statistics and gradients."""
    from fastlazy import running_stats
    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Conv2d(3, 3, 3, padding=1), torch.nn.BatchNorm2d(3))
    lazy = copy.deepcopy(eager)
    xs = [torch.randn(2, 3, 5, 5) for _ in range(4)]

    def step(net, x):
        net.zero_grad()
        bn = net[1]
        bn(net(x)).pow(2).mean().backward()     # the batch norm twice

    step(lazy, fastlazy.lazy(xs[0]))
    step(eager, xs[0])
    monkeypatch.setattr(running_stats, "record",
                        lambda *a: pytest.fail("went up into Python"))
    for x in xs[1:]:
        step(lazy, fastlazy.lazy(x))
        step(eager, x)
    for mine, want in zip(lazy.state_dict().values(), eager.state_dict().values()):
        assert type(mine) is torch.Tensor and torch.equal(mine, want)
    for mine, want in zip(lazy.parameters(), eager.parameters()):
        assert torch.equal(mine.grad, want.grad)


def test_an_eager_write_to_a_buffer_after_the_forward_lands_after_the_update():
    """A reference to a running mean taken before the step, written in place
    after the forward is recorded: as in eager, the write comes after the
    step's update (the graph runs first), and the module keeps the tensor."""
    eager, lazy = _bn_net(), _bn_net()
    x = torch.randn(2, 3, 6, 6)
    held_e, held_l = eager[1].running_mean, lazy[1].running_mean
    eager(x)
    held_e.add_(1)
    out = lazy(fastlazy.lazy(x))
    held_l.add_(1)
    out.to_eager()
    assert lazy[1].running_mean is held_l
    assert torch.equal(held_l, held_e)


def test_a_buffer_read_before_the_graph_runs_sees_the_update():
    eager, lazy = _bn_net(), _bn_net()
    x = torch.randn(2, 3, 6, 6)
    want = eager(x)
    out = lazy(fastlazy.lazy(x))
    assert fastlazy.metrics.counters()["flushes"] == 0
    bn = lazy[1]
    assert torch.equal(bn.running_mean.to_eager(), eager[1].running_mean)   # computes
    assert type(bn.running_var) is torch.Tensor          # the graph ran: eager again
    assert torch.equal(bn.running_var, eager[1].running_var)
    assert torch.equal(out.to_eager(), want)


def test_a_module_seen_before_owns_only_the_statistics_it_still_holds():
    """The module found for a pair of running statistics is remembered, and
    used again only while it holds both: a call from outside the module
    with its mean and a variance of someone else's runs eagerly, and a
    buffer replaced after a step is the one the next step updates."""
    eager, lazy = _bn_net(), _bn_net()
    x = torch.randn(2, 3, 6, 6)
    eager(x)
    lazy(fastlazy.lazy(x)).to_eager()            # the modules' pair remembered
    bn_e, bn_l = eager[1], lazy[1]
    other_e, other_l = torch.full((4,), 2.0), torch.full((4,), 2.0)
    h = torch.randn(2, 4, 4, 4)
    want = F.batch_norm(h, bn_e.running_mean, other_e, training=True)
    before = fastlazy.metrics.counters()["fallbacks"]
    got = F.batch_norm(fastlazy.lazy(h), bn_l.running_mean, other_l, training=True)
    assert fastlazy.metrics.counters()["fallbacks"] == before + 1
    assert torch.equal(got.to_eager(), want)
    assert torch.equal(bn_l.running_mean, bn_e.running_mean) and torch.equal(other_l, other_e)
    fresh = bn_l.running_mean.clone()
    bn_l.running_mean = fresh
    bn_e.running_mean = bn_e.running_mean.clone()
    eager(x)
    lazy(fastlazy.lazy(x)).to_eager()
    assert bn_l.running_mean is fresh
    for mine, want in zip(lazy.state_dict().values(), eager.state_dict().values()):
        assert torch.equal(mine, want)


def test_batch_norm_with_statistics_a_module_does_not_own_runs_eagerly():
    x = torch.randn(4, 3)
    mean, var = torch.zeros(3), torch.ones(3)
    want_mean, want_var = mean.clone(), var.clone()
    want = F.batch_norm(x * 2, want_mean, want_var, training=True)
    got = F.batch_norm(fastlazy.lazy(x) * 2, mean, var, training=True)
    assert torch.equal(got.to_eager(), want)
    assert torch.equal(mean, want_mean) and torch.equal(var, want_var)
    assert fastlazy.metrics.counters()["fallbacks"] == 1


def test_batch_norm_training_on_one_value_per_channel_raises_eagers_error():
    bn = torch.nn.BatchNorm1d(3).train()
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        bn(fastlazy.lazy(torch.randn(1, 3)))


@pytest.mark.parametrize("grad", [False, True])
def test_attention_dropout_is_drawn_at_the_call(grad):
    """scaled_dot_product_attention's dropout is drawn inside the kernel
    (its math path on CPU): the captured program's random fill becomes an
    input drawn at each call, so values, gradients and the generator's
    next draw are eager's."""
    q, k, v = (torch.rand(2, 4, 8, 16) for _ in range(3))
    q.requires_grad_(grad)
    torch.manual_seed(11)
    want = F.scaled_dot_product_attention(q * 1, k, v, dropout_p=0.3, is_causal=True)
    want_after = torch.rand(2)
    torch.manual_seed(11)
    got = F.scaled_dot_product_attention(fastlazy.lazy(q) * 1, k, v, dropout_p=0.3,
                                         is_causal=True)
    got_after = torch.rand(2)
    _no_split()
    assert torch.equal(got.to_eager(), want)
    assert torch.equal(got_after, want_after)
    if grad:
        want.sum().backward()
        expected, q.grad = q.grad, None
        got.sum().backward()
        assert torch.equal(q.grad, expected)


def _noisy(x):
    a = torch.empty_like(x).uniform_(-1, 1)
    b = torch.empty_like(x).bernoulli_(0.25)
    return x * a + b + torch.empty_like(x).normal_(0, 2)


def test_random_fills_in_a_function_are_drawn_at_the_call():
    x = torch.rand(5, 3)
    torch.manual_seed(2)
    want = _noisy(x * 2)
    torch.manual_seed(2)
    got = _noisy(fastlazy.lazy(x) * 2)
    _no_split()
    assert torch.equal(got.to_eager(), want)


def test_random_draws_from_values_still_run_eagerly():
    p = torch.rand(6)
    torch.manual_seed(4)
    want = torch.bernoulli(p * 0.5)
    torch.manual_seed(4)
    got = torch.bernoulli(fastlazy.lazy(p) * 0.5)
    assert torch.equal(got.to_eager(), want)
    assert fastlazy.metrics.counters()["fallback.bernoulli"] == 1


def test_lazy_modules_initialize_while_lazy_tensors_are_pending(lazy_on):
    # nn.LazyLinear's UninitializedParameter raises its own error when its
    # storage is asked for, which the eager-write check does before
    # materialize() writes .data
    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.LazyLinear(4), torch.nn.ReLU(), torch.nn.LazyLinear(2))
    eager(torch.randn(3, 5))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.LazyLinear(4), torch.nn.ReLU(), torch.nn.LazyLinear(2))
    pending = fastlazy.lazy(torch.ones(3)) * 2
    x = torch.randn(3, 5)
    assert torch.equal(model(fastlazy.lazy(x)).to_eager(), eager(x))
    assert torch.equal(pending.to_eager(), torch.full((3,), 2.0))
