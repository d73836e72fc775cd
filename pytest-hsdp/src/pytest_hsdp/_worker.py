"""One rank of a pool (pytest_hsdp._pool): initialises the default group once, then runs
test bodies as the parent sends them, until told to stop or the parent goes.

A rank writes its stdout and stderr (file descriptors 1 and 2, so C++ output too) to a log
file the parent reads back per test. On SIGUSR2 it writes every thread's Python stack there
(faulthandler), which is how a test that never returns is explained.
"""

from __future__ import annotations

import ast
import datetime
import faulthandler
import importlib
import os
import pickle
import signal
import sys
import threading
import time
import traceback
import types
from typing import Any

from pytest_hsdp import _continuous, _placement

RANK_SIDE = ("rank", "world_size", "group", "device", "mesh")


class Unavailable(RuntimeError):
    """The pool cannot run here (no CUDA for device='cuda'): its tests are skipped."""


FORKED_MARK = "pytest_hsdp: the test body forked and its child returned from it, pid"
# How long a rank waits, after its test body, for the children the body forked
# and did not wait for (a child that returns from the body leaves the mark in
# the log, then exits: the test is reported once that is in).
FORKED_CHILDREN_WAIT_S = 10.0


def forked_mark_of(text: str, task_id: int) -> bool:
    """Whether a rank's output says that task ``task_id``'s body forked and its child returned."""
    return any(
        line.startswith(FORKED_MARK) and line.endswith(f"task {task_id}")
        for line in text.splitlines()
    )


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"  # a zombie is gone
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def _watch_pytest(pytest_pid: int) -> None:
    # A rank whose pytest is gone (killed, crashed) must not live on. Its parent process may
    # be multiprocessing's fork server, not pytest, so pytest's own pid is watched.
    while True:
        if not _alive(pytest_pid):
            os._exit(3)
        time.sleep(0.5)


def _redirect_output(log_path: str) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)


def _load_module(name: str, path: str) -> types.ModuleType:
    """The test module, loaded as pytest loads it: asserts rewritten, so that a failing
    assert explains its operands on the rank too."""
    module = sys.modules.get(name)
    if module is not None and os.path.abspath(getattr(module, "__file__", "") or "") == path:
        return module
    package = name.rpartition(".")[0]
    if package:
        try:
            importlib.import_module(package)  # for the module's relative imports
        except ImportError:
            pass
    with open(path, "rb") as f:
        source = f.read()
    tree = ast.parse(source, filename=path)
    try:
        from _pytest.assertion.rewrite import rewrite_asserts

        rewrite_asserts(tree, source, path, None)
    except Exception:  # noqa: BLE001 - plain asserts still work
        pass
    module = types.ModuleType(name)
    module.__file__ = path
    module.__package__ = package
    sys.modules[name] = module
    try:
        exec(compile(tree, path, "exec", dont_inherit=True), module.__dict__)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _resolve_class(module: types.ModuleType, qualname: str) -> type:
    owner: Any = module
    for part in qualname.split("."):
        owner = getattr(owner, part)
    if not isinstance(owner, type):
        raise TypeError(f"{qualname} is not a class")
    return owner


class _SkipReasons:
    """Collects why torch's run_test skipped a test: it logs the SkipTest's reason
    (common_distributed's logger: "Process %s skipping test %s for following reason: %s")
    and exits with the generic code, whose message says only to look at the log."""

    LOGGER = "torch.testing._internal.common_distributed"

    def __init__(self):
        import logging

        class Handler(logging.Handler):
            def emit(handler, record):  # noqa: N805 - the handler, not this object
                if "skipping test" in str(record.msg) and record.args:
                    self.reasons.append(str(record.args[-1]))

        self.reasons: list[str] = []
        self._handler = Handler(level=logging.INFO)
        self._logger = logging.getLogger(self.LOGGER)

    def __enter__(self):
        self._logger.addHandler(self._handler)
        return self

    def __exit__(self, *exc):
        self._logger.removeHandler(self._handler)


def _exit_code(exc: SystemExit) -> int:
    """The process exit code ``sys.exit(code)`` would have given."""
    if exc.code is None:
        return 0
    return exc.code if isinstance(exc.code, int) else 1


