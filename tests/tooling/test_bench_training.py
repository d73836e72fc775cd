"""The benchmark's training suite in its quickest form: planned interleaving, consistent JSON,
equal losses.

The benchmark's ``training`` suite in its quickest form: the tiny model, 2
ranks (FSDP) against its baseline (two 1-rank copies at once), 4 steps per
run, one run per backend. Run as docs/benchmarks.md says: ``python -m benchmarks``
from the repository root (the installed hsdp_backend is imported).

`python -m benchmarks training --quick` on 2 ranks, tiny model: the runs interleaved as planned
(hsdp with `--comm-buffers alternate` and `--fsdp-shim alternate` among them, paired step by
step, with the same final loss as hsdp), the JSON's
derived numbers consistent, equal final losses on both backends, hsdp's counters of the last
step, the PNG written."""

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_training_suite_quick(tmp_path):
    out_json = tmp_path / "training.json"
    cmd = [
        sys.executable,
        "-m",
        "benchmarks",
        "training",
        "--quick",
        "--ranks",
        "2",
        "--models",
        "tiny",
        "--steps",
        "4",
        "--warmup",
        "1",
        "--seq-len",
        "32",
        "--timeout",
        "150",
        "--json",
        str(out_json),
        "--plot",
        str(tmp_path / "training.png"),
    ]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert "gloo/hsdp exp" in proc.stdout, proc.stdout
    assert (tmp_path / "training.png").stat().st_size > 0

    doc = json.loads(out_json.read_text())
    assert doc["suite"] == "training"
    section = doc["training"]
    assert section["models"]["tiny"]["fsdp_groups"] == 11
    assert 50_000 < section["models"]["tiny"]["params"] < 80_000

    # Six runs, interleaved: the baseline (two 1-rank copies), then hsdp,
    # gloo, the fake backend (the no-communication limit), hsdp with
    # FSDP2's buffers from the group on every other step (--comm-buffers
    # alternate) and hsdp with its FSDP2 shim on every other step (--fsdp-shim
    # alternate) on 2 ranks.
    runs = section["runs"]
    assert [(r["world"], r["copies"], r["backend"]) for r in runs] == [
        (1, 2, "gloo"),
        (2, 1, "hsdp"),
        (2, 1, "gloo"),
        (2, 1, "fake"),
        (2, 1, "hsdp_pool"),
        (2, 1, "hsdp_native"),
    ]
    by_backend = {r["backend"]: r for r in runs[1:]}
    pool_cmd = by_backend["hsdp_pool"]["command"]
    native_cmd = by_backend["hsdp_native"]["command"]
    assert native_cmd[native_cmd.index("--fsdp-shim") + 1] == "alternate"
    assert "--fsdp-shim" not in runs[1]["command"]
    assert pool_cmd[pool_cmd.index("--comm-buffers") + 1] == "alternate"
    assert "--comm-buffers" not in runs[1]["command"]
    assert all("--flush-denormal" in r["command"] for r in runs)
    for r in (r for r in runs if r["backend"] not in ("hsdp_pool", "hsdp_native")):
        assert r["max_rss_mib"] > 0, r
        assert len(r["step_ms"]) == 4 and len(r["measured_ms"]) == 3 * r["copies"]
        assert r["comm_buffers"] == ["default"] * 4
    for r in runs:
        assert all(0 < f <= s for f, s in zip(r["fwd_bwd_ms"], r["step_ms"])), r
    # The pool run: steps 2-4 measured (one warm-up step); step 3 on the
    # group's buffers is the contender's sample, paired with step 4.
    pool = by_backend["hsdp_pool"]
    assert pool["comm_buffers"] == ["group", "fsdp", "group", "fsdp"]
    assert pool["measured_ms"] == [pool["step_ms"][2]]
    assert pool["pairs"] == [pool["step_ms"][2] / pool["step_ms"][3]]
    # The native run: two steps each way; the first after a switch (steps 3
    # and 5) settles. Step 4 without the shim is its sample; over step 6
    # through the shim, the one pair.
    native = by_backend["hsdp_native"]
    assert native["fsdp_shim"] == ["on", "on", "off", "off", "on", "on"]
    assert native["measured_ms"] == [native["step_ms"][3]]
    assert native["pairs"] == [native["step_ms"][3] / native["step_ms"][5]]
    assert by_backend["hsdp"]["fsdp_shim"] == ["on"] * 4
    assert by_backend["gloo"]["fsdp_shim"] == ["off"] * 4

    [row] = section["results"]
    assert (row["mesh"], row["world"], row["model"]) == ("fsdp_2", 2, "tiny")
    for key in ("baseline", "hsdp", "gloo", "fake", "hsdp_pool", "hsdp_native"):
        for ms in (row[key]["step_ms"], row[key]["fwd_bwd_ms"]):
            assert math.isfinite(ms) and ms > 0, (key, row)
    for b in ("hsdp", "gloo"):
        assert row[b]["exposed_ms"] == pytest.approx(
            row[b]["fwd_bwd_ms"] - row["baseline"]["fwd_bwd_ms"]
        )
        assert row[b]["comm_share"] == pytest.approx(row[b]["exposed_ms"] / row[b]["step_ms"])
    assert row["speedup"] == pytest.approx(row["gloo"]["step_ms"] / row["hsdp"]["step_ms"])
    assert "exposed_ratio_gloo_over_hsdp" in row
    h, g, f = (row[b]["step_ms"] for b in ("hsdp", "gloo", "fake"))
    assert row["hsdp_over_fake"] == pytest.approx(h / f)
    if g > f:
        assert row["overhead_vs_gloo"] == pytest.approx((h - f) / (g - f))
    assert [v["mesh"] for v in section["verdicts"]] == ["fsdp_2"]
    assert "hsdp/fake" in proc.stdout and "overhead" in proc.stdout
    # Same work on both backends: fp32 losses agree.
    assert row["hsdp"]["final_loss"] == pytest.approx(row["gloo"]["final_loss"], rel=1e-5)
    # Pool buffers change where bytes live, not the arithmetic.
    assert row["hsdp_pool"]["final_loss"] == row["hsdp"]["final_loss"]
    assert row["pool_over_off"] == pytest.approx(pool["step_ms"][2] / pool["step_ms"][3])
    assert row["pool_over_off_pairs"] == 1
    # 1-D FSDP: the shim leaves FSDP2's reduction as it is, so the same bits.
    # (The native run's step 4: it runs 6 steps.)
    assert native["losses"][3] == row["hsdp"]["final_loss"]
    assert row["native_over_shim"] == pytest.approx(native["step_ms"][3] / native["step_ms"][5])
    assert row["native_over_shim_per_run"] == [row["native_over_shim"]]
    assert "native/shim" in proc.stdout
    assert "pool/off" in proc.stdout
    # hsdp's comm stats of the last step: 11 groups gathered, 11 reduce-scattered.
    stats = row["hsdp_comm_stats_last_step"]["fsdp"]
    assert stats["all_gather_into_tensor"]["calls"] >= 11, row
    assert stats["reduce_scatter_tensor"]["calls"] == 11, row
