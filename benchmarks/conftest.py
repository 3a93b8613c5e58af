"""Options of the benchmark suite (run it with `python benchmarks/report.py`,
or `pytest benchmarks`)."""


def pytest_addoption(parser):
    group = parser.getgroup("fastlazy benchmarks")
    group.addoption("--bench-large", action="store_true",
                    help="also run W1 at n=10000 (nine 400 MB inputs)")
    group.addoption("--bench-quick", action="store_true",
                    help="W1 at n=100 and 32 ops only, W2 MLP batch 1 inference "
                         "only, W4 resnet18 and BERT batch 1 inference on eager and "
                         "fastlazy's default backend only, without torch.compile")
    group.addoption("--bench-no-compile", action="store_true",
                    help="leave torch.compile out (its first compile takes ~20 s), "
                         "and in W4 fastlazy's inductor backend too")
