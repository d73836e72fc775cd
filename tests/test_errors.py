"""Bad input and failures on hsdp (cases in error_cases.py)."""

import pytest

import error_cases

NAMES = list(error_cases.CASES)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("name", NAMES)
def test_error(launcher, name, world):
    verdict = launcher.verdict("error_cases", NAMES, world)[name]
    if verdict is not None:
        pytest.fail(verdict, pytrace=False)
