"""Where a rank runs on CUDA: rank r on device ``r % count``, and where several ranks share one
device, each with an NCCL host identity of its own.

NCCL refuses two ranks of one communicator on one device when they look like one host: its
duplicate-GPU check (``init.cc``, ``initTransportsRank``) compares the peers' host hash and bus
id, and the host hash is made from ``NCCL_HOSTID`` when that is set (``misc/utils.cc``,
``getHostHash``), read with ``getenv`` when a communicator is made. Ranks that share a device
but not a host identity count as separate nodes and connect over NCCL's socket transport. Such
a run proves ProcessGroupNCCL's and NCCL's semantics (results, streams, communicators, splits,
faults) at world sizes above the number of devices; it does not use NVLink, NCCL's P2P or SHM
transports, and its timings say nothing about speed.

No torch here: the rank passes in what it read of its devices, so the rules are tested on CPU.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

HOST_ID = "NCCL_HOSTID"
# What a rank sharing a device needs of it by default: a CUDA context (about 0.5 GiB on an
# H100) and NCCL's buffers. A test that allocates more says so with gpu_memory_gib=.
DEFAULT_GPU_MEMORY_GIB = 1.0


class PlacementError(ValueError):
    """The ranks cannot be placed on the devices as asked; the message says which and why."""


@dataclasses.dataclass(frozen=True)
class Placement:
    rank: int
    device: int  # CUDA device index
    sharing: tuple[int, ...]  # the ranks on this device, this one included
    env: dict[str, str]  # what the rank adds to its environment before NCCL starts

    def describe(self, world: int, device_count: int) -> str:
        """One line for the test's report."""
        if len(self.sharing) == 1:
            return f"{world} ranks on {device_count} CUDA device(s), one rank per device"
        return (
            f"{world} ranks on {device_count} CUDA device(s): rank r on cuda:(r % "
            f"{device_count}), ranks {list(self.sharing)} share cuda:{self.device}, each with "
            f"its own {HOST_ID} (NCCL's socket transport between them: results, streams and "
            "communicators are NCCL's; NVLink, P2P and SHM are not used, timings mean nothing)"
        )


def place(rank: int, world: int, device_count: int, environ: Mapping[str, str]) -> Placement:
    """Rank ``rank`` of ``world`` on ``device_count`` devices, ``environ`` its environment."""
    if device_count < 1:
        raise PlacementError("device='cuda' needs a CUDA device; torch sees none")
    device = rank % device_count
    sharing = tuple(r for r in range(world) if r % device_count == device)
    env: dict[str, str] = {}
    if len(sharing) > 1:
        given = environ.get(HOST_ID)
        if given is not None:
            raise PlacementError(
                f"ranks {list(sharing)} share cuda:{device} and the same {HOST_ID}={given!r}: "
                "NCCL would refuse them as one GPU used twice on one host ('Duplicate GPU "
                f"detected'). Unset {HOST_ID} (each rank then gets its own) or run at most "
                f"{device_count} rank(s)"
            )
        env[HOST_ID] = f"pytest-hsdp-rank{rank}"
    return Placement(rank, device, sharing, env)


def check_memory(placement: Placement, total_bytes: int, need_gib: float) -> None:
    """Refuses, naming the memory, a device that cannot hold its ranks at ``need_gib`` each."""
    need = len(placement.sharing) * need_gib * 2**30
    if need > total_bytes:
        raise PlacementError(
            f"ranks {list(placement.sharing)} share cuda:{placement.device}, which has "
            f"{total_bytes / 2**30:.1f} GiB; at {need_gib:g} GiB a rank (gpu_memory_gib) they "
            f"need {need / 2**30:.1f} GiB: run fewer ranks or ask for less"
        )
