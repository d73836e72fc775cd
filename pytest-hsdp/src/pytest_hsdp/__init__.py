"""pytest_hsdp: multi-process tests with pytest, its own pure-Python distribution.

A test marked ``@pytest.mark.world_size(N)`` runs its body on N ranks, each a process of a
warm pool that already has its default group (``hsdp`` where hsdp_backend is installed, else
gloo on CPU and nccl on CUDA, unless the marker or ``--hsdp-backend`` says otherwise); it
passes when every rank passes, and a failure shows each failing rank's traceback under its
rank. See docs/testing-your-code.md.

Registered through pytest's ``pytest11`` entry point. It imports neither torch nor
hsdp_backend in pytest's own process (importing hsdp_backend imports torch), so a test
session that uses no marked test pays nothing for it.
"""

from __future__ import annotations

import atexit
import importlib.util
import inspect
import itertools
import os
import pickle
from typing import Any

import pytest

from pytest_hsdp import _cases, _continuous, _placement, _pool, _worker

_MARKER = "world_size"
_DEFAULT_TIMEOUT_S = 120.0


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("hsdp", "multi-process tests (pytest_hsdp)")
    group.addoption(
        "--hsdp-backend",
        default=None,
        help="backend of the ranks' default group where the marker names none (default: hsdp "
        "where hsdp_backend is installed, else gloo on CPU and nccl on CUDA)",
    )
    group.addoption(
        "--hsdp-timeout",
        type=float,
        default=_DEFAULT_TIMEOUT_S,
        help="deadline of a test on its ranks in seconds where the marker gives none "
        f"(default: {_DEFAULT_TIMEOUT_S:g})",
    )
    group.addoption(
        "--hsdp-start-timeout",
        type=float,
        default=300.0,
        help="deadline for a pool's ranks to start and create their default group (default: 300)",
    )
    group.addoption(
        "--hsdp-torch-cases",
        choices=("on", "off"),
        default=None,
        help="run test methods of torch's MultiProcessTestCase classes (DTensorTestBase, "
        "FSDPTest, ...) and MultiProcContinuousTest classes on warm ranks instead of spawning "
        "ranks per test or per class (default: on; ini: hsdp_torch_cases)",
    )
    parser.addini(
        "hsdp_torch_cases",
        "on/off: torch's MultiProcessTestCase and MultiProcContinuousTest tests on warm ranks "
        "(pytest_hsdp)",
        default="on",
    )
    group.addoption(
        "--hsdp-max-pools",
        type=int,
        default=2,
        help="pools kept warm at once; the least recently used is stopped (default: 2)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{_MARKER}(n, *, backend=None, device='cpu', timeout=None, env=None, mesh=None, "
        "mesh_dim_names=None, gpu_memory_gib=1.0): run the test body on n ranks of a warm "
        "pool (pytest_hsdp); with device='cuda', rank r on cuda:(r % devices), ranks that "
        "share a device each with its own NCCL_HOSTID",
    )
    config.stash[_POOLS] = _Pools(config)


def pytest_unconfigure(config: pytest.Config) -> None:
    pools = config.stash.get(_POOLS, None)
    if pools is not None:
        pools.close()


class _RankSide:
    """A fixture's value in pytest's process; the rank puts its own in its place."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}: given on each rank>"


def _rank_side_fixture(name: str, doc: str):
    def fixture(request: pytest.FixtureRequest) -> _RankSide:
        if request.node.get_closest_marker(_MARKER) is None:
            pytest.fail(
                f"the {name!r} fixture is given to tests marked @pytest.mark.{_MARKER}(N) only",
                pytrace=False,
            )
        return _RankSide(name)

    fixture.__doc__ = doc
    fixture.__name__ = name
    return pytest.fixture(name=name)(fixture)


rank = _rank_side_fixture("rank", "This rank's number in the default group (0 .. N-1).")
world_size = _rank_side_fixture("world_size", "The number of ranks, N.")
group = _rank_side_fixture("group", "The default process group (dist.group.WORLD).")
device = _rank_side_fixture(
    "device", "This rank's device: cpu, or cuda:<rank % devices> with device='cuda'."
)
mesh = _rank_side_fixture(
    "mesh", "A DeviceMesh of the marker's mesh=(...) shape over the ranks, made once per pool."
)


class _Pools:
    """The session's warm pools (``--hsdp-max-pools`` kept) and its task ids."""

    def __init__(self, config: pytest.Config):
        self._config = config
        self._pools = _pool.Pools(config.getoption("--hsdp-max-pools"))
        self._ids = itertools.count(1)
        atexit.register(self.close)  # also when pytest is interrupted before unconfigure

    def torch_cases(self) -> bool:
        option = self._config.getoption("--hsdp-torch-cases")
        return (option or self._config.getini("hsdp_torch_cases")) == "on"

    def get(self, key: tuple) -> _pool.Pool:
        world, backend, device, env, gpu_memory_gib = key
        return self._pools.get(
            key,
            lambda: _pool.Pool(
                world,
                backend,
                device,
                dict(env),
                start_timeout_s=self._config.getoption("--hsdp-start-timeout"),
                group_timeout_s=max(60.0, self._config.getoption("--hsdp-timeout")),
                gpu_memory_gib=gpu_memory_gib,
            ),
        )

    def next_id(self) -> int:
        return next(self._ids)

    def close(self) -> None:
        self._pools.close()


