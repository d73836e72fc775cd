"""all_gather_into_tensor / reduce_scatter_tensor / all_reduce, hsdp against
gloo, per message size (default 2 and 4 ranks).

For all_gather and reduce_scatter, a third contender, ``hsdp_pool``, runs
hsdp on buffers from the group's ``allocate_tensor`` (the shared-memory
pool: peers read them with plain loads), as FSDP2 does with
``set_allocate_memory_from_process_group_for_comm(True)``; ``pool gain`` is
hsdp's time on ordinary buffers / its time on pool buffers. Every timed
pool call must take the pooled path (checked with ``buffer_stats``).

For every (op, size) point: each backend runs the op once on rank-dependent
data and the result is compared with the exact answer (a fast wrong
collective is not a result; a wrong one fails the run); then both backends
are calibrated, measured interleaved and reduced over ranks as
benchmarks/timing.py says, on the same buffers (FSDP2's forms: the
all-gather in place).

Derived numbers follow nccl-tests: algbw = total bytes / time, where total
bytes = bytes per rank * W for all_gather / reduce_scatter and the message
size for all_reduce; busbw = algbw * (W-1)/W (all_gather, reduce_scatter) or
* 2(W-1)/W (all_reduce). ``speedup`` is gloo time / hsdp time (> 1: hsdp is
faster). The physical reference is single-thread ``dst.copy_(src)`` of the
same sizes, measured in the parent in the same run (median, same sampling):
``hsdp/memcpy`` is hsdp busbw / memcpy GB/s at that size, and for
all_reduce ``3xcopy`` is the time of the unavoidable copies of a
shared-memory all-reduce (copy in, reduce, copy out: about three memcpy of
the message). all_reduce always adds an 8-byte latency row. GB/s are 1e9
bytes per second; sizes are binary (KiB, MiB). ``spread`` (interquartile
range / median of rank 0's samples, the noisier backend) says how far a row
can be trusted: a few percent on a quiet machine, more when other processes
compete for the cores.

Output: one table per world size, the JSON, and a bus-bandwidth plot.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from benchmarks import report, timing
from benchmarks.report import KIB, MIB, Column, format_size
from benchmarks.suite import BACKENDS, RankContext, Suite

# Each binder returns a no-argument closure: one synchronous call of the op
# on ``bufs`` over ``group``, with everything resolved up front. FSDP2 calls
# all_gather_single / reduce_scatter_single where torch has them (>= 2.14,
# where the *_into_tensor / *_tensor names are deprecated aliases); all of
# them reach the backend's _allgather_base / _reduce_scatter_base.


def _bind_all_gather(bufs: dict, group) -> Callable[[], None]:
    import torch.distributed as dist

    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    out, inp = bufs["out"], bufs["in"]
    return lambda: fn(out, inp, group=group)


def _bind_reduce_scatter(bufs: dict, group) -> Callable[[], None]:
    import torch.distributed as dist

    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    out, inp, op = bufs["out"], bufs["in"], dist.ReduceOp.SUM
    return lambda: fn(out, inp, op=op, group=group)


def _bind_all_reduce(bufs: dict, group) -> Callable[[], None]:
    import torch.distributed as dist

    fn, t, op = dist.all_reduce, bufs["t"], dist.ReduceOp.SUM
    return lambda: fn(t, op=op, group=group)


def _bind_all_reduce_async(bufs: dict, group) -> Callable[[], None]:
    """all_reduce issued async, then waited for: the hand-off to the group's
    worker and back (DDP's bucket all-reduces take this path)."""
    import torch.distributed as dist

    fn, t, op = dist.all_reduce, bufs["t"], dist.ReduceOp.SUM
    return lambda: fn(t, op=op, group=group, async_op=True).wait()


def _bind_all_reduce_callback(bufs: dict, group) -> Callable[[], None]:
    """all_reduce issued async, a callback chained on its future (as DDP
    comm hooks do), the chained future waited for."""
    import torch.distributed as dist

    fn, t, op = dist.all_reduce, bufs["t"], dist.ReduceOp.SUM

    def call():
        fn(t, op=op, group=group, async_op=True).get_future().then(_first_value).wait()

    return call


def _first_value(fut):
    return fut.value()[0]


@dataclass(frozen=True)
class CollectiveOp:
    """One benchmarked collective: how to call it and count its bytes."""

    name: str
    bind: Callable[[dict, Any], Callable[[], None]]  # bind(bufs, group) -> call()
    # busbw = bus_factor(W) * total_bytes(per-rank bytes, W) / time
    bus_factor: Callable[[int], float]
    total_bytes: Callable[[int, int], int]


OPS: dict[str, CollectiveOp] = {
    op.name: op
    for op in (
        CollectiveOp(
            "all_gather_into_tensor",
            _bind_all_gather,
            bus_factor=lambda w: (w - 1) / w,
            total_bytes=lambda n, w: n * w,
        ),
        CollectiveOp(
            "reduce_scatter_tensor",
            _bind_reduce_scatter,
            bus_factor=lambda w: (w - 1) / w,
            total_bytes=lambda n, w: n * w,
        ),
        CollectiveOp(
            "all_reduce",
            _bind_all_reduce,
            bus_factor=lambda w: 2 * (w - 1) / w,
            total_bytes=lambda n, w: n,
        ),
        CollectiveOp(
            "all_reduce_async",
            _bind_all_reduce_async,
            bus_factor=lambda w: 2 * (w - 1) / w,
            total_bytes=lambda n, w: n,
        ),
        CollectiveOp(
            "all_reduce_callback",
            _bind_all_reduce_callback,
            bus_factor=lambda w: 2 * (w - 1) / w,
            total_bytes=lambda n, w: n,
        ),
    )
}
# What runs without --ops (the async forms on request: --ops ar,ar_async,ar_cb).
DEFAULT_OPS = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")
OP_ALIASES = {
    "all_gather": "all_gather_into_tensor",
    "allgather": "all_gather_into_tensor",
    "ag": "all_gather_into_tensor",
    "reduce_scatter": "reduce_scatter_tensor",
    "reducescatter": "reduce_scatter_tensor",
    "rs": "reduce_scatter_tensor",
    "allreduce": "all_reduce",
    "ar": "all_reduce",
    "ar_async": "all_reduce_async",
    "ar_cb": "all_reduce_callback",
}
DEFAULT_SIZES = [4 * KIB * 4**i for i in range(8)]  # 4K .. 64M, powers of 4
QUICK_MAX_SIZE = MIB
LATENCY_BYTES = 8  # the extra all_reduce latency row
# Time budget per point per backend (default, --quick).
TIME_PER_POINT_S = (0.3, 0.1)


# The ops FSDP2 allocates buffers for (the all-gather's output, the
# reduce-scatter's input), measured on pool buffers too.
POOLED_OPS = ("all_gather_into_tensor", "reduce_scatter_tensor")
POOL = "hsdp_pool"


def _make_buffers(op: str, numel: int, rank: int, world: int, dtype, comm=None) -> dict:
    """Buffers for one point, shared by both backends (FSDP2 forms). With
    ``comm`` (a c10d Backend), the buffer FSDP2 would allocate through
    ``allocate_tensor`` comes from it."""
    import torch

    def zeros(n):
        if comm is None:
            return torch.zeros(n, dtype=dtype)
        return comm.allocate_tensor(n, dtype=dtype, device=torch.device("cpu")).zero_()

    if op == "all_gather_into_tensor":
        out = zeros(world * numel)
        return {"out": out, "in": out.narrow(0, rank * numel, numel)}  # in place, as FSDP2
    if op == "reduce_scatter_tensor":
        return {"out": torch.zeros(numel, dtype=dtype), "in": zeros(world * numel)}
    return {"t": torch.zeros(numel, dtype=dtype)}


def _check_once(op: str, bufs: dict, call: Callable[[], None], rank: int, world: int) -> str | None:
    """Runs ``call`` once on rank-dependent data; returns what is wrong, or None.

    Leaves the buffers in a state safe for repeated timing (all_reduce's
    tensor is zeroed so repeated SUMs stay finite).
    """
    import torch

    tri = world * (world + 1) // 2
    if op == "all_gather_into_tensor":
        bufs["out"].fill_(-1)
        bufs["in"].fill_(rank + 1)
        call()
        got = bufs["out"].view(world, -1)
        want = torch.arange(1, world + 1, dtype=got.dtype).unsqueeze(1).expand_as(got)
    elif op == "reduce_scatter_tensor":
        chunks = bufs["in"].view(world, -1)
        for j in range(world):  # chunk j of rank r holds (r+1)*(j+1)
            chunks[j].fill_((rank + 1) * (j + 1))
        bufs["out"].fill_(-1)
        call()
        got = bufs["out"]
        want = torch.full_like(got, (rank + 1) * tri)
    else:
        bufs["t"].fill_(rank + 1)
        call()
        got = bufs["t"]
        want = torch.full_like(got, tri)
    tol = 0.0 if got.dtype == torch.float32 else 1 / 128
    ok = torch.allclose(got.float(), want.float(), rtol=tol, atol=0.0)
    if op.startswith("all_reduce"):
        bufs["t"].zero_()
    if ok:
        return None
    bad = (got.float() - want.float()).abs().flatten().argmax().item()
    return f"element {bad}: got {got.flatten()[bad].item()}, expected {want.flatten()[bad].item()}"


def add_dtype_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="element type (default: %(default)s)",
    )


