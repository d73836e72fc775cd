"""hsdp's own cost per call over the zero-cost inner backend (benchmarks/layer_cost.py), checked,
with gloo and memcpy beside it.

hsdp's own cost per call (benchmarks/layer_cost.py): hsdp over the zero-cost inner backend
against that backend as a group's own, with gloo and memcpy beside them, every contender's
result checked against the exact answer before it is timed, for both sets of inner
capabilities (NCCL's, Gloo's).

`python -m benchmarks.layer_cost` (hsdp's own cost per call over the zero-cost inner backend,
with NCCL's and with Gloo's capabilities): every contender's result checked against the exact
answer, hsdp's own microseconds with their 10th-90th percentiles, gloo and memcpy beside them."""

import json
import pathlib

import pytest
from harness import run_module

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("like", ["nccl", "gloo"])
def test_every_point_names_hsdps_own_cost(tmp_path, like):
    out = tmp_path / "layer.json"
    proc = run_module("benchmarks.layer_cost", "--like", like, "--rounds", "3", "--sample-ms", "0.2",
               "--ops", "all_reduce_async,reduce_scatter", "--json", str(out))  # fmt: skip
    result = json.loads(out.read_text())
    assert result["like"] == like
    rows = result["rows"]
    assert [(r["op"], r["bytes"]) for r in rows] == [
        (op, size) for size in (8, 65536, 1048576) for op in ("all_reduce_async", "reduce_scatter")
    ]
    for r in rows:
        for key in ("hsdp_us", "null_us", "gloo_us"):
            assert r[key] > 0, (key, r)
        assert r["own_p10_us"] <= r["own_us"] <= r["own_p90_us"], r
        assert ("memcpy_us" in r) == (r["op"] == "reduce_scatter"), r
    assert f"caps as {like}'s" in proc.stdout
