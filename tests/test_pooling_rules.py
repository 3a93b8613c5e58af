"""F.max_pool2d and F.adaptive_avg_pool2d, as nn.MaxPool2d and
nn.AdaptiveAvgPool2d call them, are recorded by C rules: no signature
analysis at a first call or a new input size.  Indices, an output size of
None and sizes beyond the attr's fields are the generic path's; empty
inputs run eagerly.  Either way: eager's values, bit for bit."""
import pytest
import torch
import torch.nn.functional as F

import fastlazy
from fastlazy import metrics


@pytest.fixture(autouse=True)
def fresh():
    yield
    fastlazy.mark_step()


def _counts():
    c = metrics.counters()
    return c["generic_calls"], c["fallbacks"]


RECORDED = {
    "max": lambda x: F.max_pool2d(x, 2),
    "max-stride-pad": lambda x: F.max_pool2d(x, 3, 2, 1),
    "max-pairs": lambda x: F.max_pool2d(x, (3, 2), stride=(1, 2), padding=(1, 0),
                                        dilation=(1, 2)),
    "max-ceil": lambda x: F.max_pool2d(x, 3, 2, ceil_mode=True),
    "MaxPool2d": lambda x: torch.nn.MaxPool2d(3, stride=2, padding=1)(x),
    "adaptive-1": lambda x: F.adaptive_avg_pool2d(x, 1),
    "adaptive-pair": lambda x: F.adaptive_avg_pool2d(x, (4, 3)),
    "AdaptiveAvgPool2d": lambda x: torch.nn.AdaptiveAvgPool2d((2, 2))(x),
}


@pytest.mark.parametrize("shape", [(2, 3, 9, 8), (3, 9, 8)], ids=["batch", "unbatched"])
@pytest.mark.parametrize("name", list(RECORDED))
def test_calls_are_recorded_by_the_c_rules(name, shape):
    call, x = RECORDED[name], torch.randn(shape)
    lx = fastlazy.lazy(x) * 1
    before = _counts()
    got = call(lx)
    assert _counts() == before
    want = call(x * 1)
    assert got.shape == want.shape
    torch.testing.assert_close(got.to_eager(), want, rtol=0, atol=0)


def test_a_new_input_size_needs_no_analysis():
    m = torch.nn.Sequential(torch.nn.MaxPool2d(3, 2, 1), torch.nn.AdaptiveAvgPool2d(1))
    before = _counts()
    for batch, size in ((1, 8), (2, 8), (3, 13), (5, 7)):
        x = torch.randn(batch, 4, size, size)
        torch.testing.assert_close(m(fastlazy.lazy(x)).to_eager(), m(x), rtol=0, atol=0)
    assert _counts() == before


@pytest.mark.parametrize("call", [
    lambda x: F.max_pool2d(x, 2, return_indices=True)[1],
    lambda x: F.max_pool2d(x, 9),                          # beyond the attr's field
    lambda x: F.adaptive_avg_pool2d(x, (None, 2)),
    lambda x: F.adaptive_avg_pool2d(x, 300),
], ids=["indices", "kernel-9", "adaptive-none", "adaptive-300"])
def test_calls_the_rules_do_not_take_are_the_generic_paths(call):
    x = torch.randn(2, 3, 10, 10)
    generic, fallbacks = _counts()
    got = call(fastlazy.lazy(x))
    assert _counts() == (generic + 1, fallbacks)
    torch.testing.assert_close(got.to_eager(), call(x), rtol=0, atol=0)


@pytest.mark.parametrize("call", [lambda x: F.max_pool2d(x, 2),
                                  lambda x: F.adaptive_avg_pool2d(x, 2)], ids=["max", "adaptive"])
def test_empty_inputs_run_eagerly(call):
    x = torch.randn(0, 3, 4, 4)
    fallbacks = metrics.counters()["fallbacks"]
    got = call(fastlazy.lazy(x))
    assert metrics.counters()["fallbacks"] == fallbacks + 1
    assert got.shape == call(x).shape


def test_gradients_through_both_pools():
    x = torch.randn(2, 3, 9, 9)
    want_x, got_x = x.clone().requires_grad_(), fastlazy.lazy(x).requires_grad_()
    for t in (want_x, got_x):
        F.adaptive_avg_pool2d(F.max_pool2d(t, 3, 2, 1), 2).pow(2).sum().backward()
    grad = got_x.grad.to_eager() if isinstance(got_x.grad, fastlazy.LazyTensor) else got_x.grad
    torch.testing.assert_close(grad, want_x.grad)
