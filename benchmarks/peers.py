"""hsdp against the peers a user could pick instead, on this host: gloo, Open
MPI (Debian's openmpi-bin, btl vader with CMA single copy), MPICH (the PyPI
``mpich`` wheel), both through mpi4py, and DeepSpeed's shm all-reduce (CPU
accelerator; all-reduce only); one- and two-process memcpy as the limit.

Peers are opt-in: scripts/setup_peers.sh installs them under .venv/peers/
(never into the venv's own packages). A peer that is not installed, does
not start or returns a wrong result is reported as missing with the reason,
in the table and the JSON; it is never dropped silently.

Ops, per rank size (default 64K, 1M, 16M, 64M; --quick: 64K, 1M):
all_gather (out of place), all_gather_inplace (FSDP2's form: the input is
the output's own slice; MPI_IN_PLACE for the MPIs), reduce_scatter (SUM),
all_reduce (SUM, plus an 8-byte latency row). Once per run, a 1-rank 8-byte
all_reduce, interleaved: hsdp (the per-call floor of torch.distributed plus
hsdp), hsdp with its flight recorder off, and torch's fake backend, which
does nothing but return a Work that Python waits for (torch.distributed's
own floor for a backend that returns one; hsdp's synchronous calls return
none).

Launches, per world size, each interleaving its contenders on the same
buffers as benchmarks/timing.py does (check once, calibrate, alternate
samples, max over ranks of the medians):
- main (tools/ranks.py): hsdp, gloo and DeepSpeed;
- one per MPI (MPI libraries cannot share a process), under that MPI's own
  launcher: the same rank processes also initialise torch.distributed on
  hsdp and gloo (env:// rendezvous, rank from OMPI_COMM_WORLD_RANK /
  PMI_RANK) and alternate hsdp, gloo and MPI samples; mpi4py works on
  numpy views of the torch tensors.
Every launch also measures ``hsdp_pool``: hsdp on buffers from the group's
``allocate_tensor`` (the shared-memory pool, which peers read with plain
loads; FSDP2's ``set_allocate_memory_from_process_group_for_comm``) for
the all-gathers and the reduce-scatter, checked once like the others.
A peer's ratio is taken against hsdp from the same launch:
``vs X`` = time(X) / time(hsdp), > 1 when hsdp is faster. ``hsdp/mc2`` =
hsdp bus bandwidth (nccl-tests) / per-process bandwidth of two concurrent
single-thread memcpy processes (memcpy2) of the per-rank size, measured in
the parent on warm buffers; ``hsdp/mcR`` = the same against memcpy2 measured
inside the main launch as one more interleaved contender (every rank copies
its per-rank size at once), whose caches are as cold as the collectives'.
For reduce_scatter the main launch also measures ``reduce`` (rdR): every
rank sums world private rows of the per-rank size into one with the
engine's own kernel (one pass, storing around the cache where hsdp's
reduce-scatter does), with no communication: exactly the bytes a one-pass
reduce-scatter reads and writes, so ``hsdp/rdR`` bounds what any buffer
scheme can gain over hsdp on this machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import os
import pickle
import sys
import time
from collections.abc import Callable

from benchmarks import collectives, peer_env, report, timing
from benchmarks.report import KIB, MIB, format_size
from benchmarks.suite import RankContext, Suite, launch

OPS = ("all_gather", "all_gather_inplace", "reduce_scatter", "all_reduce")
OP_ALIASES = {"ag": "all_gather", "ag_inplace": "all_gather_inplace", "rs": "reduce_scatter"}
OP_ALIASES["ar"] = "all_reduce"
# The collectives suite's names, for its exact-answer check and byte counts.
CHECK_NAME = {
    "all_gather": "all_gather_into_tensor",
    "all_gather_inplace": "all_gather_into_tensor",
    "reduce_scatter": "reduce_scatter_tensor",
    "all_reduce": "all_reduce",
}
DEFAULT_SIZES = [64 * KIB, MIB, 16 * MIB, 64 * MIB]
QUICK_SIZES = [64 * KIB, MIB]
LATENCY_BYTES = 8
TIME_PER_POINT_S = (0.3, 0.05)  # per contender (default, --quick)
COLUMN_PEERS = ("gloo", "ompi", "mpich", "deepspeed")
# The contender that copies the per-rank size on every rank at once (memcpy2
# measured inside the run, interleaved with the collectives).
IN_RUN_MEMCPY = "memcpy"
# The reduce-scatter's zero-communication limit, measured the same way:
# every rank reduces world private rows of its per-rank size into one with
# the engine's own kernel, storing as its reduce-scatter would.
IN_RUN_REDUCE = "reduce"


# hsdp on pool buffers (allocate_tensor), for the ops whose buffers FSDP2
# allocates that way.
POOL = "hsdp_pool"
POOL_OPS = ("all_gather", "all_gather_inplace", "reduce_scatter")


def _buffers(op: str, numel: int, rank: int, world: int, comm=None) -> dict:
    """The op's buffers; with ``comm`` (a c10d Backend), the buffers peers
    read (the all-gather's input, the reduce-scatter's input) come from its
    allocate_tensor."""
    import torch

    def zeros(n):
        if comm is None:
            return torch.zeros(n)
        return comm.allocate_tensor(n, dtype=torch.float32, device=torch.device("cpu")).zero_()

    if op == "all_gather":
        return {"out": torch.zeros(world * numel), "in": zeros(numel)}
    if op == "all_gather_inplace":
        out = zeros(world * numel)
        return {"out": out, "in": out.narrow(0, rank * numel, numel)}
    if op == "reduce_scatter":
        return {"out": torch.zeros(numel), "in": zeros(world * numel)}
    return {"t": torch.zeros(numel)}


def _bind_torch(op: str, bufs: dict, group) -> Callable[[], None]:
    name = CHECK_NAME[op]
    return collectives.OPS[name].bind(bufs, group)


def _mpi_binder(comm):
    """Binds an op to mpi4py calls on numpy views of the same torch buffers."""
    from mpi4py import MPI

    def bind(op: str, bufs: dict):
        if op == "all_gather":
            a, b = bufs["in"].numpy(), bufs["out"].numpy()
            return lambda: comm.Allgather(a, b)
        if op == "all_gather_inplace":
            b = bufs["out"].numpy()
            return lambda: comm.Allgather(MPI.IN_PLACE, b)
        if op == "reduce_scatter":
            a, b = bufs["in"].numpy(), bufs["out"].numpy()
            return lambda: comm.Reduce_scatter_block(a, b, op=MPI.SUM)
        t = bufs["t"].numpy()
        return lambda: comm.Allreduce(MPI.IN_PLACE, t, op=MPI.SUM)

    return bind


def _deepspeed_binder(ctx: RankContext, info: dict):
    """DeepSpeed's shm all-reduce, as deepspeed.comm.inference_all_reduce
    calls it on the CPU accelerator (op built by the parent's probe)."""
    import torch

    sys.path.insert(0, info["sys_path"])
    from deepspeed.accelerator import get_accelerator

    op = get_accelerator().create_op_builder("ShareMemCommBuilder").load()
    op.initialize(ctx.world, ctx.rank)  # needs LOCAL_SIZE == world, set by the parent
    # DeepSpeed never unlinks its 66 MB shm workspace; once every rank has
    # mapped every peer's (initialize returned everywhere), each rank unlinks
    # its own, so no run leaves files in /dev/shm, even one that is killed.
    import torch.distributed as dist

    dist.barrier(group=ctx.gloo)
    name = "deepspeed_allreduce_buffer_{}_{}_{}_{}".format(
        os.getuid(), os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", ""), ctx.rank
    )
    try:
        os.unlink(os.path.join("/dev/shm", name))
    except OSError:
        pass
    fn = torch.ops.deepspeed.inference_all_reduce_

    def bind(name: str, bufs: dict):
        if name != "all_reduce":
            return None
        t = bufs["t"]
        return lambda: fn(t)

    return bind


def _agree(ctx: RankContext, bad: bool) -> bool:
    """True on every rank when any rank says ``bad`` (gloo group)."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([float(bad)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=ctx.gloo)
    return bool(flag.item())


def _kernel_module():
    """The engine's kernel alone (the reduce-scatter's zero-communication
    limit) lives in the tests' and benchmarks' module, built beside the
    package by scripts/setup.sh, not in the package."""
    try:
        import hsdp_testing
    except ImportError as exc:
        raise RuntimeError(
            "the peers suite needs the hsdp_testing module (the engine's kernel alone): "
            "build with bash scripts/setup.sh, or pip install with "
            "-C cmake.define.HSDP_BUILD_TESTING=ON"
        ) from exc
    return hsdp_testing


def _floors(ctx: RankContext, sampling) -> dict:
    """The 1-rank 8-byte all_reduce, interleaved: hsdp as users run it, hsdp
    with its flight recorder off, and torch's fake backend (a backend that
    does nothing: torch.distributed's own per-call floor)."""
    import torch
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers "fake"

    os.environ["HSDP_TRACE_ENTRIES"] = "0"  # read when the group is created
    try:
        no_recorder = dist.new_group(backend="hsdp")
    finally:
        del os.environ["HSDP_TRACE_ENTRIES"]
    groups = {
        "hsdp": ctx.hsdp,
        "hsdp_no_recorder": no_recorder,
        "torch": dist.new_group(backend="fake"),
    }
    t = torch.zeros(LATENCY_BYTES // 4)
    calls = {name: _bind_torch("all_reduce", {"t": t}, g) for name, g in groups.items()}
    per_call = timing.calibrate(ctx.gloo, calls, sampling)
    samples = timing.sample_interleaved(ctx.rank, ctx.gloo, calls, per_call, sampling)
    return timing.summarise(ctx.world, ctx.gloo, samples, per_call)


def _floor_fields(per_world: dict) -> dict:
    """The JSON's 1-rank 8-byte all_reduce times (None without a launch)."""
    floor = next(iter(per_world.values()))["floor"] if per_world else {}
    return {
        f"floor_1rank_{key}_us": floor[name]["us"] if name in floor else None
        for key, name in [
            ("all_reduce_8B", "hsdp"),
            ("all_reduce_8B_no_recorder", "hsdp_no_recorder"),
            ("torch_all_reduce_8B", "torch"),
        ]
    }


def measure_points(ctx: RankContext, config: dict, peers: dict, problems: dict) -> list[dict]:
    """Every point, contenders hsdp, gloo and ``peers`` ({name: binder});
    ``problems`` collects {peer: reason} of peers that went wrong (dropped)."""
    import torch

    from hsdp_backend import config as settings

    hsdp_testing = _kernel_module()
    sampling: timing.Sampling = config["sampling"]
    stream_from = hsdp_testing.stream_store_bytes_for(
        ctx.world, settings.resolve().stream_store_bytes
    )
    comm = ctx.hsdp._get_backend(torch.device("cpu"))
    pool = comm.supports_tensor_alloc(torch.device("cpu"))
    out = []
    gc.disable()  # no collector pauses inside timed regions
    try:
        for op, nbytes in config["points"]:
            numel = nbytes // 4
            bufs = _buffers(op, numel, ctx.rank, ctx.world)
            calls = {
                "hsdp": _bind_torch(op, bufs, ctx.hsdp),
                "gloo": _bind_torch(op, bufs, ctx.gloo),
            }
            buffers = dict.fromkeys(calls, bufs)
            if pool and op in POOL_OPS:
                buffers[POOL] = _buffers(op, numel, ctx.rank, ctx.world, comm)
                calls[POOL] = _bind_torch(op, buffers[POOL], ctx.hsdp)
            for name, bind in peers.items():
                call = None if name in problems else bind(op, bufs)
                if call is not None:
                    calls[name] = call
                    buffers[name] = bufs
            for name in list(calls):
                wrong = collectives._check_once(
                    CHECK_NAME[op], buffers[name], calls[name], ctx.rank, ctx.world
                )
                if name in ("hsdp", "gloo", POOL) and wrong:
                    raise RuntimeError(
                        f"[rank {ctx.rank}] {name} {op} {format_size(nbytes)}: wrong result: {wrong}"
                    )
                if _agree(ctx, wrong is not None):
                    problems[name] = (
                        f"wrong result at {op} {format_size(nbytes)}: {wrong or 'on another rank'}"
                    )
                    del calls[name]
            # The copy limit under the same conditions: every rank copies its
            # per-rank size at once, interleaved with the collectives, so its
            # caches are as cold as theirs (the parent's memcpy2 reuses warm
            # buffers). A reference, not a peer: nothing to check.
            src, dst = torch.ones(numel), torch.empty(numel)
            calls[IN_RUN_MEMCPY] = functools.partial(dst.copy_, src)
            if op == "reduce_scatter" and ctx.world > 1:
                rows, reduced = torch.ones(ctx.world, numel), torch.empty(numel)
                calls[IN_RUN_REDUCE] = functools.partial(
                    hsdp_testing.reduce_rows, reduced, rows, stream_from
                )
            per_call = timing.calibrate(ctx.gloo, calls, sampling)
            samples = timing.sample_interleaved(ctx.rank, ctx.gloo, calls, per_call, sampling)
            res = {"op": op, "bytes": nbytes, "numel": numel, "checked": sorted(calls)}
            res["us"] = timing.summarise(ctx.world, ctx.gloo, samples, per_call)
            ctx.log(
                f"{op:<20} {format_size(nbytes):>8}  "
                + "  ".join(f"{n} {r['us']:.1f}" for n, r in res["us"].items())
            )
            out.append(res)
            del bufs, calls, buffers
            gc.collect()
    finally:
        gc.enable()
    return out


def mpi_rank_main() -> None:
    """One rank of an MPI launch (started by mpirun / mpiexec; see peer_env)."""
    import datetime

    with open(os.environ["HSDP_PEERS_CONFIG"], "rb") as f:
        job = pickle.load(f)
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "-1")))
    world = int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("PMI_SIZE", "0")))
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(job["port"]),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    import faulthandler

    faulthandler.dump_traceback_later(max(job["timeout"] - 5, 1), exit=True)  # a hang says where
    import torch
    import torch.distributed as dist

    import hsdp_backend  # noqa: F401  registers "hsdp"
    from benchmarks.suite import _cpu_engine

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=min(job["timeout"], 120))
    dist.init_process_group("hsdp", rank=rank, world_size=world, timeout=timeout)
    gloo = dist.new_group(backend="gloo", timeout=timeout)
    from mpi4py import MPI

    ctx = RankContext(rank, world, dist.group.WORLD, gloo, verbose=False)
    problems: dict[str, str] = {}
    points = measure_points(
        ctx, job["config"], {job["peer"]: _mpi_binder(MPI.COMM_WORLD)}, problems
    )
    if rank == 0:
        lib = MPI.Get_library_version().strip().splitlines()[0]
        with open(job["out"], "wb") as f:
            pickle.dump(
                {"points": points, "problems": problems, "engine": _cpu_engine(), "library": lib}, f
            )
    dist.destroy_process_group()


