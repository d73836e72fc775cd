import glob

import pytest

from harness import CaseLauncher

# Both CPU engines run the same cases: the shared-memory engine and the
# inner-gloo route (which is also the code path CUDA tensors take to NCCL).
ENGINES = ["shm", "gloo"]


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
