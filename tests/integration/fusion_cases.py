"""Fused coalesced collectives and the deferred division, on every engine.
Cases run as ``case(rank, world, ref)`` (ref: a gloo group over the ranks)."""

from __future__ import annotations

import random

import torch
import torch.distributed as dist
from hooks import engine_under_test

import hsdp_backend

CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def data(seed: int, rank: int, n: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    return torch.randint(-8, 9, (n,), generator=g).to(dtype)


def sizes_for(count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice([0, 1, 2, 5, 33, 257, 4096]) for _ in range(count)]


def engine():
    return engine_under_test()


@case
def coalesced_all_gather_many_tensors_mixed_dtypes(rank, world, ref):
    for count in (1, 2, 17, 300):
        sizes = sizes_for(count, count)
        dtypes = [
            (torch.float32, torch.bfloat16, torch.int64, torch.uint8)[i % 4] for i in range(count)
        ]
        outs = [torch.empty(world * n, dtype=d) for n, d in zip(sizes, dtypes)]
        hsdp_backend.reset_comm_stats()
        with dist._coalescing_manager():
            for i, (n, d, o) in enumerate(zip(sizes, dtypes, outs)):
                dist.all_gather_into_tensor(o, data(i, rank, n, d))
        for i, (n, d, o) in enumerate(zip(sizes, dtypes, outs)):
            expected = torch.cat([data(i, r, n, d) for r in range(world)])
            assert torch.equal(o, expected), (count, i)
        # Bytes are gathered: every dtype shares the one collective.
        assert hsdp_backend.comm_stats()["all_gather_into_tensor_coalesced"] == {
            "calls": 1,
            "collectives": 1,
            "bytes": sum(n * torch.empty(0, dtype=d).element_size() for n, d in zip(sizes, dtypes)),
        }


@case
def coalesced_reduce_scatter_many_tensors_one_collective_per_dtype(rank, world, ref):
    for count in (1, 2, 17, 300):
        sizes = sizes_for(count, count + 1)
        dtypes = [
            (torch.float32, torch.bfloat16)[i % 2] if count > 1 else torch.float32
            for i in range(count)
        ]
        outs = [torch.empty(n, dtype=d) for n, d in zip(sizes, dtypes)]
        hsdp_backend.reset_comm_stats()
        with dist._coalescing_manager():
            for i, (n, d, o) in enumerate(zip(sizes, dtypes, outs)):
                dist.reduce_scatter_tensor(o, data(i, rank, world * n, d), op=dist.ReduceOp.AVG)
        for i, (n, d, o) in enumerate(zip(sizes, dtypes, outs)):
            full = sum(data(i, r, world * n, torch.float64) for r in range(world)) / world
            torch.testing.assert_close(o, full[rank * n : (rank + 1) * n].to(d))
        assert hsdp_backend.comm_stats()["reduce_scatter_tensor_coalesced"]["collectives"] == len(
            set(dtypes)
        )


@case
def coalesced_reduce_scatter_into_adjacent_views(rank, world, ref):
    # FSDP2-like: the outputs are views of one flat buffer (reduced in place).
    sizes = [3, 0, 64, 1]
    flat = torch.zeros(sum(sizes))
    outs = list(flat.split(sizes))
    with dist._coalescing_manager():
        for i, (n, o) in enumerate(zip(sizes, outs)):
            dist.reduce_scatter_tensor(o, data(i, rank, world * n, torch.float32))
    expected = torch.cat(
        [
            sum(data(i, r, world * n, torch.float64) for r in range(world))[
                rank * n : (rank + 1) * n
            ]
            for i, n in enumerate(sizes)
        ]
    ).float()
    assert torch.equal(flat, expected)


@case
def deferred_division_chained_across_two_groups(rank, world, ref):
    """RS(SUM) over one group, AR(SUM) over another, one division at the end
    by the product of both sizes: the HSDP gradient reduction."""
    if world == 4:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        shard, replicate = mesh.get_group("shard"), mesh.get_group("replicate")
    else:  # shard over everyone, replicate over just this rank
        shard = dist.group.WORLD
        replicate = dist.new_group([rank], use_local_synchronization=True)
    s, r = dist.get_world_size(shard), dist.get_world_size(replicate)
    shard_ranks = dist.get_process_group_ranks(shard)
    me = shard_ranks.index(rank)
    for dtype in (torch.float32, torch.bfloat16):
        n = 1000
        grads = data(5, rank, s * n, dtype)
        out = torch.empty(n, dtype=dtype)
        hsdp_backend.reduce_scatter_tensor(out, grads, op=dist.ReduceOp.SUM, group=shard)
        hsdp_backend.all_reduce(out, op=dist.ReduceOp.SUM, group=replicate, divide_by=s * r)
        # Every rank's gradient counts once: the mean over all world ranks.
        expected = (
            sum(data(5, q, s * n, torch.float64) for q in range(world))[me * n : (me + 1) * n]
            / world
        )
        torch.testing.assert_close(out, expected.to(dtype))
    # AVG and PREMUL_SUM compose with divide_by into one step.
    t = data(6, rank, 10, torch.float32)
    hsdp_backend.all_reduce(t, op=dist.ReduceOp.AVG, divide_by=4.0)
    expected = sum(data(6, q, 10, torch.float64) for q in range(world)) / world / 4
    torch.testing.assert_close(t, expected.float())
    t = data(7, rank, 10, torch.float32)
    hsdp_backend.all_reduce(t, op=dist._make_nccl_premul_sum(0.5), divide_by=2.0)
    expected = sum(data(7, q, 10, torch.float64) for q in range(world)) * 0.25
    torch.testing.assert_close(t, expected.float())
    # Integers: a whole divisor, truncating.
    t = data(8, rank, 10, torch.int64)
    hsdp_backend.all_reduce(t, divide_by=3)
    expected = torch.div(
        sum(data(8, q, 10, torch.int64) for q in range(world)), 3, rounding_mode="trunc"
    )
    assert torch.equal(t, expected)


@case
def deferred_division_bad_input(rank, world, ref):
    for bad in (0.0, -2.0, float("inf"), float("nan")):
        try:
            hsdp_backend.all_reduce(torch.ones(2), divide_by=bad)
        except ValueError as exc:
            assert f"[rank {rank}/{world}] all_reduce: divide_by must be positive" in str(exc)
        else:
            raise AssertionError(f"divide_by={bad} must raise")
    try:
        hsdp_backend.all_reduce(torch.ones(2, dtype=torch.int64), divide_by=2.5)
    except ValueError as exc:
        assert "whole number for integer tensors" in str(exc)
    else:
        raise AssertionError("a fractional divisor of an integer tensor must raise")
    try:
        hsdp_backend.all_reduce(torch.ones(2), op=dist.ReduceOp.MAX, divide_by=2)
    except ValueError as exc:
        assert "divide_by needs a SUM, AVG or PREMUL_SUM reduction" in str(exc)
    else:
        raise AssertionError("MAX with divide_by must raise")
    t = torch.ones(2)
    dist.all_reduce(t)
    assert t.tolist() == [world, world]


@case
def coalesced_bad_input(rank, world, ref):
    # A tensor that does not divide by the world size, on every rank alike.
    if world > 1:
        try:
            with dist._coalescing_manager():
                dist.reduce_scatter_tensor(torch.empty(2), torch.ones(2 * world + 1))
        except ValueError as exc:
            assert (
                f"[rank {rank}/{world}] reduce_scatter_tensor_coalesced: an input (world size x output) has"
                in str(exc)
            ), exc
        else:
            raise AssertionError("expected ValueError")
    # Sizes that differ between ranks: the engine compares every rank's call
    # before touching data, so all ranks fail alike (gloo and NCCL have no
    # such check: the call is undefined behaviour there).
    if world > 1 and engine() in ("auto", "shm"):
        g = dist.new_group(backend="hsdp")
        outs = [torch.empty(world * 3), torch.empty(world * (4 + rank))]
        try:
            with dist._coalescing_manager(group=g):
                dist.all_gather_into_tensor(outs[0], torch.ones(3), group=g)
                dist.all_gather_into_tensor(outs[1], torch.ones(4 + rank), group=g)
        except dist.DistBackendError as exc:
            assert "ranks called different collectives" in str(exc), exc
        else:
            raise AssertionError("expected DistBackendError")
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == world


@case
def coalesced_all_gather_large_pieces(rank, world, ref):
    """Past the direct-read threshold: peers read every input in place (no
    packing); inputs may be in-place slices of their outputs, or strided."""
    sizes = [12288 + 17 * i for i in range(48)] + [0, 1]
    dtypes = [(torch.float32, torch.bfloat16, torch.int64)[i % 3] for i in range(len(sizes))]
    if world > 1 and hsdp_backend.cpu_route() == "shm":
        # 2.9 MB a rank: past the 2 MiB a group measures at most.
        total = sum(n * torch.empty(0, dtype=d).element_size() for n, d in zip(sizes, dtypes))
        direct_from = hsdp_backend._C.cpu_route(hsdp_backend.get_hsdp_backend())[2]
        assert 0 < direct_from <= total, (direct_from, total)
    outs = [torch.full((world * n,), 99).to(d) for n, d in zip(sizes, dtypes)]
    ins = []
    for i, (n, d, o) in enumerate(zip(sizes, dtypes, outs)):
        if i % 4 == 0:  # FSDP2's in-place form
            shard = o.narrow(0, rank * n, n)
            shard.copy_(data(i, rank, n, d))
            ins.append(shard)
        elif i % 4 == 1 and n > 1:  # a strided view: not contiguous
            ins.append(
                data(i, rank, 2 * n, d).view(n, 2)[:, 0].clone().as_strided((n,), (1,)) * 0
                + data(i, rank, n, d)
            )
        else:
            ins.append(data(i, rank, n, d))
    hsdp_backend.reset_comm_stats()
    with dist._coalescing_manager():
        for o, x in zip(outs, ins):
            dist.all_gather_into_tensor(o, x)
    for i, (n, d, o) in enumerate(zip(sizes, dtypes, outs)):
        assert torch.equal(o, torch.cat([data(i, r, n, d) for r in range(world)])), i
    assert hsdp_backend.comm_stats()["all_gather_into_tensor_coalesced"]["collectives"] == 1
