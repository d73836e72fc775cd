"""torch's own distributed test classes on warm ranks: a test method of a
``MultiProcessTestCase`` subclass (``DTensorTestBase``, ``FSDPTest`` and the other bases built
on it) runs on a pool without a default group, each rank running it as torch's spawned rank
does (``_worker._run_case``: the class's own ``_run``), and the outcome is read as torch's
parent reads its ranks' exit codes (``MultiProcessTestCase._check_return_codes``, torch
2.11-2.15): a rank that raised fails the test with its traceback; else rank 0's exit code
decides: a skip code skips the test with torch's message (the reason itself where the rank
logged one), 0 passes, anything else fails.

What the pool cannot reproduce falls back to torch's own spawning, said once per class: a
test that expects a rank's exit code (listed in ``special_return_code_checks`` or
``skip_return_code_checks``, set in ``setUp``).

Nothing here imports torch: the test module that defines such a class already has.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import pytest

_TORCH_BASE = ("torch.testing._internal.common_distributed", "MultiProcessTestCase")
_ERROR_EXIT_CODE = 10  # MultiProcessTestCase.TEST_ERROR_EXIT_CODE


def is_torch_case(cls: Any) -> bool:
    """Whether ``cls`` is a torch ``MultiProcessTestCase`` (by its bases' names: no import)."""
    return isinstance(cls, type) and any(
        (c.__module__, c.__name__) == _TORCH_BASE for c in cls.__mro__
    )


class Fallback(Exception):
    """This test runs under torch's own harness; the message says why."""


def _expects_exit_codes(case: Any) -> str:
    """Why torch's parent would judge this test's exit codes otherwise than ``judge`` does, as
    ``_check_return_codes`` decides it (2.11-2.15): by ``fn in the list``, ``fn`` being the bound
    test method ``join_or_run`` wrapped (its wrapper's ``__wrapped__``). So an entry counts
    only for its own test; and one taken from a decorated method's ``__wrapped__``, a plain
    function, matches no test, as in torch (DistributedTest's ``test_ddp_has_finalized``)."""
    fn = getattr(getattr(case, case._testMethodName, None), "__wrapped__", None)
    if fn is None:
        return ""
    if fn in (getattr(case, "special_return_code_checks", None) or {}):
        return "it expects ranks' exit codes (special_return_code_checks)"
    if fn in (getattr(case, "skip_return_code_checks", None) or []):
        return "it skips the check of ranks' exit codes (skip_return_code_checks)"
    return ""


def prepare(case: Any) -> None:
    """torch's parent-side setUp without its spawning (which the pool replaces): the store
    file name, ``rank`` = MAIN_PROCESS_RANK, the checks a test may declare. Raises Fallback
    where the pool cannot serve the test."""
    # An instance attribute hides the class's method for this one case only.
    case._spawn_processes = lambda *a, **k: None
    case._start_processes = lambda *a, **k: None
    try:
        case.setUp()
        # What torch's spawned ranks inherit: the environment as setUp left it.
        case._pytest_hsdp_environ = dict(os.environ)
    finally:
        del case._spawn_processes
        del case._start_processes
    why = _expects_exit_codes(case)
    if why:
        raise Fallback(why)


def world_size_of(case: Any, nodeid: str) -> int:
    """The case's ``world_size`` as torch's ``_start_processes`` takes it, ``int(world_size)``
    (2.11-2.15; DistributedTest's is the string of ``WORLD_SIZE``)."""
    try:
        world = case.world_size
    except Exception as exc:  # noqa: BLE001 - a property may raise anything
        pytest.fail(f"{nodeid}: its world_size raised {type(exc).__name__}: {exc}", pytrace=False)
    try:
        count = int(world)
    except (TypeError, ValueError):
        count = 0
    if isinstance(world, bool) or count < 1:
        pytest.fail(f"{nodeid}: its world_size is {world!r}; expected an int >= 1", pytrace=False)
    return count


def task_of(case: Any, method: str, task_id: int) -> dict[str, Any]:
    cls = type(case)
    module = __import__(cls.__module__, fromlist=["_"])
    return {
        "id": task_id,
        "kind": "case",
        "module": cls.__module__,
        "path": os.path.abspath(module.__file__),
        "qualname": cls.__qualname__,
        "method": method,
        "file_name": case.file_name,
        "environ": case._pytest_hsdp_environ,
        "kwargs": pickle.dumps({}),
        "rank_side": [],
        "mesh": None,
    }


def timeout_of(case: Any, default_s: float) -> float:
    """torch's deadline for the test (common_distributed.get_timeout), else ``default_s``."""
    import sys

    common = sys.modules.get(_TORCH_BASE[0])
    get_timeout = getattr(common, "get_timeout", None)
    try:
        return float(get_timeout(case.id())) if get_timeout else default_s
    except Exception:  # noqa: BLE001 - an id torch's table does not know
        return default_s


def judge(values: dict[int, dict], world: int, died: str = "") -> tuple[str, str]:
    """("passed" | "skipped" | "failed", text), as torch's parent judges its ranks' exits
    (``died``: the pool's account of ranks that died, added to a failure)."""
    import sys

    errored = {r: v for r, v in values.items() if v["code"] == _ERROR_EXIT_CODE}
    if errored:
        text = [f"{len(errored)} of {world} ranks raised"]
        for r, v in sorted(errored.items()):
            text.append(f"--- rank {r} ---\n{(v['error'] or '(no traceback sent)').rstrip()}")
        return "failed", "\n".join(text)
    first = values[0]
    skips = getattr(sys.modules.get(_TORCH_BASE[0]), "TEST_SKIPS", {})
    for name, skip in skips.items():
        if first["code"] == skip.exit_code:
            reason = skip.message
            if name == "generic" and first["skip_reason"]:
                reason = first["skip_reason"]
            return "skipped", reason
    if first["code"] != 0:
        text = f"Expected exit code 0 but got {first['code']} for rank 0"
        return "failed", text + (f"\n{died}" if died else "")
    return "passed", ""


def clean_up(case: Any) -> None:
    """torch's tearDown (nothing spawned to end), then the store file if the ranks left it."""
    try:
        case.tearDown()
        case.doCleanups()
    finally:
        remove_store_file(case)


def remove_store_file(case: Any) -> None:
    name = getattr(case, "file_name", None)
    if name and os.path.exists(name):
        os.unlink(name)
