"""What every suite shares: the Suite interface, the launch of its ranks
(tools/ranks.py, the tests' launcher), the run from configuration to JSON and
plot, and the machine information recorded with the numbers."""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

from benchmarks import load
from tools.ranks import RankFailure, run_ranks

BACKENDS = ("hsdp", "gloo")

# Per-collective timeout inside the ranks (capped by what is left of --timeout).
COLLECTIVE_TIMEOUT_S = 120.0


class BenchFailure(RuntimeError):
    """A launch failed: a rank raised or died, or the deadline passed."""


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

    A suite module defines one subclass and an instance ``SUITE``. Order of
    calls in the parent: add_arguments (building the CLI), configure,
    reference, run_all (by default one launch of ``run_rank`` per world
    size), report, plot. The default ``--json`` / ``--plot`` files are
    ``bench_results/<output_stem>.json|png``.
    """

    name: str = ""
    help: str = ""
    # World sizes without --ranks.
    default_ranks: tuple[int, ...] = (2, 4)
    takes_ranks: bool = True  # False: no --ranks, the suite's world is fixed
    output_stem: str = "bench"
    # Whole-run --timeout default (full, --quick), seconds.
    default_timeout_s: tuple[float, float] = (1200.0, 300.0)
    quick_help: str = "fewer sizes, repetitions and steps"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """The suite's own flags (the shared ones are added by the CLI)."""

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
        ``run_rank`` on ``world`` fresh rank processes per world size; a
        suite that starts its own processes (training, hosts) overrides
        this. Raises BenchFailure.
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


# ---------------------------------------------------------------- launching


def _rank_body(rank: int, world: int, module: str, config: dict, timeout_s: float, verbose: bool):
    """One rank of a suite (the default group is hsdp's already)."""
    import torch.distributed as dist

    gloo = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    ctx = RankContext(rank, world, dist.group.WORLD, gloo, verbose)
    out = importlib.import_module(module).SUITE.run_rank(ctx, config)
    return {"engine": _cpu_engine(), "result": out}


def _cpu_engine() -> str:
    """What serves the default hsdp group's CPU collectives ("shm", "gloo",
    "hierarchical"), or "unknown" on builds without ``hsdp_backend.cpu_engine``."""
    import hsdp_backend

    try:
        return str(hsdp_backend.cpu_engine())
    except (AttributeError, ImportError):
        return "unknown"


def launch(suite: Suite, world: int, config: dict, env: dict, deadline: float, verbose: bool):
    """Runs ``suite.run_rank`` on ``world`` fresh rank processes (single
    threaded, OMP_NUM_THREADS=1 unless ``env`` says otherwise).

    Returns rank 0's ``{"engine": hsdp's CPU engine, "result": what
    run_rank returned}``. ``deadline`` is a ``time.monotonic()`` value.
    Raises BenchFailure when a rank fails or the deadline passes; every
    rank process is gone on return.
    """
    time_left = deadline - time.monotonic()
    if time_left <= 0:
        raise BenchFailure(f"world size {world}: no time left (see --timeout)")
    collective_timeout = max(1.0, min(COLLECTIVE_TIMEOUT_S, time_left))
    try:
        per_rank = run_ranks(
            _rank_body,
            world,
            backend="hsdp",
            env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **env},
            timeout_s=time_left,
            collective_timeout_s=collective_timeout,
            kwargs={
                "module": type(suite).__module__,
                "config": config,
                "timeout_s": collective_timeout,
                "verbose": verbose,
            },
        )
    except RankFailure as exc:
        raise BenchFailure(f"world size {world}: {exc}") from None
    return per_rank[0]


# ---------------------------------------------------------------- one run


class _Terminated(BaseException):
    """SIGTERM / SIGHUP in the parent: unwind so the ranks get killed."""


def _on_signal(signum, frame):
    raise _Terminated(signum)


def run(suite: Suite, args: argparse.Namespace, config: dict, argv: list[str]) -> int:
    """Measures, reports, writes the JSON and the plot; returns the exit code."""
    timeout = args.timeout if args.timeout is not None else suite.default_timeout_s[args.quick]
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    start = time.monotonic()
    deadline = start + timeout
    if not _extension_found():
        return 1
    env = dict(args.env)
    try:
        info = machine_info()
        info["load_processes"] = args.load
        _print_header(suite, args.ranks, info, timeout)
        with load.busy(args.load):
            reference = suite.reference(config)
            per_world, engines, wall = suite.run_all(
                config, args.ranks, env, deadline, args.verbose
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
    json_path = _default(args.json, suite, "json")
    plot_path = _default(args.plot, suite, "png")
    if json_path:
        doc = {
            "schema": 1,
            "suite": suite.name,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": [sys.executable, "-m", "benchmarks", *argv],
            "machine": info,
            "world_sizes": args.ranks,
            "rank_env": env,
            "hsdp_cpu_engine": {str(w): e for w, e in engines.items()},
            "wall_time_s": {"total": total, **{str(w): t for w, t in wall.items()}},
            suite.name: section,
        }
        _makedirs_for(json_path)
        with open(json_path, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {json_path}")
    if plot_path:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("note: matplotlib is not installed; no plot (pip install matplotlib)")
        else:
            _makedirs_for(plot_path)
            suite.plot(section, plot_path)
            print(f"wrote {plot_path}")
    return 0


def _default(path: str | None, suite: Suite, ext: str) -> str:
    """The --json / --plot path: as given ('' skips), else under bench_results/."""
    return os.path.join("bench_results", f"{suite.output_stem}.{ext}") if path is None else path


def _makedirs_for(path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)


def _extension_found() -> bool:
    """False (with a hint) when ``hsdp_backend`` has no compiled extension (not installed)."""
    import importlib.util

    if importlib.util.find_spec("hsdp_backend._C") is not None:
        return True
    import hsdp_backend

    print(
        f"error: {os.path.dirname(hsdp_backend.__file__)} has no compiled extension "
        "(hsdp_backend._C); install the package (scripts/setup.sh)",
        file=sys.stderr,
    )
    return False


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


def _print_header(suite: Suite, ranks: list[int], info: dict, timeout: float) -> None:
    """What runs where, and warnings about conditions that make numbers noisy."""
    print(
        f"hsdp bench, suite {suite.name}: {info['cpu_model']}, {info['nproc']} cpus, "
        f"torch {info['torch_version']}, hsdp-backend {info['hsdp_backend_version']}, "
        f"world sizes {ranks}, timeout {timeout:.0f} s",
        flush=True,
    )
    cpus = info["nproc_available"] or info["nproc"] or 1
    if max(ranks) > cpus:
        print(
            f"note: more ranks than cpus ({max(ranks)} > {cpus}): ranks share cores",
            flush=True,
        )
    if info["load_processes"]:
        print(
            f"loaded mode: {info['load_processes']} CPU-bound processes run beside the ranks",
            flush=True,
        )
    avg = info["loadavg_at_start"]
    if avg and avg[0] > 0.5:
        print(
            f"note: load average {avg[0]:.1f} on {cpus} cpus before the run: other processes "
            "compete for the cpus; expect noisy absolute numbers",
            flush=True,
        )
