"""torch's Python functions called with LazyTensors have their bodies
recorded call by call (fastlazy/python_bodies.py): no analysis of the whole
function, one graph across batch sizes, eager's values and errors."""
import threading

import pytest
import torch
import torch.nn.functional as F

import fastlazy
import fastlazy.debug
from fastlazy import metrics, python_bodies
from helpers import generic_calls

pytestmark = pytest.mark.usefixtures("lazy_on")


def _attention(batch_first=True, **kwargs):
    torch.manual_seed(0)
    return torch.nn.MultiheadAttention(32, 4, batch_first=batch_first, **kwargs).eval()


def _attention_forward(mha, x, need_weights):
    """nn.MultiheadAttention's ordinary path (its forward takes a fused
    kernel in inference: test_attention_in_inference_takes_eagers_kernel)."""
    return F.multi_head_attention_forward(
        x, x, x, mha.embed_dim, mha.num_heads, mha.in_proj_weight, mha.in_proj_bias,
        None, None, False, 0.0, mha.out_proj.weight, mha.out_proj.bias, training=False,
        need_weights=need_weights)


@pytest.mark.parametrize("need_weights", [False, True])
def test_multi_head_attention_is_recorded_op_by_op(need_weights):
    mha = _attention(batch_first=False)
    metrics.reset()
    for batch in (2, 3, 5):
        x = torch.randn(7, batch, 32)
        with torch.no_grad():
            want = _attention_forward(mha, x, need_weights)
            before = generic_calls()
            got = _attention_forward(mha, fastlazy.lazy(x), need_weights)
        assert generic_calls() == before, "analysed by the generic path"
        for g, w in zip(got, want):
            if w is None:
                assert g is None
            else:
                torch.testing.assert_close(g.to_eager(), w)
    # one graph for every batch size (the sizes the body computes are read
    # when the graph runs)
    assert metrics.counters()["cache_misses"] == 1


def test_attention_in_inference_takes_eagers_kernel():
    """Eager's nn.MultiheadAttention runs torch._native_multi_head_attention
    in inference; with LazyTensors it is recorded (fastlazy/fast_paths.py):
    eager's values bit for bit, one graph for every batch size."""
    mha = _attention()
    before = generic_calls()
    for batch in (2, 3, 5):
        x = torch.randn(batch, 7, 32)
        with torch.no_grad():
            want, _ = mha(x, x, x, need_weights=False)
            lx = fastlazy.lazy(x)
            got, none = mha(lx, lx, lx, need_weights=False)
        assert none is None
        torch.testing.assert_close(got.to_eager(), want, rtol=0, atol=0)
    # its C rule (R_NATIVE_MHA): no analysis at any batch size
    assert generic_calls() == before
    assert metrics.counters()["fallbacks"] == 0
    assert metrics.counters()["cache_misses"] == 1
    assert torch.overrides.has_torch_function((lx,))    # asked again: torch's answer


def test_attention_under_autocast_after_a_layer_with_a_bias_of_its_width():
    """Under autocast (one context) ViT's patch projection and its
    attention's output projection have biases of one size: the analysis of
    the attention call reuses the trial tensor the projection's analysis
    cast, which autocast's cache of cast weights would hand back with no
    cast to record (the call then ran eagerly: ViT at 0.6x eager's speed
    under bf16 autocast).  Analyses run with that cache off."""
    mha = _attention()
    project = torch.nn.Linear(16, 32).eval()
    x = torch.randn(2, 7, 16)
    metrics.reset()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        # (float32 again, as after ViT's layer norm: the fused kernel's
        # fast path takes no input of another dtype than its weights')
        h = project(x).float()
        want, _ = mha(h, h, h, need_weights=False)
        lh = project(fastlazy.lazy(x)).float()
        got, _ = mha(lh, lh, lh, need_weights=False)
        assert torch.is_autocast_cache_enabled()      # the user's setting is back
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.to_eager(), want, rtol=0, atol=0)
    assert metrics.counters()["fallbacks"] == 0, dict(metrics.fallback_reasons)


