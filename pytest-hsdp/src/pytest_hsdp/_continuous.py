"""torch's ``MultiProcContinuousTest`` classes on warm ranks.

torch's harness (``common_distributed``, 2.11-2.15) spawns a class's ranks once: each runs
the class's ``_worker_loop``, which makes the group once (``_init_pg`` on the class's
rendezvous file), then takes test ids from a queue and runs each (``_run_test_given_id``),
putting on a completion queue the id, a ``SkipTest`` or the exception; on the poison pill
(``None``) it destroys the group, unless a test raised. The parent's ``setUp`` sends each
test's id, and the wrapper ``_worker_run_main_wait`` reads the ranks' results in rank
order: the first that is not the test's id decides (a ``SkipTest`` skips, an exception,
a rank gone or a timeout fails the test and sets ``poison_pill``, which skips the class's
later tests in ``setUp``).

Here the ranks are a pool's (no default group) and each runs the class's own
``_worker_loop`` on its main thread (``Session``): its task queue is the pool's pipe, so the
loop runs one test per task the parent sends and ends, making torch's own teardown, when
anything else comes (the class's last test was run, or another test needs the pool). The
parent side (``take_over``, ``judge``) is torch's ``setUp`` and wrapper without spawning: the
class's ``_spawn_processes`` is replaced in pytest's process by one that makes the rendezvous
file only, as torch's does, so torch's own ``tearDownClass`` removes it. Each session (the
class's group on one pool) has a rendezvous file of its own: a FileStore must start empty.
A class that spawns its ranks its own way (its own ``_spawn_processes``) keeps torch's harness.
"""

from __future__ import annotations

import os
import pickle
import sys
import tempfile
import unittest
from typing import Any

_TORCH_BASE = ("torch.testing._internal.common_distributed", "MultiProcContinuousTest")


def is_continuous_class(cls: Any) -> bool:
    """Whether ``cls`` is a torch ``MultiProcContinuousTest`` (by its bases' names: no import)."""
    return isinstance(cls, type) and any(
        (c.__module__, c.__name__) == _TORCH_BASE for c in cls.__mro__
    )


def _no_spawn(cls: type, world_size: int) -> None:
    """torch's ``_spawn_processes`` less the processes: the rendezvous file (a
    NamedTemporaryFile, as torch makes it) and the environment its ranks would inherit."""
    cls.processes, cls.task_queues, cls.completion_queues = [], [], []
    with tempfile.NamedTemporaryFile(delete=False) as f:
        cls.rdvz_file = f.name
    cls._pytest_hsdp_environ = dict(os.environ)


def own_spawning(cls: type) -> str:
    """The class below MultiProcContinuousTest that spawns its ranks its own way, if any."""
    for c in cls.__mro__:
        if (c.__module__, c.__name__) == _TORCH_BASE:
            return ""
        spawn = c.__dict__.get("_spawn_processes")
        if spawn is not None and getattr(spawn, "__func__", None) is not _no_spawn:
            return c.__qualname__
    return ""


def take_over(cls: type) -> None:
    """The class's ranks are a pool's from now on (pytest's process only; once per class)."""
    if getattr(cls.__dict__.get("_spawn_processes"), "__func__", None) is not _no_spawn:
        cls._spawn_processes = classmethod(_no_spawn)


def new_rendezvous_file() -> str:
    """A session's rendezvous file, empty, as a FileStore must start."""
    with tempfile.NamedTemporaryFile(prefix="pytest-hsdp-rdvz-", delete=False) as f:
        return f.name


def task_of(cls: type, test_id: str, task_id: int, session: int, rdvz_file: str) -> dict:
    """The pool's task for one test of the class's session (``end``: the session's end)."""
    module = __import__(cls.__module__, fromlist=["_"])
    return {
        "id": task_id,
        "kind": "class",
        "session": session,
        "end": False,
        "module": cls.__module__,
        "path": os.path.abspath(module.__file__),
        "qualname": cls.__qualname__,
        "test_id": test_id,
        "rdvz_file": rdvz_file,
        "environ": getattr(cls, "_pytest_hsdp_environ", None) or dict(os.environ),
    }


