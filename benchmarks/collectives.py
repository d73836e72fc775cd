"""all_gather_into_tensor, reduce_scatter_tensor and all_reduce per message size: hsdp against gloo
over the same ranks and buffers, against memcpy.

    python -m benchmarks collectives [--ranks 2,4] [--sizes 4K,1M,16M] [--ops ag,rs,ar] [--quick]

Every point first runs each contender once on rank-dependent data and compares the result with the
exact answer (a wrong collective fails the run); then the contenders are timed interleaved
(benchmarks/common.py). For all-gather and reduce-scatter a third contender, ``hsdp_pool``, runs
hsdp on buffers from the group's ``allocate_tensor`` (the shared-memory pool, as FSDP2 with
``set_allocate_memory_from_process_group_for_comm(True)``); every one of its calls must take
the pooled path (``buffer_stats``). It runs where one host's engine reads peers' pool buffers (from
``HSDP_SHM_DIRECT_READ_BYTES`` a rank, 8 KiB unless set). ``ar_async`` and ``ar_cb`` are all_reduce issued async and
waited for, bare or through a callback chained on its future, as DDP's comm hooks do.

Columns: times are the slowest rank's median per call; busbw as nccl-tests (all-gather and
reduce-scatter: size x W x (W-1)/W per time; all-reduce: size x 2(W-1)/W); speedup = gloo / hsdp;
pool gain = hsdp / hsdp_pool; hsdp/memcpy = hsdp's busbw over rank 0's single-thread memcpy GB/s at
that size; 3xcopy = three memcpy of the message, the copies a shared-memory all-reduce cannot
avoid; spread = interquartile range / median of the noisier contender (a large one: do not trust
the row). all_reduce always adds an 8-byte latency row.
"""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist

import hsdp_backend
from benchmarks import common
from hsdp_backend import config

OPS = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")
ASYNC_OPS = ("all_reduce_async", "all_reduce_callback")
ALIASES = {
    "ag": OPS[0],
    "all_gather": OPS[0],
    "rs": OPS[1],
    "reduce_scatter": OPS[1],
    "ar": OPS[2],
    "ar_async": ASYNC_OPS[0],
    "ar_cb": ASYNC_OPS[1],
}
POOLED = OPS[:2]  # the buffers FSDP2 allocates: the all-gather's output, the reduce-scatter's input
SIZES, QUICK_MAX = [4 << (2 * i + 10) for i in range(8)], 1 << 20  # 4 KiB .. 64 MiB
LATENCY_BYTES = 8
BUDGET_S = (0.3, 0.1)  # per point and contender (full, --quick)
ALL_GATHER, REDUCE_SCATTER = common.collective("all_gather"), common.collective("reduce_scatter")


def buffers(op: str, numel: int, ranks: common.Ranks, dtype, comm=None, in_place=True) -> dict:
    """FSDP2's forms (the all-gather in place, unless not ``in_place``); with ``comm`` the buffer
    peers read (what FSDP2 allocates through ``allocate_tensor``) comes from that backend."""

    def zeros(n):
        if comm is None:
            return torch.zeros(n, dtype=dtype)
        return comm.allocate_tensor(n, dtype=dtype, device=torch.device("cpu")).zero_()

    if op == OPS[0] and not in_place:
        return {"out": torch.zeros(ranks.world * numel, dtype=dtype), "in": zeros(numel)}
    if op == OPS[0]:
        out = zeros(ranks.world * numel)
        return {"out": out, "in": out.narrow(0, ranks.rank * numel, numel)}
    if op == OPS[1]:
        return {"out": torch.zeros(numel, dtype=dtype), "in": zeros(ranks.world * numel)}
    return {"t": torch.zeros(numel, dtype=dtype)}


def bind(op: str, b: dict, group):
    if op == OPS[0]:
        return lambda: ALL_GATHER(b["out"], b["in"], group=group)
    if op == OPS[1]:
        return lambda: REDUCE_SCATTER(b["out"], b["in"], group=group)
    if op == ASYNC_OPS[0]:
        return lambda: dist.all_reduce(b["t"], group=group, async_op=True).wait()
    if op == ASYNC_OPS[1]:
        return lambda: (
            dist.all_reduce(b["t"], group=group, async_op=True)
            .get_future()
            .then(lambda f: f.value()[0])
            .wait()
        )
    return lambda: dist.all_reduce(b["t"], group=group)


