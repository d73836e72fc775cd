"""PyTorch's own c10d suite (DistributedTest, shipped in the torch wheel) on
hsdp, against gloo's results on the same tests.

The driver (conformance/driver.py) runs the whole suite on CPU for one backend
and world size. Every test that passes on gloo (conformance/gloo_pass_w{W}.txt,
recorded from gloo on this torch) must pass on hsdp, unless
conformance/expected_hsdp_w{W}.txt lists it with its reason; a listed test
that passes fails this test too, so the list stays true. The suite's gates
are read as for gloo (driver.py): hsdp is held to every test gloo passes.
World size 2 runs by default (9-15 minutes on 2 cores);
HSDP_TEST_CONFORMANCE_FULL=1 adds world size 3 and re-runs gloo to check the
recorded baselines.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from hsdp_backend import config

HERE = pathlib.Path(__file__).parent / "conformance"
FULL = config.read("HSDP_TEST_CONFORMANCE_FULL")
WORLDS = [2, 3] if FULL else [2]


def listed(path: pathlib.Path) -> dict[str, str]:
    """``test_name: reason`` lines (blank lines and # comments ignored)."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, reason = line.partition(":")
            out[name.strip()] = reason.strip()
    return out


def run_suite(backend: str, world: int, tmp_path: pathlib.Path) -> dict[str, str]:
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
    got = run_suite("hsdp", world, tmp_path)
    unexpected = {
        t: got.get(t, "not run") for t in baseline if got.get(t) != "pass" and t not in expected
    }
    assert not unexpected, "passes on gloo, not on hsdp, and is not listed:\n" + "\n".join(
        f"{t}: {r}" for t, r in sorted(unexpected.items())
    )
    stale = sorted(t for t in expected if got.get(t) == "pass")
    assert not stale, f"listed in expected_hsdp_w{world}.txt but passing now (remove them): {stale}"
