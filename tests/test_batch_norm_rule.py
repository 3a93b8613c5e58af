"""F.batch_norm in inference (nn.BatchNorm's eval mode) is recorded by a C
rule; in training, and wherever the rule does not apply, it takes the
generic path as before.  Either way: eager's values, dtypes and errors."""
import pytest
import torch
import torch.nn.functional as F

import fastlazy
from fastlazy import metrics
from helpers import generic_calls


pytestmark = pytest.mark.usefixtures("flush_after")


def _stats(channels, dtype=torch.float32):
    g = torch.Generator().manual_seed(channels)
    return [torch.randn(channels, generator=g, dtype=dtype),
            torch.rand(channels, generator=g, dtype=dtype) + 0.5,
            torch.randn(channels, generator=g, dtype=dtype),
            torch.randn(channels, generator=g, dtype=dtype)]


@pytest.mark.parametrize("shape", [(2, 3), (2, 3, 5), (2, 3, 4, 4), (1, 3, 2, 2, 2)])
@pytest.mark.parametrize("call", [
    lambda x, rm, rv, w, b: F.batch_norm(x, rm, rv),
    lambda x, rm, rv, w, b: F.batch_norm(x, rm, rv, w, b),
    lambda x, rm, rv, w, b: F.batch_norm(x, rm, rv, w, b, False, 0.1, 1e-3),
    lambda x, rm, rv, w, b: F.batch_norm(x, rm, rv, weight=w, eps=1e-4, momentum=0.0),
    lambda x, rm, rv, w, b: F.batch_norm(x, rm, rv, bias=b, training=False),
], ids=["stats", "affine", "positional", "keywords", "bias-only"])
def test_inference_is_recorded_by_the_c_rule(shape, call):
    x = torch.randn(*shape)
    stats = _stats(shape[1])
    lx = fastlazy.lazy(x) * 1
    before = generic_calls()
    got = call(lx, *stats)
    assert generic_calls() == before
    assert got.shape == x.shape and got.dtype == x.dtype
    torch.testing.assert_close(got.to_eager(), call(x * 1, *stats), rtol=0, atol=0)


def test_a_batchnorm_module_in_eval_mode():
    m = torch.nn.BatchNorm2d(4).eval()
    m.running_mean.normal_()
    m.running_var.uniform_(0.5, 2)
    x = torch.randn(2, 4, 3, 3)
    before = generic_calls()
    got = m(fastlazy.lazy(x) * 1)
    assert generic_calls() == before
    torch.testing.assert_close(got.to_eager(), m(x), rtol=0, atol=0)


def test_gradients_to_the_input_and_the_affine_parameters():
    x = torch.randn(2, 3, 4)
    rm, rv, w, b = _stats(3)
    want = [t.clone().requires_grad_() for t in (x, w, b)]
    got = [fastlazy.lazy(x).requires_grad_(), w.clone().requires_grad_(),
           b.clone().requires_grad_()]
    F.batch_norm(want[0], rm, rv, want[1], want[2]).pow(2).sum().backward()
    F.batch_norm(got[0], rm, rv, got[1], got[2]).pow(2).sum().backward()
    for g, e in zip(got, want):
        grad = g.grad.to_eager() if isinstance(g.grad, fastlazy.LazyTensor) else g.grad
        torch.testing.assert_close(grad, e.grad)


@pytest.mark.parametrize("numel_per_channel", [8, 40_000], ids=["small", "large"])
def test_training_without_statistics_is_recorded_by_the_generic_path(numel_per_channel):
    """(BatchNorm with track_running_stats=False.)  The calls the rule does
    not take are the generic path's as a generic row's: no trial run, so an
    input too large for one is recorded too, not run eagerly."""
    x = torch.randn(2, 16, numel_per_channel)
    before = metrics.counters()["fallbacks"]
    got = F.batch_norm(fastlazy.lazy(x), None, None, training=True)
    torch.testing.assert_close(got.to_eager(), F.batch_norm(x, None, None, training=True))
    assert metrics.counters()["fallbacks"] == before


@pytest.mark.parametrize("numel_per_channel", [8, 40_000], ids=["small", "large"])
def test_a_module_in_training_is_recorded_by_the_generic_path(numel_per_channel):
    """Training writes the running statistics; the rule leaves such calls to
    the generic path as a generic row's calls, with no trial run -- so an
    input too large for one is recorded too, not run eagerly."""
    x = torch.randn(2, 16, numel_per_channel)
    want_module, got_module = torch.nn.BatchNorm1d(16), torch.nn.BatchNorm1d(16)
    want = want_module(x)
    before = metrics.counters()["fallbacks"]
    got = got_module(fastlazy.lazy(x))
    torch.testing.assert_close(got.to_eager(), want)
    assert metrics.counters()["fallbacks"] == before
    for g, w in zip(got_module.buffers(), want_module.buffers()):
        torch.testing.assert_close(g.to_eager() if isinstance(g, fastlazy.LazyTensor) else g, w)


