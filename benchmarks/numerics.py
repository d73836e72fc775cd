"""Low-precision AVG against an fp64 reference, hsdp against gloo (default 2,
4 and 8 ranks). Times nothing.

For bf16 and fp16, all_reduce and reduce_scatter_tensor with
``ReduceOp.AVG`` run on hsdp and on gloo over standard-normal inputs (fp32
from a per-rank seed, cast to the low-precision type). Every rank
regenerates all ranks' inputs, so the reference, the fp64 mean of the
low-precision inputs, needs no communication. The error of each output
element is ``|got - ref| / ulp(ref)`` in the output type (``ulp_error``);
max and mean over every rank's output are reported per (dtype, op, W), as a
markdown table (elements whose reference is exactly 0 are counted apart),
with whether hsdp stays within 0.5 ulp (+1e-3 for its fp32 division) and at
or below gloo. A backend that rejects AVG would run SUM and divide by W in
the output type (the table's reduction column says which ran).
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from benchmarks import report
from benchmarks.report import KIB, MIB, Column
from benchmarks.suite import BACKENDS, RankContext, Suite

DTYPES = ("bfloat16", "float16")
NUMERICS_OPS = ("all_reduce", "reduce_scatter_tensor")
DEFAULT_NUMEL = {"all_reduce": MIB, "reduce_scatter_tensor": 256 * KIB}
QUICK_NUMEL = {"all_reduce": 64 * KIB, "reduce_scatter_tensor": 16 * KIB}
# hsdp may exceed 0.5 ulp by this much: the fp32 division before the final
# rounding to the low-precision type.
HALF_ULP_SLACK = 1e-3


def ulp_error(got, ref, dtype):
    """``|got - ref|`` in units in the last place of ``dtype`` at ``ref`` (fp64 tensors).

    ulp(x) = 2**(floor(log2|x|) - mantissa bits), the exponent clamped at the
    smallest normal one (subnormals and zeros: the subnormal spacing).
    """
    import torch

    finfo = torch.finfo(dtype)
    mantissa_bits = round(-math.log2(finfo.eps))  # bf16: 7, fp16: 10
    min_exp = round(math.log2(finfo.tiny))  # bf16: -126, fp16: -14
    _, exp = torch.frexp(ref)  # ref = m * 2**exp with 0.5 <= |m| < 1
    floor_log2 = torch.where(ref == 0, min_exp, exp - 1).clamp_(min=min_exp)
    ulp = torch.exp2((floor_log2 - mantissa_bits).to(torch.float64))
    return (got.to(torch.float64) - ref).abs_().div_(ulp)


def _input(seed: int, op_index: int, rank: int, numel: int):
    """Rank ``rank``'s fp32 input for op ``op_index``: standard normal, its own fixed seed."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1000 * op_index + rank)
    return torch.randn(numel, generator=gen)


def _avg_collective(op: str, inp, group, world: int, allow_sum_fallback: bool):
    """Runs ``op`` with AVG on ``inp`` (not modified); returns ``(output, reduction)``.

    With ``allow_sum_fallback``, a backend that rejects AVG gets SUM and the
    output is divided by ``world`` in its own dtype (``reduction`` says so).
    """
    import torch.distributed as dist

    if op == "all_reduce":
        out = inp.clone()

        def run(redop) -> None:
            dist.all_reduce(out, op=redop, group=group)

    else:
        out = inp.new_empty(inp.numel() // world)
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

        def run(redop) -> None:
            fn(out, inp, op=redop, group=group)

    try:
        run(dist.ReduceOp.AVG)
        return out, "AVG"
    except (RuntimeError, ValueError):
        if not allow_sum_fallback:
            raise
    if op == "all_reduce":
        out.copy_(inp)  # whatever the rejected call left there
    run(dist.ReduceOp.SUM)
    out.div_(world)
    return out, "SUM, /W in dtype"


def _error_stats(ctx: RankContext, got, ref, dtype) -> dict:
    """Ulp error of ``got`` against ``ref`` (fp64) over every rank's output (gloo group).

    Elements whose reference is exactly zero are left out of the ulp
    statistics: with the ulp clamped at the subnormal spacing, any non-zero
    result there is ~1e37 ulps off and would swamp max and mean. They are
    counted instead, with how many came out non-zero and the largest
    magnitude among those.
    """
    import torch
    import torch.distributed as dist

    zero = ref == 0
    err = ulp_error(got[~zero], ref[~zero], dtype)
    at_zero = got[zero].to(torch.float64).abs()
    worst = torch.tensor(
        [err.max().item() if err.numel() else 0.0, at_zero.max().item() if zero.any() else 0.0],
        dtype=torch.float64,
    )
    sums = torch.tensor(
        [
            err.sum().item(),
            err.numel(),
            (err > 0.5 + HALF_ULP_SLACK).sum().item(),
            zero.sum().item(),
            (at_zero != 0).sum().item(),
        ],
        dtype=torch.float64,
    )
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=ctx.gloo)
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=ctx.gloo)
    n = int(sums[1].item())
    return {
        "max_ulp": worst[0].item(),
        "mean_ulp": sums[0].item() / n if n else 0.0,
        "elements": n,
        "elements_over_half_ulp": int(sums[2].item()),
        "zero_refs": int(sums[3].item()),
        "nonzero_at_zero_refs": int(sums[4].item()),
        "max_abs_at_zero_refs": worst[1].item(),
    }