_POOLS = pytest.StashKey[_Pools]()


def _refuse(message: str) -> None:
    """Fails the test (not the session) for a misuse of the marker or the fixtures."""
    pytest.fail(message, pytrace=False)


def _marker_arguments(item: pytest.Item) -> dict[str, Any]:
    marker = item.get_closest_marker(_MARKER)
    if len(marker.args) != 1 or not isinstance(marker.args[0], int) or marker.args[0] < 1:
        _refuse(
            f"{item.nodeid}: @pytest.mark.{_MARKER} takes the number of ranks, an int of at "
            f"least 1; got {marker.args!r}"
        )
    known = {"backend", "device", "timeout", "env", "mesh", "mesh_dim_names", "gpu_memory_gib"}
    unknown = set(marker.kwargs) - known
    if unknown:
        _refuse(
            f"{item.nodeid}: @pytest.mark.{_MARKER} has no argument {sorted(unknown)}; "
            f"it takes {sorted(known)}"
        )
    args = dict(marker.kwargs)
    args["world"] = marker.args[0]
    if args.get("device", "cpu") not in ("cpu", "cuda"):
        _refuse(f"{item.nodeid}: device must be 'cpu' or 'cuda', got {args['device']!r}")
    memory = args.get("gpu_memory_gib", _placement.DEFAULT_GPU_MEMORY_GIB)
    if not isinstance(memory, (int, float)) or memory <= 0:
        _refuse(f"{item.nodeid}: gpu_memory_gib must be a positive number, got {memory!r}")
    args["gpu_memory_gib"] = float(memory)
    return args


def _where(item: pytest.Function) -> tuple[str, str, str]:
    """(module name, file, qualified name) by which a fresh interpreter finds the body."""
    fn = item.obj
    qualname = getattr(fn, "__qualname__", "")
    if "<locals>" in qualname or "<lambda>" in qualname:
        _refuse(
            f"{item.nodeid}: the test body {qualname} is defined inside a function; a rank "
            "finds it by name in a fresh interpreter, so it must be defined at module level "
            "(or in a class at module level)"
        )
    module = item.module
    return module.__name__, str(module.__file__), qualname


