"""A new call signature's aten program is read off its fake run
(fastlazy.aten_recorder) rather than traced again with make_fx; calls the
recorded aten calls cannot express are traced as before.  Either way:
eager's values."""
import pytest
import torch
import torch.nn.functional as F

import fastlazy
from fastlazy import aten_recorder, capture, generic, program_templates


@pytest.fixture(autouse=True)
def fresh():
    generic.forget_signatures()
    yield
    fastlazy.mark_step()


@pytest.fixture
def programs(monkeypatch):
    """{"recorded": [...], "traced": [...]}: the functions whose analysis
    took the fake run's recording, and those make_fx traced."""
    seen = {"recorded": [], "traced": []}
    real_trace, real_program = capture._trace, aten_recorder.Recorder.program
    monkeypatch.setattr(capture, "_trace",
                        lambda func, *a: seen["traced"].append(func) or real_trace(func, *a))

    def program(self, results):
        gm = real_program(self, results)
        if gm is not None:
            seen["recorded"].append(gm)
        return gm
    monkeypatch.setattr(aten_recorder.Recorder, "program", program)
    return seen


def _same(got, want):
    got = got if isinstance(got, (tuple, list)) else (got,)
    want = want if isinstance(want, (tuple, list)) else (want,)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        torch.testing.assert_close(g.to_eager(), w)


@pytest.mark.parametrize("call", [
    lambda x: x.t(),
    lambda x: F.glu(x[:, :4], dim=1),
    lambda x: F.normalize(x, dim=1),                       # several aten calls
    lambda x: torch.unbind(x, 1),                          # a tuple of results
    lambda x: F.group_norm(x[None], 1),                    # results the call drops
    # no dropout; an int scale is the generic path's (the C rule takes floats)
    lambda x: F.scaled_dot_product_attention(x[None], x[None], x[None], scale=1),
    lambda x: x.to(torch.float64).sum(0),                  # reads x.device on the way
    # writes an intermediate in place
    lambda x: torch.gru_cell(x, torch.ones(4, 3), torch.linspace(-1, 1, 45).reshape(9, 5),
                             torch.linspace(1, -1, 27).reshape(9, 3), None, None),
    # index tensors made from the call's Python lists: constants of the program
    lambda x: x[[0, 2]],
    lambda x: x[..., [-2], :2],
    lambda x: x[[[0, 1], [2, 3]], [1, 4]],
], ids=["t", "glu", "normalize", "unbind", "group_norm", "sdpa", "to-sum", "in-place",
        "list index", "list index beside slices", "nested list index"])
def test_a_new_signature_takes_the_program_its_fake_run_made(call, programs):
    x = torch.randn(4, 5)
    _same(call(fastlazy.lazy(x) * 1), call(x))
    assert programs["recorded"] and not programs["traced"]


@pytest.mark.parametrize("where", ["input", "view of an input"])
def test_a_call_that_writes_its_input_is_no_recorded_program(where):
    """make_fx functionalizes such a call; a list of the calls as they
    happened would write the graph's input."""
    x = torch.randn(4, 5)

    def call(t):
        y = t.neg()
        (t if where == "input" else t[1:]).mul_(2)
        return y + t
    with aten_recorder.Recorder([x]) as recorder:
        out = call(x)
    assert recorder.program([out]) is None and recorder.failed == "writes an argument"


@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
def test_attention_with_dropout_is_recorded_with_its_draw_lifted(programs, grad):
    """The math path's dropout (empty_like, bernoulli_, div_ of the noise)
    is recorded from the trial run, and its draw made at each call: eager's
    values and generator state, and no make_fx trace."""
    q = torch.randn(1, 2, 6, 8)
    lazy_q = fastlazy.lazy(q).requires_grad_(grad) * 1
    torch.manual_seed(5)
    want = F.scaled_dot_product_attention(q * 1, q * 1, q * 1, dropout_p=0.3, is_causal=True)
    after_eager = torch.rand(3)
    torch.manual_seed(5)
    got = F.scaled_dot_product_attention(lazy_q, lazy_q, lazy_q, dropout_p=0.3, is_causal=True)
    assert torch.equal(torch.rand(3), after_eager)
    assert torch.equal(got.to_eager(), want)
    assert programs["recorded"] and not programs["traced"]
    assert [len(sig.draws) for sig in generic._signatures.values() if sig.draws] == [1]


def test_a_random_call_still_runs_eagerly_with_eagers_draws():
    x = torch.randn(2, 4, 8)
    torch.manual_seed(3)
    want = F.scaled_dot_product_attention(x, x, x, dropout_p=0.5)
    torch.manual_seed(3)
    got = F.scaled_dot_product_attention(*(fastlazy.lazy(x) * 1,) * 3, dropout_p=0.5)
    torch.testing.assert_close(got.to_eager(), want)


