"""PyTorch's own c10d suite (DistributedTest, shipped in the torch wheel) on
hsdp, against gloo's results on the same tests.

The driver (conformance/driver.py) runs the whole suite on CPU for one backend
and world size. Every test that passes on gloo (conformance/gloo_pass_w{W}.txt,
recorded from gloo on this torch) must pass on hsdp, unless
conformance/expected_hsdp_w{W}.txt lists it with its reason; a listed test
that passes fails this test too, so the list stays true. The suite's gates
are read as for gloo (driver.py): hsdp is held to every test gloo passes.
By default world sizes 2 and 3 run, each test's ranks forked from the driver
(as PyTorch's test_distributed_fork.py ran the suite on gloo: a spawned rank
imports torch again, ~10 s a test on 2 cores, a forked one inherits it), and
only the tests this file checks (gloo's passing set and the listed gaps: the
rest of the suite skips on CPU).
HSDP_TEST_CONFORMANCE_FULL=1 spawns the ranks (as test_distributed_spawn.py,
where the baselines were recorded), runs every test and re-runs gloo to check
the recorded baselines. The same tests at 2 ranks also run as a pytest module under
pytest_hsdp, on its warm ranks, with the outcomes torch's harness gives them.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
from plugin_runs import run_pytest

from tools import settings

HERE = pathlib.Path(__file__).resolve().parents[1] / "conformance"
FULL = settings.read("HSDP_TEST_CONFORMANCE_FULL")
WORLDS = [2, 3]
START = "spawn" if FULL else "fork"


def listed(path: pathlib.Path) -> dict[str, str]:
    """``test_name: reason`` lines (blank lines and # comments ignored)."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, reason = line.partition(":")
            out[name.strip()] = reason.strip()
    return out


def run_suite(
    backend: str, world: int, tmp_path: pathlib.Path, only: list[pathlib.Path] = ()
) -> dict[str, str]:
    out = tmp_path / f"{backend}-{world}.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(HERE / "driver.py"),
            "--backend",
            backend,
            "--world",
            str(world),
            "--out",
            str(out),
            "--start",
            START,
            *(arg for path in only for arg in ("--only", str(path))),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=2400,
    )
    assert out.exists(), (
        f"the driver wrote no results (rc {proc.returncode}):\n{proc.stderr[-6000:]}"
    )
    return json.loads(out.read_text())


@pytest.mark.timeout(3600)  # the whole suite, one backend after another
@pytest.mark.parametrize("world", WORLDS)
def test_distributed_test_on_hsdp(world, tmp_path):
    baseline = listed(HERE / f"gloo_pass_w{world}.txt")
    expected = listed(HERE / f"expected_hsdp_w{world}.txt")
    if FULL:
        gloo = run_suite("gloo", world, tmp_path)
        passing = {t for t, r in gloo.items() if r == "pass"}
        assert passing == set(baseline), (
            f"gloo's passing set changed: now also {sorted(passing - set(baseline))}, "
            f"no longer {sorted(set(baseline) - passing)}; update gloo_pass_w{world}.txt"
        )
    checked = [HERE / f"gloo_pass_w{world}.txt", HERE / f"expected_hsdp_w{world}.txt"]
    got = run_suite("hsdp", world, tmp_path, only=[] if FULL else checked)
    unexpected = {
        t: got.get(t, "not run") for t in baseline if got.get(t) != "pass" and t not in expected
    }
    assert not unexpected, "passes on gloo, not on hsdp, and is not listed:\n" + "\n".join(
        f"{t}: {r}" for t, r in sorted(unexpected.items())
    )
    stale = sorted(t for t in expected if got.get(t) == "pass")
    assert not stale, f"listed in expected_hsdp_w{world}.txt but passing now (remove them): {stale}"


@pytest.mark.timeout(2400)
@pytest.mark.parametrize("backend", ["hsdp", "gloo"])
def test_distributed_test_on_pytest_hsdps_warm_ranks(tmp_path, backend):
    """DistributedTest's tests that this file checks at 2 ranks, run unchanged by a pytest with
    pytest_hsdp (driver.py as a test module): every test on warm ranks, none falling back to
    torch's spawning, and each with the outcome the driver's run under torch's harness holds
    it to: gloo's passing set passes on gloo and on hsdp, hsdp's listed gaps fail."""
    baseline = listed(HERE / "gloo_pass_w2.txt")
    expected = listed(HERE / "expected_hsdp_w2.txt") if backend == "hsdp" else set()
    d = tmp_path / "user"
    d.mkdir()
    (d / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "pids").mkdir()
    (tmp_path / "barriers").mkdir()
    ids = [
        f"{HERE / 'driver.py'}::TestDistBackendOnCPU::{t}" for t in sorted({*baseline, *expected})
    ]
    env = {
        "CONFORMANCE_BACKEND": backend,
        "WORLD_SIZE": "2",
        "TEMP_DIR": str(tmp_path / "barriers"),
        "PYTORCH_PRINT_REPRO_ON_FAILURE": "0",
    }
    # The repository's conftest and ini stay out: the run is a user's pytest of this one module.
    args = ("--noconftest", "-c", str(d / "pytest.ini"), "--rootdir", str(d))
    results, out = run_pytest(d, *args, *ids, env=env, timeout=2000)
    got = {name: state for name, (state, _) in results.items()}
    want = {t: "failure" if t in expected else "passed" for t in {*baseline, *expected}}
    differ = {t: (got.get(t, "not run"), w) for t, w in want.items() if got.get(t) != w}
    assert not differ, f"(got, expected) under pytest_hsdp: {differ}\n{out[-4000:]}"
    assert "torch's own spawning" not in out, out[-4000:]
