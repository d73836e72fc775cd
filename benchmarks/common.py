"""What every benchmark script shares: its flags, its groups, the exact check, the interleaved
timing and the output. A script is run by torchrun on each rank (``python -m benchmarks SUITE``
launches it once per world size, see ``__main__.py``).

Timing. A *contender* is a no-argument closure making one synchronous call; every rank passes the
same contenders in the same order. Warm-up calls set how many back-to-back calls make one sample
(about ``SAMPLE_S`` of the fastest contender, the same count for all, maxed over ranks), then rounds
of one sample per contender run in alternating order, each after a barrier on the gloo group, until
rank 0's clock says the budget is spent. A contender's time is the maximum over ranks of each rank's
median per-call time: a collective is as slow as its slowest rank. Machine noise hits every
contender of a round alike, so the ratios hold when absolute numbers drift.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import ctypes
import datetime
import io
import itertools
import json
import math
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

SAMPLE_S = 2e-3  # one sample: back-to-back calls lasting about this long
MAX_CALLS_PER_SAMPLE = 1000
_SIZE = re.compile(r"^\s*(\d+)\s*([kmg]?)(i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``8``, ``4K``, ``64KiB``, ``1M``: bytes (binary units)."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 8, 4K, 1M)")
    return int(m.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[m.group(2).lower()]


def sizes(text: str) -> list[int]:
    return sorted({parse_size(s) for s in text.split(",") if s.strip()})


def format_size(n: int) -> str:
    for shift, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def collective(name: str):
    """``dist``'s all-gather or reduce-scatter by the name FSDP2 calls it: ``*_single`` where
    torch has it (2.14+, whose ``*_into_tensor`` / ``*_tensor`` warn on every call)."""
    import torch.distributed as dist

    legacy = {"all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter_tensor"}
    return getattr(dist, f"{name}_single", None) or getattr(dist, legacy[name])


def busbw_gbps(op: str, bytes_per_rank: int, world: int, us: float) -> float:
    """nccl-tests' bus bandwidth: all-gather and reduce-scatter move bytes x W x (W-1)/W, an
    all-reduce bytes x 2(W-1)/W, per call (GB/s: 1e9 bytes a second)."""
    if op.startswith("all_reduce"):
        return 2 * (world - 1) / world * bytes_per_rank / us / 1e3
    return (world - 1) * bytes_per_rank / us / 1e3


def dies_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A ``preexec_fn``: the child gets ``sig`` when the process that started it dies, however
    it dies (prctl PR_SET_PDEATHSIG), so no rank or load outlives its launcher."""
    libc = ctypes.CDLL(None, use_errno=True)
    return lambda: libc.prctl(1, sig)  # 1: PR_SET_PDEATHSIG


@contextlib.contextmanager
def cpu_load(count: int):
    """``count`` CPU-bound processes for the block, as data-loader workers beside the ranks."""
    spin = [
        subprocess.Popen(
            [sys.executable, "-c", "while True: pass"], preexec_fn=dies_with_parent(signal.SIGKILL)
        )  # fmt: skip
        for _ in range(count)
    ]
    try:
        yield
    finally:
        for s in spin:
            s.kill()
            s.wait()


def parser(doc: str | None, sampling: bool = True) -> argparse.ArgumentParser:
    """The flags every script takes (with ``sampling``, those of ``measure``); the script adds
    its own."""
    p = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="the smallest form (what CI runs)")
    p.add_argument(
        "--json", default=None, metavar="PATH", help="rows and machine facts as JSON ('' skips)"
    )
    p.add_argument("--csv", action="store_true", help="the rows as CSV after the table")
    p.add_argument("-v", "--verbose", action="store_true", help="each point as it is measured")
    if not sampling:
        return p
    s = p.add_argument_group("sampling, per point and contender")
    s.add_argument("--time-per-point", type=float, default=None, metavar="S")
    s.add_argument("--iters", type=int, default=None, metavar="N", help="exactly N samples")
    s.add_argument("--min-reps", type=int, default=3, metavar="N")
    s.add_argument("--max-reps", type=int, default=None, metavar="N")
    s.add_argument("--warmup", type=int, default=None, metavar="N")
    return p


@dataclass(frozen=True)
class Sampling:
    budget_s: float  # per contender and point
    min_reps: int
    max_reps: int
    warmup: int
    fixed_reps: int | None

    @staticmethod
    def of(args: argparse.Namespace, budget_s: tuple[float, float]) -> Sampling:
        """From the flags; ``budget_s`` is the default budget (full, --quick)."""
        if (args.iters is not None and args.iters < 1) or args.min_reps < 1:
            raise SystemExit("--iters and --min-reps must be >= 1")
        return Sampling(
            args.time_per_point if args.time_per_point is not None else budget_s[args.quick],
            args.min_reps,
            args.max_reps or (50 if args.quick else 200),
            args.warmup if args.warmup is not None else (2 if args.quick else 3),
            args.iters,
        )

    def done(self, reps: int, elapsed_s: float, contenders: int) -> bool:
        if self.fixed_reps is not None:
            return reps >= self.fixed_reps
        return reps >= self.min_reps and (
            reps >= self.max_reps or elapsed_s >= contenders * self.budget_s
        )


@dataclass
class Ranks:
    """This rank, the default group (hsdp) and a gloo group over the same ranks."""

    rank: int
    world: int
    hsdp: Any
    gloo: Any
    verbose: bool = False

    def log(self, msg: str) -> None:
        if self.verbose and self.rank == 0:
            print(f"  [W={self.world}] {msg}", file=sys.stderr, flush=True)

    def fail(self, what: str, problem: str) -> None:
        raise RuntimeError(f"[rank {self.rank}/{self.world}] {what}: {problem}")


def init(args: argparse.Namespace, backend: str = "hsdp", timeout_s: float = 120.0) -> Ranks:
    """The default group on ``backend`` (torchrun's env://) and a gloo group beside it; one thread a
    rank, no garbage collector inside timed regions (the script collects between points)."""
    import gc

    import torch
    import torch.distributed as dist

    import hsdp_backend  # noqa: F401  registers "hsdp"

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, timeout=timeout)
    gc.disable()
    return Ranks(
        dist.get_rank(),
        dist.get_world_size(),
        dist.group.WORLD,
        dist.new_group(backend="gloo", timeout=timeout),
        getattr(args, "verbose", False),
    )


def mismatch(got, want, tol: float = 0.0) -> str | None:
    """None when ``got`` equals ``want`` (within ``tol``, relative), else where it differs."""
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    g, w = got.double().flatten(), want.double().flatten()
    bad = ~((g - w).abs() <= tol * w.abs())  # a NaN is bad too
    if not bad.any():
        return None
    i = int(bad.nonzero()[0])
    return f"element {i}: got {g[i].item()}, expected {w[i].item()}"


