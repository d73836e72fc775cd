"""Bad input and failures on hsdp (cases in error_cases.py)."""

import error_cases
import pytest
from conftest import engine_worlds
from hooks import engine_env

NAMES = list(error_cases.CASES)


@pytest.mark.parametrize("engine,world", engine_worlds((1, 2, 3)))
@pytest.mark.parametrize("name", NAMES)
def test_error(launcher, name, world, engine):
    launcher.check("error_cases", NAMES, name, world, env=engine_env(engine))
