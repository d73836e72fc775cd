"""``python -m benchmarks SUITE [--ranks W[,W...]] [--load N|cores] [--timeout S] [--env K=V] ...``
from the repository root: each world size is one ``torchrun --standalone`` of the suite's script
(``python -m benchmarks.SUITE`` on every rank; the other flags are the script's: ``SUITE --help``).
The launcher only launches: the script checks, times and reports. A run that outlives
``--timeout``, or a launcher that is stopped, takes every process of the run with it."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

from benchmarks import common

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
STOP_GRACE_S = 30.0  # for torchrun to stop its ranks after SIGTERM


def _worlds(text: str) -> list[int]:
    worlds = [w.strip() for w in text.split(",") if w.strip()]
    if not worlds or not all(w.isdigit() and int(w) >= 1 for w in worlds):
        raise argparse.ArgumentTypeError(f"world sizes >= 1, e.g. 2,4; got {text!r}")
    return [int(w) for w in worlds]


def _load(text: str) -> int:
    if text != "cores" and not text.isdigit():
        raise argparse.ArgumentTypeError(f"a count >= 0 or 'cores'; got {text!r}")
    return len(os.sched_getaffinity(0)) if text == "cores" else int(text)


def _env(text: str) -> tuple[str, str]:
    if "=" not in text[1:]:
        raise argparse.ArgumentTypeError(f"KEY=VALUE; got {text!r}")
    return tuple(text.split("=", 1))


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the run's process group (torchrun stops its ranks), SIGKILL after a grace."""
    for sig, wait_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(wait_s)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def _run(cmd: list[str], env: dict, deadline: float) -> int:
    proc = subprocess.Popen(cmd, env=env, start_new_session=True,
                            preexec_fn=common.dies_with_parent())  # fmt: skip
    try:
        return proc.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        print(f"benchmarks: {' '.join(cmd)} passed --timeout; stopped", file=sys.stderr)
        return 124
    finally:
        if proc.poll() is None:
            _stop(proc)


def _on_signal(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through _run's finally: the run is stopped


def main(argv: list[str]) -> int:
    # The suite's -h is the script's: the launcher's own help only without a suite.
    p = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__, add_help=False, allow_abbrev=False
    )
    p.add_argument("suite", choices=SUITES)
    p.add_argument("--ranks", type=_worlds, default=None, metavar="W[,W...]")
    p.add_argument("--load", type=_load, default=0, metavar="N|cores",
                   help="N CPU-bound processes beside the ranks for the whole run")  # fmt: skip
    p.add_argument("--timeout", type=float, default=3600.0, metavar="S")
    p.add_argument("--env", type=_env, action="append", default=[], metavar="KEY=VALUE")
    if not argv or argv[0] in ("-h", "--help"):
        p.print_help()
        return 0 if argv else 2
    args, rest = p.parse_known_args(argv)
    if SUITES[args.suite] is None and args.ranks:
        p.error(f"{args.suite} starts its own ranks: no --ranks")
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        **dict(args.env),
    }
    env["HSDP_BENCH_LOAD"] = str(args.load)  # recorded with the results (rank_env)
    module = [sys.executable, "-m", f"benchmarks.{args.suite}"]
    if SUITES[args.suite] is None or "-h" in rest or "--help" in rest:
        launches = [module + rest]
    else:
        launches = [
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             f"--nproc-per-node={w}", "-m", f"benchmarks.{args.suite}", *rest]
            for w in args.ranks or SUITES[args.suite]
        ]  # fmt: skip
    if args.load:
        print(f"loaded mode: {args.load} CPU-bound processes beside the ranks", flush=True)
    deadline = time.monotonic() + args.timeout
    with common.cpu_load(args.load):
        for cmd in launches:
            rc = _run(cmd, env, deadline)
            if rc:
                return rc
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
