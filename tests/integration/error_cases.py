"""Bad input: a clear error naming the rank, the op and what was expected,
and the group stays usable. Every rank makes the same mistake, as a user's
SPMD program would, so the ranks stay in step."""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

import hsdp_backend
from hsdp_backend import _torch_compat

CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def raises(exc_type, pattern, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except exc_type as exc:
        assert re.search(pattern, str(exc)), f"message {str(exc)!r} does not match {pattern!r}"
        return exc
    except Exception as exc:  # noqa: BLE001
        raise AssertionError(
            f"expected {exc_type.__name__}, got {type(exc).__name__}: {exc}"
        ) from exc
    raise AssertionError(f"expected {exc_type.__name__}({pattern!r}), nothing was raised")


def work_error(work):
    """The error a finished Work holds, or None: Work.exception() where
    torch's Python can read it, else what wait() raises, the same stored
    error (_torch_compat.WORK_EXCEPTION_IN_PYTHON)."""
    if _torch_compat.WORK_EXCEPTION_IN_PYTHON:
        return work.exception()
    try:
        work.wait()
    except Exception as exc:  # noqa: BLE001
        return exc
    return None


def still_usable(rank, world):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    assert t.item() == world * (world + 1) / 2, t


def prefix(rank, world, op):
    return re.escape(f"[rank {rank}/{world}] {op}: ")


def backend():
    return dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))


@case
def wrong_output_size(rank, world, ref):
    out = torch.empty(world * 4 + 1)
    raises(
        ValueError,
        prefix(rank, world, "all_gather_into_tensor") + r".*expected " + str(world * 4),
        dist.all_gather_into_tensor,
        out,
        torch.ones(4),
    )
    still_usable(rank, world)
    raises(
        ValueError,
        prefix(rank, world, "reduce_scatter_tensor") + r"the input .*expected",
        dist.reduce_scatter_tensor,
        torch.empty(3),
        torch.ones(world * 3 + 1),
    )
    still_usable(rank, world)
    if hasattr(dist, "gather_single"):  # torch 2.14+
        # Refused on the root before anything is issued: the others need
        # not (and here do not) call it.
        if rank == 0:
            raises(
                ValueError,
                prefix(rank, world, "gather_single") + r"the output .*expected " + str(world * 4),
                dist.gather_single,
                torch.ones(4),
                torch.empty(world * 4 + 1),
                dst=0,
            )
        still_usable(rank, world)


@case
def dtype_mismatch(rank, world, ref):
    raises(
        TypeError,
        prefix(rank, world, "all_gather_into_tensor")
        + r"the output has dtype Float but the input has dtype BFloat16",
        dist.all_gather_into_tensor,
        torch.empty(world * 2),
        torch.ones(2, dtype=torch.bfloat16),
    )
    still_usable(rank, world)
    raises(
        TypeError,
        prefix(rank, world, "reduce_scatter_tensor")
        + "the output has dtype Half but the input has dtype Float",
        dist.reduce_scatter_tensor,
        torch.empty(2, dtype=torch.float16),
        torch.ones(world * 2),
    )
    still_usable(rank, world)


@case
def op_makes_no_sense_for_dtype(rank, world, ref):
    raises(
        ValueError,
        prefix(rank, world, "all_reduce")
        + r"ReduceOp.BAND needs an integer or bool tensor, got Float",
        dist.all_reduce,
        torch.ones(3),
        op=dist.ReduceOp.BAND,
    )
    still_usable(rank, world)
    raises(
        ValueError,
        prefix(rank, world, "reduce_scatter_tensor")
        + r"ReduceOp.PREMUL_SUM needs a floating-point tensor, got Long",
        dist.reduce_scatter_tensor,
        torch.empty(1, dtype=torch.int64),
        torch.ones(world, dtype=torch.int64),
        op=dist._make_nccl_premul_sum(2.0),
    )
    still_usable(rank, world)


