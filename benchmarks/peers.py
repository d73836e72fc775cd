"""hsdp against the peers a user could pick instead, on this host: gloo, Open MPI (Debian's
openmpi-bin; btl vader, CMA single copy) and MPICH (the PyPI ``mpich`` wheel), both through mpi4py,
DeepSpeed's shm all-reduce (CPU accelerator), and memcpy in one and two processes as the limit.

  python -m benchmarks.peers [--ranks 2,4] [--peers gloo,ompi,mpich,deepspeed] [--ops ar] [--sizes 1M]

Peers are opt-in (scripts/setup_peers.sh installs them under .venv/peers/). One that is not
installed, does not start or returns a wrong result is reported missing with the reason, never
dropped. Every contender is checked once against the exact answer, then timed as
benchmarks/common.py says (interleaved; max over ranks of the medians).

Ops, float32, per rank size (default 64K,1M,16M,64M; --quick 64K,1M): all_gather, all_gather_inplace
(FSDP2's form; MPI_IN_PLACE), reduce_scatter and all_reduce (SUM; all_reduce adds 8 B). Once a run,
a 1-rank 8-byte all_reduce: hsdp, hsdp without its flight recorder, and torch's fake backend (does
nothing but return a Work that Python waits for; hsdp's synchronous calls return none).

Launches per world size: the main one (hsdp, gloo, DeepSpeed), and one per MPI under its own
launcher (two MPIs cannot share a process) whose ranks also run hsdp and gloo, alternating with
the MPI on numpy views of the same tensors. hsdp_pool: hsdp on buffers from the group's
allocate_tensor (FSDP2's), for the all-gathers and reduce_scatter, in every launch.

Columns: us = max over ranks of the median per-call time; hsdp and pool us: the main launch's;
vs X = time(X) / time(hsdp in X's launch), > 1 when hsdp is faster; pool vs X: against hsdp_pool;
mc1 / mc2: single-thread memcpy of the per-rank size in 1 process / 2 at once (the slower), warm;
hsdp/mc2 = hsdp's bus bandwidth (nccl-tests) / mc2's GB/s; mcR: every rank of the main launch
copying its size, interleaved with the collectives (as cold as they are); rdR: reduce_scatter
without communication (each rank sums world rows with the engine's kernel: the bytes a one-pass
reduce-scatter moves), so hsdp/rdR bounds what any buffer scheme can gain; spread = interquartile
range / median of the noisiest contender.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import faulthandler
import functools
import gc
import os
import pickle
import sys
import time

from benchmarks import collectives, common, peer_env
from benchmarks.common import Column, format_size
from tools.ranks import RankFailure, free_port, run_ranks

OPS = ("all_gather", "all_gather_inplace", "reduce_scatter", "all_reduce")
ALIASES = {"ag": OPS[0], "ag_inplace": OPS[1], "rs": OPS[2], "ar": OPS[3]}
POOL, POOL_OPS = "hsdp_pool", OPS[:3]  # the buffers FSDP2 allocates from the group
MEMCPY, REDUCE = "memcpy", "reduce"  # the copy and reduce limits, timed inside the launch
LATENCY_BYTES = 8
BUDGET_S = (0.3, 0.05)  # per point and contender (full, --quick)
TIMEOUT_S = (1800.0, 420.0)
LABEL = {"gloo": "gloo", "ompi": "ompi", "mpich": "mpich", "deepspeed": "ds"}


# The peers' ops as the collectives suite's (its buffers, binders and exact check).
AG, RS, AR = collectives.OPS
AS_COLLECTIVE = {"all_gather": AG, "all_gather_inplace": AG, "reduce_scatter": RS, "all_reduce": AR}


def buffers(op: str, numel: int, ranks, comm=None) -> dict:
    """The op's fp32 buffers; with ``comm`` (a c10d Backend), the ones peers read (the
    all-gather's input, the reduce-scatter's input) come from its allocate_tensor."""
    import torch

    in_place = op != "all_gather"
    return collectives.buffers(AS_COLLECTIVE[op], numel, ranks, torch.float32, comm, in_place)


def bind(op: str, bufs: dict, group):
    return collectives.bind(AS_COLLECTIVE[op], bufs, group)


def check(op: str, bufs: dict, call, ranks) -> str | None:
    return collectives.check(AS_COLLECTIVE[op], bufs, call, ranks)


def _mpi_binder(comm):
    """The op as mpi4py calls on numpy views of the same torch buffers."""
    from mpi4py import MPI

    def bind_mpi(op: str, bufs: dict):
        if op == "all_reduce":
            t = bufs["t"].numpy()
            return lambda: comm.Allreduce(MPI.IN_PLACE, t, op=MPI.SUM)
        out = bufs["out"].numpy()
        if op == "all_gather_inplace":
            return lambda: comm.Allgather(MPI.IN_PLACE, out)
        inp = bufs["in"].numpy()
        if op == "reduce_scatter":
            return lambda: comm.Reduce_scatter_block(inp, out, op=MPI.SUM)
        return lambda: comm.Allgather(inp, out)

    return bind_mpi


def _deepspeed_binder(ranks: common.Ranks, info: dict):
    """DeepSpeed's shm all-reduce as deepspeed.comm.inference_all_reduce calls it on the CPU
    accelerator (the op built by the parent's probe; LOCAL_SIZE == world, set by the parent)."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, info["sys_path"])
    from deepspeed.accelerator import get_accelerator

    shm = get_accelerator().create_op_builder("ShareMemCommBuilder").load()
    shm.initialize(ranks.world, ranks.rank)
    # DeepSpeed never unlinks its 66 MB shm workspace: once every rank has mapped every peer's,
    # each unlinks its own, so no run leaves files in /dev/shm, not even one that is killed.
    dist.barrier(group=ranks.gloo)
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    with contextlib.suppress(OSError):
        os.unlink(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{ranks.rank}")
    fn = torch.ops.deepspeed.inference_all_reduce_

    def bind_ds(op: str, bufs: dict):
        t = bufs.get("t")
        return None if op != "all_reduce" else lambda: fn(t)

    return bind_ds


def _anyone(ranks: common.Ranks, bad: bool) -> bool:
    """On every rank: whether any rank says ``bad``."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([float(bad)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=ranks.gloo)
    return bool(flag.item())


def measure_points(ranks: common.Ranks, config: dict, peers: dict, problems: dict) -> list[dict]:
    """Every point: hsdp, gloo, hsdp_pool and ``peers`` ({name: binder}), each checked, then the
    copy and reduce limits, timed interleaved. A peer that goes wrong lands in ``problems``."""
    import hsdp_testing  # the engine's kernel alone: the tests' module, built by scripts/setup.sh
    import torch

    from hsdp_backend import config as settings

    stream_from = hsdp_testing.stream_store_bytes_for(
        ranks.world, settings.resolve().stream_store_bytes
    )
    comm = ranks.hsdp._get_backend(torch.device("cpu"))
    pool = comm.supports_tensor_alloc(torch.device("cpu"))
    out = []
    for op, nbytes in config["points"]:
        numel, where = nbytes // 4, f"{op} {format_size(nbytes)}"
        bufs = buffers(op, numel, ranks)
        calls = {"hsdp": bind(op, bufs, ranks.hsdp), "gloo": bind(op, bufs, ranks.gloo)}
        own = dict.fromkeys(calls, bufs)
        if pool and op in POOL_OPS:
            own[POOL] = buffers(op, numel, ranks, comm)
            calls[POOL] = bind(op, own[POOL], ranks.hsdp)
        for name, binder in peers.items():
            call = None if name in problems else binder(op, bufs)
            if call is not None:
                calls[name], own[name] = call, bufs
        for name in list(calls):
            wrong = check(op, own[name], calls[name], ranks)
            if _anyone(ranks, wrong is not None):  # every rank drops the peer (or fails) at once
                if name in ("hsdp", "gloo", POOL):
                    ranks.fail(f"{name} {where}", f"wrong result: {wrong or 'on another rank'}")
                problems[name] = f"wrong result at {where}: {wrong or 'on another rank'}"
                del calls[name]
        src, dst = torch.ones(numel), torch.empty(numel)
        calls[MEMCPY] = functools.partial(dst.copy_, src)
        if op == "reduce_scatter" and ranks.world > 1:
            rows, reduced = torch.ones(ranks.world, numel), torch.empty(numel)
            calls[REDUCE] = functools.partial(hsdp_testing.reduce_rows, reduced, rows, stream_from)
            calls[REDUCE]()
            wrong = common.mismatch(reduced, torch.full_like(reduced, ranks.world))
            if wrong:
                ranks.fail(f"reduce_rows {where}", wrong)
        times = common.measure(ranks, calls, config["sampling"])
        ranks.log(f"{where}: " + "  ".join(f"{n} {t['us']:.1f}" for n, t in times.items()))
        out.append({"op": op, "bytes": nbytes, "numel": numel, "us": times})
        del bufs, own, calls
        gc.collect()
    return out


def _floors(ranks: common.Ranks, sampling: common.Sampling) -> dict:
    """The 1-rank 8-byte all_reduce on hsdp, hsdp with its flight recorder off, and torch's fake
    backend (one rank: the sum is the input, so even the backend that does nothing is exact)."""
    import torch
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  registers "fake"

    os.environ["HSDP_TRACE_ENTRIES"] = "0"  # read when the group is created
    groups = {"hsdp": ranks.hsdp, "hsdp_no_recorder": dist.new_group(backend="hsdp")}
    del os.environ["HSDP_TRACE_ENTRIES"]
    groups["torch"] = dist.new_group(backend="fake")
    bufs = {"t": torch.zeros(LATENCY_BYTES // 4)}
    calls = {name: bind("all_reduce", bufs, g) for name, g in groups.items()}
    for name, call in calls.items():
        wrong = check("all_reduce", bufs, call, ranks)
        if wrong:
            ranks.fail(f"{name} all_reduce 8 B", wrong)
    return common.measure(ranks, calls, sampling)


def rank_main(rank: int, world: int, config: dict) -> dict:
    """One rank of the floor or the main launch (tools/ranks.py)."""
    import hsdp_backend

    ranks = common.init(argparse.Namespace(verbose=config["verbose"]))
    if config["mode"] == "floor":
        return _floors(ranks, config["sampling"])
    peers, problems = {}, {}
    ds = config["peers"].get("deepspeed", {})
    if ds.get("available"):
        try:
            binder, err = _deepspeed_binder(ranks, ds), None
        except Exception as exc:  # noqa: BLE001  reported missing, not fatal
            binder, err = None, f"{type(exc).__name__}: {exc}"
        if _anyone(ranks, err is not None):
            problems["deepspeed"] = f"shm op did not start: {err or 'on another rank'}"
        else:
            peers["deepspeed"] = binder
    points = measure_points(ranks, config, peers, problems)
    return {"points": points, "problems": problems, "engine": hsdp_backend.cpu_route()}


def mpi_rank_main() -> None:
    """One rank of an MPI launch (started by mpirun / mpiexec: benchmarks/peer_env.py)."""
    with open(os.environ["HSDP_PEERS_CONFIG"], "rb") as f:
        job = pickle.load(f)
    rank = os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "-1"))
    world = os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("PMI_SIZE", "0"))
    # torch.distributed's env:// rendezvous, from the MPI launcher's ranks
    os.environ.update(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=world, LOCAL_WORLD_SIZE=world)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(job["port"]))
    faulthandler.dump_traceback_later(max(job["timeout"] - 5, 1), exit=True)  # a hang says where
    import torch.distributed as dist

    import hsdp_backend

    ranks = common.init(argparse.Namespace(verbose=False), timeout_s=min(job["timeout"], 120))
    from mpi4py import MPI

    out = {"problems": {}, "library": MPI.Get_library_version().strip().splitlines()[0]}
    mpi = {job["peer"]: _mpi_binder(MPI.COMM_WORLD)}
    out["points"] = measure_points(ranks, job["config"], mpi, out["problems"])
    out["engine"] = hsdp_backend.cpu_route()
    if ranks.rank == 0:
        with open(job["out"], "wb") as f:
            pickle.dump(out, f)
    dist.destroy_process_group()


def launch_flags(p: argparse.ArgumentParser, ranks: list[int]) -> None:
    worlds = lambda t: [int(w) for w in t.split(",") if w.strip()]
    cores = lambda t: len(os.sched_getaffinity(0)) if t == "cores" else int(t)
    p.add_argument("--ranks", type=worlds, default=ranks, metavar="W[,W...]", help="world sizes")
    p.add_argument("--timeout", type=float, metavar="S", help="for the run, then ranks are killed")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="for the ranks")
    p.add_argument("--load", type=cores, default=0, metavar="N|cores", help="busy processes beside")


def launch(fn, world: int, env: dict, deadline: float, **kwargs):
    """Rank 0's ``fn(rank, world, **kwargs)`` from ``world`` fresh ranks; exits on a failure."""
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **env}
    left = max(1.0, deadline - time.monotonic())
    try:
        opts = {"backend": None, "env": env, "timeout_s": left, "collective_timeout_s": 120.0}
        return run_ranks(fn, world, kwargs=kwargs, **opts)[0]
    except RankFailure as exc:
        raise SystemExit(f"world size {world} failed: {exc}") from None


def _status(peer: str, info: dict, launches: dict) -> dict:
    """A wanted peer at one world size: measured, or missing with the reason."""
    source = launches.get(peer if peer in peer_env.MPI_PEERS else "main")
    if not info["available"]:
        return {"status": "missing", "reason": info["reason"]}
    if source is None or "failed" in source:
        return {"status": "missing", "reason": (source or {}).get("failed", "not run")}
    if peer in source["problems"]:
        return {"status": "missing", "reason": source["problems"][peer]}
    return {"status": "measured", "checked": True, "library": source.get("library")}


def _cell(peer: str, op: str, nbytes: int, status: dict, points: dict) -> dict:
    if status["status"] != "measured":
        return {"status": "missing", "reason": status["reason"]}
    if peer == "deepspeed" and op != "all_reduce":
        return {"status": "n/a", "reason": "DeepSpeed's shm op is all-reduce only"}
    pt = points[peer if peer in peer_env.MPI_PEERS else "main"].get((op, nbytes))
    if pt is None or peer not in pt["us"]:
        return {"status": "missing", "reason": "not measured at this point"}
    mine, hsdp, pool = pt["us"][peer], pt["us"]["hsdp"]["us"], pt["us"].get(POOL)
    cell = {"status": "measured", "checked": True, "hsdp_us_same_launch": hsdp, **mine}
    cell["speedup_vs"] = mine["us"] / hsdp  # > 1: hsdp is faster
    cell["pool_speedup_vs"] = mine["us"] / pool["us"] if pool else None
    return cell


def rows_of(world: int, found: dict, launches: dict, mc1: dict, mc2: dict) -> tuple[list, dict]:
    """One row per (op, size) of the main launch, each peer's cell from its own launch."""
    status = {peer: _status(peer, info, launches) for peer, info in found.items()}
    points = {}  # launch: {(op, bytes): point}
    for name, launch in launches.items():
        points[name] = {(p["op"], p["bytes"]): p for p in launch.get("points", [])}
    rows = []
    for p in launches["main"]["points"]:
        op, n, us = p["op"], p["bytes"], p["us"]
        busbw = common.busbw_gbps(op, n, world, us["hsdp"]["us"])
        row = {"world": world, "op": op, "bytes_per_rank": n, POOL: us.get(POOL)}
        row["hsdp"] = {**us["hsdp"], "busbw_gbps": busbw}
        row["peers"] = {peer: _cell(peer, op, n, st, points) for peer, st in status.items()}
        row["memcpy1_us"], row["memcpy2_us"] = mc1[n]["us"], mc2[n]["us"]
        row["hsdp_memcpy2_fraction"] = busbw / mc2[n]["gbps"]
        row["memcpy_in_run_us"] = us[MEMCPY]["us"]
        row["hsdp_memcpy_in_run_fraction"] = busbw / (n / us[MEMCPY]["us"] / 1e3)
        row["reduce_in_run_us"] = (us.get(REDUCE) or {}).get("us")
        row["spread"] = max(t["spread"] for t in us.values())
        row["by_launch"] = {
            name: {c: t["us"] for c, t in pts[(op, n)]["us"].items()}
            for name, pts in points.items()
            if (op, n) in pts
        }
        rows.append(row)
    return rows, status


def _show(cell: dict, key: str):
    if cell["status"] == "missing":
        return "missing"
    return "-" if cell["status"] == "n/a" or cell.get(key) is None else cell[key]


def _per_reduce(row: dict, contender):
    limit = row["reduce_in_run_us"]
    return "-" if limit is None or not contender else contender["us"] / limit


def columns(peers: list[str]) -> list[Column]:
    def of(peer, key):
        return lambda r: _show(r["peers"][peer], key)

    mpis = [p for p in peers if p != "deepspeed"]
    return [
        Column("op", lambda r: r["op"]),
        Column("size", lambda r: format_size(r["bytes_per_rank"])),
        Column("hsdp us", lambda r: r["hsdp"]["us"]),
        Column("pool us", lambda r: r[POOL]["us"] if r[POOL] else "-"),
        *(Column(f"{LABEL[p]} us", of(p, "us")) for p in peers),
        Column("mc1 us", lambda r: r["memcpy1_us"]),
        Column("mc2 us", lambda r: r["memcpy2_us"]),
        *(Column(f"vs {LABEL[p]}", of(p, "speedup_vs")) for p in peers),
        *(Column(f"pool vs {LABEL[p]}", of(p, "pool_speedup_vs")) for p in mpis),
        Column("hsdp/mc2", lambda r: r["hsdp_memcpy2_fraction"]),
        Column("mcR us", lambda r: r["memcpy_in_run_us"]),
        Column("hsdp/mcR", lambda r: r["hsdp_memcpy_in_run_fraction"]),
        Column("rdR us", lambda r: "-" if r["reduce_in_run_us"] is None else r["reduce_in_run_us"]),
        Column("hsdp/rdR", lambda r: _per_reduce(r, r["hsdp"])),
        Column("pool/rdR", lambda r: _per_reduce(r, r[POOL])),
        Column("spread", lambda r: f"{100 * r['spread']:.0f}%"),
    ]


def _notes(status: dict, floor: dict) -> list[str]:
    notes = []
    for peer, st in status.items():
        done = f"measured, checked{', ' + st['library'] if st.get('library') else ''}"
        notes.append(f"  {peer}: " + (f"missing: {st['reason']}" if "reason" in st else done))
    us = ", ".join(f"{name} {t:.2f} us" for name, t in floor.items())
    notes.append(f"1-rank all_reduce 8 B, the per-call floor: {us} (torch: its fake backend)")
    notes.append("vs X = time(X) / time(hsdp in X's launch), > 1 when hsdp is faster (see --help)")
    return notes


def _points(p: argparse.ArgumentParser, args: argparse.Namespace) -> list[tuple[str, int]]:
    ops = list(dict.fromkeys(ALIASES.get(o, o) for o in args.ops.split(",") if o))
    unknown = [x for x in args.peers if x not in peer_env.PEERS] + [o for o in ops if o not in OPS]
    if unknown:
        p.error(f"unknown {unknown}: peers are {', '.join(peer_env.PEERS)}; ops {', '.join(OPS)}")
    sizes = args.sizes or [64 << 10, 1 << 20] + ([] if args.quick else [16 << 20, 64 << 20])
    if any(s <= 0 or s % 4 for s in sizes):
        p.error("sizes must be positive multiples of 4 bytes (float32)")
    latency = [LATENCY_BYTES] if LATENCY_BYTES not in sizes else []
    return [(op, s) for op in ops for s in (latency if op == "all_reduce" else []) + sizes]


def main(argv: list[str] | None = None) -> int:
    import torch

    p = common.parser(__doc__)
    p.prog = "python -m benchmarks.peers"
    launch_flags(p, [2])
    listed = lambda t: list(dict.fromkeys(x.strip() for x in t.split(",") if x.strip()))
    p.add_argument(
        "--peers", type=listed, default=list(peer_env.PEERS), metavar="P[,...]", help="default: all"
    )
    p.add_argument(
        "--ops",
        default=",".join(OPS),
        metavar="OP[,...]",
        help="default: all; or ag,ag_inplace,rs,ar",
    )
    p.add_argument("--sizes", type=common.sizes, metavar="SIZE[,...]", help="bytes per rank")
    args = p.parse_args(argv)
    points = _points(p, args)
    sampling = common.Sampling.of(args, BUDGET_S)
    config = {"points": points, "sampling": sampling, "verbose": args.verbose}
    env = dict(kv.split("=", 1) for kv in args.env)
    deadline = time.monotonic() + (args.timeout or TIMEOUT_S[args.quick])
    torch.set_num_threads(1)
    with common.cpu_load(args.load):
        print("looking for peers (DeepSpeed's shm op is built here if setup did not)...")
        found = peer_env.find_peers(args.peers)
        print("memcpy in 1 and 2 processes, 1 thread each...", flush=True)
        sizes = sorted({s for _, s in points})
        mc1 = {n: {"us": common.memcpy_us(n, torch.float32, sampling)} for n in sizes}
        mc2 = peer_env.memcpy2(sizes, sampling)
        print("1-rank all_reduce 8 B (the per-call floor)...", flush=True)
        floor = launch(rank_main, 1, env, deadline, config={**config, "mode": "floor"})
        floor = {name: t["us"] for name, t in floor.items()}
        for world in args.ranks:
            ds = found.get("deepspeed", {})
            main_env = (
                {**env, **ds["env"], "LOCAL_SIZE": str(world)} if ds.get("available") else env
            )
            print(f"world size {world}: main launch (hsdp, gloo, DeepSpeed)...", flush=True)
            main = {**config, "mode": "main", "peers": found}
            launches = {"main": launch(rank_main, world, main_env, deadline, config=main)}
            for peer in peer_env.MPI_PEERS:
                if found.get(peer, {}).get("available"):
                    print(f"world size {world}: {peer} launch (hsdp, gloo, {peer})...", flush=True)
                    job = {"config": config, "port": free_port()}
                    left = deadline - time.monotonic()
                    out, why = peer_env.run_mpi_launch(peer, found[peer], world, job, env, left)
                    launches[peer] = out or {"failed": why}
            rows, status = rows_of(world, found, launches, mc1, mc2)
            public = ("available", "reason", "version")
            extra = {"peer_status": status, "floor_1rank_8B_us": floor}
            extra["peers"] = {n: {k: i[k] for k in public if k in i} for n, i in found.items()}
            extra["memcpy1"] = [{"bytes": n, **mc1[n]} for n in sizes]
            extra["memcpy2"] = [{"bytes": n, **mc2[n]} for n in sizes]
            extra["sampling"] = dataclasses.asdict(sampling)
            extra["hsdp_cpu_engine"] = launches["main"]["engine"]
            notes = _notes(status, floor)
            common.emit("peers", args, world, columns(args.peers), rows, notes, extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
