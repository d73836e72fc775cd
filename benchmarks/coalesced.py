"""FSDP2's per-module collectives: the 200 parameter shards of a 12-layer ViT-like transformer of
width --dim (dim-0 shards, so a rank's bytes shrink with W) all-gathered (output W x shard) and
reduce-scattered (SUM, input W x shard) in one go, three ways: (a) gloo, one call per tensor;
(b) gloo inside dist._coalescing_manager; (c) hsdp inside dist._coalescing_manager, one fused
collective. Each variant's outputs are first compared with the exact answer (small integers, exact
in any float type) and hsdp's checked call must be one collective (comm_stats); then the three are
timed interleaved (common.measure). Reported: ms per call over all tensors (max over ranks of the
medians), a/c and b/c, hsdp's busbw and the collectives it issued per timed fused call (1).
"""

from __future__ import annotations

import gc
import itertools
import math

import torch
import torch.distributed as dist

import hsdp_backend
from benchmarks import common

LAYERS = 12
AG, RS = common.collective("all_gather"), common.collective("reduce_scatter")
OPS = {"all_gather_into_tensor": AG, "reduce_scatter_tensor": RS}
VARIANTS = ("gloo_per_tensor", "gloo_coalesced", "hsdp_fused")
BUDGET_S = (2.0, 0.5)  # per variant and op: a call moves the whole model