def _default_backend(device: str) -> str:
    """hsdp where hsdp_backend is installed (found, not imported: that would import torch),
    else torch's own backend for the device."""
    if importlib.util.find_spec("hsdp_backend") is not None:
        return "hsdp"
    return "nccl" if device == "cuda" else "gloo"


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    if pyfuncitem.get_closest_marker(_MARKER) is None:
        return None
    if inspect.iscoroutinefunction(pyfuncitem.obj):
        _refuse(f"{pyfuncitem.nodeid}: async test bodies are not supported")
    config = pyfuncitem.config
    args = _marker_arguments(pyfuncitem)
    module, path, qualname = _where(pyfuncitem)
    names = pyfuncitem._fixtureinfo.argnames
    rank_side = [n for n in names if n in _worker.RANK_SIDE]
    sent = {}
    for name in names:
        if name in rank_side:
            continue
        value = pyfuncitem.funcargs[name]
        try:
            pickle.dumps(value)
        except Exception as exc:  # noqa: BLE001 - pickling raises many kinds
            pytest.fail(
                f"argument {name!r} (a fixture or parametrize value, {type(value).__name__}) "
                f"cannot be sent to the ranks: {type(exc).__name__}: {exc}",
                pytrace=False,
            )
        sent[name] = value
    if "mesh" in rank_side and args.get("mesh") is None:
        _refuse(
            f"{pyfuncitem.nodeid}: the mesh fixture needs @pytest.mark.{_MARKER}(N, mesh=(...))"
        )
    device = args.get("device", "cpu")
    backend = args.get("backend") or config.getoption("--hsdp-backend") or _default_backend(device)
    env = tuple(sorted((str(k), str(v)) for k, v in (args.get("env") or {}).items()))
    pools = config.stash[_POOLS]
    key = (args["world"], backend, device, env, args["gpu_memory_gib"])
    try:
        pool = pools.get(key)
    except _pool.PoolUnavailable as exc:
        pytest.skip(str(exc))
    except _pool.PoolError as exc:
        pytest.fail(str(exc), pytrace=False)
    if pool.placement:
        pyfuncitem.add_report_section("call", "placement", pool.placement)
    timeout_s = float(args.get("timeout") or config.getoption("--hsdp-timeout"))
    mesh_spec = None
    if args.get("mesh") is not None:
        mesh_spec = (tuple(args["mesh"]), tuple(args.get("mesh_dim_names") or ()))
    task = {
        "id": pools.next_id(),
        "module": module,
        "path": path,
        "qualname": qualname,
        "kwargs": pickle.dumps(sent),
        "rank_side": rank_side,
        "mesh": mesh_spec,
    }
    outcome = pool.run(task, timeout_s)
    for r, text in sorted(outcome.output.items()):
        if text.strip():
            pyfuncitem.add_report_section("call", f"rank {r} output", text)
    if not outcome.passed:
        pytest.fail(outcome.report(pool.world, backend), pytrace=False)
    return True


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    pools = config.stash.get(_POOLS, None)
    if pools is None or not pools.torch_cases():
        return
    for item in items:
        cls = getattr(item, "cls", None)
        if not hasattr(item, "instance"):
            continue
        # This item alone runs its test on a pool (an instance attribute hides the method).
        if _cases.is_torch_case(cls):
            item.runtest = lambda item=item: _run_torch_case(item)  # type: ignore[method-assign]
        elif _continuous.is_continuous_class(cls):
            if _continuous.own_spawning(cls):
                item.runtest = lambda item=item: _run_on_torchs_harness(item)  # type: ignore[method-assign]
                continue
            _continuous.take_over(cls)
            item.runtest = lambda item=item: _run_continuous_test(item)  # type: ignore[method-assign]


_FELL_BACK = pytest.StashKey[set]()


def _say(config: pytest.Config, line: str) -> None:
    """One line on the terminal, outside the running test's captured output."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    if reporter is None:
        return
    if capture is None:
        reporter.write_line(f"pytest_hsdp: {line}")
        return
    with capture.global_and_fixture_disabled():
        reporter.ensure_newline()
        reporter.write_line(f"pytest_hsdp: {line}")


def _run_torch_case(item: pytest.Item) -> None:
    """A torch MultiProcessTestCase test on a warm pool of its world size (pytest_hsdp._cases);
    torch's own spawning where the pool cannot serve it."""
    case = item.instance
    _skip_if_marked(item)
    try:
        _cases.prepare(case)
    except _cases.Fallback as why:
        _say_fallback(item, str(why))
        _cases.clean_up(case)
        try:
            type(item).runtest(item)
        finally:
            _cases.remove_store_file(case)  # torch's tearDown leaves it
        return
    try:
        outcome, text = _run_case_on_pool(item, case)
    finally:
        _cases.clean_up(case)
    _conclude(item, outcome, text)


def _say_fallback(item: pytest.Item, why: str) -> None:
    """Says once per class why its tests run on torch's own spawning."""
    fell_back = item.config.stash.setdefault(_FELL_BACK, set())
    if item.cls not in fell_back:
        fell_back.add(item.cls)
        _say(item.config, f"{item.cls.__qualname__}: torch's own spawning, as {why}")


def _run_on_torchs_harness(item: pytest.Item) -> None:
    """A MultiProcContinuousTest class that spawns its ranks its own way keeps torch's harness."""
    owner = _continuous.own_spawning(item.cls)
    _say_fallback(item, f"{owner} spawns its ranks its own way (its _spawn_processes)")
    type(item).runtest(item)


def _skip_if_marked(item: pytest.Item) -> None:
    """unittest's skip decorators, on the method or its class."""
    for target in (item.obj, item.cls):
        if getattr(target, "__unittest_skip__", False):
            pytest.skip(getattr(target, "__unittest_skip_why__", ""))


def _conclude(item: pytest.Item, outcome: str, text: str) -> None:
    """A unittest-style test's outcome as pytest's, ``expectedFailure`` included."""
    expecting_failure = getattr(item.obj, "__unittest_expecting_failure__", False)
    if outcome == "skipped":
        pytest.skip(text)
    if expecting_failure:
        if outcome == "failed":
            pytest.xfail(text.splitlines()[0])
        pytest.fail("unexpected success (the test is marked expectedFailure)", pytrace=False)
    if outcome == "failed":
        pytest.fail(text, pytrace=False)


