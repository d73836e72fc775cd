"""The engine's step protocol, model-checked: csrc/shm/protocol.pml (next to
Engine.hpp) checked by spin through scripts/check_protocol.sh: safe and
deadlock-free, and every broken rule caught (so the assertions bite)."""

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.timeout(600)
def test_step_protocol_model_checks():
    assert shutil.which("spin"), "spin missing: run scripts/setup.sh (installs Debian's spin)"
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "check_protocol.sh")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=580,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-8000:]
    lines = [line for line in out.splitlines() if line.startswith("[protocol]")]
    # 5 safe runs (2 with pooled calls), 6 broken rules caught (2 of the pool).
    assert len(lines) == 11, out
    assert sum("safe, no deadlock" in line for line in lines) == 5, out
    assert sum("violation found" in line for line in lines) == 6, out
    assert sum("-DPOOL" in line for line in lines) == 4, out
