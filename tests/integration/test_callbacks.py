"""Future callbacks that issue collectives and wait for them, on every route
(cases in callback_cases.py): the shared-memory engine, the inner-gloo route,
the NCCL-contract double, and a hierarchical group across pretended hosts."""

import callback_cases
import pytest
from conftest import engine_worlds
from hooks import engine_env

NAMES = list(callback_cases.CASES)
# A launch takes 5-20 s; a hang is what these tests exist to catch.
LAUNCH_TIMEOUT_S = 120


@pytest.mark.parametrize("engine,world", engine_worlds((2, 4)))
@pytest.mark.parametrize("name", NAMES)
def test_callback(launcher, name, world, engine):
    launcher.check(
        "callback_cases",
        NAMES,
        name,
        world,
        env=engine_env(engine),
        timeout_s=LAUNCH_TIMEOUT_S,
    )


@pytest.mark.parametrize("name", NAMES)
def test_callback_hierarchical(launcher, name):
    launcher.check(
        "callback_cases",
        NAMES,
        name,
        4,
        env={"HSDP_TEST_HOSTS": "a,a,b,b"},
        timeout_s=LAUNCH_TIMEOUT_S,
    )
