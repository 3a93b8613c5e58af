"""Every cache miss says why."""
import sys
import warnings

import pytest
import torch

import fastlazy
from fastlazy import _core, graph_cache, recompiles


@pytest.fixture(autouse=True)
def fresh(lazy_on):
    graph_cache.clear()
    fastlazy.metrics.reset()
    _core.set_record_sites(True)
    fastlazy.mark_step()          # next segment records sites
    yield
    _core.set_record_sites(False)


def last():
    return recompiles.log[-1]


def test_first_graph_then_structure_with_site():
    a = fastlazy.lazy(torch.rand(4))
    (a * 2).exp().to_eager()
    assert last()[0] == "first graph"
    (a * 2).tanh().to_eager()          # diverges at the second op
    reason, detail, site = last()
    assert reason == "new graph structure"
    assert "diverges at op 1 (tanh)" in detail and "test_recompiles.py:" in detail
    assert "test_recompiles.py:" in site


def test_dtype_scalar_type_rank_and_requires_grad():
    f = lambda t, s: (t * s + 1).to_eager()   # noqa: E731
    f(fastlazy.lazy(torch.rand(4)), 2.0)
    f(fastlazy.lazy(torch.rand(4, dtype=torch.float64)), 2.0)
    assert last()[0] == "new input dtype" and "float32 -> torch.float64" in last()[1]
    f(fastlazy.lazy(torch.rand(4, dtype=torch.float64)), 2)
    assert last()[0] == "new scalar type" and "float -> int" in last()[1]
    f(fastlazy.lazy(torch.rand(4, 3, dtype=torch.float64)), 2)
    assert last()[0] == "new input rank"
    f(fastlazy.lazy(torch.rand(4, 3, dtype=torch.float64).requires_grad_()), 2)
    assert last()[0] == "new requires_grad"
    c = fastlazy.metrics.counters()
    for reason in ("first graph", "new input dtype", "new scalar type", "new input rank",
                   "new requires_grad"):
        assert c["recompile." + reason] == 1
    assert "new scalar type" in fastlazy.metrics.report()


def test_no_miss_no_record():
    a = fastlazy.lazy(torch.rand(4))
    for s in range(5):
        (a * s).to_eager()
    assert len(recompiles.log) == 1


def test_inductor_shape_changes_are_explained(monkeypatch):
    monkeypatch.setattr(fastlazy.backends.get("inductor"), "dynamic_after", 5)
    fastlazy.set_backend("inductor")
    try:
        for n in (3, 4):
            (fastlazy.lazy(torch.rand(n)) + 1).to_eager()
        assert fastlazy.metrics.counters()["recompile.inductor: new input shape"] == 1
    finally:
        fastlazy.set_backend("torchscript")


def test_warn_when_a_site_keeps_compiling(monkeypatch):
    monkeypatch.setattr(recompiles, "warn_after", 2)
    a = fastlazy.lazy(torch.rand(4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
            (a.to(dtype) * 2).to_eager()   # the same line, a new dtype each time
    found = [w for w in caught if issubclass(w.category, recompiles.RecompileWarning)]
    assert len(found) == 1 and "has caused 3 compiles" in str(found[0].message)


def test_a_flush_run_inside_the_explanation_of_another():
    # A signal handler or finalizer runs Python between any two bytecodes of
    # explain() -- here while it compares skeletons -- and may flush a graph
    # of its own, which adds a skeleton to those being compared.
    a = fastlazy.lazy(torch.rand(4))
    (a * 2).exp().to_eager()
    inner = []

    def tracer(frame, event, arg):
        # inside the loop over the skeletons (its counter is bound)
        if (event == "line" and frame.f_code.co_name == "_nearest" and "n" in frame.f_locals
                and not inner):
            inner.append((fastlazy.lazy(torch.ones(3)) - 5).sin().to_eager())
        return tracer

    sys.settrace(tracer)
    try:
        out = (a * 2).tanh().to_eager()          # a new structure: _nearest runs
    finally:
        sys.settrace(None)
    assert torch.equal(out, (a.to_eager() * 2).tanh())
    assert torch.equal(inner[0], (torch.ones(3) - 5).sin())
    assert [r for r, _, _ in list(recompiles.log)[-2:]] == ["new graph structure"] * 2


def test_the_skeletons_kept_are_bounded(monkeypatch):
    # a program that compiles a new graph at every call keeps the most
    # recent skeletons only, and still explains a miss against them
    monkeypatch.setattr(recompiles, "MAX_SEEN", 5)
    a = fastlazy.lazy(torch.rand(8))
    for k in range(12):
        ((a + 1)[k:] * 2).to_eager()    # a new structure per slice (of a pending tensor)
    assert len(recompiles._seen) == 5
    assert sum(recompiles._backends.values()) == 5
    ((a + 1)[11:] * 2).exp().to_eager()
    assert last()[0] == "new graph structure" and "diverges at op 3 (exp)" in last()[1]
