"""The device per-call suite (benchmarks/device_calls.py) in its CPU form: hsdp against gloo, every
point checked.

The device per-call suite (benchmarks/device_calls.py) on the CPU it can run on here: hsdp
against gloo in the same ranks, every point checked against the plain backend's result, both
metrics measured for both contenders. On a machine with GPUs the same code runs against nccl
(scripts/gpu_check.sh); `--device cuda` without one is refused, saying why.

`python -m benchmarks device_calls --device cpu` (hsdp against gloo, the suite's CPU form):
every point checked against the plain backend's result, host and synchronized time for both
contenders, their ratios; `--device cuda` without a GPU refused, saying why."""

import json
import os
import pathlib
import subprocess
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]


def bench(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks", "device_calls", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=dict(os.environ),
    )


def test_cpu_run_measures_both_contenders_on_every_point(tmp_path):
    out_json = tmp_path / "bench.json"
    proc = bench(
        "--device", "cpu", "--quick", "--sizes", "8,64K", "--ops", "all_reduce_avg,rs_coalesced16",
        "--iters", "3", "--warmup", "1", "--json", str(out_json), "--plot", "",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    section = json.loads(out_json.read_text())["device_calls"]
    assert (section["device"], section["plain"], section["world"]) == ("cpu", "gloo", 2)
    rows = section["rows"]
    assert [(r["op"], r["bytes"]) for r in rows] == [
        ("all_reduce_avg", 8),
        ("rs_coalesced16", 8),
        ("all_reduce_avg", 65536),
        ("rs_coalesced16", 65536),
    ]
    for r in rows:
        for key in ("hsdp_host_us", "plain_host_us", "hsdp_sync_us", "plain_sync_us"):
            assert r[key] > 0, (key, r)
        assert r["host_ratio"] == r["hsdp_host_us"] / r["plain_host_us"]
    assert "ratio: hsdp / plain" in proc.stdout


def test_cuda_without_a_gpu_is_refused_saying_why():
    if torch.cuda.is_available():
        return  # this machine has one: the refusal cannot happen here
    proc = bench("--device", "cuda", "--quick", timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "torch sees no GPU on this machine" in proc.stderr
