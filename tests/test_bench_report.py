"""benchmarks/report.py reads as a user needs it (issue 17, item 7): it stands
alone, its tables are narrow, trace rows are not speedups, its columns are
explained up front, and its plots can be redrawn from the committed tables."""
import importlib.util
import pathlib
import sys

import pytest

import fastlazy

ROOT = pathlib.Path(__file__).resolve().parent.parent
MEASURED = ROOT / "benchmarks" / "measured"
TABLES = [MEASURED / "table.md", MEASURED / "w4_table.md"]


def _report():
    spec = importlib.util.spec_from_file_location("bench_report", ROOT / "benchmarks" / "report.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module          # (its dataclasses look it up)
    spec.loader.exec_module(module)
    return module


report = _report()


def test_the_project_stands_alone():
    """No reference to files outside the repository (a clone has no ../shared)."""
    for path in [ROOT / "README.md", *ROOT.joinpath("benchmarks").glob("*.py"),
                 *MEASURED.glob("*.md")]:
        text = path.read_text()
        assert "../shared" not in text and "shared/seeds" not in text, path
        assert "BENCHMARKS.md" not in text, path


def test_committed_measurements_are_read_back():
    results = report.load_markdown(TABLES)
    rows = results.rows()
    assert sum(r.workload == "W4" for r in rows) == 8
    assert any(r.workload == "W1" and r.mode == "exec" and r.n == 1000 for r in rows)
    resnet = report.Row("W4", "infer", 1, item="resnet18")
    assert results.get(resnet, "eager") == pytest.approx(10.2e-3)


def test_tables_are_narrow_and_trace_rows_are_not_speedups():
    results = report.load_markdown(TABLES)
    for title, rows in report.tables(results):
        text = report.as_text(rows)
        assert max(map(len, text.splitlines())) <= 180, title
        if title.startswith("W1 trace"):
            assert "×" not in text and "/op run" in text
    assert max(map(len, report.targets_text([["id"] * 5, ["P7", "m", "t", "x " * 200, "PASS"]])
                   .splitlines())) <= 110


def test_columns_are_explained_before_the_tables():
    text = report.legend("min", 1)
    assert "fastlazy = recording only" in text and "fastlazy[B] = recorded" in text
    assert "W4  real models" in text and "W1  a chain" in text
    assert "not compared" in text          # trace rows against eager running


def test_plots_are_redrawn_from_the_committed_tables(tmp_path):
    pytest.importorskip("matplotlib")
    assert report.main(["--replot", *map(str, TABLES), "--out", str(tmp_path)]) == 0
    for name in ("speedup.png", "w4_speedup.png"):
        assert (tmp_path / name).stat().st_size > 10_000


def _benchmark_script(monkeypatch, name):
    """benchmarks/<name>.py, loaded as a module (with its workloads, zoo)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_interleaved_w4_times_each_step_in_a_block_of_its_own(monkeypatch):
    """benchmarks/w4_interleaved.py's rounds call eager's step in a block,
    then fastlazy's (a call right after the other contender's runs slower
    than among its own), each at least the round's minimum number of
    times."""
    interleaved = _benchmark_script(monkeypatch, "w4_interleaved")
    order = []
    times = interleaved._round([lambda: order.append("eager"), lambda: order.append("lazy")],
                               seconds=0.0, calls=3)
    assert order == ["eager"] * 3 + ["lazy"] * 3
    assert [len(t) for t in times] == [3, 3] and all(s >= 0 for t in times for s in t)


def test_enable_cost_times_the_eager_step_disabled_and_enabled_in_turn(monkeypatch):
    """benchmarks/w4_enable_cost.py times the same eager step in a block
    with fastlazy disabled and one with it enabled, swapping which comes
    first each round, and leaves fastlazy as it found it."""
    cost = _benchmark_script(monkeypatch, "w4_enable_cost")
    seen = []
    was = fastlazy.enabled()
    fastlazy.disable()
    try:
        ratios = cost.enable_cost(lambda: seen.append(bool(fastlazy.enabled())), rounds=2,
                                  seconds=0.0, calls=2)
        assert not fastlazy.enabled()
    finally:
        if was:
            fastlazy.enable()
    # per block: 3 calls after the switch, then the 2 timed
    assert seen == [False] * 5 + [True] * 5 + [True] * 5 + [False] * 5
    assert len(ratios) == 2 and all(r > 0 for r in ratios)


def test_cold_pairs_alternate_the_contenders_round_by_round(monkeypatch):
    """benchmarks/w4_cold_pairs.py runs eager's fresh process and
    fastlazy's in turn, swapping which goes first each round, and reports
    the median of the rounds' ratios."""
    pairs = _benchmark_script(monkeypatch, "w4_cold_pairs")
    order = []

    def cold(case):
        order.append(case.contender.name)
        slow = {"eager": [1.0, 1.2, 0.9], "fastlazy[auto]": [0.5, 0.9, 0.6]}[case.contender.name]
        return {"first_call_s": 0.01, "first_calls_s": slow[order.count(case.contender.name) - 1]}
    runs = pairs.measure("resnet18", rounds=3, cold=cold)
    assert order == ["eager", "fastlazy[auto]", "fastlazy[auto]", "eager",
                     "eager", "fastlazy[auto]"]
    row = pairs._row("resnet18", runs)
    assert "| 0.67x (0.50-0.75) |" in row       # ratios 0.5, 0.75, 0.667