def check(op: str, b: dict, call, ranks: common.Ranks) -> str | None:
    """Runs ``call`` once on rank-dependent data; what is wrong, or None. The all-reduce's tensor
    is left zeroed, so that repeated sums stay finite while timed."""
    r, w = ranks.rank, ranks.world
    if op == OPS[0]:
        b["out"].fill_(-1)
        b["in"].fill_(r + 1)
        call()
        got = b["out"].view(w, -1)
        want = torch.arange(1, w + 1, dtype=got.dtype).unsqueeze(1).expand_as(got)
    elif op == OPS[1]:
        for j, chunk in enumerate(b["in"].view(w, -1)):  # rank r's chunk j holds (r+1)(j+1)
            chunk.fill_((r + 1) * (j + 1))
        call()
        got, want = b["out"], torch.full_like(b["out"], (r + 1) * w * (w + 1) // 2)
    else:
        b["t"].fill_(r + 1)
        call()
        got, want = b["t"], torch.full_like(b["t"], w * (w + 1) // 2)
    problem = common.mismatch(got, want)
    if "t" in b:
        b["t"].zero_()
    return problem


def point(op: str, nbytes: int, dtype, ranks: common.Ranks, sampling) -> dict:
    numel = nbytes // dtype.itemsize
    plain = buffers(op, numel, ranks, dtype)
    bufs = {"hsdp": plain, "gloo": plain}
    calls = {"hsdp": bind(op, plain, ranks.hsdp), "gloo": bind(op, plain, ranks.gloo)}
    comm = ranks.hsdp._get_backend(torch.device("cpu"))
    # One host's engine reads peers' pool buffers from HSDP_SHM_DIRECT_READ_BYTES a rank (8 KiB
    # unless set: csrc/common/Config.hpp); below, and across hosts, the pool buys nothing to time.
    pooled_from = config.resolve().direct_read_bytes or 8 << 10
    if (
        op in POOLED
        and nbytes >= pooled_from
        and hsdp_backend.cpu_route(ranks.hsdp) == "shm"
        and comm.supports_tensor_alloc(torch.device("cpu"))
    ):
        bufs["hsdp_pool"] = buffers(op, numel, ranks, dtype, comm)
        calls["hsdp_pool"] = bind(op, bufs["hsdp_pool"], ranks.hsdp)
    for name, call in calls.items():
        problem = check(op, bufs[name], call, ranks)
        if problem:
            ranks.fail(f"{name} {op} of {common.format_size(nbytes)}", problem)
    pooled = hsdp_backend.buffer_stats(ranks.hsdp)["pooled_calls"]
    times = common.measure(ranks, calls, sampling)
    pooled = hsdp_backend.buffer_stats(ranks.hsdp)["pooled_calls"] - pooled
    if "hsdp_pool" in times:
        t = times["hsdp_pool"]
        expected = max(sampling.warmup, 1) + t["reps"] * t["calls_per_sample"]  # warm-up, timed
        if pooled != expected:
            ranks.fail(
                f"hsdp_pool {op} of {common.format_size(nbytes)}",
                f"{pooled} of {expected} calls took the pooled path, expected all",
            )
    return times


def row(op: str, nbytes: int, world: int, times: dict, memcpy_us: float) -> dict:
    all_reduce = op.startswith("all_reduce")
    out = {
        "op": op,
        "bytes_per_rank": nbytes,
        "memcpy_us": memcpy_us,
        "copy_floor_us": 3 * memcpy_us if all_reduce else None,
    }
    for name, t in times.items():
        out[name] = dict(t, busbw_gbps=common.busbw_gbps(op, nbytes, world, t["us"]))
    out["speedup"] = times["gloo"]["us"] / times["hsdp"]["us"]
    if "hsdp_pool" in times:
        out["pool_gain"] = times["hsdp"]["us"] / times["hsdp_pool"]["us"]
    out["hsdp_memcpy_fraction"] = out["hsdp"]["busbw_gbps"] / (nbytes / memcpy_us / 1e3)
    out["spread"] = max(t["spread"] for t in times.values())
    return out


COLUMNS = [
    common.Column("op", lambda r: r["op"]),
    common.Column("size/rank", lambda r: common.format_size(r["bytes_per_rank"])),
    common.Column("hsdp us", lambda r: r["hsdp"]["us"]),
    common.Column("gloo us", lambda r: r["gloo"]["us"]),
    common.Column("hsdp GB/s", lambda r: r["hsdp"]["busbw_gbps"]),
    common.Column("gloo GB/s", lambda r: r["gloo"]["busbw_gbps"]),
    common.Column("speedup", lambda r: f"{r['speedup']:.2f}x"),
    common.Column("pool gain", lambda r: f"{r['pool_gain']:.2f}x" if "pool_gain" in r else "-"),
    common.Column("hsdp/memcpy", lambda r: r["hsdp_memcpy_fraction"]),
    common.Column("3xcopy us", lambda r: r["copy_floor_us"] or "-"),
    common.Column("spread", lambda r: f"{100 * r['spread']:.0f}%"),
]


def main() -> None:
    p = common.parser(__doc__)
    p.add_argument("--ops", default="ag,rs,ar", help="any of %s, ar_async, ar_cb" % ", ".join(OPS))
    p.add_argument("--sizes", type=common.sizes, default=None, help="bytes per rank, e.g. 4K,1M")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = p.parse_args()
    ops = list(dict.fromkeys(ALIASES.get(o, o) for o in args.ops.split(",") if o))
    unknown = [o for o in ops if o not in OPS + ASYNC_OPS]
    if unknown:
        p.error(f"unknown op {unknown[0]!r}: choose from {', '.join(OPS + ASYNC_OPS)}")
    dtype, sampling = getattr(torch, args.dtype), common.Sampling.of(args, BUDGET_S)
    sizes = args.sizes or [s for s in SIZES if not args.quick or s <= QUICK_MAX]
    if any(s % dtype.itemsize for s in sizes):
        p.error(f"every size must be a multiple of {args.dtype}'s {dtype.itemsize} bytes")
    points = [
        (op, s)
        for op in ops
        for s in (sorted({LATENCY_BYTES, *sizes}) if op.startswith("all_reduce") else sizes)
    ]
    ranks = common.init(args)
    # Rank 0's single-thread copy of each size, while the others wait: the physical limit.
    memcpy = (
        {s: common.memcpy_us(s, dtype, sampling) for s in {s for _, s in points}}
        if ranks.rank == 0
        else {}
    )
    box = [memcpy]
    dist.broadcast_object_list(box, src=0, group=ranks.gloo)
    rows = []
    for op, nbytes in points:
        times = point(op, nbytes, dtype, ranks, sampling)
        rows.append(row(op, nbytes, ranks.world, times, box[0][nbytes]))
        ranks.log(
            f"{op} {common.format_size(nbytes)}: hsdp {times['hsdp']['us']:.1f} us, "
            f"gloo {times['gloo']['us']:.1f} us"
        )
        gc.collect()
    common.emit("collectives", args, ranks, COLUMNS, rows, extra={"dtype": args.dtype})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
