"""Fused coalesced collectives and deferred division (cases in fusion_cases.py),
on both CPU engines: the gloo route runs the device-agnostic code CUDA
tensors take through NCCL."""

import pytest

import fusion_cases
from conftest import ENGINES

NAMES = list(fusion_cases.CASES)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("name", NAMES)
def test_fusion(launcher, name, world, engine):
    launcher.check("fusion_cases", NAMES, name, world, env={"HSDP_ENGINE": engine})
