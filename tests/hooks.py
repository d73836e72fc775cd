"""The tests' hooks into hsdp: what the test side hands the package through
its creator's injection points (``hsdp_backend._registration.hooks``), read
from the tests' own settings (tools/settings.py), never from the package's.

* ``HSDP_TEST_HOSTS``: pretended hosts. Each rank's host identity is the name
  given for its global rank, so hierarchical groups run on one machine.
* ``HSDP_TEST_INNER=nccl_contract``: every hsdp group's inner CPU backend is
  the NCCL-contract double (csrc/testing, the ``hsdp_testing`` module that
  scripts/setup.sh builds beside the package), with NCCL's capabilities: CPU
  tensors take the CUDA route's code. With ``HSDP_CPU_ROUTE=gloo``, so that
  every CPU collective reaches it (``engine_env`` sets both).
  ``HSDP_TEST_NCCL_RELEASE`` picks the torch release whose ProcessGroupNCCL
  it models (its factor marshalling differs: docs/versions.md).

``install`` sets the hooks in a process from its environment; every rank the
harness launches calls it (harness.run_ranks).
"""

from __future__ import annotations

import os

from tools import settings

NCCL_CONTRACT = "nccl_contract"
ENGINES = ["shm", "gloo", NCCL_CONTRACT]  # what the tests run hsdp's CPU collectives on


def engine_env(engine: str) -> dict[str, str]:
    """The environment that runs a launch's CPU collectives on ``engine``."""
    if engine == NCCL_CONTRACT:
        return {"HSDP_CPU_ROUTE": "gloo", "HSDP_TEST_INNER": NCCL_CONTRACT}
    return {"HSDP_CPU_ROUTE": engine}


def engine_under_test() -> str:
    """This process's engine, as ``engine_env`` named it."""
    from hsdp_backend import config

    if settings.read("HSDP_TEST_INNER") == NCCL_CONTRACT:
        return NCCL_CONTRACT
    return config.read("HSDP_CPU_ROUTE")


def install(environ=None) -> None:
    """Sets (or clears) the package's hooks from ``environ`` (default:
    ``os.environ``)."""
    from hsdp_backend._registration import hooks

    hosts = settings.read("HSDP_TEST_HOSTS", environ)
    if any(not h for h in hosts):
        raise ValueError(f"HSDP_TEST_HOSTS={','.join(hosts)}: expected a host name per rank")
    hooks.host_identity = _pretended_host(hosts) if hosts else None
    inner = settings.read("HSDP_TEST_INNER", environ)
    if inner not in ("", NCCL_CONTRACT):
        raise ValueError(f"HSDP_TEST_INNER={inner}: expected {NCCL_CONTRACT} or nothing")
    hooks.inner_cpu = nccl_contract_inner if inner else None


def _pretended_host(hosts: list[str]):
    def host_identity(opts) -> str:
        rank = int(os.environ.get("RANK", "0"))  # global: the names are per global rank
        if rank >= len(hosts):
            raise ValueError(
                f"HSDP_TEST_HOSTS names {len(hosts)} hosts but this is global rank {rank}"
            )
        # "?": a rank whose identity cannot be read (the group falls back to gloo).
        return "" if hosts[rank] == "?" else f"{hosts[rank]}|test-host"

    return host_identity


def nccl_contract_inner(opts, gloo):
    """The inner CPU backend hook: the double over the group's Gloo group.

    When the group is created by a split of a communicator that is itself
    the double (a default group on the double: nccl_contract_splits.py), the
    double stands for this group's NCCL and joins that split, as
    ProcessGroupNCCL does when it connects.
    """
    import hsdp_testing
    from torch.distributed import distributed_c10d

    from hsdp_backend import _C, _torch_compat

    parent = _torch_compat.split_source(opts)
    if parent is not None and hsdp_testing.is_nccl_contract(parent):
        color = distributed_c10d._process_group_color(list(opts.global_ranks_in_group))
        hsdp_testing.join_split(parent, color, opts.group_size)
    release = settings.read("HSDP_TEST_NCCL_RELEASE")
    double = hsdp_testing.NcclContractBackend(
        gloo, opts.group_rank, opts.group_size, release, store=opts.store
    )
    caps = _C.InnerCaps(
        NCCL_CONTRACT,
        native_scale=True,
        native_coalescing=True,
        streams=hsdp_testing.host_streams(),
        # As hsdp built for that release knows its ProcessGroupNCCL
        # (common/TorchCompat.hpp); by default, this build's own knowledge.
        bf16_premul_sum=None if release is None else not double.bf16_factor_as_float,
    )
    return double, caps


def double_of(backend):
    """The NCCL-contract double under an hsdp group's backend."""
    import hsdp_testing

    from hsdp_backend import _C

    double = _C.inner_backend(backend, "cpu")
    assert hsdp_testing.is_nccl_contract(double), "this group's inner CPU backend is not the double"
    return double
