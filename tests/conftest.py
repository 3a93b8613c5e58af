import pytest
import torch
from hypothesis import HealthCheck, settings

import fastlazy
from fastlazy import step_executor
from helpers import BACKENDS, DEVICES

step_executor.check_reader = True

# the differential fuzzers' examples per test on CUDA, where every example
# launches kernels and synchronizes (per profile: ci, long)
CUDA_EXAMPLES = {"ci": 30, "long": 4000}


@pytest.fixture(autouse=True)
def same_graph_from_both_ir_readers():
    """Fail a test whose graphs the step executor's IR reader read into
    another graph than torch's parseIR does (step_executor.check_reader)."""
    yield
    found = list(step_executor.reader_mismatches)
    step_executor.reader_mismatches.clear()
    if found:
        ir, mine, theirs = found[0]
        pytest.fail(f"{len(found)} graph(s) read differently; the first:\n{ir}\n"
                    f"-- the executor's reader:\n{mine}\n-- parseIR:\n{theirs}")


@pytest.fixture
def lazy_on():
    """fastlazy enabled and counters zeroed for one test."""
    was = fastlazy.enabled()
    fastlazy.enable()
    fastlazy.mark_step()
    fastlazy.metrics.reset()
    yield
    fastlazy.mark_step()
    if not was:
        fastlazy.disable()


@pytest.fixture
def auto(monkeypatch):
    """The tiered engine with graphs hot after one run (of any length, and
    frozen compiles for any graph), an empty cache and zeroed counters; the
    backend before it put back after."""
    from fastlazy import graph_cache, tiering
    before = fastlazy.backend()
    fastlazy.mark_step()
    fastlazy.set_backend("auto")
    monkeypatch.setattr(tiering.ENGINE, "hot_after", 1)
    monkeypatch.setattr(tiering.ENGINE, "hot_seconds", 0.0)
    monkeypatch.setattr(tiering.ENGINE, "hot_min_run", 0.0)
    monkeypatch.setattr(tiering, "FROZEN_MIN_SHARE", 0.0)
    graph_cache.clear()
    fastlazy.metrics.reset()
    yield
    tiering.wait(300)
    fastlazy.mark_step()
    graph_cache.clear()
    fastlazy.set_backend(before)


@pytest.fixture
def flush_after():
    """Compute the test's pending graph afterwards, so that no test leaves
    nodes for the next one to flush (a module applies it to every test:
    `pytestmark = pytest.mark.usefixtures("flush_after")`)."""
    yield
    fastlazy.mark_step()


@pytest.fixture
def fresh_signatures(lazy_on):
    """fastlazy enabled, with no cached graph, signature or lifted float
    and its counters at zero (tests/test_lifted_floats.py, test_churn.py)."""
    from fastlazy import generic, graph_cache
    graph_cache.clear()
    generic.reset()
    fastlazy.metrics.reset()
    yield


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Run a test once per backend in helpers.BACKENDS (or on the backends a
    test parametrizes it with, indirect=True).  Afterwards the test's pending
    graph is computed, so that no test leaves a graph behind for the next one
    to flush, and the backend found before the test (the default one) is
    restored."""
    before = fastlazy.backend()
    fastlazy.set_backend(request.param)
    try:
        yield request.param
    finally:
        fastlazy.mark_step()
        fastlazy.set_backend(before)


@pytest.fixture(params=DEVICES)
def device(request):
    """Run a test once per device: "cpu", and "cuda", marked `cuda` (skipped
    without a CUDA device; `pytest -m cuda` runs those items alone).  Eager
    on the same device is the oracle.  On CUDA, TF32 is off for the test, so
    that eager's convolutions and matrix products are float32 ones, as on
    the CPU, and the suite's float32 tolerances mean what they say."""
    if request.param != "cuda":
        yield request.param
        return
    flags = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield request.param
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = flags


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "cuda: needs a CUDA device (skipped without one); "
                   "`pytest -m cuda` runs these items alone")
    torch.manual_seed(0)
    # CI: a few hundred generated programs; --fuzz-long: tens of thousands
    # fixtures used with @given here only select a backend or enable
    # fastlazy: nothing in them needs resetting between examples
    quiet = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
    settings.register_profile("ci", max_examples=150, deadline=None,
                              suppress_health_check=quiet)
    settings.register_profile("long", max_examples=20_000, deadline=None,
                              suppress_health_check=quiet)
    profile = "long" if config.getoption("--fuzz-long") else "ci"
    settings.register_profile("cuda", settings.get_profile(profile),
                              max_examples=CUDA_EXAMPLES[profile])
    settings.load_profile(profile)


def pytest_addoption(parser):
    parser.addoption("--long", action="store_true",
                     help="run the 100,000-iteration long runs")
    parser.addoption("--fuzz-long", action="store_true",
                     help="run the long differential fuzzing profile")
    parser.addoption("--inductor-all", action="store_true",
                     help="run every differential case on the inductor backend too")
