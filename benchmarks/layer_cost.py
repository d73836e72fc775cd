"""hsdp's own cost per call on its inner route, in microseconds, measured in one process.

One rank. The inner backend is the zero-cost limit (``hsdp_testing.NullBackend``: what a world
of one computes, complete when the call returns), both as a group's own backend ("null") and as
the inner backend of an hsdp group ("hsdp"), so the difference between the two is what hsdp adds:
validation, planning, the route, its Work and its flight recorder. Both go through the same
``torch.distributed`` call, so c10d's dispatch is in both and cancels out. Beside them, for scale:
``gloo`` at one rank and, for the ops that copy, a plain ``memcpy`` of the same bytes.

``--like nccl`` gives hsdp the inner backend's capabilities as NCCL's (scales inside the
reduction, the CUDA route's completion on host streams), ``--like gloo`` as Gloo's (futures completed on hsdp's workers). What this
cannot see: the CUDA route's device events (the flight recorder's "done" event, the side stream of
a post-step), which only a GPU shows (``benchmarks/device_calls.py``).

Every contender's result is checked against the exact answer first. hsdp and null are timed in
pairs whose order alternates, each sample a batch of calls (gloo and memcpy in rounds of their
own, after); the table gives each contender's median time per call, and hsdp's own cost as the
median over rounds of hsdp minus null in the same round, with the 10th-90th percentile of those
differences.

    python -m benchmarks.layer_cost [--like nccl|gloo] [--strided] [--rounds 40] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable

SIZES = [8, 64 * 1024, 1024 * 1024]
OPS = ("all_reduce", "all_reduce_async", "all_reduce_callback", "all_gather", "reduce_scatter")


def _contenders(
    op: str, nbytes: int, groups: dict, strided: bool = False
) -> tuple[dict[str, Callable], Callable]:
    """Per contender, one call on buffers of its own, and a check of its result."""
    import torch
    import torch.distributed as dist

    n = max(1, nbytes // 4)
    calls, results = {}, {}
    for name, group in groups.items():
        src = torch.arange(n, dtype=torch.float32).remainder_(7)
        if op.startswith("all_reduce"):
            t = src.clone()
            if strided:  # every second element: hsdp stages it and copies the result back
                t = torch.empty(2 * n)[::2].copy_(src)
            if op == "all_reduce_async":
                calls[name] = lambda t=t, g=group: dist.all_reduce(t, group=g, async_op=True).wait()
            elif op == "all_reduce_callback":

                def call(t=t, g=group):
                    work = dist.all_reduce(t, group=g, async_op=True)
                    work.get_future().then(_first).wait()  # a callback, as DDP's comm hooks add
                    work.wait()

                calls[name] = call
            else:
                calls[name] = lambda t=t, g=group: dist.all_reduce(t, group=g)
            results[name] = t
        else:
            out = torch.empty(n)
            fn = dist.all_gather_into_tensor if op == "all_gather" else dist.reduce_scatter_tensor
            calls[name] = lambda o=out, i=src, g=group, fn=fn: fn(o, i, group=g)
            results[name] = out
    if not op.startswith("all_reduce"):
        src, out = torch.arange(n, dtype=torch.float32).remainder_(7), torch.empty(n)
        calls["memcpy"] = lambda: out.copy_(src)

    def check():
        want = torch.arange(n, dtype=torch.float32).remainder_(7)  # one rank: the input
        for name, t in results.items():
            torch.testing.assert_close(t, want, rtol=0, atol=0, msg=lambda m, w=name: f"{w}: {m}")

    return calls, check


def _first(fut):
    return fut.value()[0]


def _time(call: Callable, reps: int) -> float:
    start = time.perf_counter_ns()
    for _ in range(reps):
        call()
    return (time.perf_counter_ns() - start) / reps / 1e3


def _measure(calls: dict[str, Callable], rounds: int, sample_s: float) -> dict[str, list[float]]:
    for call in calls.values():
        for _ in range(20):
            call()
    slowest = max(_time(c, 20) for c in calls.values())
    reps = max(1, int(sample_s * 1e6 / slowest))
    samples: dict[str, list[float]] = {name: [] for name in calls}
    # hsdp and null in pairs whose order alternates, so that neither runs
    # more often right after the other (or after gloo, whose threads are
    # still waking up when it returns); the references in rounds of their own.
    pair = ["hsdp", "null"]
    references = [name for name in calls if name not in pair]
    for r in range(rounds):
        for name in pair if r % 2 == 0 else pair[::-1]:
            samples[name].append(_time(calls[name], reps))
    for r in range(rounds):
        for name in references[r % len(references) :] + references[: r % len(references)]:
            samples[name].append(_time(calls[name], reps))
    return samples


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--like", choices=("nccl", "gloo"), default="nccl")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--sample-ms", type=float, default=3.0)
    parser.add_argument("--ops", type=lambda s: s.split(","), default=list(OPS))
    parser.add_argument(
        "--strided",
        action="store_true",
        help="all-reduce tensors that are not contiguous: every call has a post-step (the copy back)",
    )
    parser.add_argument("--json", default="")
    args = parser.parse_args()

    os.environ["HSDP_CPU_ROUTE"] = "gloo"  # the inner route, not the shared-memory engine
    warnings.filterwarnings("ignore", category=FutureWarning)  # 2.14's *_single renames
    import hsdp_testing
    import torch.distributed as dist

    from hsdp_backend import _C
    from hsdp_backend._registration import hooks

    caps = {
        "nccl": _C.InnerCaps("null", native_scale=True, streams=hsdp_testing.host_streams()),
        "gloo": _C.InnerCaps("null", fixed_completion_pool=True),
    }[args.like]
    hooks.inner_cpu = lambda opts, gloo: (
        hsdp_testing.NullBackend(opts.group_rank, opts.group_size),
        caps,
    )
    dist.Backend.register_backend(
        "hsdp_null",
        lambda store, rank, size, timeout: hsdp_testing.NullBackend(rank, size),
        devices=["cpu"],
    )
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("hsdp", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            groups = {
                "hsdp": dist.group.WORLD,
                "null": dist.new_group(backend="hsdp_null"),
                "gloo": dist.new_group(backend="gloo"),
            }
            rows = []
            for nbytes in SIZES:
                for op in args.ops:
                    calls, check = _contenders(op, nbytes, groups, args.strided)
                    for call in calls.values():
                        call()
                    check()
                    s = _measure(calls, args.rounds, args.sample_ms / 1e3)
                    own = [h - z for h, z in zip(s["hsdp"], s["null"], strict=True)]
                    rows.append(
                        {
                            "op": op,
                            "bytes": nbytes,
                            **{f"{k}_us": statistics.median(v) for k, v in s.items()},
                            "own_us": statistics.median(own),
                            "own_p10_us": _quantile(own, 0.1),
                            "own_p90_us": _quantile(own, 0.9),
                        }
                    )
        finally:
            dist.destroy_process_group()
    print(f"hsdp over the zero-cost inner backend (caps as {args.like}'s), one rank, us per call")
    print(
        f"{'op':18} {'size':>8} {'hsdp':>8} {'null':>8} {'own':>7} {'own p10-p90':>13}"
        f" {'gloo':>8} {'memcpy':>8}"
    )
    for r in rows:
        memcpy = f"{r['memcpy_us']:8.2f}" if "memcpy_us" in r else f"{'-':>8}"
        print(
            f"{r['op']:18} {r['bytes']:>8} {r['hsdp_us']:8.2f} {r['null_us']:8.2f}"
            f" {r['own_us']:7.2f} {r['own_p10_us']:6.2f}-{r['own_p90_us']:<6.2f}"
            f" {r['gloo_us']:8.2f} {memcpy}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"like": args.like, "rounds": args.rounds, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
