"""A new call signature's aten program is read off its fake run
(fastlazy.aten_recorder) rather than traced again with make_fx; calls the
recorded aten calls cannot express are traced as before.  Either way:
eager's values."""
import pytest
import torch
import torch.nn.functional as F

import fastlazy
from fastlazy import aten_recorder, capture, generic


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
    lambda x: x.transpose(0, 1),
    lambda x: F.glu(x[:, :4], dim=1),
    lambda x: F.normalize(x, dim=1),                       # several aten calls
    lambda x: torch.split(x, 2, dim=1),                    # a list of results
    lambda x: F.group_norm(x[None], 1),                    # results the call drops
    lambda x: F.scaled_dot_product_attention(x[None], x[None], x[None]),   # no dropout
    lambda x: x.to(torch.float64).sum(0),                  # reads x.device on the way
], ids=["transpose", "glu", "normalize", "split", "group_norm", "sdpa", "to-sum"])
def test_a_new_signature_takes_the_program_its_fake_run_made(call, programs):
    x = torch.randn(4, 5)
    _same(call(fastlazy.lazy(x) * 1), call(x))
    assert programs["recorded"] and not programs["traced"]


@pytest.mark.parametrize("call", [
    lambda x: x[[0, 2]],                    # an index tensor made from a Python list
    # writes an intermediate in place
    lambda x: torch.gru_cell(x, torch.ones(4, 3), torch.linspace(-1, 1, 45).reshape(9, 5),
                             torch.linspace(1, -1, 27).reshape(9, 3), None, None),
], ids=["constant", "in-place"])
def test_calls_a_list_of_aten_calls_cannot_express_are_traced(call, programs):
    x = torch.randn(4, 5)
    _same(call(fastlazy.lazy(x) * 1), call(x))
    assert programs["traced"]


def test_a_random_call_still_runs_eagerly_with_eagers_draws():
    x = torch.randn(2, 4, 8)
    torch.manual_seed(3)
    want = F.scaled_dot_product_attention(x, x, x, dropout_p=0.5)
    torch.manual_seed(3)
    got = F.scaled_dot_product_attention(*(fastlazy.lazy(x) * 1,) * 3, dropout_p=0.5)
    torch.testing.assert_close(got.to_eager(), want)
