"""hsdp against gloo on groups that span hosts, on simulated hosts
(tools/simhosts.py: 2 hosts x 2 ranks, a network and mount namespace per
host, joined by veths on a bridge). Needs root.

Collectives: all-gather, reduce-scatter and all-reduce over the 4-rank group
at 64 KiB, 1 MiB and 16 MiB per rank; hsdp (hierarchical: shared memory
within hosts, gloo between them) and a gloo group over the same ranks run
alternately in the same launch, one repetition each in turn. A repetition's
time is the slowest rank's. Training: examples/train_fsdp.py's model
(``train()``'s per-step metrics), FSDP2 1-D over the 4 ranks and HSDP
(replicate across hosts, shard within), one launch per backend,
alternating, and the same on torch's fake backend (no communication at
all: the zero-cost-network limit of the same ranks on the same cores).
Reported: medians, the range over repetitions (JSON), gloo / hsdp (above 1:
hsdp is faster), hsdp / fake and hsdp's overhead above the limit as a
fraction of gloo's.

The "network" is a veth on one machine: as fast as loopback and sharing the
same cores, so a real cluster's links will change every number. Every rank
is ``python -m benchmarks.hosts JOB OUT ...`` under torchrun on its host.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import pickle
import statistics
import sys
import tempfile
import time
from typing import Any

from benchmarks import report, timing
from benchmarks.report import Column
from benchmarks.suite import BenchFailure, Suite

ROOT = pathlib.Path(__file__).resolve().parents[1]
SIZES = [64 << 10, 1 << 20, 16 << 20]
OPS = ["all_gather", "reduce_scatter", "all_reduce"]
TRAINING_BACKENDS = ("hsdp", "gloo", "fake")
MESHES = {"fsdp": "1-D FSDP over 4 ranks", "hsdp": "HSDP 2 x 2 (replicate across hosts)"}
# Steps per training launch dropped before measuring.
WARMUP_STEPS = 2
# Wall-clock limit of one launch (capped by what is left of --timeout).
LAUNCH_TIMEOUT_S = 1800.0


# ---------------------------------------------------------------- in a rank


def _collectives(reps: int) -> dict:
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


def _training(mesh_kind: str, steps: int) -> list:
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
    """One rank under torchrun: ``collectives BACKEND REPS`` or
    ``training BACKEND MESH STEPS``; pickles its result into ``out``."""
    import datetime
    import gc

    import torch
    import torch.distributed as dist

    import hsdp_backend  # noqa: F401  registers "hsdp"

    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT / "examples"))
    import train_fsdp

    # --flush-denormal in every run alike (see the flag's help); "fake" is
    # torch's fake backend: the zero-cost-network limit of the same ranks.
    init_args = ["--backend", args[0], "--flush-denormal"]
    train_fsdp.init_distributed(
        train_fsdp.get_parser().parse_args(init_args), timeout=datetime.timedelta(seconds=300)
    )
    if job == "collectives":
        result = _collectives(int(args[1]))
    else:
        result = _training(args[1], int(args[2]))
    (pathlib.Path(out) / f"{job}.{dist.get_rank()}.pkl").write_bytes(pickle.dumps(result))
    dist.destroy_process_group()
    gc.collect()  # see examples/train_fsdp.py's shut_down


# ---------------------------------------------------------------- driver


def _launch(out: pathlib.Path, env: dict, deadline: float, *args: str) -> list:
    """Runs ``rank_main(*args)`` on 2 simulated hosts x 2 ranks; the 4 results."""
    from tools import simhosts

    time_left = deadline - time.monotonic()
    if time_left <= 0:
        raise BenchFailure(f"no time left for launch {args} (see --timeout)")
    out.mkdir(parents=True, exist_ok=True)
    # The ranks import this package from the repository root, as the parent does.
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    rank_env = {**os.environ, "PYTHONPATH": path, **env}
    try:
        with simhosts.SimHosts(2) as hosts:
            procs = [
                hosts.torchrun(
                    h,
                    2,
                    ["benchmarks.hosts", args[0], str(out), *args[1:]],
                    env=rank_env,
                    torchrun_args=("--module",),
                )
                for h in range(2)
            ]
            codes = simhosts.wait_all(procs, min(LAUNCH_TIMEOUT_S, time_left))
    except simhosts.Unavailable as exc:
        raise BenchFailure(f"simulated hosts unavailable: {exc}") from None
    if codes != [0, 0]:
        raise BenchFailure(f"launch {args} failed: torchrun exit codes {codes}")
    return [pickle.loads((out / f"{args[0]}.{r}.pkl").read_bytes()) for r in range(4)]


def _summary(samples_s: list[float]) -> dict:
    ms = [s * 1e3 for s in samples_s]
    return {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms), "n": len(ms)}


def _range(r: dict) -> str:
    return f"{r['min_ms']:.2f}-{r['max_ms']:.2f}"


COLLECTIVE_COLUMNS = [
    Column("op", 14, lambda r: r["op"], left=True),
    Column("bytes/rank", 10, lambda r: str(r["bytes_per_rank"])),
    Column("hsdp ms", 8, lambda r: f"{r['hsdp']['median_ms']:.2f}"),
    Column("gloo ms", 8, lambda r: f"{r['gloo']['median_ms']:.2f}"),
    Column("gloo/hsdp", 9, lambda r: f"{r['gloo_over_hsdp']:.2f}x"),
    Column("hsdp range", 12, lambda r: _range(r["hsdp"])),
    Column("gloo range", 12, lambda r: _range(r["gloo"])),
]
TRAINING_COLUMNS = [
    Column("training", 8, lambda r: r["mesh_key"], left=True),
    Column("hsdp ms", 8, lambda r: f"{r['hsdp']['median_ms']:.1f}"),
    Column("gloo ms", 8, lambda r: f"{r['gloo']['median_ms']:.1f}"),
    Column("gloo/hsdp", 9, lambda r: f"{r['gloo_over_hsdp']:.2f}x"),
    Column("fake ms", 8, lambda r: f"{r['fake']['median_ms']:.1f}"),
    Column("hsdp/fake", 9, lambda r: f"{r['hsdp_over_fake']:.2f}x"),
    Column(
        "overhead",
        8,
        lambda r: "n/a" if r["overhead_vs_gloo"] is None else f"{r['overhead_vs_gloo']:.2f}",
    ),
]


class HostsSuite(Suite):
    name = "hosts"
    help = "collectives and FSDP2 training on 2 simulated hosts x 2 ranks, hsdp vs gloo (root)"
    default_ranks = (4,)
    takes_ranks = False
    output_stem = "bench_hosts"
    default_timeout_s = (3600.0, 1200.0)
    quick_help = "5 repetitions, 6 steps, 1 launch per backend"

    def configure(self, args: argparse.Namespace) -> dict:
        return {
            "reps": 5 if args.quick else 20,
            "steps": 6 if args.quick else 12,
            "launches": 1 if args.quick else 2,
        }

    def run_all(
        self, config: dict, ranks: list[int], env: dict, deadline: float, verbose: bool
    ) -> tuple[dict[int, Any], dict[int, str], dict[int, float]]:
        t0 = time.monotonic()
        work = pathlib.Path(tempfile.mkdtemp(prefix="hsdp-bench-hosts-"))
        print("collectives on 2 simulated hosts x 2 ranks...", flush=True)
        collectives = _launch(
            work / "coll", env, deadline, "collectives", "hsdp", str(config["reps"])
        )
        # Per mesh and backend: the slowest rank's step time of every step after warm-up.
        steps_s: dict = {m: {b: [] for b in TRAINING_BACKENDS} for m in MESHES}
        for mesh in MESHES:
            for i in range(config["launches"]):
                for backend in TRAINING_BACKENDS:
                    print(f"training, {mesh}, {backend}, launch {i + 1}...", flush=True)
                    ranks_out = _launch(
                        work / f"train-{mesh}-{backend}-{i}",
                        env,
                        deadline,
                        "training",
                        backend,
                        mesh,
                        str(config["steps"]),
                    )
                    for s in range(WARMUP_STEPS, config["steps"]):
                        steps_s[mesh][backend].append(max(r[s]["step_ms"] for r in ranks_out) / 1e3)
        raw = {"collectives": collectives, "training_step_s": steps_s}
        return {4: raw}, {4: "hierarchical"}, {4: time.monotonic() - t0}

    def report(self, config: dict, reference: dict, per_world: dict[int, Any]) -> dict:
        per_rank = per_world[4]["collectives"]
        reps = config["reps"]
        section: dict = {
            "setup": "2 simulated hosts x 2 ranks (veth on one machine), fp32",
            "reps": reps,
            "steps": config["steps"],
            "warmup_steps": WARMUP_STEPS,
            "launches": config["launches"],
            "collectives": [],
            "training": [],
        }
        for op in OPS:
            for size in SIZES:
                row: dict = {"op": op, "bytes_per_rank": size}
                for backend in ("hsdp", "gloo"):
                    slowest = [
                        max(r[(op, size, backend)][i] for r in per_rank) for i in range(reps)
                    ]
                    row[backend] = _summary(slowest)
                row["gloo_over_hsdp"] = row["gloo"]["median_ms"] / row["hsdp"]["median_ms"]
                section["collectives"].append(row)
        report.print_table(
            COLLECTIVE_COLUMNS,
            section["collectives"],
            title="collectives over the 4-rank group (median over repetitions of the slowest rank):",
        )
        for mesh, label in MESHES.items():
            samples = per_world[4]["training_step_s"][mesh]
            row = {"mesh": label, "mesh_key": mesh}
            for backend in TRAINING_BACKENDS:
                row[backend] = _summary(samples[backend])
            hsdp_ms, gloo_ms, fake_ms = (row[b]["median_ms"] for b in TRAINING_BACKENDS)
            row["gloo_over_hsdp"] = gloo_ms / hsdp_ms
            row["hsdp_over_fake"], row["overhead_vs_gloo"] = timing.against_limit(
                hsdp_ms, gloo_ms, fake_ms
            )
            section["training"].append(row)
        report.print_table(
            TRAINING_COLUMNS,
            section["training"],
            title=f"training step (median after {WARMUP_STEPS} warm-up steps; "
            "overhead: (hsdp - fake) / (gloo - fake)):",
        )
        for row in section["training"]:
            del row["mesh_key"]
        return section

    def plot(self, section: dict, path: str) -> None:
        with report.figure(path, 2, f"hsdp vs gloo, {section['setup']}") as (coll, train):
            rows = section["collectives"]
            short = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR"}
            labels = [f"{short[r['op']]}\n{report.short_size(r['bytes_per_rank'])}" for r in rows]
            series = [(b, [r[b]["median_ms"] for r in rows], {}) for b in ("hsdp", "gloo")]
            report.grouped_bars(coll, labels, series)
            coll.set_yscale("log")
            coll.set_ylabel("ms per call (median, slowest rank)")
            coll.set_title(
                "collectives over 4 ranks (AG, RS, AR: all-gather, reduce-scatter, all-reduce)",
                fontsize="medium",
            )
            coll.tick_params(axis="x", labelsize="small")
            rows = section["training"]
            series = [(b, [r[b]["median_ms"] for r in rows], {}) for b in TRAINING_BACKENDS]
            report.grouped_bars(train, [r["mesh"] for r in rows], series)
            train.set_ylabel("training step, ms (median, slowest rank)")
            train.set_title("FSDP2 step (fake: no communication)")
            train.tick_params(axis="x", labelsize="small")
            for ax in (coll, train):
                ax.grid(True, axis="y", which="both", alpha=0.3)
                ax.legend(fontsize="small")


SUITE = HostsSuite()

if __name__ == "__main__":
    rank_main(*sys.argv[1:])
