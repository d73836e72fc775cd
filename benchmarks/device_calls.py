"""hsdp's cost per call on a device's route against that device's plain backend, in the same
processes, interleaved: on CUDA (one rank per GPU: --ranks = the GPUs to use), hsdp (its inner
ProcessGroupNCCL) against a plain group of that ProcessGroupNCCL over the same ranks, and against
the user's default "nccl" beside it where that is another backend; on CPU, hsdp against gloo.

For every op and size (bytes per rank, float32), two pairs of contenders timed interleaved
(common.measure): ``host``, the time a call takes to return (on CUDA the kernel is only enqueued:
what hsdp adds on the host is the difference), and ``sync``, a call and then a wait for the device
(torch.cuda.synchronize; on CPU the call is synchronous already). Ops: all_reduce SUM and AVG,
reduce_scatter_tensor, all_gather_into_tensor (FSDP2's forms) and a coalesced block of 16
reduce-scatters (_coalescing_manager). Every point is checked first: each backend's result must be
the exact answer (hsdp's thus the plain one's). Ratios are hsdp / plain (< 1: hsdp is faster).
"""

from __future__ import annotations

import gc
import os

import torch
import torch.distributed as dist

from benchmarks import common

SIZES = {False: "8,1K,64K,1M,16M,256M", True: "8,64K,16M"}
BLOCK = 16
OPS = ("all_reduce_sum", "all_reduce_avg", "reduce_scatter", "all_gather", "rs_coalesced16")
AG, RS = common.collective("all_gather"), common.collective("reduce_scatter")


def data(numel: int, offset: float, device=None) -> torch.Tensor:
    """Small integers: sums over ranks are exact in fp32."""
    return torch.arange(numel, dtype=torch.float32, device=device).remainder_(7).add_(offset)


