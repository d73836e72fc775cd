"""What the CUDA route promises beyond matching gloo, checked through the
NCCL-contract double (HSDP_TEST_INNER=nccl_contract: hooks.py; csrc/testing/): what hsdp
hands NCCL, that every post-step waits for the inner Works, and that NCCL's
errors reach the caller. Cases run on every rank: ``case(rank, world, ref)``."""

from __future__ import annotations

import time

import hsdp_testing
import torch
import torch.distributed as dist
from error_cases import raises, work_error
from harness import every_torch
from hooks import double_of
from ops_cases import check, data, reduce_ref, rs_expected, rs_input

import hsdp_backend

CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def received(group=None) -> list[str]:
    return list(hsdp_testing.reductions(double_of(hsdp_backend.get_hsdp_backend(group))))


def sent_by(fn, group=None) -> list[str]:
    """The reductions the inner backend received while ``fn`` ran."""
    before = len(received(group))
    fn()
    return received(group)[before:]


@case
def scales_reach_nccl_as_avg_or_one_premul_sum(rank, world, ref):
    t = data(rank, 10, torch.float32)
    assert sent_by(lambda: dist.all_reduce(t, op=dist.ReduceOp.AVG)) == ["all_reduce:AVG"]
    check(t, reduce_ref(dist.ReduceOp.AVG, world, 10, torch.float32), "AVG")
    # divide_by folds into one PREMUL_SUM factor: no second scaling step
    t = data(rank, 10, torch.float32)
    assert sent_by(lambda: hsdp_backend.all_reduce(t, op=dist.ReduceOp.AVG, divide_by=3.0)) == [
        "all_reduce:PREMUL_SUM"
    ]
    expected = torch.stack([data(r, 10, torch.float64) for r in range(world)]).sum(0) / (3 * world)
    check(t, expected.float(), "AVG + divide_by")
    # bf16 reaches NCCL as a PREMUL_SUM only where ProcessGroupNCCL keeps
    # its factor (bf16_factors_never_reach_nccl_where_torch_loses_them)
    out = torch.empty(6, dtype=torch.bfloat16)
    premul = dist._make_nccl_premul_sum(0.125)
    assert sent_by(
        lambda: dist.reduce_scatter_tensor(out, rs_input(rank, world, 6, torch.bfloat16), op=premul)
    ) == ["reduce_scatter_tensor:" + ("SUM" if loses_bf16_factors() else "PREMUL_SUM")]
    check(
        out,
        (rs_expected(dist.ReduceOp.SUM, world, rank, 6, torch.float64) * 0.125).bfloat16(),
        "PREMUL_SUM",
    )
    # integers: ncclAvg sums and divides with truncation, as hsdp does
    t = data(rank, 10, torch.int64)
    assert sent_by(lambda: dist.all_reduce(t, op=dist.ReduceOp.AVG)) == ["all_reduce:AVG"]
    check(t, reduce_ref(dist.ReduceOp.AVG, world, 10, torch.int64), "integer AVG")
    # ... but with divide_by: SUM, then one truncating division
    t = data(rank, 10, torch.int64)
    assert sent_by(lambda: hsdp_backend.all_reduce(t, op=dist.ReduceOp.AVG, divide_by=2)) == [
        "all_reduce:SUM"
    ]
    expected = torch.stack([data(r, 10, torch.int64) for r in range(world)]).sum(0)
    check(t, torch.div(expected, 2 * world, rounding_mode="trunc"), "integer AVG + divide_by")


def loses_bf16_factors(group=None) -> bool:
    """Whether the ProcessGroupNCCL the double models hands NCCL a bf16
    PREMUL_SUM factor as a float (torch 2.11 to 2.13: docs/versions.md)."""
    return double_of(hsdp_backend.get_hsdp_backend(group)).bf16_factor_as_float


