"""Parameters that are LazyTensors (torch_xla-style training): a leaf that
requires grad, written under no_grad (an optimizer's step), is recorded
like any write; until its graph runs it answers as the leaf eager keeps
(requires_grad, is_leaf, grad_fn, grad), and every parameter's update of a
step runs in one graph, at the first op that reads one with grad enabled."""
import pytest
import torch
import torch.nn.functional as F

import fastlazy

pytestmark = pytest.mark.usefixtures("lazy_on")

OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05),
    "sgd-momentum-nesterov": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9,
                                                        nesterov=True, weight_decay=0.01),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=0.01, amsgrad=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=0.01, foreach=True),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.5),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1),
}


def parameters(make):
    g = torch.Generator().manual_seed(0)
    return [make(t.requires_grad_()) for t in (torch.randn(6, 4, generator=g) * 0.3,
                                                torch.zeros(6), torch.randn(3, 6, generator=g) * 0.3,
                                                torch.zeros(3))]


def data(make):
    g = torch.Generator().manual_seed(1)
    return make(torch.randn(5, 4, generator=g)), make(torch.randn(5, 3, generator=g))


def forward(ps, x):
    return F.linear(torch.tanh(F.linear(x, ps[0], ps[1])), ps[2], ps[3])


def train(make, optimizer, steps=4):
    ps = parameters(make)
    x, y = data(make)
    opt = OPTIMIZERS[optimizer](ps)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = F.mse_loss(forward(ps, x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, ps


def eager_value(t):
    return t.to_eager() if type(t) is fastlazy.LazyTensor else t


def eager_then_lazy(run):
    """run(make) on eager tensors (fastlazy off), then on LazyTensors."""
    fastlazy.disable()
    want = run(lambda t: t)
    fastlazy.enable()
    return want, run(fastlazy.lazy)


def bit_equal(got, want):
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_lazy_parameters_train_as_eager_ones_do(optimizer):
    (want_losses, want), (got_losses, got) = eager_then_lazy(lambda make: train(make, optimizer))
    assert got_losses == want_losses
    for w, g in zip(want, got):
        assert g.is_leaf and g.requires_grad and g.grad_fn is None
        bit_equal(eager_value(g).detach(), w.detach())
        bit_equal(eager_value(g.grad), w.grad)
        value = g.to_eager()
        assert value.is_leaf and value.requires_grad


def test_a_step_computes_nothing_and_its_updates_run_together():
    ps = parameters(fastlazy.lazy)
    x, y = data(fastlazy.lazy)
    opt = torch.optim.Adam(ps, lr=0.01)
    for _ in range(2):
        opt.zero_grad()
        F.mse_loss(forward(ps, x), y).backward()
        flushes = fastlazy.metrics.counters()["flushes"]
        opt.step()
        # the step recorded every update: no parameter was computed
        assert fastlazy.metrics.counters()["flushes"] == flushes
        assert all(not p.is_materialized for p in ps)
        # ... and each still answers as eager's leaf, its gradient readable
        # and clearable without computing the update
        assert all(p.is_leaf and p.requires_grad and p.grad_fn is None for p in ps)
        assert all(p.grad is not None for p in ps)
        opt.zero_grad()
        assert all(p.grad is None for p in ps)
        assert fastlazy.metrics.counters()["flushes"] == flushes
    # the next forward's first read of a parameter runs every update at once
    out = forward(ps, x)
    assert fastlazy.metrics.counters()["flushes"] == flushes + 1
    assert all(p.is_materialized for p in ps)
    assert out.requires_grad and out.grad_fn is not None


def test_writing_a_pending_update_with_grad_enabled_is_eagers_error():
    (p,) = parameters(fastlazy.lazy)[:1]
    p.grad = torch.ones(6, 4)
    with torch.no_grad():
        p.sub_(p.grad, alpha=0.1)
    assert not p.is_materialized
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        p.add_(1)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        p.addcdiv_(torch.ones(6, 4), torch.ones(6, 4))
    torch.testing.assert_close(p.detach().to_eager(), eager_value(parameters(lambda t: t)[0])
                               .detach() - 0.1)


@pytest.mark.parametrize("write", [lambda p: p.mul_(0.5), lambda p: p.lerp_(torch.zeros(6, 4), 0.5),
                                   lambda p: p.copy_(p * 0.5)],
                         ids=["C rule", "generic", "copy_"])
def test_a_pending_update_keeps_the_gradient_and_hooks_of_its_leaf(write):
    def run(make):
        (p,) = parameters(make)[:1]
        seen = []
        p.register_hook(lambda g: g * 2)
        p.register_post_accumulate_grad_hook(lambda q: seen.append(eager_value(q.grad).clone()))
        for _ in range(2):
            (p * p).sum().backward()
            with torch.no_grad():
                write(p)
                write(p)      # written again while its update is pending
        return eager_value(p).detach(), eager_value(p.grad), seen

    want, got = eager_then_lazy(run)
    bit_equal(got[0], want[0])
    bit_equal(got[1], want[1])
    assert len(got[2]) == len(want[2]) == 2
    for g, w in zip(got[2], want[2]):
        bit_equal(g, w)


def test_detach_and_requires_grad_false_on_a_pending_update_are_eagers():
    p, q = parameters(fastlazy.lazy)[:2]
    with torch.no_grad():
        p.mul_(2)
        q.add_(1)
    p.detach_()
    q.requires_grad_(False)
    assert not p.requires_grad and p.is_leaf and p.grad_fn is None
    assert not q.requires_grad and not q.to_eager().requires_grad
    torch.testing.assert_close(p.to_eager(), parameters(lambda t: t)[0].detach() * 2)


def _under_no_grad(write):
    def f(w):
        with torch.no_grad():
            write(w)
    return f


@pytest.mark.parametrize("write", [
    lambda w: w.detach().add_(5),
    lambda w: w.data.mul_(2),
    lambda w: w.data.__setitem__(1, 7.0),
    _under_no_grad(lambda w: w.add_(5)),
    _under_no_grad(lambda w: w.lerp_(torch.zeros(3), 0.5)),
    _under_no_grad(lambda w: w.add_(5).mul_(2)),
    lambda w: setattr(w, "data", torch.ones(3)),
], ids=["detach", "data", "data setitem", "no_grad C rule", "no_grad generic", "no_grad twice",
        "data assigned"])
def test_a_gradient_recorded_before_a_write_reaches_the_written_leaf(write):
    """The loss is recorded before the leaf is written, and backpropagated
    after: eager's one leaf gets the gradient (of the values read before the
    write: sub saves none), which the written copy must have."""
    def run(make):
        w = make(torch.tensor([1., -4., 2.])).requires_grad_()
        y = 1 - w
        write(w)
        (y * y).sum().backward()
        (3 * w).sum().backward()        # and one recorded after the write
        return eager_value(w).detach(), eager_value(w.grad), w.is_leaf, w.requires_grad

    want, got = eager_then_lazy(run)
    bit_equal(got[0], want[0])
    bit_equal(got[1], want[1])
    assert got[2:] == want[2:]


def test_a_known_write_to_a_computed_value_or_parameter_is_recorded_by_the_core(monkeypatch):
    """An optimizer's state (a computed value) and a parameter written
    under no_grad: once the signature is known, the core records the write
    without going up into Python (a materialized value no view shares)."""
    from fastlazy import generic

    def step(state, p, g):
        state.lerp_(g, 0.1)
        with torch.no_grad():
            p.addcmul_(state, state, value=0.5)

    fastlazy.disable()
    want_state, want_p = torch.zeros(4), torch.ones(4).requires_grad_()
    g = torch.arange(4.0)
    for _ in range(3):
        step(want_state, want_p, g)
    fastlazy.enable()
    state, p = fastlazy.lazy(torch.zeros(4)), fastlazy.lazy(torch.ones(4)).requires_grad_()
    step(state, p, g)
    state.to_eager(), p.to_eager()                # both values, as after a step's flush
    step(state, p, g)
    state.to_eager(), p.to_eager()
    monkeypatch.setattr(generic, "record", lambda *a, **k: pytest.fail("went up into generic"))
    step(state, p, g)
    monkeypatch.undo()
    assert p.is_leaf and p.requires_grad and not p.is_materialized
    bit_equal(state.to_eager(), want_state)
    bit_equal(p.to_eager().detach(), want_p.detach())
    assert p.to_eager().is_leaf and p.to_eager().requires_grad
