"""A LazyTensor is accepted where libraries expect a torch.Tensor:
isinstance and torch.is_tensor answer True, while type() stays LazyTensor,
and what that promise implies works without computing the value."""
import pytest
import torch

import fastlazy
from fastlazy import LazyTensor

pytestmark = pytest.mark.usefixtures("lazy_on")


def test_isinstance_and_is_tensor_answer_true():
    x = fastlazy.lazy(torch.rand(2, 3)) + 1
    assert isinstance(x, torch.Tensor)
    assert torch.is_tensor(x)
    assert type(x) is LazyTensor
    assert isinstance(x, LazyTensor)
    assert not isinstance(x, torch.nn.Parameter)
    assert fastlazy.metrics.counters()["flushes"] == 0        # nothing computed


def test_code_that_checks_isinstance_then_calls_methods():
    def normalize(t):
        if not isinstance(t, torch.Tensor):
            raise TypeError("expected a tensor")
        return (t - t.mean(-1, keepdim=True)) / t.std(-1, keepdim=True)

    a = torch.rand(4, 5)
    got = normalize(fastlazy.lazy(a))
    assert type(got) is LazyTensor
    torch.testing.assert_close(got.to_eager(), normalize(a))