def _encoder_layer(**kwargs):
    torch.manual_seed(0)
    return torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True,
                                            **kwargs).eval()


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["norm_after", "norm_first"])
@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "padding_mask"])
def test_encoder_layer_in_inference_takes_eagers_fused_kernel(activation, norm_first, masked):
    """Eager's nn.TransformerEncoderLayer runs one fused kernel in inference
    (torch._transformer_encoder_layer_fwd, of 13 tensors, 14 with a mask);
    with a LazyTensor that call is recorded, as eager makes it: eager's
    values bit for bit, one graph for every batch size."""
    layer = _encoder_layer(activation=activation, norm_first=norm_first)
    metrics.reset()
    for batch in (2, 3, 5):
        x = torch.randn(batch, 7, 32)
        pad = torch.zeros(batch, 7, dtype=torch.bool)
        pad[:, 7 - batch:] = True
        with torch.no_grad():
            want = layer(x, **({"src_key_padding_mask": pad} if masked else {}))
            got = layer(fastlazy.lazy(x),
                        **({"src_key_padding_mask": fastlazy.lazy(pad)} if masked else {}))
            program = fastlazy.debug.dump_ir(got, "text")
        assert "_transformer_encoder_layer_fwd" in program
        torch.testing.assert_close(got.to_eager(), want, rtol=0, atol=0, equal_nan=True)
    counters = metrics.counters()
    assert counters["fallbacks"] == 0
    assert counters["cache_misses"] == 1
    if not masked:
        assert counters["nodes_recorded"] == 3        # one call each
    assert torch.overrides.has_torch_function((fastlazy.lazy(x),))    # torch's answer again


@pytest.mark.parametrize("length", [7, 1100])      # a trial run, a fake run (over 1M elements)
def test_encoder_layer_under_autocast_runs_on_values_with_eagers_dtype(length):
    """Under CPU autocast eager's layer still takes its fused kernel (its
    checks ask about CUDA's autocast only), which casts inside the kernel:
    bfloat16 out of float32 in.  The analysis of the call sees eager's
    dtype differ from its recorded program's (whose run, as the trial run
    under the recorder, keeps autocast out of the kernel), and the call runs
    on the values (counted as run eagerly), with eager's result."""
    layer = _encoder_layer()
    x = torch.randn(30, length, 32)
    metrics.reset()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = layer(x)
        got = layer(fastlazy.lazy(x))
    assert want.dtype == got.dtype == torch.bfloat16
    torch.testing.assert_close(got.to_eager(), want, rtol=0, atol=0)
    assert dict(metrics.fallbacks_by_op) == {"torch._transformer_encoder_layer_fwd": 1}


def test_encoder_layer_takes_eagers_ordinary_path_where_eager_does():
    """With gradients to record (or in training) eager takes the layer's
    ordinary path; so does a LazyTensor, with eager's values."""
    layer = _encoder_layer()
    x = torch.randn(2, 7, 32)
    want = layer(x)
    got = layer(fastlazy.lazy(x))
    assert "_transformer_encoder_layer_fwd" not in fastlazy.debug.dump_ir(got, "text")
    torch.testing.assert_close(got.to_eager(), want)
    got.sum().backward()
    assert all(p.grad is not None for p in layer.parameters())


def test_a_body_raises_eagers_error_at_the_call():
    mha = _attention(batch_first=False)
    x = torch.randn(5, 2, 32)
    mask = torch.zeros(3, 3)                    # wrong size: eager raises
    with pytest.raises(RuntimeError, match="2D attn_mask"):
        mha(x, x, x, attn_mask=mask)
    lx = fastlazy.lazy(x)
    with pytest.raises(RuntimeError, match="2D attn_mask"):
        mha(lx, lx, lx, attn_mask=mask)
    # the check is torch's own again for the next call on this thread
    assert F.has_torch_function((lx,))


def test_training_gradients_equal_eagers():
    mha = _attention().train()
    mha.dropout = 0.0
    x = torch.randn(2, 5, 32)
    out, _ = mha(x, x, x)
    out.sum().backward()
    want = [p.grad.clone() for p in mha.parameters()]
    mha.zero_grad()
    lx = fastlazy.lazy(x)
    out, _ = mha(lx, lx, lx)
    out.sum().backward()
    for p, w in zip(mha.parameters(), want):
        torch.testing.assert_close(p.grad, w)


def test_the_check_is_answered_no_once_and_only_on_its_thread():
    lx = fastlazy.lazy(torch.randn(2))
    seen = []

    def other():
        seen.append(F.has_torch_function((lx,)))

    python_bodies._state.pending = True
    try:
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        first, second = F.has_torch_function((lx,)), F.has_torch_function((lx,))
    finally:
        python_bodies._state.pending = False
    assert seen == [True]
    assert (first, second) == (False, True)


def test_only_functions_that_check_first_have_their_bodies_run():
    assert python_bodies._first_check(F.multi_head_attention_forward) == ("has_torch_function", -1)
    assert python_bodies._first_check(F.selu) == ("has_torch_function_unary", 1)

    def calls_first(x):
        y = abs(x)
        if F.has_torch_function_unary(x):
            return F.handle_torch_function(calls_first, (x,), x)
        return y

    assert python_bodies._first_check(calls_first) is None       # not F's module
    assert python_bodies._first_check(F.boolean_dispatch) is None  # no check
    assert python_bodies._first_check(torch.nn.functional.linear) is None  # builtin