@case
@every_torch
def bf16_factors_never_reach_nccl_where_torch_loses_them(rank, world, ref):
    """Torch 2.11 to 2.13 build a bf16 PREMUL_SUM's host factor as a float,
    of which NCCL reads the low half (0 for 0.5), and refuse a bf16 factor
    tensor; the double does the same (run with HSDP_TEST_NCCL_RELEASE=13 on
    a newer torch). There hsdp sends NCCL's AVG for a division by the group
    size, else NCCL's SUM and multiplies after it, in fp32: every form below
    gives the exact result. Where torch keeps the factor, it rides inside
    NCCL's reduction as on fp32."""
    lossy = loses_bf16_factors()
    n = 8
    total = reduce_ref(dist.ReduceOp.SUM, world, n, torch.float64)

    def sent(fn, t):
        got = sent_by(lambda: fn(t))
        return got, t

    forms = [
        # (what, call, sent where lossy, sent where intact, scale of the sum)
        (
            "FSDP2's PREMUL_SUM(1/factor)",
            lambda t: dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.125)),
            "all_reduce:SUM",
            "all_reduce:PREMUL_SUM",
            0.125,
        ),
        (
            "PREMUL_SUM(1/world): ncclAvg",
            lambda t: dist.all_reduce(t, op=dist._make_nccl_premul_sum(1.0 / world)),
            "all_reduce:AVG",
            "all_reduce:PREMUL_SUM",
            1.0 / world,
        ),
        (
            "divide_by",
            lambda t: hsdp_backend.all_reduce(t, divide_by=8.0),
            "all_reduce:SUM",
            "all_reduce:PREMUL_SUM",
            0.125,
        ),
        (
            "AVG + divide_by",
            lambda t: hsdp_backend.all_reduce(t, op=dist.ReduceOp.AVG, divide_by=2.0),
            "all_reduce:SUM",
            "all_reduce:PREMUL_SUM",
            0.5 / world,
        ),
        (
            "a bf16 factor tensor",
            lambda t: dist.all_reduce(
                t, op=dist._make_nccl_premul_sum(torch.tensor([0.5], dtype=torch.bfloat16))
            ),
            "all_reduce:SUM",
            "all_reduce:PREMUL_SUM[tensor]",
            0.5,
        ),
        (
            "an fp32 factor tensor",
            lambda t: dist.all_reduce(t, op=dist._make_nccl_premul_sum(torch.tensor([0.5]))),
            "all_reduce:SUM",
            "all_reduce:SUM",
            0.5,
        ),
        (
            "AVG",
            lambda t: dist.all_reduce(t, op=dist.ReduceOp.AVG),
            "all_reduce:AVG",
            "all_reduce:AVG",
            1.0 / world,
        ),
    ]
    for what, fn, if_lossy, if_intact, scale in forms:
        got, t = sent(fn, data(rank, n, torch.bfloat16))
        assert got == [if_lossy if lossy else if_intact], (what, got)
        check(t, (total * scale).bfloat16(), what)
    # the reduce-scatter FSDP2 issues for a custom divide factor, async
    out = torch.empty(n, dtype=torch.bfloat16)
    premul = dist._make_nccl_premul_sum(1.0 / 8)
    work = dist.reduce_scatter_tensor(
        out, rs_input(rank, world, n, torch.bfloat16), op=premul, async_op=True
    )
    work.wait()
    check(
        out,
        (rs_expected(dist.ReduceOp.SUM, world, rank, n, torch.float64) / 8).bfloat16(),
        "async reduce_scatter PREMUL_SUM(1/8)",
    )


def _plain_double_group(release: int):
    """A group whose backend is the double itself (no hsdp), modelling
    ``release``'s ProcessGroupNCCL: what a plain ``nccl`` group does."""
    name = f"nccl_contract_{release}"
    if name.upper() not in dist.Backend._plugins:

        def create(opts, backend_options):
            gloo = dist.ProcessGroupGloo(
                dist.PrefixStore(f"{name}/", opts.store), opts.group_rank, opts.group_size
            )
            return hsdp_testing.NcclContractBackend(gloo, opts.group_rank, opts.group_size, release)

        dist.Backend.register_backend(name, create, extended_api=True, devices=["cpu"])
    return dist.new_group(backend=name)


