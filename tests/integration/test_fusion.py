"""Fused coalesced all-gather and reduce-scatter and the deferred division, on both CPU routes.

Fused coalesced collectives and deferred division (cases in fusion_cases.py),
on both CPU routes: the gloo route runs the device-agnostic code CUDA
tensors take through NCCL.

On both engines: fused all-gather / reduce-scatter over 1-300 tensors of mixed sizes (0, 1, odd)
and dtypes, one collective (per dtype for reductions), adjacent views, the piecewise direct-read
all-gather; the deferred division chained over the two groups of a mesh; bad input (non-dividing
sizes, sizes differing between ranks, bad divisors)."""

import fusion_cases
import pytest
from conftest import engine_worlds
from hooks import engine_env

NAMES = list(fusion_cases.CASES)


@pytest.mark.parametrize("engine,world", engine_worlds())
@pytest.mark.parametrize("name", NAMES)
def test_fusion(launcher, name, world, engine):
    launcher.check("fusion_cases", NAMES, name, world, env=engine_env(engine))
