"""Callbacks of an hsdp Work's future that issue collectives and wait for
them (run by test_callbacks.py on every route, 2 and 4 ranks).

A future's callbacks run on the thread that completes it: for hsdp's engine
and its inner routes that is one of the group's workers, the thread that
also runs the group's queued collectives. A callback that waits for a
collective it issued must therefore find another worker to run it, as it
does on gloo (whose pool of worker threads serves the next op while one
completes a future). Each case is a form that hung before the queue kept a
worker free (see csrc/backend/OpQueue.hpp), and compares with gloo or an
exact answer.
"""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist
from c10d_surface_cases import error_of

CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def check(actual, expected, what):
    assert torch.equal(actual, expected), f"{what}: got {actual}, expected {expected}"


def summed(world, n=8, offset=0.0):
    """What all_reduce(SUM) of torch.full((n,), rank + 1 + offset) gives."""
    return torch.full((n,), sum(r + 1 + offset for r in range(world)))


# ---------------------------------------------- the three forms, and nested


@case
def callback_waits_on_future_of_async_collective(rank, world, ref):
    t = torch.full((8,), rank + 1.0)

    def cb(_):
        return dist.all_reduce(t, async_op=True).get_future().wait()[0]

    fut = dist.all_reduce(torch.ones(65536), async_op=True).get_future().then(cb)
    check(fut.wait(), summed(world), "the callback's all_reduce")


@case
def callback_waits_on_work_of_async_collective(rank, world, ref):
    t = torch.full((8,), rank + 1.0)

    def cb(_):
        dist.all_reduce(t, async_op=True).wait()
        return t

    fut = dist.all_reduce(torch.ones(65536), async_op=True).get_future().then(cb)
    check(fut.wait(), summed(world), "the callback's all_reduce")


@case
def callback_calls_blocking_collective_with_work_queued(rank, world, ref):
    """A blocking call from the callback of the first of several async
    collectives, the others still queued: the call waits its turn, which
    another worker serves. (The callback is attached after every op was
    issued, so every rank issues the callback's last.)"""
    t = torch.full((8,), rank + 1.0)
    later = [torch.full((4,), float(rank)) for _ in range(3)]

    def cb(_):
        dist.all_reduce(t)
        return t

    first = dist.all_reduce(torch.ones(1 << 20), async_op=True)
    works = [dist.all_reduce(x, async_op=True) for x in later]
    fut = first.get_future().then(cb)
    check(fut.wait(), summed(world), "the callback's all_reduce")
    for w, x in zip(works, later):
        w.wait()
        check(x, torch.full((4,), float(sum(range(world)))), "issued before the callback's")


@case
def callback_waits_on_a_collective_issued_after_it(rank, world, ref):
    """The callback of a long all_reduce waits for a second all_reduce the
    main thread issued before attaching it: queued behind the callback's own
    completion step, it is taken by another worker after a short wait."""
    t = torch.full((8,), rank + 1.0)
    first = dist.all_reduce(torch.ones(1 << 22), async_op=True)  # 16 MiB: still running below
    second = dist.all_reduce(t, async_op=True)

    def cb(_):
        second.wait()
        return t

    check(first.get_future().then(cb).wait(), summed(world), "the second all_reduce")


@case
def nested_callbacks_three_deep(rank, world, ref):
    """Each level's callback issues an async collective, chains the next level
    on its future and waits for the whole chain."""
    depth = 3
    ts = [torch.full((8,), rank + 1.0 + k) for k in range(depth)]

    def level(k):
        def cb(_):
            fut = dist.all_reduce(ts[k], async_op=True).get_future()
            if k + 1 < depth:
                fut = fut.then(level(k + 1))
            return fut.wait()

        return cb

    out = dist.all_reduce(torch.ones(4), async_op=True).get_future().then(level(0)).wait()
    for k in range(depth):
        check(ts[k], summed(world, offset=k), f"level {k}")
    check(out[0] if isinstance(out, list) else out, summed(world, offset=depth - 1), "innermost")


@case
def chain_of_callbacks_each_waiting(rank, world, ref):
    ts = [torch.full((8,), rank + 1.0 + k) for k in range(3)]

    def step(k):
        def cb(_):
            dist.all_reduce(ts[k], async_op=True).wait()
            return ts[k]

        return cb

    fut = dist.all_reduce(torch.ones(4), async_op=True).get_future()
    for k in range(3):
        fut = fut.then(step(k))
    fut.wait()
    for k in range(3):
        check(ts[k], summed(world, offset=k), f"link {k}")


