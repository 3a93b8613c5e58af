"""A slice or select of a LazyTensor that holds its value (a dataset made
lazy, a result already computed) holds eager's view of that value: the
graphs that read it take it as an input, the same graph at every offset,
and the generic calls that take it are analysed once, not per offset.
It stays a view of its root: writes show through both ways, as in
eager."""
import pytest
import torch
import torch.nn.functional as F

import fastlazy
from fastlazy import capture, views

from helpers import fastlazy_enabled  # noqa: F401  (module-scoped enable)

pytestmark = pytest.mark.usefixtures("flush_after")


@pytest.fixture
def analysed(monkeypatch):
    """The calls the generic path analyses (a new signature each)."""
    seen = []
    real = capture.analyse
    monkeypatch.setattr(capture, "analyse", lambda func, *a, **k: seen.append(func) or
                        real(func, *a, **k))
    return seen


def test_a_loop_over_a_lazy_dataset_is_one_graph_analysed_once(analysed):
    torch.manual_seed(0)
    xs, ys = torch.randn(200, 8), torch.randn(200, 1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    X, Y = fastlazy.lazy(xs), fastlazy.lazy(ys)

    def loss(x, y, i):
        with torch.no_grad():
            return F.mse_loss(model(x[i:i + 10]), y[i:i + 10]).item()

    loss(X, Y, 0)
    misses = fastlazy.metrics.counters()["cache_misses"]
    calls = len(analysed)
    for i in range(5, 150, 7):
        assert loss(X, Y, i) == pytest.approx(loss(xs, ys, i), rel=1e-6)
    assert fastlazy.metrics.counters()["cache_misses"] == misses, "a graph per offset"
    assert len(analysed) == calls, f"analysed again at new offsets: {analysed[calls:]}"


def test_a_held_slice_sees_a_later_write_to_its_root_and_writes_through_to_it():
    def program(lz):
        x = lz(torch.arange(24.).view(4, 6))
        row, piece = x[1], x[2:, 1:4]
        x.mul_(2)                          # both views see it
        seen = row.sum(), piece.sum()
        piece.add_(100)                    # the root and the row see it
        return x, row, piece, seen

    want = program(lambda t: t)
    got = program(fastlazy.lazy)
    for g, w in zip(got[:3], want[:3]):
        torch.testing.assert_close(g.to_eager(), w, rtol=0, atol=0)
    for g, w in zip(got[3], want[3]):
        torch.testing.assert_close(g.to_eager(), w, rtol=0, atol=0)


def test_a_generic_view_of_a_held_slice_is_placed_in_the_root_at_every_offset(analysed):
    xs = torch.randn(12, 4, 4)
    x = fastlazy.lazy(xs.clone())
    want = xs.clone()
    for i in (0, 3, 7):
        d = torch.diagonal(x[i], 0, 0, 1)         # a view of a view of the value
        eager = torch.diagonal(want[i], 0, 0, 1)
        assert views.place(d) == (x, eager.shape, eager.stride(), eager.storage_offset())
        torch.testing.assert_close(d.to_eager(), torch.diagonal(want[i], 0, 0, 1))
        d.add_(10)                               # written through to x
        torch.diagonal(want[i], 0, 0, 1).add_(10)
        torch.testing.assert_close(x.to_eager(), want, rtol=0, atol=0)
    assert analysed.count(torch.diagonal) == 1, "the diagonal analysed per offset"


def test_a_dtype_view_of_a_held_slice_keeps_eagers_values():
    xs = torch.arange(16, dtype=torch.float64)
    x = fastlazy.lazy(xs.clone())
    got = x[4:8].view(torch.int32)
    torch.testing.assert_close(got.to_eager(), xs[4:8].view(torch.int32), rtol=0, atol=0)
    got.add_(1)
    want = xs.clone()
    want[4:8].view(torch.int32).add_(1)
    torch.testing.assert_close(x.to_eager(), want, rtol=0, atol=0)
    # a wider dtype: placed where the offset is a whole number of its
    # elements, eager's error where not
    ys = torch.arange(16, dtype=torch.int32)
    y = fastlazy.lazy(ys)
    torch.testing.assert_close(y[2:6].view(torch.float64).to_eager(),
                               ys[2:6].view(torch.float64), rtol=0, atol=0, equal_nan=True)
    with pytest.raises(RuntimeError, match="storage_offset"):
        ys[1:5].view(torch.float64)
    with pytest.raises(RuntimeError, match="storage_offset"):
        y[1:5].view(torch.float64).to_eager()


@pytest.mark.parametrize("make", [
    lambda t: fastlazy.lazy(t.requires_grad_()),           # autograd: slicing's backward
    lambda t: fastlazy.lazy(t) * 1,                        # pending
    lambda t: fastlazy.lazy(t).view(torch.int32),          # a dtype view of the root
], ids=["requires_grad", "pending", "dtype_view"])
def test_what_is_not_held_is_recorded(make):
    t = torch.randn(6, 6)
    got = make(t.clone())[1:3, 2]
    assert not views.held(got) and not got.is_materialized
    torch.testing.assert_close(got.to_eager(), make(t.clone())[1:3, 2].to_eager(), rtol=0, atol=0)


def test_a_slice_of_a_value_laid_out_channels_last_is_recorded():
    # (its views' places are in its contiguous layout, not its value's)
    t = torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last)
    got = fastlazy.lazy(t)[1, 1:3]
    assert not views.held(got) and not got.is_materialized
    torch.testing.assert_close(got.to_eager(), t[1, 1:3], rtol=0, atol=0)


