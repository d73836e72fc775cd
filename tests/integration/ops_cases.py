"""Every c10d operation through hsdp on CPU, checked against exact references
and against gloo. Each case runs on every rank: ``case(rank, world, ref)``
where ``ref`` is a gloo group over the same ranks.

Inputs are small integers (exact in every dtype, also bf16 and uint8), and
every rank can compute every other rank's input, so most expected results are
computed locally and compared exactly; AVG and PREMUL_SUM results are compared
within one rounding of the output dtype.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import every_torch
from hooks import engine_under_test

import hsdp_backend
from hsdp_backend import config
from tools import settings

FLOATS = [torch.float32, torch.bfloat16, torch.float16]
INTS = [torch.int64, torch.uint8]
DTYPES = FLOATS + INTS
SIZES = [0, 1, 7, 1000]  # empty, single, odd, larger than a cache line

CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def data(rank: int, n: int, dtype, kind: str = "sum") -> torch.Tensor:
    """Rank-dependent, small, exactly representable values."""
    base = torch.arange(n, dtype=torch.int64) + 3 * rank
    if kind == "product":  # keep products of <= 4 ranks exact in every dtype
        return (base % 2 + 1).to(dtype)
    return (base % 11 + 1).to(dtype)


def exact(dtype, tensors_f64: torch.Tensor) -> torch.Tensor:
    return tensors_f64.to(dtype)


def reduce_ref(op, world: int, n: int, dtype) -> torch.Tensor:
    kind = "product" if op == dist.ReduceOp.PRODUCT else "sum"
    stack = torch.stack([data(r, n, torch.int64, kind) for r in range(world)])
    if op == dist.ReduceOp.SUM:
        out = stack.sum(0)
    elif op == dist.ReduceOp.PRODUCT:
        out = stack.prod(0)
    elif op == dist.ReduceOp.MIN:
        out = stack.min(0).values
    elif op == dist.ReduceOp.MAX:
        out = stack.max(0).values
    elif op == dist.ReduceOp.BAND:
        out = stack[0].clone()
        for row in stack[1:]:
            out &= row
    elif op == dist.ReduceOp.BOR:
        out = stack[0].clone()
        for row in stack[1:]:
            out |= row
    elif op == dist.ReduceOp.BXOR:
        out = stack[0].clone()
        for row in stack[1:]:
            out ^= row
    elif op == dist.ReduceOp.AVG:
        if dtype.is_floating_point:
            return (stack.double().sum(0) / world).to(dtype)
        return torch.div(stack.sum(0), world, rounding_mode="trunc").to(dtype)
    else:
        raise AssertionError(op)
    return out.to(dtype)


def check(actual: torch.Tensor, expected: torch.Tensor, what: str):
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    if actual.dtype.is_floating_point:
        torch.testing.assert_close(actual, expected, msg=lambda m: f"{what}: {m}")
    else:
        assert torch.equal(actual, expected), f"{what}: {actual} != {expected}"


def ops_for(dtype):
    ops = [
        dist.ReduceOp.SUM,
        dist.ReduceOp.AVG,
        dist.ReduceOp.PRODUCT,
        dist.ReduceOp.MIN,
        dist.ReduceOp.MAX,
    ]
    if not dtype.is_floating_point:
        ops += [dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR]
    return ops


# ---------------------------------------------------------------- broadcast


@case
def broadcast(rank, world, ref):
    for dtype in DTYPES:
        for n in SIZES:
            for root in range(world):
                t = data(rank, n, dtype)
                dist.broadcast(t, src=root)
                check(t, data(root, n, dtype), f"broadcast {dtype} n={n} root={root}")


# --------------------------------------------------------------- all_reduce


@case
def all_reduce_every_op(rank, world, ref):
    for dtype in DTYPES:
        for op in ops_for(dtype):
            for n in SIZES:
                kind = "product" if op == dist.ReduceOp.PRODUCT else "sum"
                t = data(rank, n, dtype, kind)
                dist.all_reduce(t, op=op)
                check(t, reduce_ref(op, world, n, dtype), f"all_reduce {op} {dtype} n={n}")


@case
def all_reduce_matches_gloo(rank, world, ref):
    for dtype in [torch.float32, torch.int64]:
        for op in [dist.ReduceOp.SUM, dist.ReduceOp.MIN, dist.ReduceOp.MAX]:
            t = torch.randn(513, generator=torch.Generator().manual_seed(rank)).mul(100).to(dtype)
            g = t.clone()
            dist.all_reduce(t, op=op)
            dist.all_reduce(g, op=op, group=ref)
            if expected_engine(list(range(world))) == "hierarchical" and dtype.is_floating_point:
                # The same sum in another order (hosts' partial sums first).
                torch.testing.assert_close(t, g, rtol=1e-5, atol=1e-3)
            else:
                check(t, g, f"all_reduce vs gloo {op} {dtype}")


@case
def all_reduce_premul_sum(rank, world, ref):
    for dtype in FLOATS + [torch.float64]:
        for factor in [0.5, torch.tensor(0.25, dtype=torch.float64)]:
            t = data(rank, 33, dtype)
            dist.all_reduce(t, op=dist._make_nccl_premul_sum(factor))
            f = float(factor)
            expected = (
                torch.stack([data(r, 33, torch.float64) for r in range(world)]).sum(0) * f
            ).to(dtype)
            check(t, expected, f"premul_sum {dtype} factor={f}")


@case
def reduce_to_each_root(rank, world, ref):
    for dtype in [torch.float32, torch.bfloat16, torch.int64]:
        for op in [dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX]:
            for root in range(world):
                t = data(rank, 9, dtype)
                dist.reduce(t, dst=root, op=op)
                if rank == root:
                    check(t, reduce_ref(op, world, 9, dtype), f"reduce {op} {dtype} root={root}")


# ---------------------------------------------------------------- all-gather


@case
def all_gather_list(rank, world, ref):
    for dtype in DTYPES:
        for n in SIZES:
            outs = [torch.full((n,), 99).to(dtype) for _ in range(world)]
            dist.all_gather(outs, data(rank, n, dtype))
            for r in range(world):
                check(outs[r], data(r, n, dtype), f"all_gather {dtype} n={n} from {r}")


@case
def all_gather_coalesced_list(rank, world, ref):
    """dist.all_gather_coalesced: shapes mixed, an empty tensor, sync and
    async (torch allows one dtype per call); one fused collective."""
    for dtype, async_op in ((torch.float32, False), (torch.bfloat16, True), (torch.int64, True)):

        def inputs(r):
            return [
                data(r, 6, dtype).view(2, 3),
                data(r, 4, dtype),
                data(r, 0, dtype),
                data(r, 5, dtype),
            ]

        hsdp_backend.reset_comm_stats()
        mine = inputs(rank)
        outs = [[torch.full_like(t, 99) for t in mine] for _ in range(world)]
        work = dist.all_gather_coalesced(outs, mine, async_op=async_op)
        if async_op:
            work.wait()
        for r in range(world):
            for i, want in enumerate(inputs(r)):
                check(
                    outs[r][i], want, f"all_gather_coalesced from {r}, tensor {i}, async={async_op}"
                )
        assert hsdp_backend.comm_stats()["all_gather_into_tensor_coalesced"]["collectives"] == 1


@case
def all_gather_into_tensor(rank, world, ref):
    for dtype in DTYPES:
        for n in SIZES:
            out = torch.empty(world * n, dtype=dtype)
            dist.all_gather_into_tensor(out, data(rank, n, dtype))
            expected = torch.cat([data(r, n, dtype) for r in range(world)])
            check(out, expected, f"all_gather_into_tensor {dtype} n={n}")


@case
def all_gather_into_tensor_in_place(rank, world, ref):
    # FSDP2's form: the input is this rank's slice of the output.
    for dtype in DTYPES:
        for n in SIZES:
            out = torch.full((world * n,), 7).to(dtype)
            shard = out.narrow(0, rank * n, n)
            shard.copy_(data(rank, n, dtype))
            dist.all_gather_into_tensor(out, shard)
            expected = torch.cat([data(r, n, dtype) for r in range(world)])
            check(out, expected, f"in-place all_gather_into_tensor {dtype} n={n}")


@case
def gather_and_scatter(rank, world, ref):
    for dtype in [torch.float32, torch.bfloat16, torch.uint8]:
        for root in range(world):
            outs = [torch.empty(5, dtype=dtype) for _ in range(world)] if rank == root else None
            dist.gather(data(rank, 5, dtype), outs, dst=root)
            if rank == root:
                for r in range(world):
                    check(outs[r], data(r, 5, dtype), f"gather {dtype} root={root} from {r}")
            out = torch.empty(5, dtype=dtype)
            ins = [data(r + 10, 5, dtype) for r in range(world)] if rank == root else None
            dist.scatter(out, ins, src=root)
            check(out, data(rank + 10, 5, dtype), f"scatter {dtype} root={root}")


@case
def gather_single(rank, world, ref):
    """gather_single (torch 2.14+): every rank's tensor in one flat tensor on
    the root, in rank order, each root in turn, the root's output flat or
    stacked ([world, *shape]), sync and async; where gloo refuses it, hsdp
    serves it on every route (an all-gather the root keeps on shared memory,
    the inner backend's gather elsewhere)."""
    if not hasattr(dist, "gather_single"):
        return  # torch before 2.14 has no such call
    for dtype in [torch.float32, torch.bfloat16, torch.uint8]:
        for root in range(world):
            for shape in ((5,), (2, 3)):
                n = 5 if shape == (5,) else 6
                mine = data(rank, n, dtype).view(shape)
                want = torch.stack([data(r, n, dtype).view(shape) for r in range(world)])
                stacked = shape != (5,)
                out = None
                if rank == root:
                    out = torch.empty(want.shape if stacked else (world * n,), dtype=dtype)
                work = dist.gather_single(mine, out, dst=root, async_op=stacked)
                if stacked:
                    work.wait()
                if rank == root:
                    check(out.view(want.shape), want, f"gather_single {dtype} {shape} root={root}")
    # Gloo's own (torch 2.14-2.15) refuses it, on every rank alike.
    try:
        out = torch.empty(2 * world) if rank == 0 else None
        dist.gather_single(torch.ones(2), out, dst=0, group=ref)
    except RuntimeError as exc:
        assert "does not support gather_single" in str(exc), exc


# ------------------------------------------------------------ reduce-scatter


def rs_input(rank, world, n, dtype):
    return data(rank, world * n, dtype)


def rs_expected(op, world, rank, n, dtype):
    full = torch.stack([data(r, world * n, torch.float64) for r in range(world)]).sum(0)
    if op == dist.ReduceOp.AVG:
        full = full / world
    chunk = full[rank * n : (rank + 1) * n]
    if op == dist.ReduceOp.AVG and not dtype.is_floating_point:
        chunk = torch.div(
            torch.stack([data(r, world * n, torch.int64) for r in range(world)]).sum(0),
            world,
            rounding_mode="trunc",
        )[rank * n : (rank + 1) * n]
    return chunk.to(dtype)


@case
def reduce_scatter_tensor_sum_avg(rank, world, ref):
    for dtype in DTYPES:
        for op in [dist.ReduceOp.SUM, dist.ReduceOp.AVG]:
            for n in SIZES:
                out = torch.empty(n, dtype=dtype)
                dist.reduce_scatter_tensor(out, rs_input(rank, world, n, dtype), op=op)
                check(
                    out,
                    rs_expected(op, world, rank, n, dtype),
                    f"reduce_scatter_tensor {op} {dtype} n={n}",
                )


@case
def reduce_scatter_tensor_premul_sum(rank, world, ref):
    for dtype in FLOATS:
        out = torch.empty(6, dtype=dtype)
        dist.reduce_scatter_tensor(
            out, rs_input(rank, world, 6, dtype), op=dist._make_nccl_premul_sum(0.125)
        )
        expected = (rs_expected(dist.ReduceOp.SUM, world, rank, 6, torch.float64) * 0.125).to(dtype)
        check(out, expected, f"reduce_scatter_tensor premul_sum {dtype}")


@case
def reduce_scatter_tensor_matches_gloo(rank, world, ref):
    x = torch.randn(world * 257, generator=torch.Generator().manual_seed(rank))
    out, g = torch.empty(257), torch.empty(257)
    dist.reduce_scatter_tensor(out, x, op=dist.ReduceOp.SUM)
    dist.reduce_scatter_tensor(g, x, op=dist.ReduceOp.SUM, group=ref)
    check(out, g, "reduce_scatter_tensor vs gloo")


@case
def reduce_scatter_list(rank, world, ref):
    for dtype in [torch.float32, torch.bfloat16, torch.int64]:
        for op in [dist.ReduceOp.SUM, dist.ReduceOp.AVG]:
            full = rs_input(rank, world, 4, dtype)
            out = torch.empty(4, dtype=dtype)
            dist.reduce_scatter(out, list(full.chunk(world)), op=op)
            check(out, rs_expected(op, world, rank, 4, dtype), f"reduce_scatter {op} {dtype}")


# ---------------------------------------------------------------- all-to-all


@case
def all_to_all_single_even_and_uneven(rank, world, ref):
    for dtype in [torch.float32, torch.int64, torch.uint8]:
        # even: rank r sends [r*100 + dst] to each dst
        inp = torch.tensor([rank * 10 + d for d in range(world)]).to(dtype)
        out = torch.empty(world, dtype=dtype)
        dist.all_to_all_single(out, inp)
        check(
            out,
            torch.tensor([s * 10 + rank for s in range(world)]).to(dtype),
            f"all_to_all_single even {dtype}",
        )
        # uneven: rank r sends (d + 1) elements to rank d
        in_splits = [d + 1 for d in range(world)]
        out_splits = [rank + 1] * world
        inp = torch.cat([torch.full((d + 1,), rank * 10 + d) for d in range(world)]).to(dtype)
        out = torch.empty(sum(out_splits), dtype=dtype)
        dist.all_to_all_single(out, inp, out_splits, in_splits)
        expected = torch.cat([torch.full((rank + 1,), s * 10 + rank) for s in range(world)]).to(
            dtype
        )
        check(out, expected, f"all_to_all_single uneven {dtype}")


@case
def all_to_all_list(rank, world, ref):
    ins = [torch.full((d + 2,), float(rank * 10 + d)) for d in range(world)]
    outs = [torch.empty(rank + 2) for _ in range(world)]
    dist.all_to_all(outs, ins)
    for s in range(world):
        check(outs[s], torch.full((rank + 2,), float(s * 10 + rank)), f"all_to_all from {s}")


# ----------------------------------------------------------------- p2p


@case
def send_recv_ring(rank, world, ref):
    if world == 1:
        return
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    for dtype in [torch.float32, torch.bfloat16, torch.int64]:
        got = torch.empty(100, dtype=dtype)
        if rank % 2 == 0:
            dist.send(data(rank, 100, dtype), nxt)
            dist.recv(got, prv)
        else:
            dist.recv(got, prv)
            dist.send(data(rank, 100, dtype), nxt)
        check(got, data(prv, 100, dtype), f"send/recv {dtype}")
    # isend/irecv posted in the same order on every rank
    got = torch.empty(4096)
    reqs = [dist.isend(data(rank, 4096, torch.float32), nxt), dist.irecv(got, prv)]
    for req in reqs:
        req.wait()
    check(got, data(prv, 4096, torch.float32), "isend/irecv")
    got = torch.empty(8)
    ops = [
        dist.P2POp(dist.isend, data(rank, 8, torch.float32), nxt),
        dist.P2POp(dist.irecv, got, prv),
    ]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    check(got, data(prv, 8, torch.float32), "batch_isend_irecv")


@case
def barrier_and_objects(rank, world, ref):
    dist.barrier()
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank, "payload": list(range(rank))})
    assert objs == [{"rank": r, "payload": list(range(r))} for r in range(world)], objs
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(("r", rank), gathered, dst=0)
    if rank == 0:
        assert gathered == [("r", r) for r in range(world)], gathered
    lst = [f"root-{i}" for i in range(3)] if rank == world - 1 else [None] * 3
    dist.broadcast_object_list(lst, src=world - 1)
    assert lst == [f"root-{i}" for i in range(3)], lst
    out = [None]
    dist.scatter_object_list(out, [f"to-{r}" for r in range(world)] if rank == 0 else None, src=0)
    assert out == [f"to-{rank}"], out


# ----------------------------------------------------------- coalesced forms


@case
def coalescing_manager_all_reduce(rank, world, ref):
    hsdp_backend.reset_comm_stats()
    ts = [data(rank, n, torch.float32) for n in (3, 0, 17, 1)]
    with dist._coalescing_manager():
        for t in ts:
            dist.all_reduce(t, op=dist.ReduceOp.AVG)
    for n, t in zip((3, 0, 17, 1), ts):
        check(
            t, reduce_ref(dist.ReduceOp.AVG, world, n, torch.float32), f"coalesced all_reduce n={n}"
        )
    stats = hsdp_backend.comm_stats()["all_reduce_coalesced"]
    assert stats == {"calls": 1, "collectives": 1, "bytes": 21 * 4}, stats


@case
def coalescing_manager_all_gather_and_reduce_scatter(rank, world, ref):
    sizes = (5, 1, 0, 12)
    for dtype in [torch.float32, torch.bfloat16]:
        hsdp_backend.reset_comm_stats()
        outs = [torch.empty(world * n, dtype=dtype) for n in sizes]
        with dist._coalescing_manager():
            for n, out in zip(sizes, outs):
                dist.all_gather_into_tensor(out, data(rank, n, dtype))
        for n, out in zip(sizes, outs):
            check(
                out,
                torch.cat([data(r, n, dtype) for r in range(world)]),
                f"coalesced all_gather {dtype} n={n}",
            )
        outs = [torch.empty(n, dtype=dtype) for n in sizes]
        with dist._coalescing_manager():
            for n, out in zip(sizes, outs):
                dist.reduce_scatter_tensor(
                    out, rs_input(rank, world, n, dtype), op=dist.ReduceOp.AVG
                )
        for n, out in zip(sizes, outs):
            check(
                out,
                rs_expected(dist.ReduceOp.AVG, world, rank, n, dtype),
                f"coalesced reduce_scatter {dtype} n={n}",
            )
        stats = hsdp_backend.comm_stats()
        assert stats["all_gather_into_tensor_coalesced"]["collectives"] == 1, stats
        assert stats["reduce_scatter_tensor_coalesced"]["collectives"] == 1, stats


@case
def coalesced_async(rank, world, ref):
    outs = [torch.empty(world * 3) for _ in range(2)]
    with dist._coalescing_manager(async_ops=True) as cm:
        for out in outs:
            dist.all_gather_into_tensor(out, data(rank, 3, torch.float32))
    cm.wait()
    for out in outs:
        check(
            out,
            torch.cat([data(r, 3, torch.float32) for r in range(world)]),
            "async coalesced all_gather",
        )


@case
def all_reduce_coalesced(rank, world, ref):
    # torch.distributed's own API (one dtype per call, checked by torch)
    hsdp_backend.reset_comm_stats()
    ts = [data(rank, n, torch.bfloat16) for n in (4, 3, 0, 2)]
    dist.all_reduce_coalesced(ts, op=dist.ReduceOp.AVG)
    for t in ts:
        check(t, reduce_ref(dist.ReduceOp.AVG, world, t.numel(), t.dtype), "all_reduce_coalesced")
    assert hsdp_backend.comm_stats()["all_reduce_coalesced"]["collectives"] == 1
    # hsdp's API takes mixed dtypes: one collective per dtype
    hsdp_backend.reset_comm_stats()
    ts = [data(rank, 4, torch.float32), data(rank, 3, torch.int64), data(rank, 2, torch.float32)]
    hsdp_backend.all_reduce_coalesced(ts, op=dist.ReduceOp.SUM)
    for t in ts:
        check(t, reduce_ref(dist.ReduceOp.SUM, world, t.numel(), t.dtype), f"mixed {t.dtype}")
    assert hsdp_backend.comm_stats()["all_reduce_coalesced"]["collectives"] == 2


@case
def hsdp_all_reduce_coalesced_buckets(rank, world, ref):
    hsdp_backend.reset_comm_stats()
    ts = [data(rank, n, torch.float32) for n in (10, 10, 10, 30, 1)]
    hsdp_backend.all_reduce_coalesced(ts, op=dist.ReduceOp.AVG, bucket_bytes=80)
    for t in ts:
        check(
            t, reduce_ref(dist.ReduceOp.AVG, world, t.numel(), torch.float32), "bucketed all_reduce"
        )
    # buckets of <= 80 bytes: [10,10] [10] [30] [1]
    assert hsdp_backend.comm_stats()["all_reduce_coalesced"]["collectives"] == 4
    # adjacent views of one buffer: reduced in place, no staging copy
    flat = torch.cat([data(rank, 6, torch.float32), data(rank + 1, 6, torch.float32)])
    views = [flat[:6], flat[6:]]
    work = hsdp_backend.all_reduce_coalesced(
        views, op=dist.ReduceOp.SUM, bucket_bytes=0, async_op=True
    )
    work.wait()
    check(views[0], reduce_ref(dist.ReduceOp.SUM, world, 6, torch.float32), "flat view 0")


# ------------------------------------------------------------------- async


@case
def async_work_contract(rank, world, ref):
    for op in [dist.ReduceOp.SUM, dist.ReduceOp.AVG]:  # pass-through and chained Work
        t = data(rank, 64, torch.float32)
        work = dist.all_reduce(t, op=op, async_op=True)
        fut = work.get_future()
        assert work.wait() is not False
        assert work.is_completed()
        check(t, reduce_ref(op, world, 64, torch.float32), f"async all_reduce {op}")
        value = fut.wait()
        check(value[0], reduce_ref(op, world, 64, torch.float32), f"future value {op}")
    out = torch.empty(4, dtype=torch.bfloat16)
    work = dist.reduce_scatter_tensor(
        out, rs_input(rank, world, 4, torch.bfloat16), op=dist.ReduceOp.AVG, async_op=True
    )
    work.wait()
    check(
        out,
        rs_expected(dist.ReduceOp.AVG, world, rank, 4, torch.bfloat16),
        "async reduce_scatter AVG",
    )


@case
def waited_work_leaves_the_inflight_registry(rank, world, ref):
    """Under allow_inflight_collective_as_graph_input (torch.compile's eager
    path) c10d registers every async Work with its tensors; wait() takes it
    off again, as gloo's and NCCL's Works do (else it leaks, with a warning
    at exit)."""
    from torch._C import _distributed_c10d as c10d

    def left_registered(issue):
        before = c10d._get_work_registry_size()
        issue().wait()
        return c10d._get_work_registry_size() - before

    c10d._set_allow_inflight_collective_as_graph_input(True)
    try:
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):  # pass-through and chained Work
            t = data(rank, 8, torch.float32)
            assert left_registered(lambda: dist.all_reduce(t, op=op, async_op=True)) == 0, op
            check(t, reduce_ref(op, world, 8, torch.float32), f"in-flight all_reduce {op}")
            # Gloo's own reduce-scatter Work stays registered (torch 2.14): no
            # more than that, where hsdp hands Gloo's Work through.
            out = torch.empty(4)
            rs = lambda g, o: (
                lambda: dist.reduce_scatter_tensor(  # noqa: E731
                    out, rs_input(rank, world, 4, torch.float32), op=o, group=g, async_op=True
                )
            )
            gloo_left = left_registered(rs(ref, dist.ReduceOp.SUM))
            assert left_registered(rs(None, op)) <= gloo_left, op
    finally:
        c10d._set_allow_inflight_collective_as_graph_input(False)


@case
def a_synchronous_call_returns_no_work(rank, world, ref):
    """A synchronous call (asyncOp False: what dist.all_reduce issues) whose
    result is in place when it returns hands back no Work, as NCCL's
    synchronous calls do (torch.distributed's functions take None for done):
    on the shared-memory engine, and wherever hsdp finishes the call itself
    (a strided tensor, staged through a copy); gloo's own Work passes
    through, NCCL's none. Under allow_inflight_collective_as_graph_input (torch.compile's
    eager path) c10d registers what a call returns with its tensors and
    wait_tensor() calls wait() on every entry, so there every call returns a
    complete Work, inside a coalescing block too: waiting for it, or
    wait_tensor() on the output, empties the registry again (a null entry
    would crash wait_tensor)."""
    from torch._C import _distributed_c10d as c10d

    want = sum(data(r, 16, torch.float32) for r in range(world))
    gloo_serves = engine_under_test() != "nccl_contract" and hsdp_backend.cpu_route() == "gloo"

    def synchronous_all_reduce(layout):
        t = data(rank, 16, torch.float32)
        if layout == "strided":
            t = torch.empty(16, 2)[:, 0].copy_(t)
        opts = dist.AllreduceOptions()
        opts.asyncOp = False
        return t, dist.distributed_c10d._get_default_group().allreduce([t], opts)

    for inflight in (False, True):
        c10d._set_allow_inflight_collective_as_graph_input(inflight)
        try:
            for layout in ("contiguous", "strided"):
                what = f"{layout}, in-flight registry {'on' if inflight else 'off'}"
                before = c10d._get_work_registry_size()
                t, work = synchronous_all_reduce(layout)
                gloo_passes = gloo_serves and layout == "contiguous"
                if inflight or gloo_passes:
                    assert work is not None, what
                    assert work.wait(), what
                else:
                    assert work is None, f"{what}: {work!r}"
                check(t, want, f"a synchronous all_reduce ({what})")
                assert c10d._get_work_registry_size() == before, what
                if inflight:
                    # What FSDP2 reads: its all-gather goes through the public
                    # function with async_op=False, which waits for the Work
                    # and returns None (torch 2.11-2.15), so wait_for_unshard
                    # takes its synchronous path on hsdp as on NCCL.
                    out = torch.empty(16 * world)
                    gathered = dist.all_gather_into_tensor(out, data(rank, 16, torch.float32))
                    assert gathered is None, f"{what}: all_gather_into_tensor gave {gathered!r}"
                    check(out, torch.cat([data(r, 16, torch.float32) for r in range(world)]), what)
                    assert c10d._get_work_registry_size() == before, what
                    t, _ = synchronous_all_reduce(layout)
                    torch.ops._c10d_functional.wait_tensor(t)
                    check(t, want, f"wait_tensor after a synchronous all_reduce ({what})")
                    assert c10d._get_work_registry_size() == before, what
            if inflight:  # in a coalescing block too (Python holds back no broadcast)
                b = data(rank, 16, torch.float32)
                with dist._coalescing_manager(device=torch.device("cpu")):
                    dist.broadcast(b, 0)
                assert c10d._get_work_registry_size() == before, "a synchronous call in a block"
                torch.ops._c10d_functional.wait_tensor(b)
                check(b, data(0, 16, torch.float32), "a synchronous broadcast in a block")
        finally:
            c10d._set_allow_inflight_collective_as_graph_input(False)


@case
@every_torch
def work_gives_up_the_gil_while_its_op_is_pending(rank, world, ref):
    """wait() gives up the GIL while the op is pending, as c10d's own
    Work.wait does: another Python thread of the waiting rank runs meanwhile
    (here while rank 0 waits for peers that join a second late; at world 1
    nothing is pending)."""
    import threading
    import time

    t = data(rank, 8, torch.float32)
    if rank != 0:
        time.sleep(1.0)
    work = dist.all_reduce(t, async_op=True)
    if rank == 0 and world > 1:
        ran = []
        thread = threading.Thread(target=lambda: (time.sleep(0.2), ran.append(time.monotonic())))
        thread.start()
        work.wait()
        returned = time.monotonic()
        thread.join(timeout=30)
        assert ran and ran[0] < returned, "no other thread ran while wait() waited for peers"
    else:
        work.wait()
    check(t, reduce_ref(dist.ReduceOp.SUM, world, 8, torch.float32), "all_reduce waited for")


# -------------------------------------------------------- subgroups, meshes


@case
def subgroups(rank, world, ref):
    members = list(range(0, world, 2))  # even ranks
    g = dist.new_group(members, backend="hsdp")
    if rank in members:
        t = torch.ones(3) * (rank + 1)
        dist.all_reduce(t, op=dist.ReduceOp.AVG, group=g)
        check(
            t, torch.ones(3) * (sum(m + 1 for m in members) / len(members)), "subgroup all_reduce"
        )
        out = torch.empty(len(members))
        dist.all_gather_into_tensor(out, torch.tensor([float(rank)]), group=g)
        check(out, torch.tensor([float(m) for m in members]), "subgroup all_gather")
    dist.destroy_process_group(g)
    # default-backend subgroup (new_group reuses hsdp)
    g2 = dist.new_group(list(range(world)))
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=g2)
    check(t, torch.tensor([float(sum(range(world)))]), "default-backend subgroup")
    assert hsdp_backend.comm_stats(g2)["all_reduce"]["calls"] == 1


@case
def device_mesh_2x2(rank, world, ref):
    if world != 4:
        return
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for dim in ("replicate", "shard"):
        g = mesh.get_group(dim)
        peers = dist.get_process_group_ranks(g)
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=g)
        check(t, torch.tensor([float(sum(peers))]), f"mesh {dim} all_reduce")
        assert "all_reduce" in hsdp_backend.comm_stats(g)
        assert hsdp_backend.cpu_route(g) == expected_engine(peers), (dim, peers)


@case
def split_group_by_parity(rank, world, ref):
    """ProcessGroup.split_group, what dist.split_group and DeviceMesh call for
    a default group bound to a GPU (that path itself needs a GPU)."""
    import gc

    from hsdp_backend import _C

    parent = dist.distributed_c10d._get_default_group()
    mine = [r for r in range(world) if r % 2 == rank % 2]
    child = parent.split_group(mine, group_name=f"hsdp-split-{world}-{rank % 2}")
    assert (child.rank(), child.size()) == (mine.index(rank), len(mine)), (
        child.rank(),
        child.size(),
    )
    assert _C.is_hsdp(child._get_backend(torch.device("cpu")))
    assert hsdp_backend.cpu_route(child) == expected_engine(mine)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.AVG
    t = torch.full((6,), float(rank))
    work = child.allreduce([t], opts)
    if work is not None:
        work.wait()
    check(t, torch.full((6,), sum(mine) / len(mine)), "split child all_reduce AVG")
    out = torch.empty(len(mine) * 3)
    work = child._allgather_base(out, torch.full((3,), float(rank)))
    if work is not None:
        work.wait()
    check(
        out, torch.tensor([float(r) for r in mine]).repeat_interleave(3), "split child all_gather"
    )
    del child, work
    gc.collect()  # the child's shared memory goes with it
    # torch's new_group asks non-members of a bound (GPU) default group for
    # an NCCL no-color split: on hsdp there is nothing to do (that path
    # itself needs a GPU to reach).
    assert (
        parent._get_backend(torch.device("cpu")).perform_nocolor_split(torch.device("cpu")) is None
    )


# ------------------------------------------------------------ comm_stats


@case
def comm_stats_counts_and_resets(rank, world, ref):

    hsdp_backend.reset_comm_stats()
    assert hsdp_backend.comm_stats() == {}
    t = torch.zeros(10)
    for _ in range(3):
        dist.all_reduce(t)
    out = torch.empty(world * 10)
    dist.all_gather_into_tensor(out, t)
    stats = hsdp_backend.comm_stats()
    assert stats["all_reduce"] == {"calls": 3, "collectives": 3, "bytes": 120}, stats
    assert stats["all_gather_into_tensor"] == {"calls": 1, "collectives": 1, "bytes": 40}, stats
    if expected_engine(list(range(world))) == "hierarchical":
        # Both phases of each call. Across hosts (2 here): at least one round
        # per call, and the bytes this rank sent: half of the 40 each way
        # for an all-reduce (reduce my half, send it back), 40 for the
        # all-gather. Within hosts only when a host holds more than one rank.
        assert stats["inter_host"]["calls"] >= 4, stats
        assert stats["inter_host"]["bytes"] == 3 * 40 + 40, stats
        hosts = _hosts()[:world]
        within = 4 if hosts.count(hosts[0]) > 1 else 0
        assert stats.get("intra_host", {}).get("calls", 0) == within, stats
    else:
        assert "inter_host" not in stats, stats
    try:
        hsdp_backend.comm_stats(ref)
    except TypeError as exc:
        assert "not hsdp" in str(exc)
    else:
        raise AssertionError("comm_stats on a gloo group must raise TypeError")


def _hosts() -> list[str]:
    """Each global rank's host: pretended, or the real ones a test on
    simulated hosts found; [] when neither is known (one host)."""
    return settings.read("HSDP_TEST_HOSTS") or settings.read("HSDP_TEST_EXPECTED_HOSTS")


def expected_engine(members: list[int]) -> str:
    """What cpu_route says for a group of these global ranks, from
    HSDP_CPU_ROUTE and the hosts the ranks are on: pretended (HSDP_TEST_HOSTS),
    or real ones as a test on simulated hosts found them
    (HSDP_TEST_EXPECTED_HOSTS)."""
    engine = engine_under_test()
    if engine != "auto":
        return engine
    hosts = _hosts()
    if not hosts:
        return "shm"
    mine = [hosts[r] for r in members]
    if "?" in mine and len(members) > 1:
        return "gloo"
    per_host = {mine.count(h) for h in mine}
    if len(set(mine)) == 1:
        return "shm"
    return "hierarchical" if len(per_host) == 1 else "gloo"


@case
def route_in_use(rank, world, ref):
    assert hsdp_backend.cpu_route() == expected_engine(list(range(world)))
    with pytest.warns(DeprecationWarning, match="now cpu_route"):
        assert hsdp_backend.cpu_engine() == hsdp_backend.cpu_route()  # its earlier name


@case
def large_messages(rank, world, ref):
    """Sizes past one pipeline slot and past the direct-read threshold."""

    from hsdp_backend import _C

    if config.read("HSDP_CPU_ROUTE") in ("auto", "shm") and world > 1:
        engine, _, direct_from = _C.cpu_route(hsdp_backend.get_hsdp_backend())
        expected = expected_engine(list(range(world)))
        assert engine == expected, (engine, expected)
        # Ranks of one user may read each other's memory, and a group reads
        # directly from 2 MiB a rank at most (with the default slot).
        assert engine == "gloo" or 0 < direct_from <= 5 << 20, direct_from
    n = (5 << 20) // 4 + 3  # 5 MiB + 12 bytes of fp32: more than one 4 MiB slot
    out = torch.empty(world * n)
    dist.all_gather_into_tensor(out, data(rank, n, torch.float32))
    check(out, torch.cat([data(r, n, torch.float32) for r in range(world)]), "large all_gather")
    out.zero_()
    shard = out.narrow(0, rank * n, n)
    shard.copy_(data(rank, n, torch.float32))
    dist.all_gather_into_tensor(out, shard)
    check(
        out,
        torch.cat([data(r, n, torch.float32) for r in range(world)]),
        "large in-place all_gather",
    )
    t = data(rank, n, torch.bfloat16)
    dist.broadcast(t, src=world - 1)
    check(t, data(world - 1, n, torch.bfloat16), "large broadcast")
    t = data(rank, n, torch.float32)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    check(t, reduce_ref(dist.ReduceOp.AVG, world, n, torch.float32), "large all_reduce")
    o = torch.empty(n)
    dist.reduce_scatter_tensor(o, rs_input(rank, world, n, torch.float32))
    check(o, rs_expected(dist.ReduceOp.SUM, world, rank, n, torch.float32), "large reduce_scatter")


@case
def layouts_differ_between_ranks(rank, world, ref):
    """Ranks may pass differently laid out tensors (a transposed view here,
    a contiguous one there): every rank must still take the same engine."""

    def shaped(t):  # rank-dependent layout, same values
        if rank % 2:
            return t.reshape(4, -1).t().contiguous().t()  # same shape, column-major
        return t.reshape(4, -1)

    base = data(rank, 4 * 3000, torch.float32)
    t = shaped(base.clone())
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    check(
        t.reshape(-1),
        reduce_ref(dist.ReduceOp.AVG, world, 4 * 3000, torch.float32),
        "all_reduce, mixed layouts",
    )
    t = shaped(data(rank, 4 * 3000, torch.float32))
    dist.broadcast(t, src=0)
    check(t.reshape(-1), data(0, 4 * 3000, torch.float32), "broadcast, mixed layouts")
    outs = [shaped(torch.zeros(4 * 3000)) for _ in range(world)]
    dist.all_gather(outs, shaped(data(rank, 4 * 3000, torch.float32)))
    for r in range(world):
        check(outs[r].reshape(-1), data(r, 4 * 3000, torch.float32), f"all_gather list from {r}")
    out = shaped(torch.zeros(4 * 3000))
    dist.reduce_scatter_tensor(out, rs_input(rank, world, 4 * 3000, torch.float32))
    check(
        out.reshape(-1),
        rs_expected(dist.ReduceOp.SUM, world, rank, 4 * 3000, torch.float32),
        "reduce_scatter output layout",
    )


@case
def completion_callback_issues_a_collective(rank, world, ref):
    """A future's callback runs after the group's queue is free, so it may
    call a collective on the same group (here: synchronously)."""
    t = torch.ones(8)
    u = torch.full((8,), float(rank))
    fut = dist.all_reduce(t, async_op=True).get_future()
    chained = fut.then(lambda f: dist.all_reduce(u))
    chained.wait()
    check(t, torch.full((8,), float(world)), "first")
    check(u, torch.full((8,), float(sum(range(world)))), "issued from the callback")


@case
def batch_isend_irecv_exchanges_large_messages_both_ways(rank, world, ref):
    """hsdp reports coalescing, so batch_isend_irecv issues its ops as one
    batch: on NCCL one group launch, without which a symmetric exchange of
    messages larger than NCCL buffers deadlocks (the NCCL-contract double
    models that bound)."""
    if world == 1:
        return
    assert hsdp_backend.get_hsdp_backend().supports_coalescing
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    for n in (3, 1 << 18):  # 1 MiB of fp32: over the double's bound
        big = torch.full((n,), float(rank))
        got = torch.empty(n)
        works = dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, big, nxt), dist.P2POp(dist.irecv, got, prv)]
        )
        for w in works:
            w.wait()
        check(got, torch.full((n,), float(prv)), f"ring exchange of {n} floats")
    # both directions with each neighbour, in one batch
    if world > 2:
        a, b = torch.empty(1 << 18), torch.empty(1 << 18)
        ops = [
            dist.P2POp(dist.isend, torch.full((1 << 18,), float(rank)), nxt),
            dist.P2POp(dist.isend, torch.full((1 << 18,), float(rank)), prv),
            dist.P2POp(dist.irecv, a, prv),
            dist.P2POp(dist.irecv, b, nxt),
        ]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        check(a, torch.full((1 << 18,), float(prv)), "from the previous rank")
        check(b, torch.full((1 << 18,), float(nxt)), "from the next rank")


@case
def work_wait_honours_its_timeout(rank, world, ref):
    import datetime
    import time

    if world == 1:
        return
    # A group timeout shorter than the world's: a hierarchical group's
    # pending inter-host phase (a Gloo collective, which nothing can cancel)
    # ends at that deadline, so leaving the group takes at most that long.
    g = dist.new_group(backend="hsdp", timeout=datetime.timedelta(seconds=5))
    if rank == 0:
        work = dist.all_reduce(torch.ones(4), group=g, async_op=True)  # nobody else joins
        start = time.monotonic()
        try:
            work.wait(timeout=datetime.timedelta(milliseconds=500))
        except RuntimeError as exc:  # DistBackendError is a RuntimeError
            # gloo says "Operation timed out!"; NCCL "... ran for N milliseconds
            # before timing out" (and aborts the group's communicator)
            assert "timed out" in str(exc).lower() or "before timing out" in str(exc), exc
        else:
            raise AssertionError("wait(timeout) must raise")
        assert time.monotonic() - start < 5
    dist.barrier(group=ref)
    # Leaving the broken group fails its pending work at once (no drain to
    # the world's 60 s timeout): on shared memory at once, across hosts by
    # the group's own deadline.
    start = time.monotonic()
    dist.destroy_process_group(g)
    assert time.monotonic() - start < 10
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == world