@case
def add_done_callback_waits_on_collectives(rank, world, ref):
    got = []
    t = torch.full((8,), rank + 1.0)
    u = torch.full((8,), rank + 1.0)

    def cb(_):
        dist.all_reduce(t, async_op=True).wait()
        got.append(dist.all_gather_into_tensor(torch.empty(8 * world), u, async_op=True))
        got[-1].wait()
        got.append(t.clone())

    fut = dist.all_reduce(torch.ones(4), async_op=True).get_future()
    fut.add_done_callback(cb)
    fut.wait()
    deadline = time.monotonic() + 30
    while len(got) < 2:  # add_done_callback's future completes before the callback ends
        assert time.monotonic() < deadline, "the done-callback never finished"
        time.sleep(0.001)
    check(got[1], summed(world), "all_reduce in a done-callback")


@case
def future_value_is_the_callers_tensor(rank, world, ref):
    """An async all_reduce's or broadcast's future completes with the
    caller's tensor, shape and storage (PowerSGD's callbacks reduce a 2-D
    matrix and use the future's value as that matrix)."""
    for make in (
        lambda: torch.full((6, 3), rank + 1.0),
        lambda: torch.full((6, 4), rank + 1.0).t(),
    ):
        t = make()
        got = dist.all_reduce(t, async_op=True).get_future().wait()[0]
        assert got.shape == t.shape, (
            f"all_reduce: value of shape {tuple(got.shape)}, not {tuple(t.shape)}"
        )
        check(got, torch.full(t.shape, float(sum(r + 1 for r in range(world)))), "all_reduce value")
        if t.is_contiguous():
            assert got.data_ptr() == t.data_ptr(), "all_reduce: value is not the caller's tensor"
        t = make()
        got = dist.broadcast(t, src=0, async_op=True).get_future().wait()[0]
        assert got.shape == t.shape, (
            f"broadcast: value of shape {tuple(got.shape)}, not {tuple(t.shape)}"
        )
        check(got, torch.full(t.shape, 1.0), "broadcast value")


@case
def waiting_ends_after_the_callbacks_and_frees_the_tensors(rank, world, ref):
    """Work.wait() returns once the future's callbacks ran, as Gloo's does
    (its Work finishes after its future), and once hsdp holds nothing of
    the call: a caller that waited and dropped its tensor frees it, even
    before the group's next call, as with NCCL (whose watchdog keeps a copy
    of each Work without its outputs). On an H200 a post-step kept for the
    next op held the tensor and its staged copy until that call. A slow
    callback keeps the completing thread busy past the future's completion:
    waking the waiter there, the thread would still hold the tensor. A
    tensor C++ holds keeps its Python object alive (torch preserves it), so
    the weak reference shows it."""
    import gc
    import weakref

    ran = []

    def slow(_):
        time.sleep(0.2)
        ran.append(True)

    # Non-contiguous, AVG: staged, summed, divided and copied back after the
    # collective (a post-step on every route).
    t = (torch.arange(12, dtype=torch.float32) + rank).view(3, 4).t()
    gone = weakref.ref(t)
    work = dist.all_reduce(t, op=dist.ReduceOp.AVG, async_op=True)
    work.get_future().then(slow)
    work.wait()
    assert ran, "wait() returned before the future's callbacks ran"
    expected = (torch.arange(12, dtype=torch.float32) + (world - 1) / 2).view(3, 4).t()
    assert torch.allclose(t, expected), f"AVG: got {t}, expected {expected}"
    del t, work
    gc.collect()
    assert gone() is None, "hsdp still holds an async op's tensor after it was waited for"


@case
def a_callback_waits_for_its_own_work_and_calls_the_group(rank, world, ref):
    """A callback of an op with a post-step that waits for that op's Work
    and makes a blocking call on the same group: Work.wait() ends after the
    callbacks, but not inside them (a callback would wait for itself), and
    the call orders itself after the post-step, not after the callbacks."""
    t = (torch.arange(12, dtype=torch.float32) + rank).view(3, 4).t()
    u = torch.full((8,), rank + 1.0)
    work = dist.all_reduce(t, op=dist.ReduceOp.AVG, async_op=True)

    def cb(_):
        assert work.wait()
        assert work.wait(timeout=datetime.timedelta(seconds=60))
        work.synchronize()
        assert work.is_completed()
        dist.all_reduce(u)
        return u

    check(work.get_future().then(cb).wait(), summed(world), "the callback's all_reduce")
    expected = (torch.arange(12, dtype=torch.float32) + (world - 1) / 2).view(3, 4).t()
    assert torch.allclose(t, expected), f"AVG: got {t}, expected {expected}"


