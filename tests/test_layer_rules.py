"""The C rules for the ops models call at every layer, as nn modules call
them: F.conv2d of a batch, F.max_pool2d, F.adaptive_avg_pool2d,
F.embedding, torch.addmm (GPT-2's Conv1D).  A model's first call and each
new batch size or sequence length record them with no signature analysis
(the generic path's costs 0.1-0.5 ms a call, and a model has dozens).
Calls a rule does not take are the generic path's; empty tensors run
eagerly where eager's checks of them differ by kernel.  Either way:
eager's values, bit for bit, and eager's errors."""
import pytest
import torch
import torch.nn.functional as F

import fastlazy
from fastlazy import metrics
from helpers import generic_calls


pytestmark = pytest.mark.usefixtures("flush_after")


def _counts():
    """(calls the generic path recorded, calls run eagerly)."""
    c = metrics.counters()
    return c["generic_calls"], c["fallbacks"]


# --------------------------------------------------------------------------
# F.conv2d of a batch, as nn.Conv2d calls it, is recorded by a C rule: no
# signature analysis at its first call or at a new batch size or image size
# (the generic path's costs 0.1-0.5 ms a call, and a model has dozens).
# Calls the rule does not take are the generic path's; empty tensors run
# eagerly.  Either way: eager's values, bit for bit, and eager's errors.
@pytest.mark.parametrize("kwargs,groups", [
    ({}, 1),
    ({"stride": 2}, 1),
    ({"padding": 1}, 1),
    ({"stride": (2, 1), "padding": (1, 3), "dilation": (1, 2)}, 1),
    ({"stride": [16, 4], "padding": [7, 0], "dilation": [2, 1]}, 1),
    ({"groups": 2, "padding": 1}, 2),
    ({"groups": 4}, 4),                   # depthwise
])
def test_conv2d_calls_are_recorded_by_the_c_rule(kwargs, groups):
    x = torch.randn(2, 4, 11, 9)
    w, b = torch.randn(8, 4 // groups, 3, 3), torch.randn(8)
    before = _counts()
    got = F.conv2d(fastlazy.lazy(x) * 1, w, b, **kwargs)
    assert _counts() == before
    want = F.conv2d(x * 1, w, b, **kwargs)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got.to_eager(), want, rtol=0, atol=0)


def test_conv2d_a_new_batch_or_image_size_needs_no_analysis():
    """The point of the rule: a model at a new input size records its
    convolutions as at the first one (and its graph is shape-generic)."""
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                            torch.nn.Conv2d(8, 8, 3, stride=2, groups=8, bias=False))
    before = _counts()
    for batch, size in ((1, 8), (2, 8), (3, 12), (5, 7)):
        x = torch.randn(batch, 3, size, size)
        torch.testing.assert_close(m(fastlazy.lazy(x)).to_eager(), m(x), rtol=0, atol=0)
    assert _counts() == before


def test_conv2d_gradients_to_the_input_weight_and_bias():
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
def test_conv2d_calls_the_rule_does_not_take_are_the_generic_paths(x_shape, call):
    x, w = torch.randn(x_shape), torch.randn(4, 3, 3, 3)
    generic, fallbacks = _counts()
    got = call(fastlazy.lazy(x), w)
    assert _counts() == (generic + 1, fallbacks)
    torch.testing.assert_close(got.to_eager(), call(x, w), rtol=0, atol=0)


@pytest.mark.parametrize("x_shape,w_shape", [((0, 3, 6, 6), (4, 3, 3, 3)),
                                             ((2, 3, 6, 6), (0, 3, 3, 3))])
def test_conv2d_empty_tensors_run_eagerly(x_shape, w_shape):
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
def test_conv2d_eagers_errors_at_the_call(call):
    x = torch.randn(2, 3, 9, 9)
    with pytest.raises(RuntimeError) as want:
        call(x)
    with pytest.raises(type(want.value)):
        call(fastlazy.lazy(x))


