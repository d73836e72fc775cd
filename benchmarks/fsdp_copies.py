"""What FSDP2's own copies around its collectives cost per training step on CPU: the all-gather
copy-in (``fsdp::all_gather_copy_in``: the local shards into the all-gather's input), the copy-out
(``FSDP::all_gather_copy_out``: the gathered output into the unsharded parameters) and the
reduce-scatter copy-in (``fsdp::chunk_cat``: the gradients into the reduce-scatter's input), as
shares of the step, measured with torch's profiler on the training suite's models and batches
(1-D FSDP on 2 ranks, hsdp).

    python -m benchmarks fsdp_copies [--models small,tiny] [--steps 8] [--comm-buffers fsdp,group]

on 2 ranks (the launcher's default). Per (model, comm-buffers): rank 0's median unprofiled step, then the profiled
steps' totals of each copy's inclusive CPU time and its share of the profiled steps' wall time.
The profiler's own overhead inflates both sides; the share is what decides whether a persistent
flat shard buffer (no copy-in) is worth having.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.profiler import ProfilerActivity, profile

from benchmarks import common
from benchmarks.training import BATCH_SIZE, MODELS, SEED, SEQ_LEN, WARMUP_STEPS, Contender
from examples.train_fsdp import SyntheticData, shut_down

# Profiler event names (prefixes: FSDP2 appends the module's name).
COPIES = {
    "all_gather_copy_in": "fsdp::all_gather_copy_in",
    "all_gather_copy_out": "FSDP::all_gather_copy_out",
    "reduce_scatter_copy_in": "fsdp::chunk_cat",
}


def profiled(ranks: common.Ranks, model: str, steps: int, warmup: int, comm_buffers: str) -> dict:
    """This rank's unprofiled and profiled steps of ``model`` on ``comm_buffers``."""
    spec = argparse.Namespace(**MODELS[model], seed=SEED)
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu", mesh_dim_names=("shard",))
    net = Contender(mesh, spec, comm_buffers)
    data = SyntheticData(spec.vocab, SEQ_LEN, BATCH_SIZE, SEED, ranks.rank)
    for _ in range(warmup + steps):
        net.step(data.next_batch())
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            net.step(data.next_batch())
    plain, timed = net.ms[warmup:-steps], net.ms[-steps:]
    totals = dict.fromkeys(COPIES, 0.0)
    for event in prof.key_averages():
        for what, prefix in COPIES.items():
            if event.key.startswith(prefix):
                totals[what] += event.cpu_time_total / 1e3  # us -> ms, inclusive
    return {
        "model": model,
        "comm_buffers": comm_buffers,
        "step_ms": statistics.median(plain),
        "profiled_step_ms": statistics.median(timed),
        "copies_ms_per_step": {k: v / steps for k, v in totals.items()},
        "share_of_step": {k: v / sum(timed) for k, v in totals.items()},
    }


def _copy(k: str):
    return lambda r: f"{r['copies_ms_per_step'][k]:.2f} ms ({100 * r['share_of_step'][k]:.1f}%)"


COLUMNS = [
    common.Column("model", lambda r: r["model"]),
    common.Column("buffers", lambda r: r["comm_buffers"]),
    common.Column("step ms", lambda r: r["step_ms"]),
    common.Column("profiled", lambda r: r["profiled_step_ms"]),
    *(common.Column(k, _copy(k)) for k in COPIES),
]


def main() -> None:
    p = common.parser(__doc__, sampling=False)
    p.add_argument("--warmup", type=int, default=None, metavar="N",
                   help="untimed steps first (default %d)" % WARMUP_STEPS)  # fmt: skip
    p.add_argument("--models", metavar="M[,M...]", help="default: small,tiny (--quick: tiny)")
    p.add_argument("--steps", type=int, metavar="N", help="unprofiled, profiled (8, --quick 4)")
    p.add_argument(
        "--comm-buffers", default="fsdp,group", metavar="B[,B...]", help="FSDP2's own, the group's"
    )
    args = p.parse_args()
    if unknown := set(args.comm_buffers.split(",")) - {"fsdp", "group"}:
        p.error(f"--comm-buffers: unknown {sorted(unknown)}; fsdp, group")
    torch.set_flush_denormal(True)
    ranks = common.init(args)
    steps = args.steps or (4 if args.quick else 8)
    warmup = WARMUP_STEPS if args.warmup is None else args.warmup
    models = (args.models or ("tiny" if args.quick else "small,tiny")).split(",")
    rows = [
        profiled(ranks, m, steps, warmup, b) for m in models for b in args.comm_buffers.split(",")
    ]
    common.emit("fsdp_copies", args, ranks, COLUMNS, rows)
    shut_down()


if __name__ == "__main__":
    main()
