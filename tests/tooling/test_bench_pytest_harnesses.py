"""pytest's multi-process harnesses side by side (benchmarks/pytest_harnesses.py): each passes
every test before it is timed.

In its smallest form (3 cases at 2 ranks): `pytest_hsdp`, torch's two suites unchanged on its
warm ranks, `MultiProcContinuousTest` and `MultiProcessTestCase` are compared with the last; a
harness whose test fails stops the benchmark, naming the test's failure."""

import json
import os
import pathlib
import subprocess
import sys

from harness import run_module

ROOT = pathlib.Path(__file__).resolve().parents[2]


def bench(*args: str) -> subprocess.CompletedProcess:
    return run_module("benchmarks.pytest_harnesses", *args, timeout=400, env={}, ok=False)


def test_every_harness_runs_the_same_tests_and_is_compared(tmp_path):
    out = tmp_path / "harnesses.json"
    proc = bench(
        "--cases", "3", "--worlds", "2", "--empty", "5",
        "--harnesses", "plugin-hsdp,warm-gloo,warm-continuous-gloo,continuous-gloo,spawn-gloo",
        "--json", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["tests"] == 3
    rows = {r["harness"]: r for r in result["rows"]}
    assert sorted(rows) == [
        "continuous-gloo", "plugin-hsdp", "spawn-gloo", "warm-continuous-gloo", "warm-gloo"
    ]  # fmt: skip
    for r in rows.values():
        assert r["wall_s"] > 0 and abs(r["per_test_s"] * 3 - r["wall_s"]) < 1e-6, r
        assert r["speedup_vs_spawn_gloo"] > 0, r
    assert rows["spawn-gloo"]["speedup_vs_spawn_gloo"] == 1.0
    assert 0 < result["plain_test_median_ms"] and 0 < result["empty_test_median_ms"]
    assert 0 < result["empty_case_median_ms"] and 0 < result["empty_continuous_median_ms"]
    assert "vs spawn-gloo" in proc.stdout


def test_a_harness_whose_tests_fail_is_not_timed(tmp_path, monkeypatch):
    cases = tmp_path / "benchmarks"
    cases.mkdir()
    # The cases module with its first case broken: the benchmark must refuse to time it.
    source = (ROOT / "benchmarks" / "harness_cases.py").read_text()
    broken = source.replace(
        "def all_reduce_sum_1(rank, world):\n",
        "def all_reduce_sum_1(rank, world):\n    assert rank < 0, 'broken on purpose'\n",
    )
    assert broken != source
    for name in ("__init__.py", "pytest_harnesses.py"):
        (cases / name).write_text((ROOT / "benchmarks" / name).read_text())
    (cases / "harness_cases.py").write_text(broken)
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.pytest_harnesses", "--cases", "1", "--worlds", "2",
         "--harnesses", "plugin-gloo", "--empty", "2"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=dict(os.environ),
    )  # fmt: skip
    assert proc.returncode != 0
    assert "not all 1 tests passed" in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert "broken on purpose" in proc.stdout + proc.stderr
