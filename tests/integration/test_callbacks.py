"""Future callbacks that issue collectives and wait for them, on every route.

On the shm engine, the gloo route and the NCCL-contract double (2 and 4 ranks) and a 2 x 2
hierarchical group: a future callback waiting on an async collective it issued (by
`Future.wait()` and `Work.wait()`), a blocking call from a callback with work queued, a callback
waiting on a collective the main thread issued after its own, callbacks nested three deep,
chains, `add_done_callback`; a callback that raises (the chained future fails, the group stays
usable), one waiting on a collective the peer never issues (fails within the group timeout),
calls on an aborted / shut down group; DDP with PowerSGD, batched PowerSGD, fp16/bf16 compress
hooks (parameters equal to gloo's) and `ddp_zero_hook` (equal to SGD on gloo); futures complete
with the caller's tensor; `Work.wait()` returns after a slow callback ran and with the
waited-for tensor freed (a non-contiguous AVG: staged, post-step), and inside a callback of its
own Work returns (also bounded, and `synchronize()`), as does a blocking call on the group; two
Works whose callbacks wait for each other."""

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
