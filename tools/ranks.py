"""Runs a function on W ranks, each a new process, with hard timeouts: the
rank launcher of the benchmarks (benchmarks/) and of the tests' launches that
need fresh processes (tests/harness.py; the others run on warm pools).

Rank 0 hosts the TCPStore on a port it binds itself (port 0: no port is
chosen free and bound later, when another process may have taken it) and
shares it; every rank then gets the torchrun variables (MASTER_ADDR /
MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, and
TORCHELASTIC_USE_AGENT_STORE, as torchrun's agent store: env:// makes every
rank a client of that store) and, unless ``backend`` is None, initialises
the default group over env://. The parent waits for all ranks with
one deadline; when a rank fails the others get a short grace period, then
every process still alive is killed, so a hang costs seconds and no process
outlives its launch. Each rank arms faulthandler to print its stacks and
exit just before the deadline (a hang is diagnosable from the log), and
exits by itself when the parent is gone.

``fn`` must be importable by name in a fresh interpreter (spawn): defined at
module level in a module found on the parent's sys.path, which the ranks
inherit (the tests put tests/ there; the benchmarks run from the repository
root).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import socket
import threading
import time
import traceback
from typing import Any, Callable

# How long the other ranks may keep running once one rank failed.
GRACE_AFTER_FAILURE_S = 15.0
# A rank prints its stacks and exits this long before the launch deadline,
# so the parent still collects the output of a hang.
STACK_DUMP_MARGIN_S = 5.0


class RankFailure(AssertionError):
    """A rank raised or died, or the deadline passed; the message has every
    failing rank's traceback and the ranks that had to be killed."""


