"""Mutation through a view shows in its base, as in eager."""
import pytest
import torch

import fastlazy

pytestmark = pytest.mark.usefixtures("lazy_on")

PROGRAMS = {
    "index_add_": lambda x: (x[0].add_(1), x)[1],
    "view_mul_": lambda x: (x.view(-1).mul_(2), x)[1],
    "transpose_zero_": lambda x: (x.t().zero_(), x)[1],
    "slice_setitem": lambda x: (x[:, 1:].__setitem__(0, 7.0), x)[1],
    "setitem_on_base": lambda x: (x.__setitem__((1, 2), -3.0), x)[1],
    "chain_then_view": lambda x: ((x * 2)[1].sub_(5), x)[1],
    "iadd_through_view": lambda x: (x.view(2, 6)[1].__iadd__(x.view(-1)[:6]), x)[1],
}


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_mutation_through_views(name):
    fn = PROGRAMS[name]
    base = torch.arange(12.0).reshape(3, 4)
    want = fn(base.clone())
    lazy_x = fastlazy.lazy(base.clone()) * 1       # a pending LazyTensor
    got = fn(lazy_x)
    assert torch.equal(got.to_eager(), want)


def test_lazy_made_from_a_tensor_is_never_written_by_direct_inplace():
    t = torch.ones(3)
    x = fastlazy.lazy(t)
    x.add_(1)
    x.mul_(3)
    assert torch.equal(x.to_eager(), torch.full((3,), 6.0)) and torch.equal(t, torch.ones(3))
