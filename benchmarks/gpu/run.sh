#!/usr/bin/env bash
# The GPU check in one command, on a machine with a CUDA device and its own
# Python and torch:
#
#   bash benchmarks/gpu/run.sh OUTDIR            # writes OUTDIR/cuda.md and gpu_check.log
#   bash benchmarks/gpu/run.sh OUTDIR --dry-run  # the same steps on the CPU, tiny sizes:
#                                                # OUTDIR/cuda_dryrun.md, gpu_check_dryrun.log
#   bash benchmarks/gpu/run.sh --bundle-test-deps  # here: copy the pure-Python test
#                                                # dependencies into .gpu_deps/ (see below)
#
# 1. builds fastlazy's extension in place against the installed torch
#    (setup.py build_ext --inplace: no build isolation, nothing installed),
#    and stops at once if the build or the import fails;
# 2. prints torch, CUDA and device information;
# 3. runs the CUDA tests (`pytest tests -m cuda`: every item the `device`
#    fixture or the `cuda` mark makes for CUDA) under a time limit;
# 4. runs the CUDA benchmark (benchmarks/gpu/cuda_bench.py) with the time
#    left, and appends the build and test outcome to its report.
#
# The whole check keeps within GPU_CHECK_SECONDS (default 540) of wall time:
# the tests get at most half of what is left after the build, the benchmark
# starts no unit once its budget is spent.  Exit status: 2 if the build or
# import failed, 1 if a test or a benchmark unit failed, else 0.
#
# PYTHON: the interpreter (default python3).  FASTLAZY_COMMIT: the commit
# measured, for the report, where the copy has no .git.  GPU_CHECK_TESTS:
# what pytest runs (default "tests"; "none" skips the tests), and
# GPU_CHECK_BENCH_ARGS: more arguments for cuda_bench.py (--tables W2, say),
# to split the check over two commands.  The tests need
# hypothesis (and its attrs and sortedcontainers); a machine without it and
# without network takes them from .gpu_deps/ in the repository, which
# `--bundle-test-deps` fills from this machine's Python (pure-Python packages).
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${PYTHON:-python3}"
cd "$REPO"

if [[ "${1:-}" == "--bundle-test-deps" ]]; then
    rm -rf .gpu_deps && mkdir -p .gpu_deps
    "$PY" - <<'EOF' || exit 2
# hypothesis and what it requires (no extras), as the modules this Python imports
import importlib.metadata as md, importlib.util, pathlib, re, shutil
wanted, todo = set(), ["hypothesis"]
while todo:
    dist = todo.pop()
    if dist.lower() in wanted:
        continue
    wanted.add(dist.lower())
    for req in md.requires(dist) or []:
        if "extra ==" not in req:
            todo.append(re.split(r"[\s;<>=!~\[(]", req, maxsplit=1)[0])
for module, dists in md.packages_distributions().items():
    if not {d.lower() for d in dists} & wanted:
        continue
    origin = pathlib.Path(importlib.util.find_spec(module).origin)
    source = origin.parent if origin.name == "__init__.py" else origin
    target = pathlib.Path(".gpu_deps") / source.name
    if source.is_dir():
        shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
    else:
        shutil.copy2(source, target)
    print("bundled", module, "of", ", ".join(dists))
for dist in wanted:        # the metadata too: hypothesis's pytest plugin is an entry point
    info = pathlib.Path(md.distribution(dist)._path)
    shutil.copytree(info, pathlib.Path(".gpu_deps") / info.name)
EOF
    echo "carry .gpu_deps to the GPU machine (it is ignored by git)"
    exit 0
fi

OUT="${1:?usage: benchmarks/gpu/run.sh OUTDIR [--dry-run]}"
DRY=0
[[ "${2:-}" == "--dry-run" ]] && DRY=1
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
STEM=gpu_check
[[ $DRY == 1 ]] && STEM=gpu_check_dryrun
LOG="$OUT/$STEM.log"
: > "$LOG"
TOTAL="${GPU_CHECK_SECONDS:-540}"
START=$SECONDS
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

say() { echo "$*" | tee -a "$LOG"; }
left() { echo $((TOTAL - (SECONDS - START))); }
fail() { say ""; say "GPU CHECK FAILED: $*"; exit 2; }

say "== fastlazy GPU check $(date -Is) $([[ $DRY == 1 ]] && echo '(DRY RUN on the CPU)')"
say "python: $(command -v "$PY") $("$PY" --version 2>&1)"

# -- 1. build ---------------------------------------------------------------------
say "== build (setup.py build_ext --inplace, against the installed torch)"
T0=$SECONDS
"$PY" setup.py build_ext --inplace -j "$(nproc)" >>"$LOG" 2>&1 || fail "the build failed (see $LOG)"
BUILD_S=$((SECONDS - T0))
"$PY" - >>"$LOG" 2>&1 <<EOF || fail "fastlazy does not import from $REPO after the build (see $LOG)"
import pathlib, fastlazy, fastlazy._core, fastlazy._steps
where = pathlib.Path(fastlazy.__file__).resolve().parent
assert where == pathlib.Path("$REPO").resolve() / "fastlazy", f"imported from {where}"
print("fastlazy imports from", where)
EOF
say "built in ${BUILD_S} s"

