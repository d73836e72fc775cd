"""The tests' side of the rank launchers: their timeouts from the tests'
settings (tools/settings.py), and launches that run many cases at once.

run_ranks starts every rank as its own process with the default group on
the requested backend (tools/ranks.py); the launch has a wall-clock deadline,
after which every process still alive is killed, so a hang costs seconds and
no process outlives its test. CaseLauncher runs modules of cases on
pytest_hsdp's warm pools (src/pytest_hsdp/_pool.py), the plugin users get.
"""

from __future__ import annotations

import os
import pathlib
import pickle
import sys
import traceback
from typing import Any, Callable

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    # The repository root, for tools/ (its own sources, not the package's:
    # hsdp_backend lives under src/ and stays the installed one). conftest.py
    # imports this module, so every test module and rank finds tools/.
    sys.path.append(str(ROOT))

import hooks  # noqa: E402

from tools import settings  # noqa: E402
from tools.ranks import RankFailure, free_port  # noqa: E402
from tools.ranks import run_ranks as _run_ranks  # noqa: E402

__all__ = ["RankFailure", "free_port", "run_ranks", "run_cases", "CaseLauncher"]

# Per-collective timeout inside the ranks; a lost peer surfaces this fast.
COLLECTIVE_TIMEOUT_S = settings.read("HSDP_TEST_COLLECTIVE_TIMEOUT_S")
# Wall-clock limit for one launch (all ranks, all cases).
LAUNCH_TIMEOUT_S = settings.read("HSDP_TEST_LAUNCH_TIMEOUT_S")


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
    HSDP_TEST_COLLECTIVE_TIMEOUT_S in ``env`` overrides the parent's. Each
    rank installs the tests' hooks (hooks.py) from its environment.
    """
    env = env or {}
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
    )


def run_cases_on_pool(rank: int, world_size: int, module: str, names: list[str]):
    """run_cases as a task of a warm pool (pytest_hsdp's, which names the world world_size)."""
    return run_cases(rank, world_size, module, names)


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

    The ranks are pytest_hsdp's warm pools, one per (world, env), the last few kept: every
    module of cases with the same world and environment runs on the same processes, so a
    launch costs a process start only for a (world, env) not seen lately. The ranks are
    forked from the fork server (the cases' settings are read when a group is made, not when
    torch is imported). A pool where any case failed, or that the plugin would not keep, is
    replaced.
    """

    KEPT_POOLS = 6

    def __init__(self):
        from pytest_hsdp import _pool

        self._cache: dict[tuple, dict[str, str | None]] = {}
        self._pools = _pool.Pools(self.KEPT_POOLS)
        self._ids = 0

    def close(self) -> None:
        self._pools.close()

    def _pool_for(self, world: int, env: dict[str, str]):
        from pytest_hsdp import _pool

        timeout = settings.read("HSDP_TEST_COLLECTIVE_TIMEOUT_S", {**os.environ, **env})
        return self._pools.get(
            (world, tuple(sorted(env.items()))),
            lambda: _pool.Pool(
                world,
                "hsdp",
                "cpu",
                env,
                start_timeout_s=LAUNCH_TIMEOUT_S,
                group_timeout_s=timeout,
                setup=("hooks", hooks.__file__, "install"),
                env_at_import=False,
            ),
        )

    def _run(self, module: str, names: list[str], world: int, env, timeout_s) -> list:
        """Every rank's {case: None or traceback}, or raises RankFailure."""
        from pytest_hsdp import _pool

        try:
            pool = self._pool_for(world, dict(env or {}))
        except _pool.PoolError as exc:
            raise RankFailure(str(exc)) from None
        self._ids += 1
        task = {
            "id": self._ids,
            "module": __name__,
            "path": __file__,
            "qualname": run_cases_on_pool.__name__,
            "kwargs": pickle.dumps({"module": module, "names": names}),
            "rank_side": ["rank", "world_size"],
            "mesh": None,
        }
        outcome = pool.run(task, timeout_s)
        if not outcome.passed:
            raise RankFailure(outcome.report(world, "hsdp", output_chars=6000))
        per_rank = [outcome.values[r] for r in range(world)]
        if any(text for res in per_rank for text in res.values()):
            pool.close()  # a failed case may have left the ranks' groups unusable
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