TABLE_COLUMNS = [
    Column("op", 22, lambda r: r["op"], left=True),
    Column("size/rank", 9, lambda r: format_size(r["bytes_per_rank"])),
    Column("hsdp us", 11, lambda r: f"{r['hsdp']['us']:.1f}"),
    Column("gloo us", 11, lambda r: f"{r['gloo']['us']:.1f}"),
    Column("hsdp GB/s", 9, lambda r: f"{r['hsdp']['busbw_gbps']:.3f}"),
    Column("gloo GB/s", 9, lambda r: f"{r['gloo']['busbw_gbps']:.3f}"),
    Column("speedup", 7, lambda r: f"{r['speedup']:.2f}x"),
    Column("pool us", 9, lambda r: f"{r[POOL]['us']:.1f}" if POOL in r else "-"),
    Column("pool gain", 9, lambda r: f"{r['pool_gain']:.2f}x" if POOL in r else "-"),
    Column("hsdp/memcpy", 11, lambda r: f"{r['hsdp_memcpy_fraction']:.3f}"),
    Column(
        "3xcopy us",
        10,
        lambda r: "-" if r["copy_floor_us"] is None else f"{r['copy_floor_us']:.1f}",
    ),
    Column("spread", 6, lambda r: f"{100 * r['spread']:.0f}%"),
]
MEMCPY_COLUMNS = [
    Column("size", 8, lambda m: format_size(m["bytes"])),
    Column("us", 10, lambda m: f"{m['us']:.2f}"),
    Column("GB/s", 8, lambda m: f"{m['gbps']:.2f}"),
]
LEGEND = """
latency = max over ranks of each rank's median per-call time; busbw as in nccl-tests;
speedup = gloo time / hsdp time; pool gain = hsdp time / hsdp time on pool buffers
(allocate_tensor; all_gather and reduce_scatter); hsdp/memcpy = hsdp busbw / single-thread memcpy GB/s;
3xcopy = 3 x memcpy time of the message (copy in + reduce + copy out), all_reduce only;
spread = interquartile range / median of rank 0's samples, the noisier backend: ratios
of rows with a large spread (say > 50%) are not to be trusted."""


