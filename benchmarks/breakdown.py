"""Where one call's time goes: a tight loop of one collective on hsdp, rank 0 sampled by
``perf record`` (flat: the function each sample was in), its samples sorted into the parts of a
call and scaled by the time per call of the same loop unsampled (sampling slows it: both are
reported), so each part reads in microseconds per call.

  python -m benchmarks.breakdown [--ranks 2] [--points all_reduce:8,all_reduce:64K] [--perf-dir DIR]

Parts, in the order a call goes down (``PARTS``; a sample belongs to the first whose rule matches
its library and function):
- python: the interpreter running torch.distributed's Python wrapper;
- torch: pybind, the dispatcher, ProcessGroup (torch's libraries);
- hsdp entry: checks, the plan, the route's issue (hsdp's own functions);
- hsdp work: the Work and its future;
- hsdp records: the flight recorder, the counters, their clock reads;
- engine handshake: the engine's steps and its waits for the peers (counters, signatures,
  spinning, yields, futex sleeps in the kernel);
- engine copies: copies in and out (memcpy; process_vm_readv's copy in the kernel);
- direct-read setup: the rest of process_vm_readv (finding the peer's pages, pinning them);
- engine reduction: the reduction kernels;
- allocator: malloc and free, whoever calls them;
- kernel: the rest of the kernel's time (scheduling, syscalls);
- other: anything else (worth a look when it grows), and hsdp's functions without a name (an
  installed package is stripped: ``pip install --no-build-isolation -C install.strip=false .``).

Each call is checked once against the exact answer first. Without ``perf`` (or permission to
sample) only the loop's time per call is reported, saying why. Rank 0 samples itself; its peers
make as many calls. The samples are rank 0's CPU time: with more ranks than cores, the time a rank
waits descheduled is in no part, and the parts sum to less than the call.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

from benchmarks import common, peers
from benchmarks.common import Column, format_size

DEFAULT_POINTS = [("all_reduce", 8), ("all_reduce", 64 << 10), ("all_gather_inplace", 64 << 10)]
PERF_HZ = 4999
CHUNKS = 20  # a loop's time per call: the median over this many chunks
# Each rule: (part, library pattern, function pattern); None matches anything.
_HSDP = r"(^|/)_C\.cpython"
_PAGES = r"process_vm|get_user_pages|follow_page|pte|gup_|pin_user|try_grab|folio|vm_normal_page"
_PAGES += r"|find_get_task|mt_find|mod_node_page_state"  # the kernel finding and pinning pages
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
    ("direct-read setup", r"kernel", _PAGES),
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
    stat = [perf, "stat", "-e", "task-clock", "true"]
    probe = subprocess.run(stat, capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"perf cannot sample here: {probe.stderr.strip()[-200:]}"
    return None


def _loop(ranks: common.Ranks, call, iters: int, path: str | None) -> float:
    """``iters`` calls in ``CHUNKS`` chunks (rank 0 sampled into ``path`` when given); the median
    chunk's time per call in microseconds, the slowest rank's."""
    import torch
    import torch.distributed as dist

    perf = None
    if path is not None:
        record = ["perf", "record", "-q", "-F", str(PERF_HZ), "-p", str(os.getpid()), "-o", path]
        perf = subprocess.Popen(record, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.5)  # perf attaches
    dist.barrier(group=ranks.gloo)
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
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=ranks.gloo)
    return float(worst.item())


def rank_main(rank: int, world: int, config: dict) -> dict:
    """One rank (tools/ranks.py): per point, check, warm up, then the loop unsampled and sampled."""
    import torch
    import torch.distributed as dist

    import hsdp_backend

    ranks = common.init(argparse.Namespace(verbose=config["verbose"]))
    problem = _perf_problem() if rank == 0 else None
    rows = []
    with tempfile.TemporaryDirectory(prefix="hsdp-breakdown-") as scratch:
        for op, nbytes in config["points"]:
            bufs = peers.buffers(op, max(1, nbytes // 4), ranks)
            call = peers.bind(op, bufs, ranks.hsdp)
            wrong = peers.check(op, bufs, call, ranks)
            if wrong:
                ranks.fail(f"hsdp {op} {format_size(nbytes)}", f"wrong result: {wrong}")
            for _ in range(200):
                call()
            # Calls for the point's time, as rank 0 finds them, on every rank.
            probe = _loop(ranks, call, 20 * CHUNKS, None)
            iters = torch.tensor([int(config["seconds"] * 1e6 / max(probe, 0.1))])
            dist.broadcast(iters, src=0, group=ranks.gloo)
            path = os.path.join(config["perf_dir"] or scratch, f"{op}-{nbytes}.data")
            sampled = path if rank == 0 and problem is None else None
            # The call's time unsampled; the parts' shares from a sampled loop of the same length.
            row = {"op": op, "bytes": nbytes, "iters": int(iters.item())}
            row["us"] = _loop(ranks, call, row["iters"], None)
            row["sampled_us"] = _loop(ranks, call, row["iters"], sampled)
            if sampled is not None:
                report = ["perf", "report", "-i", path, "--no-children", "--sort", "dso,sym"]
                report += ["--stdio", "-t", "\t"]
                text = subprocess.run(report, capture_output=True, text=True, timeout=300).stdout
                row["percent"] = parse_perf_report(text)
                row["perf_rows"] = sum(1 for _ in perf_rows(text))
            rows.append(row)
            ranks.log(f"{op} {format_size(nbytes)}: {row['us']:.2f} us")
    return {"rows": rows, "perf_problem": problem, "engine": hsdp_backend.cpu_route()}


def _points(text: str) -> list[tuple[str, int]]:
    points = [
        (op, common.parse_size(n)) for op, _, n in (p.partition(":") for p in text.split(","))
    ]
    unknown = [op for op, _ in points if op not in peers.OPS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown ops {unknown}; known: {', '.join(peers.OPS)}")
    return points


def _part_us(part: str):
    return lambda r: r["us"] * r["percent"][part] / 100 if "percent" in r else "-"


def main(argv: list[str] | None = None) -> int:
    raw = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(
        "python -m benchmarks.breakdown", description=__doc__, formatter_class=raw
    )
    p.add_argument("--quick", action="store_true", help="0.5 s loops instead of 3 s")
    p.add_argument(
        "--json", metavar="PATH", help="'' skips (default bench_results/breakdown-w{world}.json)"
    )
    p.add_argument("--csv", action="store_true", help="the rows as CSV after the table")
    p.add_argument("-v", "--verbose", action="store_true", help="each point as it is measured")
    peers.launch_flags(p, [2])
    default = ",".join(f"{op}:{n}" for op, n in DEFAULT_POINTS)
    p.add_argument(
        "--points",
        type=_points,
        default=DEFAULT_POINTS,
        metavar="OP:BYTES[,...]",
        help=f"ops of {','.join(peers.OPS)}, bytes per rank (default {default})",
    )
    p.add_argument("--perf-dir", metavar="DIR", help="keep rank 0's perf.data files, one a point")
    args = p.parse_args(argv)
    perf_dir = os.path.abspath(args.perf_dir) if args.perf_dir else None
    if perf_dir:
        os.makedirs(perf_dir, exist_ok=True)
    config = {"points": args.points, "perf_dir": perf_dir, "verbose": args.verbose}
    config["seconds"] = 0.5 if args.quick else 3.0
    env = dict(kv.split("=", 1) for kv in args.env)
    deadline = time.monotonic() + (args.timeout or (300.0 if args.quick else 900.0))
    cols = [Column("op", lambda r: r["op"]), Column("size", lambda r: format_size(r["bytes"]))]
    cols += [Column("us/call", lambda r: r["us"]), Column("sampled", lambda r: r["sampled_us"])]
    cols += [Column(part, _part_us(part)) for part in PART_NAMES]
    with common.cpu_load(args.load):
        for world in args.ranks:
            out = peers.launch(rank_main, world, env, deadline, config=config)
            notes = [f"no breakdown ({out['perf_problem']})"] if out["perf_problem"] else []
            notes.append("microseconds per call by part, from rank 0's perf samples")
            extra = {"perf_problem": out["perf_problem"], "perf_hz": PERF_HZ}
            extra["hsdp_cpu_engine"] = out["engine"]
            common.emit("breakdown", args, world, cols, out["rows"], notes, extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
