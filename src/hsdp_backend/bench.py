"""Benchmarks hsdp against gloo on this host: ``python -m hsdp_backend.bench``.

Run it from outside the repository root (see README.md): the source
directory has no compiled extension.

Method
------
The parent process starts W rank processes itself (spawn), hosts the
rendezvous TCPStore on a free loopback port and enforces one wall-clock
deadline for the whole run: when a rank fails, the others get a short grace
period, then every rank still alive is killed and the run exits non-zero.
Each rank runs single-threaded (``torch.set_num_threads(1)``), initialises
the default group on ``hsdp`` and a second group over the same ranks on
``gloo``, so both backends are measured in the same processes, on the same
buffers, at the same time.

For every (op, size) point of the ``collectives`` suite:

1. **Check.** Each backend runs the op once on rank-dependent data and the
   result is compared with the exact answer; a wrong result fails the run
   (a fast wrong collective is not a result).
2. **Warm up and calibrate.** A few untimed calls per backend; the fastest,
   maxed over ranks, sets how many back-to-back calls form one *sample*
   (about ``SAMPLE_TARGET_S`` of the faster backend, so the timer and the
   barrier skew are amortised for small messages); both backends and all
   ranks use the same count.
3. **Measure, interleaved.** Rounds of one sample per backend, the order
   alternating (hsdp, gloo, then gloo, hsdp, ...); every sample is preceded
   by a barrier on the gloo group and timed with ``time.perf_counter``
   around its calls, so machine noise (this is meant to run on small shared
   machines) hits both backends alike and the *ratio* stays meaningful even
   when absolute numbers drift. Rounds continue until the point has used its
   time budget (``--time-per-point`` per backend, by rank 0's clock, shared
   through the barrier), with at least ``--min-reps`` and at most
   ``--max-reps`` samples per backend; ``--iters`` fixes the count instead.
4. **Reduce.** Each rank takes the median of its per-call sample times; the
   point's latency is the maximum of those medians over ranks (a collective
   is as slow as its slowest rank), gathered on the gloo group.

Derived numbers follow nccl-tests: algbw = total bytes / time, where total
bytes = bytes per rank * W for all_gather / reduce_scatter and the message
size for all_reduce; busbw = algbw * (W-1)/W (all_gather, reduce_scatter) or
* 2(W-1)/W (all_reduce). ``speedup`` is gloo time / hsdp time (> 1: hsdp is
faster). The physical reference is single-thread ``dst.copy_(src)`` of the
same sizes, measured in the parent in the same run (median, same sampling):
``hsdp/memcpy`` is hsdp busbw / memcpy GB/s at that size, and for
all_reduce ``3xcopy`` is the time of the unavoidable copies of a
shared-memory all-reduce (copy in, reduce, copy out: about three memcpy of
the message). GB/s are 1e9 bytes per second; sizes are binary (KiB, MiB).
``spread`` (interquartile range / median of rank 0's samples, the noisier
backend) says how far a row can be trusted: on a quiet machine it is a few
percent; when other processes compete for the cores it grows, and so does
the uncertainty of the ratio.

Output: one table per world size on stdout, all raw numbers and machine
information as JSON (``--json``), and a bus-bandwidth plot (``--plot``,
needs matplotlib).

Suites
------
``--suite`` selects a registered :class:`Suite` (see ``SUITES``). A suite
turns the CLI arguments into a picklable config in the parent, runs its
measurement on every rank, and prints / serialises / plots the results of
rank 0 in the parent; the launcher, deadline, JSON envelope and machine
information are shared. New benchmarks are new ``Suite`` subclasses added to
``SUITES``; one that starts its own processes overrides ``Suite.run_all``
(``training`` does).

``collectives`` (the default) is the method above.

``coalesced`` (default 2 ranks) measures what FSDP2 does per module: the
200 parameter shards of a 12-layer ViT-like transformer of width ``--dim``
(``transformer_shapes``; FSDP2 dim-0 shards, so the bytes per rank shrink
with W) are all-gathered (output W x shard) and reduce-scattered (SUM, input
W x shard) three ways, interleaved as above with one budget per variant:
(a) one call per tensor on the gloo group, (b) the same calls inside
``dist._coalescing_manager`` on the gloo group (gloo's coalesced path), (c)
the same calls inside ``dist._coalescing_manager`` on the hsdp group (one
fused collective). Before timing, each variant's outputs are compared with
the exact answer (small integers, exact in any float type), so the three
agree bitwise. Reported: ms per call over all tensors (max over ranks of
the medians), a/c and b/c, and the collectives hsdp issued per fused call
(``comm_stats``; 1 expected), against a target of a/c >= 20 on 2 ranks.

``numerics`` (default 2, 4, 8 ranks) times nothing: for bf16 and fp16,
all_reduce and reduce_scatter_tensor with ``ReduceOp.AVG`` run on hsdp and
on gloo over standard-normal inputs (fp32 from a per-rank seed, cast to the
low-precision type). Every rank regenerates all ranks' inputs, so the
reference, the fp64 mean of the low-precision inputs, needs no
communication. The error of each output element is ``|got - ref| /
ulp(ref)`` in the output type (``ulp_error``); max and mean over every
rank's output are reported per (dtype, op, W), as a markdown table
(elements whose reference is exactly 0 are counted apart), with
whether hsdp stays within 0.5 ulp (+1e-3 for its fp32 division) and at or
below gloo. A backend that rejects AVG would run SUM and divide by W in the
output type (the table's reduction column says which ran).

``training`` (default 2, 4 ranks) times the FSDP2 example scripts of the
repository (``examples/``, not installed with the package) end to end:
``train_fsdp.py`` on 2 ranks (``--ranks 2``) and ``train_hsdp.py
--replicate 2 --shard 2`` on 4 ranks (``--ranks 4``), each for a "small"
model (10.6 M parameters, bandwidth-bound) and a "tiny" one (66 k
parameters in 11 FSDP groups, latency-bound), plus ``train_fsdp.py`` on 1
rank, where FSDP2 issues no collectives: the compute baseline. Every run is
``python -m torch.distributed.run`` with ``OMP_NUM_THREADS=1`` (the 1-rank
run too), a free ``--master-port`` and a per-run timeout; the parent parses
rank 0's per-step ``NN.N ms`` lines, drops the first ``--warmup`` steps (3)
and takes the median over the remaining steps of all ``--repeats`` runs.
Runs are interleaved: per repeat and model the baseline, then hsdp and gloo
per configuration, odd repeats in reverse order. Reported per
(configuration, model): the step time on 1 rank, gloo and hsdp; exposed
communication = step(W) - step(1 rank) per backend; gloo exposed / hsdp
exposed (target >= 5 for the small model); communication share = exposed /
step; the hsdp speedup of the whole step; hsdp's ``comm_stats`` of the last
step. With more ranks than cpus the ranks' compute slows down, the baseline
under-estimates it and exposed communication includes that slowdown (a
printed caveat).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import functools
import itertools
import json
import math
import multiprocessing as mp
import os
import platform
import queue
import re
import signal
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

BACKENDS = ("hsdp", "gloo")

# One sample (a batch of back-to-back calls) should last about this long.
SAMPLE_TARGET_S = 2e-3
# Upper bound on calls per sample (tiny messages on a fast engine).
MAX_CALLS_PER_SAMPLE = 1000
# How long the other ranks may keep running once one rank failed.
GRACE_AFTER_FAILURE_S = 10.0
# Per-collective timeout inside the ranks (capped by what is left of --timeout).
COLLECTIVE_TIMEOUT_S = 120.0

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30

# ---------------------------------------------------------------------------
# Small helpers: sizes, statistics
# ---------------------------------------------------------------------------

_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kmg]?)(i?b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": KIB, "m": MIB, "g": GIB}


def parse_size(text: str) -> int:
    """Parses a byte count such as ``8``, ``4K``, ``64KiB``, ``1M``, ``16MB``.

    Suffixes are binary (K = 1024). Raises ValueError on anything else.
    """
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (examples: 8, 4K, 64KiB, 1M, 16M)")
    return int(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]


def format_size(nbytes: int) -> str:
    """``4096`` -> ``4 KiB``; exact binary units only, else bytes."""
    for unit, name in ((GIB, "GiB"), (MIB, "MiB"), (KIB, "KiB")):
        if nbytes >= unit and nbytes % unit == 0:
            return f"{nbytes // unit} {name}"
    return f"{nbytes} B"


def _short_size(nbytes: int) -> str:
    """``4096`` -> ``4K`` (plot ticks)."""
    text = format_size(nbytes)
    for long, short in ((" KiB", "K"), (" MiB", "M"), (" GiB", "G"), (" B", "")):
        text = text.replace(long, short)
    return text


def _clamp(value: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, value))


@dataclass(frozen=True)
class Sampling:
    """How many calls and samples a measurement point gets."""

    time_per_point_s: float  # budget per backend (per point)
    min_reps: int
    max_reps: int
    warmup: int
    fixed_reps: int | None  # --iters: exact sample count, no budget

    @staticmethod
    def calls_per_sample(est_call_s: float) -> int:
        """Back-to-back calls that make one sample of about SAMPLE_TARGET_S."""
        return _clamp(math.ceil(SAMPLE_TARGET_S / max(est_call_s, 1e-7)), 1, MAX_CALLS_PER_SAMPLE)

    def done(self, reps: int, elapsed_s: float, n_backends: int = 1) -> bool:
        """Whether a point that took ``reps`` samples per backend in ``elapsed_s`` is finished."""
        if self.fixed_reps is not None:
            return reps >= self.fixed_reps
        if reps < self.min_reps:
            return False
        return reps >= self.max_reps or elapsed_s >= n_backends * self.time_per_point_s


def _time_calls(fn: Callable[[], Any], calls: int) -> float:
    """Seconds per call of ``calls`` back-to-back calls of ``fn``."""
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


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
            warm = min(_time_calls(copy, 1) for _ in range(max(sampling.warmup, 1)))
            calls = sampling.calls_per_sample(warm)
            samples: list[float] = []
            t0 = time.perf_counter()
            while not sampling.done(len(samples), time.perf_counter() - t0):
                samples.append(_time_calls(copy, calls))
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


def machine_info() -> dict:
    """CPU model, core counts, load, torch / python / hsdp versions."""
    import torch

    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        from importlib.metadata import version

        hsdp_version = version("hsdp-backend")
    except Exception:  # noqa: BLE001
        hsdp_version = "unknown"
    return {
        "cpu_model": cpu,
        "nproc": os.cpu_count(),
        "nproc_available": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else None,
        "loadavg_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "torch_version": torch.__version__,
        "hsdp_backend_version": hsdp_version,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
    }


# ---------------------------------------------------------------------------
# Suites
# ---------------------------------------------------------------------------


@dataclass
class RankContext:
    """What a suite's rank function gets: its place and the two groups."""

    rank: int
    world: int
    hsdp: Any  # the default group, on hsdp
    gloo: Any  # a gloo group over the same ranks (reference and control plane)
    verbose: bool

    def log(self, msg: str) -> None:
        """Progress line from rank 0 (``--verbose`` only), on stderr."""
        if self.verbose and self.rank == 0:
            print(f"  [W={self.world}] {msg}", file=sys.stderr, flush=True)


