"""Runs PyTorch's own DistributedTest (shipped in the torch wheel, so it always
matches the installed torch) on one backend and world size, CPU only, and
writes every test's outcome as JSON.

    python tests/conformance/driver.py --backend hsdp --world 2 --out results.json \
        [-k PATTERN] [--only NAMES.txt ...] [--start spawn|fork]

or as a pytest module, configured by the environment (CONFORMANCE_BACKEND, WORLD_SIZE, TEMP_DIR):

    CONFORMANCE_BACKEND=hsdp WORLD_SIZE=2 pytest tests/conformance/driver.py::TestDistBackendOnCPU

The suite is configured as PyTorch's test_distributed_spawn.py does (BACKEND
and WORLD_SIZE before import, a TestDistBackend subclass that starts the ranks
per test: spawned, or with --start fork forked from this process, as the
retired test_distributed_fork.py did). hsdp is held to everything gloo is: the
suite's gates, which it evaluates by backend name when its classes are defined
(``BACKEND == "gloo"``, ``require_backend_is_available({"gloo"})``,
DistTestCases.backend_feature), are evaluated with the name "gloo"; then the
name becomes "hsdp", so every group the tests create, and every name they
check, is hsdp's. A test gloo passes and
hsdp does not is a gap, listed with its reason in expected_hsdp_w{W}.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import unittest

# The suite's gates are read as for gloo when the backend under test is another
# CPU backend: hsdp claims every gloo feature, and a test it cannot pass fails.
GATES_AS = {"hsdp": "gloo"}

# Tests whose bodies (not gates) branch on the name: their CPU model is built
# under ``if BACKEND in ("mpi", "gloo")`` (distributed_test.py,
# _test_accumulate_gradients_no_sync). Their bodies see "gloo" too; the group
# they run on is still the one _run created, on the backend under test.
BODY_READS_NAME = ("test_accumulate_gradients_no_sync",)


def _configure(backend: str, world: int) -> None:
    os.environ["CONFORMANCE_BACKEND"] = backend
    os.environ["WORLD_SIZE"] = str(world)
    os.environ.setdefault("TEMP_DIR", tempfile.mkdtemp(prefix="hsdp-conformance-"))
    os.environ.setdefault("PYTORCH_PRINT_REPRO_ON_FAILURE", "0")


if __name__ == "__main__":
    _args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _args.add_argument("--backend", required=True)
    _args.add_argument("--world", type=int, default=2)
    _args.add_argument("--out", required=True)
    _args.add_argument(
        "-k", dest="pattern", default=None, help="only tests whose name contains this"
    )
    _args.add_argument(
        "--only",
        action="append",
        default=[],
        help="a file of test names (the first word of each line, # comments ignored): "
        "run only those; may repeat",
    )
    _args.add_argument(
        "--start",
        choices=["spawn", "fork"],
        default="spawn",
        help="how each test starts its ranks: fresh interpreters (spawn, as "
        "test_distributed_spawn.py) or forks of this one (fork)",
    )
    ARGS = _args.parse_args()
    _configure(ARGS.backend, ARGS.world)
    os.environ["CONFORMANCE_START"] = ARGS.start
# Spawned ranks re-import this module: the environment above is theirs already.
BACKEND = os.environ["CONFORMANCE_BACKEND"]

import torch  # noqa: E402

import hsdp_backend  # noqa: E402,F401  registers "hsdp"

os.environ["BACKEND"] = GATES_AS.get(BACKEND, BACKEND)
from torch.testing._internal.common_distributed import DistTestCases  # noqa: E402
from torch.testing._internal.distributed import distributed_test  # noqa: E402
from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)

# Gates are decided; from here on the suite runs, and names, the backend under test.
os.environ["BACKEND"] = distributed_test.BACKEND = BACKEND
# Test bodies that consult the feature tables at run time see what gloo has, too.
_gates_as = GATES_AS.get(BACKEND, BACKEND)
for _table in (DistTestCases.skip_collective, DistTestCases.backend_feature):
    for _backends in _table.values():
        if _gates_as in _backends:
            _backends.add(BACKEND)


class TestDistBackendOnCPU(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        if os.environ.get("CONFORMANCE_START", "spawn") == "fork":
            # As PyTorch's test_distributed_fork.py ran this suite on gloo: the
            # ranks inherit the imported torch and the registered backend
            # instead of importing them again (seconds a test on 2 cores).
            self._start_processes(torch.multiprocessing.get_context("fork").Process)
        else:
            self._spawn_processes()

    def run_test(self, test_name, parent_pipe):
        # In the rank, after _run has created the group on the backend under test.
        import torch.distributed as dist

        assert dist.get_backend() == BACKEND, (
            f"{test_name} runs on {dist.get_backend()}, not {BACKEND}"
        )
        if not test_name.startswith(BODY_READS_NAME):
            return super().run_test(test_name, parent_pipe)
        # Restored after: a warm rank (pytest_hsdp) runs the next test in this same process.
        distributed_test.BACKEND = GATES_AS.get(BACKEND, BACKEND)
        try:
            return super().run_test(test_name, parent_pipe)
        finally:
            distributed_test.BACKEND = BACKEND


class _Outcomes(unittest.TextTestResult):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.outcomes: dict[str, str] = {}

    def _name(self, test) -> str:
        return test.id().rsplit(".", 1)[-1]

    def addSuccess(self, test):
        super().addSuccess(test)
        self.outcomes[self._name(test)] = "pass"

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self.outcomes[self._name(test)] = f"skip: {reason}"

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self.outcomes[self._name(test)] = (
            "fail: " + self._exc_info_to_string(err, test).strip().splitlines()[-1]
        )

    def addError(self, test, err):
        super().addError(test, err)
        self.outcomes[self._name(test)] = (
            "fail: " + self._exc_info_to_string(err, test).strip().splitlines()[-1]
        )


def _named_in(paths: list[str]) -> set[str]:
    names = set()
    for path in paths:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line and not line.startswith("#"):
                    names.add(line.partition(":")[0].strip())
    return names


def main() -> int:
    loader = unittest.TestLoader()
    only = _named_in(ARGS.only)
    names = [
        n
        for n in loader.getTestCaseNames(TestDistBackendOnCPU)
        if (not ARGS.pattern or ARGS.pattern in n) and (not only or n in only)
    ]
    suite = unittest.TestSuite(TestDistBackendOnCPU(n) for n in names)
    runner = unittest.TextTestRunner(resultclass=_Outcomes, verbosity=1, stream=sys.stderr)
    result = runner.run(suite)
    with open(ARGS.out, "w") as f:
        json.dump(result.outcomes, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