@case
def callbacks_of_two_works_wait_for_each_other(rank, world, ref):
    """A's callback waits for B's Work and B's callback for A's, both
    attached while A still runs: on hsdp's completion threads a wait ends
    with the future, so neither waits for the other's callbacks (each would
    wait for the other forever)."""
    big = torch.full((1 << 22,), rank + 1.0)  # 16 MiB: still running below
    small = torch.full((8,), rank + 2.0)
    a = dist.all_reduce(big, async_op=True)
    b = dist.all_reduce(small, async_op=True)
    fa = a.get_future().then(lambda _: b.wait())
    fb = b.get_future().then(lambda _: a.wait())
    assert fa.wait() and fb.wait()
    a.wait()
    b.wait()
    check(small, summed(world, offset=1), "B")
    check(big, summed(world, n=1 << 22), "A")


# ---------------------------------------------------------- failures


@case
def callback_that_raises_reaches_the_chained_future(rank, world, ref):
    def cb(_):
        dist.all_reduce(torch.ones(2), async_op=True).wait()
        raise ValueError("boom from a callback")

    fut = dist.all_reduce(torch.ones(4), async_op=True).get_future().then(cb)
    err = error_of(fut.wait)
    assert err is not None and "boom from a callback" in str(err), err
    t = torch.ones(8)
    dist.all_reduce(t)
    check(t, torch.full((8,), float(world)), "the group after a failed callback")


@case
def callback_waits_on_a_collective_the_peer_never_issues(rank, world, ref):
    """Rank r's callback waits on an all_reduce of group r, which no other
    rank calls: every rank fails within that group's timeout, not a hang."""
    timeout_s = 3.0
    groups = [
        dist.new_group(backend="hsdp", timeout=datetime.timedelta(seconds=timeout_s))
        for _ in range(world)
    ]

    def cb(_):
        dist.all_reduce(torch.ones(4), group=groups[rank], async_op=True).wait()

    start = time.monotonic()
    fut = dist.all_reduce(torch.ones(4), async_op=True).get_future().then(cb)
    err = error_of(fut.wait)
    took = time.monotonic() - start
    assert err is not None, "a collective nobody else joined completed"
    assert took < timeout_s + 15, f"failed after {took:.1f} s, group timeout {timeout_s} s"
    dist.barrier(group=ref)
    for g in groups:
        dist.destroy_process_group(g)
    t = torch.ones(8)
    dist.all_reduce(t)
    check(t, torch.full((8,), float(world)), "the default group afterwards")


@case
def callback_uses_an_aborted_group(rank, world, ref):
    """A collective issued from a callback on a group that was aborted, shut
    down or destroyed fails with a clear error; nothing crashes."""
    for end in ("abort", "shutdown"):
        g = dist.new_group(backend="hsdp")
        dist.barrier(group=ref)
        getattr(g, end)()

        def cb(_, g=g):
            dist.all_reduce(torch.ones(4), group=g)

        fut = dist.all_reduce(torch.ones(4), async_op=True).get_future().then(cb)
        err = error_of(fut.wait)
        assert err is not None, f"a collective on a group after {end}() succeeded"
        text = str(err)
        assert f"rank {rank}" in text and ("shut down" in text or "abort" in text), text
        dist.destroy_process_group(g)
    # Destroyed: torch itself refuses the group before hsdp sees the call.
    g = dist.new_group(backend="hsdp")
    dist.barrier(group=ref)
    dist.destroy_process_group(g)
    fut = dist.all_reduce(torch.ones(4), async_op=True).get_future()
    err = error_of(fut.then(lambda _: dist.all_reduce(torch.ones(4), group=g)).wait)
    assert err is not None and "not initialized" in str(err), err
    t = torch.ones(8)
    dist.all_reduce(t)
    check(t, torch.full((8,), float(world)), "the default group afterwards")


# --------------------------------------------- torch's DDP communication hooks


