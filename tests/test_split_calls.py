"""Calls of more tensors than one node reads (MAX_IN): recorded as their aten
program cut into parts (fastlazy/split_calls.py) -- multi-layer
bidirectional RNNs, long lists -- with eager's values and gradients; the
programs the parts cannot hold run eagerly, their reason told."""
import copy

import pytest
import torch
import torch.nn.functional as F

import fastlazy
from fastlazy import _core, split_calls
from fastlazy.capture import Unsafe

from helpers import assert_same

pytestmark = pytest.mark.usefixtures("lazy_on")

RNNS = {
    "lstm": lambda **kw: torch.nn.LSTM(6, 8, **kw),
    "lstm-proj": lambda **kw: torch.nn.LSTM(6, 8, proj_size=3, **kw),
    "gru": lambda **kw: torch.nn.GRU(6, 8, **kw),
    "rnn-tanh": lambda **kw: torch.nn.RNN(6, 8, **kw),
    "rnn-relu": lambda **kw: torch.nn.RNN(6, 8, nonlinearity="relu", **kw),
}


def _eager_calls():
    """{op: count} of the calls that ran eagerly since the test began."""
    return {k: v for k, v in fastlazy.metrics.counters().items()
            if k.startswith("fallback.") and v}


def _state(module, x, batch_first):
    """An initial state of the module's shape: (h0, c0) for an LSTM."""
    g = torch.Generator().manual_seed(3)
    layers = module.num_layers * (2 if module.bidirectional else 1)
    batch = x.shape[0 if batch_first else 1]
    h = torch.randn(layers, batch, module.proj_size or module.hidden_size, generator=g)
    if isinstance(module, torch.nn.LSTM):
        return h, torch.randn(layers, batch, module.hidden_size, generator=g)
    return h


@pytest.mark.parametrize("kind", sorted(RNNS))
@pytest.mark.parametrize("layers", [2, 3])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("with_state", [False, True])
def test_bidirectional_rnn_recorded_with_eager_values(kind, layers, batch_first, with_state):
    torch.manual_seed(0)
    module = RNNS[kind](num_layers=layers, bidirectional=True, batch_first=batch_first).eval()
    x = torch.randn(3, 5, 6)
    state = _state(module, x, batch_first) if with_state else None
    with torch.no_grad():
        expected = module(x, state)
        for _ in range(3):      # the first call plans, the later ones reuse it
            got = module(fastlazy.lazy(x), state)
            assert type(got[0]) is fastlazy.LazyTensor
            assert_same(got, expected)
    assert _eager_calls() == {}


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_rnn_training_gradients_are_eager_s(kind):
    torch.manual_seed(0)
    module = RNNS[kind](num_layers=2, bidirectional=True, batch_first=True)
    twin = copy.deepcopy(module)
    x = torch.randn(3, 5, 6)
    out, _ = module(x)
    (out * out).sum().backward()
    got, _ = twin(fastlazy.lazy(x))
    assert got.requires_grad
    (got * got).sum().backward()
    assert_same(got, out)
    for (name, p), q in zip(module.named_parameters(), twin.parameters()):
        assert_same(q.grad, p.grad, name)
    assert _eager_calls() == {}


def test_rnn_between_other_ops_is_one_graph():
    """The recurrent layer no longer cuts the model's graph in two."""
    torch.manual_seed(0)
    rnn = torch.nn.LSTM(6, 8, num_layers=2, bidirectional=True, batch_first=True).eval()
    head = torch.nn.Linear(16, 2)
    x = torch.randn(3, 5, 6)
    with torch.no_grad():
        expected = head(torch.relu(rnn(x * 2)[0])).mean(1)
        fastlazy.mark_step()
        fastlazy.metrics.reset()
        got = head(torch.relu(rnn(fastlazy.lazy(x) * 2)[0])).mean(1)
        assert_same(got, expected)
    assert fastlazy.metrics.counters()["flushes"] == 1


def test_long_list_in_parts():
    """multi_dot of 20 matrices: a chain of mm cut into parts."""
    g = torch.Generator().manual_seed(0)
    ms = [torch.randn(3, 3, generator=g) for _ in range(20)]
    assert_same(torch.linalg.multi_dot([fastlazy.lazy(m) for m in ms]),
                torch.linalg.multi_dot(ms))
    outs = torch.broadcast_tensors(*[fastlazy.lazy(m[:1]) for m in ms], fastlazy.lazy(ms[0][:, :1]))
    assert_same(list(outs), list(torch.broadcast_tensors(*[m[:1] for m in ms], ms[0][:, :1])))
    assert _eager_calls() == {}


def test_long_join_nested():
    """A cat or stack of more than MAX_IN tensors inside a program becomes a
    cat of groups (a GRU's outputs over 40 steps)."""
    module = torch.nn.GRU(6, 8, num_layers=2, bidirectional=True).eval()
    x = torch.randn(40, 2, 6)
    with torch.no_grad():
        assert_same(module(fastlazy.lazy(x)), module(x))
    assert _eager_calls() == {}


