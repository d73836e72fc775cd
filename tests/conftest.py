import glob
import os
import tempfile

import pytest
from harness import CaseLauncher

# Every case runs on both CPU engines (the shared-memory engine and the
# inner-gloo route) and through the NCCL-contract double (the code path CUDA
# tensors take to NCCL, proven on CPU; see csrc/testing/).
ENGINES = ["shm", "gloo", "nccl_contract"]
# The double runs on these world sizes (an even and a 2x2-mesh size).
NCCL_CONTRACT_WORLDS = (2, 4)


def engine_worlds(worlds=(1, 2, 3, 4)):
    """(engine, world) pairs to parametrize a multi-process test with."""
    return [
        (engine, world)
        for engine in ENGINES
        for world in worlds
        if engine != "nccl_contract" or world in NCCL_CONTRACT_WORLDS
    ]


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
