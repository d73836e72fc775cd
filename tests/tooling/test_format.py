"""The tree is formatted: clang-format for C++, ruff for Python.

The tree is formatted: clang-format (.clang-format) for C++, ruff
(pyproject.toml) for Python. A change that drifts fails here; fix it with
``bash scripts/format.sh``."""

import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_tree_is_formatted():
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "format.sh"), "--check"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
