"""W4: real models (zoo.py: torchvision's resnet18, mobilenet_v3_small and a
small ViT; HuggingFace's BERT, GPT-2 and Llama, random weights), every
contender side by side at one intra-op thread: inference under no_grad at
batch 1 (images 1x3x64x64, 32 tokens) and at batch 8 where kernels dominate
(8x3x128x128, 8x128 tokens), and one training step (forward, loss,
backward, SGD step) of resnet18 and GPT-2.

Per case: the steady-state time (pytest-benchmark, a number of rounds that
fits --benchmark-max-time, at least W4_MIN_ROUNDS), the first call's time in
this process, the time to finish the first 100 calls in a fresh process
(workloads.first_calls_cold: compilation included, what a user waits for),
and for fastlazy the nodes, graphs, fallbacks by op and generic-path calls
of one steady-state call.  Skipped without torchvision or transformers.
"""
import contextlib
import math

import pytest
import torch

import workloads
import zoo

W4_MIN_ROUNDS, W4_MAX_ROUNDS = 5, 1000


def pytest_generate_tests(metafunc):
    if "w4_case" not in metafunc.fixturenames:
        return
    workloads.parametrize_cases(metafunc, "w4_case", workloads.w4_cases)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The libraries present (else every case skips), one intra-op thread."""
    why = zoo.missing_library()
    if why:
        pytest.skip(why)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _rounds(config, call_s: float) -> int:
    """As many rounds as fit in --benchmark-max-time, within the bounds."""
    budget = config.getoption("benchmark_max_time", 1.0) or 1.0
    return max(W4_MIN_ROUNDS, min(W4_MAX_ROUNDS, math.ceil(float(budget) / call_s)))


def test_w4(benchmark, w4_case, request):
    case = w4_case
    benchmark.group = case.label
    benchmark.extra_info.update(
        workload="W4", contender=case.contender.name, model=case.model.name,
        batch=case.size.batch, mode=case.mode, input=case.model.describe(case.size),
        threads=torch.get_num_threads())
    with contextlib.ExitStack() as stack:
        try:
            run = stack.enter_context(workloads.prepared_w4(case))
        except workloads.Unsupported as why:
            pytest.skip(str(why))
        counts = run.counts or {}
        benchmark.extra_info.update(
            first_call_s=run.first_call_s, nodes=counts.get("nodes"),
            graphs_per_call=counts.get("graphs_per_call"), fallbacks=counts.get("fallbacks"),
            fallbacks_total=counts.get("fallbacks_total"),
            generic_calls=counts.get("generic_calls"))
        benchmark.pedantic(run.step, rounds=_rounds(request.config, run.call_s), iterations=1)
    cold = workloads.first_calls_cold(case)
    benchmark.extra_info.update(first_100_s=cold.get("first_calls_s"),
                                first_100_error=cold.get("error"))
