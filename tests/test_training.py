"""A torch_xla-style training loop with lazy forward passes gives eager's
losses; random ops (dropout) give eager's numbers for the same seed."""
import pytest
import torch
from torch import nn

import fastlazy

pytestmark = pytest.mark.usefixtures("lazy_on")


def make_model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.3),
                         nn.Linear(16, 16), nn.Sigmoid(), nn.Linear(16, 1))


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)) for _ in range(n)]


def train(model, data, lazy):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    torch.manual_seed(123)        # the dropout masks
    for x, y in data:
        if lazy:
            x, y = x.to("lazy"), y.to("lazy")
        opt.zero_grad()
        out = model(x)
        loss = ((out - y) ** 2).mean()
        loss.backward()
        opt.step()
        if lazy:
            fastlazy.mark_step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", ["torchscript", "eager"])
def test_xla_style_loop_matches_eager(name):
    fastlazy.set_backend(name)
    try:
        data = batches(6)
        eager = train(make_model(0), data, lazy=False)
        lazy = train(make_model(0), data, lazy=True)
    finally:
        fastlazy.set_backend("torchscript")
    # the same kernels in the same order: bit-equal, not merely close
    assert lazy == eager


def test_seeded_dropout_is_bit_equal_to_eager():
    x = torch.rand(64, 64)
    torch.manual_seed(7)
    want = [torch.nn.functional.dropout(x * 2, 0.5, training=True) for _ in range(3)]
    torch.manual_seed(7)
    got = [torch.nn.functional.dropout(fastlazy.lazy(x) * 2, 0.5, training=True)
           for _ in range(3)]
    for g, w in zip(got, want):
        assert isinstance(g, fastlazy.LazyTensor)
        assert torch.equal(g.to_eager(), w)
    torch.manual_seed(3)
    b = torch.bernoulli(fastlazy.lazy(torch.full((32,), 0.5)))
    torch.manual_seed(3)
    assert torch.equal(b.to_eager(), torch.bernoulli(torch.full((32,), 0.5)))
