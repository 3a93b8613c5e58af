"""torch.addmm(bias, x, weight), as GPT-2's Conv1D calls it at every layer,
is recorded by a C rule: no signature analysis at a first call or a new
sequence length.  beta and alpha, and the calls the rule leaves, are the
generic path's.  Either way: eager's values, bit for bit."""
import pytest
import torch

import fastlazy
from fastlazy import metrics


@pytest.fixture(autouse=True)
def fresh():
    yield
    fastlazy.mark_step()


def _generic_calls():
    return metrics.counters()["generic_calls"]


@pytest.mark.parametrize("bias_shape", [(4,), (3, 4), (1, 4), (3, 1), ()])
def test_calls_are_recorded_by_the_c_rule(bias_shape):
    b, x, w = torch.randn(bias_shape), torch.randn(3, 5), torch.randn(5, 4)
    before = _generic_calls()
    got = torch.addmm(b, fastlazy.lazy(x) * 1, w)
    method = fastlazy.lazy(b).addmm(x, w)
    assert _generic_calls() == before
    want = torch.addmm(b, x, w)
    torch.testing.assert_close(got.to_eager(), want, rtol=0, atol=0)
    torch.testing.assert_close(method.to_eager(), want, rtol=0, atol=0)


def test_a_new_sequence_length_needs_no_analysis():
    w, b = torch.randn(8, 24), torch.randn(24)
    before = _generic_calls()
    for seq in (3, 5, 8):
        x = torch.randn(2, seq, 8)
        lx = fastlazy.lazy(x)
        got = torch.addmm(b, lx.view(-1, 8), w)
        want = torch.addmm(b, x.view(-1, 8), w)
        torch.testing.assert_close(got.to_eager(), want, rtol=0, atol=0)
    # the views are the generic path's (one per sequence length); addmm none
    assert _generic_calls() - before == 3


@pytest.mark.parametrize("kwargs", [{"beta": 0.5}, {"alpha": 2}, {"beta": 0, "alpha": 3}])
def test_beta_and_alpha_are_the_generic_paths(kwargs):
    b, x, w = torch.randn(4), torch.randn(3, 5), torch.randn(5, 4)
    before = _generic_calls()
    got = torch.addmm(b, fastlazy.lazy(x), w, **kwargs)
    assert _generic_calls() == before + 1
    torch.testing.assert_close(got.to_eager(), torch.addmm(b, x, w, **kwargs), rtol=0, atol=0)


def test_gradients_to_every_operand():
    b, x, w = torch.randn(4), torch.randn(3, 5), torch.randn(5, 4)
    want = [t.clone().requires_grad_() for t in (b, x, w)]
    got = [b.clone().requires_grad_(), fastlazy.lazy(x).requires_grad_(),
           w.clone().requires_grad_()]
    torch.addmm(*want).pow(2).sum().backward()
    torch.addmm(*got).pow(2).sum().backward()
    for g, e in zip(got, want):
        grad = g.grad.to_eager() if isinstance(g.grad, fastlazy.LazyTensor) else g.grad
        torch.testing.assert_close(grad, e.grad)