def _run_case(rank: int, task: dict[str, Any]) -> dict[str, Any]:
    """One rank of a torch MultiProcessTestCase test, as torch's spawned rank runs it: the
    class's own ``_run`` (which builds the case, sets ``rank`` and ``file_name`` and calls
    ``run_test``), over a pipe of its own; the exit code it would have left with, the
    traceback it sent its parent, and the reason of a skip it logged."""
    import torch.multiprocessing as mp

    _restore_environ(task["environ"])  # the run's caller restores the pool's after it
    cls = _resolve_class(_load_module(task["module"], task["path"]), task["qualname"])
    ours, theirs = mp.Pipe()
    code = 0
    with _SkipReasons() as skips:
        try:
            cls._run(rank, task["method"], task["file_name"], theirs)
        except SystemExit as exc:
            code = _exit_code(exc)
    error = None
    try:
        if ours.poll(0):
            error = ours.recv()
    except (EOFError, OSError):
        pass
    ours.close()
    theirs.close()
    return {
        "code": code,
        "error": error,
        "skip_reason": skips.reasons[0] if skips.reasons else None,
    }


def _resolve(module: types.ModuleType, qualname: str) -> Any:
    owner: Any = module
    parts = qualname.split(".")
    for part in parts[:-1]:
        owner = getattr(owner, part)
    if isinstance(owner, type):
        owner = owner()  # a test class: pytest makes an instance per test too
    return getattr(owner, parts[-1])


