"""The training suite in its quickest forms: checked losses, paired ratios and comm_stats in its JSON.

``python -m benchmarks training --ranks 2 --quick`` (tiny model, 1-D FSDP, a few rounds) and
``--ranks 4`` (HSDP 2x2), run as docs/benchmarks.md says, from the repository root: every
contender in the JSON, its losses as the suite checked them (hsdp_pool and, on 1-D, hsdp_native
bit-equal to hsdp, gloo within rel 1e-5), every derived number recomputed from the raw per-rank
step times (medians, paired ratios, speedup, overhead), and hsdp's counters of its last step (11
FSDP groups: 11 reduce-scatters; under HSDP the shim's bucketed replicate all-reduces against
hsdp_native's one per group). Also ``python -m benchmarks fsdp_copies --quick``: its rows."""

import json
import pathlib
import statistics

import pytest
from harness import run_module

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONTENDERS = ["hsdp", "gloo", "fake", "hsdp_pool", "hsdp_native"]
STEPS, WARMUP = 6, 2


def run(tmp_path, *args: str, timeout: float = 240) -> tuple[str, dict]:
    out_json = tmp_path / "out.json"
    proc = run_module(*args, "--json", str(out_json), timeout=timeout)
    return proc.stdout, json.loads(out_json.read_text())


def training(tmp_path, world: int) -> tuple[str, dict]:
    flags = ["--quick", "--steps", str(STEPS), "--warmup", str(WARMUP), "--seq-len", "32"]
    stdout, doc = run(
        tmp_path, "benchmarks", "training", "--ranks", str(world), "--timeout", "200", *flags
    )
    assert doc["suite"] == "training" and doc["world"] == world
    [row] = doc["rows"]
    assert (row["model"], row["world"], row["steps"], row["warmup"]) == (
        "tiny",
        world,
        STEPS,
        WARMUP,
    )
    assert row["fsdp_groups"] == 11 and 50_000 < row["params"] < 80_000
    for header in ("hsdp ms", "native/shim", "pool/off", "hsdp/fake", "overhead"):
        assert header in stdout, stdout
    check_times(row, world)
    return stdout, row


def check_times(row: dict, world: int) -> None:
    """Every derived number from the raw step times of every rank and round."""
    rounds = {}
    for c in CONTENDERS:
        per_rank = row[c]["step_ms_per_rank"]
        assert len(per_rank) == world and all(len(ms) == STEPS for ms in per_rank), (c, row[c])
        assert all(ms > 0 for times in per_rank for ms in times), (c, per_rank)
        counted = [r for r in range(WARMUP, STEPS) if c != "hsdp_pool" or r % 2 == 0]
        assert row[c]["counted_rounds"] == counted, c
        medians = [statistics.median(ms[r] for r in counted) for ms in per_rank]
        assert row[c]["per_rank_median_ms"] == pytest.approx(medians), c
        assert row[c]["step_ms"] == pytest.approx(max(medians)), c
        assert row[c]["exposed_ms"] == pytest.approx(row[c]["step_ms"] - row["fake"]["step_ms"])
        rounds[c] = [max(times) for times in zip(*per_rank)]
    h, g, f = (row[c]["step_ms"] for c in ("hsdp", "gloo", "fake"))
    assert row["speedup"] == pytest.approx(g / h)
    assert row["hsdp_over_fake"] == pytest.approx(h / f)
    assert row["overhead_vs_gloo"] == (pytest.approx((h - f) / (g - f)) if g > f else None)
    # native/shim: hsdp_native's step over hsdp's in the same round, every counted round.
    native = [rounds["hsdp_native"][r] / rounds["hsdp"][r] for r in range(WARMUP, STEPS)]
    # pool/off: hsdp_pool on the group's buffers (even round) over FSDP2's own (the next round).
    pool = [rounds["hsdp_pool"][r] / rounds["hsdp_pool"][r + 1] for r in (2, 4)]
    for key, pairs in (("native_over_shim", native), ("pool_over_off", pool)):
        assert row[key] == pytest.approx(statistics.median(pairs)), key
        assert row[f"{key}_pairs"] == len(pairs), key
        q1, q3 = row[f"{key}_quartiles"]
        assert min(pairs) <= q1 <= row[key] <= q3 <= max(pairs), (key, pairs)


def check_losses(row: dict, native_exact: bool) -> None:
    """The losses the suite checked, on every rank."""
    hsdp = row["hsdp"]["final_losses"]
    assert row["hsdp_pool"]["final_losses"] == hsdp  # buffers move no arithmetic
    if native_exact:  # 1-D: the shim leaves FSDP2's reduce-scatter as it is
        assert row["hsdp_native"]["final_losses"] == hsdp
    for c in ("gloo", "hsdp_native"):
        assert row[c]["final_losses"] == pytest.approx(hsdp, rel=1e-5), c


def test_training_fsdp_2_ranks(tmp_path):
    _, row = training(tmp_path, 2)
    assert (row["mesh"], row["mesh_label"]) == ("fsdp_2", "FSDP 2")
    check_losses(row, native_exact=True)
    for key in ("hsdp_comm_stats_last_step", "native_comm_stats_last_step"):
        stats = row[key]["fsdp"]  # the mesh's one group: 11 groups gathered, 11 reduce-scattered
        assert stats["reduce_scatter_tensor"]["calls"] == 11, (key, stats)
        assert stats["all_gather_into_tensor"]["calls"] >= 11, (key, stats)


def test_training_hsdp_2x2(tmp_path):
    _, row = training(tmp_path, 4)
    assert (row["mesh"], row["mesh_label"]) == ("hsdp_2x2", "HSDP 2x2")
    check_losses(row, native_exact=False)
    shim, native = row["hsdp_comm_stats_last_step"], row["native_comm_stats_last_step"]
    for stats in (shim, native):
        assert stats["shard"]["reduce_scatter_tensor"]["calls"] == 11, stats
    # FSDP2's native path all-reduces each group's shard; the shim buckets them.
    assert native["replicate"]["all_reduce"]["calls"] == 11, native
    assert 1 <= shim["replicate"]["all_reduce"]["calls"] < 11, shim


def test_fsdp_copies_quick(tmp_path):
    _, doc = run(tmp_path, "benchmarks", "fsdp_copies", "--quick", "--steps", "2", "--warmup", "1")
    assert [(r["model"], r["comm_buffers"]) for r in doc["rows"]] == [
        ("tiny", "fsdp"),
        ("tiny", "group"),
    ]
    for r in doc["rows"]:
        assert r["step_ms"] > 0 and r["profiled_step_ms"] > 0, r
        assert set(r["share_of_step"]) == {
            "all_gather_copy_in",
            "all_gather_copy_out",
            "reduce_scatter_copy_in",
        }
        assert all(0 < s < 1 for s in r["share_of_step"].values()), r
