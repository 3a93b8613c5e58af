"""The CUDA benchmark: W1, W2 and W4 on one device, every contender side by
side in one process, and the CUDA targets C1-C4.

    python benchmarks/gpu/cuda_bench.py OUTDIR             # CUDA: OUTDIR/cuda.md
    python benchmarks/gpu/cuda_bench.py OUTDIR --dry-run   # CPU, tiny sizes

The workloads and contenders are benchmarks/workloads.py's and the models
benchmarks/zoo.py's, moved to the device:

- W1: the 32-op chain at n=100, 1000 and 4000, executed (the result read as
  a device tensor); and trace only (recorded, never run) on device tensors
  and on CPU tensors, for C4.
- W2: the MLP 8x256 at batch 1 and 64 and the TransformerEncoderLayer at
  batch 1, inference.
- W4: zoo models at batch 1, inference (resnet18 and BERT unless
  --w4-models says otherwise: each compiling contender costs tens of
  seconds per model, and the whole GPU check must finish in 10 minutes).

Contenders: eager, torch._lazy (its TorchScript backend, on CUDA with
LTC_TS_CUDA=1), torch.jit.trace, torch.compile (default and
mode="reduce-overhead"), fastlazy with TorchScript+NNC, with inductor and
with its default engine (whose hot inference graphs may settle on a
CUDA-graph replay: the report lists the tier each graph settled on).  W4 runs eager, torch.compile and fastlazy's default engine and
TorchScript backend.

Each (workload, contender) unit: the first call (timed, compilation
included), a check against eager on the same device, a warm-up and the
contender's settling (the default engine's background compiles), then
rounds of calls, the device synchronized before every clock read; the
minimum per call over the rounds is kept.  Units run in order of what the
targets need first, and none starts once --budget-s has passed: the rest
are listed as skipped.  TF32 is off, so every contender computes float32.

--dry-run (or a machine without CUDA) runs the same steps on the CPU at
tiny sizes and writes cuda_dryrun.md, labelled as such: it exercises the
script, its numbers are no CUDA figures.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import gc
import json
import math
import os
import pathlib
import platform
import subprocess
import sys
import time
import traceback

BENCH_DIR = pathlib.Path(__file__).resolve().parent.parent
REPO = BENCH_DIR.parent
if "workloads" not in sys.modules:        # run as a script: the suite's modules by name
    sys.path.insert(0, str(BENCH_DIR))

import torch  # noqa: E402

import fastlazy  # noqa: E402
import workloads  # noqa: E402
import zoo  # noqa: E402
from workloads import EXEC, INFER, TRACE  # noqa: E402

OPS = 32
CUDA_NS = (100, 1000, 4000)
DRY_NS = (16, 32, 64)             # stand in for 100, 1000, 4000 in the dry run
W4_MODELS = ("resnet18", "bert")
BUDGET_S = 240.0
TABLES = ("W1", "trace", "W4", "W2")
INPUTS_READ = 9                   # W1's inputs a ... i, each read once
COMPILE_WAIT_S = 60.0             # at most, before each unit, for the compile thread to idle


# -- the device ---------------------------------------------------------------

class Device:
    """Where the benchmark runs, and the clock it reads."""

    def __init__(self, name: str, dry: bool):
        self.name = name
        self.dry = dry
        self.cuda = name == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def clock(self) -> float:
        """perf_counter after the device has finished all queued work."""
        self.sync()
        return time.perf_counter()

    def tensors(self, ts):
        return [t.to(self.name) for t in ts]


def time_per_call(device: Device, step, target_s: float, rounds: int) -> float:
    """The minimum over `rounds` rounds of the time per call, each round as
    many calls as take about `target_s`."""
    start = device.clock()
    step()
    once = device.clock() - start
    iters = max(1, min(100_000, int(target_s / max(once, 1e-7))))
    best = math.inf
    for _ in range(rounds):
        start = device.clock()
        for _ in range(iters):
            step()
        best = min(best, (device.clock() - start) / iters)
    return best


def copy_bandwidth(device: Device, nbytes: int) -> float:
    """Bytes per second a device-to-device copy_ moves (read + written): the
    memory-bandwidth floor of C2 is W1's bytes at this rate."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device.name).uniform_()
    dst = torch.empty_like(src)
    seconds = time_per_call(device, lambda: dst.copy_(src), 0.05, 5)
    return 2 * nbytes / seconds