class Suite:
    """A benchmark: configured in the parent, run on every rank, reported in the parent.

    Subclasses set ``name`` / ``help`` and implement the methods; their
    instances go into ``SUITES``. Order of calls in the parent: configure,
    reference, ``run_all`` (by default one launch of ``run_rank`` per world
    size), report, plot.
    ``default_ranks`` are the world sizes without ``--ranks``; the default
    ``--json`` / ``--plot`` files are ``bench_results/<output_stem>.json|png``.
    """

    name: str = ""
    help: str = ""
    default_ranks: tuple[int, ...] = (2, 4)
    output_stem: str = "bench"

    def configure(self, args: argparse.Namespace) -> dict:
        """Validated, picklable config for the ranks (parent; ValueError on bad args)."""
        raise NotImplementedError

    def reference(self, config: dict) -> dict:
        """Parent-side reference measurements (e.g. memcpy), before the ranks start."""
        return {}

    def run_all(
        self, config: dict, ranks: list[int], env: dict, deadline: float, verbose: bool
    ) -> tuple[dict[int, Any], dict[int, str], dict[int, float]]:
        """Runs the measurement for every world size (parent).

        Returns ``(per_world, engines, wall)``: what ``report`` gets, hsdp's
        CPU engine and the wall time per world size. The default launches
        ``run_rank`` on ``world`` fresh rank processes per world size (see
        ``launch``); a suite that starts its own processes (``training``)
        overrides this. Raises BenchFailure.
        """
        per_world: dict[int, Any] = {}
        engines: dict[int, str] = {}
        wall: dict[int, float] = {}
        for world in ranks:
            print(f"world size {world}: running {world} ranks...", flush=True)
            t0 = time.monotonic()
            out = launch(self, world, config, env, deadline, verbose)
            per_world[world], engines[world] = out["result"], out["engine"]
            wall[world] = time.monotonic() - t0
            print(
                f"world size {world}: done in {wall[world]:.1f} s "
                f"(hsdp cpu engine: {engines[world]})",
                flush=True,
            )
        return per_world, engines, wall

    def run_rank(self, ctx: RankContext, config: dict) -> Any:
        """The measurement, on every rank; rank 0's return value is reported."""
        raise NotImplementedError

    def report(self, config: dict, reference: dict, per_world: dict[int, Any]) -> dict:
        """Prints the tables; returns the suite's JSON section (parent)."""
        raise NotImplementedError

    def plot(self, section: dict, path: str) -> None:
        """Draws the suite's figure from its JSON section (parent)."""


# --- timing shared by the suites: calibrate, sample interleaved, reduce ----
#
# ``calls`` maps a contender's name (a backend, a variant) to a no-argument
# closure; every rank passes the same names in the same order.


def _calibrate(ctx: RankContext, calls: dict[str, Callable[[], None]], sampling: Sampling) -> int:
    """Warms every contender up; returns the calls per sample, the same on every rank.

    The count comes from the fastest warmup call (the least disturbed one)
    of the fastest contender, maxed over ranks so that every rank plans
    alike. All contenders get the same count: one whose samples averaged
    over more calls would see noise differently (fewer outliers, higher
    floor) and bias the ratio.
    """
    import torch
    import torch.distributed as dist

    est = [min(_time_calls(fn, 1) for _ in range(max(sampling.warmup, 1))) for fn in calls.values()]
    est_t = torch.tensor([min(est)], dtype=torch.float64)
    dist.all_reduce(est_t, op=dist.ReduceOp.MAX, group=ctx.gloo)
    return sampling.calls_per_sample(est_t.item())


def _sample_interleaved(
    ctx: RankContext,
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
        stop[0] = float(ctx.rank == 0 and sampling.done(i, time.perf_counter() - t0, len(names)))
        dist.all_reduce(stop, op=dist.ReduceOp.MAX, group=ctx.gloo)
        if stop.item():
            break
        for k, n in enumerate(names if i % 2 == 0 else names[::-1]):
            if k:
                dist.barrier(group=ctx.gloo)
            samples[n].append(_time_calls(calls[n], calls_per_sample))
    return samples


def _summarise_samples(
    ctx: RankContext, samples: dict[str, list[float]], calls_per_sample: int
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
    gathered = [torch.empty_like(mine) for _ in range(ctx.world)]
    dist.all_gather(gathered, mine, group=ctx.gloo)
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


# --- the collectives suite -------------------------------------------------


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
    )
}
OP_ALIASES = {
    "all_gather": "all_gather_into_tensor",
    "allgather": "all_gather_into_tensor",
    "ag": "all_gather_into_tensor",
    "reduce_scatter": "reduce_scatter_tensor",
    "reducescatter": "reduce_scatter_tensor",
    "rs": "reduce_scatter_tensor",
    "allreduce": "all_reduce",
    "ar": "all_reduce",
}
DEFAULT_SIZES = [4 * KIB * 4**i for i in range(8)]  # 4K .. 64M, powers of 4
QUICK_MAX_SIZE = MIB
LATENCY_BYTES = 8  # the extra all_reduce latency row


def _make_buffers(op: str, numel: int, rank: int, world: int, dtype) -> dict:
    """Buffers for one point, shared by both backends (FSDP2 forms)."""
    import torch

    if op == "all_gather_into_tensor":
        out = torch.zeros(world * numel, dtype=dtype)
        return {"out": out, "in": out.narrow(0, rank * numel, numel)}  # in place, as FSDP2
    if op == "reduce_scatter_tensor":
        return {
            "out": torch.zeros(numel, dtype=dtype),
            "in": torch.zeros(world * numel, dtype=dtype),
        }
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
    if op == "all_reduce":
        bufs["t"].zero_()
    if ok:
        return None
    bad = (got.float() - want.float()).abs().flatten().argmax().item()
    return f"element {bad}: got {got.flatten()[bad].item()}, expected {want.flatten()[bad].item()}"


class CollectivesSuite(Suite):
    name = "collectives"
    help = "all_gather_into_tensor / reduce_scatter_tensor / all_reduce, hsdp vs gloo, per size"

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
            sizes = sorted({parse_size(s) for s in args.sizes.split(",") if s.strip()})
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
            if op == "all_reduce" and LATENCY_BYTES not in sizes:
                op_sizes = [LATENCY_BYTES, *sizes]
            points += [(op, s) for s in op_sizes]
        return {
            "ops": ops,
            "points": points,
            "dtype": args.dtype,
            "sampling": _sampling_from_args(args),
        }

    def reference(self, config: dict) -> dict:
        print(f"memcpy reference (parent, 1 thread, {config['dtype']})...", flush=True)
        sizes = [s for _, s in config["points"]]
        return {"memcpy": measure_memcpy(sizes, config["dtype"], config["sampling"])}

    def run_rank(self, ctx: RankContext, config: dict) -> list[dict] | None:
        import gc

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
        self, ctx: RankContext, op: str, nbytes: int, numel: int, dtype, sampling: Sampling
    ) -> dict:
        """Check, calibrate, measure interleaved; returns the point (same on every rank)."""
        import hsdp_backend

        bufs = _make_buffers(op, numel, ctx.rank, ctx.world, dtype)
        groups = {"hsdp": ctx.hsdp, "gloo": ctx.gloo}
        call = {b: OPS[op].bind(bufs, groups[b]) for b in BACKENDS}

        for b in BACKENDS:
            problem = _check_once(op, bufs, call[b], ctx.rank, ctx.world)
            if problem:
                raise RuntimeError(
                    f"[rank {ctx.rank}/{ctx.world}] {b} {op} of {format_size(nbytes)} "
                    f"returned a wrong result: {problem}"
                )

        calls_per_sample = _calibrate(ctx, call, sampling)
        hsdp_backend.reset_comm_stats(ctx.hsdp)
        samples = _sample_interleaved(ctx, call, calls_per_sample, sampling)
        stats = hsdp_backend.comm_stats(ctx.hsdp)
        result = {"op": op, "bytes": nbytes, "numel": numel}
        result.update(_summarise_samples(ctx, samples, calls_per_sample))
        result["hsdp"]["comm_stats"] = stats.get(op)
        return result

    def report(self, config: dict, reference: dict, per_world: dict[int, Any]) -> dict:
        memcpy = reference["memcpy"]
        print(f"\nmemcpy (single thread, dst.copy_(src), {config['dtype']}):")
        print(f"  {'size':>8}  {'us':>10}  {'GB/s':>8}")
        for nbytes, m in sorted(memcpy.items()):
            print(f"  {format_size(nbytes):>8}  {m['us']:10.2f}  {m['gbps']:8.2f}")

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
                row["speedup"] = p["gloo"]["us"] / p["hsdp"]["us"]
                row["spread"] = max(_spread(p[b]["rank0_samples_us"]) for b in BACKENDS)
                mc = memcpy[p["bytes"]]
                row["memcpy_gbps"] = mc["gbps"]
                row["hsdp_memcpy_fraction"] = row["hsdp"]["busbw_gbps"] / mc["gbps"]
                row["copy_floor_us"] = 3 * mc["us"] if p["op"] == "all_reduce" else None
                table.append(row)
            _print_table(world, config["dtype"], table)
            rows += table
        print(TABLE_LEGEND)
        return {
            "dtype": config["dtype"],
            "ops": config["ops"],
            "sampling": dataclasses.asdict(config["sampling"]),
            "sample_target_s": SAMPLE_TARGET_S,
            "memcpy": [{"bytes": n, **m} for n, m in sorted(memcpy.items())],
            "results": rows,
        }

    def plot(self, section: dict, path: str) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        ops = section["ops"]
        worlds = sorted({r["world"] for r in section["results"]})
        fig, axes = plt.subplots(1, len(ops), figsize=(5.5 * len(ops), 4.5), squeeze=False)
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        for ax, op in zip(axes[0], ops, strict=True):
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
                ax.plot(
                    xs,
                    [r["hsdp"]["busbw_gbps"] for r in rows],
                    "o-",
                    color=color,
                    label=f"hsdp W={world}",
                )
                ax.plot(
                    xs,
                    [r["gloo"]["busbw_gbps"] for r in rows],
                    "x--",
                    color=color,
                    label=f"gloo W={world}",
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
            ax.set_xticks(ticks, [_short_size(t) for t in ticks])
            ax.set_xlabel("bytes per rank")
            ax.set_ylabel("bus bandwidth (GB/s)")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize="small")
        fig.suptitle(f"hsdp vs gloo, {section['dtype']}, busbw (nccl-tests convention)")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


