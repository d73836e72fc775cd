"""What FSDP2 does per module: 200 parameter shards gathered and
reduce-scattered in one go, three ways (default 2 ranks).

The 200 parameter shards of a 12-layer ViT-like transformer of width
``--dim`` (``transformer_shapes``; FSDP2 dim-0 shards, so the bytes per rank
shrink with W) are all-gathered (output W x shard) and reduce-scattered
(SUM, input W x shard): (a) one call per tensor on the gloo group, (b) the
same calls inside ``dist._coalescing_manager`` on the gloo group (gloo's
coalesced path), (c) the same calls inside ``dist._coalescing_manager`` on
the hsdp group (one fused collective). Before timing, each variant's
outputs are compared with the exact answer (small integers, exact in any
float type), so the three agree bitwise; then they are sampled interleaved
as benchmarks/timing.py says, one budget per variant. Reported: ms per call
over all tensors (max over ranks of the medians), a/c and b/c, and the
collectives hsdp issued per fused call (``comm_stats``; 1 expected),
against a target of a/c >= 20 on 2 ranks.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
from typing import Any

from benchmarks import report, timing
from benchmarks.collectives import OPS, add_dtype_argument
from benchmarks.report import MIB, Column
from benchmarks.suite import RankContext, Suite

LAYERS = 12
DEFAULT_DIM = 256
COALESCED_OPS = ("all_gather_into_tensor", "reduce_scatter_tensor")
VARIANTS = ("gloo_per_tensor", "gloo_coalesced", "hsdp_fused")
LABELS = {
    "gloo_per_tensor": "(a) gloo, one call per tensor",
    "gloo_coalesced": "(b) gloo, _coalescing_manager",
    "hsdp_fused": "(c) hsdp, _coalescing_manager (fused)",
}
# hsdp fused should be at least this much faster than (a) on 2 ranks.
TARGET_SPEEDUP = 20.0
# Time budget per variant per op (default, --quick): a call moves the whole
# model, so samples are long and few fit into the collectives suite's budget.
TIME_PER_OP_S = (2.0, 0.5)


def transformer_shapes(dim: int, layers: int = LAYERS) -> list[tuple[str, tuple]]:
    """``(name, shape)`` of the parameters of a ViT-like encoder of width ``dim``.

    Per layer: q, k, v, o (``dim x dim``) and their biases, the MLP
    (``4dim x dim``, ``dim x 4dim``) and its biases, two LayerNorms: 6
    matrices and 10 vectors. Around the layers: patch embedding (16x16x3
    patches), class token, position embedding (197 positions), final norm and
    a 1000-class head. 12 layers: 200 tensors, 10.0 M elements at dim 256.
    """
    shapes: list[tuple[str, tuple]] = [
        ("patch_embed.weight", (dim, 3 * 16 * 16)),
        ("patch_embed.bias", (dim,)),
        ("cls_token", (dim,)),
        ("pos_embed", (197, dim)),
    ]
    for i in range(layers):
        p = f"blocks.{i}."
        for proj in ("q", "k", "v", "o"):
            shapes += [(f"{p}attn.{proj}.weight", (dim, dim)), (f"{p}attn.{proj}.bias", (dim,))]
        shapes += [
            (f"{p}mlp.fc1.weight", (4 * dim, dim)),
            (f"{p}mlp.fc1.bias", (4 * dim,)),
            (f"{p}mlp.fc2.weight", (dim, 4 * dim)),
            (f"{p}mlp.fc2.bias", (dim,)),
        ]
        for norm in ("norm1", "norm2"):
            shapes += [(f"{p}{norm}.weight", (dim,)), (f"{p}{norm}.bias", (dim,))]
    shapes += [
        ("norm.weight", (dim,)),
        ("norm.bias", (dim,)),
        ("head.weight", (1000, dim)),
        ("head.bias", (1000,)),
    ]
    return shapes


def shard_numels(shapes: list[tuple[str, tuple]], world: int) -> list[int]:
    """Elements of one rank's shard of each parameter, as FSDP2 shards:
    dim 0 split into ``world`` equal chunks, the last one padded."""
    return [-(-shape[0] // world) * math.prod(shape[1:]) for _, shape in shapes]


def _small_ints(numel: int, offset: int, modulus: int, dtype):
    """``(arange(numel) + offset) % modulus``: small integers, whose sums over a
    few ranks are exact in fp32 and bf16 alike."""
    import torch

    return ((torch.arange(numel) + offset) % modulus).to(dtype)


def _fill(op: str, bufs: list[dict], rank: int, world: int) -> None:
    """Writes rank ``rank``'s inputs: tensor ``i`` depends on the rank, ``i`` and, for
    reduce-scatter, the destination chunk, so a misplaced block shows."""
    for i, b in enumerate(bufs):
        if op == "all_gather_into_tensor":
            n = b["in"].numel()
            b["in"].copy_(_small_ints(n, 7 * rank + i, 13, b["in"].dtype))
        else:
            n = b["out"].numel()
            for c, chunk in enumerate(b["in"].view(world, n)):
                chunk.copy_(_small_ints(n, 5 * rank + 3 * c + i, 11, chunk.dtype))


def _expected(op: str, numel: int, i: int, rank: int, world: int, dtype):
    """The exact output of tensor ``i`` on ``rank`` (see ``_fill``)."""
    import torch

    if op == "all_gather_into_tensor":
        return torch.cat([_small_ints(numel, 7 * s + i, 13, dtype) for s in range(world)])
    total = sum(_small_ints(numel, 5 * s + 3 * rank + i, 11, torch.int64) for s in range(world))
    return total.to(dtype)


def _buffers(op: str, numels: list[int], world: int, dtype) -> list[dict]:
    """One ``{"in", "out"}`` pair per tensor, in the layout of the collectives suite's binders."""
    import torch

    if op == "all_gather_into_tensor":
        return [
            {"in": torch.zeros(n, dtype=dtype), "out": torch.zeros(world * n, dtype=dtype)}
            for n in numels
        ]
    return [
        {"in": torch.zeros(world * n, dtype=dtype), "out": torch.zeros(n, dtype=dtype)}
        for n in numels
    ]