class _Rank:
    def __init__(self, rank: int, world: int, spec: dict[str, Any]):
        self.rank = rank
        self.world = world
        self.spec = spec
        self.pid = os.getpid()
        self.meshes: dict[tuple, Any] = {}
        self.device = None
        self.placement_note = ""  # how the ranks share devices, for the test's report
        # Every process forked from this rank writes its pid here (at fork, in the child),
        # and the rank counts its forks (in the parent): after a test body, the rank waits
        # for as many pids as it forked (a child may not have run yet), then for the children.
        self._forks_r, self._forks_w = os.pipe()
        os.set_blocking(self._forks_r, False)
        os.set_blocking(self._forks_w, False)  # a full pipe must not block a forking child
        self._forks = 0
        os.register_at_fork(after_in_parent=self._note_fork, after_in_child=self._note_child)

    def _note_fork(self) -> None:
        if os.getpid() == self.pid:  # not a child's own forks: those are its to wait for
            self._forks += 1

    def _note_child(self) -> None:
        try:
            os.write(self._forks_w, os.getpid().to_bytes(4, "little"))
        except OSError:
            pass

    def _forked(self, deadline: float) -> list[int]:
        """The pids this rank forked since the last call, read until every fork it counted
        has written its pid or ``deadline`` (``time.monotonic()``) passes."""
        data = b""
        while True:
            try:
                chunk = os.read(self._forks_r, 4096)
            except BlockingIOError:
                if len(data) // 4 >= self._forks or time.monotonic() >= deadline:
                    break
                time.sleep(0.01)
                continue
            if not chunk:
                break
            data += chunk
        self._forks = 0
        return [int.from_bytes(data[i : i + 4], "little") for i in range(0, len(data) - 3, 4)]

    def _wait_for_children(self) -> None:
        deadline = time.monotonic() + FORKED_CHILDREN_WAIT_S
        for pid in self._forked(deadline):
            while time.monotonic() < deadline:
                try:
                    done, _ = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    break  # reaped by the body already, or not this rank's child
                if done:
                    break
                time.sleep(0.01)

    def _rendezvous(self, conn, deadline_s: float):
        """The default group's store: rank 0 binds port 0 (no port is chosen free and bound
        later, when another process may have taken it) and tells the parent, which tells the
        other ranks; they connect to it."""
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=self.spec["group_timeout_s"])
        if self.rank == 0:
            store = dist.TCPStore(
                "127.0.0.1", 0, self.world, is_master=True, timeout=timeout,
                wait_for_workers=False,
            )  # fmt: skip
            conn.send(("port", store.port))
            return store, store.port
        if not conn.poll(deadline_s):
            raise TimeoutError(
                f"rank {self.rank} was not told rank 0's store port within {deadline_s:g} s"
            )
        message = conn.recv()
        if message[0] != "port":
            raise RuntimeError(f"rank {self.rank} expected rank 0's store port, got {message!r}")
        port = message[1]
        store = dist.TCPStore("127.0.0.1", port, self.world, is_master=False, timeout=timeout)
        return store, port

    def init_group(self, conn, deadline_s: float) -> None:
        import torch
        import torch.distributed as dist

        if self.spec["backend"] is None:
            # No default group: each test makes its own (torch's test cases). hsdp is
            # registered where installed, for the tests that name it.
            try:
                import hsdp_backend  # noqa: F401
            except ImportError:
                pass
            return
        if self.spec["backend"] == "hsdp":
            import hsdp_backend  # noqa: F401  registers "hsdp"
        self.meshes.clear()
        store, port = self._rendezvous(conn, deadline_s)
        # torchrun's variables, for code that reads them (MASTER_PORT: this group's store).
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world),
            LOCAL_RANK=str(self.rank),
            LOCAL_WORLD_SIZE=str(self.world),
        )
        # The device first: NCCL binds a group to the current device when it is made.
        if self.spec["device"] == "cuda":
            self.device = self._place_on_cuda(torch)
        else:
            self.device = torch.device("cpu")
        dist.init_process_group(
            self.spec["backend"],
            store=store,
            rank=self.rank,
            world_size=self.world,
            timeout=datetime.timedelta(seconds=self.spec["group_timeout_s"]),
        )

    def _place_on_cuda(self, torch: Any) -> Any:
        """This rank's CUDA device (``_placement``), its NCCL host identity in the environment
        where ranks share the device; ``Unavailable`` without CUDA."""
        if not torch.cuda.is_available():
            raise Unavailable("device='cuda': this machine has no CUDA device torch can use")
        count = torch.cuda.device_count()
        placement = _placement.place(self.rank, self.world, count, os.environ)
        total = torch.cuda.get_device_properties(placement.device).total_memory
        _placement.check_memory(placement, total, self.spec["gpu_memory_gib"])
        os.environ.update(placement.env)
        torch.cuda.set_device(placement.device)
        self.placement_note = placement.describe(self.world, count)
        return torch.device("cuda", placement.device)

    def _groups(self) -> set:
        # The groups c10d knows on this rank: its one registry (_world), read here only.
        import torch.distributed as dist

        try:
            return set(dist.distributed_c10d._world.pg_map)
        except AttributeError:
            return set()

    def _mesh(self, shape: tuple, names: tuple | None) -> Any:
        key = (shape, names)
        if key not in self.meshes:
            from torch.distributed.device_mesh import init_device_mesh

            self.meshes[key] = init_device_mesh(self.device.type, shape, mesh_dim_names=names)
        return self.meshes[key]

    def run(self, task: dict[str, Any]) -> tuple[str | None, bytes, int | None, bool]:
        import torch.distributed as dist

        failure = None
        value = pickle.dumps(None)
        before = self._groups() if dist.is_initialized() else set()
        environ = dict(os.environ)
        self._forked(time.monotonic())  # forks before this test's body are not its own
        try:
            if task.get("kind") == "case":
                fn, kwargs = (lambda: _run_case(self.rank, task)), {}
            else:
                fn = _resolve(_load_module(task["module"], task["path"]), task["qualname"])
                kwargs = pickle.loads(task["kwargs"])
                for name in task["rank_side"]:
                    kwargs[name] = self._rank_side(name, task)
        except BaseException as exc:  # noqa: BLE001
            failure = "the test body could not be set up on this rank:\n" + _format(exc, 0)
        else:
            try:
                returned = fn(**kwargs)
            except SystemExit as exc:
                failure = f"the test body called sys.exit({exc.code!r})\n" + _format(exc, 1)
            except BaseException as exc:  # noqa: BLE001 - every failure goes to the parent
                failure = _format(exc, 1)
            else:
                try:
                    value = pickle.dumps(returned)
                except Exception as exc:  # noqa: BLE001 - pickling raises many kinds
                    failure = f"the body's return value cannot be sent back: {exc!r}"
        if os.getpid() != self.pid:
            # The body forked and its child came back here: it must not act as the rank.
            # The parent finds this line in the rank's log and fails the test.
            os.write(2, f"\n{FORKED_MARK} {os.getpid()}, task {task['id']}\n".encode())
            os._exit(70)
        self._wait_for_children()
        _restore_environ(environ)
        if self.spec["backend"] is None:
            # A pool without a default group (torch's test cases make their own): whatever
            # the test left initialised goes, as its process would have.
            if dist.is_initialized():
                try:
                    dist.destroy_process_group()
                except Exception:  # noqa: BLE001 - a group the test broke is gone either way
                    pass
            _forget_meshes()
            return failure, value, None, True
        group_ok = dist.is_initialized()
        if group_ok:
            meshes = {g for mesh in self.meshes.values() for g in _mesh_groups(mesh)}
            keep = before | {dist.group.WORLD} | meshes
            for pg in self._groups() - keep:
                try:
                    dist.destroy_process_group(pg)
                except Exception:  # noqa: BLE001 - a group the test broke is gone either way
                    pass
        # After every test: one that made and destroyed its own groups leaves no trace in
        # the group registry, but DTensor's caches still hold their meshes.
        _forget_meshes()
        return failure, value, self._sequence_number() if group_ok else None, group_ok

    def serve_class(self, conn, task: dict[str, Any]) -> _continuous.Session:
        """A torch MultiProcContinuousTest class's session (``_continuous``), in the
        environment its spawned ranks would have inherited; what a test left behind goes with
        the session, as it would with torch's processes."""
        import torch.distributed as dist

        environ = dict(os.environ)
        _restore_environ(task["environ"])
        self._forked(time.monotonic())  # forks before the session are not its tests'
        session = _continuous.Session(self.rank, conn, task, self._after_class_test)
        try:
            session.end_failure = session.serve(
                lambda t: _resolve_class(_load_module(t["module"], t["path"]), t["qualname"]),
                self.world,
            )
        finally:
            _restore_environ(environ)
            # A test raised, so torch's loop kept the group (its destroy could wait for ranks
            # still in a collective): destroyed here unless the pool is stopping anyway.
            if dist.is_initialized() and not session.ended_by_stop:
                try:
                    dist.destroy_process_group()
                except Exception:  # noqa: BLE001 - a group the test broke is gone either way
                    pass
            _forget_meshes()
        return session

    def _after_class_test(self, task: dict[str, Any]) -> None:
        if os.getpid() != self.pid:
            # A child the test body forked came back into torch's loop: it must not answer.
            os.write(2, f"\n{FORKED_MARK} {os.getpid()}, task {task['id']}\n".encode())
            os._exit(70)
        self._wait_for_children()

    def _rank_side(self, name: str, task: dict[str, Any]) -> Any:
        import torch.distributed as dist

        if name == "rank":
            return self.rank
        if name == "world_size":
            return self.world
        if name == "group":
            return dist.group.WORLD
        if name == "device":
            return self.device
        mesh = task["mesh"]
        if mesh is None:
            raise RuntimeError(
                "the mesh fixture needs a mesh shape: @pytest.mark.world_size(N, mesh=(A, B))"
            )
        return self._mesh(tuple(mesh[0]), tuple(mesh[1]) if mesh[1] else None)

    def _sequence_number(self) -> int | None:
        import torch.distributed as dist

        try:
            return int(dist.group.WORLD._get_sequence_number_for_group())
        except Exception:  # noqa: BLE001 - a backend without one: not compared
            return None