TABLE_LEGEND = """
latency = max over ranks of each rank's median per-call time; busbw as in nccl-tests;
speedup = gloo time / hsdp time; hsdp/memcpy = hsdp busbw / single-thread memcpy GB/s;
3xcopy = 3 x memcpy time of the message (copy in + reduce + copy out), all_reduce only;
spread = interquartile range / median of rank 0's samples, the noisier backend: ratios
of rows with a large spread (say > 50%) are not to be trusted."""


def _spread(samples: list[float]) -> float:
    """Interquartile range / median of some samples: how noisy a point was."""
    if len(samples) < 2:
        return 0.0
    q1, q2, q3 = statistics.quantiles(samples, n=4)
    return (q3 - q1) / q2 if q2 > 0 else 0.0


def _print_table(world: int, dtype: str, rows: list[dict]) -> None:
    """One fixed-width table for one world size."""
    cols = [
        ("op", 22, lambda r: r["op"]),
        ("size/rank", 9, lambda r: format_size(r["bytes_per_rank"])),
        ("hsdp us", 11, lambda r: f"{r['hsdp']['us']:.1f}"),
        ("gloo us", 11, lambda r: f"{r['gloo']['us']:.1f}"),
        ("hsdp GB/s", 9, lambda r: f"{r['hsdp']['busbw_gbps']:.3f}"),
        ("gloo GB/s", 9, lambda r: f"{r['gloo']['busbw_gbps']:.3f}"),
        ("speedup", 7, lambda r: f"{r['speedup']:.2f}x"),
        ("hsdp/memcpy", 11, lambda r: f"{r['hsdp_memcpy_fraction']:.3f}"),
        (
            "3xcopy us",
            10,
            lambda r: "-" if r["copy_floor_us"] is None else f"{r['copy_floor_us']:.1f}",
        ),
        ("spread", 6, lambda r: f"{100 * r['spread']:.0f}%"),
    ]
    print(f"\nworld size {world} ({dtype}; busbw in GB/s):")
    print("  ".join(f"{h:<{w}}" if i == 0 else f"{h:>{w}}" for i, (h, w, _) in enumerate(cols)))
    for r in rows:
        print(
            "  ".join(
                f"{f(r):<{w}}" if i == 0 else f"{f(r):>{w}}" for i, (_, w, f) in enumerate(cols)
            )
        )


def _sampling_from_args(args: argparse.Namespace) -> Sampling:
    quick = args.quick
    return Sampling(
        time_per_point_s=args.time_per_point
        if args.time_per_point is not None
        else (0.1 if quick else 0.3),
        min_reps=args.min_reps,
        max_reps=args.max_reps if args.max_reps is not None else (50 if quick else 200),
        warmup=args.warmup if args.warmup is not None else (2 if quick else 3),
        fixed_reps=args.iters,
    )


# --- the coalesced suite ---------------------------------------------------
#
# FSDP2 gathers / reduce-scatters a module's parameter shards in one go.
# Three ways to do that for the same 200 tensors, measured interleaved: one
# call per tensor on gloo; the same calls inside ``dist._coalescing_manager``
# on gloo (gloo's own coalesced path); and inside it on hsdp (one fused
# collective per dtype).

COALESCED_LAYERS = 12
COALESCED_DEFAULT_DIM = 256
COALESCED_OPS = ("all_gather_into_tensor", "reduce_scatter_tensor")
COALESCED_VARIANTS = ("gloo_per_tensor", "gloo_coalesced", "hsdp_fused")
COALESCED_LABELS = {
    "gloo_per_tensor": "(a) gloo, one call per tensor",
    "gloo_coalesced": "(b) gloo, _coalescing_manager",
    "hsdp_fused": "(c) hsdp, _coalescing_manager (fused)",
}
# hsdp fused should be at least this much faster than (a) on 2 ranks.
COALESCED_TARGET_SPEEDUP = 20.0
# Time budget per variant per op (default, --quick): a call moves the whole
# model, so samples are long and few fit into the collectives suite's budget.
COALESCED_TIME_PER_OP_S = (2.0, 0.5)


def transformer_shapes(dim: int, layers: int = COALESCED_LAYERS) -> list[tuple[str, tuple]]:
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


def _coalesced_fill(op: str, bufs: list[dict], rank: int, world: int) -> None:
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


def _coalesced_expected(op: str, numel: int, i: int, rank: int, world: int, dtype):
    """The exact output of tensor ``i`` on ``rank`` (see ``_coalesced_fill``)."""
    import torch

    if op == "all_gather_into_tensor":
        return torch.cat([_small_ints(numel, 7 * s + i, 13, dtype) for s in range(world)])
    total = sum(_small_ints(numel, 5 * s + 3 * rank + i, 11, torch.int64) for s in range(world))
    return total.to(dtype)


def _coalesced_buffers(op: str, numels: list[int], world: int, dtype) -> list[dict]:
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


def _bind_coalesced_variant(variant: str, op: str, bufs: list[dict], ctx: RankContext):
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


class CoalescedSuite(Suite):
    name = "coalesced"
    help = (
        "200 transformer parameter shards: all-gather / reduce-scatter one call per tensor "
        "on gloo, gloo coalesced, hsdp fused"
    )
    default_ranks = (2,)
    output_stem = "bench_coalesced"

    def configure(self, args: argparse.Namespace) -> dict:
        if args.dim < 1:
            raise ValueError("--dim must be >= 1")
        sampling = _sampling_from_args(args)
        if args.time_per_point is None:
            budget = COALESCED_TIME_PER_OP_S[1 if args.quick else 0]
            sampling = dataclasses.replace(sampling, time_per_point_s=budget)
        shapes = transformer_shapes(args.dim)
        return {
            "dim": args.dim,
            "layers": COALESCED_LAYERS,
            "shapes": shapes,
            "dtype": args.dtype,
            "sampling": sampling,
        }

    def run_rank(self, ctx: RankContext, config: dict) -> list[dict] | None:
        import gc

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
                    + "  ".join(f"{v} {res[v]['us'] / 1e3:8.2f} ms" for v in COALESCED_VARIANTS)
                    + f"  ({res['hsdp_fused']['reps']} reps)"
                )
                out.append(res)
                gc.collect()
        finally:
            gc.enable()
        return out if ctx.rank == 0 else None

    def _measure_op(
        self, ctx: RankContext, op: str, numels: list[int], dtype, sampling: Sampling
    ) -> dict:
        """Check every variant, calibrate, measure interleaved; the same on every rank."""
        import torch

        import hsdp_backend

        bufs = _coalesced_buffers(op, numels, ctx.world, dtype)
        call = {v: _bind_coalesced_variant(v, op, bufs, ctx) for v in COALESCED_VARIANTS}
        expected = [
            _coalesced_expected(op, n, i, ctx.rank, ctx.world, dtype) for i, n in enumerate(numels)
        ]
        for v in COALESCED_VARIANTS:
            # All three must produce the exact answer (hence agree bitwise).
            _coalesced_fill(op, bufs, ctx.rank, ctx.world)
            for b in bufs:
                b["out"].fill_(-1)
            call[v]()
            for i, (b, want) in enumerate(zip(bufs, expected, strict=True)):
                if not torch.equal(b["out"], want):
                    bad = (b["out"].double() - want.double()).abs().argmax().item()
                    raise RuntimeError(
                        f"[rank {ctx.rank}/{ctx.world}] {COALESCED_LABELS[v]}: {op} of tensor {i} "
                        f"({numels[i]} elements) returned a wrong result: element {bad}: "
                        f"got {b['out'][bad].item()}, expected {want[bad].item()}"
                    )
        del expected

        calls_per_sample = _calibrate(ctx, call, sampling)
        hsdp_backend.reset_comm_stats(ctx.hsdp)
        samples = _sample_interleaved(ctx, call, calls_per_sample, sampling)
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
        result.update(_summarise_samples(ctx, samples, calls_per_sample))
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
                row["spread"] = max(_spread(p[v]["rank0_samples_us"]) for v in COALESCED_VARIANTS)
                table.append(row)
            self._print_table(world, config, table)
            rows += table
        print(COALESCED_LEGEND)
        verdicts = self._print_verdicts(rows)
        return {
            "dtype": config["dtype"],
            "dim": config["dim"],
            "layers": config["layers"],
            "shapes": [{"name": n, "shape": list(s)} for n, s in config["shapes"]],
            "variants": {v: COALESCED_LABELS[v] for v in COALESCED_VARIANTS},
            "target_speedup_a_over_c_2_ranks": COALESCED_TARGET_SPEEDUP,
            "sampling": dataclasses.asdict(config["sampling"]),
            "results": rows,
            "verdicts": verdicts,
        }

    @staticmethod
    def _print_table(world: int, config: dict, rows: list[dict]) -> None:
        r0 = rows[0]
        print(
            f"\nworld size {world} ({r0['tensors']} {config['dtype']} tensors, dim "
            f"{config['dim']}, {r0['bytes_per_rank'] / MIB:.1f} MiB per rank; "
            "ms per call over all tensors):"
        )
        cols = [
            ("op", 22, lambda r: r["op"]),
            ("(a) gloo/tensor", 15, lambda r: f"{r['gloo_per_tensor']['us'] / 1e3:.2f}"),
            ("(b) gloo coal.", 14, lambda r: f"{r['gloo_coalesced']['us'] / 1e3:.2f}"),
            ("(c) hsdp fused", 14, lambda r: f"{r['hsdp_fused']['us'] / 1e3:.2f}"),
            ("a/c", 7, lambda r: f"{r['a_over_c']:.1f}x"),
            ("b/c", 7, lambda r: f"{r['b_over_c']:.1f}x"),
            ("hsdp GB/s", 9, lambda r: f"{r['hsdp_busbw_gbps']:.2f}"),
            ("hsdp coll/call", 14, lambda r: f"{r['hsdp_collectives_per_call']:g}"),
            ("reps", 4, lambda r: str(r["hsdp_fused"]["reps"])),
            ("spread", 6, lambda r: f"{100 * r['spread']:.0f}%"),
        ]
        print("  ".join(f"{h:<{w}}" if i == 0 else f"{h:>{w}}" for i, (h, w, _) in enumerate(cols)))
        for r in rows:
            print(
                "  ".join(
                    f"{f(r):<{w}}" if i == 0 else f"{f(r):>{w}}" for i, (_, w, f) in enumerate(cols)
                )
            )

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
                v["target_met"] = r["a_over_c"] >= COALESCED_TARGET_SPEEDUP
                line += (
                    f"; hsdp fused vs (a) {r['a_over_c']:.1f}x, target >= "
                    f"{COALESCED_TARGET_SPEEDUP:g}x {'met' if v['target_met'] else 'NOT met'}"
                )
            print(line)
            verdicts.append(v)
        return verdicts

    def plot(self, section: dict, path: str) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        worlds = sorted({r["world"] for r in section["results"]})
        fig, axes = plt.subplots(1, len(worlds), figsize=(6 * len(worlds), 4.5), squeeze=False)
        width = 0.8 / len(COALESCED_VARIANTS)
        for ax, world in zip(axes[0], worlds, strict=True):
            rows = [r for r in section["results"] if r["world"] == world]
            for k, v in enumerate(COALESCED_VARIANTS):
                xs = [i + (k - 1) * width for i in range(len(rows))]
                ms = [r[v]["us"] / 1e3 for r in rows]
                ax.bar(xs, ms, width, label=section["variants"][v])
                if v == "hsdp_fused":
                    for x, y, r in zip(xs, ms, rows, strict=True):
                        ax.annotate(
                            f"{r['a_over_c']:.1f}x / {r['b_over_c']:.1f}x",
                            (x, y),
                            ha="center",
                            va="bottom",
                            fontsize="small",
                        )
            ax.set_xticks(range(len(rows)), [r["op"] for r in rows])
            ax.set_yscale("log")
            top = max(r[v]["us"] for r in rows for v in COALESCED_VARIANTS) / 1e3
            ax.set_ylim(top=top * 10)  # room for the legend above the bars
            ax.set_ylabel("ms per call over all tensors (median, max over ranks)")
            mib = rows[0]["bytes_per_rank"] / MIB
            ax.set_title(f"W={world}, {rows[0]['tensors']} tensors, {mib:.1f} MiB per rank")
            ax.grid(True, axis="y", which="both", alpha=0.3)
            ax.legend(fontsize="small", title="labels over (c): a/c / b/c", title_fontsize="small")
        fig.suptitle(
            f"fused coalesced collectives, {section['dtype']}, transformer dim {section['dim']}"
        )
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


