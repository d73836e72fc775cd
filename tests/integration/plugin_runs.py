"""How the plugin's tests run a user's pytest: test files written to a directory, a pytest of
the user's own run there (a subprocess, as from a user's shell), each test's outcome read from
its JUnit XML report; the ranks' process ids, written where PIDS_DIR says, show which pool ran
a test and that none outlives its pytest."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import xml.etree.ElementTree as ET
from pathlib import Path


def write_tests(tmp_path: Path, conftest: str = "", **files: str) -> Path:
    d = tmp_path / "user"
    d.mkdir()
    (d / "conftest.py").write_text(conftest)
    for name, text in files.items():
        (d / f"{name}.py").write_text(textwrap.dedent(text))
    (tmp_path / "pids").mkdir()
    return d


def run_pytest(
    d: Path,
    *args: str,
    timeout: float = 400,
    env: dict[str, str] | None = None,
    python: str = sys.executable,
    inherit: bool = True,
) -> tuple[dict, str]:
    """({test name: (outcome, text)}, pytest's output) of ``python``'s pytest run in ``d``
    (``env``: more variables, or all of them where ``inherit`` is false)."""
    report = d / "report.xml"
    base = os.environ if inherit else {}
    env = {**base, "PIDS_DIR": str(d.parent / "pids"), **(env or {})}
    env.pop("PYTEST_ADDOPTS", None)
    proc = subprocess.run(
        [python, "-m", "pytest", "-p", "no:cacheprovider", f"--junitxml={report}", *args],
        cwd=d,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    out = proc.stdout + proc.stderr
    assert report.exists(), out[-4000:]
    results = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = case.get("name")
        outcome, text = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome, text = child.tag, (child.get("message") or "") + "\n" + (child.text or "")
                break
        results[name] = (outcome, text)
    return results, out


def pids(d: Path, tag: str) -> list[int]:
    files = sorted((d.parent / "pids").glob(f"{tag}.rank*"))
    return [int(f.read_text()) for f in files]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for every purpose here.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


# How long ranks may take to go after their pytest did: each rank's watcher polls for its
# pytest every 0.5 s, which a loaded machine may delay by seconds. A bound on a leak, not a speed.
RANKS_GONE_WITHIN_S = 60.0


def all_gone(pid_list: list[int], within_s: float = RANKS_GONE_WITHIN_S) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pid_list):
            return True
        time.sleep(0.2)
    return False


def every_pid(d: Path) -> list[int]:
    return [int(f.read_text()) for f in (d.parent / "pids").iterdir()]