def _case_pool(item: pytest.Item, case: Any) -> tuple[_Pools, _pool.Pool, int]:
    """The warm pool, without a default group, of a torch test case's world size."""
    world = _cases.world_size_of(case, item.nodeid)
    pools = item.config.stash[_POOLS]
    try:
        return pools, pools.get((world, None, "cpu", (), _placement.DEFAULT_GPU_MEMORY_GIB)), world
    except _pool.PoolError as exc:
        pytest.fail(str(exc), pytrace=False)


def _run_on(item: pytest.Item, case: Any, pool: _pool.Pool, task: dict) -> _pool.Outcome:
    """``task`` on ``pool`` by torch's deadline for the test; each rank's output reported."""
    timeout_s = _cases.timeout_of(case, item.config.getoption("--hsdp-timeout"))
    outcome = pool.run(task, timeout_s)
    for r, text in sorted(outcome.output.items()):
        if text.strip():
            item.add_report_section("call", f"rank {r} output", text)
    return outcome


def _run_case_on_pool(item: pytest.Item, case: Any) -> tuple[str, str]:
    pools, pool, world = _case_pool(item, case)
    outcome = _run_on(item, case, pool, _cases.task_of(case, item.name, pools.next_id()))
    if outcome.hung or set(outcome.failures) - outcome.died:
        return "failed", outcome.report(world, "the test's own")
    # A rank that died left an exit code, which torch's parent reads as any other.
    values = dict(outcome.values)
    for r, code in outcome.exit_codes.items():
        values[r] = {"code": code, "error": None, "skip_reason": None}
    return _cases.judge(values, world, outcome.report(world, "the test's own"))


_SESSIONS = pytest.StashKey[dict]()


def _run_continuous_test(item: pytest.Item) -> None:
    """A test of a torch MultiProcContinuousTest class on a warm pool of its world size
    (pytest_hsdp._continuous): torch's setUp without spawning (which skips a poisoned
    class's tests), the test on the class's session, torch's tearDown."""
    import unittest

    case = item.instance
    _skip_if_marked(item)
    try:
        case.setUp()
    except unittest.SkipTest as exc:
        case.doCleanups()
        pytest.skip(str(exc))
    except BaseException:
        case.doCleanups()  # as unittest does after a setUp that raised
        raise
    try:
        outcome, text = _run_class_test_on_pool(item, case)
    finally:
        case.tearDown()
        case.doCleanups()
    _conclude(item, outcome, text)


def _run_class_test_on_pool(item: pytest.Item, case: Any) -> tuple[str, str]:
    config, cls = item.config, type(case)
    pools, pool, world = _case_pool(item, case)
    sessions = config.stash.setdefault(_SESSIONS, {})
    state = sessions.get(cls)
    if state is None or state["pool"] is not pool or pool.session != state["id"]:
        # The class's group is made anew: its first test, or the pool ran something else.
        state = {"pool": pool, "id": pools.next_id(), "rdvz": _continuous.new_rendezvous_file()}
        sessions[cls] = state
        item.parent.addfinalizer(lambda: _end_session(config, cls, state))
    task = _continuous.task_of(cls, case.id(), pools.next_id(), state["id"], state["rdvz"])
    outcome = _run_on(item, case, pool, task)
    result, text = _continuous.judge(world, outcome.values, outcome.failures)
    if result == "failed":
        # As torch's wrapper: the class's later tests are skipped. Its ranks kept the group
        # of a rank that raised, so the pool goes too.
        cls.poison_pill = True
        pool.close()
        text = outcome.report(world, "the class's own")
    return result, text


def _end_session(config: pytest.Config, cls: type, state: dict) -> None:
    """The class's last test ran (pytest ends the class): its ranks end torch's loop, which
    destroys the class's group, as torch's tearDownClass makes its ranks do."""
    sessions = config.stash.get(_SESSIONS, {})
    if sessions.get(cls) is state:
        del sessions[cls]
    pool = state["pool"]
    try:
        if not pool.broken and pool.session == state["id"]:
            task = _continuous.task_of(cls, "", config.stash[_POOLS].next_id(), state["id"], "")
            task["end"] = True
            outcome = pool.run(task, config.getoption("--hsdp-timeout"))
            if not outcome.passed:
                pool.close()
                pytest.fail(
                    f"{cls.__qualname__}: its ranks could not end the class's group\n"
                    + outcome.report(pool.world, "the class's own"),
                    pytrace=False,
                )
    finally:
        try:
            os.unlink(state["rdvz"])  # unless its store's last user removed it
        except OSError:
            pass
