"""How the timed suites sample: calibrate, measure interleaved, reduce over ranks.

A *contender* is a backend or a variant, given as a no-argument closure that
makes one synchronous call; every rank passes the same contenders in the
same order.

1. **Calibrate.** A few untimed calls per contender; the fastest, maxed over
   ranks, sets how many back-to-back calls form one *sample* (about
   ``SAMPLE_TARGET_S`` of the fastest contender, so the timer and the barrier
   skew are amortised for small messages); every contender and every rank
   uses the same count.
2. **Measure, interleaved.** Rounds of one sample per contender, the order
   alternating (a, b, then b, a, ...); every sample is preceded by a barrier
   on the gloo group and timed with ``time.perf_counter`` around its calls,
   so machine noise hits every contender alike and the *ratio* stays
   meaningful when absolute numbers drift. Rounds go on until the point has
   used its budget (``--time-per-point`` per contender, by rank 0's clock),
   with at least ``--min-reps`` and at most ``--max-reps`` samples per
   contender; ``--iters`` fixes the count instead.
3. **Reduce.** Each rank takes the median of its per-call sample times; the
   point's time is the maximum of those medians over ranks (a collective is
   as slow as its slowest rank), gathered on the gloo group.

The physical reference is single-thread ``dst.copy_(src)`` of the same sizes
(``measure_memcpy``), sampled the same way in the parent.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# One sample (a batch of back-to-back calls) should last about this long.
SAMPLE_TARGET_S = 2e-3
# Upper bound on calls per sample (tiny messages on a fast engine).
MAX_CALLS_PER_SAMPLE = 1000


@dataclass(frozen=True)
class Sampling:
    """How many calls and samples a measurement point gets."""

    time_per_point_s: float  # budget per contender (per point)
    min_reps: int
    max_reps: int
    warmup: int
    fixed_reps: int | None  # --iters: exact sample count, no budget

    @staticmethod
    def calls_per_sample(est_call_s: float) -> int:
        """Back-to-back calls that make one sample of about SAMPLE_TARGET_S."""
        calls = math.ceil(SAMPLE_TARGET_S / max(est_call_s, 1e-7))
        return max(1, min(MAX_CALLS_PER_SAMPLE, calls))

    def done(self, reps: int, elapsed_s: float, n_contenders: int = 1) -> bool:
        """Whether a point that took ``reps`` samples per contender in ``elapsed_s`` is finished."""
        if self.fixed_reps is not None:
            return reps >= self.fixed_reps
        if reps < self.min_reps:
            return False
        return reps >= self.max_reps or elapsed_s >= n_contenders * self.time_per_point_s


def add_sampling_arguments(parser: argparse.ArgumentParser, budget_help: str) -> None:
    """The sampling flags of the timed suites (``budget_help``: the default budget)."""
    samp = parser.add_argument_group("sampling (per point, per contender)")
    samp.add_argument(
        "--time-per-point",
        type=float,
        default=None,
        metavar="S",
        help=f"time budget per point per contender (default: {budget_help})",
    )
    samp.add_argument(
        "--iters",
        type=int,
        default=None,
        metavar="N",
        help="exactly N samples per point per contender instead of the time budget",
    )
    samp.add_argument(
        "--min-reps", type=int, default=3, metavar="N", help="fewest samples (default: 3)"
    )
    samp.add_argument(
        "--max-reps",
        type=int,
        default=None,
        metavar="N",
        help="most samples (default: 200; --quick: 50)",
    )
    samp.add_argument(
        "--warmup",
        type=int,
        default=None,
        metavar="N",
        help="untimed calls per contender before measuring (default: 3; --quick: 2)",
    )


def sampling_from_args(args: argparse.Namespace, budget_s: tuple[float, float]) -> Sampling:
    """The Sampling of the flags; ``budget_s`` is the default budget (full, --quick)."""
    if args.iters is not None and args.iters < 1:
        raise ValueError("--iters must be >= 1")
    if args.min_reps < 1 or (args.max_reps is not None and args.max_reps < args.min_reps):
        raise ValueError("need 1 <= --min-reps <= --max-reps")
    quick = args.quick
    return Sampling(
        time_per_point_s=args.time_per_point
        if args.time_per_point is not None
        else budget_s[1 if quick else 0],
        min_reps=args.min_reps,
        max_reps=args.max_reps if args.max_reps is not None else (50 if quick else 200),
        warmup=args.warmup if args.warmup is not None else (2 if quick else 3),
        fixed_reps=args.iters,
    )


def time_calls(fn: Callable[[], Any], calls: int) -> float:
    """Seconds per call of ``calls`` back-to-back calls of ``fn``."""
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def quartiles(samples: list[float]) -> tuple[float, float]:
    """The first and third quartile of some samples (both the sample itself
    when there is one)."""
    if len(samples) < 2:
        return samples[0], samples[0]
    q1, _, q3 = statistics.quantiles(samples, n=4)
    return q1, q3


def spread(samples: list[float]) -> float:
    """Interquartile range / median of some samples: how noisy a point was."""
    if len(samples) < 2:
        return 0.0
    q1, q3 = quartiles(samples)
    median = statistics.median(samples)
    return (q3 - q1) / median if median > 0 else 0.0


def calibrate(gloo, calls: dict[str, Callable[[], None]], sampling: Sampling) -> int:
    """Warms every contender up; returns the calls per sample, the same on every rank.

    The count comes from the fastest warmup call (the least disturbed one)
    of the fastest contender, maxed over ranks so that every rank plans
    alike. All contenders get the same count: one whose samples averaged
    over more calls would see noise differently (fewer outliers, higher
    floor) and bias the ratio.
    """
    import torch
    import torch.distributed as dist

    est = [min(time_calls(fn, 1) for _ in range(max(sampling.warmup, 1))) for fn in calls.values()]
    est_t = torch.tensor([min(est)], dtype=torch.float64)
    dist.all_reduce(est_t, op=dist.ReduceOp.MAX, group=gloo)
    return sampling.calls_per_sample(est_t.item())


def sample_interleaved(
    rank: int,
    gloo,
    calls: dict[str, Callable[[], None]],
    calls_per_sample: int,
    sampling: Sampling,
) -> dict[str, list[float]]:
    """Rounds of one sample (seconds per call) per contender, the order alternating.

    Rank 0's clock ends the measurement (``sampling.done`` with one budget
    per contender); the all_reduce carrying its verdict is also the barrier
    before the round's first sample, and a gloo barrier precedes each other
    sample.
    """
    import torch
    import torch.distributed as dist

    names = list(calls)
    samples: dict[str, list[float]] = {n: [] for n in names}
    stop = torch.zeros(1, dtype=torch.float64)
    t0 = time.perf_counter()
    for i in itertools.count():
        stop[0] = float(rank == 0 and sampling.done(i, time.perf_counter() - t0, len(names)))
        dist.all_reduce(stop, op=dist.ReduceOp.MAX, group=gloo)
        if stop.item():
            break
        for k, n in enumerate(names if i % 2 == 0 else names[::-1]):
            if k:
                dist.barrier(group=gloo)
            samples[n].append(time_calls(calls[n], calls_per_sample))
    return samples


def summarise(
    world: int, gloo, samples: dict[str, list[float]], calls_per_sample: int
) -> dict[str, dict]:
    """Per contender: the max over ranks of each rank's median (us), and the raw numbers.

    Collective over the gloo group; the result is the same on every rank.
    """
    import torch
    import torch.distributed as dist

    names = list(samples)
    mine = torch.tensor(
        [[statistics.median(samples[n]), min(samples[n])] for n in names], dtype=torch.float64
    )
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=gloo)
    per_rank = torch.stack(gathered) * 1e6  # [W, contender, (median, min)] in us
    return {
        n: {
            "us": per_rank[:, i, 0].max().item(),  # max over ranks of the medians
            "per_rank_median_us": per_rank[:, i, 0].tolist(),
            "per_rank_min_us": per_rank[:, i, 1].tolist(),
            "calls_per_sample": calls_per_sample,
            "reps": len(samples[n]),
            "rank0_samples_us": [s * 1e6 for s in samples[n]],
        }
        for i, n in enumerate(names)
    }


def against_limit(hsdp_ms: float, gloo_ms: float, fake_ms: float) -> tuple[float, float | None]:
    """hsdp's step against the zero-cost limit (torch's fake backend): hsdp /
    fake, and (hsdp - fake) / (gloo - fake), hsdp's cost above the limit as a
    fraction of gloo's (None when gloo is not above the limit)."""
    overhead = (hsdp_ms - fake_ms) / (gloo_ms - fake_ms) if gloo_ms > fake_ms else None
    return hsdp_ms / fake_ms, overhead