def _bind_variant(variant: str, op: str, bufs: list[dict], ctx: RankContext):
    """A no-argument closure: ``op`` over every tensor of ``bufs``, the ``variant`` way."""
    import torch.distributed as dist

    group = ctx.hsdp if variant == "hsdp_fused" else ctx.gloo
    per_tensor = [OPS[op].bind(b, group) for b in bufs]

    def one_by_one() -> None:
        for fn in per_tensor:
            fn()

    if variant == "gloo_per_tensor":
        return one_by_one

    def coalesced() -> None:
        with dist._coalescing_manager(group=group):
            one_by_one()

    return coalesced


TABLE_COLUMNS = [
    Column("op", 22, lambda r: r["op"], left=True),
    Column("(a) gloo/tensor", 15, lambda r: f"{r['gloo_per_tensor']['us'] / 1e3:.2f}"),
    Column("(b) gloo coal.", 14, lambda r: f"{r['gloo_coalesced']['us'] / 1e3:.2f}"),
    Column("(c) hsdp fused", 14, lambda r: f"{r['hsdp_fused']['us'] / 1e3:.2f}"),
    Column("a/c", 7, lambda r: f"{r['a_over_c']:.1f}x"),
    Column("b/c", 7, lambda r: f"{r['b_over_c']:.1f}x"),
    Column("hsdp GB/s", 9, lambda r: f"{r['hsdp_busbw_gbps']:.2f}"),
    Column("hsdp coll/call", 14, lambda r: f"{r['hsdp_collectives_per_call']:g}"),
    Column("reps", 4, lambda r: str(r["hsdp_fused"]["reps"])),
    Column("spread", 6, lambda r: f"{100 * r['spread']:.0f}%"),
]
LEGEND = """
ms = max over ranks of each rank's median time of one call over all tensors (the three
variants interleaved); a/c, b/c = how many times faster hsdp fused is than (a) / (b);
hsdp GB/s = hsdp fused busbw (nccl-tests); hsdp coll/call = collectives hsdp issued per
fused call (comm_stats, all ops, during the measurement); spread as in the collectives
suite. Every variant's output was checked exactly before timing."""