# --------------------------------------------------------------------------
# F.max_pool2d and F.adaptive_avg_pool2d, as nn.MaxPool2d and
# nn.AdaptiveAvgPool2d call them, are recorded by C rules: no signature
# analysis at a first call or a new input size.  Indices, an output size of
# None and sizes beyond the attr's fields are the generic path's; empty
# inputs run eagerly.  Either way: eager's values, bit for bit.
POOLING_CALLS = {
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
@pytest.mark.parametrize("name", list(POOLING_CALLS))
def test_pooling_calls_are_recorded_by_the_c_rules(name, shape):
    call, x = POOLING_CALLS[name], torch.randn(shape)
    lx = fastlazy.lazy(x) * 1
    before = _counts()
    got = call(lx)
    assert _counts() == before
    want = call(x * 1)
    assert got.shape == want.shape
    torch.testing.assert_close(got.to_eager(), want, rtol=0, atol=0)


def test_pooling_a_new_input_size_needs_no_analysis():
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
def test_pooling_calls_the_rules_do_not_take_are_the_generic_paths(call):
    x = torch.randn(2, 3, 10, 10)
    generic, fallbacks = _counts()
    got = call(fastlazy.lazy(x))
    assert _counts() == (generic + 1, fallbacks)
    torch.testing.assert_close(got.to_eager(), call(x), rtol=0, atol=0)


@pytest.mark.parametrize("call", [lambda x: F.max_pool2d(x, 2),
                                  lambda x: F.adaptive_avg_pool2d(x, 2)], ids=["max", "adaptive"])
def test_pooling_empty_inputs_run_eagerly(call):
    x = torch.randn(0, 3, 4, 4)
    fallbacks = metrics.counters()["fallbacks"]
    got = call(fastlazy.lazy(x))
    assert metrics.counters()["fallbacks"] == fallbacks + 1
    assert got.shape == call(x).shape


def test_pooling_gradients_through_both_pools():
    x = torch.randn(2, 3, 9, 9)
    want_x, got_x = x.clone().requires_grad_(), fastlazy.lazy(x).requires_grad_()
    for t in (want_x, got_x):
        F.adaptive_avg_pool2d(F.max_pool2d(t, 3, 2, 1), 2).pow(2).sum().backward()
    grad = got_x.grad.to_eager() if isinstance(got_x.grad, fastlazy.LazyTensor) else got_x.grad
    torch.testing.assert_close(grad, want_x.grad)


# --------------------------------------------------------------------------
# F.embedding, as nn.Embedding calls it, is recorded by a C rule: no
# signature analysis at a first call or a new sequence length.  max_norm
# (which renormalizes the weight's rows in place), sparse gradients and
# gradients scaled by frequency are the generic path's, which runs max_norm
# eagerly -- writing the LazyTensor weight, never the tensor it was made
# from.
@pytest.mark.parametrize("kwargs", [{}, {"padding_idx": 0}, {"padding_idx": -2}],
                         ids=["plain", "padding", "negative-padding"])
@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32])
def test_embedding_lookups_are_recorded_by_the_c_rule(kwargs, ids_dtype):
    ids, w = torch.tensor([[1, 2, 0], [4, 3, 1]], dtype=ids_dtype), torch.randn(5, 4)
    before = generic_calls()
    got = F.embedding(fastlazy.lazy(ids), w, **kwargs)
    assert generic_calls() == before
    torch.testing.assert_close(got.to_eager(), F.embedding(ids, w, **kwargs), rtol=0, atol=0)


def test_embedding_a_new_sequence_length_needs_no_analysis():
    e = torch.nn.Embedding(10, 4, padding_idx=0)
    before = generic_calls()
    for seq in (3, 5, 8):
        ids = torch.randint(0, 10, (2, seq))
        torch.testing.assert_close(e(fastlazy.lazy(ids)).to_eager(), e(ids), rtol=0, atol=0)
    assert generic_calls() == before


def test_embedding_the_padding_rows_gradient_is_zero_as_in_eager():
    ids = torch.tensor([[1, 0, 0], [2, 3, 0]])
    want, got = torch.nn.Embedding(5, 3, padding_idx=0), torch.nn.Embedding(5, 3, padding_idx=0)
    got.load_state_dict(want.state_dict())
    want(ids).pow(2).sum().backward()
    got(fastlazy.lazy(ids)).pow(2).sum().backward()
    grad = got.weight.grad
    grad = grad.to_eager() if isinstance(grad, fastlazy.LazyTensor) else grad
    torch.testing.assert_close(grad, want.weight.grad, rtol=0, atol=0)
    assert not grad[0].any()


def test_embedding_max_norm_writes_the_lazy_weight_not_the_tensor_it_was_made_from():
    ids = torch.tensor([[1, 2, 0], [3, 3, 1]])
    w = torch.randn(5, 4) * 3
    source = w.clone()
    lw = fastlazy.lazy(w)
    got = F.embedding(fastlazy.lazy(ids), lw, max_norm=1.0)
    want_w = source.clone()
    want = F.embedding(ids, want_w, max_norm=1.0)
    assert torch.equal(w, source)                      # untouched
    torch.testing.assert_close(got.to_eager(), want, rtol=0, atol=0)
    torch.testing.assert_close(lw.to_eager(), want_w, rtol=0, atol=0)   # renormalized


