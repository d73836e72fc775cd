"""Rank bodies of test_buffers.py: communication buffers from
``allocate_tensor`` (the shared-memory pool on CPU; the inner backend's
through the NCCL-contract double), compared bitwise with gloo."""

import torch
import torch.distributed as dist

import hsdp_backend
from hsdp_backend import config

CPU = torch.device("cpu")


def backend(group=None):
    return (group or dist.group.WORLD)._get_backend(CPU)


def pooled(n, dtype, group=None):
    return backend(group).allocate_tensor(n, dtype=dtype, device=CPU)


def values(rank, n, dtype, seed=0):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(n, generator=g).to(dtype)


def collectives_match_gloo(rank, world, flat=True):
    """Every rank's buffers in the pool: gloo's bytes, and on a flat group
    (one engine) the pooled path for every call."""
    assert backend().supports_tensor_alloc(CPU)
    gloo = dist.new_group(backend="gloo")
    before = hsdp_backend.buffer_stats()["pooled_calls"]
    calls = 0
    for dtype in (torch.float32, torch.bfloat16):
        for n in (1, 1000, 70_000):
            mine = values(rank, n, dtype)
            # all-gather in place (FSDP2's form) and out of place
            out = pooled(world * n, dtype)
            out.narrow(0, rank * n, n).copy_(mine)
            dist.all_gather_into_tensor(out, out.narrow(0, rank * n, n))
            src = pooled(n, dtype)
            src.copy_(mine)
            out2 = torch.empty(world * n, dtype=dtype)
            dist.all_gather_into_tensor(out2, src)
            ref = torch.empty(world * n, dtype=dtype)
            dist.all_gather_into_tensor(ref, mine, group=gloo)
            assert torch.equal(out, ref) and torch.equal(out2, ref), (dtype, n)
            # reduce-scatter: SUM and AVG (SUM plus one division)
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
                full = values(rank, world * n, dtype, seed=1)
                inp = pooled(world * n, dtype)
                inp.copy_(full)
                got = torch.empty(n, dtype=dtype)
                dist.reduce_scatter_tensor(got, inp, op=op)
                # Bitwise hsdp's ordinary path (the same order of the sum)...
                ref = torch.empty(n, dtype=dtype)
                dist.reduce_scatter_tensor(ref, full, op=op)
                assert torch.equal(got, ref), (dtype, n, op)
                # ... and gloo's sum (gloo has no AVG; its order of a sum of
                # more than two differs, so exact only at two ranks).
                if op == dist.ReduceOp.SUM and dtype == torch.float32:
                    dist.reduce_scatter_tensor(ref, full, op=op, group=gloo)
                    if world == 2:
                        assert torch.equal(got, ref), (dtype, n, op)
                    torch.testing.assert_close(got, ref)
            # Pooled from the pool's direct-read threshold on (below it the
            # slots are faster); the ordinary-memory references never are.
            if n * mine.element_size() >= config.resolve().pooled_read_bytes():
                calls += 4
    stats = hsdp_backend.buffer_stats()
    if flat:
        assert stats["pooled_calls"] - before == calls, (stats, calls)
    assert stats["fallbacks"] == 0, stats
    return stats


def buffers_return_to_the_pool(rank, world):
    t = pooled(1 << 20, torch.float32)
    live = hsdp_backend.buffer_stats()["live_bytes"]
    assert live >= 4 << 20, live
    address = t.data_ptr()
    del t
    assert hsdp_backend.buffer_stats()["live_bytes"] == live - (4 << 20)
    # The same size again is the same buffer: FSDP2 allocates alike every step.
    assert pooled(1 << 20, torch.float32).data_ptr() == address
    # Not resizable: a resize would move it out of the pool unnoticed.
    t = pooled(16, torch.float32)
    try:
        t.resize_(1 << 20)
    except RuntimeError:
        pass
    else:
        raise AssertionError("a pool tensor was resized")


def ordinary_memory_on_some_ranks_is_served_alike(rank, world):
    gloo = dist.new_group(backend="gloo")
    before = hsdp_backend.buffer_stats()["pooled_calls"]
    n = 4096  # 16 KiB a rank: past the pool's direct-read threshold
    mine = values(rank, n, torch.float32)
    out = pooled(world * n, torch.float32) if rank == 0 else torch.empty(world * n)
    out.narrow(0, rank * n, n).copy_(mine)
    dist.all_gather_into_tensor(out, out.narrow(0, rank * n, n))
    ref = torch.empty(world * n)
    dist.all_gather_into_tensor(ref, mine, group=gloo)
    assert torch.equal(out, ref)
    full = values(rank, world * n, torch.float32, seed=2)
    inp = pooled(world * n, torch.float32) if rank != 0 else full.clone()
    inp.copy_(full)
    got, ref = torch.empty(n), torch.empty(n)
    dist.reduce_scatter_tensor(got, inp)
    dist.reduce_scatter_tensor(ref, full)  # ordinary memory on every rank
    assert torch.equal(got, ref)
    assert hsdp_backend.buffer_stats()["pooled_calls"] == before


def another_groups_buffer_is_ordinary_memory_there(rank, world):
    other = dist.new_group(backend="hsdp")
    n = 4096
    out = pooled(world * n, torch.float32)  # the default group's pool
    out.narrow(0, rank * n, n).fill_(rank + 1)
    dist.all_gather_into_tensor(out, out.narrow(0, rank * n, n), group=other)
    expect = torch.arange(1, world + 1, dtype=torch.float32).repeat_interleave(n)
    assert torch.equal(out, expect)
    assert hsdp_backend.buffer_stats(other)["pooled_calls"] == 0
    # A buffer of a destroyed group stays valid until it dies.
    kept = pooled(n, torch.float32, group=other)
    kept.fill_(7)
    dist.destroy_process_group(other)
    kept += 1
    assert torch.equal(kept, torch.full((n,), 8.0))


