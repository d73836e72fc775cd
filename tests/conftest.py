import glob
import os
import random
import tempfile

import pytest
from harness import CaseLauncher, close_pools

# Every case runs on both CPU engines (the shared-memory engine and the
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


# What runs on every supported torch besides the main venv's (scripts/test.sh's
# compat stages, with that release's C++ backend tests), beyond the quick tier (every route,
# every case at two ranks): what meets what differs between releases:
# registration and settings, FSDP2 parity and the shim (whose contact with
# FSDP2's internals differs most), the version contracts, splits under
# device-bound defaults (how torch hands split sources), the launcher.
# Prefixes of test ids. HSDP 2x2 parity runs through
# the NCCL-contract double here (the plain form, at 4 ranks, takes 40 s a
# release: the main venv runs it).
EVERY_TORCH = (
    "tests/unit/test_registration.py::test_import_torch_registers_hsdp_lazily",
    "tests/unit/test_config.py",
    "tests/unit/test_backend_surface.py",
    "tests/unit/test_docs.py",
    "tests/unit/test_fsdp_buckets.py",
    "tests/unit/test_torch_contracts.py",
    "tests/unit/test_fsdp_internals.py",
    "tests/integration/test_fsdp.py::test_fsdp_parity[fsdp_w2]",
    "tests/integration/test_fsdp.py::test_fsdp_parity_nccl_contract[hsdp_2x2]",
    "tests/integration/test_fsdp_selfproof.py",
    "tests/integration/test_fsdp.py::test_fsdp_parity_nccl_contract[hsdp_2x2_bf16_reduce_divide_factor]",
    "tests/integration/test_nccl_contract.py::test_nccl_contract_splits",
    # how each release's ProcessGroupNCCL marshals a bf16 PREMUL_SUM factor
    "tests/integration/test_nccl_contract.py::test_nccl_contract[bf16_factors_never_reach_nccl",
    "tests/integration/test_nccl_contract.py::test_nccl_contract[allocation_needs_the_communicator",
    "tests/integration/test_nccl_contract.py::test_nccl_contract[the_double_loses_a_bf16_factor",
    "tests/integration/test_launcher.py::test_group_really_runs_on_hsdp_and_chains_sitecustomize",
    # hsdp's Work as a Python subclass of the Work this release's c10d binds
    "tests/integration/test_ops.py::test_op[work_gives_up_the_gil_while_its_op_is_pending-shm-2]",
    # reconfigure: torch 2.14's Backend surface (skips, saying so, before it)
    "tests/integration/test_reconfigure.py",
    "tests/integration/test_examples.py::test_a_lost_replica_is_dropped_and_training_goes_on_as_on_gloo",
)


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
        if item.nodeid.startswith(EVERY_TORCH):
            item.add_marker(pytest.mark.every_torch)
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