def test_disable_gives_the_module_its_checks_back():
    fastlazy.disable()
    try:
        for name in python_bodies.CHECKS:
            assert not getattr(getattr(F, name), "fastlazy_gate", False)
    finally:
        fastlazy.enable()
    assert all(getattr(getattr(F, name), "fastlazy_gate", False)
               for name in python_bodies.CHECKS)


def test_a_call_that_writes_its_input_is_recorded_whole():
    """F.selu(x, inplace=True)'s body calls torch.selu_, which the generic
    path cannot functionalize alone: the call is analysed whole instead."""
    x = torch.randn(6)
    lx = fastlazy.lazy(x) * 1
    before = metrics.counters()["fallbacks"]
    out = F.selu(lx, inplace=True)
    assert out is lx
    assert metrics.counters()["fallbacks"] == before
    torch.testing.assert_close(lx.to_eager(), F.selu(x))


def test_attention_with_lazy_masks_takes_eagers_kernel():
    """A lazy padding mask is made a float mask by recorded calls whose
    analyses ask torch.overrides.has_torch_function about fake tensors:
    those questions get torch's answer, and the forward's own question
    about the LazyTensors still takes the fast path (bit for bit)."""
    mha = _attention()
    x = torch.randn(3, 5, 32)
    mask = torch.zeros(3, 5, dtype=torch.bool)
    mask[0, -1] = True
    with torch.no_grad():
        want, _ = mha(x, x, x, key_padding_mask=mask, need_weights=False)
        lx = fastlazy.lazy(x)
        got, _ = mha(lx, lx, lx, key_padding_mask=fastlazy.lazy(mask), need_weights=False)
    torch.testing.assert_close(got.to_eager(), want, rtol=0, atol=0)


@pytest.mark.parametrize("autocast", [False, True])
def test_large_masked_attention_returns_none_for_its_weights(autocast):
    """Over 1M input elements the masked call's analysis is a fake run,
    whose kernel gives the unasked-for attention weights as an empty tensor
    where eager's returns None: a real run says which."""
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(128, 4, batch_first=True).eval()
    x = torch.randn(32, 128, 128)
    mask = torch.zeros(32, 128, dtype=torch.bool)
    mask[:, -3:] = True
    metrics.reset()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        want = mha(x, x, x, key_padding_mask=mask, need_weights=False)
        lx = fastlazy.lazy(x)
        got = mha(lx, lx, lx, key_padding_mask=mask, need_weights=False)
    assert want[1] is None and got[1] is None
    assert got[0].dtype == want[0].dtype
    torch.testing.assert_close(got[0].to_eager(), want[0], rtol=0, atol=0)
    assert metrics.counters()["fallbacks"] == 0, dict(metrics.fallback_reasons)


def _in_functional(function):
    """`function`'s code as if defined in torch.nn.functional (whose
    checks are gated)."""
    import types
    return types.FunctionType(function.__code__, vars(F), function.__name__, None,
                              function.__closure__)


def test_a_body_that_runs_code_before_its_check_is_not_run():
    """Code before the check (an operator: any object's __add__) could
    reach another gated check first and take its answer."""
    def checks_first(x):
        if has_torch_function_unary(x):  # noqa: F821 - F's global, through _in_functional
            return handle_torch_function(checks_first, (x,), x)  # noqa: F821
        return x + 1

    def adds_first(x):
        y = x + 1
        if has_torch_function_unary(x):  # noqa: F821
            return handle_torch_function(adds_first, (x,), x)  # noqa: F821
        return y

    assert python_bodies._first_check(_in_functional(checks_first)) == \
        ("has_torch_function_unary", -1)
    assert python_bodies._first_check(_in_functional(adds_first)) is None


@pytest.mark.parametrize("backend", ["torchscript", "native", "eager", "inductor", "auto"],
                         indirect=True)
def test_the_fused_attention_compiles_on_every_backend(backend):
    mha = _attention()
    failures = metrics.counters()["compile_failures"]
    for batch in (2, 3):
        x = torch.randn(batch, 7, 32)
        with torch.no_grad():
            want, _ = mha(x, x, x, need_weights=False)
            lx = fastlazy.lazy(x) * 1
            got, _ = mha(lx, lx, lx, need_weights=False)
        torch.testing.assert_close(got.to_eager(), want, rtol=0, atol=0)
    assert metrics.counters()["compile_failures"] == failures