COALESCED_LEGEND = """
ms = max over ranks of each rank's median time of one call over all tensors (the three
variants interleaved); a/c, b/c = how many times faster hsdp fused is than (a) / (b);
hsdp GB/s = hsdp fused busbw (nccl-tests); hsdp coll/call = collectives hsdp issued per
fused call (comm_stats, all ops, during the measurement); spread as in the collectives
suite. Every variant's output was checked exactly before timing."""


# --- the numerics suite ----------------------------------------------------
#
# Low-precision AVG against an fp64 reference, hsdp vs gloo. No timing.

NUMERICS_DTYPES = ("bfloat16", "float16")
NUMERICS_OPS = ("all_reduce", "reduce_scatter_tensor")
NUMERICS_DEFAULT_NUMEL = {"all_reduce": MIB, "reduce_scatter_tensor": 256 * KIB}
NUMERICS_QUICK_NUMEL = {"all_reduce": 64 * KIB, "reduce_scatter_tensor": 16 * KIB}
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


def _numerics_input(seed: int, op_index: int, rank: int, numel: int):
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


class NumericsSuite(Suite):
    name = "numerics"
    help = (
        "bf16/fp16 AVG all_reduce / reduce_scatter error in ulps vs an fp64 reference, hsdp vs gloo"
    )
    default_ranks = (2, 4, 8)
    output_stem = "bench_numerics"

    def configure(self, args: argparse.Namespace) -> dict:
        defaults = NUMERICS_QUICK_NUMEL if args.quick else NUMERICS_DEFAULT_NUMEL
        numel = {
            "all_reduce": parse_size(args.ar_numel) if args.ar_numel else defaults["all_reduce"],
            "reduce_scatter_tensor": parse_size(args.rs_numel)
            if args.rs_numel
            else defaults["reduce_scatter_tensor"],
        }
        if min(numel.values()) < 1:
            raise ValueError("--ar-numel and --rs-numel must be >= 1")
        return {"dtypes": NUMERICS_DTYPES, "ops": NUMERICS_OPS, "numel": numel, "seed": args.seed}

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
                x = _numerics_input(config["seed"], op_index, s, n_in)
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
        print(
            f"\nAVG error in ulps of the output dtype vs the fp64 mean of the low-precision inputs "
            f"(standard normal, seed {config['seed']}; all_reduce {n['all_reduce']} elements per "
            f"rank, reduce_scatter_tensor {n['reduce_scatter_tensor']} out per rank; max / mean "
            "over every rank's output elements whose reference is not exactly 0; those are "
            "counted apart, with how many each backend returned non-zero):\n"
        )
        print(
            "| dtype | op | W | hsdp max | hsdp mean | gloo max | gloo mean | gloo reduction "
            "| ref = 0: n (non-zero hsdp / gloo) "
            f"| hsdp <= 0.5 ulp (+{HALF_ULP_SLACK:g}) | hsdp <= gloo (max, mean) |"
        )
        print("|---|---|---:|---:|---:|---:|---:|---|---|---|---|")
        yes = {True: "yes", False: "**no**"}
        for r in rows:
            h, g = r["hsdp"], r["gloo"]
            print(
                f"| {r['dtype']} | {r['op']} | {r['world']} | {_format_ulp(h['max_ulp'])} | "
                f"{_format_ulp(h['mean_ulp'])} | {_format_ulp(g['max_ulp'])} | "
                f"{_format_ulp(g['mean_ulp'])} | {g['reduction']} | {h['zero_refs']} "
                f"({h['nonzero_at_zero_refs']} / {g['nonzero_at_zero_refs']}) | "
                f"{yes[r['hsdp_within_half_ulp']]} | "
                f"{yes[r['hsdp_max_le_gloo']]}, {yes[r['hsdp_mean_le_gloo']]} |"
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
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        dtypes = section["dtypes"]
        fig, axes = plt.subplots(1, len(dtypes), figsize=(6.5 * len(dtypes), 4.5), squeeze=False)
        for ax, d in zip(axes[0], dtypes, strict=True):
            rows = [r for r in section["results"] if r["dtype"] == d]
            xs = range(len(rows))
            bars = [(b, stat) for stat in ("max", "mean") for b in BACKENDS]
            width = 0.8 / len(bars)
            colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
            for k, (b, stat) in enumerate(bars):
                ax.bar(
                    [x + (k - (len(bars) - 1) / 2) * width for x in xs],
                    [r[b][f"{stat}_ulp"] for r in rows],
                    width,
                    color=colors[BACKENDS.index(b)],
                    hatch="" if stat == "max" else "//",
                    alpha=1.0 if stat == "max" else 0.5,
                    label=f"{b} {stat}",
                )
            ax.axhline(0.5, color="black", linestyle=":", label="0.5 ulp")
            ax.set_yscale("log")
            labels = [f"{'AR' if r['op'] == 'all_reduce' else 'RS'} W={r['world']}" for r in rows]
            ax.set_xticks(list(xs), labels)
            ax.set_ylabel("error (ulps of the output dtype)")
            ax.set_title(f"{d} AVG")
            ax.grid(True, axis="y", which="both", alpha=0.3)
            ax.legend(fontsize="small")
        fig.suptitle("AVG error vs fp64 reference (AR = all_reduce, RS = reduce_scatter_tensor)")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


# --- the training suite ----------------------------------------------------
#
# The repository's FSDP2 example scripts under torchrun, the same work on
# hsdp and on gloo: rank 0's step time, its median after warm-up. The
# exposed communication is forward + backward (where FSDP2 communicates; the
# optimizer step is local) minus the same on a compute-only baseline: W
# independent 1-rank copies of the script running at once, so the baseline's
# ranks compete for cores and memory bandwidth exactly as the W ranks do.

# name -> the scripts' model flags. FSDP2 groups = layers + 1 (each block and
# the root, as in apply_fsdp).
TRAINING_MODELS: dict[str, dict[str, int]] = {
    # 10.6 M parameters (8.2 M of them outside the embedding): bandwidth-bound.
    "small": {"dim": 256, "layers": 8, "heads": 8, "vocab": 8192},
    # 66 k parameters in 11 groups: every collective is a latency.
    "tiny": {"dim": 16, "layers": 10, "heads": 2, "vocab": 768},
}
TRAINING_QUICK_MODELS = ("tiny",)
# Steps per run (default, --quick), warm-up included.
TRAINING_STEPS = {"small": (12, 6), "tiny": (20, 8)}
# Steps dropped from the start of each run (lazy init, first allocations).
TRAINING_WARMUP_STEPS = 3
# Runs per (configuration, backend) (default, --quick).
TRAINING_REPEATS = (2, 1)
# Tokens per rank per step: batch x seq-len; a small-model step takes a few
# hundred ms on one core.
TRAINING_SEQ_LEN = 64
TRAINING_BATCH_SIZE = 2
# gloo exposed / hsdp exposed should be at least this for the small model.
TRAINING_TARGET_RATIO = 5.0
# Wall-clock limit of one torchrun (capped by what is left of --timeout).
TRAINING_RUN_TIMEOUT_S = 600.0
# How long torchrun gets to stop its workers after SIGTERM.
TRAINING_STOP_GRACE_S = 40.0
# FSDP2 issues no collectives on a 1-rank mesh (unshard and reduce are local
# copies), so the backend of the baseline does not matter; gloo, the neutral one.
TRAINING_BASELINE_BACKEND = "gloo"


@dataclass(frozen=True)
class TrainingMesh:
    """One configuration: the example script and its world size."""

    name: str  # key in the JSON
    label: str  # in the tables
    world: int
    script: str  # in examples/
    extra: tuple[str, ...] = ()  # script flags
    copies: int = 1  # independent runs started at once (the baseline: W copies of 1 rank)


TRAINING_MESHES = (
    TrainingMesh("fsdp_2", "FSDP 2", 2, "train_fsdp.py"),
    TrainingMesh("hsdp_2x2", "HSDP 2x2", 4, "train_hsdp.py", ("--replicate", "2", "--shard", "2")),
)
TRAINING_BASELINE_SCRIPT = "train_fsdp.py"


def training_baseline(mesh: TrainingMesh) -> TrainingMesh:
    """The compute-only baseline of ``mesh``: ``mesh.world`` concurrent
    1-rank runs (FSDP2 issues no collectives on one rank)."""
    return TrainingMesh(
        f"1_rank_x{mesh.world}",
        f"1 rank x{mesh.world}",
        1,
        TRAINING_BASELINE_SCRIPT,
        copies=mesh.world,
    )


# Rank 0's lines: "step   3  loss 7.123456     45.6 ms  fwd+bwd     40.1 ms     1234 tok/s<comm
# stats>", "model: 10.62M params, ...", "final loss 7.1".
_STEP_RE = re.compile(
    r"^step\s+(\d+)\s+loss\s+(\S+)\s+([0-9.]+)\s*ms\s+fwd\+bwd\s+([0-9.]+)\s*ms\s+([0-9.]+)\s*tok/s(.*)$",
    re.MULTILINE,
)
_STEP_ANY_RE = re.compile(r"^step\s+\d+\s+loss", re.MULTILINE)
_PARAMS_RE = re.compile(r"^model: ([0-9.]+)M params", re.MULTILINE)
_FINAL_RE = re.compile(r"^final loss (\S+)", re.MULTILINE)


def examples_dir(explicit: str | None = None) -> str:
    """The repository's ``examples/`` (not installed with the package):
    ``explicit`` (--examples) if given, else next to the package (a source
    checkout installed with ``pip install -e``), else ``./examples``."""
    if explicit:
        return os.path.abspath(explicit)
    import hsdp_backend

    root = os.path.dirname(os.path.dirname(os.path.realpath(hsdp_backend.__file__)))
    beside_package = os.path.join(root, "examples")
    if os.path.isdir(beside_package):
        return beside_package
    return os.path.abspath("examples")


def training_param_counts(script: str, models: dict[str, dict[str, int]]) -> dict[str, int | None]:
    """Exact parameter count of each model, built on the meta device from the
    example's own ``Transformer``; None where that fails (the run's
    ``model: X.XXM params`` line is used instead)."""
    import importlib.util

    import torch

    name = "_hsdp_bench_train_fsdp"
    counts: dict[str, int | None] = dict.fromkeys(models)
    try:
        spec = importlib.util.spec_from_file_location(name, script)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
        for model, a in models.items():
            with torch.device("meta"):
                net = module.Transformer(
                    module.ModelArgs(
                        dim=a["dim"],
                        n_layers=a["layers"],
                        n_heads=a["heads"],
                        vocab_size=a["vocab"],
                    )
                )
            counts[model] = sum(p.numel() for p in net.parameters())
    except Exception:  # noqa: BLE001 - the printed count is the fallback
        pass
    finally:
        sys.modules.pop(name, None)
    return counts


def parse_training_output(text: str) -> dict:
    """Rank 0's output of a training script: per-step ms and losses, the last
    step's comm-stats text (hsdp only, else ""), the printed parameter count
    and the final loss. Raises ValueError when there is no step line with ms."""
    steps = _STEP_RE.findall(text)
    if not steps:
        if _STEP_ANY_RE.search(text):
            raise ValueError(
                "the step lines carry no 'NN.N ms  fwd+bwd NN.N ms' fields: examples/train_fsdp.py "
                "predates per-step times"
            )
        raise ValueError("no 'step N  loss ...' lines in the output")
    params = _PARAMS_RE.search(text)
    final = _FINAL_RE.search(text)
    return {
        "step_ms": [float(s[2]) for s in steps],
        "fwd_bwd_ms": [float(s[3]) for s in steps],
        "losses": [float(s[1]) for s in steps],
        "comm_stats_last_step": steps[-1][5].strip(),
        "params_printed": round(float(params.group(1)) * 1e6) if params else None,
        "final_loss": float(final.group(1)) if final else None,
    }


def _free_port() -> int:
    """A loopback TCP port nobody listens on right now (for torchrun's --master-port)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _stop_torchrun(proc) -> None:
    """SIGTERM to torchrun (it stops its workers, which live in their own
    sessions), SIGKILL to its process group if it does not exit in time."""
    import subprocess

    if proc.poll() is not None:
        return
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(TRAINING_STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(5)


def run_torchrun(cmd: list[str], env: dict, timeout_s: float) -> tuple[int | None, str, str]:
    """Runs ``cmd`` in its own session; ``(returncode or None on timeout, stdout, stderr)``.

    torchrun is stopped on timeout and on any exception here (Ctrl-C, SIGTERM).
    """
    import subprocess

    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # Ctrl-C reaches the parent only; it stops torchrun
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        _stop_torchrun(proc)
        try:  # workers that outlived torchrun would hold the pipes open
            out, err = proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            out, err = "", "(output not collected: pipes still held open)"
        return None, out or "", err or ""
    finally:
        _stop_torchrun(proc)


class TrainingSuite(Suite):
    name = "training"
    help = (
        "FSDP2 training step (examples/train_fsdp.py, train_hsdp.py) under torchrun on hsdp "
        "and on gloo, against the same script on 1 rank"
    )
    default_ranks = (2, 4)
    output_stem = "bench_training"

    def configure(self, args: argparse.Namespace) -> dict:
        examples = examples_dir(args.examples)
        missing = [
            m.script
            for m in (training_baseline(TRAINING_MESHES[0]), *TRAINING_MESHES)
            if not os.path.isfile(os.path.join(examples, m.script))
        ]
        if missing:
            raise ValueError(
                f"the training suite runs the repository's example scripts, which are not "
                f"installed with the package: {', '.join(sorted(set(missing)))} not found in "
                f"{examples} (pass --examples DIR, the repository's examples/ directory)"
            )
        known = {m.world: m for m in TRAINING_MESHES}
        unknown = [w for w in args.ranks if w not in known]
        if unknown:
            raise ValueError(
                f"training suite: no configuration for world size(s) {unknown}; choose from "
                + ", ".join(f"{w} ({m.label})" for w, m in known.items())
            )
        meshes = [m for m in TRAINING_MESHES if m.world in args.ranks]
        if args.models:
            models = []
            for item in args.models.split(","):
                item = item.strip().lower()
                if item not in TRAINING_MODELS:
                    raise ValueError(
                        f"unknown model {item!r}; choose from {', '.join(TRAINING_MODELS)}"
                    )
                if item not in models:
                    models.append(item)
        else:
            models = list(TRAINING_QUICK_MODELS if args.quick else TRAINING_MODELS)
        warmup = args.warmup if args.warmup is not None else TRAINING_WARMUP_STEPS
        steps = {
            m: args.steps if args.steps is not None else TRAINING_STEPS[m][1 if args.quick else 0]
            for m in models
        }
        for m, n in steps.items():
            if warmup < 0 or n - warmup < 1:
                raise ValueError(
                    f"{m} model: --steps {n} leaves no measured step after --warmup {warmup}"
                )
        repeats = (
            args.repeats if args.repeats is not None else TRAINING_REPEATS[1 if args.quick else 0]
        )
        if repeats < 1:
            raise ValueError("--repeats must be >= 1")
        if args.seq_len < 1 or args.batch_size < 1:
            raise ValueError("--seq-len and --batch-size must be >= 1")
        script = os.path.join(examples, TRAINING_BASELINE_SCRIPT)
        params = training_param_counts(script, {m: TRAINING_MODELS[m] for m in models})
        return {
            "examples": examples,
            "models": models,
            "model_args": {m: dict(TRAINING_MODELS[m]) for m in models},
            "params": params,
            "meshes": meshes,
            "steps": steps,
            "warmup_steps": warmup,
            "repeats": repeats,
            "seq_len": args.seq_len,
            "batch_size": args.batch_size,
            "seed": args.seed,
            "baseline_backend": TRAINING_BASELINE_BACKEND,
        }

    @staticmethod
    def _plan(config: dict) -> list[tuple[int, str, TrainingMesh, str]]:
        """``(repeat, model, mesh, backend)`` in run order.

        Per repeat and model, per configuration: its baseline, then hsdp and
        gloo; odd repeats run the same list backwards, so no contender always
        goes first (as the other suites alternate).
        """
        plan = []
        for rep in range(config["repeats"]):
            for model in config["models"]:
                seq = []
                for mesh in config["meshes"]:
                    seq.append((training_baseline(mesh), config["baseline_backend"]))
                    seq += [(mesh, b) for b in BACKENDS]
                if rep % 2:
                    seq.reverse()
                plan += [(rep, model, mesh, b) for mesh, b in seq]
        return plan

    def _command(self, config: dict, model: str, mesh: TrainingMesh, backend: str) -> list[str]:
        a = config["model_args"][model]
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(mesh.world),
            "--master-port",
            str(_free_port()),
            os.path.join(config["examples"], mesh.script),
            "--backend",
            backend,
            "--steps",
            str(config["steps"][model]),
            "--dim",
            str(a["dim"]),
            "--layers",
            str(a["layers"]),
            "--heads",
            str(a["heads"]),
            "--vocab",
            str(a["vocab"]),
            "--seq-len",
            str(config["seq_len"]),
            "--batch-size",
            str(config["batch_size"]),
            "--mixed-precision",
            "none",
            "--seed",
            str(config["seed"]),
            *mesh.extra,
        ]

    def run_all(
        self, config: dict, ranks: list[int], env: dict, deadline: float, verbose: bool
    ) -> tuple[dict[int, Any], dict[int, str], dict[int, float]]:
        # OMP_NUM_THREADS=1 everywhere, the 1-rank baseline included, so it
        # computes as one rank of W does (an explicit --env may override).
        run_env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
        plan = self._plan(config)
        per_world: dict[int, Any] = {}
        wall: dict[int, float] = {}
        for i, (rep, model, mesh, backend) in enumerate(plan):
            time_left = deadline - time.monotonic()
            if time_left <= 0:
                raise BenchFailure(f"no time left for run {i + 1} of {len(plan)} (see --timeout)")
            what = f"{model} model, {mesh.label}, {backend}"
            print(
                f"[{i + 1}/{len(plan)}] repeat {rep + 1}/{config['repeats']}: {what} "
                f"({config['steps'][model]} steps)...",
                flush=True,
            )
            cmds = [self._command(config, model, mesh, backend) for _ in range(mesh.copies)]
            t0 = time.monotonic()
            # Copies start together (one thread each waits on its torchrun).
            with concurrent.futures.ThreadPoolExecutor(len(cmds)) as pool:
                finished = list(
                    pool.map(
                        lambda c: run_torchrun(c, run_env, min(TRAINING_RUN_TIMEOUT_S, time_left)),
                        cmds,
                    )
                )
            elapsed = time.monotonic() - t0
            copies = []
            for cmd, (rc, out, err) in zip(cmds, finished):
                if rc != 0:
                    why = "timed out" if rc is None else f"exited with code {rc}"
                    raise BenchFailure(
                        f"{what}: torchrun {why} after {elapsed:.1f} s\ncommand: {' '.join(cmd)}\n"
                        f"--- stdout (end) ---\n{out[-3000:].rstrip()}\n"
                        f"--- stderr (end) ---\n{err[-4000:].rstrip()}"
                    )
                try:
                    copies.append(parse_training_output(out))
                except ValueError as exc:
                    raise BenchFailure(
                        f"{what}: {exc}\ncommand: {' '.join(cmd)}\n--- stdout ---\n{out[-3000:]}"
                    ) from None
                if verbose:
                    for line in out.splitlines():
                        if line.startswith("step"):
                            print(f"  {line}", file=sys.stderr, flush=True)
            cmd = cmds[0]
            parsed = copies[0]
            warm = config["warmup_steps"]
            measured = [ms for c in copies for ms in c["step_ms"][warm:]]
            measured_fwd_bwd = [ms for c in copies for ms in c["fwd_bwd_ms"][warm:]]
            if not measured:
                raise BenchFailure(
                    f"{what}: {len(parsed['step_ms'])} step lines, none after the "
                    f"{warm} warm-up steps"
                )
            run = {
                "model": model,
                "mesh": mesh.name,
                "world": mesh.world,
                "backend": backend,
                "repeat": rep,
                "command": cmd,
                "wall_s": elapsed,
                "copies": mesh.copies,
                "measured_ms": measured,
                "measured_fwd_bwd_ms": measured_fwd_bwd,
                "median_ms": statistics.median(measured),
                "median_fwd_bwd_ms": statistics.median(measured_fwd_bwd),
                **parsed,
            }
            print(
                f"    median {run['median_ms']:.1f} ms, fwd+bwd {run['median_fwd_bwd_ms']:.1f} ms "
                f"over {len(measured)} steps (run {elapsed:.1f} s)",
                flush=True,
            )
            per_world.setdefault(mesh.world, []).append(run)
            wall[mesh.world] = wall.get(mesh.world, 0.0) + elapsed
        return per_world, {}, wall

    def report(self, config: dict, reference: dict, per_world: dict[int, Any]) -> dict:
        runs = [r for _, rs in sorted(per_world.items()) for r in rs]

        def pooled(model: str, mesh: str, backend: str, key: str = "measured_ms") -> list[float]:
            return [
                ms
                for r in runs
                if (r["model"], r["mesh"], r["backend"]) == (model, mesh, backend)
                for ms in r[key]
            ]

        def last_run(model: str, mesh: str, backend: str) -> dict:
            return [
                r for r in runs if (r["model"], r["mesh"], r["backend"]) == (model, mesh, backend)
            ][-1]

        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        models = {}
        for m in config["models"]:
            base = last_run(
                m, training_baseline(config["meshes"][0]).name, config["baseline_backend"]
            )
            params = config["params"][m] or base["params_printed"]
            models[m] = {
                **config["model_args"][m],
                "params": params,
                "params_exact": config["params"][m] is not None,
                "fsdp_groups": config["model_args"][m]["layers"] + 1,
                "steps": config["steps"][m],
            }
        rows = []
        for mesh in config["meshes"]:
            for m in config["models"]:
                baseline = training_baseline(mesh)
                base_samples = pooled(
                    m, baseline.name, config["baseline_backend"], "measured_fwd_bwd_ms"
                )
                base_ms = statistics.median(base_samples)
                row = {
                    "mesh": mesh.name,
                    "mesh_label": mesh.label,
                    "world": mesh.world,
                    "script": mesh.script,
                    "model": m,
                    "params": models[m]["params"],
                    "fsdp_groups": models[m]["fsdp_groups"],
                    "oversubscribed": mesh.world > (cpus or 1),
                    "baseline": {
                        "backend": config["baseline_backend"],
                        "copies": baseline.copies,
                        "step_ms": statistics.median(
                            pooled(m, baseline.name, config["baseline_backend"])
                        ),
                        "fwd_bwd_ms": base_ms,
                        "spread": _spread(base_samples),
                        "steps_measured": len(base_samples),
                    },
                }
                for b in BACKENDS:
                    samples = pooled(m, mesh.name, b, "measured_fwd_bwd_ms")
                    step = statistics.median(pooled(m, mesh.name, b))
                    fwd_bwd = statistics.median(samples)
                    exposed = fwd_bwd - base_ms
                    row[b] = {
                        "step_ms": step,
                        "fwd_bwd_ms": fwd_bwd,
                        "exposed_ms": exposed,
                        "comm_share": exposed / step,
                        "spread": _spread(samples),
                        "steps_measured": len(samples),
                        "per_run_median_ms": [
                            r["median_ms"]
                            for r in runs
                            if (r["model"], r["mesh"], r["backend"]) == (m, mesh.name, b)
                        ],
                        "final_loss": last_run(m, mesh.name, b)["final_loss"],
                    }
                h, g = row["hsdp"], row["gloo"]
                row["exposed_ratio_gloo_over_hsdp"] = (
                    g["exposed_ms"] / h["exposed_ms"] if h["exposed_ms"] > 0 else None
                )
                row["speedup"] = g["step_ms"] / h["step_ms"]
                row["spread"] = max(row[k]["spread"] for k in ("baseline", *BACKENDS))
                row["hsdp_comm_stats_last_step"] = last_run(m, mesh.name, "hsdp")[
                    "comm_stats_last_step"
                ]
                rows.append(row)

        self._print_table(config, models, rows)
        print(TRAINING_LEGEND)
        print()
        for r in rows:
            # The same work on both backends: at fp32 the losses agree.
            print(
                f"{r['mesh_label']} {r['model']}: hsdp comm_stats, last step, rank 0: "
                f"{r['hsdp_comm_stats_last_step'] or '(none printed)'}; final loss hsdp "
                f"{r['hsdp']['final_loss']} / gloo {r['gloo']['final_loss']}"
            )
        verdicts = []
        for r in rows:
            if r["model"] != "small":
                continue
            ratio = r["exposed_ratio_gloo_over_hsdp"]
            met = ratio is not None and ratio >= TRAINING_TARGET_RATIO
            verdicts.append({"mesh": r["mesh"], "model": r["model"], "target_met": met})
            shown = "n/a (hsdp exposed <= 0)" if ratio is None else f"{ratio:.1f}x"
            print(
                f"{r['mesh_label']} small: gloo exposed / hsdp exposed {shown}, target >= "
                f"{TRAINING_TARGET_RATIO:g}x {'met' if met else 'NOT met'}"
            )
        caveats = []
        for mesh in config["meshes"]:
            if mesh.world > (cpus or 1):
                caveats.append(
                    f"caveat: {mesh.label} runs {mesh.world} ranks on {cpus} cpus; its baseline runs "
                    f"{mesh.world} 1-rank copies at once, so compute is slowed alike, but a rank "
                    f"waiting in a collective also waits for descheduled peers: exposed "
                    f"communication includes scheduling delays a machine with a core per rank "
                    f"would not have"
                )
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
        if load > (cpus or 1) / 2:
            caveats.append(
                f"caveat: load average {load:.1f} on {cpus} cpus at the end: other processes "
                "competed for the cores; the interleaving spreads that over both backends, "
                "absolute times are noisy"
            )
        for c in caveats:
            print(c)
        return {
            "examples": config["examples"],
            "models": models,
            "meshes": [dataclasses.asdict(m) for m in config["meshes"]],
            "baselines": [dataclasses.asdict(training_baseline(m)) for m in config["meshes"]],
            "baseline_backend": config["baseline_backend"],
            "seq_len": config["seq_len"],
            "batch_size": config["batch_size"],
            "mixed_precision": "none",
            "seed": config["seed"],
            "warmup_steps": config["warmup_steps"],
            "repeats": config["repeats"],
            "omp_num_threads": 1,
            "cpus": cpus,
            "target_exposed_ratio_small": TRAINING_TARGET_RATIO,
            "results": rows,
            "verdicts": verdicts,
            "caveats": caveats,
            "runs": runs,
        }

    @staticmethod
    def _print_table(config: dict, models: dict, rows: list[dict]) -> None:
        def params(n: int | None) -> str:
            if n is None:
                return "?"
            return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}k"

        def ratio(r: dict) -> str:
            x = r["exposed_ratio_gloo_over_hsdp"]
            return "n/a" if x is None else f"{x:.1f}x"

        print(
            f"\ntraining step, rank 0, ms (median of the steps after {config['warmup_steps']} "
            f"warm-up steps of each run, {config['repeats']} run(s) per backend and "
            f"configuration, interleaved; fp32, seq-len {config['seq_len']}, batch "
            f"{config['batch_size']} per rank, OMP_NUM_THREADS=1):"
        )
        for m, a in models.items():
            print(
                f"  {m}: {params(a['params'])} params ({a['params']} exact"
                if a["params_exact"]
                else f"  {m}: {params(a['params'])} params (as printed by the script",
                end="",
            )
            print(
                f"), dim {a['dim']}, {a['layers']} layers, {a['heads']} heads, vocab "
                f"{a['vocab']}, {a['fsdp_groups']} FSDP groups, {a['steps']} steps per run"
            )
        cols = [
            ("mesh", 8, lambda r: r["mesh_label"]),
            ("model", 5, lambda r: r["model"]),
            ("params", 7, lambda r: params(r["params"])),
            ("compute", 8, lambda r: f"{r['baseline']['fwd_bwd_ms']:.1f}"),
            ("gloo f+b", 8, lambda r: f"{r['gloo']['fwd_bwd_ms']:.1f}"),
            ("hsdp f+b", 8, lambda r: f"{r['hsdp']['fwd_bwd_ms']:.1f}"),
            ("gloo exp", 8, lambda r: f"{r['gloo']['exposed_ms']:.1f}"),
            ("hsdp exp", 8, lambda r: f"{r['hsdp']['exposed_ms']:.1f}"),
            ("gloo/hsdp exp", 13, ratio),
            ("gloo share", 10, lambda r: f"{100 * r['gloo']['comm_share']:.0f}%"),
            ("hsdp share", 10, lambda r: f"{100 * r['hsdp']['comm_share']:.0f}%"),
            ("gloo step", 9, lambda r: f"{r['gloo']['step_ms']:.1f}"),
            ("hsdp step", 9, lambda r: f"{r['hsdp']['step_ms']:.1f}"),
            ("speedup", 7, lambda r: f"{r['speedup']:.2f}x"),
            ("spread", 6, lambda r: f"{100 * r['spread']:.0f}%"),
        ]
        print("  ".join(f"{h:<{w}}" if i < 2 else f"{h:>{w}}" for i, (h, w, _) in enumerate(cols)))
        for r in rows:
            print(
                "  ".join(
                    f"{f(r):<{w}}" if i < 2 else f"{f(r):>{w}}" for i, (_, w, f) in enumerate(cols)
                )
            )

    def plot(self, section: dict, path: str) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        models = list(section["models"])
        fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        for ax, m in zip(axes[0], models, strict=True):
            rows = [r for r in section["results"] if r["model"] == m]
            width = 0.25
            for i, r in enumerate(rows):
                base = r["baseline"]["fwd_bwd_ms"]
                ax.bar(
                    i - width,
                    base,
                    width,
                    color="grey",
                    label="compute (1-rank copies)" if i == 0 else None,
                )
                for k, b in enumerate(BACKENDS):
                    x = i + k * width
                    step = r[b]["fwd_bwd_ms"]
                    c = colors[k]
                    ax.bar(x, min(base, step), width, color=c, label=b if i == 0 else None)
                    if step > base:
                        ax.bar(
                            x,
                            step - base,
                            width,
                            bottom=base,
                            color=c,
                            alpha=0.4,
                            hatch="//",
                            label=f"{b} exposed comm" if i == 0 else None,
                        )
                ratio = r["exposed_ratio_gloo_over_hsdp"]
                top = max(r[b]["fwd_bwd_ms"] for b in BACKENDS)
                ax.annotate(
                    f"exposed gloo/hsdp {'n/a' if ratio is None else f'{ratio:.1f}x'}",
                    (i + width / 2, top),
                    ha="center",
                    va="bottom",
                    fontsize="small",
                )
            ax.set_xticks(range(len(rows)), [r["mesh_label"] for r in rows])
            ax.set_xlim(-0.75, len(rows) - 0.25)
            ax.set_ylim(top=1.35 * max(r[b]["fwd_bwd_ms"] for r in rows for b in BACKENDS))
            ax.set_ylabel("forward + backward, rank 0, ms (median)")
            a = section["models"][m]
            n = a["params"]
            shown = "?" if n is None else (f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}k")
            ax.set_title(f"{m} model ({shown} params, {a['fsdp_groups']} FSDP groups)")
            ax.grid(True, axis="y", alpha=0.3)
            ax.legend(fontsize="small")
        fig.suptitle(
            f"FSDP2 training step, hsdp vs gloo (seq-len {section['seq_len']}, batch "
            f"{section['batch_size']} per rank, fp32)"
        )
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


TRAINING_LEGEND = """
compute = forward + backward of the same script on 1 rank, W copies running at once (no
collectives, the same competition for cores); gloo f+b, hsdp f+b = rank 0's forward +
backward on W ranks, where FSDP2 does all its communication; exp = exposed communication =
f+b - compute; gloo/hsdp exp = gloo exp / hsdp exp; share = exp / step; step = forward +
backward + optimizer step (local, over this rank's shard); speedup = gloo step / hsdp step;
spread = interquartile range / median of the pooled steps, the noisiest of the three."""


SUITES: dict[str, Suite] = {
    s.name: s for s in (CollectivesSuite(), CoalescedSuite(), NumericsSuite(), TrainingSuite())
}

# ---------------------------------------------------------------------------
# Launcher: W rank processes, one deadline, no survivors
# ---------------------------------------------------------------------------


class BenchFailure(RuntimeError):
    """A launch failed: a rank raised or died, or the deadline passed."""


def _watch_parent(parent_pid: int) -> None:
    """Exits this rank as soon as the parent process is gone."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(3)
        time.sleep(0.5)


def _rank_entry(
    suite_name, rank, world, store_port, config, env, deadline_epoch, verbose, parent_pid, results
):
    """Body of one rank process (module level so spawn can find it).

    ``deadline_epoch`` is the parent's deadline as a ``time.time()`` value.
    """
    import faulthandler

    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    time_left_s = deadline_epoch - time.time()
    faulthandler.enable()
    # Shortly before the parent's deadline, print every thread's stack (a
    # hang is then diagnosable from the output) and exit.
    faulthandler.dump_traceback_later(max(time_left_s - 3.0, 1.0), exit=True)
    os.environ.update(env)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import torch
        import torch.distributed as dist

        import hsdp_backend  # noqa: F401  registers "hsdp"

        torch.set_num_threads(1)
        timeout = datetime.timedelta(seconds=max(1.0, min(COLLECTIVE_TIMEOUT_S, time_left_s)))
        store = dist.TCPStore("127.0.0.1", store_port, world, is_master=False, timeout=timeout)
        dist.init_process_group("hsdp", store=store, rank=rank, world_size=world, timeout=timeout)
        gloo = dist.new_group(backend="gloo", timeout=timeout)
        ctx = RankContext(rank, world, dist.group.WORLD, gloo, verbose)
        out = SUITES[suite_name].run_rank(ctx, config)
        results.put((rank, "ok", {"engine": _cpu_engine(), "result": out}))
    except BaseException:  # noqa: BLE001 - everything goes to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def _cpu_engine() -> str:
    """What serves the default hsdp group's CPU collectives ("shm", "gloo"),
    or "unknown" on builds without ``hsdp_backend.cpu_engine``."""
    import hsdp_backend

    try:
        return str(hsdp_backend.cpu_engine())
    except (AttributeError, ImportError):
        return "unknown"


def launch(
    suite: Suite, world: int, config: dict, env: dict, deadline: float, verbose: bool
) -> Any:
    """Runs ``suite`` on ``world`` fresh rank processes.

    Returns rank 0's ``{"engine": hsdp's CPU engine, "result": what the
    suite's ``run_rank`` returned}``.

    ``deadline`` is a ``time.monotonic()`` value. Raises BenchFailure when a
    rank fails or the deadline passes; every rank process is gone on return.
    """
    import torch.distributed as dist

    time_left = deadline - time.monotonic()
    if time_left <= 0:
        raise BenchFailure(f"world size {world}: no time left (see --timeout)")
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        None,
        True,
        datetime.timedelta(seconds=max(time_left, 1)),
        wait_for_workers=False,
    )
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_rank_entry,
            args=(
                suite.name,
                r,
                world,
                store.port,
                config,
                env,
                time.time() + time_left,
                verbose,
                os.getpid(),
                results,
            ),
            name=f"hsdp-bench-rank{r}",
            daemon=True,
        )
        for r in range(world)
    ]
    outputs: dict[int, Any] = {}
    errors: dict[int, str] = {}
    died_ranks: set[int] = set()
    timed_out = False
    run_deadline = deadline
    collected = False
    try:
        for p in procs:
            p.start()
        while len(outputs) + len(errors) < world:
            now = time.monotonic()
            if now >= deadline:
                timed_out = not errors
                break
            try:
                rank, status, payload = results.get(timeout=min(0.5, deadline - now))
            except queue.Empty:
                for r, p in enumerate(procs):
                    if p.exitcode not in (None, 0) and r not in outputs and r not in errors:
                        errors[r] = (
                            f"rank {r} died with exit code {p.exitcode} "
                            "(no Python error: crashed or killed)"
                        )
                        died_ranks.add(r)
                        deadline = min(deadline, time.monotonic() + GRACE_AFTER_FAILURE_S)
                continue
            if status == "ok":
                outputs[rank] = payload
            else:
                errors[rank] = payload  # dict order: first reported first
                deadline = min(deadline, time.monotonic() + GRACE_AFTER_FAILURE_S)
        collected = True
    finally:
        # Ranks that reported are tearing their groups down: give them a
        # moment. On an exception here (a signal), kill at once.
        for p in procs:
            if collected and p.pid is not None:
                p.join(timeout=max(0.0, min(10.0, deadline - time.monotonic())))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        results.close()
        del store
    if errors or timed_out or len(outputs) < world:
        alive = [r for r in range(world) if r not in outputs and r not in errors]
        lines = []
        if timed_out:
            lines.append(f"world size {world}: deadline reached (--timeout); killed ranks {alive}")
        else:
            lines.append(
                f"world size {world}: {len(errors)} of {world} ranks failed; killed ranks {alive}"
            )
        if time.monotonic() >= run_deadline - 5.0:
            lines.append(
                "(the --timeout deadline was reached: ranks still running printed their "
                "Python stacks on stderr and exited)"
            )
        died = sorted(r for r in errors if r in died_ranks)
        reported = [r for r in errors if r not in died_ranks]
        # A rank that died without a Python error (crash, kill) is the likely
        # cause; then the first traceback in full, the others' last lines
        # (usually consequences of the first).
        for r in died:
            lines.append(f"--- rank {r} --- {errors[r]}")
        for i, r in enumerate(reported):
            if i == 0:
                lines.append(f"--- rank {r} (first error reported) ---\n{errors[r].rstrip()}")
            else:
                lines.append(f"--- rank {r} --- {errors[r].strip().splitlines()[-1]}")
        raise BenchFailure("\n".join(lines))
    return outputs[0]


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------