# -- contenders on a device ----------------------------------------------------

class LazyTS(workloads.TorchLazy):
    """torch._lazy on its TorchScript backend, results read back as tensors
    of the benchmark's device (not .cpu(): a copy to the host would be timed
    for torch._lazy alone)."""

    def __init__(self, device: Device):
        self.device = device

    def read(self, r):
        torch._lazy.mark_step()
        return r.to(self.device.name)

    def calls(self, workload, tensors, mode):
        lazy = workloads._torch_lazy_device()
        calls = workloads.Contender.calls(self, workload, [t.to(lazy) for t in tensors], mode)
        return calls if mode == TRACE else [
            functools.partial(lambda c: self.read(c()), c) for c in calls]

    def w2_step(self, model, x, y, mode):
        lazy = workloads._torch_lazy_device()
        model.to(lazy)
        step = workloads._w2_step(model, model, x.to(lazy), y.to(lazy), mode, read=self.read)
        return step, lambda: [p.detach().to(self.device.name) for p in model.parameters()]


class CompileReduceOverhead(workloads.Compile):
    """torch.compile(mode="reduce-overhead"): inductor's kernels replayed as
    CUDA graphs (on the CPU, as mode="default")."""
    name = "torch.compile reduce-overhead"

    def calls(self, workload, tensors, mode):
        fn = torch.compile(workload.fn, dynamic=False, mode="reduce-overhead")
        return workloads._bind(fn, tensors, workload)

    def w2_step(self, model, x, y, mode):
        forward = torch.compile(model, dynamic=False, mode="reduce-overhead")
        return (workloads._w2_step(model, forward, x, y, mode),
                functools.partial(workloads._eager_params, model))

    def w4_step(self, model, module, x, target, mode):
        forward = torch.compile(module, dynamic=False, mode="reduce-overhead")
        return (zoo.step(model, module, forward, x, target, mode),
                functools.partial(zoo.state, module))


LABELS = {"eager": "eager", "torch._lazy": "torch._lazy", "torch.jit": "torch.jit.trace",
          "torch.compile": "torch.compile", "torch.compile reduce-overhead":
          "torch.compile reduce-overhead", "fastlazy[torchscript]": "fastlazy TorchScript+NNC",
          "fastlazy[inductor]": "fastlazy inductor",
          "fastlazy[auto]": "fastlazy default engine", "fastlazy": "fastlazy"}
COMPILING = ("torch.compile", "torch.compile reduce-overhead", "fastlazy[inductor]",
             "fastlazy[auto]")


def w1_contenders(device: Device) -> list:
    return [workloads.Contender(), LazyTS(device), workloads.Jit(), workloads.Compile(),
            CompileReduceOverhead(), workloads.FastLazy("torchscript"),
            workloads.FastLazy("inductor"), workloads.FastLazy("auto")]


def w2_contenders(device: Device) -> list:
    return [workloads.Contender(), LazyTS(device), workloads.Compile(),
            CompileReduceOverhead(), workloads.FastLazy("torchscript"),
            workloads.FastLazy("inductor"), workloads.FastLazy("auto")]


def w4_contenders() -> list:
    return [workloads.Contender(), workloads.Compile(), workloads.FastLazy("torchscript"),
            workloads.FastLazy("auto")]


# -- units ---------------------------------------------------------------------

@dataclasses.dataclass
class Unit:
    """One contender on one workload row; `priority` orders the run (the
    targets' units first)."""
    table: str            # "W1", "W1 trace", "W2", "W4"
    row: str
    contender: object
    run: object           # () -> dict of results
    priority: int

    @property
    def key(self):
        return f"{self.table} | {self.row} | {self.contender.name}"


class Settings:
    def __init__(self, args, device: Device):
        self.device = device
        self.dry = device.dry
        self.ns = DRY_NS if self.dry else CUDA_NS
        self.target_s = 0.002 if self.dry else 0.05
        self.rounds = 2 if self.dry else 5
        self.compile = not args.no_compile
        self.tables = set(args.tables.split(","))
        unknown = self.tables - set(TABLES)
        if unknown:
            raise SystemExit(f"--tables: unknown {sorted(unknown)}; choose from {TABLES}")
        self.w4_models = [m for m in args.w4_models.split(",") if m] \
            if "W4" in self.tables else []
        self.w2 = "W2" in self.tables


