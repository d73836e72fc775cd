"""The c10d surface beyond hsdp's fast paths, against gloo (cases in
c10d_surface_cases.py). CPU engines only: these are CPU-tensor calls (the
NCCL-contract double stands for the CUDA route, which serves none of them)."""

import c10d_surface_cases
import pytest
from conftest import engine_worlds
from hooks import engine_env

NAMES = list(c10d_surface_cases.CASES)


@pytest.mark.parametrize(
    "engine,world", [(e, w) for e, w in engine_worlds((1, 2, 3)) if e != "nccl_contract"]
)
@pytest.mark.parametrize("name", NAMES)
def test_c10d_surface(launcher, name, world, engine):
    launcher.check("c10d_surface_cases", NAMES, name, world, env=engine_env(engine))
