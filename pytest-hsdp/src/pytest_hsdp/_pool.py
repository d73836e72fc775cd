"""Warm ranks: one pool of rank processes per (world size, backend, device, environment),
started once and reused by every test that asks for it (pytest_hsdp's parent side).

A test is sent to every rank of its pool and has one deadline. The pool is kept for the next
test only when every rank came back and the ranks are still in step: all passed or all failed,
every rank's default group at the same sequence number. A rank that died, a test that failed
on some ranks only or left the ranks out of step, and a test past its deadline end the pool
(killed; the next test gets a fresh one). Before killing ranks past a deadline, the pool asks
each for its Python stacks (SIGUSR2) and, on hsdp, for its flight record (SIGUSR1).

No torch here: the parent of the ranks is pytest itself.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from pytest_hsdp import _placement, _worker

# Once a rank failed or died, how long the others have to come back (they may be waiting
# for it in a collective) before they count as hung.
GRACE_AFTER_FAILURE_S = 10.0
# After asking a hung rank for its stacks, how long it has to write them.
STACKS_WAIT_S = 1.5


class PoolError(RuntimeError):
    """The pool could not be started (a rank failed to import or initialise)."""


class PoolUnavailable(PoolError):
    """The pool cannot run on this machine (device='cuda' without CUDA): a reason to skip."""


@dataclasses.dataclass
class Outcome:
    """What one test did on each rank."""

    failures: dict[int, str]  # rank -> why it failed (traceback, exit code, hang)
    output: dict[int, str]  # rank -> what it printed during the test (stdout and stderr)
    values: dict[int, Any] = dataclasses.field(default_factory=dict)  # rank -> what it returned
    died: set[int] = dataclasses.field(default_factory=set)  # the likely cause, if any
    trace: str = ""  # hsdp's reading of the flight records, after a hang
    hung: bool = False
    exit_codes: dict[int, int | None] = dataclasses.field(default_factory=dict)  # of `died`

    @property
    def passed(self) -> bool:
        return not self.failures

    def report(self, world: int, backend: str, output_chars: int = 0) -> str:
        """The failure text: each failing rank's reason, a rank that died first (the likely
        cause of the others'); with ``output_chars``, the tail of each one's output too."""
        lines = [f"{len(self.failures)} of {world} ranks failed (backend {backend})"]
        for r, text in sorted(
            self.failures.items(), key=lambda kv: (kv[0] not in self.died, kv[0])
        ):
            lines.append(f"--- rank {r} ---\n{text.rstrip()}")
            if output_chars and self.output.get(r, "").strip():
                lines.append(f"--- rank {r} output ---\n{self.output[r][-output_chars:].rstrip()}")
        if self.trace:
            lines.append(f"--- flight records ---\n{self.trace}")
        return "\n".join(lines)


class Pools:
    """Warm pools by key, the least recently used stopped beyond ``limit``."""

    def __init__(self, limit: int):
        self._limit = max(1, limit)
        self._pools: dict[Any, Pool] = {}  # least recently used first

    def get(self, key: Any, make) -> Pool:
        """The pool for ``key``, made by ``make()`` where there is none or it is broken."""
        pool = self._pools.pop(key, None)
        if pool is None or pool.broken:
            while len(self._pools) >= self._limit:
                self._pools.pop(next(iter(self._pools))).close()
            pool = make()
        self._pools[key] = pool
        return pool

    def close(self) -> None:
        while self._pools:
            self._pools.pop(next(iter(self._pools))).close()


def _context(env: dict[str, str], env_at_import: bool):
    """How ranks are started. Forked from multiprocessing's fork server, which has imported
    torch once, so a pool's start costs no import of torch per rank; but spawned where the
    ranks have an environment of their own that must be set before torch is imported
    (``env_at_import``: the caller cannot tell, so it must)."""
    if env and env_at_import:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # What FSDP2 and DTensor tests import, too: once here, not once per rank.
    ctx.set_forkserver_preload(
        [
            "pytest_hsdp._worker",
            "torch.distributed",
            "torch.distributed.tensor",
            "torch.distributed.fsdp",
        ]
    )
    return ctx


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class Pool:
    def __init__(
        self,
        world: int,
        backend: str | None,  # None: no default group (torch's test cases make their own)
        device: str,
        env: dict[str, str],
        *,
        start_timeout_s: float,
        group_timeout_s: float,
        setup: tuple[str, str, str] | None = None,
        env_at_import: bool = True,
        gpu_memory_gib: float = _placement.DEFAULT_GPU_MEMORY_GIB,
    ):
        self.world = world
        self.backend = backend
        self.broken = False
        # The MultiProcContinuousTest session the ranks hold (pytest_hsdp._continuous): the
        # last task's, None after any other task.
        self.session: int | None = None
        self.placement = ""  # how the ranks share CUDA devices, from rank 0 (device='cuda')
        self._dir = tempfile.mkdtemp(prefix="pytest-hsdp-")
        self._logs = [os.path.join(self._dir, f"rank{r}.log") for r in range(world)]
        # hsdp's flight records: where the ranks' environment says, else the pool's own.
        self._trace_dir = (
            env.get("HSDP_TRACE_DIR")
            or os.environ.get("HSDP_TRACE_DIR")
            or os.path.join(self._dir, "trace")
        )
        self._start_timeout_s = start_timeout_s
        spec = {
            "backend": backend,
            "device": device,
            "env": env,
            "logs": self._logs,
            "trace_dir": self._trace_dir,
            "group_timeout_s": group_timeout_s,
            "setup": setup,
            "gpu_memory_gib": gpu_memory_gib,
            "start_timeout_s": start_timeout_s,
        }
        ctx = _context(env, env_at_import)
        self._conns = []
        self._procs = []
        try:
            for r in range(world):
                parent_end, child_end = ctx.Pipe()
                proc = ctx.Process(
                    target=_worker.main,
                    args=(r, world, spec, child_end, os.getpid()),
                    name=f"pytest-hsdp-rank{r}",
                    daemon=True,
                )
                proc.start()
                child_end.close()
                self._conns.append(parent_end)
                self._procs.append(proc)
            self._await_ready("start")
        except BaseException:
            self.close()
            raise

    def _await_ready(self, what: str) -> None:
        deadline = time.monotonic() + self._start_timeout_s
        waiting = set(range(self.world))
        errors: dict[int, str] = {}
        unavailable = ""
        while waiting and time.monotonic() < deadline:
            for r in self._ready(waiting, deadline - time.monotonic()):
                message = self._receive(r)
                waiting.discard(r)
                if message is None:
                    errors[r] = f"rank {r} died ({_exit_text(self._procs[r].exitcode)})"
                elif message[0] == "failed":
                    errors[r] = message[2]
                elif message[0] == "unavailable":
                    unavailable = errors[r] = message[2]
                elif message[0] == "port":
                    # Rank 0's store is bound: the others connect to it. Rank 0 is still
                    # to say it is ready.
                    waiting.add(r)
                    for conn in self._conns[1:]:
                        try:
                            conn.send(("port", message[1]))
                        except (BrokenPipeError, OSError):
                            pass  # found dead when its message does not come
                elif r == 0:
                    self.placement = message[3]
            if errors:
                break
        if unavailable:
            self.broken = True
            raise PoolUnavailable(unavailable)
        if errors or waiting:
            lines = [f"could not {what} a pool of {self.world} ranks on {self.backend}"]
            lines += [f"--- rank {r} ---\n{text.rstrip()}" for r, text in sorted(errors.items())]
            if waiting and not errors:
                lines.append(
                    f"ranks {sorted(waiting)} were not ready after {self._start_timeout_s:.0f} s"
                    " (--hsdp-start-timeout)"
                )
            for r in range(self.world):
                tail = self._read_log(r, 0)[-3000:]
                if tail.strip():
                    lines.append(f"--- rank {r} output ---\n{tail.rstrip()}")
            self.broken = True
            raise PoolError("\n".join(lines))

    def _ready(self, ranks: set[int], timeout_s: float) -> list[int]:
        """Ranks among ``ranks`` with a message waiting or whose process ended."""
        handles = {}
        for r in ranks:
            handles[self._conns[r]] = r
            handles[self._procs[r].sentinel] = r
        ready = multiprocessing.connection.wait(list(handles), timeout=max(0.0, timeout_s))
        return sorted({handles[h] for h in ready})

    def _receive(self, r: int) -> tuple | None:
        """The rank's next message, or None if it is gone."""
        conn = self._conns[r]
        try:
            if conn.poll():
                return conn.recv()
        except (EOFError, OSError):
            pass
        # Ended with nothing to say: reaped, so that its exit code is known.
        self._procs[r].join(5.0)
        return None

    def _read_log(self, r: int, offset: int) -> str:
        try:
            with open(self._logs[r], "rb") as f:
                f.seek(offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def _log_size(self, r: int) -> int:
        try:
            return os.path.getsize(self._logs[r])
        except OSError:
            return 0

    def run(self, task: dict[str, Any], timeout_s: float) -> Outcome:
        """Runs ``task`` on every rank; the pool is ``broken`` after it unless kept."""
        self.session = None  # until every rank answered
        try:
            return self._run(task, timeout_s)
        except BaseException:
            self.close()  # interrupted (Ctrl-C, a timeout's signal): the ranks are mid-task
            raise

    def _run(self, task: dict[str, Any], timeout_s: float) -> Outcome:
        offsets = [self._log_size(r) for r in range(self.world)]
        failures: dict[int, str] = {}
        died: set[int] = set()
        sequence: dict[int, int | None] = {}
        values: dict[int, Any] = {}
        exit_codes: dict[int, int | None] = {}
        group_lost = False
        out_of_step = False  # a rank answered something else: the pipe is a message behind
        pending = set(range(self.world))
        for r in range(self.world):
            try:
                self._conns[r].send(("run", task))
            except (BrokenPipeError, OSError):
                pass  # found dead below
        deadline = time.monotonic() + timeout_s
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for r in self._ready(pending, left):
                message = self._receive(r)
                pending.discard(r)
                if message is None:
                    died.add(r)
                    exit_codes[r] = self._procs[r].exitcode
                    failures[r] = (
                        f"rank {r} died during the test ({_exit_text(self._procs[r].exitcode)})"
                    )
                elif message[0] == "done" and message[1] == task["id"]:
                    _, _, _, failure, value, seq, group_ok = message
                    sequence[r] = seq
                    group_lost |= not group_ok
                    if failure is not None:
                        failures[r] = failure
                    try:
                        values[r] = pickle.loads(value)
                    except Exception as exc:  # noqa: BLE001 - unpickling raises many kinds
                        failures.setdefault(r, f"rank {r}'s return value cannot be read: {exc!r}")
                else:
                    out_of_step = True
                    failures[r] = f"rank {r} answered {message[0]!r} where a result was expected"
                if r in failures:
                    deadline = min(deadline, time.monotonic() + GRACE_AFTER_FAILURE_S)
        outcome = Outcome(failures, {}, values, died, exit_codes=exit_codes)
        if pending:
            outcome.hung = True
            self._explain_hang(pending, failures, timeout_s, deadline_passed=not failures)
        for r in range(self.world):
            outcome.output[r] = self._read_log(r, offsets[r])
            if _worker.forked_mark_of(outcome.output[r], task["id"]) and r not in failures:
                failures[r] = (
                    "the test body forked and the child returned from it instead of exiting "
                    "(os._exit in the child); the child was ended"
                )
        if outcome.hung and self.backend == "hsdp":
            outcome.trace = self._read_traces()
        self.session = task["session"] if task.get("kind") == "class" and not task["end"] else None
        in_step = len({sequence.get(r) for r in range(self.world)}) == 1
        partial = failures and len(failures) < self.world
        if pending or died or not in_step or partial or out_of_step:
            self.close()
        elif group_lost:
            self._reinit()
        return outcome

    def _explain_hang(
        self, pending: set[int], failures: dict[int, str], timeout_s: float, deadline_passed: bool
    ) -> None:
        for r in sorted(pending):
            self._signal(r, signal.SIGUSR2)  # faulthandler: every thread's Python stack
        time.sleep(STACKS_WAIT_S)
        if self.backend == "hsdp":
            for r in range(self.world):
                self._signal(r, signal.SIGUSR1)  # hsdp's flight recorder dumps
            time.sleep(STACKS_WAIT_S)
        why = (
            f"did not return within the test's deadline of {timeout_s:g} s"
            if deadline_passed
            else f"did not return within {GRACE_AFTER_FAILURE_S:g} s of another rank's failure"
        )
        for r in sorted(pending):
            failures[r] = (
                f"rank {r} {why}; its Python stacks are in its output below (the pool was killed)"
            )

    def _signal(self, r: int, sig: int) -> None:
        proc = self._procs[r]
        if proc.is_alive() and proc.pid is not None:
            try:
                os.kill(proc.pid, sig)
            except ProcessLookupError:
                pass

    def _read_traces(self) -> str:
        if not os.path.isdir(self._trace_dir) or not os.listdir(self._trace_dir):
            return ""
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "hsdp_backend.trace", self._trace_dir],
                capture_output=True,
                text=True,
                timeout=60,
                cwd=self._dir,
            )
            return (proc.stdout + proc.stderr).strip()
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"(the flight records in {self._trace_dir} could not be read: {exc})"

    def _reinit(self) -> None:
        """A test destroyed the default group on some rank: every rank makes a new one."""
        try:
            for conn in self._conns:
                conn.send(("reinit",))
            self._await_ready("re-create the default group of")
        except (PoolError, BrokenPipeError, OSError):
            self.close()

    def close(self) -> None:
        """Stops every rank (killed if it does not stop at once) and removes the pool's files."""
        self.broken = True
        for conn in self._conns:
            try:
                conn.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
        stop_by = time.monotonic() + 5.0
        for proc in self._procs:
            if proc.pid is not None:
                proc.join(max(0.0, stop_by - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
        for conn in self._conns:
            conn.close()
        self._conns = []
        self._procs = []
        shutil.rmtree(self._dir, ignore_errors=True)
