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


# The quick tier (`pytest tests -m quick`): every route once (shared memory,
# hierarchical across pretended hosts, the inner Gloo, the NCCL-contract
# double), FSDP2 1-D and HSDP with the shim, the launcher, registration and
# the generated docs. Prefixes of test ids.
QUICK = (
    "tests/integration/test_ops.py::test_op[all_reduce_every_op-shm-2]",
    "tests/integration/test_ops.py::test_op[all_reduce_every_op-gloo-2]",
    "tests/integration/test_ops.py::test_op[all_reduce_every_op-nccl_contract-2]",
    "tests/integration/test_ops.py::test_op_across_pretended_hosts[all_reduce_every_op-a,a,b,b]",
    "tests/integration/test_fsdp.py::test_fsdp_parity[fsdp_w2]",
    "tests/integration/test_fsdp.py::test_fsdp_parity[hsdp_2x2]",
    "tests/integration/test_fsdp.py::test_fsdp_parity_nccl_contract[hsdp_2x2]",
    "tests/integration/test_nccl_contract.py::test_nccl_contract_splits[nccl_under_a_bound_hsdp_default]",
    "tests/integration/test_launcher.py::test_group_really_runs_on_hsdp_and_chains_sitecustomize",
    "tests/unit/test_registration.py::test_import_torch_registers_hsdp_lazily",
    "tests/unit/test_config.py",
    "tests/unit/test_docs.py",
    "tests/tooling/test_cpp_backend.py",
)


# What runs on every supported torch besides the main venv's
# (tests/system/test_torch_versions.py): the quick tier and the FSDP2 shim, whose
# contact with FSDP2's internals is what differs most between releases.
EVERY_TORCH = (
    *QUICK,
    "tests/integration/test_fsdp_selfproof.py",
    "tests/unit/test_fsdp_buckets.py",
    "tests/unit/test_torch_contracts.py",
    # splits under device-bound defaults: how torch hands split sources differs by release
    "tests/integration/test_nccl_contract.py::test_nccl_contract_splits",
)


# The tiers, one folder each (docs/testing.md): a test's folder is its marker.
TIERS = ("unit", "integration", "system", "tooling")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.parent.name in TIERS:
            item.add_marker(getattr(pytest.mark, item.path.parent.name))
        if item.nodeid.startswith(QUICK):
            item.add_marker(pytest.mark.quick)
        if item.nodeid.startswith(EVERY_TORCH):
            item.add_marker(pytest.mark.every_torch)


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