@pytest.mark.parametrize("call", [
    lambda x, rm, rv: F.batch_norm(x, torch.randn(5), rv),          # stats of other sizes
    lambda x, rm, rv: F.batch_norm(x, rm, rv, momentum="fast"),     # a type eager refuses
    lambda x, rm, rv: F.batch_norm(x[0, 0], rm, rv),                 # 1-D input
    lambda x, rm, rv: F.batch_norm(x.long(), rm, rv),               # integers
    lambda x, rm, rv: F.batch_norm(x, None, None),                  # no statistics in eval
], ids=["sizes", "momentum-type", "1-d", "int", "no-stats"])
def test_calls_eager_rejects_raise_eagers_error_at_the_call(call):
    x = torch.randn(2, 3, 4)
    rm, rv = _stats(3)[:2]
    with pytest.raises(Exception) as eager:
        call(x, rm, rv)
    with pytest.raises(type(eager.value)):
        call(fastlazy.lazy(x) * 1, rm, rv)


@pytest.mark.parametrize("make", [
    lambda bn: torch.randn(4, 5),                  # more channels than statistics
    lambda bn: torch.randn(4, 100),                # (far more: it crashed)
    lambda bn: torch.randn(4, 2),                  # fewer
    lambda bn: (setattr(bn, "weight", torch.nn.Parameter(torch.ones(4))), torch.randn(4, 3))[1],
], ids=["5-channels", "100-channels", "2-channels", "weight-size"])
def test_a_module_in_training_given_other_channels_raises_eagers_error(make):
    """aten's functional batch norm, which a training step records, does
    not check that its statistics hold one value per channel (eager's
    batch_norm does): it read past them, and crashed given 100 channels.
    Before and after the module's signature is the core's to record."""
    bn = torch.nn.BatchNorm1d(3)
    for _ in range(2):
        bn(fastlazy.lazy(torch.randn(4, 3))).to_eager()
    x = make(bn)
    with pytest.raises(RuntimeError) as eager:
        torch.nn.BatchNorm1d(3).train()(x) if bn.weight.numel() == 3 else \
            F.batch_norm(x, bn.running_mean, bn.running_var, bn.weight, bn.bias, True)
    with pytest.raises(RuntimeError, match=str(eager.value)[:20]):
        bn(fastlazy.lazy(x)).to_eager()
    bn.weight = torch.nn.Parameter(torch.ones(3))
    torch.testing.assert_close(bn(fastlazy.lazy(torch.ones(4, 3))).to_eager(), torch.zeros(4, 3))


def test_mixed_dtypes_take_the_generic_path_with_eagers_values():
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    rm, rv, w, b = _stats(3)
    try:
        want = F.batch_norm(x, rm, rv, w, b)
    except RuntimeError as exc:
        with pytest.raises(type(exc)):
            F.batch_norm(fastlazy.lazy(x) * 1, rm, rv, w, b).to_eager()
        return
    before = generic_calls()
    got = F.batch_norm(fastlazy.lazy(x) * 1, rm, rv, w, b)
    assert generic_calls() == before + 1
    torch.testing.assert_close(got.to_eager(), want)


def test_inference_compiles_on_inductor_with_eps_a_graph_input():
    """eps is a graph input (a new value never recompiles); inductor gets
    batch_norm's arithmetic with it, not a .item() it cannot trace."""
    was = fastlazy.backend()
    fastlazy.set_backend("inductor")
    try:
        x = torch.randn(2, 3, 4, 4)
        rm, rv, w, b = _stats(3)
        before = metrics.counters()["compile_failures"]
        for eps in (1e-3, 1e-1):
            got = F.batch_norm(fastlazy.lazy(x) * 1, rm, rv, w, b, False, 0.1, eps)
            torch.testing.assert_close(got.to_eager(), F.batch_norm(x, rm, rv, w, b, False, 0.1, eps))
        assert metrics.counters()["compile_failures"] == before
    finally:
        fastlazy.set_backend(was)


def _bn_after_steps(lz, steps, load=None):
    """A BatchNorm1d(3) module after the given training steps (each a batch,
    or an Exception expected at its read), then load_state_dict(load) right
    after the last one when given, then one more step: what each read gave,
    and the statistics."""
    torch.manual_seed(0)
    emb, bn = torch.nn.Embedding(10, 3), torch.nn.BatchNorm1d(3)
    log = []
    for ids in steps:
        try:
            out = bn(emb(lz(torch.tensor(ids))))
            if load is None:      # (else the step's graph is still pending at the load)
                log.append(round(float(out.sum()), 4))
        except IndexError:
            log.append("IndexError")
    if load is not None:
        bn.load_state_dict(load)
        log.append(bn.running_mean.tolist())
    bn(emb(lz(torch.tensor([1, 2, 3]))))
    return log, bn.running_mean.tolist(), bn.running_var.tolist()


