"""The collectives suite's pool-buffer contender: all-gather and reduce-scatter only, checked, with
its gain.

The collectives suite's third contender, hsdp on pool buffers
(allocate_tensor): measured for all-gather and reduce-scatter only, checked
once against the exact answer, every timed call on the pooled path (the
suite raises otherwise), and its gain over hsdp on ordinary buffers reported."""

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_collectives_suite_measures_pool_buffers(tmp_path):
    out_json = tmp_path / "bench.json"
    cmd = [
        sys.executable,
        "-m",
        "benchmarks",
        "collectives",
        "--quick",
        "--ranks",
        "2",
        "--sizes",
        "64K",
        "--ops",
        "ag,rs,ar",
        "--iters",
        "5",
        "--warmup",
        "1",
        "--json",
        str(out_json),
        "--plot",
        "",
    ]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=180, cwd=ROOT, env=dict(os.environ)
    )
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-4000:]}"
    assert "pool gain" in proc.stdout
    rows = json.loads(out_json.read_text())["collectives"]["results"]
    by_op = {(r["op"], r["bytes_per_rank"]): r for r in rows}
    for op in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        r = by_op[(op, 65536)]
        assert r["hsdp_pool"]["us"] > 0 and r["hsdp_pool"]["busbw_gbps"] > 0, r
        assert r["pool_gain"] == r["hsdp"]["us"] / r["hsdp_pool"]["us"]
    assert "hsdp_pool" not in by_op[("all_reduce", 65536)]
