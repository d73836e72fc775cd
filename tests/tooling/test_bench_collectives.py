"""The collectives benchmark (benchmarks/collectives.py under torchrun): every contender checked,
the pool contender on the pooled path, the JSON's ratios its times' quotients, the loaded mode.

Run as the docs say, ``python -m benchmarks collectives`` from the repository root, in its smallest
form; a run past its --timeout, stopped with every process of it; and its exact check on its
own, against a collective that answers right and one that does not, a NaN and a wrong shape."""

import json
import pathlib
import subprocess

import pytest
from harness import run_module

ROOT = pathlib.Path(__file__).resolve().parents[2]


def run_suite(*args: str) -> subprocess.CompletedProcess:
    return run_module("benchmarks", "collectives", "--quick", *args)


def test_every_op_is_checked_timed_and_reported(tmp_path):
    out = tmp_path / "w{world}.json"
    proc = run_suite(
        "--ranks",
        "2",
        "--sizes",
        "64K",
        "--ops",
        "ag,rs,ar,ar_cb",
        "--iters",
        "5",
        "--warmup",
        "1",
        "--json",
        str(out),
        "--csv",
    )
    doc = json.loads((tmp_path / "w2.json").read_text())
    assert doc["suite"] == "collectives" and doc["world"] == 2
    rows = {(r["op"], r["bytes_per_rank"]): r for r in doc["rows"]}
    assert set(rows) == {
        ("all_gather_into_tensor", 65536),
        ("reduce_scatter_tensor", 65536),
        ("all_reduce", 8),
        ("all_reduce", 65536),
        ("all_reduce_callback", 8),
        ("all_reduce_callback", 65536),
    }
    for (op, nbytes), r in rows.items():
        assert r["speedup"] == r["gloo"]["us"] / r["hsdp"]["us"]
        assert r["hsdp"]["reps"] == r["gloo"]["reps"] == 5
        assert len(r["hsdp"]["per_rank_us"]) == 2 and r["hsdp"]["us"] == max(
            r["hsdp"]["per_rank_us"]
        )
        world_bytes = nbytes if op.startswith("all_reduce") else 2 * nbytes
        factor = 1.0 if op.startswith("all_reduce") else 0.5
        assert r["hsdp"]["busbw_gbps"] == pytest.approx(
            factor * world_bytes / r["hsdp"]["us"] / 1e3
        )
        # The pool contender: FSDP2's buffers, the all-gather's output and reduce-scatter's input.
        assert ("hsdp_pool" in r) == (op in ("all_gather_into_tensor", "reduce_scatter_tensor"))
        if "hsdp_pool" in r:
            assert r["pool_gain"] == r["hsdp"]["us"] / r["hsdp_pool"]["us"]
        assert (r["copy_floor_us"] is not None) == op.startswith("all_reduce")
    assert "pool gain" in proc.stdout and "op,size/rank,hsdp us" in proc.stdout  # table, CSV


def test_the_loaded_mode_runs_beside_the_ranks_and_leaves_nothing(tmp_path):
    def spinners() -> set[int]:
        out = subprocess.run(["pgrep", "-f", "while True: pass"], capture_output=True, text=True)
        return {int(p) for p in out.stdout.split()}

    before = spinners()
    proc = run_suite(
        "--ranks",
        "2",
        "--sizes",
        "8",
        "--ops",
        "ar",
        "--load",
        "2",
        "--iters",
        "3",
        "--json",
        str(tmp_path / "loaded.json"),
    )
    assert "loaded mode: 2 CPU-bound processes" in proc.stdout
    assert json.loads((tmp_path / "loaded.json").read_text())["rank_env"]["HSDP_BENCH_LOAD"] == "2"
    assert spinners() <= before, "the load processes outlived the run"


@pytest.mark.parametrize("op", ["all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce"])
def test_the_check_tells_a_right_collective_from_a_wrong_one(op):
    """A world of 2 played by one process: rank 0 with rank 1's contribution computed locally."""
    import torch

    from benchmarks import collectives, common

    ranks = common.Ranks(rank=0, world=2, hsdp=None, gloo=None)
    bufs = collectives.buffers(op, 4, ranks, torch.float32)

    def right():
        if op == "all_gather_into_tensor":
            bufs["out"][4:] = 2  # rank 1 contributes 2s
        elif op == "reduce_scatter_tensor":
            bufs["out"].copy_(bufs["in"][:4] + 2 * bufs["in"][:4])  # rank 1's chunk 0: 2x rank 0's
        else:
            bufs["t"].add_(2)

    assert collectives.check(op, bufs, right, ranks) is None
    problem = collectives.check(
        op, bufs, lambda: (right(), bufs.get("out", bufs.get("t"))[1:2].add_(1)), ranks
    )
    assert problem is not None and "element" in problem


def test_a_run_past_its_timeout_is_stopped_with_every_process_of_it():
    proc = run_module("benchmarks", "collectives", "--ranks", "2", "--sizes", "16M", "--load", "1",
                      "--time-per-point", "60", "--json", "", "--timeout", "10", ok=False)  # fmt: skip
    assert proc.returncode == 124, proc.stdout + proc.stderr[-3000:]
    assert "passed --timeout; stopped" in proc.stderr
    left = subprocess.run(["pgrep", "-f", "benchmarks.collectives|while True: pass"],
                          capture_output=True, text=True).stdout.split()  # fmt: skip
    assert not left, f"processes outlived the run: {left}"


def test_the_check_calls_nan_and_a_wrong_shape_wrong():
    import torch

    from benchmarks import common

    assert common.mismatch(torch.ones(3), torch.ones(3)) is None
    assert "element 1" in common.mismatch(torch.tensor([1.0, float("nan"), 1.0]), torch.ones(3))
    assert "shape" in common.mismatch(torch.ones(2), torch.ones(3))