def _restore_environ(environ: dict[str, str]) -> None:
    """Undoes the variables a test set or removed (only those: threads it left may be reading
    the others), so the next test on this rank sees the pool's environment."""
    for key in [k for k in os.environ if k not in environ]:
        del os.environ[key]
    for key, value in environ.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


def _forget_meshes() -> None:
    """Empties DTensor's caches, which hold DeviceMeshes: a mesh compares equal to another of
    the same shape and ranks whatever its groups, so the next test's mesh would find the
    destroyed groups of this one's there ("Could not resolve the process group"). The caches
    differ by torch release; the ones a release lacks are skipped."""
    tensor = sys.modules.get("torch.distributed.tensor")
    if tensor is None:
        return
    dispatcher = getattr(getattr(tensor, "DTensor", None), "_op_dispatcher", None)
    propagator = getattr(dispatcher, "sharding_propagator", None)
    redistribute = sys.modules.get("torch.distributed.tensor._redistribute")
    collectives = sys.modules.get("torch.distributed.tensor._collective_utils")
    caches = [
        getattr(propagator, "propagate_op_sharding", None),
        getattr(propagator, "_propagate_tensor_meta_cached", None),
        getattr(redistribute, "_gen_transform_infos", None),
        getattr(getattr(collectives, "MeshTopoInfo", None), "build_from_mesh", None),
    ]
    for cache in caches:
        clear = getattr(cache, "cache_clear", None)
        if clear is not None:
            clear()
    # The C++ dispatch fast path's own cache (torch.distributed.tensor.debug clears it so).
    clear_fast_path = getattr(
        sys.modules["torch"]._C, "_clear_DTensor_sharding_propagator_cache", None
    )
    if clear_fast_path is not None:
        clear_fast_path()