def _format_ulp(x: float) -> str:
    """Four decimals for ordinary errors, three significant digits for huge ones."""
    return f"{x:.4f}" if x < 1e4 else f"{x:.3g}"


_YES = {True: "yes", False: "**no**"}
TABLE_COLUMNS = [
    Column("dtype", 0, lambda r: r["dtype"], left=True),
    Column("op", 0, lambda r: r["op"], left=True),
    Column("W", 0, lambda r: str(r["world"])),
    Column("hsdp max", 0, lambda r: _format_ulp(r["hsdp"]["max_ulp"])),
    Column("hsdp mean", 0, lambda r: _format_ulp(r["hsdp"]["mean_ulp"])),
    Column("gloo max", 0, lambda r: _format_ulp(r["gloo"]["max_ulp"])),
    Column("gloo mean", 0, lambda r: _format_ulp(r["gloo"]["mean_ulp"])),
    Column("gloo reduction", 0, lambda r: r["gloo"]["reduction"], left=True),
    Column(
        "ref = 0: n (non-zero hsdp / gloo)",
        0,
        lambda r: (
            f"{r['hsdp']['zero_refs']} ({r['hsdp']['nonzero_at_zero_refs']} / "
            f"{r['gloo']['nonzero_at_zero_refs']})"
        ),
        left=True,
    ),
    Column(
        f"hsdp <= 0.5 ulp (+{HALF_ULP_SLACK:g})",
        0,
        lambda r: _YES[r["hsdp_within_half_ulp"]],
        left=True,
    ),
    Column(
        "hsdp <= gloo (max, mean)",
        0,
        lambda r: f"{_YES[r['hsdp_max_le_gloo']]}, {_YES[r['hsdp_mean_le_gloo']]}",
        left=True,
    ),
]