class CollectivesSuite(Suite):
    name = "collectives"
    help = "all_gather_into_tensor / reduce_scatter_tensor / all_reduce, hsdp vs gloo, per size"
    output_stem = "bench"
    quick_help = "sizes up to 1 MiB, 0.1 s per point per backend, at most 50 samples (CI)"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        add_dtype_argument(parser)
        parser.add_argument(
            "--ops",
            default=",".join(DEFAULT_OPS),
            metavar="OP[,OP...]",
            help=f"default %(default)s; any of {', '.join(OPS)} "
            "(aliases: all_gather, reduce_scatter, ag, rs, ar, ar_async, ar_cb)",
        )
        parser.add_argument(
            "--sizes",
            default=None,
            metavar="SIZE[,SIZE...]",
            help="bytes per rank, e.g. 4K,1M,16M (default: 4K..64M in powers of 4; "
            "--quick: up to 1M); all_reduce always adds an 8 B latency row",
        )
        timing.add_sampling_arguments(parser, "0.3; --quick: 0.1")

    def configure(self, args: argparse.Namespace) -> dict:
        ops = []
        for item in args.ops.split(","):
            item = item.strip().lower()
            name = OP_ALIASES.get(item, item)
            if name not in OPS:
                raise ValueError(f"unknown op {item!r}; choose from {', '.join(OPS)}")
            if name not in ops:
                ops.append(name)
        if args.sizes:
            sizes = sorted({report.parse_size(s) for s in args.sizes.split(",") if s.strip()})
        else:
            sizes = [s for s in DEFAULT_SIZES if not args.quick or s <= QUICK_MAX_SIZE]
        elem = 2 if args.dtype == "bfloat16" else 4
        for s in sizes + [LATENCY_BYTES]:
            if s <= 0 or s % elem:
                raise ValueError(
                    f"size {s} B is not a positive multiple of the {args.dtype} element ({elem} B)"
                )
        points = []
        for op in ops:
            op_sizes = sizes
            if op.startswith("all_reduce") and LATENCY_BYTES not in sizes:
                op_sizes = [LATENCY_BYTES, *sizes]
            points += [(op, s) for s in op_sizes]
        return {
            "ops": ops,
            "points": points,
            "dtype": args.dtype,
            "sampling": timing.sampling_from_args(args, TIME_PER_POINT_S),
        }

    def reference(self, config: dict) -> dict:
        print(f"memcpy reference (parent, 1 thread, {config['dtype']})...", flush=True)
        sizes = [s for _, s in config["points"]]
        return {"memcpy": timing.measure_memcpy(sizes, config["dtype"], config["sampling"])}

    def run_rank(self, ctx: RankContext, config: dict) -> list[dict] | None:
        import torch

        dtype = getattr(torch, config["dtype"])
        elem = torch.empty((), dtype=dtype).element_size()
        out = []
        gc.disable()  # no collector pauses inside timed regions
        try:
            for op, nbytes in config["points"]:
                res = self._measure_point(
                    ctx, op, nbytes, nbytes // elem, dtype, config["sampling"]
                )
                ctx.log(
                    f"{op:<24} {format_size(nbytes):>8}  hsdp {res['hsdp']['us']:10.1f} us"
                    f"  gloo {res['gloo']['us']:10.1f} us  ({res['hsdp']['reps']} reps)"
                )
                out.append(res)
                gc.collect()
        finally:
            gc.enable()
        return out if ctx.rank == 0 else None

    def _measure_point(
        self, ctx: RankContext, op: str, nbytes: int, numel: int, dtype, sampling: timing.Sampling
    ) -> dict:
        """Check, calibrate, measure interleaved; returns the point (same on every rank)."""
        import torch

        import hsdp_backend

        bufs = _make_buffers(op, numel, ctx.rank, ctx.world, dtype)
        groups = {"hsdp": ctx.hsdp, "gloo": ctx.gloo}
        call = {b: OPS[op].bind(bufs, groups[b]) for b in BACKENDS}
        buffers = dict.fromkeys(BACKENDS, bufs)
        comm = ctx.hsdp._get_backend(torch.device("cpu"))
        if op in POOLED_OPS and comm.supports_tensor_alloc(torch.device("cpu")):
            buffers[POOL] = _make_buffers(op, numel, ctx.rank, ctx.world, dtype, comm)
            call[POOL] = OPS[op].bind(buffers[POOL], ctx.hsdp)

        for b in call:
            problem = _check_once(op, buffers[b], call[b], ctx.rank, ctx.world)
            if problem:
                raise RuntimeError(
                    f"[rank {ctx.rank}/{ctx.world}] {b} {op} of {format_size(nbytes)} "
                    f"returned a wrong result: {problem}"
                )

        calls_per_sample = timing.calibrate(ctx.gloo, call, sampling)
        hsdp_backend.reset_comm_stats(ctx.hsdp)
        pooled_before = hsdp_backend.buffer_stats(ctx.hsdp)["pooled_calls"]
        samples = timing.sample_interleaved(ctx.rank, ctx.gloo, call, calls_per_sample, sampling)
        stats = hsdp_backend.comm_stats(ctx.hsdp)
        pooled = hsdp_backend.buffer_stats(ctx.hsdp)["pooled_calls"] - pooled_before
        if POOL in call and pooled != len(samples[POOL]) * calls_per_sample:
            raise RuntimeError(
                f"[rank {ctx.rank}/{ctx.world}] {op} of {format_size(nbytes)}: {pooled} pooled "
                f"calls, expected every timed call on pool buffers to take the pooled path"
            )
        result = {"op": op, "bytes": nbytes, "numel": numel}
        result.update(timing.summarise(ctx.world, ctx.gloo, samples, calls_per_sample))
        result["hsdp"]["comm_stats"] = stats.get(op)
        return result

    def report(self, config: dict, reference: dict, per_world: dict[int, Any]) -> dict:
        memcpy = reference["memcpy"]
        report.print_table(
            MEMCPY_COLUMNS,
            [{"bytes": n, **m} for n, m in sorted(memcpy.items())],
            title=f"memcpy (single thread, dst.copy_(src), {config['dtype']}):",
        )
        rows = []
        for world, points in sorted(per_world.items()):
            table = []
            for p in points:
                op = OPS[p["op"]]
                total = op.total_bytes(p["bytes"], world)
                row = {
                    "world": world,
                    "op": p["op"],
                    "bytes_per_rank": p["bytes"],
                    "numel_per_rank": p["numel"],
                }
                for b in BACKENDS:
                    secs = p[b]["us"] / 1e6
                    row[b] = dict(
                        p[b],
                        algbw_gbps=total / secs / 1e9,
                        busbw_gbps=op.bus_factor(world) * total / secs / 1e9,
                    )
                if POOL in p:
                    secs = p[POOL]["us"] / 1e6
                    row[POOL] = dict(p[POOL], busbw_gbps=op.bus_factor(world) * total / secs / 1e9)
                    row["pool_gain"] = p["hsdp"]["us"] / p[POOL]["us"]
                row["speedup"] = p["gloo"]["us"] / p["hsdp"]["us"]
                row["spread"] = max(timing.spread(p[b]["rank0_samples_us"]) for b in BACKENDS)
                mc = memcpy[p["bytes"]]
                row["memcpy_gbps"] = mc["gbps"]
                row["hsdp_memcpy_fraction"] = row["hsdp"]["busbw_gbps"] / mc["gbps"]
                row["copy_floor_us"] = 3 * mc["us"] if p["op"].startswith("all_reduce") else None
                table.append(row)
            report.print_table(
                TABLE_COLUMNS,
                table,
                title=f"world size {world} ({config['dtype']}; busbw in GB/s):",
            )
            rows += table
        print(LEGEND)
        return {
            "dtype": config["dtype"],
            "ops": config["ops"],
            "sampling": dataclasses.asdict(config["sampling"]),
            "sample_target_s": timing.SAMPLE_TARGET_S,
            "memcpy": [{"bytes": n, **m} for n, m in sorted(memcpy.items())],
            "results": rows,
        }

    def plot(self, section: dict, path: str) -> None:
        ops = section["ops"]
        worlds = sorted({r["world"] for r in section["results"]})
        title = f"hsdp vs gloo, {section['dtype']}, busbw (nccl-tests convention)"
        with report.figure(path, len(ops), title, panel_size=(5.5, 4.5)) as axes:
            colors = report.colors()
            for ax, op in zip(axes, ops, strict=True):
                xs_all = set()
                for k, world in enumerate(worlds):
                    rows = [
                        r
                        for r in section["results"]
                        if r["op"] == op and r["world"] == world and r["bytes_per_rank"] >= KIB
                    ]
                    xs = [r["bytes_per_rank"] for r in rows]
                    xs_all.update(xs)
                    color = colors[k % len(colors)]
                    for b, style in (("hsdp", "o-"), ("gloo", "x--")):
                        ax.plot(
                            xs,
                            [r[b]["busbw_gbps"] for r in rows],
                            style,
                            color=color,
                            label=f"{b} W={world}",
                        )
                mc = [m for m in section["memcpy"] if m["bytes"] in xs_all]
                ax.plot(
                    [m["bytes"] for m in mc],
                    [m["gbps"] for m in mc],
                    ":",
                    color="black",
                    label="memcpy (1 thread)",
                )
                ax.set_title(op)
                ticks = sorted(xs_all)
                if not ticks:  # only the 8 B latency row: nothing to draw
                    ax.set_axis_off()
                    continue
                ax.set_xscale("log", base=2)
                ax.set_yscale("log")
                ax.set_xticks(ticks, [report.short_size(t) for t in ticks])
                ax.set_xlabel("bytes per rank")
                ax.set_ylabel("bus bandwidth (GB/s)")
                ax.grid(True, which="both", alpha=0.3)
                ax.legend(fontsize="small")


SUITE = CollectivesSuite()