def judge(world: int, values: dict[int, Any], failures: dict[int, str]) -> tuple[str, str]:
    """("passed" | "skipped" | "failed", text) as torch's wrapper reads its ranks' results:
    in rank order, the first that is not a success decides."""
    for r in range(world):
        if r in failures:
            return "failed", f"rank {r}:\n{failures[r].rstrip()}"
        skipped = (values.get(r) or {}).get("skipped")
        if skipped is not None:
            return "skipped", skipped
    return "passed", ""


class Session:
    """One rank's run of a class's ``_worker_loop`` (rank side; torch is imported by the
    loop). The loop's task queue (``get``) answers the previous test, then reads the pool's
    pipe: a test of this session is handed to the loop; anything else ends the session and is
    kept in ``pending`` for the rank's own loop (None: the pipe closed). ``after_test(task)``
    runs on the rank after each test's body, before its result is sent: a child the body forked
    that returned from it ends there."""

    def __init__(self, rank: int, conn, first: dict[str, Any], after_test):
        self.rank = rank
        self.conn = conn
        self.session = first["session"]
        self.current = first
        self.after_test = after_test
        self.result: Any = None
        self.answered = False
        self.first_given = False
        self.pending: tuple | None = None
        self.closed = False  # the pool's pipe closed: the rank ends
        self.end_failure: str | None = None  # why torch's loop failed at its end, if it did

    # torch's completion queue
    def put(self, item: Any) -> None:
        self.after_test(self.current)
        self.result = item

    # torch's task queue
    def get(self, *args: Any, **kwargs: Any) -> str | None:
        if not self.first_given:
            self.first_given = True
            return self.current["test_id"]
        self._answer()
        try:
            message = self.conn.recv()
        except (EOFError, OSError):
            self.closed = True
            return None
        task = message[1] if message[0] == "run" else None
        if task and task.get("session") == self.session and not task.get("end"):
            self.current, self.result, self.answered = task, None, False
            return task["test_id"]
        self.pending = message
        return None

    def _answer(self, failure: str | None = None) -> None:
        """Sends the current test's result as the pool's "done" message: what torch's loop
        put on its completion queue, read as torch's wrapper reads it."""
        if self.answered:
            return
        self.answered = True
        value: dict[str, Any] = {}
        if failure is None:
            if isinstance(self.result, unittest.SkipTest):
                value["skipped"] = str(self.result)
            elif isinstance(self.result, BaseException):
                failure = str(self.result)
            elif self.result != self.current["test_id"]:
                failure = f"the class's worker loop answered {self.result!r}"
        sys.stdout.flush()
        sys.stderr.flush()
        done = ("done", self.current["id"], self.rank, failure, pickle.dumps(value), None, True)
        self.conn.send(done)

    def serve(self, load_class, world: int) -> str | None:
        """Runs the class's loop until its session ends (the message that ended it in
        ``pending``); why the loop's own teardown failed, if it did."""
        import traceback

        try:
            cls = load_class(self.current)
        except BaseException:  # noqa: BLE001 - the module may raise anything
            self._answer(
                f"{self.current['qualname']} could not be loaded on this rank:\n"
                + traceback.format_exc()
            )
            return None
        try:
            cls._worker_loop(self.rank, world, self.current["rdvz_file"], self, self)
        except BaseException:  # noqa: BLE001 - _init_pg or the loop's teardown raised
            text = f"{cls.__qualname__}'s worker loop raised:\n{traceback.format_exc()}"
            if not self.answered:
                self._answer(text)
            else:
                return text
        finally:
            # The group is destroyed (or broken): torch's handle to it goes too, with its store,
            # whose last user removes the rendezvous file.
            if "pg" in cls.__dict__:
                cls.pg = None
        return None

    @property
    def ended_by_stop(self) -> bool:
        return self.closed or (self.pending is not None and self.pending[0] == "stop")