def _time_calls(fn: Callable[[], Any], calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def measure(
    ranks: Ranks,
    calls: dict[str, Callable[[], Any]],
    sampling: Sampling,
    settle: Callable[[], Any] | None = None,
) -> dict:
    """Times the contenders interleaved; per contender ``{"us", "per_rank_us", "reps",
    "calls_per_sample", "spread"}``, the same on every rank (see the module's docstring).
    ``settle`` runs untimed after every sample (a device's synchronize: no sample pays for
    the kernels another left queued)."""
    import torch
    import torch.distributed as dist

    settle = settle or (lambda: None)
    names = list(calls)

    def warm_up(fn) -> float:
        t = min(_time_calls(fn, 1) for _ in range(max(sampling.warmup, 1)))
        settle()
        return t

    warm = [warm_up(f) for f in calls.values()]
    est = torch.tensor([min(warm)], dtype=torch.float64)
    dist.all_reduce(est, op=dist.ReduceOp.MAX, group=ranks.gloo)
    per_sample = max(1, min(MAX_CALLS_PER_SAMPLE, math.ceil(SAMPLE_S / max(est.item(), 1e-7))))
    samples: dict[str, list[float]] = {n: [] for n in names}
    stop, t0 = torch.zeros(1, dtype=torch.float64), time.perf_counter()
    for i in itertools.count():
        stop[0] = float(ranks.rank == 0 and sampling.done(i, time.perf_counter() - t0, len(names)))
        dist.all_reduce(stop, op=dist.ReduceOp.MAX, group=ranks.gloo)  # also the round's barrier
        if stop.item():
            break
        for k, n in enumerate(names if i % 2 == 0 else names[::-1]):
            if k:
                dist.barrier(group=ranks.gloo)
            samples[n].append(_time_calls(calls[n], per_sample))
            settle()
    mine = torch.tensor([[statistics.median(samples[n]) * 1e6] for n in names], dtype=torch.float64)
    every = [torch.empty_like(mine) for _ in range(ranks.world)]
    dist.all_gather(every, mine, group=ranks.gloo)
    medians = torch.cat(every, dim=1)  # [contender, rank], us
    return {
        n: {
            "us": medians[i].max().item(),
            "per_rank_us": medians[i].tolist(),
            "reps": len(samples[n]),
            "calls_per_sample": per_sample,
            "spread": spread(samples[n]),
        }
        for i, n in enumerate(names)
    }


def spread(samples: Sequence[float]) -> float:
    """Interquartile range over median: how far a point can be trusted."""
    if len(samples) < 2:
        return 0.0
    q1, med, q3 = statistics.quantiles(samples, n=4)
    return (q3 - q1) / med if med > 0 else 0.0


def memcpy_us(nbytes: int, dtype, sampling: Sampling) -> float:
    """Single-thread ``dst.copy_(src)`` of ``nbytes``, median us: the physical limit of a copy."""
    import torch

    src = torch.ones(max(nbytes // dtype.itemsize, 1), dtype=dtype)
    dst = torch.empty_like(src)
    warm = min(_time_calls(lambda: dst.copy_(src), 1) for _ in range(max(sampling.warmup, 1)))
    calls = max(1, min(MAX_CALLS_PER_SAMPLE, math.ceil(SAMPLE_S / max(warm, 1e-7))))
    out: list[float] = []
    t0 = time.perf_counter()
    while not sampling.done(len(out), time.perf_counter() - t0, 1):
        out.append(_time_calls(lambda: dst.copy_(src), calls))
    return statistics.median(out) * 1e6


def machine() -> dict:
    import torch

    with open("/proc/cpuinfo") as f:  # Linux, as hsdp
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    return {
        "cpu_model": cpu,
        "cpus": len(os.sched_getaffinity(0)),
        "loadavg": list(os.getloadavg()),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


@dataclass(frozen=True)
class Column:
    header: str
    cell: Callable[[dict], Any]  # the row's value: a number or a string


def emit(
    suite: str,
    args: argparse.Namespace,
    ranks_or_world,
    columns: Sequence[Column],
    rows: list[dict],
    notes: Sequence[str] = (),
    extra: dict | None = None,
) -> None:
    """Rank 0 prints the rows as a table (and CSV with --csv) and writes the JSON; the rows' full
    dicts go to the JSON, the columns to the terminal."""
    world = getattr(ranks_or_world, "world", ranks_or_world)
    if getattr(ranks_or_world, "rank", 0) != 0:
        return
    cells = [[_text(c.cell(r)) for c in columns] for r in rows]
    widths = [max([len(c.header), *(len(row[i]) for row in cells)]) for i, c in enumerate(columns)]
    print(f"\n{suite}, world size {world}:")
    for line in [[c.header for c in columns], *cells]:
        print("  ".join(t.rjust(w) for t, w in zip(line, widths, strict=True)))
    for note in notes:
        print(note)
    if args.csv:
        out = io.StringIO()
        csv.writer(out).writerows([[c.header for c in columns], *cells])
        print(out.getvalue(), end="")
    path = (args.json if args.json is not None else "bench_results/{suite}-w{world}.json").format(
        suite=suite, world=world
    )
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        doc = {
            "suite": suite,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": sys.argv,
            "world": world,
            "machine": machine(),
            "rank_env": {k: v for k, v in os.environ.items() if k.startswith(("HSDP_", "OMP_"))},
            "rows": rows,
            **(extra or {}),
        }
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {path}", flush=True)


def _text(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)
