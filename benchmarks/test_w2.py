"""W2: small models where per-op overhead dominates, every contender side by
side: an MLP of 8 Linear(256, 256)+ReLU (batch 1 and 64; inference under
no_grad and one training step), and an nn.TransformerEncoderLayer (d_model
256, 4 heads, seq 32, batch 1) in eval under no_grad.  Target P7: the MLP at
batch 1, inference, faster than eager and than torch._lazy."""
import contextlib

import pytest

import workloads


def pytest_generate_tests(metafunc):
    if "w2_case" not in metafunc.fixturenames:
        return
    workloads.parametrize_cases(metafunc, "w2_case", workloads.w2_cases)


def test_w2(benchmark, w2_case):
    case = w2_case
    benchmark.group = case.label
    benchmark.extra_info.update(
        workload="W2", contender=case.contender.name, model=case.model.name,
        batch=case.batch, mode=case.mode)
    with contextlib.ExitStack() as stack:
        try:
            run = stack.enter_context(workloads.prepared_w2(case))
        except workloads.Unsupported as why:
            pytest.skip(str(why))
        benchmark.extra_info["first_call_s"] = run.first_call_s
        benchmark(run.step)
        benchmark.extra_info["recompiles"] = run.recompiles()
