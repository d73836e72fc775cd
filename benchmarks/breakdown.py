"""Where one call's time goes: a tight loop of one collective on hsdp, rank 0
sampled by ``perf record`` (flat: the function each sample was in), its
samples sorted into the parts of a call and scaled by the time per call of
the same loop unsampled (sampling slows it: both are reported), so each
part reads in microseconds per call.

  python -m benchmarks breakdown --ranks 2 --points all_reduce:8,all_reduce:64K

Parts, in the order a call goes down (``PARTS``; a sample belongs to the
first whose rule matches its library and function):
- python: the interpreter running torch.distributed's Python wrapper;
- torch: pybind, the dispatcher, ProcessGroup (torch's libraries);
- hsdp entry: checks, the plan, the route's issue (hsdp's own functions);
- hsdp work: the Work and its future;
- hsdp records: the flight recorder, the counters, their clock reads;
- engine handshake: the engine's steps and its waits for the peers
  (counters, signatures, spinning, yields, futex sleeps in the kernel);
- engine copies: copies in and out (memcpy; process_vm_readv's copy in the
  kernel);
- direct-read setup: the rest of process_vm_readv (finding the peer's pages,
  pinning and releasing them);
- engine reduction: the reduction kernels;
- allocator: malloc and free, whoever calls them;
- kernel: the rest of the kernel's time (scheduling, syscalls);
- other: anything else (a part worth a look when it grows), and hsdp's
  functions without a name: the package is installed stripped; for names,
  install it with ``pip install --no-build-isolation -C install.strip=false .``.

Without ``perf`` (or without permission to sample), only the loop's time
per call is reported, saying why. Rank 0 samples itself; its peers run the
same number of calls. The samples describe rank 0's CPU time: with more
ranks than cores, the time a rank waits descheduled is in no part, and the
parts sum to less than the call.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from benchmarks import peers, report
from benchmarks.report import Column, format_size
from benchmarks.suite import RankContext, Suite

OPS = peers.OPS  # and their buffers and calls, as the peers suite makes them
DEFAULT_POINTS = [("all_reduce", 8), ("all_reduce", 64 * 1024), ("all_gather_inplace", 64 * 1024)]
PERF_HZ = 4999
CHUNKS = 20  # a loop's time per call: the median over this many chunks
# Each rule: (part, library pattern, function pattern); None matches anything.
_HSDP = r"(^|/)_C\.cpython"
PARTS: list[tuple[str, str | None, str | None]] = [
    ("python", r"libpython", None),
    ("hsdp records", _HSDP, r"FlightRecorder|TracedCall|CommStats|ProcessGroupHSDP::record\b"),
    ("hsdp records", r"\[vdso\]", r"clock_gettime"),
    ("hsdp work", _HSDP, r"WorkHSDP|ivalue::Future|c10::List|IValue|inflight"),
    ("engine reduction", _HSDP, r"hsdp::shm::(\(anonymous namespace\)::)?(reduce\w*\b|combine)"),
    ("engine copies", _HSDP, r"copyBytes|readPeer|copyStreaming"),
    ("engine handshake", _HSDP, r"hsdp::shm::"),
    ("other", _HSDP, r"^0x[0-9a-f]+$"),  # a stripped build: install with -C install.strip=false
    ("hsdp entry", _HSDP, None),
    ("engine copies", r"libc\.so", r"mem(cpy|move)"),
    ("engine handshake", r"libc\.so", r"sched_yield|syscall|futex"),
    ("allocator", r"libc\.so|libstdc\+\+", r"malloc|free|operator new|operator delete|_int_"),
    ("engine copies", r"kernel", r"copy_(to_iter|page_to_iter|user|to_user|from_user|mc)|rep_movs"),
    (
        "direct-read setup",
        r"kernel",
        r"process_vm|get_user_pages|follow_page|pte|gup_|pin_user|try_grab|folio|vm_normal_page"
        r"|find_get_task|mt_find|mod_node_page_state",
    ),
    ("engine handshake", r"kernel", r"futex|sched_yield"),
    ("torch", r"libtorch|libc10|libstdc\+\+|ld-linux|libc\.so", None),
    ("kernel", r"kernel", None),
]
PART_NAMES = list(dict.fromkeys(p for p, _, _ in PARTS if p != "other")) + ["other"]


def part_of(library: str, function: str) -> str:
    """The part of a call a sample in ``function`` of ``library`` belongs to."""
    for part, lib, fn in PARTS:
        if lib is not None and not re.search(lib, library):
            continue
        if fn is not None and not re.search(fn, function):
            continue
        return part
    return "other"


def perf_rows(text: str) -> Iterator[tuple[float, str, str]]:
    """(percent, library, function) of each row of ``perf report --sort
    dso,sym -t TAB``; perf rounds each row's percent to 0.01."""
    for line in text.splitlines():
        if line.startswith("#") or "\t" not in line:
            continue
        fields = [f.strip() for f in line.split("\t")]
        if len(fields) < 3 or not fields[0].endswith("%"):
            continue
        yield float(fields[0].rstrip("%")), fields[1], re.sub(r"^\[[.k]\]\s*", "", fields[2])


def parse_perf_report(text: str) -> dict[str, float]:
    """Percent of samples per part, from ``perf report --sort dso,sym -t TAB``."""
    shares = dict.fromkeys(PART_NAMES, 0.0)
    for percent, library, function in perf_rows(text):
        shares[part_of(library, function)] += percent
    return shares


def _perf_problem() -> str | None:
    perf = shutil.which("perf")
    if perf is None:
        return "perf is not installed"
    probe = subprocess.run(
        [perf, "stat", "-e", "task-clock", "true"], capture_output=True, text=True, timeout=30
    )
    if probe.returncode != 0:
        return f"perf cannot sample here: {probe.stderr.strip()[-200:]}"
    return None