def _train_ddp(rank, group, register, steps=5):
    """A few DDP steps of a small model on ``group``; the parameters after."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 24), torch.nn.Linear(24, 4)
    )
    # One bucket (the model is smaller than DDP's first bucket): with several,
    # a hook's callback issues collectives while the autograd thread issues
    # the next bucket's, in an order that differs between ranks, on any
    # backend whose callbacks run on its own threads (gloo's too).
    model = DDP(net, process_group=group)
    opt = register(model, group)
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        x = torch.randn(8, 16, generator=gen)
        opt.zero_grad()
        model(x).square().sum().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


class _StepsInHook:
    """The optimizer of a DDP model whose hook runs the step (ZeRO overlap)."""

    def __init__(self, model):
        self.zero_grad = model.zero_grad

    def step(self):
        pass


def _same_as_gloo(rank, world, ref, register, rtol=1e-5, atol=1e-6):
    hsdp_params = _train_ddp(rank, dist.group.WORLD, register)
    gloo_params = _train_ddp(rank, ref, register)
    for k, (p, q) in enumerate(zip(hsdp_params, gloo_params)):
        # hsdp's engine sums in another order than gloo's ring on 3+ ranks.
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol, msg=lambda m, k=k: f"param {k}: {m}")


def _power_sgd(batched):
    def register(model, group):
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

        state = ps.PowerSGDState(
            process_group=group,
            matrix_approximation_rank=1,
            start_powerSGD_iter=2,
            min_compression_rate=0.5,
        )
        model.register_comm_hook(state, ps.batched_powerSGD_hook if batched else ps.powerSGD_hook)

    return register


@case
def ddp_power_sgd_hook(rank, world, ref):
    _same_as_gloo(rank, world, ref, _power_sgd(batched=False))


@case
def ddp_batched_power_sgd_hook(rank, world, ref):
    """torch 2.14's batched hook hands its 2-D P and Q matrices to
    ``_orthogonalize``, which asserts a batch of 3-D ones, so it raises on
    every backend once compression starts. The helper is taught the 2-D case
    (as a batch of one) for both backends alike, so the hook's callbacks,
    which wait for the all-reduces they issue, run."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

    orthogonalize = ps._orthogonalize

    def batch_of_one(matrices, epsilon=0):
        if matrices.dim() == 2:
            return orthogonalize(matrices.unsqueeze(0), epsilon)
        return orthogonalize(matrices, epsilon)

    ps._orthogonalize = batch_of_one
    try:
        _same_as_gloo(rank, world, ref, _power_sgd(batched=True))
    finally:
        ps._orthogonalize = orthogonalize


@case
def ddp_fp16_and_bf16_compress_hooks(rank, world, ref):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    hooks = [default_hooks.fp16_compress_hook]
    # DDP refuses the bf16 hook on every backend in a torch built without
    # CUDA and NCCL (DistributedDataParallel._check_comm_hook).
    if torch.version.cuda is not None and dist.is_nccl_available():
        hooks.append(default_hooks.bf16_compress_hook)
    for hook in hooks:
        # On 3+ ranks half-precision sums differ by their rounding (gloo
        # rounds after every addition, hsdp's engine once, in fp32), and
        # five steps carry it on: a bound far below a lost contribution.
        _same_as_gloo(
            rank,
            world,
            ref,
            lambda model, group, hook=hook: model.register_comm_hook(group, hook),
            rtol=5e-2,
            atol=1e-3,
        )


@case
def ddp_zero_hook(rank, world, ref):
    """ZeRO's step overlapped with DDP's all-reduce: its callback waits on
    the broadcasts of the updated parameters. torch refuses this hook on
    gloo ("may meet hangs", which is this very problem), so the reference
    is what it computes: SGD on gloo-reduced gradients, with no update in
    the first two steps (where DDP's buckets are not yet final)."""

    def register(model, group):
        from torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook import hook_with_zero_step
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.distributed.optim import ZeroRedundancyOptimizer

        zero = ZeroRedundancyOptimizer(
            model.parameters(),
            optimizer_class=torch.optim.SGD,
            overlap_with_ddp=True,
            process_group=group,
            lr=0.05,
        )
        model.register_comm_hook(group, hook_with_zero_step(allreduce_hook, model, zero))
        return _StepsInHook(model)

    def reference(model, group):
        return _SgdAfterWarmup(model, warmup=2)

    hsdp_params = _train_ddp(rank, dist.group.WORLD, register)
    gloo_params = _train_ddp(rank, ref, reference)
    for k, (p, q) in enumerate(zip(hsdp_params, gloo_params)):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"param {k}: {m}")


class _SgdAfterWarmup:
    def __init__(self, model, warmup):
        self.sgd = torch.optim.SGD(model.parameters(), lr=0.05)
        self.zero_grad = self.sgd.zero_grad
        self.warmup = warmup

    def step(self):
        if self.warmup:
            self.warmup -= 1
        else:
            self.sgd.step()