def _release():
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def w1_exec(s: Settings, n: int, contender):
    device = s.device
    workload = next(w for w in workloads.W1 if w.name == f"{OPS}ops")

    def run():
        tensors = device.tensors(workloads.inputs(n))
        with contender.session():
            start = time.perf_counter()
            calls = contender.calls(workload, tensors, EXEC)
            results = [call() for call in calls]
            first = device.clock() - start
            workloads._check(results, workload, tensors)
            for _ in range(workloads.WARMUP_CALLS):
                for call in calls:
                    call()
            contender.settle(calls)
            results = [call() for call in calls]
            workloads._check(results, workload, tensors)       # the settled program
            fusion = fastlazy.metrics.fusion() if isinstance(contender, workloads.FastLazy) \
                else None
            seconds = time_per_call(device, calls[0], s.target_s, s.rounds)
        return {"seconds": seconds, "first_call_s": first, "tiers": _tiers(contender),
                "fusion": [{k: g[k] for k in ("state", "groups", "fused", "unfused")}
                           for g in fusion] if fusion else None}
    return run


def w1_trace(s: Settings, n: int, on: str):
    """fastlazy's trace-only W1 (recorded, discarded: nothing runs) on
    tensors of `on`: nanoseconds per recorded op."""
    device = s.device
    workload = next(w for w in workloads.W1 if w.name == f"{OPS}ops")

    def run():
        tensors = [t.to(on) for t in workloads.inputs(n)]
        contender = workloads.FastLazy(None)
        with contender.session():
            call = contender.calls(workload, tensors, TRACE)[0]
            for _ in range(workloads.WARMUP_CALLS):
                call()
            seconds = time_per_call(device, call, s.target_s, s.rounds)
        return {"seconds": seconds, "ns_per_op": seconds / OPS * 1e9}
    return run


def w2_infer(s: Settings, model: workloads.Model, batch: int, contender):
    device = s.device

    def run():
        x, y = device.tensors(workloads.w2_inputs(model, batch))
        with workloads.fastlazy_state(False):
            reference = model.build().to(device.name).eval()
            with torch.no_grad():
                want = reference(x)
        module = model.build().to(device.name).eval()
        with contender.session():
            start = time.perf_counter()
            step, _ = contender.w2_step(module, x, y, INFER)
            got = step()
            first = device.clock() - start
            torch.testing.assert_close(got, want, **contender.w2_tolerance)
            for _ in range(workloads.WARMUP_CALLS):
                step()
            contender.settle([step])
            torch.testing.assert_close(step(), want, **workloads.Compile.w2_tolerance)
            seconds = time_per_call(device, step, s.target_s, s.rounds)
        return {"seconds": seconds, "first_call_s": first}
    return run


def w4_infer(s: Settings, model: zoo.ZooModel, contender):
    device = s.device
    size = zoo.SIZES[1]

    def run():
        x, target = device.tensors(model.inputs(size))
        with workloads.fastlazy_state(False):
            reference = model.build(size).to(device.name)
            want = zoo.step(model, reference, reference, x, target, INFER)()
        module = model.build(size).to(device.name)
        with contender.session():
            start = time.perf_counter()
            step, _ = contender.w4_step(model, module, x, target, INFER)
            got = step()
            first = device.clock() - start
            torch.testing.assert_close(got, want, **contender.w4_tolerance)
            contender.settle([step])
            torch.testing.assert_close(step(), want, **contender.settled_w4_tolerance)
            for _ in range(workloads.WARMUP_CALLS):
                step()
            seconds = time_per_call(device, step, s.target_s, s.rounds)
        return {"seconds": seconds, "first_call_s": first, "tiers": _tiers(contender)}
    return run


def _tiers(contender):
    """The default engine's graphs, as they settled: each one's tier and
    what its CUDA-graph twins did (fastlazy.metrics.tiers()); None for
    another contender."""
    if not (isinstance(contender, workloads.FastLazy) and contender.backend == "auto"):
        return None
    return [{"tier": t["tier"], "runs": t["runs"], "cuda_graph": t["cuda_graph"],
             "error": t["error"]} for t in fastlazy.metrics.tiers()]


