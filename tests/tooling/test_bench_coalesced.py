"""The coalesced suite in its smallest form: every variant checked exactly, one hsdp collective per
fused call, ratios consistent with the times.

`python -m benchmarks coalesced --ranks 2 --dim 16 --iters 2` (the 200 shards of a width-16
transformer on 2 ranks, all-gathered and reduce-scattered three ways: gloo per tensor, gloo
coalesced, hsdp fused): the run passes its exact checks; the JSON has both ops with 200 tensors,
times for every variant, a/c and b/c equal to the times' quotients, and hsdp's comm_stats count
one collective per timed fused call."""

import json
import pathlib

import pytest
from harness import run_module

ROOT = pathlib.Path(__file__).resolve().parents[2]
VARIANTS = ("gloo_per_tensor", "gloo_coalesced", "hsdp_fused")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_coalesced_smallest_form(tmp_path, dtype):
    out_json = tmp_path / "coalesced.json"
    proc = run_module(
        "benchmarks", "coalesced", "--ranks", "2", "--timeout", "200",
        "--dim", "16", "--dtype", dtype, "--iters", "2", "--warmup", "1", "--json", str(out_json),
    )  # fmt: skip
    doc = json.loads(out_json.read_text())
    assert (doc["suite"], doc["world"], doc["dim"], doc["dtype"]) == ("coalesced", 2, 16, dtype)
    rows = doc["rows"]
    assert [r["op"] for r in rows] == ["all_gather_into_tensor", "reduce_scatter_tensor"]
    for r in rows:
        assert r["tensors"] == 200
        us = {v: r[v]["us"] for v in VARIANTS}
        assert all(t > 0 for t in us.values()), us
        assert r["a_over_c"] == us["gloo_per_tensor"] / us["hsdp_fused"]
        assert r["b_over_c"] == us["gloo_coalesced"] / us["hsdp_fused"]
        # Every timed fused call (warm-up included) was one collective of hsdp's.
        fused = r["hsdp_fused"]["reps"] * r["hsdp_fused"]["calls_per_sample"]
        assert r["hsdp_fused_calls"] >= fused >= 2
        sent = sum(s["collectives"] for s in r["hsdp_comm_stats"].values())
        assert sent == r["hsdp_fused_calls"], r["hsdp_comm_stats"]
        assert r["hsdp_collectives_per_call"] == 1
    assert "hsdp coll/call" in proc.stdout