def measure_memcpy(sizes: list[int], dtype_name: str, sampling: Sampling) -> dict[int, dict]:
    """Single-thread ``dst.copy_(src)`` time per size (median over samples).

    Runs in the calling process with ``torch.set_num_threads(1)`` (restored
    afterwards). Returns ``{nbytes: {"us", "gbps", "min_us", "calls_per_sample", "reps"}}``.
    """
    import torch

    dtype = getattr(torch, dtype_name)
    elem = torch.empty((), dtype=dtype).element_size()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = {}
    try:
        for nbytes in sorted(set(sizes)):
            src = torch.ones(max(nbytes // elem, 1), dtype=dtype)
            dst = torch.empty_like(src)
            copy = functools.partial(dst.copy_, src)
            warm = min(time_calls(copy, 1) for _ in range(max(sampling.warmup, 1)))
            calls = sampling.calls_per_sample(warm)
            samples: list[float] = []
            t0 = time.perf_counter()
            while not sampling.done(len(samples), time.perf_counter() - t0):
                samples.append(time_calls(copy, calls))
            t = statistics.median(samples)
            out[nbytes] = {
                "us": t * 1e6,
                "gbps": nbytes / t / 1e9,
                "min_us": min(samples) * 1e6,
                "calls_per_sample": calls,
                "reps": len(samples),
            }
    finally:
        torch.set_num_threads(threads)
    return out
