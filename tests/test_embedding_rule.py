"""F.embedding, as nn.Embedding calls it, is recorded by a C rule: no
signature analysis at a first call or a new sequence length.  max_norm
(which renormalizes the weight's rows in place), sparse gradients and
gradients scaled by frequency are the generic path's, which runs max_norm
eagerly -- writing the LazyTensor weight, never the tensor it was made
from."""
import pytest
import torch
import torch.nn.functional as F

import fastlazy
from fastlazy import metrics


@pytest.fixture(autouse=True)
def fresh():
    yield
    fastlazy.mark_step()


def _generic_calls():
    return metrics.counters()["generic_calls"]


@pytest.mark.parametrize("kwargs", [{}, {"padding_idx": 0}, {"padding_idx": -2}],
                         ids=["plain", "padding", "negative-padding"])
@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32])
def test_lookups_are_recorded_by_the_c_rule(kwargs, ids_dtype):
    ids, w = torch.tensor([[1, 2, 0], [4, 3, 1]], dtype=ids_dtype), torch.randn(5, 4)
    before = _generic_calls()
    got = F.embedding(fastlazy.lazy(ids), w, **kwargs)
    assert _generic_calls() == before
    torch.testing.assert_close(got.to_eager(), F.embedding(ids, w, **kwargs), rtol=0, atol=0)


def test_a_new_sequence_length_needs_no_analysis():
    e = torch.nn.Embedding(10, 4, padding_idx=0)
    before = _generic_calls()
    for seq in (3, 5, 8):
        ids = torch.randint(0, 10, (2, seq))
        torch.testing.assert_close(e(fastlazy.lazy(ids)).to_eager(), e(ids), rtol=0, atol=0)
    assert _generic_calls() == before


def test_the_padding_rows_gradient_is_zero_as_in_eager():
    ids = torch.tensor([[1, 0, 0], [2, 3, 0]])
    want, got = torch.nn.Embedding(5, 3, padding_idx=0), torch.nn.Embedding(5, 3, padding_idx=0)
    got.load_state_dict(want.state_dict())
    want(ids).pow(2).sum().backward()
    got(fastlazy.lazy(ids)).pow(2).sum().backward()
    grad = got.weight.grad
    grad = grad.to_eager() if isinstance(grad, fastlazy.LazyTensor) else grad
    torch.testing.assert_close(grad, want.weight.grad, rtol=0, atol=0)
    assert not grad[0].any()


def test_max_norm_writes_the_lazy_weight_not_the_tensor_it_was_made_from():
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
