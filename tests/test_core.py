"""The core contract: metadata without running, values computed once,
flushes, the node buffer, fallbacks, metrics."""
import threading

import pytest
import torch

import fastlazy
from fastlazy import _core
from helpers import run_in_threads

pytestmark = pytest.mark.usefixtures("lazy_on")


def counters():
    return fastlazy.metrics.counters()


def test_metadata_without_running():
    a = torch.rand(3, 4).to("lazy")
    r = (a + torch.rand(4)) * 2
    assert isinstance(r, fastlazy.LazyTensor)
    assert r.shape == torch.Size([3, 4]) and r.size() == (3, 4) and r.size(-1) == 4
    assert r.dtype == torch.float32 and r.device == torch.device("cpu")
    assert r.ndim == 2 and r.dim() == 2 and r.numel() == 12 and len(r) == 3
    assert not r.requires_grad and r.is_lazy and not r.is_materialized
    assert counters()["flushes"] == 0
    with pytest.raises(IndexError):
        r.size(2)


def test_value_is_computed_once_and_kept():
    e = torch.rand(5)
    r = fastlazy.lazy(e).mul(3).add(1)
    first = r.to_eager()
    assert torch.equal(first, e * 3 + 1)
    assert r.to_eager() is first
    r.item if r.numel() == 1 else None
    r.tolist(), r.numpy(), repr(r), r.cpu()
    c = counters()
    assert c["flushes"] == 1 and c["materializations"] == 1


@pytest.mark.parametrize("read", [
    lambda t: t.to_eager(), lambda t: t.item(), lambda t: float(t), lambda t: int(t),
    lambda t: bool(t), lambda t: t.tolist(), lambda t: repr(t), lambda t: t.numpy(),
    lambda t: t.cpu(), lambda t: str(t), lambda t: f"{t:.2f}", lambda t: t.__index__()
    if t.dtype == torch.int64 else 0,
])
def test_every_value_read_materializes(read):
    t = fastlazy.lazy(torch.tensor(3)).add(4)
    read(t)
    assert t.is_materialized
    assert t.to_eager().item() == 7


def test_one_flush_computes_every_live_tensor():
    a = fastlazy.lazy(torch.rand(4))
    x, y = a + 1, a * 2
    x.to_eager()
    assert y.is_materialized
    assert counters()["flushes"] == 1
    assert torch.equal(y.to_eager(), a.to_eager() * 2)


def test_mark_step_flushes_all_live_tensors():
    a = fastlazy.lazy(torch.rand(4))
    xs = [a + i for i in range(5)]
    fastlazy.mark_step()
    assert all(x.is_materialized for x in xs)
    assert counters()["flush_reason.mark_step"] == 1
    assert _core.pending_nodes() == 0


def test_dead_nodes_are_pruned():
    a = fastlazy.lazy(torch.rand(4))
    keep = a.exp()
    for _ in range(10):
        tmp = a.mul(2).add(1)  # dropped: never computed
        tmp2 = tmp.sub(1)
    del tmp
    from fastlazy.graph import GraphView
    seg, idx = _core.pending_in(keep)
    view = GraphView(seg, [idx, _core.pending_in(tmp2)[1]])
    # keep (1 node) and tmp2 with its two inputs; the other 27 are dead
    assert len(view.nodes) == 4
    del tmp2
    keep.to_eager()


def test_discarded_results_do_not_fill_the_buffer():
    a = fastlazy.lazy(torch.rand(4))
    for _ in range(1000):
        a.add(1).mul(2).sub(3)
    assert _core.pending_nodes() == 0
    assert counters()["nodes_recorded"] == 3000


def test_flush_threshold():
    old = _core.get_flush_threshold()
    fastlazy.set_flush_threshold(10)
    try:
        a = fastlazy.lazy(torch.rand(4))
        b = fastlazy.lazy(torch.rand(4))
        live = [a * b for i in range(25)]
        assert counters()["flush_reason.threshold"] == 2
        assert _core.pending_nodes() == 5
        assert torch.equal(live[-1].to_eager(), a.to_eager() * b.to_eager())
        # scalar inputs count too: each one is a slot of the segment
        fastlazy.mark_step()
        live = [a + i for i in range(25)]
        assert counters()["flush_reason.threshold"] == 4
    finally:
        fastlazy.set_flush_threshold(old)
    with pytest.raises(ValueError):
        fastlazy.set_flush_threshold(0)


