"""Every c10d op on hsdp, on world sizes 1-4 (cases in ops_cases.py)."""

import ops_cases
import pytest
from conftest import engine_worlds
from hooks import engine_env

NAMES = list(ops_cases.CASES)


@pytest.mark.parametrize("engine,world", engine_worlds())
@pytest.mark.parametrize("name", NAMES)
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