# --------------------------------------------------------------------------
# torch.addmm(bias, x, weight), as GPT-2's Conv1D calls it at every layer,
# is recorded by a C rule: no signature analysis at a first call or a new
# sequence length.  beta and alpha, and the calls the rule leaves, are the
# generic path's.  Either way: eager's values, bit for bit.
@pytest.mark.parametrize("bias_shape", [(4,), (3, 4), (1, 4), (3, 1), ()])
def test_addmm_calls_are_recorded_by_the_c_rule(bias_shape):
    b, x, w = torch.randn(bias_shape), torch.randn(3, 5), torch.randn(5, 4)
    before = generic_calls()
    got = torch.addmm(b, fastlazy.lazy(x) * 1, w)
    method = fastlazy.lazy(b).addmm(x, w)
    assert generic_calls() == before
    want = torch.addmm(b, x, w)
    torch.testing.assert_close(got.to_eager(), want, rtol=0, atol=0)
    torch.testing.assert_close(method.to_eager(), want, rtol=0, atol=0)


def test_addmm_a_new_sequence_length_needs_no_analysis():
    w, b = torch.randn(8, 24), torch.randn(24)
    before = generic_calls()
    for seq in (3, 5, 8):
        x = torch.randn(2, seq, 8)
        lx = fastlazy.lazy(x)
        got = torch.addmm(b, lx.view(-1, 8), w)
        want = torch.addmm(b, x.view(-1, 8), w)
        torch.testing.assert_close(got.to_eager(), want, rtol=0, atol=0)
    # (the views are C rules too: tests/test_view_rules.py)
    assert generic_calls() == before


@pytest.mark.parametrize("kwargs", [{"beta": 0.5}, {"alpha": 2}, {"beta": 0, "alpha": 3}])
def test_addmm_beta_and_alpha_are_the_generic_paths(kwargs):
    b, x, w = torch.randn(4), torch.randn(3, 5), torch.randn(5, 4)
    before = generic_calls()
    got = torch.addmm(b, fastlazy.lazy(x), w, **kwargs)
    assert generic_calls() == before + 1
    torch.testing.assert_close(got.to_eager(), torch.addmm(b, x, w, **kwargs), rtol=0, atol=0)


def test_addmm_gradients_to_every_operand():
    b, x, w = torch.randn(4), torch.randn(3, 5), torch.randn(5, 4)
    want = [t.clone().requires_grad_() for t in (b, x, w)]
    got = [b.clone().requires_grad_(), fastlazy.lazy(x).requires_grad_(),
           w.clone().requires_grad_()]
    torch.addmm(*want).pow(2).sum().backward()
    torch.addmm(*got).pow(2).sum().backward()
    for g, e in zip(got, want):
        grad = g.grad.to_eager() if isinstance(g.grad, fastlazy.LazyTensor) else g.grad
        torch.testing.assert_close(grad, e.grad)


# --------------------------------------------------------------------------
# F.scaled_dot_product_attention as transformers call it in inference (q,
# k, v transposed views of (batch, seq, heads, dim), a mask or is_causal,
# a scale) is recorded by a C rule, the scale interned; dropout (random:
# the generic path draws its noise at the call) and masks eager's kernel
# refuses are not.
def _heads(batch, seq, heads=2, dim=4):
    """A (batch, heads, seq, dim) view, as attention layers make them."""
    return fastlazy.lazy(torch.randn(batch, seq, heads, dim)).transpose(1, 2)


@pytest.mark.parametrize("kwargs", [{}, {"is_causal": True}, {"scale": 0.125},
                                    {"attn_mask": "bool"}, {"attn_mask": "float", "scale": 0.5}],
                         ids=["plain", "causal", "scale", "bool-mask", "float-mask"])
def test_sdpa_calls_are_recorded_by_the_c_rule(kwargs):
    q, k, v = _heads(2, 5), _heads(2, 5), _heads(2, 5)
    kinds = {"bool": torch.rand(5, 5) > 0.3, "float": torch.randn(2, 1, 5, 5)}
    kwargs = {name: kinds.get(value, value) if name == "attn_mask" else value
              for name, value in kwargs.items()}
    before = _counts()
    got = F.scaled_dot_product_attention(q, k, v, **kwargs)
    assert _counts()[0] == before[0]
    want = F.scaled_dot_product_attention(q.to_eager(), k.to_eager(), v.to_eager(), **kwargs)
    torch.testing.assert_close(got.to_eager(), want, rtol=0, atol=0)


def test_sdpa_a_new_sequence_length_needs_no_analysis():
    before = generic_calls()
    for seq in (3, 5, 8):
        q, k, v = _heads(1, seq), _heads(1, seq), _heads(1, seq)
        got = F.scaled_dot_product_attention(q * 1, k * 1, v * 1, is_causal=True, scale=0.3)
        want = F.scaled_dot_product_attention(q.to_eager(), k.to_eager(), v.to_eager(),
                                              is_causal=True, scale=0.3)
        torch.testing.assert_close(got.to_eager(), want, rtol=0, atol=0)
    # (the transposes are C rules too: tests/test_view_rules.py)
    assert generic_calls() == before