def _format(exc: BaseException, skip: int) -> str:
    """The traceback without its first ``skip`` frames (this module's call of the body)."""
    tb = exc.__traceback__
    for _ in range(skip):
        tb = tb.tb_next if tb is not None and tb.tb_next is not None else tb
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _mesh_groups(mesh: Any) -> list:
    try:
        return [mesh.get_group(d) for d in range(mesh.ndim)]
    except Exception:  # noqa: BLE001
        return []


def main(rank: int, world: int, spec: dict[str, Any], conn, pytest_pid: int) -> None:
    """The rank's loop. Messages in: ("run", task), ("reinit",), ("stop",), and before each
    default group, on ranks but 0, ("port", rank 0's store port). Out: ("port", port) from
    rank 0 before each default group, ("ready", rank, pid, placement) once it is up, ("failed", rank, traceback) if it
    could not be, ("done", task id, rank, failure text or None, the body's pickled return
    value, the default group's sequence number or None, whether the default group is still
    there) per test. ``spec["setup"]``: (module, path, name) of a function each rank calls
    once before its first default group, or None."""
    threading.Thread(target=_watch_pytest, args=(pytest_pid,), daemon=True).start()
    _redirect_output(spec["logs"][rank])
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR2, all_threads=True, chain=False)
    os.environ.update(spec["env"])
    os.environ["HSDP_TRACE_DIR"] = spec["trace_dir"]
    me = _Rank(rank, world, spec)
    try:
        import torch

        torch.set_num_threads(1)
        if spec.get("setup"):
            module, path, name = spec["setup"]
            _resolve(_load_module(module, path), name)()
        me.init_group(conn, spec["start_timeout_s"])
        conn.send(("ready", rank, os.getpid(), me.placement_note))
    except (Unavailable, _placement.PlacementError) as exc:
        conn.send(("unavailable" if isinstance(exc, Unavailable) else "failed", rank, str(exc)))
        return
    except BaseException:  # noqa: BLE001
        conn.send(("failed", rank, traceback.format_exc()))
        return
    try:
        _serve(me, conn)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _serve(me: _Rank, conn) -> None:
    carried = None  # the message a class's session ended on, still to be handled
    while True:
        if carried is not None:
            message, carried = carried, None
        else:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                return
        if message[0] == "stop":
            return
        if message[0] == "reinit":
            try:
                import torch.distributed as dist

                if dist.is_initialized():
                    dist.destroy_process_group()
                me.init_group(conn, me.spec["start_timeout_s"])
                conn.send(("ready", me.rank, os.getpid(), me.placement_note))
            except BaseException:  # noqa: BLE001
                conn.send(("failed", me.rank, traceback.format_exc()))
                return
            continue
        task = message[1]
        if task.get("kind") == "class" and not task.get("end"):
            session = me.serve_class(conn, task)
            if session.closed:
                return
            carried = session.pending
            ended = carried is not None and carried[0] == "run" and carried[1].get("end")
            if ended and carried[1].get("session") == task["session"]:
                _answer(conn, me.rank, carried[1], session.end_failure)
                carried = None
            elif session.end_failure:
                print(f"pytest_hsdp: {session.end_failure}", flush=True)
            continue
        if task.get("kind") == "class":  # the end of a session this rank does not hold
            _answer(conn, me.rank, task, None)
            continue
        failure, value, seq, group_ok = me.run(task)
        sys.stdout.flush()
        sys.stderr.flush()
        conn.send(("done", task["id"], me.rank, failure, value, seq, group_ok))


def _answer(conn, rank: int, task: dict[str, Any], failure: str | None) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    conn.send(("done", task["id"], rank, failure, pickle.dumps(None), None, True))
