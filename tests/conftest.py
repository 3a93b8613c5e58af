import pytest
import torch
from hypothesis import HealthCheck, settings

import fastlazy
from helpers import BACKENDS


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


def pytest_configure(config):
    torch.manual_seed(0)
    # CI: a few hundred generated programs; --fuzz-long: tens of thousands
    # fixtures used with @given here only select a backend or enable
    # fastlazy: nothing in them needs resetting between examples
    quiet = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
    settings.register_profile("ci", max_examples=150, deadline=None,
                              suppress_health_check=quiet)
    settings.register_profile("long", max_examples=20_000, deadline=None,
                              suppress_health_check=quiet)
    settings.load_profile("long" if config.getoption("--fuzz-long") else "ci")


def pytest_addoption(parser):
    parser.addoption("--long", action="store_true",
                     help="run the 100,000-iteration long runs")
    parser.addoption("--fuzz-long", action="store_true",
                     help="run the long differential fuzzing profile")
    parser.addoption("--inductor-all", action="store_true",
                     help="run every differential case on the inductor backend too")
