"""hsdp's cost per call on a device's route against that device's plain backend, in the same
processes, interleaved: on CUDA, hsdp (its inner ProcessGroupNCCL) against a plain ``nccl``
group over the same ranks; on CPU, hsdp against ``gloo`` (what a machine without a GPU can run).

One rank per GPU (``nccl`` runs a world of one on one GPU), or 2 ranks on CPU. For every op and
message size, two pairs of contenders, measured interleaved as benchmarks/timing.py says:

- ``host``: the time a call takes to return (on CUDA the kernel is only enqueued: what hsdp adds
  on the host is the difference);
- ``sync``: a call and then a wait for the device (``torch.cuda.synchronize``; on CPU the
  call is synchronous already).

Ops: all_reduce SUM and AVG, reduce_scatter_tensor, all_gather_into_tensor (FSDP2's forms),
and a coalesced block of 16 reduce-scatters (``_coalescing_manager``). Sizes are bytes per rank
(float32). Every point is checked first: hsdp's result must equal the plain backend's. The
ratio columns are hsdp / plain (< 1: hsdp is faster); the target on CUDA is 1.05 at most.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from benchmarks import report, timing
from benchmarks.report import KIB, MIB, Column, format_size
from benchmarks.suite import RankContext, Suite

DEFAULT_SIZES = [8, 1 * KIB, 64 * KIB, 1 * MIB, 16 * MIB, 256 * MIB]
QUICK_SIZES = [8, 64 * KIB, 16 * MIB]
COALESCED_BLOCK = 16
OPS = ("all_reduce_sum", "all_reduce_avg", "reduce_scatter", "all_gather", "rs_coalesced16")


def _binders(device, world: int, nbytes: int) -> dict[str, Callable]:
    """Per op: bind(group) -> (call, result): one synchronous call on buffers of
    its own, and the tensor that holds its result."""
    import torch
    import torch.distributed as dist

    n = max(1, nbytes // 4)

    def data(numel: int) -> torch.Tensor:
        return (
            torch.arange(numel, dtype=torch.float32, device=device)
            .remainder_(7)
            .add_(dist.get_rank())
        )

    def all_reduce(op):
        def bind(group):
            t = data(n)
            return (lambda: dist.all_reduce(t, op=op, group=group)), t

        return bind

    def reduce_scatter(group):
        inp, out = data(n * world), torch.empty(n, device=device)
        return (lambda: dist.reduce_scatter_tensor(out, inp, group=group)), out

    def all_gather(group):
        inp, out = data(n), torch.empty(n * world, device=device)
        return (lambda: dist.all_gather_into_tensor(out, inp, group=group)), out

    def rs_coalesced(group):
        m = max(1, n // COALESCED_BLOCK)
        ins = [data(m * world) for _ in range(COALESCED_BLOCK)]
        outs = [torch.empty(m, device=device) for _ in range(COALESCED_BLOCK)]

        # On CUDA the block is NCCL's own group launch (start/end coalescing);
        # gloo has none, so on CPU torch issues the block as one coalesced call.
        block_device = device if device.type == "cuda" else None

        def call():
            with dist._coalescing_manager(group=group, device=block_device):
                for o, i in zip(outs, ins):
                    dist.reduce_scatter_tensor(o, i, group=group)

        return call, outs[-1]

    return {
        "all_reduce_sum": all_reduce(dist.ReduceOp.SUM),
        "all_reduce_avg": all_reduce(dist.ReduceOp.AVG),
        "reduce_scatter": reduce_scatter,
        "all_gather": all_gather,
        "rs_coalesced16": rs_coalesced,
    }


class DeviceCallsSuite(Suite):
    name = "device_calls"
    help = "per-call cost of hsdp's device route against the plain backend (nccl on CUDA)"
    takes_ranks = False
    default_ranks = (2,)
    output_stem = "bench_device_calls"
    default_timeout_s = (1800.0, 300.0)
    quick_help = f"sizes {','.join(map(format_size, QUICK_SIZES))} and shorter samples"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--device",
            choices=("auto", "cuda", "cpu"),
            default="auto",
            help="cuda: one rank per GPU against nccl; cpu: 2 ranks against gloo "
            "(default: cuda when torch sees a GPU)",
        )
        parser.add_argument(
            "--sizes",
            type=lambda text: [report.parse_size(s) for s in text.split(",")],
            default=None,
            metavar="S[,S...]",
            help="bytes per rank (default: "
            + ",".join(map(format_size, DEFAULT_SIZES))
            + "; --quick: "
            + ",".join(map(format_size, QUICK_SIZES))
            + ")",
        )
        parser.add_argument(
            "--ops",
            type=lambda text: text.split(","),
            default=list(OPS),
            metavar="OP[,OP...]",
            help=f"of {','.join(OPS)} (default: all)",
        )
        timing.add_sampling_arguments(parser, "0.5 s; --quick: 0.1 s")

    def configure(self, args: argparse.Namespace) -> dict:
        import torch

        device = args.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: torch sees no GPU on this machine")
        unknown = [op for op in args.ops if op not in OPS]
        if unknown:
            raise ValueError(f"unknown ops {unknown}; known: {', '.join(OPS)}")
        world = torch.cuda.device_count() if device == "cuda" else 2
        args.ranks = [world]
        return {
            "device": device,
            "world": world,
            "ops": list(args.ops),
            "sizes": args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES),
            "sampling": timing.sampling_from_args(args, (0.5, 0.1)),
        }

    def run_rank(self, ctx: RankContext, config: dict) -> Any:
        import torch
        import torch.distributed as dist

        cuda = config["device"] == "cuda"
        if cuda:
            torch.cuda.set_device(ctx.rank)
            device = torch.device("cuda", ctx.rank)
            from hsdp_backend import _torch_compat

            # Against the ProcessGroupNCCL hsdp wraps; the user's default
            # "nccl" beside it where that is another backend (2.15's
            # ProcessGroupNCCL2, or 2.14's with TORCH_DIST_USE_NCCL2=1).
            plain = dist.new_group(backend=_torch_compat.WRAPPED_NCCL)
            default = dist.new_group(backend="nccl")
            if type(default._get_backend(device)) is type(plain._get_backend(device)):
                default = None
            sync = torch.cuda.synchronize
        else:
            device = torch.device("cpu")
            plain = ctx.gloo
            default = None
            sync = lambda: None  # noqa: E731
        sampling = config["sampling"]
        rows = []
        for nbytes in config["sizes"]:
            binders = _binders(device, ctx.world, nbytes)
            for op in config["ops"]:
                (hsdp_call, hsdp_out), (plain_call, plain_out) = (
                    binders[op](ctx.hsdp),
                    binders[op](plain),
                )
                hsdp_call()
                plain_call()
                sync()
                # A fast wrong collective is not a result: hsdp's must be the plain one's.
                torch.testing.assert_close(hsdp_out, plain_out, rtol=1e-6, atol=0.0)
                if op.startswith("all_reduce"):
                    # In place: a sum of zeros stays finite however often it runs.
                    hsdp_out.zero_()
                    plain_out.zero_()

                def synced(call):
                    return lambda: (call(), sync())

                calls = {
                    "hsdp host": hsdp_call,
                    "plain host": plain_call,
                    "hsdp sync": synced(hsdp_call),
                    "plain sync": synced(plain_call),
                }
                if default is not None:
                    default_call, _ = binders[op](default)
                    calls["default host"] = default_call
                    calls["default sync"] = synced(default_call)
                per_sample = timing.calibrate(ctx.gloo, calls, sampling)
                samples = timing.sample_interleaved(ctx.rank, ctx.gloo, calls, per_sample, sampling)
                sync()
                summary = timing.summarise(ctx.world, ctx.gloo, samples, per_sample)
                rows.append(
                    {
                        "op": op,
                        "bytes": nbytes,
                        **{name.replace(" ", "_") + "_us": s["us"] for name, s in summary.items()},
                        "spread": max(timing.spread(samples[n]) for n in samples),
                    }
                )
                ctx.log(f"{op} {format_size(nbytes)}: {rows[-1]}")
            del binders
        return {
            "device": str(device),
            "plain": plain._get_backend(device).name() if cuda else "gloo",
            "default": default._get_backend(device).name() if default is not None else None,
            "rows": rows,
        }

    def report(self, config: dict, reference: dict, per_world: dict[int, Any]) -> dict:
        [(world, result)] = per_world.items()
        rows = result["rows"]
        for row in rows:
            row["host_ratio"] = row["hsdp_host_us"] / row["plain_host_us"]
            row["sync_ratio"] = row["hsdp_sync_us"] / row["plain_sync_us"]
        plain = result["plain"]
        columns = [
            Column("op", 15, lambda r: r["op"], left=True),
            Column("size", 8, lambda r: format_size(r["bytes"])),
            Column("hsdp host us", 12, lambda r: f"{r['hsdp_host_us']:.2f}"),
            Column(f"{plain} host us", 12, lambda r: f"{r['plain_host_us']:.2f}"),
            Column("ratio", 6, lambda r: f"{r['host_ratio']:.3f}"),
            Column("hsdp sync us", 12, lambda r: f"{r['hsdp_sync_us']:.2f}"),
            Column(f"{plain} sync us", 12, lambda r: f"{r['plain_sync_us']:.2f}"),
            Column("ratio", 6, lambda r: f"{r['sync_ratio']:.3f}"),
            Column("spread", 6, lambda r: f"{r['spread']:.2f}"),
        ]
        report.print_table(
            columns,
            rows,
            title=f"hsdp against {plain} on {config['device']}, {world} rank(s) "
            "(ratio: hsdp / plain; < 1: hsdp is faster)",
        )
        worst = max(max(r["host_ratio"], r["sync_ratio"]) for r in rows)
        print(f"largest ratio: {worst:.3f}")
        return {"world": world, "device": config["device"], "plain": plain, "rows": rows}

    def plot(self, section: dict, path: str) -> None:
        with report.figure(path, 2, f"hsdp / {section['plain']} per call") as axes:
            for ax, metric in zip(axes, ("host_ratio", "sync_ratio"), strict=True):
                for op in sorted({r["op"] for r in section["rows"]}):
                    pts = [r for r in section["rows"] if r["op"] == op]
                    ax.plot(
                        [r["bytes"] for r in pts], [r[metric] for r in pts], marker="o", label=op
                    )
                ax.set_xscale("log", base=2)
                ax.axhline(1.0, color="gray", linewidth=0.8)
                ax.set_xlabel("bytes per rank")
                ax.set_ylabel(metric.replace("_", " "))
                ax.legend(fontsize=7)


SUITE = DeviceCallsSuite()