def bind(op: str, n: int, group, device, rank: int, world: int):
    """One synchronous call of ``op`` on buffers of its own (``n`` elements a rank); returns the
    call, the tensors holding its result and the exact value of each (on the CPU)."""
    ranksum = world * (world - 1) / 2
    if op.startswith("all_reduce"):
        t, avg = data(n, rank, device), op == "all_reduce_avg"
        redop = dist.ReduceOp.AVG if avg else dist.ReduceOp.SUM
        want = (data(n, 0) * world + ranksum) / (world if avg else 1)
        return (lambda: dist.all_reduce(t, op=redop, group=group)), [t], want
    if op == "all_gather":
        inp, out = data(n, rank, device), torch.full((n * world,), float("nan"), device=device)
        want = torch.cat([data(n, s) for s in range(world)])
        return (lambda: AG(out, inp, group=group)), [out], want
    m = n if op == "reduce_scatter" else max(1, n // BLOCK)
    ins = [data(m * world, rank, device) for _ in range(1 if op == "reduce_scatter" else BLOCK)]
    outs = [torch.full((m,), float("nan"), device=device) for _ in ins]  # unwritten: wrong
    want = data(m * world, 0)[rank * m : (rank + 1) * m] * world + ranksum
    if op == "reduce_scatter":
        return (lambda: RS(outs[0], ins[0], group=group)), outs, want
    # On CUDA the block is NCCL's own group launch; gloo has none, so on CPU torch issues the
    # block as one coalesced call.
    block_device = device if device.type == "cuda" else None

    def block() -> None:
        with dist._coalescing_manager(group=group, device=block_device):
            for o, i in zip(outs, ins, strict=True):
                RS(o, i, group=group)

    return block, outs, want


def point(op: str, nbytes: int, groups: dict, device, sync, ranks: common.Ranks, sampling):
    calls = {}
    for name, group in groups.items():
        call, outs, want = bind(op, max(1, nbytes // 4), group, device, ranks.rank, ranks.world)
        call()
        sync()
        # A fast wrong collective is no result (AVG may round its division: the tolerance).
        for i, out in enumerate(outs):
            if problem := common.mismatch(out.cpu(), want, tol=1e-6):
                ranks.fail(f"{name} {op} of {common.format_size(nbytes)}, output {i}", problem)
        if op.startswith("all_reduce"):
            outs[0].zero_()  # in place: a sum of zeros stays finite however often it runs
        calls[f"{name} host"] = call
        calls[f"{name} sync"] = lambda call=call: (call(), sync())
    times = common.measure(ranks, calls, sampling, settle=sync)
    sync()
    row = {
        "op": op,
        "bytes": nbytes,
        **{k.replace(" ", "_") + "_us": t["us"] for k, t in times.items()},
    }
    row["host_ratio"] = row["hsdp_host_us"] / row["plain_host_us"]
    row["sync_ratio"] = row["hsdp_sync_us"] / row["plain_sync_us"]
    if "default_host_us" in row:  # the user's "nccl", where it is another backend
        row["default_host_ratio"] = row["hsdp_host_us"] / row["default_host_us"]
        row["default_sync_ratio"] = row["hsdp_sync_us"] / row["default_sync_us"]
    row["spread"] = max(t["spread"] for t in times.values())
    return row


def main() -> None:
    p = common.parser(__doc__)
    p.add_argument(
        "--device",
        choices=("auto", "cuda", "cpu"),
        default="auto",
        help="cuda: one rank per GPU against nccl; cpu: against gloo "
        "(default: cuda when torch sees a GPU)",
    )
    p.add_argument(
        "--sizes",
        type=common.sizes,
        default=None,
        help=f"bytes per rank (default {SIZES[False]}; --quick {SIZES[True]})",
    )
    p.add_argument("--ops", default=",".join(OPS), help=f"any of {','.join(OPS)}")
    args = p.parse_args()
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    world, gpus = int(os.environ["WORLD_SIZE"]), torch.cuda.device_count()
    if cuda and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no GPU on this machine")
    if cuda and world > gpus:
        p.error(
            f"--device cuda: one rank per GPU, {world} ranks but {gpus} GPU(s) (--ranks {gpus})"
        )
    ops = args.ops.split(",")
    if unknown := [op for op in ops if op not in OPS]:
        p.error(f"unknown ops {unknown}; known: {', '.join(OPS)}")
    sizes = args.sizes or common.sizes(SIZES[args.quick])
    sampling = common.Sampling.of(args, (0.5, 0.1))
    if cuda:  # before the first collective: NCCL binds the current device
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    ranks = common.init(args)
    if cuda:
        from hsdp_backend import _torch_compat

        device, sync = torch.device("cuda", torch.cuda.current_device()), torch.cuda.synchronize
        # Against the ProcessGroupNCCL hsdp wraps; the user's default "nccl" beside it where that
        # is another backend (2.15's ProcessGroupNCCL2, or 2.14's with TORCH_DIST_USE_NCCL2=1).
        groups = {"hsdp": ranks.hsdp, "plain": dist.new_group(backend=_torch_compat.WRAPPED_NCCL)}
        default = dist.new_group(backend="nccl")
        if type(default._get_backend(device)) is not type(groups["plain"]._get_backend(device)):
            groups["default"] = default
        plain = groups["plain"]._get_backend(device).name()
    else:
        device, sync, plain = torch.device("cpu"), lambda: None, "gloo"
        groups = {"hsdp": ranks.hsdp, "plain": ranks.gloo}
    rows = []
    for nbytes in sizes:
        for op in ops:
            rows.append(point(op, nbytes, groups, device, sync, ranks, sampling))
            ranks.log(f"{op} {common.format_size(nbytes)}: {rows[-1]}")
            gc.collect()
    columns = [
        common.Column("op", lambda r: r["op"]),
        common.Column("size", lambda r: common.format_size(r["bytes"])),
        common.Column("hsdp host us", lambda r: r["hsdp_host_us"]),
        common.Column(f"{plain} host us", lambda r: r["plain_host_us"]),
        common.Column("ratio", lambda r: f"{r['host_ratio']:.3f}"),
        common.Column("hsdp sync us", lambda r: r["hsdp_sync_us"]),
        common.Column(f"{plain} sync us", lambda r: r["plain_sync_us"]),
        common.Column("ratio", lambda r: f"{r['sync_ratio']:.3f}"),
        common.Column("spread", lambda r: f"{r['spread']:.2f}"),
    ]
    worst = max(max(r["host_ratio"], r["sync_ratio"]) for r in rows)
    notes = [
        f"hsdp against {plain} on {device.type} (ratio: hsdp / plain; < 1: hsdp is faster)",
        f"largest ratio: {worst:.3f}",
    ]
    default = groups["default"]._get_backend(device).name() if "default" in groups else None
    extra = {"device": device.type, "plain": plain, "default": default}
    common.emit("device_calls", args, ranks, columns, rows, notes, extra)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