@case
@every_torch
def the_double_loses_a_bf16_factor_as_torch_2_13_does(rank, world, ref):
    """The double's clause behind bf16_factors_never_reach_nccl_where_torch_loses_them,
    on a plain group of the double: as torch 2.13's ProcessGroupNCCL hands
    NCCL the factor, bf16 PREMUL_SUM(0.5) sums to zero (the float 0.5's low
    half), 1/3 to a tiny negative number, and a bf16 factor tensor raises
    (const_data_ptr<float>); as 2.14's, the factor arrives rounded to bf16.
    fp16 and fp32 are right on both."""
    total = reduce_ref(dist.ReduceOp.SUM, world, 4, torch.float64)
    for release, lossy in ((13, True), (14, False)):
        group = _plain_double_group(release)
        t = data(rank, 4, torch.bfloat16)
        dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5), group=group)
        check(t, torch.zeros(4, dtype=torch.bfloat16) if lossy else (total / 2).bfloat16(), "0.5")
        t = data(rank, 4, torch.bfloat16)
        dist.all_reduce(t, op=dist._make_nccl_premul_sum(1.0 / 3), group=group)
        if lossy:
            assert bool((t < 0).all() and (t.abs() < 1e-9).all()), t
        else:
            check(t, (total * torch.tensor(1.0 / 3).bfloat16().double()).bfloat16(), "1/3")
        factor = torch.tensor([0.5], dtype=torch.bfloat16)
        t = data(rank, 4, torch.bfloat16)
        op = dist._make_nccl_premul_sum(factor)
        if lossy:
            # the op fails on every rank alike, so the ranks stay in step
            raises(
                RuntimeError, "expected scalar type Float", dist.all_reduce, t, op=op, group=group
            )
        else:
            dist.all_reduce(t, op=op, group=group)
            check(t, (total / 2).bfloat16(), "bf16 factor tensor")
        for dtype in (torch.float16, torch.float32):
            t = data(rank, 4, dtype)
            dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5), group=group)
            check(t, (total / 2).to(dtype), str(dtype))
        dist.destroy_process_group(group)


@case
def an_fp16_divide_by_is_split_around_the_reduction(rank, world, ref):
    """NCCL rounds a PREMUL_SUM factor to fp16 and multiplies each fp16 input
    by it: folding a large divisor into one factor pushes every input down by
    all of it before the sum (here the factor 2**-25 itself rounds to zero in
    fp16). hsdp splits it as FSDP2 does for fp16: a power-of-two part in the
    reduction, the rest after it in fp32, rounded once."""
    divide_by = 2.0**25

    def inputs(r):
        return (torch.rand(4096, generator=torch.Generator().manual_seed(r)) * 1500 + 500).half()

    t = inputs(rank)
    assert sent_by(lambda: hsdp_backend.all_reduce(t, divide_by=divide_by)) == [
        "all_reduce:PREMUL_SUM"
    ]
    exact = torch.stack([inputs(r) for r in range(world)]).double().sum(0) / divide_by
    # within an fp16 rounding of the exact quotient (one ulp, subnormals included)
    torch.testing.assert_close(t.double(), exact, rtol=2.0**-10, atol=2.0**-24)


@case
def a_tensor_factor_reaches_nccl_as_a_tensor_of_the_data_dtype(rank, world, ref):
    """NCCL reads a tensor PREMUL_SUM factor on the device (no host sync, fine
    under graph capture) and wants the data's dtype (the double refuses
    another, as ProcessGroupNCCL does). The caller's factor of the data's
    dtype goes as it is; one that would need a copy (another dtype, or a
    divide_by folded in) makes NCCL a SUM and hsdp one multiply after it on
    the device: a copy made inside the call would be freed before NCCL's
    stream reads it, and reading the factor on the host would sync."""
    t = data(rank, 6, torch.float32)
    premul = dist._make_nccl_premul_sum(torch.tensor([0.5]))
    assert sent_by(lambda: dist.all_reduce(t, op=premul)) == ["all_reduce:PREMUL_SUM[tensor]"]
    check(t, reduce_ref(dist.ReduceOp.SUM, world, 6, torch.float32) * 0.5, "tensor factor")
    t = data(rank, 6, torch.bfloat16)
    premul = dist._make_nccl_premul_sum(torch.tensor([0.5]))  # fp32 factor, bf16 data
    assert sent_by(lambda: dist.all_reduce(t, op=premul)) == ["all_reduce:SUM"]
    check(t, (reduce_ref(dist.ReduceOp.SUM, world, 6, torch.float64) * 0.5).bfloat16(), "bf16")
    t = data(rank, 6, torch.float32)
    premul = dist._make_nccl_premul_sum(torch.tensor([0.5]))
    assert sent_by(lambda: hsdp_backend.all_reduce(t, op=premul, divide_by=4.0)) == [
        "all_reduce:SUM"
    ]
    check(t, reduce_ref(dist.ReduceOp.SUM, world, 6, torch.float32) / 8, "tensor / divide_by")