# (table, contender) pairs the targets read, by priority: C1, C2, C4, C3
def _priority(table: str, row_n: int | None, name: str, s: Settings) -> int:
    first_n, last_n = s.ns[0], s.ns[-1]
    if table == "W1" and row_n == first_n and name in ("eager", "torch._lazy", "fastlazy[auto]"):
        return 0
    if table == "W1" and row_n == last_n and name in ("torch.compile", "fastlazy[auto]"):
        return 0
    if table == "W1 trace":
        return 0
    if table == "W4" and name in ("eager", "torch.compile", "fastlazy[auto]"):
        return 1
    if table == "W1":
        return 2
    if table == "W4":
        return 3
    return 4


def plan(s: Settings) -> list:
    """Every unit, in the report's order (run_units sorts them by priority)."""
    units = []

    def add(table, row, row_n, contender, run):
        if not s.compile and contender.name in COMPILING:
            run = "skip: --no-compile"
        units.append(Unit(table, row, contender, run, _priority(table, row_n, contender.name, s)))

    for n in s.ns if "W1" in s.tables else ():
        for c in w1_contenders(s.device):
            add("W1", f"n={n}", n, c, w1_exec(s, n, c))
    n = s.ns[0]
    for on in (("cpu", s.device.name) if s.device.cuda else ("cpu",)) \
            if "trace" in s.tables else ():
        c = workloads.FastLazy(None)
        c.name = f"fastlazy trace, {on} tensors"
        add("W1 trace", f"n={n}", n, c, w1_trace(s, n, on))
    why = zoo.missing_library() if s.w4_models else None
    for name in s.w4_models:
        model = zoo.MODELS[name]
        for c in w4_contenders():
            add("W4", f"{name} batch 1", None, c, why and f"skip: {why}" or w4_infer(s, model, c))
    if s.w2:
        for model, batch in ((workloads.W2[0], 1), (workloads.W2[0], 64), (workloads.W2[1], 1)):
            for c in w2_contenders(s.device):
                add("W2", f"{model.name} batch {batch}", None, c, w2_infer(s, model, batch, c))
    return units


def run_units(units, budget_s: float, log) -> dict:
    """Run the units, the targets' first (by priority; in the report's order
    within one), none started once budget_s has passed."""
    results = {}
    start = time.perf_counter()
    for unit in sorted(units, key=lambda u: u.priority):
        if isinstance(unit.run, str):
            results[unit.key] = {"skip": unit.run}
            continue
        spent = time.perf_counter() - start
        if spent > budget_s:
            results[unit.key] = {"skip": f"skip: time budget ({budget_s:.0f} s) spent"}
            log(f"[{spent:6.1f} s] {unit.key}: skipped, budget spent")
            continue
        # an earlier unit's background compile (the default engine's) must
        # not share the CPU with this unit's timed calls
        fastlazy.tiering.wait(COMPILE_WAIT_S)
        began = time.perf_counter()
        try:
            results[unit.key] = unit.run()
            shown = fmt_time(results[unit.key]["seconds"])
        except workloads.Unsupported as why:
            results[unit.key] = {"error": str(why)[:300]}
            shown = "unsupported"
        except Exception as error:       # noqa: BLE001 -- one contender's failure is a row's entry
            results[unit.key] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
            shown = "ERROR"
            log(traceback.format_exc())
        _release()
        log(f"[{time.perf_counter() - start:6.1f} s] {unit.key}: {shown} "
            f"(unit {time.perf_counter() - began:.1f} s)")
    return results


# -- the report ------------------------------------------------------------------