def free_port() -> int:
    """A loopback TCP port nobody listens on right now, for a program that takes a port
    number only (torchrun's --master-port): another process may take it before that
    program binds it. The launchers here bind port 0 instead."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _shared_store_port(rank: int, world: int, port: Any, deadline_epoch: float, timeout_s: float):
    """(rank 0's store or None, its port): rank 0 binds port 0 and publishes it in ``port``
    (a shared value); the others wait for it until the deadline."""
    import torch.distributed as dist

    if rank == 0:
        store = dist.TCPStore(
            "127.0.0.1", 0, world, is_master=True,
            timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False,
        )  # fmt: skip
        port.value = store.port
        return store, store.port
    while port.value == 0:
        if time.time() >= deadline_epoch:
            raise TimeoutError(f"rank {rank} was not told rank 0's store port by the deadline")
        time.sleep(0.01)
    return None, port.value


def _watch_parent(parent_pid: int) -> None:
    # A rank whose launcher is gone (killed, crashed) must not live on.
    while True:
        if os.getppid() != parent_pid:
            os._exit(3)
        time.sleep(0.5)


def _rank_main(
    fn,
    setup,
    rank,
    world,
    backend,
    env,
    collective_timeout_s,
    deadline_epoch,
    parent_pid,
    kwargs,
    results,
    device,
    port,
):
    import faulthandler

    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    time_left_s = deadline_epoch - time.time()
    faulthandler.enable()  # a crash prints every thread's Python stack
    faulthandler.dump_traceback_later(max(time_left_s - STACK_DUMP_MARGIN_S, 1.0), exit=True)
    os.environ.update(env)
    try:
        import torch
        import torch.distributed as dist

        import hsdp_backend  # noqa: F401  registers "hsdp"

        # Rank 0's store lives as long as this process (the env:// clients' server).
        _store, store_port = _shared_store_port(
            rank, world, port, deadline_epoch, collective_timeout_s
        )
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(store_port),
            TORCHELASTIC_USE_AGENT_STORE=str(True),
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world),
        )

        torch.set_num_threads(1)
        if device == "cuda":
            # pytest_hsdp's placement: ranks beyond the device count share devices, each
            # with its own NCCL host identity (set before NCCL reads it).
            from pytest_hsdp import _placement

            place = _placement.place(rank, world, torch.cuda.device_count(), os.environ)
            os.environ.update(place.env)
            torch.cuda.set_device(place.device)
        if setup is not None:
            setup()
        if backend is not None:
            dist.init_process_group(
                backend,
                rank=rank,
                world_size=world,
                timeout=datetime.timedelta(seconds=collective_timeout_s),
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
    *,
    backend: str | None = "hsdp",
    env: dict[str, str] | None = None,
    timeout_s: float,
    collective_timeout_s: float,
    may_die: tuple[int, ...] = (),
    kwargs: dict[str, Any] | None = None,
    setup: Callable[[], None] | None = None,
    device: str = "cpu",
) -> list[Any]:
    """Runs ``fn(rank, world, **kwargs)`` on ``world`` fresh processes.

    Args:
        fn: module-level function (see the module docstring).
        world: number of ranks.
        backend: of the default group each rank initialises, or None: ``fn``
            initialises (or not) itself, from the env:// variables.
        env: set in every rank before torch is imported there.
        timeout_s: wall-clock limit of the whole launch.
        collective_timeout_s: the default group's timeout (capped by what
            is left of ``timeout_s``).
        may_die: ranks allowed to die without reporting (a fault test's
            victim); their result is None.
        kwargs: passed to ``fn``; must pickle.
        setup: module-level function each rank calls once hsdp_backend is
            imported, before its default group is created (the tests'
            hooks: tests/hooks.py).
        device: "cuda": each rank on its CUDA device as pytest_hsdp places
            it (pytest-hsdp/src/pytest_hsdp/_placement.py), before ``setup``.

    Returns the per-rank return values, or raises RankFailure.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = ctx.Value("i", 0)  # rank 0's store port, once bound
    deadline = time.monotonic() + timeout_s
    collective_timeout_s = max(1.0, min(collective_timeout_s, timeout_s))
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(
                fn,
                setup,
                r,
                world,
                backend,
                env or {},
                collective_timeout_s,
                time.time() + timeout_s,
                os.getpid(),
                kwargs or {},
                results,
                device,
                port,
            ),
            name=f"rank{r}",
            daemon=True,
        )
        for r in range(world)
    ]
    outputs: dict[int, Any] = {}
    errors: dict[int, str] = {}  # in the order reported: the first is likely the cause
    died: set[int] = set()
    collected = False
    try:
        for p in procs:
            p.start()
        while len(outputs) + len(errors) < world:
            now = time.monotonic()
            if now >= deadline:
                break
            try:
                rank, status, payload = results.get(timeout=min(0.5, deadline - now))
            except queue.Empty:
                for r, p in enumerate(procs):
                    if p.exitcode in (None, 0) or r in outputs or r in errors:
                        continue
                    if r in may_die:
                        outputs[r] = None
                    else:
                        errors[r] = (
                            f"rank {r} died with exit code {p.exitcode} (no Python error: crashed or killed)"
                        )
                        died.add(r)
                        deadline = min(deadline, time.monotonic() + GRACE_AFTER_FAILURE_S)
                continue
            if status == "ok":
                outputs[rank] = payload
            else:
                errors[rank] = payload
                deadline = min(deadline, time.monotonic() + GRACE_AFTER_FAILURE_S)
        collected = True
    finally:
        # Ranks that reported are tearing their groups down: give them a
        # moment. On an exception here (Ctrl-C, a signal), kill at once.
        for p in procs:
            if collected and p.pid is not None:
                p.join(timeout=max(0.0, min(10.0, deadline - time.monotonic())))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        results.close()
    missing = [r for r in range(world) if r not in outputs and r not in errors]
    if errors or missing:
        raise RankFailure(_failure_text(world, errors, died, missing))
    return [outputs[r] for r in range(world)]


def _failure_text(world: int, errors: dict[int, str], died: set[int], missing: list[int]) -> str:
    lines = [f"{len(errors)} of {world} ranks failed"]
    if missing:
        lines[0] += f"; ranks {missing} were still running at the deadline and were killed"
        if not errors:
            lines.append("(their Python stacks, printed just before the deadline, are on stderr)")
    # A rank that died without a Python error (crash, kill) is the likely
    # cause; then the tracebacks, first reported first.
    for r in sorted(died):
        lines.append(f"--- rank {r} --- {errors[r]}")
    for r in errors:
        if r not in died:
            lines.append(f"--- rank {r} ---\n{errors[r].rstrip()}")
    return "\n".join(lines)