@case
def sync_calls_return_no_work(rank, world, ref):
    t = data(rank, 5, torch.float32)
    assert hsdp_backend.all_reduce(t, divide_by=2.0) is None
    check(t, reduce_ref(dist.ReduceOp.SUM, world, 5, torch.float32) / 2, "sync divide_by")
    out = torch.empty(5)
    hsdp_backend.reduce_scatter_tensor(out, rs_input(rank, world, 5, torch.float32), divide_by=2.0)
    check(
        out,
        rs_expected(dist.ReduceOp.SUM, world, rank, 5, torch.float32) / 2,
        "sync reduce_scatter divide_by",
    )


@case
def async_post_steps_wait_for_every_inner_work(rank, world, ref):
    # several buckets and dtypes: one inner Work each, one post-step after all
    ts = [
        data(rank, n, d)
        for n, d in [(7, torch.float32), (5, torch.int64), (9, torch.float32), (3, torch.int64)]
    ]
    work = hsdp_backend.all_reduce_coalesced(
        ts, op=dist.ReduceOp.AVG, bucket_bytes=16, async_op=True
    )
    work.wait()
    assert work.is_completed()
    for t in ts:
        check(t, reduce_ref(dist.ReduceOp.AVG, world, t.numel(), t.dtype), f"bucketed {t.dtype}")
    # a staged (non-contiguous) argument is copied back only after the data landed
    base = data(rank, 24, torch.float32).view(4, 6)
    t = base.t()
    work = dist.all_reduce(t, op=dist.ReduceOp.SUM, async_op=True)
    work.wait()
    check(
        t,
        reduce_ref(dist.ReduceOp.SUM, world, 24, torch.float32).view(4, 6).t(),
        "non-contiguous async",
    )
    # the future of a chained Work carries the finished result
    t = data(rank, 8, torch.int64)
    fut = dist.all_reduce(t, op=dist.ReduceOp.AVG, async_op=True).get_future()
    check(
        fut.wait()[0], reduce_ref(dist.ReduceOp.AVG, world, 8, torch.int64), "future of integer AVG"
    )


@case
def device_coalescing_holds_post_steps_until_the_end(rank, world, ref):
    """_coalescing_manager(device=...) brackets the calls with start/end
    coalescing: NCCL launches nothing before the end, the Works of the ops
    inside the block order after nothing and the end Work's future carries
    no event, so post-steps wait for the end Work itself."""
    # post-steps: a copy back (non-contiguous) and a divide (integer divide_by)
    bases = [data(rank, 12, torch.float32).view(3, 4), data(rank, 6, torch.int64)]
    with dist._coalescing_manager(device=torch.device("cpu"), async_ops=True) as cm:
        dist.all_reduce(bases[0].t(), op=dist.ReduceOp.SUM)
        hsdp_backend.all_reduce(bases[1], op=dist.ReduceOp.SUM, divide_by=2, async_op=True)
    cm.wait()
    check(
        bases[0],
        reduce_ref(dist.ReduceOp.SUM, world, 12, torch.float32).view(3, 4),
        "coalesced non-contiguous",
    )
    check(
        bases[1],
        torch.div(reduce_ref(dist.ReduceOp.SUM, world, 6, torch.int64), 2, rounding_mode="trunc"),
        "coalesced divide_by",
    )
    # no post-step: the end Work is the block's Work
    ts = [data(rank, n, torch.int64) for n in (4, 3)]
    with dist._coalescing_manager(device=torch.device("cpu"), async_ops=True) as cm:
        for t in ts:
            dist.all_reduce(t, op=dist.ReduceOp.AVG)
    cm.wait()
    for t in ts:
        check(
            t, reduce_ref(dist.ReduceOp.AVG, world, t.numel(), torch.int64), "coalesced integer AVG"
        )
    outs = [torch.empty(world * n) for n in (3, 2)]
    with dist._coalescing_manager(device=torch.device("cpu")):
        for n, o in zip((3, 2), outs):
            dist.all_gather_into_tensor(o, data(rank, n, torch.float32))
    for n, o in zip((3, 2), outs):
        check(
            o, torch.cat([data(r, n, torch.float32) for r in range(world)]), "coalesced all_gather"
        )


