"""Runs a function on W ranks, each a separate process, with hard timeouts.

Every rank initialises the default group on the requested backend over a
TCPStore on a free loopback port. The parent waits for all ranks with a
deadline; when a rank fails the others get a short grace period, then every
process still alive is killed, so a hang costs seconds and no process
outlives its test. Each rank also arms faulthandler to print its stacks
just before the deadline, so a hang is diagnosable from the test log.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from typing import Any, Callable

# Per-collective timeout inside the ranks; a lost peer surfaces this fast.
COLLECTIVE_TIMEOUT_S = float(os.environ.get("HSDP_TEST_COLLECTIVE_TIMEOUT_S", "60"))
# Wall-clock limit for one launch (all ranks, all cases).
LAUNCH_TIMEOUT_S = float(os.environ.get("HSDP_TEST_LAUNCH_TIMEOUT_S", "300"))
# How long other ranks may keep running once one rank failed.
GRACE_AFTER_FAILURE_S = 15.0


class RankFailure(AssertionError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn, rank, world, port, backend, env, kwargs, results):
    import faulthandler

    faulthandler.enable()  # a crash prints every thread's Python stack
    faulthandler.dump_traceback_later(max(LAUNCH_TIMEOUT_S - 5, 1), exit=True)
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    try:
        import torch
        import torch.distributed as dist

        import hsdp_backend  # noqa: F401  registers "hsdp"

        torch.set_num_threads(1)
        if backend is not None:
            dist.init_process_group(
                backend,
                rank=rank,
                world_size=world,
                timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
            )
        out = fn(rank, world, **kwargs)
        results.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    backend: str | None = "hsdp",
    env: dict[str, str] | None = None,
    timeout_s: float = LAUNCH_TIMEOUT_S,
    may_die: tuple[int, ...] = (),
    **kwargs,
) -> list[Any]:
    """Runs ``fn(rank, world, **kwargs)`` on ``world`` processes.

    ``fn`` must be importable by name (defined at module level). Returns the
    per-rank return values (None for a rank in ``may_die`` that died, as a
    fault test's victim does), or raises RankFailure with every failing
    rank's traceback (and the ranks that had to be killed).
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, r, world, port, backend, env or {}, kwargs, results),
            daemon=True,
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    outputs: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(outputs) + len(errors) < world:
            now = time.monotonic()
            if now >= deadline:
                break
            try:
                rank, status, payload = results.get(timeout=min(1.0, deadline - now))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                for r in dead:
                    if r in may_die and r not in outputs:
                        outputs[r] = None
                    elif r not in outputs and r not in errors:
                        errors[r] = f"rank {r} died with exit code {procs[r].exitcode}"
                if errors:
                    deadline = min(deadline, time.monotonic() + GRACE_AFTER_FAILURE_S)
                continue
            if status == "ok":
                outputs[rank] = payload
            else:
                errors[rank] = payload
                deadline = min(deadline, time.monotonic() + GRACE_AFTER_FAILURE_S)
    finally:
        for p in procs:
            p.join(timeout=max(0.0, min(10.0, deadline - time.monotonic())))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    missing = [r for r in range(world) if r not in outputs and r not in errors]
    if errors or missing:
        lines = [f"{len(errors)} of {world} ranks failed; killed after timeout: {missing}"]
        for r in sorted(errors):
            lines.append(f"--- rank {r} ---\n{errors[r]}")
        raise RankFailure("\n".join(lines))
    return [outputs[r] for r in range(world)]


def run_cases(rank: int, world: int, module: str, names: list[str]) -> dict[str, str | None]:
    """Rank body that runs many named cases in one launch.

    Starting ranks is the slow part of a multi-process test, so one launch
    runs every case of a module for one world size. A case is
    ``fn(rank, world, ref)`` where ``ref`` is a gloo group over the same
    ranks, to compare against. Returns {case: None or the traceback}. After a
    failure the remaining cases are not run (the ranks may be out of step).
    """
    import importlib

    import torch.distributed as dist

    cases = importlib.import_module(module).CASES
    ref = dist.new_group(backend="gloo")
    out: dict[str, str | None] = {}
    for name in names:
        try:
            cases[name](rank, world, ref)
            out[name] = None
        except BaseException:  # noqa: BLE001
            out[name] = traceback.format_exc()
            break
    for name in names:
        out.setdefault(name, "not run: an earlier case failed on this rank")
    return out


class CaseLauncher:
    """Launches each (module, world) once and serves per-case verdicts."""

    def __init__(self):
        self._cache: dict[tuple, dict[str, str | None]] = {}

    def verdict(self, module: str, names: list[str], world: int, env=None) -> dict:
        """{case: None or failure text} for ``module``'s cases on ``world``
        ranks with ``env`` set in every rank, launching on first request."""
        key = (module, world, tuple(sorted((env or {}).items())))
        if key not in self._cache:
            try:
                per_rank = run_ranks(run_cases, world, env=env, module=module, names=names)
            except RankFailure as exc:
                self._cache[key] = {n: f"launch failed:\n{exc}" for n in names}
            else:
                merged = {}
                for n in names:
                    errs = [
                        f"--- rank {r} ---\n{res[n]}" for r, res in enumerate(per_rank) if res[n]
                    ]
                    merged[n] = "\n".join(errs) if errs else None
                self._cache[key] = merged
        return self._cache[key]

    def check(self, module: str, names: list[str], name: str, world: int, env=None) -> None:
        """Fails the calling test with case ``name``'s failure text, if any."""
        import pytest

        verdict = self.verdict(module, names, world, env)[name]
        if verdict is not None:
            pytest.fail(verdict, pytrace=False)
