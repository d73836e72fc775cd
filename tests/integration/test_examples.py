"""The README's main job: the FSDP2 examples under torchrun, hsdp against gloo, the same losses.

The FSDP2 and HSDP examples on hsdp and gloo, on identical work (same seed, same data), give the
same fp32 losses (read from their `--json` lines); so does the fault-tolerant one (torch 2.14+),
a replica lost at step 3 and the other going on at world size 2. Every `--json` line is one JSON
object per step with loss, step_ms, fwd_bwd_ms, tokens_per_s and, on hsdp, each group's
counters; without `--json` the readable per-step line."""

import functools
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch.distributed as dist

ROOT = pathlib.Path(__file__).resolve().parents[2]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
STEP_KEYS = {"step", "loss", "step_ms", "fwd_bwd_ms", "tokens_per_s"}


def run_example(script: str, nproc: int, backend: str, *extra: str) -> str:
    """The example's stdout (rank 0's)."""
    cmd = [
        *TORCHRUN,
        f"--nproc-per-node={nproc}",
        # torchrun's agent binds its store on a port of its own choosing (port 0).
        "--standalone",
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
    return proc.stdout


@functools.cache  # a run serves every test that reads it
def train(script: str, nproc: int, backend: str) -> list[dict]:
    """Per-step objects of a --json run; every stdout line must be one."""
    out = run_example(script, nproc, backend, "--json")
    steps = [json.loads(line) for line in out.splitlines()]
    for s in steps:
        assert STEP_KEYS <= s.keys(), s
        assert ("comm_stats" in s) == (backend == "hsdp"), s
    assert [s["step"] for s in steps] == [1, 2, 3, 4], out
    return steps


@pytest.mark.parametrize(
    "script,nproc",
    [("train_fsdp.py", 2), ("train_hsdp.py", 4)],
)
def test_example_matches_gloo(script, nproc):
    hsdp = [s["loss"] for s in train(script, nproc, "hsdp")]
    gloo = [s["loss"] for s in train(script, nproc, "gloo")]
    assert len(hsdp) == len(gloo) >= 4
    assert hsdp[-1] < hsdp[0], f"loss did not decrease: {hsdp}"
    for a, b in zip(hsdp, gloo):
        assert a == pytest.approx(b, rel=1e-5), (hsdp, gloo)


@pytest.mark.every_torch
@pytest.mark.skipif(
    not hasattr(dist, "_reconfigure"), reason="torch before 2.14 has no reconfigure"
)
def test_a_lost_replica_is_dropped_and_training_goes_on_as_on_gloo():
    """train_hsdp_ft.py: replica 0 (ranks 0 and 1, torchrun's rank 0 among them) leaves at step 3;
    the other replica reconfigures the group, rebuilds its mesh and model from its own shards and
    takes step 3 again, renumbered 0 and 1, with gloo's losses."""
    runs = {}
    for backend in ("hsdp", "gloo"):
        out = run_example(
            "train_hsdp_ft.py", 4, backend, "--steps", "5", "--lose-replica-at", "3",
            "--lose-replica", "0",
        )  # fmt: skip
        runs[backend] = [json.loads(line) for line in out.splitlines()]
    hsdp, gloo = runs["hsdp"], runs["gloo"]
    assert [(s["step"], s["world"]) for s in hsdp] == [(1, 4), (2, 4), (3, 2), (4, 2), (5, 2)]
    assert [(s["step"], s["world"]) for s in gloo] == [(s["step"], s["world"]) for s in hsdp]
    for a, b in zip(hsdp, gloo):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (hsdp, gloo)
    assert hsdp[-1]["loss"] < hsdp[2]["loss"], f"the survivors' loss did not decrease: {hsdp}"


def test_json_lines_carry_the_metrics_and_counters():
    steps = train("train_hsdp.py", 4, "hsdp")
    for s in steps:
        assert s["step_ms"] >= s["fwd_bwd_ms"] > 0 and s["tokens_per_s"] > 0, s
        # One shard and one replicate group per rank, each with its ops' counters.
        assert set(s["comm_stats"]) == {"shard", "replicate"}, s
        shard = s["comm_stats"]["shard"]
        assert shard["all_gather_into_tensor"]["calls"] > 0, s
        assert shard["reduce_scatter_tensor"]["calls"] > 0, s
        for counters in (*shard.values(), *s["comm_stats"]["replicate"].values()):
            assert set(counters) == {"calls", "collectives", "bytes"}, s


def test_readable_line_without_json():
    out = run_example("train_fsdp.py", 2, "hsdp")
    step_lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(step_lines) == 4, out
    assert " ms  fwd+bwd " in step_lines[0] and "tok/s  ag=" in step_lines[0], out
    assert "final loss " in out, out


def test_the_model_computes_where_its_parameters_are():
    """The rotary tables are built on the activations' device: a model moved
    off the CPU (here to the meta device, which checks devices as CUDA does
    and needs no GPU) runs its forward there. Built on the CPU, they met
    CUDA activations in apply_rotary ("Expected all tensors to be on the
    same device") and the example could not train with --device cuda."""
    import argparse

    import torch

    from examples import train_fsdp

    args = argparse.Namespace(dim=16, layers=1, heads=2, vocab=32, seq_len=8, seed=0)
    model = train_fsdp.build_model(args).to("meta")
    logits = model(torch.zeros(2, 8, dtype=torch.long, device="meta"))
    assert logits.device.type == "meta" and tuple(logits.shape) == (2, 8, 32)
