"""pytest's multi-process harnesses side by side: the same small distributed tests
(benchmarks/harness_cases.py: collectives, object collectives, point-to-point, subgroups, a
DTensor op, FSDP2 steps; each checks its result) at 2 and 4 ranks, written for torch's
``MultiProcessTestCase`` (processes spawned per test), for torch's ``MultiProcContinuousTest``
(processes kept per test class) and for pytest_hsdp (a warm pool per world size), each run by a
pytest of its own on this machine; and torch's two suites, unchanged, on pytest_hsdp's warm
ranks (``warm-*``, ``warm-continuous-*``: the plugin runs torch's test classes itself; torch's
own harnesses run with that turned off). Reports each harness's wall time (pytest's start included)
and time per test, with the ratio to ``MultiProcessTestCase`` on gloo, and pytest_hsdp's own
cost per test: the time between the ends of consecutive empty tests at 4 ranks (after the
first, which starts the pool), marked and as methods of torch's two kinds of test class,
beside the same for
unmarked empty tests (pytest's own share).

Every run must pass all its tests, or the benchmark fails: a harness that skipped or failed
tests is not timed.

    python -m benchmarks.pytest_harnesses [--cases N] [--worlds 2,4] [--repeats R]
        [--harnesses plugin-hsdp,plugin-gloo,warm-hsdp,warm-gloo,warm-continuous-hsdp,
                     warm-continuous-gloo,continuous-gloo,spawn-gloo]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
HARNESSES = (
    "plugin-hsdp",
    "plugin-gloo",
    "warm-hsdp",
    "warm-gloo",
    "warm-continuous-hsdp",
    "warm-continuous-gloo",
    "continuous-gloo",
    "spawn-gloo",
)
# Each harness's test file (by the harness's name less its backend) and the plugin's say in
# it: torch's own harnesses run torch's test classes only with the plugin's running of them
# turned off.
SUITE = {
    "plugin": "plugin",
    "warm": "spawn",
    "spawn": "spawn",
    "warm-continuous": "continuous",
    "continuous": "continuous",
}
TORCH_CASES_OFF = ("--hsdp-torch-cases", "off")
TORCH_OWN = ("spawn", "continuous")

PLUGIN = """
import pytest

import harness_cases as cases

NAMES = [c.__name__ for c in cases.CASES[:{cases}]]
{tests}
"""
PLUGIN_WORLD = """

@pytest.mark.world_size({world})
@pytest.mark.parametrize("case", NAMES)
def test_w{world}(case, rank, world_size):
    getattr(cases, case)(rank, world_size)
"""

# torch's harnesses find a test's class by name in the ranks: one module-level class per world.
TORCH = """
import os

import torch.distributed as dist
from torch.testing._internal.common_distributed import {base}

import harness_cases as cases

BACKEND = os.environ["HARNESS_BACKEND"]
if BACKEND == "hsdp":
    import hsdp_backend  # noqa: F401


def _add_cases(cls):
    for case in cases.CASES[:{cases}]:
        def test(self, case=case):
            {body}
        setattr(cls, "test_" + case.__name__, test)
    return cls
{classes}
"""
SPAWN_CLASS = """

@_add_cases
class TestW{world}(MultiProcessTestCase):
    @property
    def world_size(self):
        return {world}

    def setUp(self):
        super().setUp()
        self._spawn_processes()

    def tearDown(self):
        super().tearDown()
        try:
            os.remove(self.file_name)
        except OSError:
            pass
"""
SPAWN_BODY = (
    "store = dist.FileStore(self.file_name, self.world_size)\n"
    "            dist.init_process_group(BACKEND, store=store, rank=self.rank, "
    "world_size=self.world_size)\n"
    "            try:\n"
    "                case(self.rank, self.world_size)\n"
    "            finally:\n"
    "                dist.destroy_process_group()"
)
CONTINUOUS_CLASS = """

@_add_cases
class TestW{world}(MultiProcContinuousTest):
    world_size = {world}

    @classmethod
    def backend_str(cls):
        return BACKEND

    @classmethod
    def device_type(cls):
        return "cpu"
"""
CONTINUOUS_BODY = "case(self.rank, self.world_size)"

# Each test's end in pytest's process, to the microsecond (JUnit's times are in milliseconds).
TIMES = """
import json
import os
import time

_ENDS = []


def pytest_runtest_logfinish(nodeid, location):
    _ENDS.append(time.perf_counter())


def pytest_sessionfinish(session):
    if os.environ.get("HARNESS_TIMES"):
        with open(os.environ["HARNESS_TIMES"], "w") as f:
            json.dump(_ENDS, f)