# -- 2. the machine ---------------------------------------------------------------
say "== torch and device"
"$PY" - 2>&1 <<'EOF' | tee -a "$LOG"
import torch
print("torch", torch.__version__, "| CUDA", torch.version.cuda, "| cuda available",
      torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", torch.cuda.get_device_name(0), f"| capability {p.major}.{p.minor}",
          f"| {p.total_memory / 2**30:.0f} GiB")
EOF
command -v nvidia-smi >/dev/null && nvidia-smi -L 2>&1 | tee -a "$LOG"
if [[ $DRY == 0 ]] && ! "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    say "no CUDA device: running the dry run instead"
    DRY=1
fi

# -- 3. the CUDA tests ------------------------------------------------------------
if ! "$PY" -c "import hypothesis" 2>/dev/null && [[ -d "$REPO/.gpu_deps" ]]; then
    export PYTHONPATH="$PYTHONPATH:$REPO/.gpu_deps"
fi
TEST_STATUS=0
TEST_SUMMARY=""
TESTS="${GPU_CHECK_TESTS:-tests}"
if [[ "$TESTS" == none ]]; then
    TEST_SUMMARY="not run (GPU_CHECK_TESTS=none)"
    say "== CUDA tests $TEST_SUMMARY"
elif ! "$PY" -c "import pytest, hypothesis" 2>>"$LOG"; then
    TEST_STATUS=1
    TEST_SUMMARY="not run: pytest or hypothesis missing (run --bundle-test-deps where they are installed and carry .gpu_deps)"
    say "== CUDA tests $TEST_SUMMARY"
else
    LIMIT=$(( $(left) / 2 ))
    (( LIMIT > 300 )) && LIMIT=300
    (( LIMIT < 30 )) && LIMIT=30
    say "== CUDA tests: pytest $TESTS -m cuda (at most ${LIMIT} s)"
    T0=$SECONDS
    # shellcheck disable=SC2086  # GPU_CHECK_TESTS may name several paths
    timeout --signal=INT --kill-after=20 "$LIMIT" \
        "$PY" -m pytest $TESTS -m cuda -q -p no:cacheprovider -o addopts="" \
        --continue-on-collection-errors --durations=10 -W ignore::DeprecationWarning \
        >"$OUT/$STEM.tests.txt" 2>&1
    TEST_STATUS=$?
    cat "$OUT/$STEM.tests.txt" >>"$LOG"
    TEST_SUMMARY="$(grep -E '(passed|failed|skipped|error|no tests ran)' "$OUT/$STEM.tests.txt" | tail -1)"
    [[ $TEST_STATUS == 124 || $TEST_STATUS == 130 ]] && TEST_SUMMARY="stopped at the ${LIMIT} s limit: $TEST_SUMMARY"
    TEST_SUMMARY="$TEST_SUMMARY (exit $TEST_STATUS, $((SECONDS - T0)) s)"
    rm -f "$OUT/$STEM.tests.txt"
    say "tests: $TEST_SUMMARY"
fi

# -- 4. the CUDA benchmark --------------------------------------------------------
BUDGET=$(( $(left) - 90 ))
(( BUDGET < 30 )) && BUDGET=30
say "== CUDA benchmark (units started within ${BUDGET} s)"
BENCH_ARGS=("$OUT" --budget-s "$BUDGET")
[[ $DRY == 1 ]] && BENCH_ARGS+=(--dry-run)
# shellcheck disable=SC2206  # split on purpose
[[ -n "${GPU_CHECK_BENCH_ARGS:-}" ]] && BENCH_ARGS+=(${GPU_CHECK_BENCH_ARGS})
"$PY" benchmarks/gpu/cuda_bench.py "${BENCH_ARGS[@]}" 2>&1 | tee -a "$LOG"
BENCH_STATUS=${PIPESTATUS[0]}
REPORT="$OUT/cuda.md"
[[ $DRY == 1 ]] && REPORT="$OUT/cuda_dryrun.md"
[[ -f "$REPORT" ]] || fail "the benchmark wrote no report (exit $BENCH_STATUS, see $LOG)"
{
    echo
    echo "## This check"
    echo
    echo "- build: \`setup.py build_ext --inplace\` against the installed torch, ${BUILD_S} s"
    echo "- CUDA tests (\`pytest $TESTS -m cuda\`): $TEST_SUMMARY"
    echo "- benchmark exit status $BENCH_STATUS; the whole check $((SECONDS - START)) s"
} >>"$REPORT"
say "== done in $((SECONDS - START)) s: $REPORT, $LOG"
(( TEST_STATUS != 0 || BENCH_STATUS != 0 )) && exit 1
exit 0
