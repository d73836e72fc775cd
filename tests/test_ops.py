"""Every c10d op on hsdp, on world sizes 1-4 (cases in ops_cases.py)."""

import pytest

from conftest import ENGINES

import ops_cases

NAMES = list(ops_cases.CASES)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("name", NAMES)
def test_op(launcher, name, world, engine):
    verdict = launcher.verdict("ops_cases", NAMES, world, env={"HSDP_ENGINE": engine})[name]
    if verdict is not None:
        pytest.fail(verdict, pytrace=False)
