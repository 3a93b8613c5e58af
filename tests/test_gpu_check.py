"""The GPU check's benchmark (benchmarks/gpu/cuda_bench.py) still runs: its
dry run on the CPU at the smallest settings, in a fresh process (it starts
torch._lazy's backend, which keeps the lazy device for good).  The GPU
check itself is `bash benchmarks/gpu/run.sh OUTDIR` on a machine with CUDA.
"""
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent


def test_cuda_benchmark_dry_run(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run(
        [sys.executable, "benchmarks/gpu/cuda_bench.py", str(tmp_path), "--dry-run",
         "--no-compile", "--w4-models", "bert", "--ns", "8,12"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert not (tmp_path / "cuda.md").exists(), "a dry run must not write cuda.md"
    text = (tmp_path / "cuda_dryrun.md").read_text()
    assert text.startswith("# fastlazy GPU check: DRY RUN on the CPU (not CUDA numbers)")
    for target in ("C1", "C2", "C3", "C4"):
        assert f"| {target} |" in text
    assert "PASS" not in text and "MISS" not in text       # no verdicts from a dry run
    results = json.loads((tmp_path / "cuda_dryrun.json").read_text())
    assert results["dry_run"] and results["device"] == "cpu"
    got = results["results"]
    ran = {"W1 | n=8 | eager", "W1 | n=8 | torch._lazy", "W1 | n=8 | torch.jit",
           "W1 | n=12 | fastlazy[torchscript]", "W1 trace | n=8 | fastlazy trace, cpu tensors",
           "W2 | mlp batch 1 | fastlazy[torchscript]", "W2 | transformer batch 1 | torch._lazy"}
    w4 = {"W4 | bert batch 1 | eager", "W4 | bert batch 1 | fastlazy[torchscript]"}
    # (W4 needs the model-zoo extra, which the tox legs do not install)
    zoo = all(importlib.util.find_spec(m) for m in ("transformers", "torchvision"))
    for key in ran | w4 if zoo else ran:
        assert got[key].get("seconds", 0) > 0, (key, got[key])
    if not zoo:
        for key in w4:
            assert got[key]["skip"].startswith("skip: W4 needs"), (key, got[key])
    assert got["W1 | n=8 | torch.compile"] == {"skip": "skip: --no-compile"}
    assert not [k for k, r in got.items() if "error" in r]
    for label in ("torch.jit.trace", "torch.compile reduce-overhead", "fastlazy TorchScript+NNC",
                  "fastlazy inductor", "fastlazy default engine"):
        assert label in text
