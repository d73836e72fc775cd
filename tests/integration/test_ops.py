"""Every c10d op on hsdp, on world sizes 1-4 (cases in ops_cases.py).

On both CPU engines (shm and the gloo route): every c10d op on world sizes 1-4,
fp32/bf16/fp16/int64/uint8, sizes 0/1/odd/large, against exact references and gloo; coalesced
forms and their one-collective property; async Work; subgroups; a 2x2 mesh; messages past a slot
and past the direct-read threshold; layouts that differ between ranks; collectives issued from
completion callbacks; `Work.wait(timeout)`; `wait()` gives up the GIL while the op is pending
(another thread of the waiting rank runs); a synchronous call returns no Work (shm, a strided
tensor on the gloo route, the NCCL-contract double) but a complete one under c10d's in-flight
registry, which waiting or `wait_tensor()` empties again.

Across pretended hosts: every op case again on groups whose ranks `HSDP_TEST_HOSTS` places on
hosts: 2 x 2 (host-ordered and interleaved ranks), 2 x 1 (hierarchical), 3 + 1 and an unreadable
identity (flat gloo)."""

import ops_cases
import pytest
from conftest import engine_worlds
from harness import case_params
from hooks import engine_env

NAMES = list(ops_cases.CASES)


def _op_params() -> list:
    """Every case on every engine and world; a case marked every_torch carries the marker on
    shared memory at two ranks (what it shows depends on the release, not on the route)."""
    return [
        pytest.param(
            name.values[0],
            engine,
            world,
            id=f"{name.id}-{engine}-{world}",
            marks=name.marks if (engine, world) == ("shm", 2) else (),
        )
        for engine, world in engine_worlds()
        for name in case_params(ops_cases.CASES)
    ]


@pytest.mark.parametrize("name,engine,world", _op_params())
def test_op(launcher, name, world, engine):
    launcher.check("ops_cases", NAMES, name, world, env=engine_env(engine))


# Hosts pretended through HSDP_TEST_HOSTS (host name per global rank; "?":
# an identity that cannot be read), so hierarchical groups run on one machine:
# 2 hosts x 2 ranks (and interleaved), 2 x 1, an uneven 3 + 1 and an unknown
# host (flat gloo). Real hosts (namespaces) are in test_hosts.py.
HOST_LAYOUTS = ["a,a,b,b", "a,b,a,b", "a,b", "a,a,a,b", "?,a,b,b"]


@pytest.mark.parametrize("hosts", HOST_LAYOUTS)
@pytest.mark.parametrize("name", NAMES)
def test_op_across_pretended_hosts(launcher, name, hosts):
    world = len(hosts.split(","))
    launcher.check("ops_cases", NAMES, name, world, env={"HSDP_TEST_HOSTS": hosts})
