"""The tests' side of the rank launchers: their timeouts from the tests'
settings (tools/settings.py), and warm ranks shared by every test.

run_ranks and CaseLauncher run on pytest_hsdp's warm pools
(pytest-hsdp/src/pytest_hsdp/_pool.py), the plugin users get: one pool per (world,
backend, environment), the last few kept for the session, each test with a
wall-clock deadline after which the pool is killed, so a hang costs seconds.
A launch that must start from fresh processes (a rank meant to die, no
default group, a test that looks at what a process holds once its group is
gone) runs on tools/ranks.py's launcher instead.
"""

from __future__ import annotations

import itertools
import os
import pathlib
import pickle
import sys
import traceback
from typing import Any, Callable

import hooks

from tools import settings
from tools.ranks import RankFailure, free_port
from tools.ranks import run_ranks as _run_ranks

ROOT = pathlib.Path(__file__).resolve().parents[1]

__all__ = ["RankFailure", "free_port", "run_ranks", "run_cases", "CaseLauncher", "close_pools"]

# Per-collective timeout inside the ranks; a lost peer surfaces this fast.
COLLECTIVE_TIMEOUT_S = settings.read("HSDP_TEST_COLLECTIVE_TIMEOUT_S")
# Wall-clock limit for one launch (all ranks, all cases).
LAUNCH_TIMEOUT_S = settings.read("HSDP_TEST_LAUNCH_TIMEOUT_S")


# Warm pools kept at once: one per (world, backend, environment) seen lately.
KEPT_POOLS = 6
_pools = None


def every_torch(fn):
    """Marks a case body to run on every supported torch release too (the
    `every_torch` marker: scripts/test.sh's compat stages), through case_params."""
    fn.every_torch = True
    return fn


def case_params(cases: dict[str, Callable]) -> list:
    """A case module's CASES as pytest parameters, each carrying its body's markers."""
    import pytest

    return [
        pytest.param(name, id=name, marks=[pytest.mark.every_torch] * hasattr(fn, "every_torch"))
        for name, fn in cases.items()
    ]


def _pool_for(world: int, backend: str, env: dict[str, str], device: str = "cpu"):
    """The session's warm pool of ``world`` ranks on ``backend`` with ``env``, each rank's
    current device placed by pytest_hsdp where ``device`` is "cuda"."""
    global _pools
    from pytest_hsdp import _pool

    if _pools is None:
        _pools = _pool.Pools(KEPT_POOLS)
    timeout = settings.read("HSDP_TEST_COLLECTIVE_TIMEOUT_S", {**os.environ, **env})
    return _pools.get(
        (world, backend, tuple(sorted(env.items())), device),
        lambda: _pool.Pool(
            world,
            backend,
            device,
            env,
            start_timeout_s=LAUNCH_TIMEOUT_S,
            group_timeout_s=timeout,
            setup=("hooks", hooks.__file__, "install"),
            # hsdp's settings are read when a group is made, not when torch is imported.
            env_at_import=False,
        ),
    )


def close_pools() -> None:
    """Stops every warm pool (the session's end)."""
    if _pools is not None:
        _pools.close()


def _run_on_pool(
    fn, world: int, backend: str, env, timeout_s: float, kwargs: dict, device: str = "cpu"
):
    """``fn(rank, world, **kwargs)`` on every rank of a warm pool: their return values and
    the pool, or raises RankFailure."""
    from pytest_hsdp import _pool

    try:
        pool = _pool_for(world, backend, dict(env or {}), device)
    except _pool.PoolError as exc:
        raise RankFailure(str(exc)) from None
    body = (fn.__module__, sys.modules[fn.__module__].__file__, fn.__qualname__)
    task = {
        "id": next(_task_ids),
        "module": __name__,
        "path": __file__,
        "qualname": _call.__name__,
        "kwargs": pickle.dumps({"fn": body, "kwargs": kwargs}),
        "rank_side": ["rank", "world_size"],
        "mesh": None,
    }
    outcome = pool.run(task, timeout_s)
    if not outcome.passed:
        raise RankFailure(outcome.report(world, backend, output_chars=6000))
    return [outcome.values[r] for r in range(world)], pool


_task_ids = itertools.count(1)


