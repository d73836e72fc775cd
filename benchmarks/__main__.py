"""``python -m benchmarks SUITE [--ranks W[,W...]] [--load N|cores] [--timeout S] [--env K=V] ...``
from the repository root: each world size is one ``torchrun --standalone`` of the suite's script
(``python -m benchmarks.SUITE`` on every rank; the other flags are the script's: ``SUITE --help``).
The launcher only launches: the script checks, times and reports. A run that outlives
``--timeout`` is killed, all of its processes with it."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

# suite: default world sizes; None: a plain process that starts its own ranks.
SUITES = {
    "collectives": (2, 4),
    "coalesced": (2,),
    "numerics": (2, 4, 8),
    "device_calls": (2,),
    "training": (2, 4),
    "fsdp_copies": (2,),
    "hosts": None,
}
SPIN = "while True: pass"


def _worlds(text: str) -> list[int]:
    worlds = [int(w) for w in text.split(",") if w.strip()]
    if not worlds or min(worlds) < 1:
        raise argparse.ArgumentTypeError(f"world sizes >= 1, e.g. 2,4; got {text!r}")
    return worlds


def _load(text: str) -> int:
    return len(os.sched_getaffinity(0)) if text == "cores" else int(text)


def _run(cmd: list[str], env: dict, deadline: float) -> int:
    """Runs ``cmd`` in a session of its own; past ``deadline`` every process of it is killed."""
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        return proc.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        print(f"benchmarks: {' '.join(cmd)} passed --timeout; killed", file=sys.stderr)
        return 124
    finally:
        if proc.poll() is None or proc.returncode:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def main(argv: list[str]) -> int:
    # The suite's -h is the script's: the launcher's own help only without a suite.
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__, add_help=False)
    p.add_argument("suite", choices=SUITES)
    p.add_argument("--ranks", type=_worlds, default=None, metavar="W[,W...]")
    p.add_argument(
        "--load",
        type=_load,
        default=0,
        metavar="N|cores",
        help="N CPU-bound processes beside the ranks for the whole run",
    )
    p.add_argument("--timeout", type=float, default=3600.0, metavar="S")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    if not argv or argv[0] in ("-h", "--help"):
        p.print_help()
        return 0 if argv else 2
    args, rest = p.parse_known_args(argv)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env.update(kv.split("=", 1) for kv in args.env)
    env["HSDP_BENCH_LOAD"] = str(args.load)  # recorded with the results (rank_env)
    module = [sys.executable, "-m", f"benchmarks.{args.suite}"]
    if SUITES[args.suite] is None or "-h" in rest or "--help" in rest:
        launches = [module + rest]
    else:
        launches = [
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={w}",
                "-m",
                f"benchmarks.{args.suite}",
                *rest,
            ]
            for w in args.ranks or SUITES[args.suite]
        ]
    if args.load:
        print(f"loaded mode: {args.load} CPU-bound processes beside the ranks", flush=True)
    spinners = [
        subprocess.Popen([sys.executable, "-c", SPIN], start_new_session=True)
        for _ in range(args.load)
    ]
    deadline = time.monotonic() + args.timeout
    try:
        for cmd in launches:
            rc = _run(cmd, env, deadline)
            if rc:
                return rc
        return 0
    finally:
        for s in spinners:
            s.kill()
            s.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