@case
def a_block_keeps_hsdps_staged_copies_until_it_ran(rank, world, ref):
    """NCCL keeps alive the tensors of a block's async calls only (stashed on
    endCoalescing's Work). hsdp's own staged copy for a synchronous call in a
    block (a non-contiguous input: copied in, nothing after) is no caller's
    tensor: hsdp must keep it until the block ran. The double checks, when
    the block lands, that every tensor of its synchronous calls still lives.
    The last call async makes the block's Work async, launched on NCCL's
    stream: the memory would be reused while the block runs."""
    pg = dist.group.WORLD
    base = data(rank, 12, torch.float32).view(3, 4)
    out = torch.empty(world * 12)
    t = data(rank, 5, torch.float32)
    pg._start_coalescing(torch.device("cpu"))
    dist.all_gather_into_tensor(out, base.t())
    dist.all_reduce(t, async_op=True)
    work = pg._end_coalescing(torch.device("cpu"))
    work.wait()
    expected = torch.cat(
        [data(r, 12, torch.float32).view(3, 4).t().reshape(-1) for r in range(world)]
    )
    check(out, expected, "all_gather of a staged input in a block")
    check(t, reduce_ref(dist.ReduceOp.SUM, world, 5, torch.float32), "all_reduce in the block")


@case
@every_torch
def allocation_needs_the_communicator_a_barrier_makes(rank, world, ref):
    """NCCL's memory pool needs the communicator, which NCCL makes at the
    first collective: allocate_tensor before one raises NCCL's own error
    (hsdp passes it on, as a plain nccl group would). A barrier makes it, as
    NCCL's does (an all-reduce on the device): FSDP2 calls one for that."""
    g = dist.new_group(backend="hsdp")
    backend = g._get_backend(torch.device("cpu"))
    assert not hsdp_testing.is_initialized(double_of(backend))
    # A point-to-point exchange makes NCCL a communicator of the pair's own,
    # not the group's: allocation still needs the group's, though
    # ProcessGroupNCCL::isInitialized (ProcessGroupNCCL.cpp: any entry of
    # devNCCLCommMap_) now says true, which hsdp's answer must not follow
    # (C++: Split.EveryRankAnswersIsInitializedAlikeWhateverNcclCounts).
    peer = rank ^ 1
    sent, got = torch.full((2,), float(rank)), torch.empty(2)
    for w in dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, sent, peer, g), dist.P2POp(dist.irecv, got, peer, g)]
    ):
        w.wait()
    assert torch.equal(got, torch.full((2,), float(peer))), got
    assert hsdp_testing.is_initialized(double_of(backend))
    raises(
        RuntimeError,
        "NCCL communicator has not been initialized before mem pool creation",
        backend.allocate_tensor,
        16,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    dist.barrier(group=g)
    t = backend.allocate_tensor(16, dtype=torch.float32, device=torch.device("cpu"))
    assert t.numel() == 16, t.shape


@case
def inner_errors_reach_the_caller(rank, world, ref):
    backend = hsdp_backend.get_hsdp_backend()
    for name, issue in [
        ("pass-through", lambda t: dist.all_reduce(t, op=dist.ReduceOp.SUM, async_op=True)),
        ("chained", lambda t: hsdp_backend.all_reduce(t, divide_by=2.0, async_op=True)),
        (
            "bucketed",
            lambda t: hsdp_backend.all_reduce_coalesced(
                [t[:4], t[4:].long()], bucket_bytes=8, async_op=True
            ),
        ),
    ]:
        hsdp_testing.fail_next(double_of(backend), f"injected NCCL error ({name})")
        work = issue(torch.ones(8))
        try:
            work.wait()
        except dist.DistBackendError as exc:
            assert f"injected NCCL error ({name})" in str(exc), exc
        else:
            raise AssertionError(f"{name}: the inner Work's error was lost")
    # Not waited for: NCCL's watchdog finds the failure on a copy of the Work;
    # the caller's Work shows it once is_completed() has asked.
    hsdp_testing.fail_next(double_of(backend), "injected NCCL error (polled)")
    base = torch.ones(4, 2)
    work = dist.all_reduce(base.t(), async_op=True)  # a post-step: the copy back
    deadline = time.monotonic() + 30
    while not work.is_completed():
        assert time.monotonic() < deadline, "the failed Work never completed"
        time.sleep(0.005)
    error = work_error(work)
    assert error is not None, "polled: the inner Work's error was lost"
    assert "injected NCCL error (polled)" in str(error), error
    hsdp_testing.fail_next(double_of(backend), "injected NCCL error (sync)")
    try:
        dist.all_reduce(torch.ones(2), op=dist.ReduceOp.AVG)
    except dist.DistBackendError as exc:
        assert "injected NCCL error (sync)" in str(exc), exc
    else:
        raise AssertionError("sync: the inner error was lost")
    t = torch.ones(3)  # the group still works
    dist.all_reduce(t)
    check(t, torch.full((3,), float(world)), "after errors")


@case
def async_ops_on_one_tensor_are_ordered_without_a_wait(rank, world, ref):
    """NCCL runs a group's ops in order on one stream: a second async op on a
    tensor may follow the first with no wait() between (c10d allows it) and
    sees its result. hsdp's post-steps run on a side stream, which the second
    op must not overtake."""
    base = data(rank, 8, torch.float32).view(2, 4)
    t = base.t()  # non-contiguous: each op stages it and copies back after
    first = dist.all_reduce(t, async_op=True)
    second = dist.all_reduce(t, async_op=True)
    second.wait()
    first.wait()
    once = reduce_ref(dist.ReduceOp.SUM, world, 8, torch.float32).view(2, 4).t()
    check(t, once * world, "the second op saw the first one's result")
    # a synchronous op after an async one with a post-step, likewise
    u = torch.ones(3, dtype=torch.int64)
    hsdp_backend.all_reduce(u, divide_by=1, async_op=True)  # integer: a divide post-step
    hsdp_backend.all_reduce(u, op=dist.ReduceOp.SUM, divide_by=world)
    check(u, torch.ones(3, dtype=torch.int64), "sync after async")


@case
def a_bounded_wait_that_expires_aborts_as_nccl_does(rank, world, ref):
    """WorkNCCL::wait(timeout): the host blocks until the op is done or the
    time is up; then the communicator is aborted and NCCL's message raised.
    hsdp's Work (an op with a post-step) behaves the same."""
    import datetime

    if world == 1:
        return
    g = dist.new_group(backend="hsdp", timeout=datetime.timedelta(seconds=5))
    if rank == 0:
        base = torch.ones(4, 2)
        work = dist.all_reduce(base.t(), group=g, async_op=True)  # nobody else joins
        try:
            work.wait(timeout=datetime.timedelta(milliseconds=300))
        except dist.DistBackendError as exc:
            assert "before timing out" in str(exc), exc
        else:
            raise AssertionError("wait(timeout) must raise")
        assert work_error(work) is not None
        try:
            dist.all_reduce(torch.ones(2), group=g)  # the communicator is gone
        except RuntimeError:
            pass
        else:
            raise AssertionError("the group must be unusable after the timeout")
    dist.barrier(group=ref)
    dist.destroy_process_group(g)