def past_the_bound_is_ordinary_memory_counted(rank, world):
    # HSDP_SHM_POOL_BYTES=2 MiB (the launch's environment): one chunk
    a = pooled(1 << 18, torch.float32)  # 1 MiB: from the pool
    b = pooled(1 << 19, torch.float32)  # 2 MiB more: past the bound
    stats = hsdp_backend.buffer_stats()
    assert stats["fallbacks"] == 1 and stats["allocations"] == 1, stats
    n = 1 << 17
    b.narrow(0, rank * n, n).fill_(rank)
    dist.all_gather_into_tensor(b.narrow(0, 0, world * n), b.narrow(0, rank * n, n))
    assert torch.equal(
        b[: world * n], torch.arange(world, dtype=torch.float32).repeat_interleave(n)
    )
    del a


def no_pool_says_why(rank, world):
    assert not backend().supports_tensor_alloc(CPU)
    try:
        pooled(16, torch.float32)
    except RuntimeError as e:
        assert f"[rank {rank}/{world}] allocate_tensor" in str(e), e
        assert "no communication buffers on cpu" in str(e), e
    else:
        raise AssertionError("allocate_tensor succeeded without a pool")


def the_nccl_double_allocates(rank, world):
    """On the NCCL-contract double (hooks.py): CPU tensors take the CUDA route, whose
    allocation is the inner backend's (NCCL's pool on a GPU)."""
    import hsdp_testing
    from hooks import double_of

    b = backend()
    assert b.supports_tensor_alloc(CPU)
    # NCCL's pool needs the communicator, which a group without device_id
    # gets at its first collective: a barrier makes it (see allocateTensor's
    # clause below).
    dist.barrier()
    before = hsdp_testing.allocations(double_of(b))
    gloo = dist.new_group(backend="gloo")
    n = 1000
    full = values(rank, world * n, torch.float32, seed=3)
    inp = pooled(world * n, torch.float32)
    inp.copy_(full)
    assert hsdp_testing.allocations(double_of(b)) == before + 1
    got, ref = torch.empty(n), torch.empty(n)
    dist.reduce_scatter_tensor(got, inp)
    dist.reduce_scatter_tensor(ref, full, group=gloo)
    assert torch.equal(got, ref)
    assert hsdp_testing.allocations(double_of(b)) == before + 1

    # The double's own clause (ProcessGroupNCCL 2.14.1's allocateTensor): a
    # request on a device of another kind is refused, not served (CPU
    # stands for the communicator's CUDA device): a route that handed NCCL
    # another device's request would fail there, not here.
    double = hsdp_testing.NcclContractBackend(gloo._get_backend(CPU), rank, world)
    try:
        double.allocate_tensor(8, dtype=torch.float32, device=torch.device("cuda", 0))
    except ValueError as e:
        assert "NCCL tensor allocator expects cuda type but got" in str(e), e
    else:
        raise AssertionError("the double served a request on another device")
    # Nor before its communicator exists (NCCL: none before the first
    # collective): NCCL's own error, then served after one.
    try:
        double.allocate_tensor(8, dtype=torch.float32, device=CPU)
    except RuntimeError as e:
        assert "NCCL communicator has not been initialized before mem pool creation" in str(e), e
    else:
        raise AssertionError("the double served a request before its communicator existed")
    work = double.allreduce([torch.zeros(1)])
    if work is not None:
        work.wait()
    assert double.allocate_tensor(8, dtype=torch.float32, device=CPU).numel() == 8


def pool_suite(rank, world):
    collectives_match_gloo(rank, world)
    buffers_return_to_the_pool(rank, world)
    ordinary_memory_on_some_ranks_is_served_alike(rank, world)
    another_groups_buffer_is_ordinary_memory_there(rank, world)


def fsdp_buffers(rank, world, pooled):
    """FSDP2 param groups on a 1-D mesh over the default group keep FSDP2's
    own buffers until ``hsdp_backend.fsdp.use_group_buffers`` asks, through
    FSDP2's public setter, for the groups' pools; then a training step's
    all-gather and reduce-scatter read peers' pool buffers (``pooled``: the
    groups count such calls, one host's shared-memory engine). Asked to
    undo, FSDP2's own again; a mesh of gloo groups is left alone."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hsdp_backend.fsdp import use_group_buffers

    def comms(module):
        group = module._get_fsdp_state()._fsdp_param_group
        return type(group._all_gather_comm).__name__, type(group._reduce_scatter_comm).__name__

    pool = ("ProcessGroupAllocAllGather", "ProcessGroupAllocReduceScatter")
    own = ("DefaultAllGather", "DefaultReduceScatter")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Linear(128, 128))
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    assert comms(model) == own, comms(model)
    assert use_group_buffers(model) == 1
    assert comms(model) == pool, comms(model)
    before = hsdp_backend.buffer_stats()["pooled_calls"]
    model(torch.randn(4, 128)).sum().backward()
    pooled_calls = hsdp_backend.buffer_stats()["pooled_calls"] - before
    # 8 KiB a rank and more (the pool's direct-read threshold): an all-gather and a
    # reduce-scatter of 66 KB.
    assert (pooled_calls >= 2) if pooled else (pooled_calls == 0), pooled_calls
    assert use_group_buffers(model, enable=False) == 1
    assert comms(model) == own, comms(model)

    gloo_mesh = DeviceMesh.from_group(dist.new_group(backend="gloo"), "cpu")
    other = fully_shard(torch.nn.Linear(128, 128), mesh=gloo_mesh)
    assert use_group_buffers(other) == 0
    assert comms(other) == own, comms(other)
