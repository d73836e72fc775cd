"""Low-precision AVG against the fp64 mean, hsdp against gloo; times nothing.

For bf16 and fp16, all_reduce and reduce_scatter_tensor with ReduceOp.AVG run on hsdp and on gloo
over standard-normal inputs (fp32 from a per-rank seed, cast to the low-precision type). Every rank
regenerates all ranks' inputs, so the reference, the fp64 mean of the low-precision inputs, needs
no communication. An output element's error is |got - ref| / ulp(ref) in the output type; max and
mean over every rank's output are reported per dtype and op (elements whose reference is exactly 0
counted apart), with whether hsdp stays within 0.5 ulp (+1e-3 for its fp32 division) and at or
below gloo. gloo rejects AVG: it runs SUM and divides by W in the output type (column reduction).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from benchmarks import common

DTYPES = ("bfloat16", "float16")
RS = common.collective("reduce_scatter")
NUMEL = {False: (1 << 20, 256 << 10), True: (64 << 10, 16 << 10)}  # (all_reduce, rs out) a rank
SLACK = 1e-3  # hsdp divides in fp32 before its final rounding
FLAGS = ("hsdp_within_half_ulp", "hsdp_max_le_gloo", "hsdp_mean_le_gloo")


def ulp_error(got, ref, dtype):
    """|got - ref| in units in the last place of ``dtype`` at ``ref`` (fp64): ulp(x) =
    2**(floor(log2|x|) - mantissa bits), the exponent clamped at the smallest normal one."""
    finfo = torch.finfo(dtype)
    mantissa_bits, min_exp = round(-math.log2(finfo.eps)), round(math.log2(finfo.tiny))
    _, exp = torch.frexp(ref)  # ref = m * 2**exp with 0.5 <= |m| < 1
    floor_log2 = torch.where(ref == 0, min_exp, exp - 1).clamp_(min=min_exp)
    return (got.double() - ref).abs_() / torch.exp2((floor_log2 - mantissa_bits).double())


def reduced(op: str, inp, group, redop, world: int):
    out = inp.clone() if op == "all_reduce" else inp.new_empty(inp.numel() // world)
    if op == "all_reduce":
        dist.all_reduce(out, op=redop, group=group)
    else:
        RS(out, inp, op=redop, group=group)
    return out


def error_stats(ranks: common.Ranks, got, ref, dtype) -> dict:
    """Ulp error over every rank's output. Elements whose reference is 0 are counted apart (any
    non-zero result there is ~1e37 subnormal ulps off and would swamp max and mean)."""
    zero = ref == 0
    err = ulp_error(got[~zero], ref[~zero], dtype)
    worst = torch.cat([err, err.new_zeros(1)]).max().reshape(1)
    sums = torch.tensor([err.sum(), err.numel(), zero.sum(), (got[zero] != 0).sum()]).double()
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=ranks.gloo)
    dist.all_reduce(sums, group=ranks.gloo)
    total, n, zeros, nonzero = sums.tolist()
    return {"max_ulp": worst.item(), "mean_ulp": total / max(n, 1), "elements": int(n),
            "zero_refs": int(zeros), "nonzero_at_zero_refs": int(nonzero)}  # fmt: skip


def row(op: str, d: str, xs: list, lo: int, n_out: int, ranks: common.Ranks) -> dict:
    """``xs``: every rank's fp32 input; this rank's output is ``[lo, lo + n_out)`` of the mean."""
    dtype, w = getattr(torch, d), ranks.world
    # Sums of a few bf16/fp16 values are exact in fp64, and so is the mean for W = 2**k.
    want = sum(x[lo : lo + n_out].to(dtype).double() for x in xs) / w
    inp = xs[ranks.rank].to(dtype)
    hsdp = reduced(op, inp, ranks.hsdp, dist.ReduceOp.AVG, w)
    try:
        gloo, how = reduced(op, inp, ranks.gloo, dist.ReduceOp.AVG, w), "AVG"
    except (RuntimeError, ValueError):  # gloo has no AVG: SUM, then / W in the output dtype
        gloo, how = reduced(op, inp, ranks.gloo, dist.ReduceOp.SUM, w).div_(w), "SUM, /W in dtype"
    h, g = error_stats(ranks, hsdp, want, dtype), error_stats(ranks, gloo, want, dtype)
    ranks.log(f"{d} {op}: max ulp hsdp {h['max_ulp']:.4g}, gloo {g['max_ulp']:.4g}")
    return {
        "dtype": d, "op": op, "world": w, "numel_out_per_rank": n_out,
        "hsdp": {"reduction": "AVG", **h}, "gloo": {"reduction": how, **g},
        "hsdp_within_half_ulp": h["max_ulp"] <= 0.5 + SLACK and not h["nonzero_at_zero_refs"],
        "hsdp_max_le_gloo": h["max_ulp"] <= g["max_ulp"],
        "hsdp_mean_le_gloo": h["mean_ulp"] <= g["mean_ulp"],
    }  # fmt: skip


YES = {True: "yes", False: "NO"}
COLUMNS = [
    common.Column("dtype", lambda r: r["dtype"]),
    common.Column("op", lambda r: r["op"]),
    *(common.Column(f"{b} {s}", lambda r, b=b, s=s: r[b][f"{s}_ulp"])
      for b in ("hsdp", "gloo") for s in ("max", "mean")),
    common.Column("gloo reduction", lambda r: r["gloo"]["reduction"]),
    common.Column("ref=0", lambda r: r["hsdp"]["zero_refs"]),
    common.Column("non-0 there hsdp/gloo",
                  lambda r: f"{r['hsdp']['nonzero_at_zero_refs']}/{r['gloo']['nonzero_at_zero_refs']}"),
    common.Column(f"hsdp<=0.5ulp+{SLACK:g}", lambda r: YES[r["hsdp_within_half_ulp"]]),
    common.Column("hsdp<=gloo max, mean",
                  lambda r: f"{YES[r['hsdp_max_le_gloo']]}, {YES[r['hsdp_mean_le_gloo']]}"),
]  # fmt: skip


def main() -> None:
    p = common.parser(__doc__, sampling=False)
    p.add_argument("--ar-numel", type=common.parse_size, help="all_reduce elements a rank (1M)")
    p.add_argument("--rs-numel", type=common.parse_size, help="reduce_scatter out a rank (256K)")
    p.add_argument("--seed", type=int, default=0, help="base seed of the inputs")
    args = p.parse_args()
    ar, rs = NUMEL[args.quick]
    numel = {"all_reduce": args.ar_numel or ar, "reduce_scatter_tensor": args.rs_numel or rs}
    ranks = common.init(args)
    rows = []
    for i, (op, n_out) in enumerate(numel.items()):
        n_in, lo = (n_out, 0) if op == "all_reduce" else (n_out * ranks.world, n_out * ranks.rank)
        # Every rank's input from its own seed: the reference needs no communication.
        gens = [torch.Generator().manual_seed(args.seed + 1000 * i + s) for s in range(ranks.world)]
        xs = [torch.randn(n_in, generator=g) for g in gens]
        rows += [row(op, d, xs, lo, n_out, ranks) for d in DTYPES]
    rows.sort(key=lambda r: (r["dtype"], r["op"]))
    ok = {k: all(r[k] for r in rows) for k in FLAGS}
    note = f"ulps of the output dtype against the fp64 mean; {numel} a rank; everywhere: {ok}"
    extra = {"dtypes": list(DTYPES), "numel_out_per_rank": numel, "seed": args.seed,
             "half_ulp_slack": SLACK, "everywhere": ok}  # fmt: skip
    common.emit("numerics", args, ranks, COLUMNS, rows, [note], extra)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