def shard_numels(dim: int, world: int, layers: int = LAYERS) -> list[int]:
    """A rank's shard of each parameter as FSDP2 cuts it (dim 0 in W chunks, the last padded): the
    patch embedding (16x16x3), class token, 197 positions; per layer q, k, v, o and the MLP (4 dim)
    with their biases, two LayerNorms; a final norm, a 1000-class head. 10.0 M elements at dim 256."""
    attn = [(dim, dim), (dim,)] * 4
    layer = attn + [(4 * dim, dim), (4 * dim,), (dim, 4 * dim), (dim,)] + [(dim,)] * 4
    shapes = [(dim, 3 * 16 * 16), (dim,), (dim,), (197, dim), *layer * layers,
              (dim,), (dim,), (1000, dim), (1000,)]  # fmt: skip
    return [-(-s[0] // world) * math.prod(s[1:]) for s in shapes]


def small_ints(numel: int, offset: int, modulus: int, dtype) -> torch.Tensor:
    """Sums of these over a few ranks are exact in fp32 and bf16 alike."""
    return ((torch.arange(numel) + offset) % modulus).to(dtype)


def buffers(op: str, numels: list[int], rank: int, world: int, dtype) -> list[dict]:
    """Tensor i's input depends on the rank, i and (reduce-scatter) the destination chunk, so a
    misplaced block shows; ``want`` is this rank's exact output."""
    out = []
    for i, n in enumerate(numels):
        if op == "all_gather_into_tensor":
            inp = small_ints(n, 7 * rank + i, 13, dtype)
            want = torch.cat([small_ints(n, 7 * s + i, 13, dtype) for s in range(world)])
        else:
            inp = torch.cat([small_ints(n, 5 * rank + 3 * c + i, 11, dtype) for c in range(world)])
            want = sum(small_ints(n, 5 * s + 3 * rank + i, 11, torch.int64) for s in range(world))
        out.append({"in": inp, "out": torch.empty(want.numel(), dtype=dtype), "want": want})
    return out


def bind(variant: str, op: str, bufs: list[dict], ranks: common.Ranks):
    group, collective = ranks.hsdp if variant == "hsdp_fused" else ranks.gloo, OPS[op]

    def per_tensor() -> None:
        for b in bufs:
            collective(b["out"], b["in"], group=group)

    def coalesced() -> None:
        with dist._coalescing_manager(group=group):
            per_tensor()

    return per_tensor if variant == "gloo_per_tensor" else coalesced


def collectives(ranks: common.Ranks) -> int:  # hsdp's since the reset; control is on gloo
    return sum(s["collectives"] for s in hsdp_backend.comm_stats(ranks.hsdp).values())


def point(op: str, numels: list[int], dtype, ranks: common.Ranks, sampling) -> dict:
    bufs = buffers(op, numels, ranks.rank, ranks.world, dtype)
    calls = {v: bind(v, op, bufs, ranks) for v in VARIANTS}
    for v, call in calls.items():
        for b in bufs:
            b["out"].fill_(-1)
        hsdp_backend.reset_comm_stats(ranks.hsdp)
        call()
        for i, b in enumerate(bufs):
            if problem := common.mismatch(b["out"], b["want"]):
                ranks.fail(f"{v} {op} of tensor {i} ({numels[i]} elements)", problem)
        if v == "hsdp_fused" and (sent := collectives(ranks)) != 1:
            ranks.fail(f"{v} {op}", f"{sent} hsdp collectives for one fused call, expected 1")
    counter = itertools.count()  # next(counter): the fused calls made so far, warm-up included
    calls["hsdp_fused"] = lambda call=calls["hsdp_fused"]: (next(counter), call())
    hsdp_backend.reset_comm_stats(ranks.hsdp)
    times = common.measure(ranks, calls, sampling)
    nbytes = sum(numels) * dtype.itemsize
    fused, (a, b, c) = next(counter), (times[v]["us"] for v in VARIANTS)
    return {"op": op, "tensors": len(numels), "bytes_per_rank": nbytes, **times,
            "a_over_c": a / c, "b_over_c": b / c,
            "hsdp_busbw_gbps": common.busbw_gbps(op, nbytes, ranks.world, c),
            "hsdp_fused_calls": fused, "hsdp_comm_stats": hsdp_backend.comm_stats(ranks.hsdp),
            "hsdp_collectives_per_call": collectives(ranks) / fused,
            "spread": max(times[v]["spread"] for v in VARIANTS)}  # fmt: skip


COLUMNS = [
    common.Column("op", lambda r: r["op"]),
    common.Column("MiB/rank", lambda r: r["bytes_per_rank"] / 2**20),
    common.Column("(a) gloo/tensor ms", lambda r: r["gloo_per_tensor"]["us"] / 1e3),
    common.Column("(b) gloo coal. ms", lambda r: r["gloo_coalesced"]["us"] / 1e3),
    common.Column("(c) hsdp fused ms", lambda r: r["hsdp_fused"]["us"] / 1e3),
    common.Column("a/c", lambda r: f"{r['a_over_c']:.1f}x"),
    common.Column("b/c", lambda r: f"{r['b_over_c']:.1f}x"),
    common.Column("hsdp GB/s", lambda r: r["hsdp_busbw_gbps"]),
    common.Column("hsdp coll/call", lambda r: f"{r['hsdp_collectives_per_call']:g}"),
    common.Column("spread", lambda r: f"{100 * r['spread']:.0f}%"),
]
NOTE = "ms: one call over all tensors (max over ranks of the medians); a/c, b/c: (c)'s speedup"


def main() -> None:
    p = common.parser(__doc__)
    p.add_argument("--dim", type=int, default=256, help="transformer width (256: 10 M params)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = p.parse_args()
    if args.dim < 1:
        p.error("--dim must be >= 1")
    dtype, sampling = getattr(torch, args.dtype), common.Sampling.of(args, BUDGET_S)
    ranks = common.init(args)
    numels = shard_numels(args.dim, ranks.world)
    rows = []
    for op in OPS:
        rows.append(point(op, numels, dtype, ranks, sampling))
        ranks.log(f"{op}: " + ", ".join(f"{v} {rows[-1][v]['us'] / 1e3:.2f} ms" for v in VARIANTS))
        gc.collect()
    extra = {"dtype": args.dtype, "dim": args.dim, "layers": LAYERS}
    common.emit("coalesced", args, ranks, COLUMNS, rows, [NOTE], extra)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