@pytest.fixture
def analyses(monkeypatch):
    """{"trial": [...], "fake": [...]}: the functions analysed by a trial
    run on real values, and those analysed by a fake run."""
    seen = {"trial": [], "fake": []}
    real_trial, real_fake = capture._trial_run, capture._fake_run

    def trial(func, *a):
        result = real_trial(func, *a)
        if result is not None:
            seen["trial"].append(func)
        return result
    monkeypatch.setattr(capture, "_trial_run", trial)
    monkeypatch.setattr(capture, "_fake_run",
                        lambda func, *a: seen["fake"].append(func) or real_fake(func, *a))
    return seen


def test_a_small_floating_point_call_is_analysed_by_a_trial_run_not_a_fake_one(analyses):
    """The trial run's aten calls are the program (no fake run)."""
    q = torch.randn(1, 6, 4, 8)
    # (an int scale: the generic path's, not the C rule's)
    got = F.scaled_dot_product_attention(*((fastlazy.lazy(q) * 1).transpose(1, 2),) * 3, scale=1)
    want = F.scaled_dot_product_attention(*((q * 1).transpose(1, 2),) * 3, scale=1)
    torch.testing.assert_close(got.to_eager(), want)
    assert analyses["trial"] and not analyses["fake"]


def test_an_index_argument_is_analysed_by_two_trial_runs(analyses):
    """Index tensors: the trial runs them as all zeros and all ones, which
    make the same program (the index_select kernel reads the indices only
    in the graph's run): no fake run."""
    weight, ids = torch.randn(10, 3), torch.tensor([1, 7, 3])
    got = torch.index_select(fastlazy.lazy(weight), 0, fastlazy.lazy(ids) * 1)
    torch.testing.assert_close(got.to_eager(), torch.index_select(weight, 0, ids))
    assert analyses["trial"] and not analyses["fake"]


def test_indices_read_on_the_host_are_not_baked_into_the_program(analyses):
    """tensor_split reads its index tensor's values in C++ (no aten call)
    and passes them on as the split points: the two trial runs make
    different programs, so the fake run judges (and refuses: eager runs
    the call), and other indices of the same signature split where eager
    splits."""
    x = torch.arange(12.0)
    for at in ([2, 5], [7, 9]):
        got = torch.tensor_split(fastlazy.lazy(x) * 1, fastlazy.lazy(torch.tensor(at)))
        want = torch.tensor_split(x, torch.tensor(at))
        assert len(got) == len(want)
        for g, w in zip(got, want):
            torch.testing.assert_close(g.to_eager() if type(g) is fastlazy.LazyTensor else g, w)
    assert not analyses["trial"] and analyses["fake"]


def test_indices_the_ones_trial_rejects_go_to_the_fake_run(analyses):
    """A one-row tensor refuses index 1: the second trial raises, and the
    fake run judges instead of the call running eagerly."""
    weight, ids = torch.randn(1, 3), torch.zeros(2, dtype=torch.long)
    got = torch.index_select(weight, 0, fastlazy.lazy(ids) * 1)
    assert type(got) is fastlazy.LazyTensor
    torch.testing.assert_close(got.to_eager(), torch.index_select(weight, 0, ids))
    assert analyses["fake"] and not analyses["trial"]


@pytest.mark.parametrize("call", [
    lambda x: torch.nonzero(x > 0.5),           # a shape from the values
    lambda x: x[x > 0.5],                       # a boolean mask made inside the call
    lambda x: torch.unique(x),
], ids=["nonzero", "mask", "unique"])
def test_a_call_whose_trial_reads_values_is_judged_by_the_fake_run(call, analyses):
    """The trial values decide nothing: a call whose aten calls read values
    (a data-dependent shape, a value returned to Python) is analysed on fake
    tensors, which refuse it, and runs eagerly on the real values."""
    x = torch.tensor([[0.1, 0.9, 0.7], [0.2, 0.6, 0.3]])
    got = call(fastlazy.lazy(x) * 1)
    want = call(x)
    torch.testing.assert_close(got.to_eager() if type(got) is fastlazy.LazyTensor else got, want)
    assert not analyses["trial"]


def test_a_program_from_a_trial_run_keeps_none_of_its_tensors():
    """The program kept for a signature holds code, not the trial's values."""
    x = torch.randn(3, 5)
    program_templates.forget()
    kept = []
    real = capture._forget_values

    def forget(graph):
        real(graph)
        kept.append(graph)
    import unittest.mock
    with unittest.mock.patch.object(capture, "_forget_values", forget):
        torch.testing.assert_close(F.normalize(fastlazy.lazy(x) * 1, dim=1).to_eager(),
                                   F.normalize(x, dim=1))
    assert kept and all("val" not in node.meta for g in kept for node in g.nodes)


