"""The package on every other supported torch release (2.11, 2.12, 2.13, 2.15), each in a cached
venv of its own.

The package on every other supported torch (the main venv has 2.14):
scripts/setup_compat.sh builds it against that release in a venv of its own
(cached outside the clone: docs/versions.md), then what meets torch's
differences (conftest.py: EVERY_TORCH) runs there with that venv's pytest,
and the quick tier too with HSDP_TEST_EVERY_TORCH_FULL=1 (SUBSETS below). A fresh machine
spends a minute or two per release installing torch and about two building;
a second run only runs the tests."""

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Every supported minor release but the main venv's (scripts/setup_compat.sh's table).
OTHER_RELEASES = ["2.11", "2.12", "2.13", "2.15"]
# Every release runs what differs between releases (the shim on the
# release's FSDP2, the version contracts, ...); with
# HSDP_TEST_EVERY_TORCH_FULL=1 the quick tier too (every case at two ranks,
# on every route: about 2-6 minutes more each on 2 cores).
FULL = os.environ.get("HSDP_TEST_EVERY_TORCH_FULL") == "1"
# {release kind: (pytest's -m, what it passes less a margin: it must not
# shrink unnoticed)}
SUBSETS = {
    "quick tier": ("quick or every_torch", 330),
    "differences": ("every_torch", 85),
}


def subset() -> tuple[str, int]:
    return SUBSETS["quick tier" if FULL else "differences"]


# Set in the compat run, so that the suite run there does not start itself again.
NESTED = "HSDP_COMPAT_RUN"


def tail(text: str, n: int = 6000) -> str:
    return text[-n:]


@pytest.mark.timeout(1500)
@pytest.mark.skipif(bool(os.environ.get(NESTED)), reason="already inside a compat run")
@pytest.mark.parametrize("release", OTHER_RELEASES)
def test_on_every_supported_torch(release):
    setup = subprocess.run(
        ["bash", "scripts/setup_compat.sh", release],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert setup.returncode == 0, (
        f"setup_compat.sh {release} failed:\n{tail(setup.stdout + setup.stderr)}"
    )
    python = setup.stdout.strip().splitlines()[-1]
    version = subprocess.run(
        [python, "-c", "import torch; print(torch.__version__)"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert version.stdout.startswith(release + "."), version.stdout + version.stderr
    marks, min_passed = subset()
    proc = subprocess.run(
        [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", marks, "tests"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, NESTED: "1"},
        timeout=1200,
    )
    out = proc.stdout + proc.stderr
    summary = out.strip().splitlines()[-1] if out.strip() else ""
    assert proc.returncode == 0, f"torch {version.stdout.strip()}: {summary}\n{tail(out)}"
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= min_passed, f"-m {marks!r}: {summary}"
    print(f"torch {version.stdout.strip()}: {summary}")
