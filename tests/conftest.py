import glob
import os
import random
import tempfile

import pytest
from harness import CaseLauncher, close_pools

# Every case runs on both CPU routes (the shared-memory engine and the
# inner-gloo route) and through the NCCL-contract double (the code path CUDA
# tensors take to NCCL, proven on CPU; see csrc/testing/ and hooks.py).
from hooks import ENGINES, NCCL_CONTRACT

# The double runs on these world sizes (an even and a 2x2-mesh size).
NCCL_CONTRACT_WORLDS = (2, 4)


def engine_worlds(worlds=(1, 2, 3, 4)):
    """(engine, world) pairs to parametrize a multi-process test with."""
    return [
        (engine, world)
        for engine in ENGINES
        for world in worlds
        if engine != NCCL_CONTRACT or world in NCCL_CONTRACT_WORLDS
    ]


# The quick tier (`pytest tests -m quick`, the quick stage of scripts/test.sh):
# tests/integration at two ranks. That is every case on every route (shared
# memory, the inner Gloo, the NCCL-contract double, hierarchical across two
# pretended hosts), the communication buffers and a killed peer. A test's
# world is its `world` parameter, or the number of hosts it pretends.
QUICK_WORLD = 2


def world_of(item) -> int | None:
    params = item.callspec.params if hasattr(item, "callspec") else {}
    if "world" in params:
        return params["world"]
    if "hosts" in params:
        return len(params["hosts"].split(","))
    return None


def is_quick(item) -> bool:
    return item.path.parent.name == "integration" and world_of(item) == QUICK_WORLD


# The tiers, one folder each (docs/testing.md): a test's folder is its marker.
TIERS = ("unit", "integration", "system", "tooling")


def pytest_addoption(parser):
    parser.addoption(
        "--shuffle",
        type=int,
        default=None,
        metavar="SEED",
        help="run the selected tests in an order shuffled with SEED (scripts/test.sh's quick "
        "stage prints the seed it took): the suite must pass in any order",
    )


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.parent.name in TIERS:
            item.add_marker(getattr(pytest.mark, item.path.parent.name))
        if is_quick(item):
            item.add_marker(pytest.mark.quick)
    seed = config.getoption("--shuffle")
    if seed is not None:
        random.Random(seed).shuffle(items)


@pytest.fixture(scope="session", autouse=True)
def flight_records_in_a_temporary_directory():
    # Failing collectives (the fault tests make many) write flight records;
    # ranks inherit this, so they land here instead of /tmp/hsdp-trace.
    with tempfile.TemporaryDirectory(prefix="hsdp-trace-tests-") as d:
        os.environ.setdefault("HSDP_TRACE_DIR", d)
        yield


@pytest.fixture(scope="session")
def launcher():
    return CaseLauncher()


def hsdp_segments() -> list[str]:
    return sorted(glob.glob("/dev/shm/hsdp-*"))


@pytest.fixture(scope="session", autouse=True)
def no_segment_outlives_the_suite():
    before = set(hsdp_segments())
    yield
    leaked = sorted(set(hsdp_segments()) - before)
    assert not leaked, f"shared-memory segments left in /dev/shm: {leaked}"


@pytest.fixture(scope="session", autouse=True)
def warm_ranks(no_segment_outlives_the_suite):
    # The tests' warm pools (harness.py), stopped before the segments are counted.
    yield
    close_pools()