class PeersSuite(Suite):
    name = "peers"
    help = "hsdp vs gloo, Open MPI, MPICH, DeepSpeed shm and memcpy (opt-in peers)"
    default_ranks = (2,)
    output_stem = "peers"
    default_timeout_s = (1800.0, 420.0)
    quick_help = "sizes 64K and 1M, 0.05 s per point per contender"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--peers",
            default=",".join(peer_env.PEERS),
            metavar="P[,P...]",
            help="subset of %(default)s (hsdp and memcpy are always measured)",
        )
        parser.add_argument(
            "--ops", default=",".join(OPS), metavar="OP[,OP...]", help="subset of %(default)s"
        )
        parser.add_argument(
            "--sizes",
            default=None,
            metavar="SIZE[,SIZE...]",
            help="bytes per rank (default 64K,1M,16M,64M)",
        )
        timing.add_sampling_arguments(parser, "0.3; --quick: 0.05")

    def configure(self, args: argparse.Namespace) -> dict:
        peers = [p.strip() for p in args.peers.split(",") if p.strip()]
        ops = [OP_ALIASES.get(o.strip(), o.strip()) for o in args.ops.split(",") if o.strip()]
        for p in peers:
            if p not in peer_env.PEERS:
                raise ValueError(f"unknown peer {p!r}; choose from {', '.join(peer_env.PEERS)}")
        for o in ops:
            if o not in OPS:
                raise ValueError(f"unknown op {o!r}; choose from {', '.join(OPS)}")
        if args.sizes:
            sizes = sorted({report.parse_size(s) for s in args.sizes.split(",") if s.strip()})
        else:
            sizes = QUICK_SIZES if args.quick else DEFAULT_SIZES
        if any(s <= 0 or s % 4 for s in sizes):
            raise ValueError("sizes must be positive multiples of 4 bytes (float32)")
        points = []
        for op in ops:
            extra = [LATENCY_BYTES] if op == "all_reduce" and LATENCY_BYTES not in sizes else []
            points += [(op, s) for s in extra + sizes]
        return {
            "ops": ops,
            "peers_wanted": peers,
            "points": points,
            "dtype": "float32",
            "sampling": timing.sampling_from_args(args, TIME_PER_POINT_S),
            "quick": args.quick,
        }

    def reference(self, config: dict) -> dict:
        print(
            "looking for peers (DeepSpeed's shm op is built here if setup did not)...", flush=True
        )
        config["peers"] = peer_env.find_peers(config["peers_wanted"])
        for name, info in config["peers"].items():
            print(f"  {name}: {'found' if info['available'] else 'MISSING: ' + info['reason']}")
        sizes = sorted({s for _, s in config["points"]})
        print(
            "memcpy1 / memcpy2 reference (parent; 1 and 2 processes, 1 thread each)...", flush=True
        )
        secs = config["sampling"].time_per_point_s
        return {
            "memcpy1": timing.measure_memcpy(sizes, "float32", config["sampling"]),
            "memcpy2": peer_env.measure_memcpy2(sizes, "float32", max(secs, 0.05)),
        }

    def run_all(self, config, ranks, env, deadline, verbose):
        peers = config["peers"]
        per_world, engines, wall = {}, {}, {}
        print("1-rank hsdp all_reduce 8 B (per-call floor)...", flush=True)
        floor = launch(self, 1, {**config, "mode": "floor"}, env, deadline, verbose)["result"]
        for world in ranks:
            t0 = time.monotonic()
            main_env = dict(env)
            ds = peers.get("deepspeed", {})
            if ds.get("available"):
                main_env.update(ds["env"], LOCAL_SIZE=str(world))
            print(f"world size {world}: main launch (hsdp, gloo, deepspeed)...", flush=True)
            main = launch(self, world, {**config, "mode": "main"}, main_env, deadline, verbose)
            engines[world] = main["engine"]
            launches = {"main": main["result"]}
            for peer in peer_env.MPI_PEERS:
                if not peers.get(peer, {}).get("available"):
                    continue
                print(f"world size {world}: {peer} launch (hsdp, gloo, {peer})...", flush=True)
                out, why = peer_env.run_mpi_launch(
                    peer,
                    peers[peer],
                    world,
                    {**config, "peers": {}},
                    env,
                    peer_env.free_port(),
                    deadline - time.monotonic(),
                )
                launches[peer] = out if out is not None else {"failed": why}
                if why:
                    print(f"  {peer} MISSING at W={world}: {why}", flush=True)
            wall[world] = time.monotonic() - t0
            per_world[world] = {"floor": floor, "launches": launches}
            print(f"world size {world}: done in {wall[world]:.1f} s", flush=True)
        return per_world, engines, wall

    def run_rank(self, ctx: RankContext, config: dict):
        if config["mode"] == "floor":
            return _floors(ctx, config["sampling"])
        peers, problems = {}, {}
        ds = config["peers"].get("deepspeed", {})
        if ds.get("available"):
            try:
                bind, err = _deepspeed_binder(ctx, ds), None
            except Exception as exc:  # noqa: BLE001 - reported as missing, not fatal
                bind, err = None, f"{type(exc).__name__}: {exc}"
            if _agree(ctx, err is not None):
                problems["deepspeed"] = f"shm op did not start: {err or 'on another rank'}"
            else:
                peers["deepspeed"] = bind
        points = measure_points(ctx, config, peers, problems)
        return {"points": points, "problems": problems} if ctx.rank == 0 else None

    def report(self, config: dict, reference: dict, per_world: dict) -> dict:
        from benchmarks.peers_report import build_rows, print_tables

        rows, status = build_rows(config, reference, per_world)
        print_tables(config, reference, per_world, rows, status)
        return {
            "dtype": "float32",
            "ops": config["ops"],
            "sampling": dataclasses.asdict(config["sampling"]),
            "peers": {
                n: {k: v for k, v in i.items() if k in ("available", "reason", "version")}
                for n, i in config["peers"].items()
            },
            "peer_status_by_world": status,
            **_floor_fields(per_world),
            "memcpy1": [{"bytes": n, **m} for n, m in sorted(reference["memcpy1"].items())],
            "memcpy2": [{"bytes": n, **m} for n, m in sorted(reference["memcpy2"].items())],
            "results": rows,
        }

    def plot(self, section: dict, path: str) -> None:
        from benchmarks.peers_report import plot

        plot(section, path)


SUITE = PeersSuite()