@case
def invalid_root_and_peer(rank, world, ref):
    # torch.distributed rejects ranks outside the group before the backend
    # sees them; a caller of the backend API directly meets hsdp's own check.
    raises(ValueError, "", dist.broadcast, torch.ones(2), src=world)
    still_usable(rank, world)
    opts = dist.BroadcastOptions()
    opts.rootRank = world + 3
    raises(
        ValueError,
        prefix(rank, world, "broadcast")
        + rf"invalid root rank {world + 3}; expected a group rank in \[0, {world}\)",
        backend().broadcast,
        [torch.ones(2)],
        opts,
    )
    still_usable(rank, world)
    raises(
        ValueError,
        prefix(rank, world, "send") + r"invalid destination rank -1",
        backend().send,
        [torch.ones(2)],
        -1,
        0,
    )
    raises(
        ValueError,
        prefix(rank, world, "recv") + rf"invalid source rank {world}",
        backend().recv,
        [torch.ones(2)],
        world,
        0,
    )
    still_usable(rank, world)


@case
def unsupported_device(rank, world, ref):
    # torch.distributed answers meta tensors itself, without a backend; the
    # backend API shows what hsdp does with a device it does not serve.
    raises(
        RuntimeError,
        prefix(rank, world, "all_reduce") + r"tensors on meta are not supported",
        backend().allreduce,
        [torch.ones(2, device="meta")],
        dist.AllreduceOptions(),
    )
    still_usable(rank, world)


