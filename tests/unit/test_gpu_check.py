"""scripts/gpu_check.sh on a machine without a GPU: one line saying so, exit 0.

scripts/gpu_check.sh on a machine without a GPU: one line saying so, exit
0 (on a machine with GPUs it is the one command that checks the CUDA route;
it cannot run here). The GPU is hidden by an nvidia-smi that lists none, so
this holds on any machine."""

import os
import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_without_a_gpu_it_says_so_and_exits_0(tmp_path):
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\nexit 9\n")  # as on a machine whose driver sees no GPU
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}")
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path / "report.txt")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,  # a deadline, not a timing: generous for a loaded machine
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1 and "no GPU" in lines[0], proc.stdout
    assert not (tmp_path / "report.txt").exists(), "nothing is checked, so no report"


def test_a_bad_number_of_ranks_is_refused_before_anything_runs(tmp_path):
    for bad in (["--ranks"], ["--ranks", "0"], ["--ranks", "two"], ["--ranks", "9"]):
        proc = subprocess.run(
            ["bash", str(ROOT / "scripts" / "gpu_check.sh"), *bad, str(tmp_path / "r.txt")],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,  # a deadline, not a timing: generous for a loaded machine
        )
        assert proc.returncode == 2, (bad, proc.stdout, proc.stderr)
        assert "--ranks takes a number of ranks from 1 to 8" in proc.stderr, (bad, proc.stderr)
