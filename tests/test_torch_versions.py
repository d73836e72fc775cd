"""The package on the oldest supported torch: scripts/setup_compat.sh builds
it into .venv-torch2.13 (the local torch 2.13.0 CPU wheel, its own build
tree), then a representative subset of this suite runs there with that
venv's pytest: registration (with and without an import), the ops and fusion
cases on each engine at one world size each, FSDP2 parity, the launcher.
About 2 minutes of setup on a fresh clone (seconds on a second run) and a few
minutes of tests, inside CI's budget (see docs/versions.md)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
COMPAT_TORCH = "2.13"
VENV = ROOT / f".venv-torch{COMPAT_TORCH}"

# One launch per (module, world, engine) runs every case of that module, so
# the subset is chosen by launch: one world size per engine.
SUBSET = [
    "tests/test_registration.py",
    "tests/test_ops.py",
    "tests/test_fusion.py",
    "-k",
    "not test_op_across_pretended_hosts and (not test_op and not test_fusion"
    " or shm-2 or gloo-3 or nccl_contract-4)",
    "tests/test_fsdp.py",
    "tests/test_launcher.py",
]
MIN_PASSED = 150  # what the subset passes, less a margin: it must not shrink unnoticed

# Set in the compat run, so that running the whole suite in the compat venv
# does not start itself again.
NESTED = "HSDP_COMPAT_RUN"


def tail(text: str, n: int = 6000) -> str:
    return text[-n:]


@pytest.mark.timeout(900)
@pytest.mark.skipif(bool(os.environ.get(NESTED)), reason="already inside the compat run")
def test_subset_on_oldest_supported_torch():
    setup = subprocess.run(
        ["bash", "scripts/setup_compat.sh"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert setup.returncode == 0, (
        f"scripts/setup_compat.sh failed:\n{tail(setup.stdout + setup.stderr)}"
    )
    version = subprocess.run(
        [str(VENV / "bin/python"), "-c", "import torch; print(torch.__version__)"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert version.stdout.startswith(COMPAT_TORCH + "."), version.stdout + version.stderr
    proc = subprocess.run(
        [str(VENV / "bin/python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", *SUBSET],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, NESTED: "1"},
        timeout=780,
    )
    out = proc.stdout + proc.stderr
    summary = out.strip().splitlines()[-1] if out.strip() else ""
    assert proc.returncode == 0, f"torch {version.stdout.strip()}: {summary}\n{tail(out)}"
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= MIN_PASSED, summary
    print(f"torch {version.stdout.strip()} ({sys.executable} ran it): {summary}")