class NumericsSuite(Suite):
    name = "numerics"
    help = (
        "bf16/fp16 AVG all_reduce / reduce_scatter error in ulps vs an fp64 reference, hsdp vs gloo"
    )
    default_ranks = (2, 4, 8)
    output_stem = "bench_numerics"
    quick_help = "64K all_reduce and 16K reduce_scatter elements per rank"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--ar-numel",
            default=None,
            metavar="N",
            help="all_reduce elements per rank, K/M suffixes allowed (default: 1M; --quick: 64K)",
        )
        parser.add_argument(
            "--rs-numel",
            default=None,
            metavar="N",
            help="reduce_scatter_tensor output elements per rank; the input is W times that "
            "(default: 256K; --quick: 16K)",
        )
        parser.add_argument(
            "--seed", type=int, default=0, metavar="S", help="base seed of the inputs (default: 0)"
        )

    def configure(self, args: argparse.Namespace) -> dict:
        defaults = QUICK_NUMEL if args.quick else DEFAULT_NUMEL
        given = {"all_reduce": args.ar_numel, "reduce_scatter_tensor": args.rs_numel}
        numel = {op: report.parse_size(given[op]) if given[op] else defaults[op] for op in given}
        if min(numel.values()) < 1:
            raise ValueError("--ar-numel and --rs-numel must be >= 1")
        return {"dtypes": DTYPES, "ops": NUMERICS_OPS, "numel": numel, "seed": args.seed}

    def run_rank(self, ctx: RankContext, config: dict) -> list[dict] | None:
        import torch

        out = []
        for op_index, op in enumerate(config["ops"]):
            n_out = config["numel"][op]
            n_in = n_out if op == "all_reduce" else ctx.world * n_out
            lo = 0 if op == "all_reduce" else ctx.rank * n_out  # this rank's output slice
            # The reference needs every rank's input: regenerate them all
            # from their seeds (no communication).
            ref = {d: torch.zeros(n_out, dtype=torch.float64) for d in config["dtypes"]}
            for s in range(ctx.world):
                x = _input(config["seed"], op_index, s, n_in)
                if s == ctx.rank:
                    mine = x
                for d in config["dtypes"]:
                    ref[d] += x[lo : lo + n_out].to(getattr(torch, d)).to(torch.float64)
            for d in config["dtypes"]:
                dtype = getattr(torch, d)
                # Sums of a few bf16/fp16 values are exact in fp64, and so is
                # the division for power-of-two W (else off by < 1e-16).
                ref[d] /= ctx.world
                inp = mine.to(dtype)
                row = {"dtype": d, "op": op, "world": ctx.world, "numel_out_per_rank": n_out}
                for b, group in (("hsdp", ctx.hsdp), ("gloo", ctx.gloo)):
                    got, reduction = _avg_collective(op, inp, group, ctx.world, b == "gloo")
                    row[b] = {"reduction": reduction, **_error_stats(ctx, got, ref[d], dtype)}
                ctx.log(
                    f"{d:<9} {op:<22} max ulp: hsdp {_format_ulp(row['hsdp']['max_ulp'])}  "
                    f"gloo {_format_ulp(row['gloo']['max_ulp'])}"
                )
                out.append(row)
        return out if ctx.rank == 0 else None

    def report(self, config: dict, reference: dict, per_world: dict[int, Any]) -> dict:
        rows = [r for _, points in sorted(per_world.items()) for r in points]
        rows.sort(key=lambda r: (r["dtype"], r["op"], r["world"]))
        for r in rows:
            h, g = r["hsdp"], r["gloo"]
            r["hsdp_within_half_ulp"] = (
                h["max_ulp"] <= 0.5 + HALF_ULP_SLACK and h["nonzero_at_zero_refs"] == 0
            )
            r["hsdp_max_le_gloo"] = h["max_ulp"] <= g["max_ulp"]
            r["hsdp_mean_le_gloo"] = h["mean_ulp"] <= g["mean_ulp"]
        n = config["numel"]
        report.print_table(
            TABLE_COLUMNS,
            rows,
            title="AVG error in ulps of the output dtype vs the fp64 mean of the low-precision "
            f"inputs (standard normal, seed {config['seed']}; all_reduce {n['all_reduce']} "
            f"elements per rank, reduce_scatter_tensor {n['reduce_scatter_tensor']} out per "
            "rank; max / mean over every rank's output elements whose reference is not exactly "
            "0; those are counted apart, with how many each backend returned non-zero):\n",
            markdown=True,
        )
        hsdp_reductions = {r["hsdp"]["reduction"] for r in rows}
        print(
            f"\nhsdp reduction: {', '.join(sorted(hsdp_reductions))}. "
            f"hsdp within 0.5 ulp everywhere: {all(r['hsdp_within_half_ulp'] for r in rows)}; "
            "hsdp <= gloo everywhere (max and mean): "
            f"{all(r['hsdp_max_le_gloo'] and r['hsdp_mean_le_gloo'] for r in rows)}"
        )
        return {
            "dtypes": list(config["dtypes"]),
            "ops": list(config["ops"]),
            "numel_out_per_rank": n,
            "seed": config["seed"],
            "half_ulp_slack": HALF_ULP_SLACK,
            "results": rows,
        }

    def plot(self, section: dict, path: str) -> None:
        dtypes = section["dtypes"]
        title = "AVG error vs fp64 reference (AR = all_reduce, RS = reduce_scatter_tensor)"
        with report.figure(path, len(dtypes), title, panel_size=(6.5, 4.5)) as axes:
            colors = report.colors()
            for ax, d in zip(axes, dtypes, strict=True):
                rows = [r for r in section["results"] if r["dtype"] == d]
                series = [
                    (
                        f"{b} {stat}",
                        [r[b][f"{stat}_ulp"] for r in rows],
                        {
                            "color": colors[BACKENDS.index(b)],
                            "hatch": "" if stat == "max" else "//",
                            "alpha": 1.0 if stat == "max" else 0.5,
                        },
                    )
                    for stat in ("max", "mean")
                    for b in BACKENDS
                ]
                labels = [
                    f"{'AR' if r['op'] == 'all_reduce' else 'RS'} W={r['world']}" for r in rows
                ]
                report.grouped_bars(ax, labels, series)
                ax.axhline(0.5, color="black", linestyle=":", label="0.5 ulp")
                ax.set_yscale("log")
                ax.set_ylabel("error (ulps of the output dtype)")
                ax.set_title(f"{d} AVG")
                ax.grid(True, axis="y", which="both", alpha=0.3)
                ax.legend(fontsize="small")


SUITE = NumericsSuite()
