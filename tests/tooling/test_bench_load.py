"""The benchmarks' loaded mode (`--load N`): the load runs for the whole run, is recorded and
leaves nothing behind.

The benchmarks' loaded mode: ``--load N`` runs N CPU-bound processes
beside the ranks for the whole run, records it, and leaves none behind."""

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def spinners() -> set[int]:
    out = subprocess.run(["pgrep", "-f", "while True: pass"], capture_output=True, text=True)
    return {int(p) for p in out.stdout.split()}


def test_loaded_collectives_run(tmp_path):
    before = spinners()
    out_json = tmp_path / "loaded.json"
    cmd = [
        sys.executable,
        "-m",
        "benchmarks",
        "collectives",
        "--quick",
        "--ranks",
        "2",
        "--sizes",
        "8",
        "--ops",
        "all_reduce",
        "--load",
        "2",
        "--json",
        str(out_json),
        "--plot",
        "",
    ]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=180, cwd=ROOT, env=dict(os.environ)
    )
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-4000:]}"
    assert "loaded mode: 2 CPU-bound processes" in proc.stdout
    doc = json.loads(out_json.read_text())
    assert doc["machine"]["load_processes"] == 2
    assert spinners() <= before, "the load processes outlived the run"
