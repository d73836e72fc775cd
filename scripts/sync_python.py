"""Copies a package's Python files over its installed copy (scripts/venv_steps.sh).

Run by the venv's python: `python scripts/sync_python.py src/hsdp_backend src/pytest_hsdp`
(the first package is the one with the extension). Only when the
installed copy has exactly the source's Python files (same relative paths) and its extension
imports; otherwise it exits 1 and the caller rebuilds the package, so a module added or removed
never leaves a stale file behind or a missing one out. Never imports the package itself.
"""

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path


def python_files(root: Path) -> set[Path]:
    return {p.relative_to(root) for p in root.rglob("*.py") if "__pycache__" not in p.parts}


def main(source: str) -> int:
    source_root = Path(source)
    spec = importlib.util.find_spec(source_root.name)
    if spec is None or not spec.submodule_search_locations:
        return 1
    installed_root = Path(next(iter(spec.submodule_search_locations)))
    if installed_root.resolve() == source_root.resolve():
        return 1  # an editable install: nothing to copy, and nothing to trust
    files = python_files(source_root)
    if files != python_files(installed_root):
        return 1
    for rel in sorted(files):
        # copyfile, not copy2: a fresh mtime, so no stale bytecode can match it.
        shutil.copyfile(source_root / rel, installed_root / rel)
    return 0


if __name__ == "__main__":
    # Any package that cannot be copied makes the caller rebuild, which installs them all.
    if any([main(source) for source in sys.argv[1:]]):
        sys.exit(1)
    # The first package carries the extension; the others must import beside it.
    first, *others = (Path(source).name for source in sys.argv[1:])
    modules = ", ".join([f"{first}._C", *others])
    check = subprocess.run(
        [sys.executable, "-c", f"import {modules}"], cwd="/tmp", capture_output=True
    )
    sys.exit(check.returncode)