def test_one_call_reading_more_runs_eagerly_with_reason():
    ms = [torch.randn(2, 2) for _ in range(_core.MAX_IN + 2)]
    got = torch.block_diag(*[fastlazy.lazy(m) for m in ms])
    assert_same(got, torch.block_diag(*ms))
    assert _eager_calls() == {"fallback.block_diag": 1}
    assert "aten.block_diag.default alone reads more than" in fastlazy.explain()


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_dropout_between_layers_draws_eager_s_numbers(kind):
    """Training with dropout: each part draws its numbers as it is
    recorded, in the program's order -- eager's masks, gradients and the
    random stream after the call."""
    torch.manual_seed(0)
    module = RNNS[kind](num_layers=3, bidirectional=True, dropout=0.4)
    twin = copy.deepcopy(module)
    x = torch.randn(5, 3, 6)
    torch.manual_seed(7)
    out, _ = module(x)
    (out * out).sum().backward()
    after = torch.rand(3)
    torch.manual_seed(7)
    got, _ = twin(fastlazy.lazy(x))
    (got * got).sum().backward()
    assert torch.equal(torch.rand(3), after)
    assert_same(got, out)
    for (name, p), q in zip(module.named_parameters(), twin.parameters()):
        assert_same(q.grad, p.grad, name)
    assert _eager_calls() == {}


def test_under_autocast_runs_eagerly():
    module = torch.nn.GRU(6, 8, num_layers=2, bidirectional=True).eval()
    x = torch.randn(5, 3, 6)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = module(x)
        got = module(fastlazy.lazy(x))
    assert_same(got, expected)
    assert "under autocast" in fastlazy.explain()


def _accumulate(*ts):
    acc = ts[0] * 1
    for t in ts[1:]:
        acc.add_(t)
    return acc


def test_write_is_never_cut_from_what_it_writes():
    """A part may not begin between a call and a later write into its
    result; where every cut would, the program is refused."""
    ts = [fastlazy.lazy(torch.randn(2)) for _ in range(_core.MAX_IN + 4)]
    with pytest.raises(Unsafe, match="writes in place across more than"):
        split_calls.plan(_accumulate, tuple(ts), {}, ts)
    plan = split_calls.plan(_local_writes, tuple(ts), {}, ts)
    assert len(plan.parts) >= 2
    assert_same(split_calls.record(plan, ts), _local_writes(*[t.to_eager() for t in ts]))


def _local_writes(*ts):
    total = None
    for t in ts:
        y = t * 2
        y.add_(1)
        total = y if total is None else total + y
    return total


def test_cut_bounds_every_part():
    ts = [fastlazy.lazy(torch.randn(3, 3)) for _ in range(3 * _core.MAX_IN)]
    plan = split_calls.plan(torch.linalg.multi_dot, (ts,), {}, ts)
    assert len(plan.parts) >= 3
    for _, sources in plan.parts:
        assert len(sources) <= _core.MAX_IN


def test_lstm_in_a_model_gives_eager_s_values_over_calls():
    torch.manual_seed(0)
    emb = torch.nn.Embedding(50, 6)
    rnn = torch.nn.LSTM(6, 8, num_layers=2, bidirectional=True, batch_first=True).eval()
    ids = torch.randint(0, 50, (4, 7))
    with torch.no_grad():
        for n in (7, 7, 3, 7):
            expected = F.log_softmax(rnn(emb(ids[:, :n]))[0], -1)
            assert_same(F.log_softmax(rnn(emb(fastlazy.lazy(ids[:, :n])))[0], -1), expected)
    assert _eager_calls() == {}


def _views_of_one_sum(*ts):
    total = torch.stack(ts).sum(0)
    return total, total[0], total.t()


def test_results_viewing_one_another_run_eagerly():
    """Each part's results are tensors of their own, so a call whose results
    view one another is not cut: a write through one reaches the other, as
    in eager."""
    ts = [fastlazy.lazy(torch.ones(2, 2)) for _ in range(_core.MAX_IN + 1)]
    with pytest.raises(Unsafe, match="results view one another"):
        split_calls.plan(_views_of_one_sum, tuple(ts), {}, ts)


def test_signature_key_tells_eager_tensors_apart():
    """The generic path's key of a call that misses the core's flat key (more
    than MAX_IN tensors) reads each eager tensor's dtype, sizes, strides and
    requires_grad: two tensors alike key alike, any difference keys apart."""
    lazy = fastlazy.lazy(torch.ones(2))

    def key(t):
        return _core.signature_key(torch.add, (lazy, t), {}, [], False, None)

    base = torch.zeros(3, 4)
    assert key(base) == key(torch.ones(3, 4))
    others = [torch.zeros(3, 4, dtype=torch.float64), torch.zeros(4, 3), torch.zeros(4, 3).t(),
              torch.zeros(3, 4, requires_grad=True), torch.zeros(3, 4, 1), torch.zeros(12)]
    keys = {key(t) for t in others + [base]}
    assert len(keys) == len(others) + 1
    sparse = torch.zeros(3, 4).to_sparse()
    with pytest.raises(Unsafe):
        key(sparse)
