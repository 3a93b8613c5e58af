"""A torch_xla-style training loop with lazy forward passes gives eager's
losses; random ops (dropout) give eager's numbers for the same seed."""
import pytest
import torch
from torch import nn

import fastlazy

pytestmark = pytest.mark.usefixtures("lazy_on")


def make_model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.3),
                         nn.Linear(16, 16), nn.Sigmoid(), nn.Linear(16, 1))


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)) for _ in range(n)]


def train(model, data, lazy):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    torch.manual_seed(123)        # the dropout masks
    for x, y in data:
        if lazy:
            x, y = x.to("lazy"), y.to("lazy")
        opt.zero_grad()
        out = model(x)
        loss = ((out - y) ** 2).mean()
        loss.backward()
        opt.step()
        if lazy:
            fastlazy.mark_step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", ["torchscript", "eager"])
def test_xla_style_loop_matches_eager(name):
    fastlazy.set_backend(name)
    try:
        data = batches(6)
        eager = train(make_model(0), data, lazy=False)
        lazy = train(make_model(0), data, lazy=True)
    finally:
        fastlazy.set_backend("torchscript")
    # the same kernels in the same order: bit-equal, not merely close
    assert lazy == eager


def test_seeded_dropout_is_bit_equal_to_eager():
    x = torch.rand(64, 64)
    torch.manual_seed(7)
    want = [torch.nn.functional.dropout(x * 2, 0.5, training=True) for _ in range(3)]
    torch.manual_seed(7)
    got = [torch.nn.functional.dropout(fastlazy.lazy(x) * 2, 0.5, training=True)
           for _ in range(3)]
    for g, w in zip(got, want):
        assert isinstance(g, fastlazy.LazyTensor)
        assert torch.equal(g.to_eager(), w)
    torch.manual_seed(3)
    b = torch.bernoulli(fastlazy.lazy(torch.full((32,), 0.5)))
    torch.manual_seed(3)
    assert torch.equal(b.to_eager(), torch.bernoulli(torch.full((32,), 0.5)))


def _pooled_twice(x, w, cw):
    a = torch.nn.functional.max_pool2d(x, 2)
    b = torch.nn.functional.max_pool2d(x, 2)          # the same call again
    c = torch.nn.functional.conv2d(x, cw, stride=2, padding=1)
    mean, var = torch.var_mean(x, (2, 3), keepdim=True)   # one call, two results
    return (a * w).sin() + (b * 3.7).cos() * w + c + mean * var


def test_identical_calls_reach_the_gradient_as_eagers_do(backend):
    """Two identical calls on one input are two runs when autograd records
    them: each gradient reaches the input on its own, in eager's order (the
    input's gradient bit for bit; merged, it was 9.5e-7 off)."""
    torch.manual_seed(0)
    x0, w, cw = torch.randn(2, 8, 16, 16), torch.randn(2, 8, 8, 8), torch.randn(8, 8, 3, 3)
    grads = []
    for lazy in (False, True):
        x = x0.clone().requires_grad_(True)
        out = _pooled_twice(fastlazy.lazy(x) if lazy else x, w, cw)
        out.sum().backward()
        grads.append(x.grad)
    assert torch.equal(grads[1], grads[0]), (grads[1] - grads[0]).abs().max()


def test_one_call_returning_two_tensors_is_one_run(monkeypatch):
    """Its nodes share one run (backends.base.run_key), a second identical
    call has its own, and outside autograd identical calls share one --
    unless the results of both are held (graph outputs), which must then be
    tensors of their own."""
    from fastlazy import graph_cache
    from fastlazy.backends.base import run_key
    views = []
    real = graph_cache._compile
    monkeypatch.setattr(graph_cache, "_compile",
                        lambda backend, view: views.append(view) or real(backend, view))
    x = torch.randn(3, 5, requires_grad=True)

    def combined(lx):
        (v1, i1), (v2, i2) = torch.max(lx, 1), torch.max(lx, 1)
        return (v1 * i1 + v2 * i2).sum()

    for grad, held, runs in ((True, False, 2), (False, False, 1), (False, True, 2)):
        with torch.set_grad_enabled(grad):
            lx = fastlazy.lazy(x)
            if held:
                (v1, i1), (v2, i2) = torch.max(lx, 1), torch.max(lx, 1)
                fastlazy.mark_step()
                assert v1.to_eager() is not v2.to_eager()
            else:
                combined(lx).to_eager()
        nodes = [n for n in views[-1].nodes if not n.program.fresh]
        assert len(nodes) == 4
        assert len({run_key(n) for n in nodes}) == runs


def test_requires_grad_on_a_lazy_leaf_is_a_flag_not_a_write():
    """requires_grad_ is named like an in-place call: on a leaf that already
    requires grad the write checks refused it ('a leaf Variable that
    requires grad is being used in an in-place operation')."""
    x = torch.randn(2, 3, requires_grad=True)
    assert fastlazy.lazy(x).requires_grad_(True).requires_grad
    assert not fastlazy.lazy(x).requires_grad_(False).requires_grad
    y = torch.randn(2, 3)
    lazy = fastlazy.lazy(y)
    lazy.requires_grad_(True)
    (lazy * 2).sum().backward()
    assert torch.equal(y.grad, torch.full((2, 3), 2.0))
    with pytest.raises(RuntimeError, match="only change requires_grad flags of leaf"):
        (fastlazy.lazy(torch.randn(2, requires_grad=True)) * 2).requires_grad_(False)


@pytest.mark.parametrize("optimizer", [
    lambda ps: torch.optim.SGD(ps, lr=0.1),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True),
    lambda ps: torch.optim.AdamW(ps, lr=0.05, foreach=True),
    lambda ps: torch.optim.Adam(ps, lr=0.05, fused=True),
], ids=["sgd", "sgd-foreach", "adamw-foreach", "adam-fused"])
def test_a_view_of_a_parameter_taken_once_carries_its_gradient_across_steps(optimizer):
    """A tied (transposed) weight taken once before the loop: each step's
    write of the leaf under no_grad leaves the view requiring grad, as
    eager's, so its share of the gradient reaches the leaf (it was dropped,
    silently, from the second step on)."""
    def train(make):
        w = make(torch.tensor([[0.5, -0.2, 0.1], [0.3, 0.9, -0.4]])).requires_grad_()
        tied, row = w.t(), w[1:]
        opt = optimizer([w])
        losses = []
        for _ in range(4):
            loss = (w @ tied).sum() + (row * row).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert tied.requires_grad and row.requires_grad
        return losses, w.detach()
    want = train(lambda t: t)
    got = train(fastlazy.lazy)
    assert got[0] == want[0]
    assert torch.equal(got[1].to_eager(), want[1])
