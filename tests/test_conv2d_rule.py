"""F.conv2d of a batch, as nn.Conv2d calls it, is recorded by a C rule: no
signature analysis at its first call or at a new batch size or image size
(the generic path's costs 0.1-0.5 ms a call, and a model has dozens).
Calls the rule does not take are the generic path's; empty tensors run
eagerly.  Either way: eager's values, bit for bit, and eager's errors."""
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


@pytest.mark.parametrize("kwargs,groups", [
    ({}, 1),
    ({"stride": 2}, 1),
    ({"padding": 1}, 1),
    ({"stride": (2, 1), "padding": (1, 3), "dilation": (1, 2)}, 1),
    ({"stride": [16, 4], "padding": [7, 0], "dilation": [2, 1]}, 1),
    ({"groups": 2, "padding": 1}, 2),
    ({"groups": 4}, 4),                   # depthwise
])
def test_calls_are_recorded_by_the_c_rule(kwargs, groups):
    x = torch.randn(2, 4, 11, 9)
    w, b = torch.randn(8, 4 // groups, 3, 3), torch.randn(8)
    before = _counts()
    got = F.conv2d(fastlazy.lazy(x) * 1, w, b, **kwargs)
    assert _counts() == before
    want = F.conv2d(x * 1, w, b, **kwargs)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got.to_eager(), want, rtol=0, atol=0)


def test_a_new_batch_or_image_size_needs_no_analysis():
    """The point of the rule: a model at a new input size records its
    convolutions as at the first one (and its graph is shape-generic)."""
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                            torch.nn.Conv2d(8, 8, 3, stride=2, groups=8, bias=False))
    before = _counts()
    for batch, size in ((1, 8), (2, 8), (3, 12), (5, 7)):
        x = torch.randn(batch, 3, size, size)
        torch.testing.assert_close(m(fastlazy.lazy(x)).to_eager(), m(x), rtol=0, atol=0)
    assert _counts() == before


def test_gradients_to_the_input_weight_and_bias():
    x = torch.randn(2, 3, 6, 6)
    want_m = torch.nn.Conv2d(3, 4, 3, padding=1, stride=2)
    got_m = torch.nn.Conv2d(3, 4, 3, padding=1, stride=2)
    got_m.load_state_dict(want_m.state_dict())
    want_x = x.clone().requires_grad_()
    got_x = fastlazy.lazy(x).requires_grad_()
    want_m(want_x).pow(2).sum().backward()
    got_m(got_x).pow(2).sum().backward()
    for g, w in zip([got_x, *got_m.parameters()], [want_x, *want_m.parameters()]):
        grad = g.grad.to_eager() if isinstance(g.grad, fastlazy.LazyTensor) else g.grad
        torch.testing.assert_close(grad, w.grad)


@pytest.mark.parametrize("x_shape,call", [
    ((2, 3, 9, 9), lambda x, w: F.conv2d(x, w, padding="same")),
    ((3, 9, 9), lambda x, w: F.conv2d(x, w)),                   # unbatched
    ((2, 3, 9, 9), lambda x, w: F.conv2d(x, w, padding=8)),     # beyond the attr's field
    ((2, 3, 9, 9), lambda x, w: F.conv2d(x, w, stride=17)),
    ((2, 3, 9, 9), lambda x, w: F.conv2d(x, w, dilation=3)),
    ((2, 3, 9, 9), lambda x, w: F.conv2d(x, w, stride=(2,))),   # eager expands one value
], ids=["same", "unbatched", "padding-8", "stride-17", "dilation-3", "stride-1-tuple"])
def test_calls_the_rule_does_not_take_are_the_generic_paths(x_shape, call):
    x, w = torch.randn(x_shape), torch.randn(4, 3, 3, 3)
    generic, fallbacks = _counts()
    got = call(fastlazy.lazy(x), w)
    assert _counts() == (generic + 1, fallbacks)
    torch.testing.assert_close(got.to_eager(), call(x, w), rtol=0, atol=0)


@pytest.mark.parametrize("x_shape,w_shape", [((0, 3, 6, 6), (4, 3, 3, 3)),
                                             ((2, 3, 6, 6), (0, 3, 3, 3))])
def test_empty_tensors_run_eagerly(x_shape, w_shape):
    """eager returns an empty batch's result and refuses a weight with no
    output channels; a meta kernel would take both."""
    x, w = torch.randn(x_shape), torch.randn(w_shape)
    try:
        want = F.conv2d(x, w)
    except RuntimeError as exc:
        with pytest.raises(RuntimeError, match="expected weight to be at least 1"):
            F.conv2d(fastlazy.lazy(x), w)
        assert "expected weight" in str(exc)
        return
    fallbacks = metrics.counters()["fallbacks"]
    got = F.conv2d(fastlazy.lazy(x), w)
    assert metrics.counters()["fallbacks"] == fallbacks + 1
    torch.testing.assert_close(got.to_eager(), want)


@pytest.mark.parametrize("call", [
    lambda x: F.conv2d(x, torch.randn(4, 2, 3, 3)),                  # channels
    lambda x: F.conv2d(x, torch.randn(4, 3, 3, 3), torch.randn(5)),  # bias size
    lambda x: F.conv2d(x, torch.randn(4, 3, 3, 3, dtype=torch.float64)),
    lambda x: F.conv2d(x, torch.randn(4, 3, 11, 3)),                 # kernel > input
    lambda x: F.conv2d(x, torch.randn(4, 3, 3, 3), stride=0),
    lambda x: F.conv2d(x, torch.randn(6, 1, 3, 3), groups=2),        # 3 % 2
], ids=["channels", "bias", "dtype", "kernel", "stride-0", "groups"])
def test_eagers_errors_at_the_call(call):
    x = torch.randn(2, 3, 9, 9)
    with pytest.raises(RuntimeError) as want:
        call(x)
    with pytest.raises(type(want.value)):
        call(fastlazy.lazy(x))