class CoalescedSuite(Suite):
    name = "coalesced"
    help = (
        "200 transformer parameter shards: all-gather / reduce-scatter one call per tensor "
        "on gloo, gloo coalesced, hsdp fused"
    )
    default_ranks = (2,)
    output_stem = "bench_coalesced"
    quick_help = "0.5 s per op per variant, at most 50 samples"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        add_dtype_argument(parser)
        parser.add_argument(
            "--dim",
            type=int,
            default=DEFAULT_DIM,
            metavar="D",
            help=f"width of the {LAYERS}-layer transformer whose 200 parameter shards "
            "are gathered / reduce-scattered (default: %(default)s: 10 M parameters, "
            "about 19 MiB fp32 per rank on 2 ranks)",
        )
        timing.add_sampling_arguments(parser, "2.0; --quick: 0.5")

    def configure(self, args: argparse.Namespace) -> dict:
        if args.dim < 1:
            raise ValueError("--dim must be >= 1")
        return {
            "dim": args.dim,
            "layers": LAYERS,
            "shapes": transformer_shapes(args.dim),
            "dtype": args.dtype,
            "sampling": timing.sampling_from_args(args, TIME_PER_OP_S),
        }

    def run_rank(self, ctx: RankContext, config: dict) -> list[dict] | None:
        import torch

        dtype = getattr(torch, config["dtype"])
        numels = shard_numels(config["shapes"], ctx.world)
        out = []
        gc.disable()  # no collector pauses inside timed regions
        try:
            for op in COALESCED_OPS:
                res = self._measure_op(ctx, op, numels, dtype, config["sampling"])
                ctx.log(
                    f"{op:<24} "
                    + "  ".join(f"{v} {res[v]['us'] / 1e3:8.2f} ms" for v in VARIANTS)
                    + f"  ({res['hsdp_fused']['reps']} reps)"
                )
                out.append(res)
                gc.collect()
        finally:
            gc.enable()
        return out if ctx.rank == 0 else None

    def _measure_op(
        self, ctx: RankContext, op: str, numels: list[int], dtype, sampling: timing.Sampling
    ) -> dict:
        """Check every variant, calibrate, measure interleaved; the same on every rank."""
        import torch

        import hsdp_backend

        bufs = _buffers(op, numels, ctx.world, dtype)
        call = {v: _bind_variant(v, op, bufs, ctx) for v in VARIANTS}
        expected = [_expected(op, n, i, ctx.rank, ctx.world, dtype) for i, n in enumerate(numels)]
        for v in VARIANTS:
            # All three must produce the exact answer (hence agree bitwise).
            _fill(op, bufs, ctx.rank, ctx.world)
            for b in bufs:
                b["out"].fill_(-1)
            call[v]()
            for i, (b, want) in enumerate(zip(bufs, expected, strict=True)):
                if not torch.equal(b["out"], want):
                    bad = (b["out"].double() - want.double()).abs().argmax().item()
                    raise RuntimeError(
                        f"[rank {ctx.rank}/{ctx.world}] {LABELS[v]}: {op} of tensor {i} "
                        f"({numels[i]} elements) returned a wrong result: element {bad}: "
                        f"got {b['out'][bad].item()}, expected {want[bad].item()}"
                    )
        del expected

        calls_per_sample = timing.calibrate(ctx.gloo, call, sampling)
        hsdp_backend.reset_comm_stats(ctx.hsdp)
        samples = timing.sample_interleaved(ctx.rank, ctx.gloo, call, calls_per_sample, sampling)
        stats = hsdp_backend.comm_stats(ctx.hsdp)
        fused_calls = len(samples["hsdp_fused"]) * calls_per_sample
        # Everything hsdp sent during the measurement was for the fused calls
        # (the control plane is the gloo group).
        collectives = sum(s["collectives"] for s in stats.values())
        result = {
            "op": op,
            "tensors": len(numels),
            "bytes_per_rank": sum(numels) * torch.empty((), dtype=dtype).element_size(),
        }
        result.update(timing.summarise(ctx.world, ctx.gloo, samples, calls_per_sample))
        result["hsdp_comm_stats"] = stats
        result["hsdp_fused_calls"] = fused_calls
        result["hsdp_collectives_per_call"] = collectives / fused_calls
        return result

    def report(self, config: dict, reference: dict, per_world: dict[int, Any]) -> dict:
        rows = []
        for world, points in sorted(per_world.items()):
            table = []
            for p in points:
                op = OPS[p["op"]]
                secs = p["hsdp_fused"]["us"] / 1e6
                total = op.total_bytes(p["bytes_per_rank"], world)
                row = {"world": world, **p}
                row["a_over_c"] = p["gloo_per_tensor"]["us"] / p["hsdp_fused"]["us"]
                row["b_over_c"] = p["gloo_coalesced"]["us"] / p["hsdp_fused"]["us"]
                row["hsdp_busbw_gbps"] = op.bus_factor(world) * total / secs / 1e9
                row["spread"] = max(timing.spread(p[v]["rank0_samples_us"]) for v in VARIANTS)
                table.append(row)
            r0 = table[0]
            report.print_table(
                TABLE_COLUMNS,
                table,
                title=f"world size {world} ({r0['tensors']} {config['dtype']} tensors, dim "
                f"{config['dim']}, {r0['bytes_per_rank'] / MIB:.1f} MiB per rank; "
                "ms per call over all tensors):",
            )
            rows += table
        print(LEGEND)
        verdicts = self._print_verdicts(rows)
        return {
            "dtype": config["dtype"],
            "dim": config["dim"],
            "layers": config["layers"],
            "shapes": [{"name": n, "shape": list(s)} for n, s in config["shapes"]],
            "variants": {v: LABELS[v] for v in VARIANTS},
            "target_speedup_a_over_c_2_ranks": TARGET_SPEEDUP,
            "sampling": dataclasses.asdict(config["sampling"]),
            "results": rows,
            "verdicts": verdicts,
        }

    @staticmethod
    def _print_verdicts(rows: list[dict]) -> list[dict]:
        """One line per op and world: one collective per fused call; the 2-rank speedup target."""
        print()
        verdicts = []
        for r in rows:
            one = r["hsdp_collectives_per_call"] == 1
            v = {"world": r["world"], "op": r["op"], "one_collective_per_call": one}
            line = (
                f"W={r['world']} {r['op']}: hsdp collectives per fused call "
                f"{r['hsdp_collectives_per_call']:g} ({'ok' if one else 'NOT 1'})"
            )
            if r["world"] == 2:
                v["target_met"] = r["a_over_c"] >= TARGET_SPEEDUP
                line += (
                    f"; hsdp fused vs (a) {r['a_over_c']:.1f}x, target >= "
                    f"{TARGET_SPEEDUP:g}x {'met' if v['target_met'] else 'NOT met'}"
                )
            print(line)
            verdicts.append(v)
        return verdicts

    def plot(self, section: dict, path: str) -> None:
        worlds = sorted({r["world"] for r in section["results"]})
        title = f"fused coalesced collectives, {section['dtype']}, transformer dim {section['dim']}"
        with report.figure(path, len(worlds), title) as axes:
            for ax, world in zip(axes, worlds, strict=True):
                rows = [r for r in section["results"] if r["world"] == world]
                series = [
                    (section["variants"][v], [r[v]["us"] / 1e3 for r in rows], {}) for v in VARIANTS
                ]
                positions = report.grouped_bars(ax, [r["op"] for r in rows], series)
                fused_ms = series[VARIANTS.index("hsdp_fused")][1]
                for x, y, r in zip(positions[-1], fused_ms, rows, strict=True):
                    ax.annotate(
                        f"{r['a_over_c']:.1f}x / {r['b_over_c']:.1f}x",
                        (x, y),
                        ha="center",
                        va="bottom",
                        fontsize="small",
                    )
                ax.set_yscale("log")
                top = max(r[v]["us"] for r in rows for v in VARIANTS) / 1e3
                ax.set_ylim(top=top * 10)  # room for the legend above the bars
                ax.set_ylabel("ms per call over all tensors (median, max over ranks)")
                mib = rows[0]["bytes_per_rank"] / MIB
                ax.set_title(f"W={world}, {rows[0]['tensors']} tensors, {mib:.1f} MiB per rank")
                ax.grid(True, axis="y", which="both", alpha=0.3)
                ax.legend(
                    fontsize="small", title="labels over (c): a/c / b/c", title_fontsize="small"
                )


SUITE = CoalescedSuite()