def test_a_slice_of_a_view_of_a_value_is_held_at_its_place():
    t = torch.randn(5, 7)
    x = fastlazy.lazy(t.clone())
    got = x.t()[2:5, 1:3]                  # a recorded view, then slices of it
    assert views.held(got)
    torch.testing.assert_close(got.to_eager(), t.t()[2:5, 1:3], rtol=0, atol=0)
    assert got.to_eager().stride() == t.t()[2:5, 1:3].stride()


def test_a_held_slice_takes_part_in_autograd_as_a_constant():
    # a slice of a dataset feeds a model; gradients reach its parameters
    torch.manual_seed(1)
    xs = torch.randn(40, 5)
    lin = torch.nn.Linear(5, 1)
    ref = torch.nn.Linear(5, 1)
    ref.load_state_dict(lin.state_dict())
    X = fastlazy.lazy(xs)
    for i in (0, 10, 20):
        lin(X[i:i + 10]).pow(2).mean().backward()
        ref(xs[i:i + 10]).pow(2).mean().backward()
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad)
    torch.testing.assert_close(lin.bias.grad, ref.bias.grad)


def test_a_write_lets_the_held_views_old_storage_go():
    import weakref
    t = torch.randn(64, 64)
    x = fastlazy.lazy(t)
    rows = x[2:10]
    assert views.held(rows)
    storage = weakref.ref(rows.to_eager())
    del t
    x.mul_(2)                                # rows are rebound: they hold no eager view
    assert not views.held(rows) and rows.family.held is None
    x.to_eager()
    rows.to_eager()
    import gc
    gc.collect()
    assert storage() is None, "the written root's old view is kept alive"


def test_writes_at_a_new_place_every_step_carry_to_every_view():
    # each write is carried to the family's views by fastlazy's own calls,
    # whose numbers are places: they never run eagerly for taking new
    # values at every flush (fastlazy.churn: that raised an internal error
    # at the 17th place)
    def program(lz, sync):
        x = lz(torch.zeros(64, 8))
        for i in range(30):
            sync()
            window = x[i:i + 8]
            x[i].add_(1)
            torch.diagonal(window).add_(2)
        return x

    want = program(lambda t: t, lambda: None)
    got = program(fastlazy.lazy, fastlazy.mark_step)
    torch.testing.assert_close(got.to_eager(), want, rtol=0, atol=0)


def test_as_strided_of_a_held_slice_at_a_storage_offset_it_names():
    # the offset is the storage's, not the slice's: runs eagerly, where a
    # default offset (the slice's own) is recorded
    def program(lz):
        x = lz(torch.arange(40.))
        a = x[10:30]
        named = a.as_strided((3, 3), (3, 1), 2)
        named.add_(1000)
        own = a.as_strided((2,), (5,))
        return x, own

    for got, want in zip(program(fastlazy.lazy), program(lambda t: t)):
        torch.testing.assert_close(got.to_eager(), want, rtol=0, atol=0)


def test_a_dtype_view_of_a_slice_of_a_value_at_a_storage_offset():
    # the root's value starts at an odd element of its storage: eager's
    # error for the view that starts there, at the call
    base = torch.arange(80, dtype=torch.int16)
    x = fastlazy.lazy(base[1:65])
    torch.testing.assert_close(x[1:9].view(torch.int32).to_eager(),
                               base[1:65][1:9].view(torch.int32), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="storage_offset"):
        x[0:8].view(torch.int32)


LEAVES_OF_VIEWS = {
    "detach_of_result": lambda t: t.exp().detach().requires_grad_(),
    "slice": lambda t: t[1:].requires_grad_(),
    "detach": lambda t: t.detach().requires_grad_(),
    "data": lambda t: t.data.requires_grad_(),
    "attribute": lambda t: (t + 1).detach().requires_grad_(True),
}


@pytest.mark.parametrize("view", [lambda c: c[0:1], lambda c: c[0], lambda c: c.narrow(0, 0, 1),
                                  lambda c: c[:, 1]],
                         ids=["slice", "select", "narrow", "column"])
@pytest.mark.parametrize("make_leaf", LEAVES_OF_VIEWS.values(), ids=LEAVES_OF_VIEWS.keys())
def test_a_slice_of_a_leaf_made_of_a_view_carries_the_leafs_gradient(make_leaf, view):
    """`x_adv = x.clone().detach().requires_grad_()` (an adversarial
    attack's leaf): the leaf is a view whose root holds a value requiring
    no grad, and a slice of it is no held view of that value (it would
    not require grad), but the leaf's own view, whose gradient reaches it."""
    def program(t):
        c = make_leaf(t)
        v = view(c)
        ((v * 2).sum() + c.sum()).backward()
        return v.requires_grad, c.grad
    x = torch.arange(6.0).reshape(3, 2)
    want = program(x.clone())
    got = program(fastlazy.lazy(x.clone()))
    assert got[0] == want[0] is True
    assert torch.equal(got[1].to_eager() if isinstance(got[1], fastlazy.LazyTensor) else got[1],
                       want[1])
