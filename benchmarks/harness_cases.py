"""The small distributed tests that benchmarks/pytest_harnesses.py runs under each harness.

Each case is ``case(rank, world)`` on a default group that exists already, and checks its
result against the exact answer (an assert that fails when the collective is wrong). The same
functions are called by every harness, so only the harness differs. This file is copied beside
the generated test files, so it imports nothing of the repository.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_reduce(rank, world, op, n):
    t = torch.full((n,), float(rank + 1))
    dist.all_reduce(t, op=op)
    total = world * (world + 1) / 2
    expected = {
        dist.ReduceOp.SUM: total,
        dist.ReduceOp.AVG: total / world,
        dist.ReduceOp.MAX: float(world),
    }[op]
    assert torch.equal(t, torch.full((n,), expected))


def all_reduce_sum_1(rank, world):
    _all_reduce(rank, world, dist.ReduceOp.SUM, 1)


def all_reduce_sum_4k(rank, world):
    _all_reduce(rank, world, dist.ReduceOp.SUM, 4096)


def all_reduce_avg_1(rank, world):
    _all_reduce(rank, world, dist.ReduceOp.AVG, 1)


def all_reduce_avg_4k(rank, world):
    _all_reduce(rank, world, dist.ReduceOp.AVG, 4096)


def all_reduce_max_1(rank, world):
    _all_reduce(rank, world, dist.ReduceOp.MAX, 1)


def all_reduce_max_4k(rank, world):
    _all_reduce(rank, world, dist.ReduceOp.MAX, 4096)


def all_reduce_async(rank, world):
    ts = [torch.full((64,), float(rank)) for _ in range(4)]
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    for w in works:
        w.wait()
    assert all(torch.equal(t, torch.full((64,), world * (world - 1) / 2)) for t in ts)


def _broadcast(rank, world, root):
    t = torch.full((100,), float(rank))
    dist.broadcast(t, src=root)
    assert torch.equal(t, torch.full((100,), float(root)))


def broadcast_from_first(rank, world):
    _broadcast(rank, world, 0)


def broadcast_from_last(rank, world):
    _broadcast(rank, world, world - 1)


def _all_gather(rank, world, n):
    out = torch.empty(world * n)
    dist.all_gather_into_tensor(out, torch.full((n,), float(rank)))
    assert torch.equal(out, torch.arange(world).repeat_interleave(n).float())


def all_gather_8(rank, world):
    _all_gather(rank, world, 8)


def all_gather_4k(rank, world):
    _all_gather(rank, world, 4096)


def all_gather_list(rank, world):
    outs = [torch.empty(3) for _ in range(world)]
    dist.all_gather(outs, torch.full((3,), float(rank)))
    assert all(torch.equal(o, torch.full((3,), float(r))) for r, o in enumerate(outs))


def _reduce_scatter(rank, world, op):
    n = 16
    out = torch.empty(n)
    dist.reduce_scatter_tensor(out, torch.arange(world * n).float() * (rank + 1), op=op)
    factor = world * (world + 1) / 2 / (world if op == dist.ReduceOp.AVG else 1)
    assert torch.allclose(out, torch.arange(rank * n, (rank + 1) * n).float() * factor)


def reduce_scatter_sum(rank, world):
    _reduce_scatter(rank, world, dist.ReduceOp.SUM)


def reduce_scatter_avg(rank, world):
    _reduce_scatter(rank, world, dist.ReduceOp.AVG)


def all_to_all(rank, world):
    inp = torch.arange(world).float() + 10 * rank
    out = torch.empty(world)
    dist.all_to_all_single(out, inp)
    assert torch.equal(out, torch.arange(world).float() * 10 + rank)


def barrier(rank, world):
    dist.barrier()


def all_gather_object(rank, world):
    out = [None] * world
    dist.all_gather_object(out, {"rank": rank, "name": f"r{rank}"})
    assert out == [{"rank": r, "name": f"r{r}"} for r in range(world)]


def broadcast_object_list(rank, world):
    objs = [{"step": 3}, "text"] if rank == 0 else [None, None]
    dist.broadcast_object_list(objs, src=0)
    assert objs == [{"step": 3}, "text"]


def gather_object(rank, world):
    out = [None] * world if rank == 0 else None
    dist.gather_object(("r", rank), out, dst=0)
    if rank == 0:
        assert out == [("r", r) for r in range(world)]


def scatter_object_list(rank, world):
    out = [None]
    dist.scatter_object_list(out, [f"for {r}" for r in range(world)] if rank == 0 else None, src=0)
    assert out == [f"for {rank}"]


def send_recv_ring(rank, world):
    if world == 1:
        return
    t = torch.full((8,), float(rank))
    got = torch.empty(8)
    ops = [
        dist.P2POp(dist.isend, t, (rank + 1) % world),
        dist.P2POp(dist.irecv, got, (rank - 1) % world),
    ]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    assert torch.equal(got, torch.full((8,), float((rank - 1) % world)))


def subgroups(rank, world):
    half = max(1, world // 2)
    groups = [dist.new_group(list(range(0, half))), dist.new_group(list(range(half, world)))]
    mine = groups[0] if rank < half else groups[1]
    members = range(0, half) if rank < half else range(half, world)
    t = torch.ones(4) * rank
    dist.all_reduce(t, group=mine)
    assert torch.equal(t, torch.ones(4) * sum(members))


def dtensor_op(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    full = torch.randn(world * 4, 8)
    d = distribute_tensor(full, mesh, [Shard(0)])
    assert torch.allclose((d * 2).sum(dim=0).full_tensor(), (full * 2).sum(dim=0), atol=1e-5)


def _fsdp_steps(rank, world, steps):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    reference = [p.detach().clone() for p in model.parameters()]
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        torch.manual_seed(step)  # the same batch on every rank
        loss = model(torch.randn(8, 16)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    params = [p.full_tensor() for p in model.parameters()]
    assert any(not torch.equal(p, r) for p, r in zip(params, reference))
    first = [None] * world
    dist.all_gather_object(first, [p.sum().item() for p in params])
    assert all(f == first[0] for f in first)  # every rank holds the same model


def fsdp_one_step(rank, world):
    _fsdp_steps(rank, world, 1)


def fsdp_three_steps(rank, world):
    _fsdp_steps(rank, world, 3)


CASES = [
    all_reduce_sum_1,
    all_reduce_sum_4k,
    all_reduce_avg_1,
    all_reduce_avg_4k,
    all_reduce_max_1,
    all_reduce_max_4k,
    all_reduce_async,
    broadcast_from_first,
    broadcast_from_last,
    all_gather_8,
    all_gather_4k,
    all_gather_list,
    reduce_scatter_sum,
    reduce_scatter_avg,
    all_to_all,
    barrier,
    all_gather_object,
    broadcast_object_list,
    gather_object,
    send_recv_ring,
    subgroups,
    dtensor_op,
    fsdp_one_step,
    fsdp_three_steps,
    scatter_object_list,
]
