"""docs/testing.md states the suite's size once, as the number of tests pytest collects.

docs/testing.md is the one place that states the suite's size: the count
it gives is the number of tests pytest collects, so it cannot drift."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_testing_md_states_the_number_of_tests_pytest_collects():
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    collected = re.search(r"^(\d+) tests? collected", proc.stdout, re.M)
    assert collected, proc.stdout[-2000:] + proc.stderr[-2000:]
    stated = re.findall(r"\*\*(\d+) tests\*\*", (ROOT / "docs" / "testing.md").read_text())
    assert len(stated) == 1, "docs/testing.md must state the suite's size once, as **N tests**"
    assert int(stated[0]) == int(collected.group(1)), (
        f"docs/testing.md states {stated[0]} tests; pytest collects {collected.group(1)}"
    )