def test_a_failed_step_leaves_the_running_statistics_as_eager_does(lazy_on):
    """The middle batch's index is out of range: eager raises at the
    embedding, before the batch norm, and the statistics stay; the step's
    graph fails when read, and its write-back puts the buffers back as they
    were (they had stayed the failed values: every later step raised).
    (num_batches_tracked, which the module adds to eagerly before its batch
    norm, counts the failed step: its error comes at the read.)"""
    steps = ([1, 2, 3], [4, 5, 99], [6, 7, 8])
    want = _bn_after_steps(lambda t: t, steps)
    assert want[0][1] == "IndexError"
    assert _bn_after_steps(fastlazy.lazy, steps) == want


def test_load_state_dict_while_a_step_is_pending_is_kept(lazy_on):
    """load_state_dict copies the weight first, which runs the pending
    step's graph and restores the module's buffers; its reference to the
    pending running mean, taken before, must still write the buffer."""
    state = {"weight": torch.ones(3), "bias": torch.zeros(3), "running_mean": torch.ones(3),
             "running_var": torch.full((3,), 2.0), "num_batches_tracked": torch.tensor(0)}
    want = _bn_after_steps(lambda t: t, ([1, 2, 3],), load=state)
    assert want[0][-1] == [1.0, 1.0, 1.0]
    assert _bn_after_steps(fastlazy.lazy, ([1, 2, 3],), load=state) == want


def test_two_modules_sharing_their_statistics_update_them_as_eager(lazy_on):
    """b2's statistics are b1's tensors: eager updates them twice a step.
    b1's pending step holds their update, which b2 read stale (its
    statistics came out zeros); b2's call now computes b1's step first."""
    def run(lz):
        torch.manual_seed(0)
        b1, b2 = torch.nn.BatchNorm1d(3), torch.nn.BatchNorm1d(3)
        b2.running_mean, b2.running_var = b1.running_mean, b1.running_var
        outs = []
        for step in range(3):
            x = torch.randn(6, 3, 4, generator=torch.Generator().manual_seed(step))
            outs.append(b2(b1(lz(x))))
        return ([o.to_eager() if type(o) is not torch.Tensor else o for o in outs],
                b1.running_mean.tolist(), b2.running_mean.tolist(), b2.running_var.tolist())
    want, got = run(lambda t: t), run(fastlazy.lazy)
    for g, w in zip(got[0], want[0]):
        torch.testing.assert_close(g, w)
    assert got[1:] == want[1:]


def test_references_to_the_statistics_of_a_module_gone_before_the_read_are_updated(lazy_on):
    """The module is freed before the step's graph runs (a function that
    builds it and returns its output and buffers, a state_dict kept): the
    write-back still copies the update into the buffers' tensors, which
    eager updated in place."""
    def step(lz):
        bn = torch.nn.BatchNorm1d(3)
        state = bn.state_dict()
        y = bn(lz(torch.randn(4, 3, generator=torch.Generator().manual_seed(0))))
        return y, state["running_mean"], state["running_var"]

    want = step(lambda t: t)
    y, mean, var = step(fastlazy.lazy)
    torch.testing.assert_close(y.to_eager(), want[0])
    torch.testing.assert_close(mean, want[1], rtol=0, atol=0)
    torch.testing.assert_close(var, want[2], rtol=0, atol=0)


def test_a_training_module_called_under_inference_mode_then_trained(lazy_on):
    """A validation batch run under inference_mode without eval(): eager
    writes the buffers, which stay normal tensors that the next training
    step saves for backward (pending statistics would be inference
    tensors, which it could not)."""
    def run(lz):
        torch.manual_seed(0)
        bn = torch.nn.BatchNorm1d(3)
        x = lz(torch.randn(4, 3, generator=torch.Generator().manual_seed(1)))
        with torch.inference_mode():
            bn(x)
        bn(x).sum().backward()
        return bn.weight.grad, bn.running_mean, bn.running_var

    for got, want in zip(run(fastlazy.lazy), run(lambda t: t)):
        torch.testing.assert_close(got.to_eager() if hasattr(got, "to_eager") else got, want)


def test_functional_call_with_buffers_updates_the_tensors_given(lazy_on):
    """torch.func.functional_call swaps the given buffers in for the call and
    puts the module's own back after it: eager's batch norm wrote the given
    tensors in place, and so does the step's write-back."""
    from torch.func import functional_call

    def run(lz):
        torch.manual_seed(0)
        bn = torch.nn.BatchNorm1d(3)
        buffers = {name: b.clone() for name, b in bn.named_buffers()}
        mean, var = buffers["running_mean"], buffers["running_var"]
        x = lz(torch.randn(4, 3, generator=torch.Generator().manual_seed(1)))
        y = functional_call(bn, buffers, (x,))
        y = y.to_eager() if hasattr(y, "to_eager") else y
        return y, mean, var, bn.running_mean

    for got, want in zip(run(fastlazy.lazy), run(lambda t: t)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
