"""hsdp against gloo on groups that span hosts, on simulated hosts
(tools/simhosts.py: 2 hosts x 2 ranks, a network and mount namespace per
host, joined by veths on a bridge).

    python benchmarks/hosts.py [--quick] [--json FILE]

Collectives: all-gather, reduce-scatter and all-reduce over the 4-rank group
at 64 KiB, 1 MiB and 16 MiB per rank; hsdp (hierarchical: shared memory
within hosts, gloo between them) and a gloo group over the same ranks run
alternately in the same launch, one repetition each in turn. A repetition's
time is the slowest rank's. Training: examples/train_fsdp.py's model, FSDP2
1-D over the 4 ranks and HSDP (replicate across hosts, shard within), one
launch per backend, alternating, and the same on torch's fake backend (no
communication at all: the zero-cost-network limit of the same ranks on the
same cores). Reported: medians, the range over repetitions (JSON), gloo /
hsdp (above 1: hsdp is faster), hsdp / fake and hsdp's overhead above the
limit as a fraction of gloo's.

The "network" is a veth on one machine: as fast as loopback and sharing the
same cores, so a real cluster's links will change every number. Needs root.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import pickle
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
SIZES = [64 << 10, 1 << 20, 16 << 20]
OPS = ["all_gather", "reduce_scatter", "all_reduce"]


# ---------------------------------------------------------------- in a rank


def _collectives(out: pathlib.Path, reps: int) -> dict:
    import torch
    import torch.distributed as dist

    import hsdp_backend

    world = dist.get_world_size()
    groups = {"hsdp": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    assert hsdp_backend.cpu_engine() == "hierarchical", hsdp_backend.cpu_engine()
    times: dict = {}
    for size in SIZES:
        n = size // 4
        shard = torch.ones(n)
        full = torch.ones(world * n)
        for op in OPS:

            def run(group, op=op):
                if op == "all_gather":
                    dist.all_gather_into_tensor(full, shard, group=group)
                elif op == "reduce_scatter":
                    dist.reduce_scatter_tensor(shard, full, group=group)
                else:
                    dist.all_reduce(shard, group=group)

            for backend, group in groups.items():  # warm-up, and one check of each
                shard.fill_(1.0)
                full.fill_(1.0)
                run(group)
                expected = {
                    "all_gather": 1.0,
                    "reduce_scatter": float(world),
                    "all_reduce": float(world),
                }[op]
                got = (full if op == "all_gather" else shard)[0].item()
                assert got == expected, (backend, op, size, got)
            for _ in range(reps):
                for backend, group in groups.items():
                    dist.barrier(group=groups["gloo"])
                    start = time.perf_counter()
                    run(group)
                    times.setdefault((op, size, backend), []).append(time.perf_counter() - start)
    return times


def _training(out: pathlib.Path, mesh_kind: str, steps: int) -> list:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    sys.path.insert(0, str(ROOT / "examples"))
    import train_fsdp

    backend = dist.get_backend()
    args = train_fsdp.get_parser().parse_args(["--backend", backend, "--steps", str(steps)])
    world = dist.get_world_size()
    if mesh_kind == "fsdp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
        groups = {"fsdp": mesh.get_group("fsdp")}
    else:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        groups = {n: mesh.get_group(n) for n in ("replicate", "shard")}
    return train_fsdp.train(args, mesh, groups)


def rank_main(job: str, out: str, *args: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    import hsdp_backend  # noqa: F401  registers "hsdp"

    torch.set_num_threads(1)
    # Every run alike: a fake all-gather leaves garbage in parameters, and
    # denormals in it must not slow the arithmetic of that run alone.
    torch.set_flush_denormal(True)
    backend = args[0]
    if backend == "fake":
        # torch's fake backend: every rank does all of FSDP2's own work and
        # no communication, the zero-cost-network limit of the same ranks.
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group(
            "fake",
            store=FakeStore(),
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
        )
    else:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=300))
    out_dir = pathlib.Path(out)
    if job == "collectives":
        result = _collectives(out_dir, int(args[1]))
    else:
        result = _training(out_dir, args[1], int(args[2]))
    (out_dir / f"{job}.{dist.get_rank()}.pkl").write_bytes(pickle.dumps(result))
    dist.destroy_process_group()
    import gc

    gc.collect()  # see examples/train_fsdp.py's shut_down


# ---------------------------------------------------------------- driver


def _launch(out: pathlib.Path, *args: str, timeout_s: float = 1800) -> list:
    sys.path.insert(0, str(ROOT / "tools"))
    import simhosts

    out.mkdir(parents=True, exist_ok=True)
    with simhosts.SimHosts(2) as hosts:
        procs = [
            hosts.torchrun(h, 2, [__file__, "--rank", args[0], str(out), *args[1:]])
            for h in range(2)
        ]
        codes = simhosts.wait_all(procs, timeout_s)
    if codes != [0, 0]:
        raise RuntimeError(f"benchmark launch {args} failed: torchrun exit codes {codes}")
    return [pickle.loads((out / f"{args[0]}.{r}.pkl").read_bytes()) for r in range(4)]


def _summary(samples_s: list[float]) -> dict:
    ms = [s * 1e3 for s in samples_s]
    return {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms), "n": len(ms)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and steps")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--rank", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        rank_main(*args.rank)
        return 0
    import tempfile

    reps = 5 if args.quick else 20
    steps = 6 if args.quick else 12
    launches = 1 if args.quick else 2
    work = pathlib.Path(tempfile.mkdtemp(prefix="hsdp-bench-hosts-"))
    report: dict = {
        "setup": "2 simulated hosts x 2 ranks (veth on one machine), fp32",
        "collectives": [],
        "training": [],
    }

    per_rank = _launch(work / "coll", "collectives", "hsdp", str(reps))
    print(
        f"{'op':<16}{'bytes/rank':>11}{'hsdp ms':>10}{'gloo ms':>10}{'gloo/hsdp':>11}   (median; range)"
    )
    for op in OPS:
        for size in SIZES:
            row = {"op": op, "bytes_per_rank": size}
            for backend in ("hsdp", "gloo"):
                slowest = [max(r[(op, size, backend)][i] for r in per_rank) for i in range(reps)]
                row[backend] = _summary(slowest)
            row["gloo_over_hsdp"] = row["gloo"]["median_ms"] / row["hsdp"]["median_ms"]
            report["collectives"].append(row)
            print(
                f"{op:<16}{size:>11}{row['hsdp']['median_ms']:>10.2f}{row['gloo']['median_ms']:>10.2f}"
                f"{row['gloo_over_hsdp']:>10.2f}x   ({row['hsdp']['min_ms']:.2f}-{row['hsdp']['max_ms']:.2f}; "
                f"{row['gloo']['min_ms']:.2f}-{row['gloo']['max_ms']:.2f})",
                flush=True,
            )

    print(
        f"\n{'training':<16}{'hsdp ms':>10}{'gloo ms':>10}{'gloo/hsdp':>11}{'fake ms':>10}{'hsdp/fake':>11}"
        f"{'overhead':>10}   (median step after 2 warm-up steps; overhead: (hsdp - fake) / (gloo - fake))"
    )
    for mesh in ("fsdp", "hsdp"):
        steps_ms: dict = {"hsdp": [], "gloo": [], "fake": []}
        for i in range(launches):
            for backend in ("hsdp", "gloo", "fake"):
                ranks = _launch(
                    work / f"train-{mesh}-{backend}-{i}", "training", backend, mesh, str(steps)
                )
                for s in range(2, steps):
                    steps_ms[backend].append(max(r[s]["step_ms"] for r in ranks) / 1e3)
        row = {
            "mesh": "1-D FSDP over 4 ranks"
            if mesh == "fsdp"
            else "HSDP 2 x 2 (replicate across hosts)"
        }
        for backend in ("hsdp", "gloo", "fake"):
            row[backend] = _summary(steps_ms[backend])
        hsdp_ms, gloo_ms, fake_ms = (row[b]["median_ms"] for b in ("hsdp", "gloo", "fake"))
        row["gloo_over_hsdp"] = gloo_ms / hsdp_ms
        row["hsdp_over_fake"] = hsdp_ms / fake_ms
        row["overhead_vs_gloo"] = (hsdp_ms - fake_ms) / (gloo_ms - fake_ms)
        report["training"].append(row)
        print(
            f"{mesh:<16}{hsdp_ms:>10.1f}{gloo_ms:>10.1f}{row['gloo_over_hsdp']:>10.2f}x{fake_ms:>10.1f}"
            f"{row['hsdp_over_fake']:>10.2f}x{row['overhead_vs_gloo']:>10.2f}",
            flush=True,
        )
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
