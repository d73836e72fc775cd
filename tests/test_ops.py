"""Every c10d op on hsdp, on world sizes 1-4 (cases in ops_cases.py)."""

import pytest

from conftest import engine_worlds

import ops_cases

NAMES = list(ops_cases.CASES)


@pytest.mark.parametrize("engine,world", engine_worlds())
@pytest.mark.parametrize("name", NAMES)
def test_op(launcher, name, world, engine):
    launcher.check("ops_cases", NAMES, name, world, env={"HSDP_ENGINE": engine})