def test_scalar_values_do_not_recompile():
    a = fastlazy.lazy(torch.rand(8))
    for i, s in enumerate([1.5, 2.5, -3.0, 0.25]):
        r = (a * s + i).to_eager()
        assert torch.equal(r, a.to_eager() * s + i)
    c = counters()
    assert c["cache_misses"] == 1 and c["cache_hits"] == 3


def test_scalar_type_is_structure():
    a = fastlazy.lazy(torch.arange(4))
    assert (a * 2).dtype == torch.int64 and (a * 2.0).dtype == torch.float32
    (a * 2).to_eager(), (a * 2.0).to_eager(), (a * True).to_eager()
    assert counters()["cache_misses"] == 3


def test_inplace_rebinds_the_handle_and_never_mutates_the_source():
    e = torch.ones(3)
    x = fastlazy.lazy(e)
    y = x.add_(2)
    assert y is x and not x.is_materialized
    x *= 3
    x.sub_(torch.ones(3), alpha=2)
    assert torch.equal(x.to_eager(), torch.full((3,), 7.0))
    assert torch.equal(e, torch.ones(3))


def test_inplace_casts_to_self_dtype():
    x = fastlazy.lazy(torch.zeros(3, dtype=torch.float16))
    x.add_(torch.ones(3, dtype=torch.float64))
    assert x.dtype == torch.float16
    assert x.to_eager().dtype == torch.float16


def test_eager_tensor_mutated_by_lazy_argument_stays_eager():
    e = torch.zeros(3)
    out = e.add_(fastlazy.lazy(torch.ones(3)))
    assert out is e and type(out) is torch.Tensor
    assert torch.equal(e, torch.ones(3))


def test_op_without_a_row_is_recorded_by_the_generic_path():
    a = fastlazy.lazy(torch.arange(6.0))
    r = torch.cumsum(a * 2, 0)
    assert isinstance(r, fastlazy.LazyTensor) and not r.is_materialized
    assert torch.equal(r.to_eager(), torch.cumsum(torch.arange(6.0) * 2, 0))
    m = a.flip(0).sum(dim=0)
    assert isinstance(m, fastlazy.LazyTensor) and not m.is_materialized
    assert torch.equal(m.to_eager(), torch.arange(6.0).flip(0).sum(0))
    c = counters()
    assert c["generic_calls"] == 2 and c["fallbacks"] == 0


def test_unsafe_op_falls_back_and_stays_lazy():
    a = fastlazy.lazy(torch.tensor([0.0, 1.0, 0.0, 2.0]))
    r = torch.nonzero(a * 2)            # output shape depends on the data
    assert isinstance(r, fastlazy.LazyTensor) and r.is_materialized
    assert torch.equal(r.to_eager(), torch.tensor([[1], [3]]))
    assert counters()["fallback.nonzero"] == 1


def test_unsupported_inplace_method_rebinds():
    e = torch.arange(4.0)
    x = fastlazy.lazy(e)
    assert x.zero_() is x
    assert torch.equal(x.to_eager(), torch.zeros(4)) and torch.equal(e, torch.arange(4.0))


def test_mixed_eager_and_scalar_inputs():
    a = fastlazy.lazy(torch.rand(3, 1))
    b = torch.rand(4)
    r = (2 - a) / (b + 1) + 3 ** a
    ea = a.to_eager()
    assert torch.allclose(r.to_eager(), (2 - ea) / (b + 1) + 3 ** ea)
    assert r.shape == (3, 4)


def test_zero_dim_tensor_promotion():
    a = fastlazy.lazy(torch.tensor([1, 2], dtype=torch.uint8))
    r = a + torch.tensor(5)
    assert r.dtype == torch.uint8 and r.to_eager().dtype == torch.uint8
    r = a + torch.tensor(5.0, dtype=torch.float64)
    assert r.dtype == torch.float64


