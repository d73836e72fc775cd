"""The numerics suite on 2 ranks, --quick: hsdp's AVG within half an ulp of the fp64 mean and never
worse than gloo, every error finite.

`python -m benchmarks numerics --ranks 2 --quick` (bf16 and fp16 AVG all_reduce and
reduce_scatter_tensor against the fp64 mean of the inputs, hsdp and gloo): four rows, each with
finite ulp errors over every rank's output, hsdp's max within 0.5 ulp (+ the fp32 division's slack)
and at or below gloo's, no non-zero result where the reference is exactly zero; the row's flags
and the summary agree with the numbers."""

import json
import math
import pathlib

from harness import run_module

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_numerics_quick(tmp_path):
    out_json = tmp_path / "numerics.json"
    run_module("benchmarks", "numerics", "--ranks", "2", "--quick", "--timeout", "200",
                      "--json", str(out_json))  # fmt: skip
    doc = json.loads(out_json.read_text())
    assert (doc["suite"], doc["world"]) == ("numerics", 2)
    numel = doc["numel_out_per_rank"]
    assert numel == {"all_reduce": 64 * 1024, "reduce_scatter_tensor": 16 * 1024}
    slack = doc["half_ulp_slack"]
    rows = doc["rows"]
    assert [(r["dtype"], r["op"]) for r in rows] == [
        (d, op) for d in ("bfloat16", "float16") for op in ("all_reduce", "reduce_scatter_tensor")
    ]
    for r in rows:
        h, g = r["hsdp"], r["gloo"]
        assert h["reduction"] == "AVG"
        for stats in (h, g):
            assert math.isfinite(stats["max_ulp"]) and math.isfinite(stats["mean_ulp"]), r
            assert 0 <= stats["mean_ulp"] <= stats["max_ulp"], r
            # Every rank's output elements: the ones with a reference and the zeros.
            assert stats["elements"] + stats["zero_refs"] == 2 * numel[r["op"]], r
        assert h["max_ulp"] <= 0.5 + slack and h["nonzero_at_zero_refs"] == 0, r
        assert h["max_ulp"] <= g["max_ulp"] and h["mean_ulp"] <= g["mean_ulp"], r
        assert r["hsdp_within_half_ulp"] and r["hsdp_max_le_gloo"] and r["hsdp_mean_le_gloo"]
    assert all(doc["everywhere"].values()), doc["everywhere"]