def _parse_ranks(text: str) -> list[int]:
    try:
        ranks = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if not ranks or any(r < 2 for r in ranks):
        raise argparse.ArgumentTypeError("world sizes must be integers >= 2, e.g. 2,4")
    return ranks


def _parse_env(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def build_parser() -> argparse.ArgumentParser:
    """The CLI (see the module docstring for the method)."""
    parser = argparse.ArgumentParser(
        prog="python -m hsdp_backend.bench",
        description=(
            "Benchmark hsdp against gloo on this host. Spawns W rank processes per world size,\n"
            "measures both backends in the same run, interleaved, and reports medians (max over\n"
            "ranks), nccl-tests bus bandwidth, the gloo/hsdp speedup and the fraction of\n"
            "single-thread memcpy bandwidth. Run it from outside the repository root.\n"
            "Method: see the docstring of hsdp_backend/bench.py."
        ),
        epilog=(
            "examples:\n"
            "  python -m hsdp_backend.bench --quick\n"
            "  python -m hsdp_backend.bench --ranks 2 --sizes 4K,64K,1M,16M\n"
            "  python -m hsdp_backend.bench --ops all_reduce --dtype bfloat16 -v\n"
            "  python -m hsdp_backend.bench --suite coalesced --dim 256\n"
            "  python -m hsdp_backend.bench --suite numerics --ranks 2,4,8\n"
            "  python -m hsdp_backend.bench --suite training\n"
            "  python -m hsdp_backend.bench --suite training --quick --ranks 2"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--suite",
        choices=sorted(SUITES),
        default="collectives",
        help="benchmark to run: "
        + "; ".join(f"{s.name}: {s.help}" for s in SUITES.values())
        + " (default: %(default)s)",
    )
    parser.add_argument(
        "--ranks",
        type=_parse_ranks,
        default=None,
        metavar="W[,W...]",
        help="world sizes, one launch each (default: "
        + "; ".join(f"{s.name} {','.join(map(str, s.default_ranks))}" for s in SUITES.values())
        + ")",
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="element type of the collectives and coalesced suites (default: %(default)s)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="sizes up to 1 MiB, 0.1 s per point per backend, at most 50 samples (CI); "
        "training suite: tiny model only, 8 steps, 1 run per backend",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="S",
        help="wall-clock limit of the whole run in seconds; ranks still running are "
        "killed (default: 300 with --quick, else 1200)",
    )
    parser.add_argument(
        "--env",
        type=_parse_env,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment variable for the rank processes (repeatable)",
    )
    parser.add_argument(
        "--json",
        default=None,
        metavar="PATH",
        help="raw results and machine info; '' to skip (default: bench_results/bench.json, "
        "other suites bench_results/bench_<suite>.json)",
    )
    parser.add_argument(
        "--plot",
        default=None,
        metavar="PATH",
        help="PNG plot (needs matplotlib); '' to skip (default: bench_results/bench.png, "
        "other suites bench_results/bench_<suite>.png)",
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="print each point as it is measured"
    )

    coll = parser.add_argument_group("collectives suite")
    coll.add_argument(
        "--ops",
        default=",".join(OPS),
        metavar="OP[,OP...]",
        help="subset of %(default)s (aliases: all_gather, reduce_scatter, ag, rs, ar)",
    )
    coll.add_argument(
        "--sizes",
        default=None,
        metavar="SIZE[,SIZE...]",
        help="bytes per rank, e.g. 4K,1M,16M (default: 4K..64M in powers of 4; "
        "--quick: up to 1M); all_reduce always adds an 8 B latency row",
    )

    coal = parser.add_argument_group("coalesced suite")
    coal.add_argument(
        "--dim",
        type=int,
        default=COALESCED_DEFAULT_DIM,
        metavar="D",
        help=f"width of the {COALESCED_LAYERS}-layer transformer whose 200 parameter shards "
        "are gathered / reduce-scattered (default: %(default)s: 10 M parameters, "
        "about 19 MiB fp32 per rank on 2 ranks)",
    )

    num = parser.add_argument_group("numerics suite")
    num.add_argument(
        "--ar-numel",
        default=None,
        metavar="N",
        help="all_reduce elements per rank, K/M suffixes allowed (default: 1M; --quick: 64K)",
    )
    num.add_argument(
        "--rs-numel",
        default=None,
        metavar="N",
        help="reduce_scatter_tensor output elements per rank; the input is W times that "
        "(default: 256K; --quick: 16K)",
    )
    num.add_argument(
        "--seed",
        type=int,
        default=0,
        metavar="S",
        help="base seed of the inputs; training suite: the scripts' --seed (default: 0)",
    )

    tr = parser.add_argument_group(
        "training suite (--ranks selects the configurations: "
        + ", ".join(f"{m.world} = {m.label}" for m in TRAINING_MESHES)
        + "; the 1-rank baseline always runs)"
    )
    tr.add_argument(
        "--examples",
        default=None,
        metavar="DIR",
        help="the repository's examples/ directory (default: beside the package, else ./examples)",
    )
    tr.add_argument(
        "--models",
        default=None,
        metavar="M[,M...]",
        help="subset of "
        + ",".join(TRAINING_MODELS)
        + " (default: all; --quick: "
        + ",".join(TRAINING_QUICK_MODELS)
        + ")",
    )
    tr.add_argument(
        "--steps",
        type=int,
        default=None,
        metavar="N",
        help="training steps per run, --warmup of them dropped (default: "
        + ", ".join(f"{m} {n[0]}" for m, n in TRAINING_STEPS.items())
        + "; --quick: "
        + ", ".join(f"{m} {n[1]}" for m, n in TRAINING_STEPS.items())
        + ")",
    )
    tr.add_argument(
        "--repeats",
        type=int,
        default=None,
        metavar="N",
        help=f"runs per configuration and backend, interleaved (default: {TRAINING_REPEATS[0]}; "
        f"--quick: {TRAINING_REPEATS[1]})",
    )
    tr.add_argument(
        "--seq-len",
        type=int,
        default=TRAINING_SEQ_LEN,
        metavar="N",
        help="tokens per sample (default: %(default)s)",
    )
    tr.add_argument(
        "--batch-size",
        type=int,
        default=TRAINING_BATCH_SIZE,
        metavar="N",
        help="samples per rank per step (default: %(default)s)",
    )

    samp = parser.add_argument_group(
        "sampling (per point, per backend; coalesced: per op, per variant)"
    )
    samp.add_argument(
        "--time-per-point",
        type=float,
        default=None,
        metavar="S",
        help="time budget per point per backend (default: 0.3; --quick: 0.1; "
        "coalesced suite: 2.0; --quick: 0.5)",
    )
    samp.add_argument(
        "--iters",
        type=int,
        default=None,
        metavar="N",
        help="exactly N samples per point per backend instead of the time budget",
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
        help="untimed calls per backend before measuring (default: 3; --quick: 2); "
        f"training suite: steps dropped from the start of each run (default: "
        f"{TRAINING_WARMUP_STEPS})",
    )
    return parser


class _Terminated(BaseException):
    """SIGTERM / SIGHUP in the parent: unwind so the ranks get killed."""


def _on_signal(signum, frame):
    raise _Terminated(signum)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.iters is not None and args.iters < 1:
        parser.error("--iters must be >= 1")
    if args.min_reps < 1 or (args.max_reps is not None and args.max_reps < args.min_reps):
        parser.error("need 1 <= --min-reps <= --max-reps")
    timeout = args.timeout if args.timeout is not None else (300.0 if args.quick else 1200.0)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    start = time.monotonic()
    deadline = start + timeout
    suite = SUITES[args.suite]
    if args.ranks is None:
        args.ranks = list(suite.default_ranks)
    for attr, ext in (("json", "json"), ("plot", "png")):
        if getattr(args, attr) is None:
            setattr(args, attr, os.path.join("bench_results", f"{suite.output_stem}.{ext}"))
    try:
        config = suite.configure(args)
    except ValueError as exc:
        parser.error(str(exc))
    if not _extension_found():
        return 1
    try:
        info = machine_info()
        _print_header(suite, args, info, timeout)
        reference = suite.reference(config)
        per_world, engines, wall = suite.run_all(
            config, args.ranks, dict(args.env), deadline, args.verbose
        )
        section = suite.report(config, reference, per_world)
    except BenchFailure as exc:
        print(
            f"\nhsdp bench FAILED after {time.monotonic() - start:.1f} s:\n{exc}",
            file=sys.stderr,
            flush=True,
        )
        return 1
    except (KeyboardInterrupt, _Terminated) as exc:
        signum = exc.args[0] if isinstance(exc, _Terminated) and exc.args else signal.SIGINT
        print(
            f"\nhsdp bench interrupted (signal {int(signum)}); ranks killed",
            file=sys.stderr,
            flush=True,
        )
        return 128 + int(signum)

    total = time.monotonic() - start
    info["loadavg_at_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    print(f"\ntotal wall time {total:.1f} s", flush=True)
    if args.json:
        doc = {
            "schema": 1,
            "suite": suite.name,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": [
                sys.executable,
                "-m",
                "hsdp_backend.bench",
                *(sys.argv[1:] if argv is None else argv),
            ],
            "machine": info,
            "world_sizes": args.ranks,
            "rank_env": dict(args.env),
            "hsdp_cpu_engine": {str(w): e for w, e in engines.items()},
            "wall_time_s": {"total": total, **{str(w): t for w, t in wall.items()}},
            suite.name: section,
        }
        _makedirs_for(args.json)
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("note: matplotlib is not installed; no plot (pip install matplotlib)")
        else:
            _makedirs_for(args.plot)
            suite.plot(section, args.plot)
            print(f"wrote {args.plot}")
    return 0


def _makedirs_for(path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)


def _extension_found() -> bool:
    """False (with a hint) when ``hsdp_backend`` is the source tree, not the installed package."""
    import importlib.util

    if importlib.util.find_spec("hsdp_backend._C") is not None:
        return True
    import hsdp_backend

    print(
        f"error: {os.path.dirname(hsdp_backend.__file__)} has no compiled extension "
        "(hsdp_backend._C); run from outside the repository root, with the package installed",
        file=sys.stderr,
    )
    return False


def _print_header(suite: Suite, args: argparse.Namespace, info: dict, timeout: float) -> None:
    """What runs where, and warnings about conditions that make numbers noisy."""
    print(
        f"hsdp bench, suite {suite.name}: {info['cpu_model']}, {info['nproc']} cpus, "
        f"torch {info['torch_version']}, hsdp-backend {info['hsdp_backend_version']}, "
        f"world sizes {args.ranks}, timeout {timeout:.0f} s",
        flush=True,
    )
    cpus = info["nproc_available"] or info["nproc"] or 1
    if max(args.ranks) > cpus:
        print(
            f"note: more ranks than cpus ({max(args.ranks)} > {cpus}): ranks share cores",
            flush=True,
        )
    load = info["loadavg_at_start"]
    if load and load[0] > 0.5:
        print(
            f"note: load average {load[0]:.1f} on {cpus} cpus before the run: other processes "
            "compete for the cpus; expect noisy absolute numbers",
            flush=True,
        )


if __name__ == "__main__":
    sys.exit(main())
