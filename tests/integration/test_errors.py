"""Bad input and failures on hsdp (cases in error_cases.py).

On both engines: bad input on every op family (sizes, dtypes, ranks, op for dtype, device: a
cuda tensor on a group made without a GPU and cpu with cuda in one coalesced call, with torch's
FakeTensor standing for the cuda tensor; a PREMUL_SUM factor tensor on another device than the
data), a nested `start_coalescing`, the group usable afterwards; an async collective that cannot
complete fails from `wait()`; an ephemeral timeout extension; abort hooks (run in id order on a
rank whose op timed out, past a hook that raises, not on a rank where nothing failed, before
`abort()`, not again from a hook that aborts; an id in use refused)."""

import error_cases
import pytest
from conftest import engine_worlds
from hooks import engine_env

NAMES = list(error_cases.CASES)


@pytest.mark.parametrize("engine,world", engine_worlds((1, 2, 3)))
@pytest.mark.parametrize("name", NAMES)
def test_error(launcher, name, world, engine):
    launcher.check("error_cases", NAMES, name, world, env=engine_env(engine))