def fake_cuda(*shape):
    """A tensor that says it is on cuda:0 without a GPU (torch's FakeTensor):
    hsdp refuses it by its device, before reading anything."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.empty(*shape, device="cuda")


@case
def cuda_tensors_on_a_group_without_cuda(rank, world, ref):
    # This machine has no GPU, so the group has no inner NCCL.
    raises(
        RuntimeError,
        prefix(rank, world, "all_reduce")
        + r"got a tensor on cuda:0 but this process group was created without CUDA",
        backend().allreduce,
        [fake_cuda(2)],
        dist.AllreduceOptions(),
    )
    still_usable(rank, world)
    # cpu and cuda in one coalesced call: named before anything is issued
    raises(
        ValueError,
        prefix(rank, world, "all_reduce_coalesced")
        + r"a tensor is on cuda:0 but the input is on cpu",
        hsdp_backend.all_reduce_coalesced,
        [torch.ones(2), fake_cuda(2)],
    )
    still_usable(rank, world)


@case
def devices_mixed_in_one_call(rank, world, ref):
    # A meta tensor stands in for a second device (this machine has no GPU);
    # the checks compare devices, so cuda:0 beside cuda:1 or cpu beside cuda
    # fail the same way, before anything is issued.
    if _torch_compat.BACKEND_COALESCED_CALLS_IN_PYTHON:
        raises(
            ValueError,
            prefix(rank, world, "all_gather_into_tensor_coalesced")
            + r"an input is on meta but the input is on cpu",
            backend().all_gather_single_coalesced,
            [torch.empty(world * 2), torch.empty(world * 2)],
            [torch.ones(2), torch.ones(2, device="meta")],
            dist.distributed_c10d.AllgatherOptions(),
        )
        still_usable(rank, world)
        raises(
            ValueError,
            prefix(rank, world, "reduce_scatter_tensor_coalesced")
            + r"an input is on meta but the input is on cpu",
            backend().reduce_scatter_single_coalesced,
            [torch.empty(2), torch.empty(2)],
            [torch.ones(world * 2), torch.ones(world * 2, device="meta")],
            dist.ReduceScatterOptions(),
        )
        still_usable(rank, world)
    raises(
        ValueError,
        prefix(rank, world, "all_reduce_coalesced")
        + r"a tensor is on meta but the input is on cpu",
        hsdp_backend.all_reduce_coalesced,
        [torch.ones(2), torch.ones(2, device="meta")],
    )
    still_usable(rank, world)


@case
def premul_factor_on_another_device(rank, world, ref):
    # NCCL would read the factor's pointer as memory of the data's device:
    # refused before anything is issued, naming both devices (meta stands
    # in for the other device, as above).
    for op, args in [
        (dist.all_reduce, (torch.ones(4),)),
        (dist.reduce_scatter_tensor, (torch.empty(2), torch.ones(2 * world))),
    ]:
        raises(
            ValueError,
            prefix(rank, world, op.__name__)
            + r"ReduceOp.PREMUL_SUM's factor tensor is on meta but the data is on cpu",
            op,
            *args,
            op=dist._make_nccl_premul_sum(torch.tensor(0.5, device="meta")),
        )
        still_usable(rank, world)
    # A factor tensor on the data's device, of another dtype: applied.
    t = torch.ones(4)
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(torch.tensor(0.5, dtype=torch.float64)))
    assert torch.equal(t, torch.full((4,), 0.5 * world)), t


@case
def nested_coalescing(rank, world, ref):
    # NCCL 2.14.1 takes a second start_coalescing silently (and loses the
    # tensors stashed so far): hsdp refuses it, and the block goes on.
    pg = dist.group.WORLD
    device = torch.device("cpu")
    pg._start_coalescing(device)
    raises(
        RuntimeError,
        prefix(rank, world, "start_coalescing") + "already coalescing",
        pg._start_coalescing,
        device,
    )
    t = torch.ones(3)
    dist.all_reduce(t)
    work = pg._end_coalescing(device)
    if work is not None:
        work.wait()
    assert torch.equal(t, torch.full((3,), float(world))), t
    still_usable(rank, world)


@case
def coalesced_list_length_mismatch(rank, world, ref):
    raises(
        ValueError,
        prefix(rank, world, "all_gather_into_tensor_coalesced") + "got 2 inputs but 1 outputs",
        dist.group.WORLD.allgather_into_tensor_coalesced,
        [torch.empty(world * 2)],
        [torch.ones(2), torch.ones(2)],
        dist.distributed_c10d.AllgatherOptions(),
    )
    still_usable(rank, world)


@case
def async_failure_surfaces_from_wait(rank, world, ref):
    """A collective that cannot complete (only rank 0 calls it) fails from
    wait() with an exception once the group's timeout expires: no hang, no
    crash. The broken group is abandoned; the default group keeps working.
    Its backend's get_error() says so as ProcessGroupNCCL's would: TIMEOUT on
    rank 0 on shared memory (whose wait reached its deadline) and
    REMOTE_ERROR on the ranks that only find the segment broken; on the
    NCCL-contract double, its own TIMEOUT (as NCCL's watchdog sets it); on
    the inner Gloo (whose get_error() always says SUCCESS), hsdp's record of
    rank 0's failed op (COMM_ERROR); SUCCESS where nothing failed."""
    import datetime
    import time

    from hooks import engine_under_test

    if world == 1:
        return
    g = dist.new_group(backend="hsdp", timeout=datetime.timedelta(seconds=2))
    be = g._get_backend(torch.device("cpu"))
    errors = torch._C._distributed_c10d.ErrorType if hasattr(be, "get_error") else None
    if errors is not None:
        assert be.get_error() == errors.SUCCESS, be.get_error()
    if rank == 0:
        work = dist.all_reduce(torch.ones(4), op=dist.ReduceOp.AVG, group=g, async_op=True)
        start = time.monotonic()
        raises(RuntimeError, "", work.wait)
        assert time.monotonic() - start < 30
        assert work.is_completed()
    dist.barrier(group=ref)
    if errors is not None:
        engine = engine_under_test()
        if rank == 0:
            want = errors.COMM_ERROR if engine == "gloo" else errors.TIMEOUT
        else:
            want = errors.REMOTE_ERROR if engine == "shm" else errors.SUCCESS
        assert be.get_error() == want, f"rank {rank}: get_error() {be.get_error()}, expected {want}"
    still_usable(rank, world)


@case
def abort_hooks(rank, world, ref):
    """Abort hooks (Backend::registerAbortHook, torch 2.14+) run as ProcessGroupNCCL2 runs
    them: on a rank where an op of the group fails (here a timeout: one rank never joins),
    in id order, a hook that raises logged and the next still run, the failure still the
    caller's; not on a rank where nothing failed; before abort(); an unregistered hook no
    longer. An id in use is refused (ProcessGroupNCCL2 keeps the first hook without a word)."""
    import datetime

    from hsdp_backend import _torch_compat

    if world == 1 or not _torch_compat.ABORT_HOOKS:
        return  # no peer to wait for; before 2.14 no Backend has abort hooks
    absent = world - 1
    g = dist.new_group(backend="hsdp", timeout=datetime.timedelta(seconds=1))
    calls = []

    def boom():
        calls.append("raised")
        raise RuntimeError("a hook that fails")

    g.register_abort_hook(3, lambda: calls.append("third"))
    g.register_abort_hook(1, lambda: calls.append("first"))
    g.register_abort_hook(2, boom)
    raises(ValueError, "hook id 1 is already registered", g.register_abort_hook, 1, print)
    if rank != absent:
        raises(RuntimeError, "(?i)timed? ?out", dist.all_reduce, torch.ones(4), group=g)
        assert calls[:3] == ["first", "raised", "third"], calls
    else:
        assert calls == [], calls
    dist.barrier(group=ref)
    calls.clear()
    g.unregister_abort_hook(2)
    g.unregister_abort_hook(2)  # unknown: nothing, as ProcessGroupNCCL2
    g.register_abort_hook(4, g.abort)  # aborting its own group runs no hook again
    g.abort()
    assert calls == ["first", "third"], calls
    g.unregister_abort_hook(4)  # the group's bound method would keep the group alive
    dist.barrier(group=ref)


@case
def ephemeral_timeout_extension(rank, world, ref):
    """c10d's ephemeral timeout extension (``_add_ephemeral_timeout_for_all_pgs``,
    which torch.compile calls when a cache hit lets a rank skip compiling;
    Backend::addEphemeralTimeout from torch 2.14), with ProcessGroupNCCL's
    meaning: a collective that one rank reaches later than the group's
    timeout, but within the timeout plus the extension, completes; the
    extension expires when the first collective issued after it completes,
    so the same late arrival then times out. A negative extension is refused,
    naming the rank, and changes nothing."""
    import datetime
    import time

    from hsdp_backend import _torch_compat

    if world == 1 or not _torch_compat.EPHEMERAL_TIMEOUT_ON_ANY_BACKEND:
        return  # no late peer; before 2.14 torch hands the extension to NCCL only
    late = world - 1
    g = dist.new_group(backend="hsdp", timeout=datetime.timedelta(seconds=1))
    raises(
        ValueError,
        prefix(rank, world, "add_ephemeral_timeout") + "expected an extension of at least 0 ms",
        g._add_ephemeral_timeout,
        datetime.timedelta(seconds=-1),
    )

    def late_all_reduce(delay_s):
        dist.barrier(group=ref)
        if rank == late:
            time.sleep(delay_s)
        t = torch.full((4,), float(rank + 1))
        dist.all_reduce(t, group=g)
        return t

    dist.distributed_c10d._add_ephemeral_timeout_for_all_pgs(datetime.timedelta(seconds=6))
    t = late_all_reduce(2.0)  # the group's 1 s, plus the extension's 6
    check_sum = world * (world + 1) / 2
    assert torch.equal(t, torch.full((4,), check_sum)), t
    start = time.monotonic()
    try:
        late_all_reduce(2.5)  # the extension has expired
        raise AssertionError("a peer 2.5 s late passed a 1 s timeout with no extension active")
    except RuntimeError as exc:
        if rank != late:
            assert re.search("(?i)timed? ?out", str(exc)), str(exc)
            assert time.monotonic() - start < 2.5, "the expired extension still held"
    dist.barrier(group=ref)
    still_usable(rank, world)
