"""Rank bodies of the split tests (test_nccl_contract.py): groups created
under a device-bound default group, where torch splits communicators.

With ``init_process_group(device_id=...)``, ``new_group`` hands every new
group's creator the default group's backend for that device as
``split_from``, and each non-member calls ``perform_nocolor_split`` on it
(distributed_c10d._new_process_group_helper, torch 2.14.1). On NCCL that
split is collective over every rank of the parent. Here the NCCL-contract
double plays ProcessGroupNCCL as a backend of its own ("nccl_contract",
registered below with a creator that acts as torch's NCCL creator does),
and "meta:0" plays the bound accelerator: torch accepts any device with an
index that is not the CPU, and both backends are made to serve it.
"""

from __future__ import annotations

import datetime
import time

import hsdp_testing
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from hsdp_backend import _registration, _torch_compat

DOUBLE = "nccl_contract"
BOUND = torch.device("meta", 0)
MEMBERS = [0, 2]  # of world 3: rank 1 is the non-member


def _create_double(opts, backend_options):
    """As distributed_c10d._create_nccl_process_group: a split source must
    be of its own kind (it raises AssertionError("Expected split_from to be
    ProcessGroupNCCL") otherwise), and with one the new communicator is split
    from it with the color of the group's ranks."""
    # torch < 2.13 hands a plugin's creator no split source; its own NCCL
    # creator computes it, as _torch_compat.split_source does.
    split_from = _torch_compat.split_source(opts)
    if split_from is not None:
        if not hsdp_testing.is_nccl_contract(split_from):
            raise AssertionError("Expected split_from to be ProcessGroupNCCL")
        color = distributed_c10d._process_group_color(list(opts.global_ranks_in_group))
        hsdp_testing.join_split(split_from, color, opts.group_size)
    gloo = dist.ProcessGroupGloo(
        dist.PrefixStore("double/", opts.store), opts.group_rank, opts.group_size, opts.timeout
    )
    return hsdp_testing.NcclContractBackend(gloo, opts.group_rank, opts.group_size)


def _serve_the_bound_device() -> None:
    """Registers the double as a backend (wrapped as hsdp wraps NCCL's
    creator) and lets both backends serve the pretend accelerator."""
    if DOUBLE.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(
            DOUBLE,
            _registration.not_split_from_hsdp(_create_double),
            extended_api=True,
            devices=["cpu", "meta"],
        )
    for name in ("hsdp", "gloo"):  # both serve CUDA as well
        if "meta" not in dist.Backend.backend_capability[name]:
            dist.Backend.backend_capability[name].append("meta")


def _init_bound(rank: int, world: int, backend: str, timeout_s: float) -> None:
    _serve_the_bound_device()
    dist.init_process_group(
        backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s)
    )
    dist.group.WORLD.bound_device_id = BOUND


def _check_group(rank: int, group) -> None:
    """The new group reduces right on its members, and the whole world is
    still in step afterwards (a non-member left inside a split would not
    be)."""
    if rank in MEMBERS:
        t = torch.full((4,), float(rank + 1))
        dist.all_reduce(t, group=group)
        want = float(sum(r + 1 for r in MEMBERS))
        assert torch.equal(t, torch.full((4,), want)), (rank, t)
    else:
        assert group is dist.GroupMember.NON_GROUP_MEMBER, group
    t = torch.full((3,), float(rank))
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((3,), float(sum(range(dist.get_world_size()))))), t


def hsdp_under_a_bound_nccl_default(rank: int, world: int) -> None:
    """new_group(subset, backend="hsdp") under a device-bound NCCL default:
    the non-member joins a split of the default's communicator, so hsdp's
    members must split their NCCL from it too (torch's own creator passes
    split_from and the group's color); built from scratch, the non-member
    waits in the split until the timeout."""
    _init_bound(rank, world, DOUBLE, timeout_s=20)
    _check_group(rank, dist.new_group(MEMBERS, backend="hsdp"))
    _check_group(rank, dist.new_group(MEMBERS, backend=DOUBLE))  # NCCL splitting from NCCL
    dist.destroy_process_group()


def nccl_under_a_bound_hsdp_default(rank: int, world: int) -> None:
    """new_group(subset, backend="nccl") under a device-bound hsdp default:
    torch hands NCCL's creator hsdp to split from, which it refuses; hsdp's
    non-members join no split, so the members build their own."""
    _init_bound(rank, world, "hsdp", timeout_s=20)
    # torch's own NCCL creator is the one wrapped, not only ours; before
    # torch 2.14 NCCL groups are created inline, not through a plugin.
    if dist.is_nccl_available() and _torch_compat.LAZY_BACKEND_REGISTRATION:
        creator = dist.Backend._plugins["NCCL"].creator_fn
        assert getattr(creator, "__wrapped__", None) is not None, creator
    _check_group(rank, dist.new_group(MEMBERS, backend=DOUBLE))
    _check_group(rank, dist.new_group(MEMBERS, backend="gloo"))
    _check_group(rank, dist.new_group(MEMBERS, backend="hsdp"))
    dist.destroy_process_group()


def a_split_is_collective_over_the_parent(rank: int, world: int) -> None:
    """The double's model of ncclCommSplit: every rank of the parent must
    join. Here the non-member does not: the members' split fails after the
    parent's timeout instead of going on without it."""
    _init_bound(rank, world, DOUBLE, timeout_s=3)
    parent = dist.group.WORLD._get_backend(BOUND)
    if rank in MEMBERS:
        try:
            hsdp_testing.join_split(parent, 7, len(MEMBERS))
        except dist.DistBackendError as exc:
            assert "not every rank of the parent joined" in str(exc), exc
            assert "timed out" in str(exc).lower(), exc
        else:
            raise AssertionError("a split a parent rank never joined must not complete")
    else:
        time.sleep(5)  # stays up: the members must fail by the timeout, not a closed peer
