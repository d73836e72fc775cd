"""The README's main job: the FSDP2 examples under torchrun, hsdp against
gloo on identical work (same seed, same data). fp32 losses must agree."""

import os
import pathlib
import re
import subprocess
import sys

import pytest
from harness import free_port

ROOT = pathlib.Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def train(script: str, nproc: int, backend: str, *extra: str) -> list[float]:
    cmd = [
        *TORCHRUN,
        f"--nproc-per-node={nproc}",
        f"--master-port={free_port()}",
        str(ROOT / "examples" / script),
        "--backend",
        backend,
        "--steps",
        "4",
        "--dim",
        "64",
        "--layers",
        "2",
        "--seq-len",
        "32",
        *extra,
    ]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT / "examples",
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    losses = [float(x) for x in re.findall(r"loss ([0-9.]+)", proc.stdout)]
    assert re.search(r"final loss [0-9.]+", proc.stdout), proc.stdout
    return losses


@pytest.mark.parametrize(
    "script,nproc",
    [("train_fsdp.py", 2), ("train_hsdp.py", 4)],
)
def test_example_matches_gloo(script, nproc):
    hsdp = train(script, nproc, "hsdp")
    gloo = train(script, nproc, "gloo")
    assert len(hsdp) == len(gloo) >= 4
    assert hsdp[-1] < hsdp[0], f"loss did not decrease: {hsdp}"
    for a, b in zip(hsdp, gloo):
        assert a == pytest.approx(b, rel=1e-5), (hsdp, gloo)
