"""W1: the fusible-chain microbenchmark, every contender side by side."""
import workloads


def pytest_generate_tests(metafunc):
    if "case" not in metafunc.fixturenames:
        return
    option = metafunc.config.getoption
    quick = option("--bench-quick")
    large = (workloads.LARGE_N,) if option("--bench-large") else ()
    ns = (100,) if quick else workloads.NS + large
    ops = (32,) if quick else workloads.OPS
    with_compile = not (quick or option("--bench-no-compile"))
    cases = workloads.w1_cases(ns, ops, with_compile)
    metafunc.parametrize("case", cases, ids=[c.id for c in cases])


def test_w1(benchmark, case):
    benchmark.group = f"W1 {case.mode} n={case.n} {case.workload.name}"
    benchmark.extra_info.update(
        workload="W1", contender=case.contender.name, n=case.n, ops=case.workload.ops,
        mode=case.mode, control_flow=case.workload.has_control_flow)
    with workloads.prepared(case) as run:
        benchmark.extra_info["first_call_s"] = run.first_call_s
        benchmark(run.step)
        benchmark.extra_info["recompiles"] = run.recompiles()