"""

EMPTY = """
import pytest


@pytest.mark.world_size(4)
@pytest.mark.parametrize("i", range({n}))
def test_empty(i, rank):
    pass
"""
EMPTY_CASE = """
from torch.testing._internal.common_distributed import MultiProcessTestCase


class TestEmpty(MultiProcessTestCase):
    world_size = 4

    def setUp(self):
        super().setUp()
        self._spawn_processes()


for _i in range({n}):
    setattr(TestEmpty, f"test_empty_{{_i:04d}}", lambda self: None)
"""
EMPTY_CONTINUOUS = """
from torch.testing._internal.common_distributed import MultiProcContinuousTest


class TestEmpty(MultiProcContinuousTest):
    world_size = 4

    @classmethod
    def backend_str(cls):
        return "gloo"

    @classmethod
    def device_type(cls):
        return "cpu"


for _i in range({n}):
    setattr(TestEmpty, f"test_empty_{{_i:04d}}", lambda self: None)
"""
PLAIN = """
import pytest


@pytest.mark.parametrize("i", range({n}))
def test_plain(i):
    pass
"""


def write_suites(d: Path, cases: int, worlds: list[int]) -> dict[str, Path]:
    shutil.copy(HERE / "harness_cases.py", d / "harness_cases.py")
    files = {
        "plugin": PLUGIN.format(
            cases=cases, tests="".join(PLUGIN_WORLD.format(world=w) for w in worlds)
        ),
        "spawn": TORCH.format(
            base="MultiProcessTestCase",
            cases=cases,
            body=SPAWN_BODY,
            classes="".join(SPAWN_CLASS.format(world=w) for w in worlds),
        ),
        "continuous": TORCH.format(
            base="MultiProcContinuousTest",
            cases=cases,
            body=CONTINUOUS_BODY,
            classes="".join(CONTINUOUS_CLASS.format(world=w) for w in worlds),
        ),
    }
    paths = {}
    for name, text in files.items():
        paths[name] = d / f"test_{name}.py"
        paths[name].write_text(text)
    return paths


def run_pytest(
    d: Path,
    path: Path,
    backend: str,
    expected: int,
    timeout_s: float,
    times: Path | None = None,
    extra: tuple[str, ...] = (),
) -> float:
    """Wall seconds of a pytest run of ``path`` (and ``extra`` arguments) that must pass
    ``expected`` tests; with ``times``, each test's end (perf_counter seconds) is written
    there."""
    env = {**os.environ, "HARNESS_BACKEND": backend}
    env.pop("PYTEST_ADDOPTS", None)
    if times is not None:
        env["HARNESS_TIMES"] = str(times)
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path), *extra]
    if path.name.startswith("test_plugin") or path.name.startswith("test_empty"):
        args += ["--hsdp-backend", backend]
    start = time.perf_counter()
    proc = subprocess.run(args, cwd=d, env=env, capture_output=True, text=True, timeout=timeout_s)
    wall = time.perf_counter() - start
    out = proc.stdout + proc.stderr
    passed = re.search(r"(\d+) passed", out)
    if proc.returncode != 0 or not passed or int(passed.group(1)) != expected:
        raise HarnessFailed(
            f"{path.name} on {backend}: not all {expected} tests passed\n{out[-4000:]}"
        )
    return wall


class HarnessFailed(Exception):
    """A run that did not pass all its tests: reported, never timed."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=25, help="cases per world (at most 25)")
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--repeats", type=int, default=1, help="rounds, harnesses interleaved")
    parser.add_argument("--harnesses", default=",".join(HARNESSES))
    parser.add_argument("--empty", type=int, default=200, help="N of the empty-test cost")
    parser.add_argument("--timeout", type=float, default=3600.0, help="per pytest run, seconds")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    worlds = [int(w) for w in args.worlds.split(",")]
    harnesses = args.harnesses.split(",")
    unknown = set(harnesses) - set(HARNESSES)
    if unknown or not 1 <= args.cases <= 25:
        parser.error(f"--harnesses from {HARNESSES}; --cases 1-25")
    tests = args.cases * len(worlds)
    walls: dict[str, list[float]] = {h: [] for h in harnesses}
    empty: list[float] = []  # ms per marked empty test
    empty_case: list[float] = []  # ms per empty test of a torch test class
    empty_continuous: list[float] = []  # the same, of a MultiProcContinuousTest class
    plain: list[float] = []  # ms per unmarked empty test: pytest's own share
    failed: list[str] = []  # runs that did not pass all their tests: reported, not timed
    with tempfile.TemporaryDirectory(prefix="harnesses-") as tmp:
        d = Path(tmp)
        suites = write_suites(d, args.cases, worlds)
        (d / "conftest.py").write_text(TIMES)
        (d / "test_empty.py").write_text(EMPTY.format(n=args.empty + 1))
        (d / "test_plain.py").write_text(PLAIN.format(n=args.empty + 1))
        (d / "test_empty_case.py").write_text(EMPTY_CASE.format(n=args.empty + 1))
        (d / "test_empty_continuous.py").write_text(EMPTY_CONTINUOUS.format(n=args.empty + 1))
        for _ in range(args.repeats):
            for h in harnesses:
                kind, backend = h.rsplit("-", 1)
                extra = TORCH_CASES_OFF if kind in TORCH_OWN else ()
                try:
                    walls[h].append(
                        run_pytest(
                            d, suites[SUITE[kind]], backend, tests, args.timeout, None, extra
                        )
                    )
                except HarnessFailed as exc:
                    failed.append(str(exc))
                    print(f"  {h}: FAILED, not timed\n{exc}", flush=True)
                    continue
                print(f"  {h}: {walls[h][-1]:.1f} s", flush=True)
            per_test = {}
            for name in ("empty", "empty_case", "empty_continuous", "plain"):
                ends = d / f"{name}.json"
                run_pytest(d, d / f"test_{name}.py", "hsdp", args.empty + 1, args.timeout, ends)
                # After the first test, which starts the pool.
                t = json.loads(ends.read_text())[1:]
                per_test[name] = [(b - a) * 1000 for a, b in zip(t, t[1:])]
            empty += per_test["empty"]
            empty_case += per_test["empty_case"]
            empty_continuous += per_test["empty_continuous"]
            plain += per_test["plain"]
            print(
                f"  empty test at 4 ranks: median {statistics.median(per_test['empty']):.3f} ms;"
                f" a torch test class's: {statistics.median(per_test['empty_case']):.3f} ms;"
                f" a continuous one's: {statistics.median(per_test['empty_continuous']):.3f} ms;"
                f" an unmarked empty test: {statistics.median(per_test['plain']):.3f} ms",
                flush=True,
            )
    if failed:
        print(f"\n{len(failed)} run(s) did not pass all their tests and were not timed")
    walls = {h: w for h, w in walls.items() if w}
    harnesses = [h for h in harnesses if h in walls]
    base = statistics.median(walls["spawn-gloo"]) if "spawn-gloo" in walls else None
    rows = []
    print(f"\n{tests} tests ({args.cases} cases x worlds {worlds}), {args.repeats} round(s)")
    print(f"{'harness':22} {'wall s':>8} {'range':>15} {'per test s':>11} {'vs spawn-gloo':>14}")
    for h in harnesses:
        med = statistics.median(walls[h])
        ratio = base / med if base else None
        rows.append({"harness": h, "wall_s": med, "walls_s": walls[h], "per_test_s": med / tests})
        if ratio:
            rows[-1]["speedup_vs_spawn_gloo"] = ratio
        spread = f"{min(walls[h]):.1f}-{max(walls[h]):.1f}"
        print(
            f"{h:22} {med:8.1f} {spread:>15} {med / tests:11.3f} "
            + (f"{ratio:13.1f}x" if ratio else f"{'-':>14}")
        )
    print(
        f"an empty test at 4 ranks: median {statistics.median(empty):.3f} ms, 90th percentile"
        f" {statistics.quantiles(empty, n=10)[-1]:.3f} ms ({len(empty)} tests); unmarked:"
        f" {statistics.median(plain):.3f} ms; pytest_hsdp's own:"
        f" {statistics.median(empty) - statistics.median(plain):.3f} ms"
    )
    print(
        f"an empty torch test class method at 4 ranks: median"
        f" {statistics.median(empty_case):.3f} ms; pytest_hsdp's own:"
        f" {statistics.median(empty_case) - statistics.median(plain):.3f} ms; of a"
        f" MultiProcContinuousTest class: {statistics.median(empty_continuous):.3f} ms;"
        f" pytest_hsdp's own: {statistics.median(empty_continuous) - statistics.median(plain):.3f} ms"
    )
    if args.json:
        result = {
            "tests": tests,
            "cases": args.cases,
            "worlds": worlds,
            "rows": rows,
            "empty_test_median_ms": statistics.median(empty),
            "empty_test_p90_ms": statistics.quantiles(empty, n=10)[-1],
            "empty_case_median_ms": statistics.median(empty_case),
            "empty_continuous_median_ms": statistics.median(empty_continuous),
            "plain_test_median_ms": statistics.median(plain),
        }
        result["failed_runs"] = failed
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