def test_default_dtype_is_read_at_the_call():
    a = fastlazy.lazy(torch.arange(3))
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert (a / 2).dtype == torch.float64 and (a * 0.5).dtype == torch.float64
    finally:
        torch.set_default_dtype(old)
    assert (a / 2).dtype == torch.float32


def test_torch_function_records_without_enable():
    fastlazy.disable()
    try:
        a = fastlazy.lazy(torch.rand(3))
        before = counters()["nodes_recorded"]
        r = torch.add(a, 1)
        s = a.mul(2)
        assert counters()["nodes_recorded"] == before + 2
        assert torch.equal(r.to_eager(), a.to_eager() + 1)
        assert torch.equal(s.to_eager(), a.to_eager() * 2)
    finally:
        fastlazy.enable()


def test_lazy_of_lazy_and_to():
    a = fastlazy.lazy(torch.rand(3))
    assert fastlazy.lazy(a) is a and a.to("lazy") is a
    same = a.to("cpu")                # the device it lives on: recorded, stays lazy
    assert type(same) is fastlazy.LazyTensor and torch.equal(same.to_eager(), a.to_eager())
    assert type(a.cpu()) is torch.Tensor
    d = a.to(torch.float64)
    assert isinstance(d, fastlazy.LazyTensor) and d.dtype == torch.float64
    with pytest.raises(TypeError):
        fastlazy.lazy([1, 2])
    with pytest.raises(TypeError):
        fastlazy.LazyTensor()


def test_metrics_api():
    a = fastlazy.lazy(torch.rand(3))
    (a + 1).to_eager()
    c = fastlazy.metrics.counters()
    for key in ("nodes_recorded", "flushes", "cache_hits", "cache_misses",
                "materializations", "fallbacks"):
        assert key in c
    assert type(c) is dict
    assert "nodes_recorded" in fastlazy.metrics.report()
    fastlazy.metrics.reset()
    assert fastlazy.metrics.counters()["nodes_recorded"] == 0


def test_failed_graph_leaves_other_tensors_usable():
    good = fastlazy.lazy(torch.arange(1, 5)) * 2
    bad = torch.div(fastlazy.lazy(torch.arange(4)), torch.zeros(4, dtype=torch.int64),
                    rounding_mode="floor")
    other = good + 1
    with pytest.raises(RuntimeError):
        bad.to_eager()
    # the segment failed as a whole; the tensors that do not depend on the
    # failing node are still computed, one by one
    assert torch.equal(good.to_eager(), torch.arange(1, 5) * 2)
    assert torch.equal(other.to_eager(), torch.arange(1, 5) * 2 + 1)
    with pytest.raises(RuntimeError):
        bad.to_eager()
    with pytest.raises(RuntimeError):
        bad + 1           # an op on a tensor whose flush failed
    assert _core.pending_nodes() == 0
    assert torch.equal((good * 3).to_eager(), torch.arange(1, 5) * 6)


def test_threads_record_and_materialize():
    inputs = [torch.rand(16, 16) for _ in range(4)]
    results = [None] * 4

    def work(k):
        x = fastlazy.lazy(inputs[k])
        for i in range(200):
            y = (x * 1.5 + i).sub(x).div(2)
            if i % 10 == 0:
                results[k] = y.to_eager()

    assert not run_in_threads(work, 4)
    for k in range(4):
        assert torch.allclose(results[k], (inputs[k] * 1.5 + 190).sub(inputs[k]).div(2))


def test_lazy_tensor_passed_between_threads():
    x = fastlazy.lazy(torch.rand(8)) * 2
    out = []
    t = threading.Thread(target=lambda: out.append((x + 1).to_eager()))
    t.start()
    t.join()
    assert torch.equal(out[0], x.to_eager() + 1)


@pytest.mark.cuda
def test_cuda_values_and_device():
    a = fastlazy.lazy(torch.rand(64, 64, device="cuda"))
    r = (a * 2 + 1).relu() - torch.tensor(0.5)   # a 0-dim CPU tensor may join
    assert r.device.type == "cuda"
    e = a.to_eager()
    for _ in range(3):     # the profiling executor fuses after a few runs
        out = ((a * 2 + 1).relu() - torch.tensor(0.5)).to_eager()
    assert torch.allclose(out, (e * 2 + 1).relu() - 0.5)