def fmt_time(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def _cell(result: dict | None, eager: dict | None) -> str:
    if result is None:
        return "—"
    if "skip" in result:
        return result["skip"]
    if "error" in result:
        return "error: " + result["error"].replace("|", "/").replace("\n", " ")[:120]
    text = fmt_time(result["seconds"])
    if eager and "seconds" in eager and eager is not result:
        text += f" ({eager['seconds'] / result['seconds']:.2f}×)"
    return text


def _table(results, units, table, with_first=False) -> list:
    rows = list(dict.fromkeys(u.row for u in units if u.table == table))
    names = list(dict.fromkeys(u.contender.name for u in units if u.table == table))
    if not rows:
        return []
    lines = ["| " + " | ".join([table] + [LABELS.get(n, n) for n in names]) + " |",
             "|" + "---|" * (len(names) + 1)]
    for row in rows:
        eager = results.get(f"{table} | {row} | eager")
        cells = [_cell(results.get(f"{table} | {row} | {n}"), eager) for n in names]
        lines.append("| " + " | ".join([row] + cells) + " |")
    if with_first:
        lines += ["", f"First call ({table}: setup and compilation included):", "",
                  "| " + " | ".join([table] + [LABELS.get(n, n) for n in names]) + " |",
                  "|" + "---|" * (len(names) + 1)]
        for row in rows:
            cells = []
            for n in names:
                r = results.get(f"{table} | {row} | {n}") or {}
                cells.append(fmt_time(r["first_call_s"]) if "first_call_s" in r else "—")
            lines.append("| " + " | ".join([row] + cells) + " |")
    return lines


def _seconds(results, key):
    r = results.get(key) or {}
    return r.get("seconds")


def targets(results, s: Settings, bandwidth: float) -> list:
    """[id, measure, target, measured, verdict] for C1-C4; a measure whose
    units did not run is "not measured"."""
    # (the targets' sizes, whichever --ns ran: a size not run is "not measured")
    first_n, last_n = (DRY_NS if s.dry else CUDA_NS)[0], (DRY_NS if s.dry else CUDA_NS)[-1]
    rows = []

    def verdict(ok):
        return "PASS" if ok else "MISS"

    f = _seconds(results, f"W1 | n={first_n} | fastlazy[auto]")
    e = _seconds(results, f"W1 | n={first_n} | eager")
    lz = _seconds(results, f"W1 | n={first_n} | torch._lazy")
    if f and e and lz:
        rows.append(["C1", f"W1 n={first_n} {OPS} ops, default engine", "≥ 10× eager, ≥ 5× torch._lazy",
                     f"{e / f:.2f}× eager, {lz / f:.2f}× torch._lazy ({fmt_time(f)})",
                     verdict(e / f >= 10 and lz / f >= 5)])
    else:
        rows.append(["C1", f"W1 n={first_n} {OPS} ops, default engine",
                     "≥ 10× eager, ≥ 5× torch._lazy", "not measured", "—"])

    f = _seconds(results, f"W1 | n={last_n} | fastlazy[auto]")
    c = _seconds(results, f"W1 | n={last_n} | torch.compile")
    floor = (INPUTS_READ + 1) * last_n * last_n * 4 / bandwidth if bandwidth else None
    if f and c and floor:
        rows.append(["C2", f"W1 n={last_n} {OPS} ops, default engine",
                     "≥ 0.8× memory-bandwidth floor, ≥ 1.0× torch.compile",
                     f"{floor / f:.2f}× the floor ({fmt_time(floor)}: {INPUTS_READ} inputs read, "
                     f"1 output written at {bandwidth / 1e9:.0f} GB/s copy bandwidth), "
                     f"{c / f:.2f}× torch.compile ({fmt_time(f)})",
                     verdict(floor / f >= 0.8 and c / f >= 1.0)])
    else:
        rows.append(["C2", f"W1 n={last_n} {OPS} ops, default engine",
                     "≥ 0.8× memory-bandwidth floor, ≥ 1.0× torch.compile", "not measured", "—"])

    models = [m for m in s.w4_models]
    speed = [(_seconds(results, f"W4 | {m} batch 1 | eager"),
              _seconds(results, f"W4 | {m} batch 1 | torch.compile"),
              _seconds(results, f"W4 | {m} batch 1 | fastlazy[auto]")) for m in models]
    if models and all(all(t) for t in speed):
        vs_eager = math.exp(sum(math.log(e / f) for e, _, f in speed) / len(speed))
        vs_compile = math.exp(sum(math.log(c / f) for _, c, f in speed) / len(speed))
        rows.append(["C3", f"W4 inference batch 1 ({', '.join(models)}), default engine, "
                     "geometric mean", "≥ 2× eager, ≥ 1.0× torch.compile",
                     f"{vs_eager:.2f}× eager, {vs_compile:.2f}× torch.compile",
                     verdict(vs_eager >= 2 and vs_compile >= 1.0)])
    else:
        rows.append(["C3", "W4 inference, default engine, geometric mean",
                     "≥ 2× eager, ≥ 1.0× torch.compile", "not measured", "—"])

    on_device = (results.get(f"W1 trace | n={first_n} | fastlazy trace, {s.device.name} tensors")
                 or {}).get("ns_per_op")
    on_cpu = (results.get(f"W1 trace | n={first_n} | fastlazy trace, cpu tensors")
              or {}).get("ns_per_op")
    if on_device and on_cpu and s.device.cuda:
        rows.append(["C4", f"W1 trace only, n={first_n}, {OPS} ops: CUDA tensors vs CPU tensors",
                     "the CPU figure (≤ 1.1×)",
                     f"{on_device:.0f} ns per op on CUDA tensors, {on_cpu:.0f} on CPU tensors "
                     f"({on_device / on_cpu:.2f}×)", verdict(on_device <= 1.1 * on_cpu)])
    else:
        rows.append(["C4", "W1 trace only on CUDA tensors vs CPU tensors", "the CPU figure",
                     "not measured" if not on_cpu else
                     f"{on_cpu:.0f} ns per op on CPU tensors; no CUDA tensors here", "—"])
    return rows


def _git_commit() -> str:
    if os.environ.get("FASTLAZY_COMMIT"):
        return os.environ["FASTLAZY_COMMIT"]
    try:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], text=True,
                                capture_output=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain",
                                "--untracked-files=no"], text=True, capture_output=True,
                               check=True).stdout.strip()
        return commit + (" (with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git here: set FASTLAZY_COMMIT)"


def environment(device: Device, bandwidth: float) -> list:
    lines = []
    if device.cuda:
        props = torch.cuda.get_device_properties(0)
        lines.append(f"- device: {torch.cuda.get_device_name(0)} (compute capability "
                     f"{props.major}.{props.minor}, {props.total_memory / 2**30:.0f} GiB)")
    else:
        lines.append(f"- device: CPU ({platform.processor() or platform.machine()}, "
                     f"{os.cpu_count()} cores, intra-op threads: {torch.get_num_threads()})")
    lines += [f"- torch {torch.__version__}, CUDA {torch.version.cuda}, "
              f"Python {platform.python_version()}",
              f"- fastlazy commit {_git_commit()}",
              f"- measured {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}",
              f"- copy bandwidth (device-to-device copy_, read + written): "
              f"{bandwidth / 1e9:.0f} GB/s"]
    return lines


def report(results, units, s: Settings, bandwidth: float, elapsed: float, argv) -> str:
    if s.dry:
        head = ["# fastlazy GPU check: DRY RUN on the CPU (not CUDA numbers)", "",
                "This file comes from `benchmarks/gpu/run.sh OUTDIR --dry-run` (or a machine "
                "without CUDA): the CUDA benchmark's steps run on the CPU at tiny sizes "
                f"(W1 at n={', '.join(map(str, s.ns))} standing in for "
                f"{', '.join(map(str, CUDA_NS))}) to exercise the script.  No figure here "
                "is a CUDA measurement, and no target verdict is given."]
    else:
        head = ["# fastlazy on CUDA: measured", "",
                "Written by `benchmarks/gpu/run.sh` (benchmarks/gpu/cuda_bench.py): every "
                "contender side by side in one process, the device synchronized before every "
                "clock read, minimum time per call over rounds; in brackets the speedup over "
                "eager.  TF32 off (every contender computes float32)."]
    lines = head + [""] + environment(s.device, bandwidth) + [
        f"- run: `{' '.join(argv)}`, {elapsed:.0f} s, budget {s.budget_s:.0f} s", ""]
    lines += ["## Targets", "", "| id | measure | target | measured | verdict |",
              "|---|---|---|---|---|"]
    for row in targets(results, s, bandwidth):
        if s.dry:
            row = row[:4] + ["— (dry run)"]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", f"## W1: {OPS}-op chain, executed (time per call)", ""]
    lines += _table(results, units, "W1", with_first=True)
    fusion = [(u.row, (results.get(u.key) or {}).get("fusion")) for u in units
              if u.table == "W1" and u.contender.name == "fastlazy[torchscript]"]
    fusion = [(row, f) for row, f in fusion if f]
    if fusion:
        lines += ["", "fastlazy TorchScript+NNC, what the graph executor fused "
                  "(fastlazy.metrics.fusion()):", ""]
        for row, graphs in fusion:
            for g in graphs:
                left = ", ".join(f"{k} ×{v}" for k, v in g["unfused"].items()) or "none"
                lines.append(f"- W1 {row}: {g['state']}, {g['groups']} fusion group(s) "
                             f"covering {g['fused']} aten ops; outside: {left}")
    tiers = [(u.table, u.row, (results.get(u.key) or {}).get("tiers")) for u in units]
    tiers = [(table, row, t) for table, row, t in tiers if t]
    if tiers:
        lines += ["", "fastlazy default engine, the tier each graph settled on "
                  "(fastlazy.metrics.tiers(); a CUDA-graph twin's probed run or why it "
                  "was not captured):", ""]
        for table, row, graphs in tiers:
            for g in graphs:
                extra = f"; CUDA graph: {g['cuda_graph']}" if g["cuda_graph"] else ""
                extra += f"; error: {g['error']}" if g["error"] else ""
                lines.append(f"- {table} {row}: {g['tier']}, {g['runs']} runs{extra}")
    lines += ["", f"## W1 trace only ({OPS} ops recorded, nothing run)", ""]
    lines += _table(results, units, "W1 trace")
    if s.w4_models:
        lines += ["", "## W4: inference, batch 1 (time per call)", ""]
        lines += _table(results, units, "W4", with_first=True)
    if s.w2:
        lines += ["", "## W2: inference (time per call)", ""]
        lines += _table(results, units, "W2", with_first=True)
    errors = [(k, r["error"]) for k, r in results.items() if "error" in r]
    if errors:
        lines += ["", "## Errors", ""] + [f"- {k}: {e}" for k, e in errors]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("outdir", type=pathlib.Path)
    parser.add_argument("--dry-run", action="store_true",
                        help="the CPU at tiny sizes: exercise the script (cuda_dryrun.md)")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S,
                        help="start no unit after this many seconds (default %(default)s)")
    parser.add_argument("--w4-models", default=",".join(W4_MODELS),
                        help="comma-separated zoo models for W4 ('' for none)")
    parser.add_argument("--no-compile", action="store_true",
                        help="leave out every contender that compiles with inductor")
    parser.add_argument("--tables", default=",".join(TABLES),
                        help="which tables to run, comma-separated (default: all of "
                             "%(default)s)")
    parser.add_argument("--ns", default="", help="W1 sizes, comma-separated (default: "
                        f"{CUDA_NS}, dry run {DRY_NS})")
    args = parser.parse_args(argv)

    dry = args.dry_run or not torch.cuda.is_available()
    device = Device("cpu" if dry else "cuda", dry)
    if device.cuda:
        # torch._lazy's TorchScript backend reads this when it starts
        os.environ.setdefault("LTC_TS_CUDA", "1")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if dry:
        # one intra-op thread, as the CPU benchmark: steadier on a shared machine
        torch.set_num_threads(1)
    s = Settings(args, device)
    if args.ns:
        s.ns = tuple(int(n) for n in args.ns.split(","))
    s.budget_s = args.budget_s
    args.outdir.mkdir(parents=True, exist_ok=True)
    stem = "cuda_dryrun" if dry else "cuda"
    log_file = open(args.outdir / f"{stem}_bench.log", "w")

    def log(text):
        print(text, flush=True)
        log_file.write(text + "\n")
        log_file.flush()

    log(f"{'DRY RUN on the CPU' if dry else 'CUDA'}: torch {torch.__version__}, "
        f"device {torch.cuda.get_device_name(0) if device.cuda else 'cpu'}")
    started = time.perf_counter()
    bandwidth = copy_bandwidth(device, (16 if dry else 1024) * 2**20)
    log(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s")
    units = plan(s)
    results = run_units(units, s.budget_s, log)
    elapsed = time.perf_counter() - started
    text = report(results, units, s, bandwidth, elapsed,
                  ["python", "benchmarks/gpu/cuda_bench.py", *(argv or sys.argv[1:])])
    (args.outdir / f"{stem}.md").write_text(text)
    (args.outdir / f"{stem}.json").write_text(json.dumps(
        {"dry_run": dry, "device": device.name, "torch": torch.__version__,
         "bandwidth_bytes_per_s": bandwidth, "elapsed_s": elapsed, "results": results},
        indent=1, default=str))
    log(f"wrote {args.outdir / f'{stem}.md'} in {elapsed:.0f} s")
    log_file.close()
    failed = [k for k, r in results.items() if "error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
