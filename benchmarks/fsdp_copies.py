"""What FSDP2's own copies around its collectives cost per training step on
CPU: the all-gather copy-in (``fsdp::all_gather_copy_in``: the local shards
into the all-gather's input), the copy-out (``FSDP::all_gather_copy_out``:
the gathered output into the unsharded parameters) and the reduce-scatter
copy-in (``fsdp::chunk_cat``: the gradients into the reduce-scatter's
input), as shares of the step, measured with torch's profiler on the
training suite's models (examples/train_fsdp.py, 1-D FSDP on 2 ranks, hsdp).

    python -m benchmarks.fsdp_copies [--models small,tiny] [--steps 8] [--comm-buffers fsdp,group]

Per (model, comm-buffers): rank 0's median unprofiled step, then the
profiled steps' totals of each copy's inclusive CPU time and its share of
the profiled steps' wall time. The profiler's own overhead inflates both
sides; the share is what decides whether a persistent flat shard buffer
(no copy-in) is worth having.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from benchmarks.training import BATCH_SIZE, MODELS, SEQ_LEN

# Profiler event names (prefixes: FSDP2 appends the module's name).
COPIES = {
    "all_gather_copy_in": "fsdp::all_gather_copy_in",
    "all_gather_copy_out": "FSDP::all_gather_copy_out",
    "reduce_scatter_copy_in": "fsdp::chunk_cat",
}


def _rank(rank: int, world: int, model: str, steps: int, warmup: int, comm_buffers: str) -> dict:
    import os
    import time

    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    from train_fsdp import SyntheticData, apply_fsdp, build_model, get_parser

    torch.set_flush_denormal(True)
    torch.set_num_threads(1)
    # The training suite's models and batches.
    flags = {**MODELS[model], "seq-len": SEQ_LEN, "batch-size": BATCH_SIZE}
    args = get_parser().parse_args([f"--{k}={v}" for k, v in flags.items()] + ["--backend", "hsdp"])
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    net = build_model(args)
    apply_fsdp(net, mesh, "none", comm_buffers)
    optimizer = torch.optim.AdamW(net.parameters(), lr=args.lr)
    data = SyntheticData(args.vocab, args.seq_len, args.batch_size, args.seed, rank)

    def step() -> float:
        inputs, labels = data.next_batch()
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = F.cross_entropy(net(inputs).flatten(0, 1), labels.flatten(0, 1))
        loss.backward()
        optimizer.step()
        return (time.perf_counter() - start) * 1e3

    for _ in range(warmup):
        step()
    plain = [step() for _ in range(steps)]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        profiled = [step() for _ in range(steps)]
    totals = dict.fromkeys(COPIES, 0.0)
    for event in prof.key_averages():
        for what, prefix in COPIES.items():
            if event.key.startswith(prefix):
                totals[what] += event.cpu_time_total / 1e3  # us -> ms, inclusive
    wall = sum(profiled)
    return {
        "step_ms": statistics.median(plain),
        "profiled_step_ms": statistics.median(profiled),
        "copies_ms_per_step": {k: v / steps for k, v in totals.items()},
        "share_of_step": {k: v / wall for k, v in totals.items()},
    }


def main() -> None:
    from tools.ranks import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="small,tiny")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--comm-buffers", default="fsdp,group")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    results = []
    for model in args.models.split(","):
        for buffers in args.comm_buffers.split(","):
            per_rank = run_ranks(
                _rank,
                2,
                backend="hsdp",
                env={"OMP_NUM_THREADS": "1"},
                timeout_s=600,
                collective_timeout_s=120,
                kwargs=dict(
                    model=model,
                    steps=args.steps,
                    warmup=args.warmup,
                    comm_buffers=buffers,
                ),
            )
            r = {"model": model, "comm_buffers": buffers, **per_rank[0]}
            results.append(r)
            shares = "  ".join(
                f"{k} {r['copies_ms_per_step'][k]:.2f} ms ({100 * r['share_of_step'][k]:.1f}%)"
                for k in COPIES
            )
            print(
                f"{model:>5} buffers={buffers:<5} step {r['step_ms']:.1f} ms "
                f"(profiled {r['profiled_step_ms']:.1f}): {shares}",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