def test_eager_input_written_in_place_after_use_is_computed_first():
    b = torch.ones(3)
    r = fastlazy.lazy(torch.zeros(3)) + b
    b.add_(1)                        # patched in-place entry: flushes first
    assert torch.equal(r.to_eager(), torch.ones(3))
    assert counters()["flush_reason.eager_write"] == 1


def test_input_mutated_behind_our_back_is_an_error_not_a_wrong_value():
    b = torch.ones(3)
    r = fastlazy.lazy(torch.zeros(3)) + b
    torch.Tensor.add_.__wrapped__(b, 1)      # the original, unpatched method
    with pytest.raises(RuntimeError, match="modified in place after a lazy op used it"):
        r.to_eager()


def test_dead_nodes_and_their_inputs_do_not_change_the_key():
    b, c = fastlazy.lazy(torch.rand(3)), fastlazy.lazy(torch.rand(3))
    e = torch.rand(3)

    def f():
        return (b * c + c).to_eager()

    f()
    b + 1                             # dropped at the tail
    z = fastlazy.lazy(e) * e          # a dead node that stays, with its own slots
    keep = z + 1
    del z
    fastlazy.mark_step()
    z = c * e
    r = b * c + c                     # recorded after a dead node and new slots
    del z
    assert torch.equal(r.to_eager(), f())
    c_ = counters()
    assert c_["cache_misses"] == 2 and c_["cache_hits"] == 2     # keep's graph + f
    del keep


def test_fast_path_and_general_path_record_the_same_node():
    a, b = fastlazy.lazy(torch.rand(3, 2)), fastlazy.lazy(torch.rand(3, 2))
    i, j = fastlazy.lazy(torch.arange(6).view(3, 2)), fastlazy.lazy(torch.full((3, 2), 4))
    # positional same-meta calls take the fast path; keyword calls do not
    pairs = [(lambda: a.add(b), lambda: torch.add(input=a, other=b)),
             (lambda: a - b, lambda: torch.sub(a, other=b)),
             (lambda: a / b, lambda: torch.div(a, other=b)),
             (lambda: a < b, lambda: torch.lt(a, other=b)),
             (lambda: a.div(b), lambda: torch.divide(a, other=b, rounding_mode=None)),
             (lambda: i / j, lambda: torch.div(i, other=j))]     # promoted to float
    for fast, general in pairs:
        want = general().to_eager()
        misses = counters()["cache_misses"]
        got = fast()
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.to_eager(), want)
        assert counters()["cache_misses"] == misses     # one graph for both


def test_any_inplace_method_on_an_eager_input_computes_pending_nodes_first():
    b = torch.tensor([False, True])
    r = fastlazy.lazy(torch.zeros(2)) + b
    b.view(-1)[0:1].logical_not_()          # not an op-table row, still patched
    b[1] = False                            # __setitem__ too
    assert torch.equal(r.to_eager(), torch.tensor([0.0, 1.0]))


@pytest.mark.parametrize("call", [
    lambda x: x.to("lazy", torch.float64), lambda x: x.to("lazy", non_blocking=True),
    lambda x: x.to(torch.device("lazy")), lambda x: x.to("lazy:0"),
    lambda x: x.to(device=torch.device("lazy", 0), dtype=torch.float16),
    lambda x: x.to(device="lazy", copy=True)])
def test_to_the_lazy_device_as_torch_xla_style_code_names_it(call):
    """'lazy:0', torch.device('lazy') and the other arguments of .to() (a
    dtype, non_blocking, copy) with the lazy device: a LazyTensor of the
    tensor converted as the rest of the call asks."""
    x = torch.rand(3, 4)
    got = call(x)
    assert type(got) is fastlazy.LazyTensor
    want = call(x).to_eager()
    assert got.dtype == want.dtype
    torch.testing.assert_close(got.to_eager(), x.to(want.dtype), rtol=0, atol=0)
    assert got.to(torch.device("lazy")) is got and got.to("lazy:0") is got