def test_sdpa_dropout_is_the_generic_paths_and_draws_as_eager():
    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    before = generic_calls()
    torch.manual_seed(7)
    got = F.scaled_dot_product_attention(fastlazy.lazy(q), k, v, dropout_p=0.5)
    assert generic_calls() == before + 1      # its noise drawn at the call, as eager's
    torch.manual_seed(7)
    want = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    torch.testing.assert_close(got.to_eager(), want, rtol=0, atol=0)


@pytest.mark.parametrize("mask_shape", [(5,), (1, 1, 1, 2, 3, 5)], ids=["1-d", "6-d"])
def test_sdpa_masks_eagers_kernel_refuses_raise_at_the_call(mask_shape):
    q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 6)
    mask = torch.rand(mask_shape) > 0.5
    with pytest.raises(Exception) as want:
        F.scaled_dot_product_attention(q, k, v, mask)
    with pytest.raises(type(want.value)):
        F.scaled_dot_product_attention(fastlazy.lazy(q), k, v, mask)


def test_sdpa_gradients_to_query_key_and_value():
    qkv = [torch.randn(1, 2, 4, 8) for _ in range(3)]
    want = [t.clone().requires_grad_() for t in qkv]
    got = [fastlazy.lazy(t).requires_grad_() for t in qkv]
    for ts in (want, got):
        F.scaled_dot_product_attention(*ts, is_causal=True).pow(2).sum().backward()
    for g, w in zip(got, want):
        grad = g.grad.to_eager() if isinstance(g.grad, fastlazy.LazyTensor) else g.grad
        torch.testing.assert_close(grad, w.grad)


# --------------------------------------------------------------------------
# F.hardtanh (nn.Hardtanh, and nn.ReLU6, which is one) and F.relu6, in place
# or not, are recorded by a C rule: eager's values and gradients -- which
# pass strictly between the limits, none at them -- and eager's
# ValueError where the lower limit exceeds the upper.
HARDTANH_CALLS = {
    "relu6": lambda x: F.relu6(x),
    "relu6_inplace": lambda x: F.relu6(x * 1, inplace=True),
    "hardtanh": lambda x: F.hardtanh(x),
    "hardtanh_limits": lambda x: F.hardtanh(x, -0.5, 2),
    "hardtanh_inplace": lambda x: F.hardtanh(x * 1, 0.0, 6.0, True),
    "ReLU6_module": lambda x: torch.nn.ReLU6(inplace=True)(x * 1),
}


def _at_the_limits():
    # every limit of the calls above, each side of it, and between
    return torch.tensor([-7.0, -1.0, -0.5, -0.25, 0.0, 0.5, 1.0, 2.0, 3.0, 6.0, 6.5,
                         float("nan")])


@pytest.mark.parametrize("name", list(HARDTANH_CALLS))
def test_hardtanh_calls_are_recorded_by_the_c_rule(backend, name):
    call = HARDTANH_CALLS[name]
    x = _at_the_limits()
    before = _counts()
    got = call(fastlazy.lazy(x))
    assert _counts() == before
    torch.testing.assert_close(got.to_eager(), call(x), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("backend", ["torchscript", "native", "eager", "inductor"],
                         indirect=True)
@pytest.mark.parametrize("name", list(HARDTANH_CALLS))
def test_hardtanh_gradients_are_zero_at_the_limits_as_in_eager(backend, name):
    call = HARDTANH_CALLS[name]
    want_x = _at_the_limits()[:-1].requires_grad_()
    call(want_x * 1).mul(torch.arange(11.0)).sum().backward()
    got_x = fastlazy.lazy(_at_the_limits()[:-1]).requires_grad_()
    call(got_x * 1).mul(torch.arange(11.0)).sum().backward()
    grad = got_x.grad
    grad = grad.to_eager() if isinstance(grad, fastlazy.LazyTensor) else grad
    torch.testing.assert_close(grad, want_x.grad, rtol=0, atol=0)


def test_hardtanh_lower_limit_above_the_upper_raises_eagers_error_at_the_call():
    x = fastlazy.lazy(torch.randn(3))
    with pytest.raises(ValueError, match="min_val cannot be greater than max_val"):
        F.hardtanh(x, 2.0, 1.0)
    with pytest.raises(ValueError, match="min_val cannot be greater than max_val"):
        F.hardtanh(x * 1, 2, 1, inplace=True)
    assert x.to_eager().shape == (3,)
