"""The collectives and training suites on groups that span hosts: 2 simulated hosts x 2 ranks
(tools/simhosts.py: a network and mount namespace per host, joined by veths on a bridge; needs
root). hsdp runs hierarchically there (shared memory within a host, gloo between hosts).

    python -m benchmarks hosts [--quick]

Each suite is the same script as on one host (``benchmarks/collectives.py``: 64 KiB, 1 MiB and
16 MiB per rank; ``benchmarks/training.py``: HSDP 2 x 2, replicating across the hosts), run by a
torchrun on each simulated host, so it checks and reports as it does there; its JSON lands in
``--out``. The "network" is a veth on one machine, as fast as loopback and on the same cores: a
real cluster's links will change every number.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
import sys

from tools import simhosts

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT_S = 1800.0


def launch(hosts: simhosts.SimHosts, module: str, flags: list[str], timeout_s: float) -> None:
    # The ranks import benchmarks/ and examples/ from the repository root, as a torchrun -m does.
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    procs = [
        hosts.torchrun(h, 2, [module, *flags], env=env, cwd=ROOT, torchrun_args=("--module",))
        for h in range(hosts.count)
    ]
    codes = simhosts.wait_all(procs, timeout_s)
    if codes != [0] * hosts.count:
        raise SystemExit(f"hosts: {module} failed across hosts: torchrun exit codes {codes}")


def _on_signal(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through SimHosts: namespaces and veths go


def main() -> None:
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="fewer samples and steps")
    p.add_argument("--out", default="bench_results", help="where the suites' JSON goes")
    args = p.parse_args()
    quick = ["--quick"] if args.quick else []
    out = pathlib.Path(args.out).resolve()
    with simhosts.SimHosts(2) as hosts:
        print("collectives on 2 simulated hosts x 2 ranks", flush=True)
        launch(
            hosts,
            "benchmarks.collectives",
            [*quick, "--sizes", "64K,1M,16M", "--json", str(out / "hosts-collectives.json")],
            LAUNCH_TIMEOUT_S,
        )
        print("training on 2 simulated hosts x 2 ranks", flush=True)
        launch(
            hosts,
            "benchmarks.training",
            [*quick, "--json", str(out / "hosts-training.json")],
            LAUNCH_TIMEOUT_S,
        )


if __name__ == "__main__":
    try:
        main()
    except simhosts.Unavailable as exc:
        sys.exit(f"hosts: simulated hosts unavailable: {exc}")
