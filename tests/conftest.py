import pytest
import torch

import fastlazy


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


@pytest.fixture(params=["torchscript", "eager"])
def backend(request):
    """Run a test once per backend."""
    before = fastlazy.backend()
    fastlazy.set_backend(request.param)
    yield request.param
    fastlazy.set_backend(before)


def pytest_configure(config):
    torch.manual_seed(0)