def test_programs_are_interned_by_structure_keeping_constants_apart():
    """Two recorded programs are one lowering when their ops and arguments
    are the same; a constant's type and sign keep them apart, as they
    would in generated code (0.0 and -0.0, 1 and True)."""
    def program(value):
        g = torch.fx.Graph()
        x = g.placeholder("arg0")
        g.output((g.call_function(torch.ops.aten.mul.Tensor, (x, value)),))
        return g
    key = capture.program_key
    assert key(program(0.5)) == key(program(0.5))
    assert key(program(0.0)) != key(program(-0.0))
    assert key(program(1)) != key(program(True)) != key(program(1.0))


def test_a_recorded_program_gets_no_graph_module_until_it_is_called(monkeypatch):
    """Generating and compiling a program's Python code cost a fifth of a
    model's first call: a recorded program's GraphModule is made only
    where it runs as a template at another size."""
    made = []
    real = torch.fx.GraphModule.__init__
    monkeypatch.setattr(torch.fx.GraphModule, "__init__",
                        lambda self, *a, **k: made.append(1) or real(self, *a, **k))
    x = torch.randn(3, 4, 5)
    got = F.glu(fastlazy.lazy(x) * 1, dim=1).to_eager()
    torch.testing.assert_close(got, F.glu(x * 1, dim=1))
    assert not made


_SETITEM_VALUES = [3, 2.5, True, -1, 300, 1e6]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64, torch.uint8,
                                   torch.bool])
@pytest.mark.parametrize("value", _SETITEM_VALUES, ids=[repr(v) for v in _SETITEM_VALUES])
def test_a_slice_assigned_a_number_is_recorded_from_its_trial_run(programs, dtype, value):
    """x[a:b, c:d] = number writes a copy of the number made in x's dtype
    outside any aten call (eager's wrapped number): the recorded program
    takes it as a constant, with no make_fx trace (swin_t's attention
    masks: 18 traces, 0.4 s of its first call).  Eager's values, dtype and
    conversion errors (300 into uint8)."""
    base = torch.arange(48.0).reshape(6, 8).to(dtype)
    index = (slice(0, -2), slice(-2, None))
    want = base.clone()
    try:
        want[index] = value
    except RuntimeError:
        want = RuntimeError
    lazy = fastlazy.lazy(base).clone()
    try:
        lazy[index] = value
        got = lazy.to_eager()
    except RuntimeError:
        got = RuntimeError
    if want is RuntimeError:
        assert got is RuntimeError
        return
    assert got.dtype == want.dtype and torch.equal(got, want)
    assert programs["recorded"] and not programs["traced"]
    [sig] = [s for s in generic._signatures.values() if s.constants]
    assert [c.item() for c in sig.constants] == [want[0, -1].item()]


def test_a_tensor_the_trial_run_made_from_its_values_is_no_constant():
    """Only a 0-dim tensor holding one of the call's own numbers is taken
    as a constant: one made from the trial's values would bake them in."""
    x = torch.full((3,), 7.0)

    def call(t):
        return t + torch.tensor(t.tolist()[0])     # (not through aten: made outside)
    with aten_recorder.Recorder([x], (2,)) as recorder:
        out = call(x)
    assert recorder.program([out]) is None
    with aten_recorder.Recorder([x], (7.0,)) as recorder:
        out = call(x)
    assert recorder.program([out]) is not None


@pytest.mark.parametrize("call", [
    lambda x, i: x[i, torch.arange(5)],
    lambda x, i: x[torch.zeros(1, 1, dtype=torch.long), i.view(1, 1)],
], ids=["index into a dim of size 1", "broadcast indices"])
def test_integer_indexing_is_recorded_from_its_trial_runs(call, programs, monkeypatch):
    """Indexing with integer tensors (HuggingFace's mask building,
    padding_mask[batch_idx, kv_idx]) reads no value to decide its shape:
    its trial runs are the judge (with indices all -1 where all 1 would be
    out of range), with no fake run (the first one in a process costs
    milliseconds) and no make_fx trace."""
    fake_runs = []
    real_fake_run = capture._fake_run
    monkeypatch.setattr(capture, "_fake_run", lambda *a: fake_runs.append(a) or real_fake_run(*a))
    x = torch.randn(1, 5)
    i = torch.zeros(1, dtype=torch.long)
    want = call(x, i)
    got = call(fastlazy.lazy(x) * 1, i)
    assert got.shape == want.shape
    torch.testing.assert_close(got.to_eager(), want)
    assert programs["recorded"] and not programs["traced"] and not fake_runs