def _profiled_loop(ctx: RankContext, call, iters: int, path: str | None) -> float:
    """Runs ``iters`` calls in ``CHUNKS`` chunks (rank 0 sampled into
    ``path`` when given); the median chunk's time per call in microseconds,
    the slowest rank's."""
    import torch
    import torch.distributed as dist

    perf = None
    if path is not None:
        perf = subprocess.Popen(
            ["perf", "record", "-q", "-F", str(PERF_HZ), "-p", str(os.getpid()), "-o", path],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(0.5)  # perf attaches
    dist.barrier(group=ctx.gloo)
    chunk = max(1, iters // CHUNKS)
    times = []
    for _ in range(CHUNKS):
        start = time.perf_counter()
        for _ in range(chunk):
            call()
        times.append((time.perf_counter() - start) / chunk * 1e6)
    us = statistics.median(times)  # a descheduled moment moves one chunk, not the median
    if perf is not None:
        perf.send_signal(signal.SIGINT)
        perf.wait(timeout=60)
    worst = torch.tensor([us], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=ctx.gloo)
    return float(worst.item())


class BreakdownSuite(Suite):
    name = "breakdown"
    help = "where one call's time goes (perf samples of rank 0 sorted into the parts of a call)"
    default_ranks = (2,)
    output_stem = "bench_breakdown"
    default_timeout_s = (900.0, 300.0)
    quick_help = "shorter loops (0.5 s a point instead of 3 s)"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--points",
            type=lambda text: [
                (op, report.parse_size(size))
                for op, _, size in (p.partition(":") for p in text.split(","))
            ],
            default=None,
            metavar="OP:BYTES[,...]",
            help=f"ops of {','.join(OPS)} with bytes per rank (default: "
            + ",".join(f"{op}:{format_size(b)}" for op, b in DEFAULT_POINTS)
            + ")",
        )
        parser.add_argument(
            "--perf-dir",
            default=None,
            metavar="DIR",
            help="keep rank 0's perf.data files there, one a point (default: dropped)",
        )

    def configure(self, args: argparse.Namespace) -> dict:
        points = args.points or DEFAULT_POINTS
        unknown = [op for op, _ in points if op not in OPS]
        if unknown:
            raise ValueError(f"unknown ops {unknown}; known: {', '.join(OPS)}")
        perf_dir = os.path.abspath(args.perf_dir) if args.perf_dir else None
        if perf_dir:
            os.makedirs(perf_dir, exist_ok=True)
        return {"points": points, "seconds": 0.5 if args.quick else 3.0, "perf_dir": perf_dir}

    def run_rank(self, ctx: RankContext, config: dict) -> Any:
        import torch
        import torch.distributed as dist

        problem = _perf_problem() if ctx.rank == 0 else None
        rows = []
        with tempfile.TemporaryDirectory(prefix="hsdp-breakdown-") as scratch:
            tmp = config["perf_dir"] or scratch
            for op, nbytes in config["points"]:
                bufs = peers._buffers(op, max(1, nbytes // 4), ctx.rank, ctx.world)
                call = peers._bind_torch(op, bufs, ctx.hsdp)
                for _ in range(200):
                    call()
                # Calls for the point's time, as rank 0 finds them, on every rank.
                probe = _profiled_loop(ctx, call, 20 * CHUNKS, None)
                iters = torch.tensor([int(config["seconds"] * 1e6 / max(probe, 0.1))])
                dist.broadcast(iters, src=0, group=ctx.gloo)
                path = os.path.join(tmp, f"{op}-{nbytes}.data")
                sampled = path if ctx.rank == 0 and problem is None else None
                # The call's time unsampled; the parts' shares from a sampled
                # loop of the same length (sampling slows the loop).
                us = _profiled_loop(ctx, call, int(iters.item()), None)
                sampled_us = _profiled_loop(ctx, call, int(iters.item()), sampled)
                row = {"op": op, "bytes": nbytes, "us": us, "sampled_us": sampled_us}
                row["iters"] = int(iters.item())
                if sampled is not None:
                    text = subprocess.run(
                        ["perf", "report", "-i", path, "--no-children", "--sort", "dso,sym"]
                        + ["--stdio", "-t", "\t"],
                        capture_output=True,
                        text=True,
                        timeout=300,
                    ).stdout
                    row["percent"] = parse_perf_report(text)
                    row["perf_rows"] = sum(1 for _ in perf_rows(text))
                rows.append(row)
                ctx.log(f"{op} {format_size(nbytes)}: {us:.2f} us")
        return {"rows": rows, "perf_problem": problem}

    def report(self, config: dict, reference: dict, per_world: dict[int, Any]) -> dict:
        section = {}
        for world, result in per_world.items():
            rows = result["rows"]
            if result["perf_problem"]:
                print(f"world size {world}: no breakdown ({result['perf_problem']})")
            columns = [
                Column("op", 19, lambda r: r["op"], left=True),
                Column("size", 7, lambda r: format_size(r["bytes"])),
                Column("us/call", 8, lambda r: f"{r['us']:.2f}"),
                Column("sampled", 8, lambda r: f"{r['sampled_us']:.2f}"),
            ]
            for part in PART_NAMES:
                columns.append(
                    Column(
                        part,
                        max(8, len(part)),
                        lambda r, p=part: (
                            f"{r['us'] * r['percent'][p] / 100:.2f}" if "percent" in r else "-"
                        ),
                    )
                )
            report.print_table(
                columns,
                rows,
                title=f"{world} ranks: microseconds per call, by part (rank 0's perf samples)",
            )
            section[str(world)] = rows
        return section


SUITE = BreakdownSuite()
