"""The device per-call suite (benchmarks/device_calls.py) in its CPU form: hsdp against gloo, every
point checked.

`python -m benchmarks device_calls --device cpu --ranks 2` (hsdp against gloo in the same ranks,
the suite's CPU form): every point checked against the exact answer before it is timed, host and
synchronized time for both contenders and their ratios in the JSON; on a machine with GPUs the
same script runs against nccl (scripts/gpu_check.sh). `--device cuda` without one is refused,
saying why."""

import json
import pathlib
import subprocess

import torch
from harness import run_module

ROOT = pathlib.Path(__file__).resolve().parents[2]


def bench(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return run_module(
        "benchmarks", "device_calls", "--ranks", "2", *args, timeout=timeout, ok=False
    )


def test_cpu_run_measures_both_contenders_on_every_point(tmp_path):
    out_json = tmp_path / "bench.json"
    proc = bench(
        "--device", "cpu", "--quick", "--sizes", "8,64K", "--ops", "all_reduce_avg,rs_coalesced16",
        "--iters", "3", "--warmup", "1", "--timeout", "200", "--json", str(out_json),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out_json.read_text())
    assert (doc["suite"], doc["device"], doc["plain"], doc["world"]) == (
        "device_calls", "cpu", "gloo", 2,
    )  # fmt: skip
    rows = doc["rows"]
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
        assert r["sync_ratio"] == r["hsdp_sync_us"] / r["plain_sync_us"]
    worst = max(max(r["host_ratio"], r["sync_ratio"]) for r in rows)
    assert f"largest ratio: {worst:.3f}" in proc.stdout  # what scripts/gpu_check.sh greps
    assert "ratio: hsdp / plain" in proc.stdout


def test_cuda_without_a_gpu_is_refused_saying_why():
    if torch.cuda.is_available():
        return  # this machine has one: the refusal cannot happen here
    proc = bench("--device", "cuda", "--quick", "--timeout", "60", timeout=90)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "--device cuda: torch sees no GPU on this machine" in proc.stderr