def run_ranks(
    fn: Callable[..., Any],
    world: int,
    backend: str | None = "hsdp",
    env: dict[str, str] | None = None,
    timeout_s: float = LAUNCH_TIMEOUT_S,
    may_die: tuple[int, ...] = (),
    fresh: bool = False,
    device: str = "cpu",
    **kwargs,
) -> list[Any]:
    """Runs ``fn(rank, world, **kwargs)`` on ``world`` ranks.

    ``fn`` must be importable by name (defined at module level). Returns the
    per-rank return values (None for a rank in ``may_die`` that died, as a
    fault test's victim does), or raises RankFailure with every failing
    rank's traceback (and the ranks that had to be killed).
    HSDP_TEST_COLLECTIVE_TIMEOUT_S in ``env`` overrides the parent's. Each
    rank installs the tests' hooks (hooks.py) from its environment.

    The ranks are a warm pool with the default group on ``backend``, unless
    ``fresh`` or ``may_die`` ask for new processes or ``backend`` is None (the
    body makes its own groups). ``device="cuda"``: each rank's current CUDA
    device set before its group is made, ranks beyond the device count
    sharing devices (pytest-hsdp/src/pytest_hsdp/_placement.py).
    """
    env = env or {}
    if backend is not None and not may_die and not fresh:
        per_rank, _ = _run_on_pool(fn, world, backend, env, timeout_s, kwargs, device)
        return per_rank
    return _run_ranks(
        fn,
        world,
        backend=backend,
        env=env,
        timeout_s=timeout_s,
        collective_timeout_s=settings.read("HSDP_TEST_COLLECTIVE_TIMEOUT_S", {**os.environ, **env}),
        may_die=may_die,
        kwargs=kwargs,
        setup=hooks.install,
        device=device,
    )


def _call(rank: int, world_size: int, fn: tuple[str, str, str], kwargs: dict) -> Any:
    """A body ``fn`` (module, file, qualname) as a task of a warm pool (pytest_hsdp's, which
    names the world world_size)."""
    from pytest_hsdp import _worker

    module, path, qualname = fn
    return _worker._resolve(_worker._load_module(module, path), qualname)(
        rank, world_size, **kwargs
    )


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
    """Runs each (module, world, env) once and serves per-case verdicts.

    Every module of cases with the same world and environment runs on the same warm pool
    (``_pool_for``), so a launch costs a process start only for a (world, env) not seen
    lately. A pool where any case failed is replaced.
    """

    def __init__(self):
        self._cache: dict[tuple, dict[str, str | None]] = {}

    def _run(self, module: str, names: list[str], world: int, env, timeout_s) -> list:
        """Every rank's {case: None or traceback}, or raises RankFailure."""
        per_rank, pool = _run_on_pool(
            run_cases, world, "hsdp", env, timeout_s, {"module": module, "names": names}
        )
        if any(text for res in per_rank for text in res.values()):
            # A failed case may have left the ranks' groups unusable.
            pool.close()
        return per_rank

    def verdict(
        self, module: str, names: list[str], world: int, env=None, timeout_s=LAUNCH_TIMEOUT_S
    ) -> dict:
        """{case: None or failure text} for ``module``'s cases on ``world``
        ranks with ``env`` set in every rank, launching on first request
        (``timeout_s``: the launch's deadline)."""
        key = (module, world, tuple(sorted((env or {}).items())))
        if key not in self._cache:
            try:
                per_rank = self._run(module, names, world, env, timeout_s)
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

    def check(
        self,
        module: str,
        names: list[str],
        name: str,
        world: int,
        env=None,
        timeout_s=LAUNCH_TIMEOUT_S,
    ) -> None:
        """Fails the calling test with case ``name``'s failure text, if any."""
        import pytest

        verdict = self.verdict(module, names, world, env, timeout_s)[name]
        if verdict is not None:
            pytest.fail(verdict, pytrace=False)


def cmake_configure(
    build_dir: pathlib.Path,
    env: dict[str, str],
    *,
    folded: bool = False,
    defines: tuple[str, ...] = (),
) -> tuple[int, str]:
    """Runs only CMake's configure step of this project for this interpreter,
    with ``env`` added to the environment and ``defines`` (``NAME=VALUE``) as
    cache entries: (exit status, output with CMake's folded lines joined, or
    as printed with ``folded``)."""
    import subprocess

    proc = subprocess.run(
        ["cmake", "-S", str(ROOT), "-B", str(build_dir), f"-DPython3_EXECUTABLE={sys.executable}"]
        + [f"-D{d}" for d in defines],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )
    out = proc.stdout + proc.stderr
    return proc.returncode, out if folded else " ".join(out.split())


def run_module(*argv: str, timeout: float = 240, env: dict[str, str] | None = None, ok=True):
    """``python -m *argv`` from the repository root, as the docs run the benchmarks and tools (one
    thread a rank unless ``env`` says otherwise); with ``ok``, it must exit 0. The finished
    process (``stdout``, ``stderr``, ``returncode``)."""
    import subprocess

    cmd = [sys.executable, "-m", *argv]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )
    if ok:
        assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc
