"""The c10d surface beyond hsdp's own fast paths, each checked against gloo
on the same ranks (``ref``, a gloo group) or against exact values: what
PyTorch's c10d suites check for gloo (sparse all-reduce, several tensors per
rank, uneven list reduce-scatter, the exception types of bad arguments) and
what users call that the suites do not reach (monitored_barrier,
batch_isend_irecv, uneven all_to_all_single, large object collectives,
Work.exception and future chains, abort/shutdown then a new group, sequence
numbers). Cases run in order on every rank, as in ops_cases.py.
"""

from __future__ import annotations

import datetime
import re

import torch
import torch.distributed as dist
from error_cases import work_error
from ops_cases import check, data
from torch.testing._internal.common_distributed import simple_sparse_reduce_tests

import hsdp_backend
from hsdp_backend import _torch_compat

CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def error_of(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        return exc
    return None


def pg(group):
    return group or dist.group.WORLD


def root_options(kind, root_tensor):
    opts = kind()
    opts.rootRank, opts.rootTensor = 0, root_tensor
    return opts


def dense(t: torch.Tensor) -> torch.Tensor:
    return t.coalesce().to_dense() if t.is_sparse else t


# ------------------------------------------------------------------ sparse


@case
def sparse_all_reduce(rank, world, ref):
    """Sparse tensors go to the inner gloo, which sums them; AVG and
    PREMUL_SUM are that sum and hsdp's one scaling step (gloo refuses them)."""
    for inputs, outputs in simple_sparse_reduce_tests(rank, world, num_inputs=1):
        for group in (None, ref):
            t = inputs[0].clone()
            dist.all_reduce(t, group=group)
            check(dense(t), dense(outputs[0]), f"sparse SUM on {dist.get_backend(group)}")
        t = inputs[0].clone()
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        check(dense(t), dense(outputs[0]) / world, "sparse AVG")
        assert isinstance(
            error_of(lambda: dist.all_reduce(inputs[0].clone(), op=dist.ReduceOp.AVG, group=ref)),
            RuntimeError,
        )
        t = inputs[0].clone()
        dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
        check(dense(t), dense(outputs[0]) * 0.5, "sparse PREMUL_SUM")


@case
def ddp_sparse_embedding_gradients(rank, world, ref):
    """DDP with nn.Embedding(sparse=True): the same parameters as on gloo."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    models = []
    for group in (None, ref):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Embedding(32, 8, sparse=True), torch.nn.Linear(8, 2))
        models.append(DDP(net, process_group=group))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    for step in range(3):
        idx = torch.tensor([[rank, (rank * 7 + step) % 32, 5]])
        for model, opt in zip(models, opts):
            opt.zero_grad()
            model(idx).sum().backward()
            opt.step()
    params = [dict(m.named_parameters()) for m in models]
    # The embedding's sparse gradients take gloo's own path: bitwise equal.
    # The dense ones are summed by hsdp's engine in another order than gloo's
    # ring: equal within float rounding.
    for name, p in params[0].items():
        q = params[1][name]
        if name.startswith("module.0."):
            assert torch.equal(p, q), f"{name}: hsdp and gloo differ by {(p - q).abs().max()}"
        else:
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6, msg=lambda m: f"{name}: {m}")


# ----------------------------------------------------- several tensors per rank


@case
def several_tensors_per_rank(rank, world, ref):
    """The list form of all_reduce / broadcast / all_gather (one call, k
    tensors per rank) as gloo serves it; AVG averages all k x world."""
    pg = dist.group.WORLD
    k = 2

    def inputs():
        return [data(rank * k + i, 9, torch.float32) for i in range(k)]

    for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.AVG):
        got = inputs()
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        pg.allreduce(got, opts).wait()
        everything = torch.stack([data(q, 9, torch.float32) for q in range(world * k)])
        if op == dist.ReduceOp.AVG:  # gloo averages only its first tensor
            want = [everything.sum(0) / (world * k)] * k
        else:
            want = inputs()
            ref.allreduce(want, opts).wait()
        for i in range(k):
            check(got[i], want[i], f"list all_reduce {op} tensor {i}")
    for root in range(world):
        for root_tensor in range(k):
            opts = dist.BroadcastOptions()
            opts.rootRank, opts.rootTensor = root, root_tensor
            got, want = inputs(), inputs()
            pg.broadcast(got, opts).wait()
            ref.broadcast(want, opts).wait()
            for i in range(k):
                check(got[i], want[i], f"list broadcast root {root}/{root_tensor}")
    got = [[torch.empty(9) for _ in range(world * k)] for _ in range(k)]
    want = [[torch.empty(9) for _ in range(world * k)] for _ in range(k)]
    pg.allgather(got, inputs()).wait()
    ref.allgather(want, inputs()).wait()
    for i in range(k):
        for j in range(world * k):
            check(got[i][j], want[i][j], f"list all_gather [{i}][{j}]")


@case
def reduce_scatter_list_uneven(rank, world, ref):
    """Rank q's output has its own size: the list form serves it (as gloo)."""
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        ins = [data(rank, q + 1, torch.float32) + q for q in range(world)]
        out = torch.empty(rank + 1)
        dist.reduce_scatter(out, ins, op=op)
        want = sum(data(s, rank + 1, torch.float32) + rank for s in range(world))
        check(out, want / world if op == dist.ReduceOp.AVG else want, f"uneven reduce_scatter {op}")
        if op == dist.ReduceOp.SUM:
            out_gloo = torch.empty(rank + 1)
            dist.reduce_scatter(out_gloo, ins, group=ref)
            check(out, out_gloo, "uneven reduce_scatter against gloo")


# ---------------------------------------------------------- bad arguments


@case
def bad_arguments_raise_what_gloo_raises(rank, world, ref):
    """Each mistake (every rank makes it: no collective starts) raises an
    instance of the class gloo raises for it, and names hsdp's rank and op."""
    f32, n = torch.float32, 3
    mistakes = {
        "all_gather: too many outputs": lambda g: dist.all_gather(
            [torch.empty(n)] * (world + 1), torch.ones(n), group=g
        ),
        "all_gather: wrong output size": lambda g: dist.all_gather(
            [torch.empty(n + 1)] * world, torch.ones(n), group=g
        ),
        "all_gather_into_tensor: wrong size": lambda g: dist.all_gather_into_tensor(
            torch.empty(n * world + 1), torch.ones(n), group=g
        ),
        "all_gather_into_tensor: wrong dtype": lambda g: dist.all_gather_into_tensor(
            torch.empty(n * world, dtype=torch.int32), torch.ones(n), group=g
        ),
        "reduce_scatter_tensor: wrong size": lambda g: dist.reduce_scatter_tensor(
            torch.empty(n), torch.ones(n * world + 1), group=g
        ),
        "reduce_scatter_tensor: wrong dtype": lambda g: dist.reduce_scatter_tensor(
            torch.empty(n, dtype=torch.int32), torch.ones(n * world), group=g
        ),
        "reduce_scatter: too many inputs": lambda g: dist.reduce_scatter(
            torch.empty(n), [torch.ones(n)] * (world + 1), group=g
        ),
        "all_reduce: BXOR on floats": lambda g: dist.all_reduce(
            torch.ones(n, dtype=f32), op=dist.ReduceOp.BXOR, group=g
        ),
        "all_to_all_single: too many splits": lambda g: dist.all_to_all_single(
            torch.empty(world + 1),
            torch.ones(world + 1),
            [1] * (world + 1),
            [1] * (world + 1),
            group=g,
        ),
        "broadcast: no such source": lambda g: dist.broadcast(
            torch.ones(n), src=world + 2, group=g
        ),
        "broadcast: no such root tensor": lambda g: pg(g).broadcast(
            [torch.ones(n)], root_options(dist.BroadcastOptions, 1)
        ),
        "reduce: no such root tensor": lambda g: pg(g).reduce(
            [torch.ones(n)], root_options(dist.ReduceOptions, 1)
        ),
        "all_reduce_coalesced: sparse tensors": lambda g: pg(g).allreduce_coalesced(
            [torch.ones(n).to_sparse()] * 2, dist.AllreduceCoalescedOptions()
        ),
    }
    for what, call in mistakes.items():
        gloo_error = error_of(lambda: call(ref))
        assert gloo_error is not None, f"{what}: gloo accepted it"
        hsdp_error = error_of(lambda: call(None))
        assert isinstance(hsdp_error, type(gloo_error)), (
            f"{what}: gloo raises {type(gloo_error).__name__}, hsdp {type(hsdp_error).__name__}: {hsdp_error}"
        )
        if isinstance(hsdp_error, (hsdp_backend.ArgumentError, hsdp_backend.ArgumentTypeError)):
            assert re.match(rf"\[rank {rank}/{world}\] \w+: ", str(hsdp_error)), hsdp_error
    # Both are also what NCCL raises for such arguments.
    assert issubclass(hsdp_backend.ArgumentError, ValueError) and issubclass(
        hsdp_backend.ArgumentError, RuntimeError
    )
    assert issubclass(hsdp_backend.ArgumentTypeError, TypeError) and issubclass(
        hsdp_backend.ArgumentTypeError, RuntimeError
    )
    dist.barrier()


@case
def async_ops_keep_the_callers_inference_mode(rank, world, ref):
    """Async collectives on inference tensors, under inference mode: the
    work runs on another thread, which gets the caller's thread-local state
    (as gloo's workers do), so writing the outputs is allowed there."""
    with torch.inference_mode():
        for group in (None, ref):
            outs = [torch.empty(5) for _ in range(world)]
            works = [
                dist.all_gather(outs, data(rank, 5, torch.float32), group=group, async_op=True)
            ]
            t = data(rank, 5, torch.float32)
            works.append(
                dist.all_reduce(
                    t,
                    op=dist.ReduceOp.AVG if group is None else dist.ReduceOp.SUM,
                    group=group,
                    async_op=True,
                )
            )
            for w in works:
                w.wait()
            for r in range(world):
                check(
                    outs[r],
                    data(r, 5, torch.float32),
                    f"all_gather under inference mode on {dist.get_backend(group)}",
                )
            total = sum(data(r, 5, torch.float32) for r in range(world))
            check(
                t,
                total / world if group is None else total,
                f"all_reduce under inference mode on {dist.get_backend(group)}",
            )


# ------------------------------------------------------- monitored_barrier


@case
def global_ranks_of_a_group_are_in_its_options(rank, world, ref):
    """As torch's own groups carry them (the barrier's guess of a rank's GPU reads the global
    rank, as ProcessGroupNCCL::guessDeviceForRank): the default group and a new group (a
    split's child: tests/cpp/backend_test.cpp)."""
    import hsdp_testing

    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    assert hsdp_testing.global_ranks_in_group(backend) == list(range(world))
    last = [world - 1]
    group = dist.new_group(last)
    if rank == world - 1:
        sub = group._get_backend(torch.device("cpu"))
        assert hsdp_testing.global_ranks_in_group(sub) == last
    dist.destroy_process_group(group)


@case
def monitored_barrier(rank, world, ref):
    """Every rank arrives: it returns, with and without wait_all_ranks. The
    last rank never arrives: every rank that called it raises within the
    timeout, and rank 0's error names the missing rank, as on gloo."""
    if not _torch_compat.MONITORED_BARRIER_ON_ANY_BACKEND:
        # torch < 2.14 refuses it in Python on any group but gloo's.
        err = error_of(lambda: dist.monitored_barrier(timeout=datetime.timedelta(seconds=60)))
        assert isinstance(err, ValueError) and "only implemented for GLOO" in str(err), err
        return
    timeout = datetime.timedelta(seconds=1)
    for wait_all in (False, True):
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=60), wait_all_ranks=wait_all)
    if world == 1:
        return
    for wait_all in (False, True):
        errors = {}
        for backend in ("hsdp", "gloo"):
            g = dist.new_group(backend=backend)
            if rank != world - 1:
                errors[backend] = error_of(
                    lambda: dist.monitored_barrier(g, timeout=timeout, wait_all_ranks=wait_all)
                )
            dist.barrier()  # on the default group: everyone is past the failure
            dist.destroy_process_group(g)
        if rank == world - 1:
            continue
        for backend, err in errors.items():
            assert isinstance(err, RuntimeError), f"{backend}, wait_all_ranks={wait_all}: {err!r}"
        assert type(errors["hsdp"]) is type(errors["gloo"]), errors
        if rank == 0:
            assert f"{world - 1}" in str(errors["hsdp"]), errors["hsdp"]


# ------------------------------------------------------------------- p2p


@case
def batch_isend_irecv_mixed(rank, world, ref):
    """Sends and receives both ways round the ring, of different sizes and
    dtypes, in one batch. (Messages between two ranks match in the order they
    were posted, on gloo as on NCCL: with 2 ranks both directions share a pair.)"""
    if world == 1:
        return
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    from_prv = torch.empty(3 * (prv + 1))
    from_nxt = torch.empty(5 + nxt, dtype=torch.int64)
    ops = [
        dist.P2POp(dist.isend, data(rank, 3 * (rank + 1), torch.float32), nxt),
        dist.P2POp(dist.irecv, from_prv, prv),
        dist.P2POp(dist.isend, data(rank, 5 + rank, torch.int64), prv),
        dist.P2POp(dist.irecv, from_nxt, nxt),
    ]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    check(
        from_prv,
        data(prv, 3 * (prv + 1), torch.float32),
        "batch_isend_irecv from the previous rank",
    )
    check(from_nxt, data(nxt, 5 + nxt, torch.int64), "batch_isend_irecv from the next rank")


# ------------------------------------------------------------ all_to_all


@case
def all_to_all_single_uneven_with_empty_splits(rank, world, ref):
    """Rank r sends (r + d) % 3 rows (some none) of a 2-D tensor to rank d."""

    def rows(src, dst):
        return (src + dst) % 3

    for dtype in (torch.float32, torch.bfloat16, torch.int32):
        in_splits = [rows(rank, d) for d in range(world)]
        out_splits = [rows(s, rank) for s in range(world)]
        inp = torch.cat([torch.full((rows(rank, d), 4), rank * 10 + d) for d in range(world)]).to(
            dtype
        )
        outs = [torch.full((sum(out_splits), 4), -1).to(dtype) for _ in range(2)]
        dist.all_to_all_single(outs[0], inp, out_splits, in_splits)
        dist.all_to_all_single(outs[1], inp, out_splits, in_splits, group=ref)
        want = torch.cat([torch.full((rows(s, rank), 4), s * 10 + rank) for s in range(world)]).to(
            dtype
        )
        check(outs[0], want, f"all_to_all_single {dtype}")
        check(outs[0], outs[1], f"all_to_all_single {dtype} against gloo")


# -------------------------------------------------------- object collectives


@case
def object_collectives_with_large_pickles(rank, world, ref):
    """Objects of several MiB each (sizes differ between ranks)."""

    def obj(r):
        g = torch.Generator().manual_seed(r)
        return {
            "rank": r,
            "blob": torch.randint(0, 256, (3 * 2**20 + 4099 * r,), generator=g, dtype=torch.uint8)
            .numpy()
            .tobytes(),
        }

    got = [None] * world
    dist.all_gather_object(got, obj(rank))
    assert got == [obj(r) for r in range(world)], "all_gather_object"
    root = world - 1
    lst = [obj(root), obj(root + 1)] if rank == root else [None, None]
    dist.broadcast_object_list(lst, src=root)
    assert lst == [obj(root), obj(root + 1)], "broadcast_object_list"
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(obj(rank), gathered, dst=0)
    if rank == 0:
        assert gathered == [obj(r) for r in range(world)], "gather_object"
    out = [None]
    dist.scatter_object_list(out, [obj(10 + r) for r in range(world)] if rank == 0 else None, src=0)
    assert out == [obj(10 + rank)], "scatter_object_list"


# ------------------------------------------------------------- Work, futures


@case
def work_exception_and_future_chains(rank, world, ref):
    """A chain of then() callbacks sees the result; a failed collective
    (only rank 0 calls it) reports its error through wait(), exception() and
    the whole future chain, within the group's timeout, as gloo's does."""
    t = data(rank, 16, torch.float32)
    work = dist.all_reduce(t, async_op=True)
    chained = work.get_future().then(lambda f: f.value()[0] * 2).then(lambda f: f.value() + 1)
    want = sum(data(r, 16, torch.float32) for r in range(world))
    check(chained.wait(), want * 2 + 1, "future chain")
    assert work.wait() and work_error(work) is None
    check(t, want, "all_reduce under a future chain")
    if world == 1:
        return
    errors = {}
    for backend in ("hsdp", "gloo"):
        g = dist.new_group(backend=backend, timeout=datetime.timedelta(seconds=2))
        if rank == 0:
            work = dist.all_reduce(torch.ones(4), group=g, async_op=True)
            chained = work.get_future().then(lambda f: f.value()[0] + 1)
            errors[backend] = error_of(work.wait)
            assert errors[backend] is not None, (
                f"{backend}: a collective nobody else joined completed"
            )
            assert error_of(chained.wait) is not None, (
                f"{backend}: the future chain hid the failure"
            )
            if backend == "hsdp":
                assert work_error(work) is not None
        dist.barrier()
        dist.destroy_process_group(g)
    if rank == 0:
        assert isinstance(errors["hsdp"], type(errors["gloo"])), errors


# ------------------------------------------------------- group lifecycle


@case
def abort_or_shutdown_then_a_new_group(rank, world, ref):
    """A group aborted or shut down frees what it held; the next group works."""
    for end in ("shutdown", "abort"):
        g = dist.new_group(backend="hsdp")
        t = torch.ones(8)
        dist.all_reduce(t, group=g)
        check(t, torch.full((8,), float(world)), f"before {end}")
        dist.barrier()  # nobody ends g while a peer still uses it
        getattr(g, end)()
        dist.destroy_process_group(g)
        g = dist.new_group(backend="hsdp")
        t = torch.ones(8)
        dist.all_reduce(t, group=g)
        check(t, torch.full((8,), float(world)), f"a new group after {end}")
        dist.destroy_process_group(g)


@case
def sequence_numbers_count_collectives_as_gloo(rank, world, ref):
    """A new group starts at 0 on every rank and counts each collective (not
    point-to-point calls), as gloo's does, whatever engine serves it."""

    def seq(g):
        if _torch_compat.SEQUENCE_NUMBERS_OF_ANY_BACKEND:
            return g._get_sequence_number_for_group()
        return g._get_backend(torch.device("cpu"))._get_sequence_number_for_group()

    def run(g):
        seqs = [seq(g)]
        for step in (
            lambda: dist.all_reduce(torch.ones(4), group=g),
            lambda: dist.broadcast(torch.ones(4), src=0, group=g),
            lambda: dist.all_gather_into_tensor(torch.empty(4 * world), torch.ones(4), group=g),
            lambda: dist.reduce_scatter_tensor(torch.empty(4), torch.ones(4 * world), group=g),
            lambda: dist.barrier(group=g),
        ):
            step()
            seqs.append(seq(g))
        return seqs

    got, want = run(dist.new_group(backend="hsdp")), run(dist.new_group(backend="gloo"))
    assert got == want, f"hsdp {got}, gloo {want}"
    everyone = [None] * world
    dist.all_gather_object(everyone, got)
    assert all(s == got for s in everyone), everyone
