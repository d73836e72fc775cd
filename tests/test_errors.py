"""Bad input and failures on hsdp (cases in error_cases.py)."""

import pytest

from conftest import ENGINES

import error_cases

NAMES = list(error_cases.CASES)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("name", NAMES)
def test_error(launcher, name, world, engine):
    verdict = launcher.verdict("error_cases", NAMES, world, env={"HSDP_ENGINE": engine})[name]
    if verdict is not None:
        pytest.fail(verdict, pytrace=False)
