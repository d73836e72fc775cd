"""The CUDA route on real GPUs: hsdp over an inner ProcessGroupNCCL.

Each check runs at one rank and at HSDP_GPU_CHECK_RANKS ranks (default 2; HSDP
meshes at 4), whatever the number of GPUs: the ranks are placed by
pytest_hsdp (pytest-hsdp/src/pytest_hsdp/_placement.py), rank r on cuda:(r % devices),
ranks that share a GPU each with its own NCCL_HOSTID, so that NCCL connects
them over its socket transport as separate nodes. On one GPU that proves
ProcessGroupNCCL's and NCCL's semantics at world > 1 (results, streams,
communicators, splits), not NVLink, P2P or SHM transports and not speed.
Every chained op sync and async, GPU-aware Work, stream placement, memory,
CUDA graphs, the CUDA sanitizer, FSDP2 on 1-D and HSDP meshes, parity with
NCCL's own numerics and overlap, bf16 scaling against fp64. Each test skips,
saying why, without a GPU; the route's logic is proven on CPU by the
NCCL-contract double (``pytest tests -k nccl_contract``).
"""

import copy
import datetime
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks

from hsdp_backend import _torch_compat
from tools import settings

GPUS = torch.cuda.device_count()
one_gpu = pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU; this machine has none")
# Ranks of the multi-rank checks (scripts/gpu_check.sh --ranks N); they share GPUs as needed.
RANKS = settings.read("HSDP_GPU_CHECK_RANKS")
WORLDS = sorted({1, RANKS})


def _device(rank):
    """Rank ``rank``'s GPU, as the launcher placed it (current already)."""
    return torch.device("cuda", rank % torch.cuda.device_count())


def run_on_gpus(body, world, **kwargs):
    """``body`` on ``world`` ranks placed on this machine's GPUs (shared where fewer)."""
    return run_ranks(body, world, device="cuda", **kwargs)


def _check(actual, expected, what):
    torch.testing.assert_close(
        actual.float().cpu(), expected.float().cpu(), msg=lambda m: f"{what}: {m}"
    )


def chained_ops_body(rank, world):
    """Every op whose result needs a post-step on the CUDA route, sync and async."""
    import torch.distributed as dist

    import hsdp_backend

    dev = _device(rank)
    torch.cuda.set_device(dev)
    assert hsdp_backend.get_hsdp_backend() is not None
    for async_op in (False, True):

        def done(work):
            if async_op:
                work.wait()
            else:
                assert work is None

        t = torch.full((1000,), 3.0, device=dev, dtype=torch.bfloat16)
        done(dist.all_reduce(t, op=dist.ReduceOp.AVG, async_op=async_op))
        _check(t, torch.full((1000,), 3.0), "AVG")
        t = torch.full((8,), 4.0, device=dev)
        done(hsdp_backend.all_reduce(t, divide_by=4.0, async_op=async_op))
        _check(t, torch.full((8,), float(world)), "divide_by")
        t = torch.full((5,), 7, device=dev, dtype=torch.int64)
        done(dist.all_reduce(t, op=dist.ReduceOp.AVG, async_op=async_op))  # ncclAvg truncates
        _check(t, torch.full((5,), 7), "integer AVG")
        t = torch.arange(12.0, device=dev).view(3, 4).t()  # non-contiguous: staged
        done(dist.all_reduce(t, op=dist._make_nccl_premul_sum(2.0), async_op=async_op))
        _check(t, torch.arange(12.0).view(3, 4).t() * 2 * world, "PREMUL_SUM, non-contiguous")
        out = torch.empty(10, device=dev)
        done(
            dist.reduce_scatter_tensor(
                out,
                torch.ones(10 * world, device=dev),
                op=dist._make_nccl_premul_sum(0.5),
                async_op=async_op,
            )
        )
        # The factor applied at every world size, one rank included, where
        # NCCL 2.28.9's reduce-scatter drops it: hsdp scales that copy itself.
        _check(out, torch.full((10,), world * 0.5), "reduce_scatter PREMUL_SUM")
        ts = [
            torch.full((n,), 2.0, device=dev, dtype=d)
            for n, d in [(7, torch.float32), (3, torch.int64), (9, torch.float32)]
        ]
        done(
            hsdp_backend.all_reduce_coalesced(
                ts, op=dist.ReduceOp.AVG, bucket_bytes=16, async_op=async_op
            )
        )
        for x in ts:
            _check(x, torch.full((x.numel(),), 2.0), f"bucketed {x.dtype}")
        outs = [torch.empty(world * n, device=dev) for n in (3, 5)]
        with dist._coalescing_manager(async_ops=async_op) as cm:
            for n, o in zip((3, 5), outs):
                dist.all_gather_into_tensor(o, torch.full((n,), float(rank), device=dev))
        if async_op:
            cm.wait()
        for n, o in zip((3, 5), outs):
            _check(o, torch.arange(world).float().repeat_interleave(n), "coalesced all_gather")
        outs = [torch.empty(n, device=dev, dtype=torch.int64) for n in (2, 4)]
        with dist._coalescing_manager(device=dev, async_ops=async_op) as cm:
            for n, o in zip((2, 4), outs):
                dist.reduce_scatter_tensor(
                    o,
                    torch.full((n * world,), 5, device=dev, dtype=torch.int64),
                    op=dist.ReduceOp.AVG,
                )
        if async_op:
            cm.wait()
        for o in outs:
            _check(o, torch.full((o.numel(),), 5), "device-coalesced integer AVG")


def _gpu_with_communicator(rank):
    """This rank's GPU, current, with NCCL's communicator made. The first
    collective creates it (the harness binds no device_id, so creation is
    lazy), which takes far longer than any sleep in these checks: done
    first, outside what is asserted."""
    dev = _device(rank)
    torch.cuda.set_device(dev)
    dist.all_reduce(torch.ones(1, device=dev))
    torch.cuda.synchronize()
    return dev


def _cycles_per_second(dev):
    """A torch.cuda._sleep argument of about one second (clock_rate: kHz)."""
    return int(torch.cuda.get_device_properties(dev).clock_rate * 1e3)


def gpu_work_body(rank, world):
    """GPU-aware Work and streams."""
    dev = _gpu_with_communicator(rank)
    # is_completed() follows the device: false while a long kernel runs
    # ahead. The op must be hsdp's own Work (WorkOnStream), which it is only
    # with a post-step: a non-contiguous tensor is staged and copied back.
    # (An op NCCL serves whole, e.g. an int64 AVG at world 1, which is a
    # plain SUM, returns NCCL's own Work and would test NCCL, not hsdp.)
    t = torch.full((4, 2), 3.0, device=dev).t()
    cycles = _cycles_per_second(dev)
    # The same call once before, untimed: a first async op may set up what
    # makes it wait for the device (NCCL's stream, a new allocator segment).
    dist.all_reduce(t.clone(), op=dist.ReduceOp.AVG, async_op=True).wait()  # strides kept
    torch.cuda.synchronize()
    torch.cuda._sleep(cycles)
    start = time.monotonic()
    work = dist.all_reduce(t, op=dist.ReduceOp.AVG, async_op=True)
    issued = time.monotonic() - start
    assert issued < 0.5, (
        f"the async call blocked the host for {issued:.2f} s: it waited for the GPU"
    )
    assert not work.is_completed(), "is_completed() must wait for the GPU"
    work.wait()
    torch.cuda.synchronize()
    assert work.is_completed()
    _check(t, torch.full((2, 4), 3.0), "AVG of a staged non-contiguous tensor")
    # A barrier that names the device waits for its current stream first, as
    # NCCL's (an all-reduce there, then a stream synchronize): when it
    # returns, the GPU work issued before it has run.
    torch.cuda._sleep(cycles // 10)
    dist.barrier(device_ids=[dev.index])
    assert torch.cuda.current_stream().query(), "the barrier did not wait for the device"
    # Kernels land on the stream that was current: a side stream stays busy,
    # the default stream does not wait for it.
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(500_000_000 // 1000)
        u = torch.ones(16, device=dev)
        dist.all_reduce(u, op=dist.ReduceOp.AVG)
    assert torch.cuda.default_stream().query(), "the op blocked the default stream"
    side.synchronize()
    _check(u, torch.ones(16), "AVG on a side stream")
    # NCCL work issued before a barrier and never waited for has run when
    # it returns, as with NCCL's barrier (its all-reduce follows that work on
    # NCCL's stream): here the work waits for a side stream the current
    # stream knows nothing of.
    with torch.cuda.stream(side):
        torch.cuda._sleep(cycles // 10)
        pending = dist.all_reduce(torch.ones(16, device=dev), async_op=True)
    dist.barrier(device_ids=[dev.index])
    assert pending.is_completed(), "the barrier did not cover NCCL work never waited for"


def gpu_memory_body(rank, world):
    """Memory comes back once an async op was waited for and dropped."""
    dev = _gpu_with_communicator(rank)
    # Memory comes back: nothing is cached or leaked per call, staged copies
    # included. A block freed after use on a side stream (hsdp's post-step
    # records it there, as NCCL records its tensors) stays allocated until
    # the caching allocator sees that stream's event done: at its next
    # malloc, or in empty_cache(), which first frees every block whose
    # events are outstanding (CUDACachingAllocator's release_cached_blocks
    # -> synchronize_and_free_events). On an H200 without that step, one
    # such block (the last call's) was still counted.
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(dev)
    for _ in range(20):
        x = torch.randn(256, 256, device=dev).t()  # non-contiguous: staged
        dist.all_reduce(x, op=dist._make_nccl_premul_sum(0.5), async_op=True).wait()
        del x
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_allocated(dev) == base, (torch.cuda.memory_allocated(dev), base)


def gpu_graphs_body(rank, world):
    """CUDA graph capture and replay of ops with post-steps."""
    dev = _gpu_with_communicator(rank)
    # CUDA graph capture and replay of a chained op.
    g = torch.cuda.CUDAGraph()
    v = torch.ones(32, device=dev)
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        dist.all_reduce(v, op=dist.ReduceOp.AVG)
    v.fill_(5.0)
    g.replay()
    torch.cuda.synchronize()
    _check(v, torch.full((32,), 5.0), "graph replay")
    # An async op with a post-step (a staged tensor) left pending, then a
    # capture of an op with a post-step of its own: the captured op must not
    # query the pending post-step's event (a query invalidates a capture).
    pending = dist.all_reduce(torch.ones(4, 2, device=dev).t(), async_op=True)
    g2 = torch.cuda.CUDAGraph()
    x = torch.ones(4, 2, device=dev).t()
    with torch.cuda.graph(g2):
        dist.all_reduce(x, op=dist.ReduceOp.AVG)
    pending.wait()
    x.fill_(2.0)
    g2.replay()
    torch.cuda.synchronize()
    # x is a (4, 2) tensor transposed: its shape is (2, 4).
    _check(x, torch.full((2, 4), 2.0), "graph replay of a staged op after a pending one")
    # An async op captured, waited for inside the capture: its flight-record
    # entry completes at enqueue (a callback following its events would pull
    # a pool stream into the capture and leave it unjoined).
    g3 = torch.cuda.CUDAGraph()
    y = torch.ones(16, device=dev)
    with torch.cuda.graph(g3):
        dist.all_reduce(y, op=dist.ReduceOp.AVG, async_op=True).wait()
    y.fill_(3.0)
    g3.replay()
    torch.cuda.synchronize()
    _check(y, torch.full((16,), 3.0), "graph replay of an async op")
    # Async ops with post-steps captured (a staged tensor's copy back on the
    # side stream, a division hsdp does itself at one rank), waited for
    # inside the capture: the side stream joins the capture and is joined
    # back before it ends, so replays give the result every time.
    import hsdp_backend

    g4 = torch.cuda.CUDAGraph()
    z = torch.ones(4, 2, device=dev).t()
    d = torch.ones(8, device=dev)
    torch.cuda.synchronize()
    with torch.cuda.graph(g4):
        dist.all_reduce(z, op=dist.ReduceOp.AVG, async_op=True).wait()
        hsdp_backend.all_reduce(d, divide_by=2.0, async_op=True).wait()
    for value in (4.0, 6.0):
        z.fill_(value)
        d.fill_(value)
        g4.replay()
        torch.cuda.synchronize()
        _check(z, torch.full((2, 4), value), f"replay {value} of a captured staged async op")
        _check(d, torch.full((8,), value / 2), f"replay {value} of a captured async division")


def gpu_bounded_wait_body(rank, world):
    """A bounded wait on a busy GPU."""
    import datetime

    dev = _gpu_with_communicator(rank)
    cycles = _cycles_per_second(dev)
    # On a group of its own: a bounded wait that expires while the GPU
    # is busy behaves as WorkNCCL::wait(timeout), because it is one: hsdp
    # waits on the inner WorkNCCL with the timeout, which blocks the host,
    # then aborts the communicator and raises "... ran for N milliseconds
    # before timing out". The group is unusable after.
    short = dist.new_group(backend="hsdp")
    dist.all_reduce(torch.ones(1, device=dev), group=short)  # its communicator, made
    torch.cuda.synchronize()
    t = torch.full((4, 2), 3.0, device=dev).t()  # a post-step: hsdp's own Work
    torch.cuda._sleep(cycles)
    work = dist.all_reduce(t, group=short, async_op=True)
    try:
        work.wait(timeout=datetime.timedelta(milliseconds=10))
    except RuntimeError as exc:
        assert "before timing out" in str(exc), exc
    else:
        raise AssertionError("wait(timeout) must honour its timeout while the GPU is busy")
    torch.cuda.synchronize()


def trace_body(rank, world):
    """The flight recorder follows the GPU: NCCL completes a Work's future
    when the op is enqueued (and a synchronous call returns then), so an op
    queued behind a long kernel must read "started" in a dump until the GPU
    has run it; that is what lets ``python -m hsdp_backend.trace`` name the
    op a GPU hang is stuck in. Both forms: synchronous (no Work) and async
    with hsdp's own Work (a post-step)."""
    import json
    import pathlib

    import torch.distributed as dist

    import hsdp_backend

    dev = _gpu_with_communicator(rank)
    cycles = _cycles_per_second(dev)

    def last_state():
        [path] = hsdp_backend.dump_trace("asked")
        return json.loads(pathlib.Path(path).read_text())["entries"][-1]["state"]

    torch.cuda._sleep(cycles)
    dist.all_reduce(torch.ones(8, device=dev))
    assert last_state() == "started", "a synchronous op read done before the GPU ran it"
    torch.cuda.synchronize()
    assert last_state() == "completed"
    # The async form once, untimed (see gpu_work_body).
    dist.all_reduce(torch.ones(4, 2, device=dev).t(), async_op=True).wait()
    torch.cuda.synchronize()
    torch.cuda._sleep(cycles)
    start = time.monotonic()
    work = dist.all_reduce(torch.ones(4, 2, device=dev).t(), async_op=True)
    issued = time.monotonic() - start
    assert issued < 0.5, (
        f"the async call blocked the host for {issued:.2f} s: it waited for the GPU"
    )
    assert last_state() == "started", "an async op read done before the GPU ran it"
    work.wait()
    torch.cuda.synchronize()
    assert last_state() == "completed"


def _beside_a_capture(dev, action, what):
    """Runs ``action()`` on another thread while this one captures a CUDA graph in torch's
    default, global mode (which any thread's event query invalidates, unless that thread is in
    ThreadLocal mode, as ProcessGroupNCCL's watchdog sets it); the capture must end and
    replay."""
    import threading

    capturing, acted = threading.Event(), threading.Event()
    errors = []

    def act():
        capturing.wait(timeout=60)
        try:
            action()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        acted.set()

    thread = threading.Thread(target=act)
    thread.start()
    graph = torch.cuda.CUDAGraph()
    x = torch.ones(256, device=dev)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        graph.capture_begin()
        y = x * 2
        capturing.set()
        assert acted.wait(timeout=60), f"{what} beside the capture did not return"
        y = y + 1
        graph.capture_end()  # raises if a query invalidated the capture
    thread.join(timeout=60)
    assert not errors, errors
    graph.replay()
    torch.cuda.synchronize()
    _check(y, torch.full((256,), 3.0), f"the graph captured beside {what}")


def dump_beside_a_capture_body(rank, world):
    """A flight-record dump queries the "done" events of pending entries."""
    import hsdp_backend

    dev = _gpu_with_communicator(rank)
    torch.cuda._sleep(_cycles_per_second(dev) // 2)
    work = dist.all_reduce(torch.ones(4, 2, device=dev).t(), async_op=True)  # pending: an event
    _beside_a_capture(dev, lambda: hsdp_backend.dump_trace("asked"), "a dump")
    work.wait()


def op_beside_a_capture_body(rank, world):
    """An op issued while a post-step is pending asks whether that post-step is done
    (StreamOrdered::beforeIssue)."""
    dev = _gpu_with_communicator(rank)
    t = torch.ones(8, device=dev)  # allocated before the capture: the op allocates nothing
    torch.cuda.synchronize()
    torch.cuda._sleep(_cycles_per_second(dev) // 2)
    pending = dist.all_reduce(torch.ones(4, 2, device=dev).t(), async_op=True)  # a post-step
    _beside_a_capture(dev, lambda: dist.all_reduce(t), "an op")
    pending.wait()
    torch.cuda.synchronize()
    _check(t, torch.full((8,), float(world)), "the op beside the capture")


@one_gpu
@pytest.mark.parametrize("world", WORLDS)
def test_gpu_op_beside_a_capture(world):
    run_on_gpus(op_beside_a_capture_body, world)


@one_gpu
@pytest.mark.parametrize("world", WORLDS)
def test_gpu_dump_beside_a_capture(tmp_path, world):
    run_on_gpus(dump_beside_a_capture_body, world, env={"HSDP_TRACE_DIR": str(tmp_path)})


@one_gpu
@pytest.mark.parametrize("world", WORLDS)
def test_gpu_flight_record_follows_the_device(tmp_path, world):
    run_on_gpus(trace_body, world, env={"HSDP_TRACE_DIR": str(tmp_path)})


def _train_as_the_plain_module(model, ref, dev, what):
    """Three SGD steps of the sharded ``model`` and the plain ``ref`` on the
    same batches; the parameters must end equal."""
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    for step in range(3):
        x = torch.randn(8, 16, device=dev, generator=torch.Generator(dev).manual_seed(step))
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        _check(p.full_tensor(), q.detach(), f"{what} parameter {n}")


def _shard_with_comm(model, mesh, comm):
    """fully_shard on each Linear and the root; ``comm``: FSDP2's buffers from the group
    ("pg_alloc") or NCCL symmetric memory ("symm_mem"), else FSDP2's own."""
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for m in model.modules():
        if comm == "pg_alloc" and hasattr(m, "set_allocate_memory_from_process_group_for_comm"):
            m.set_allocate_memory_from_process_group_for_comm(True)
        if comm == "symm_mem" and hasattr(m, "set_symm_mem_for_comm"):
            m.set_symm_mem_for_comm()


def fsdp_body(rank, world, comm=None):
    """FSDP2 on a 1-D mesh of every rank against a plain module (every rank
    trains on the same batches, so the averaged gradient is the plain one's); ``comm``: FSDP2's
    buffers from the group's allocate_tensor ("pg_alloc": NCCL's pool through
    hsdp) or from NCCL symmetric memory ("symm_mem": the inner NCCL is
    registered under the hsdp group's name, and runs the collectives)."""
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh

    dev = _device(rank)
    torch.cuda.set_device(dev)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(dev)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(dev)
    model.load_state_dict(ref.state_dict())
    mesh = init_device_mesh("cuda", (world,))
    _shard_with_comm(model, mesh, comm)
    _train_as_the_plain_module(model, ref, dev, f"FSDP2 on {world} rank(s)")


def buffers_body(rank, world):
    """allocate_tensor on CUDA is the inner NCCL's: hsdp answers
    supports_tensor_alloc as a plain nccl group does, and a collective on
    the buffer it hands out is right."""
    dev = _device(rank)
    torch.cuda.set_device(dev)
    hsdp = dist.group.WORLD._get_backend(dev)
    # The ProcessGroupNCCL hsdp wraps (on 2.15 plain "nccl" is ProcessGroupNCCL2).
    nccl = dist.new_group(backend=_torch_compat.WRAPPED_NCCL)._get_backend(dev)
    supported = nccl.supports_tensor_alloc(dev)
    # Two bools: compared as they are (_check compares tensors).
    assert hsdp.supports_tensor_alloc(dev) == supported, "supports_tensor_alloc(cuda)"
    if not supported:
        return
    # A group made without device_id has no NCCL communicator before its
    # first collective, and NCCL's pool needs one: a barrier makes it, on
    # hsdp as on nccl (FSDP2 relies on that before symmetric memory), though
    # dist.barrier hands an hsdp group a cpu device.
    fresh = dist.new_group(backend="hsdp")
    dist.barrier(group=fresh)
    t = fresh._get_backend(dev).allocate_tensor(1024, dtype=torch.float32, device=dev)
    assert t.device == dev, f"allocate_tensor's device: {t.device}, expected {dev}"
    t.fill_(3)
    out = torch.empty(1024 * world, device=dev)
    dist.all_gather_into_tensor(out, t, group=fresh)
    _check(out, torch.full_like(out, 3), "all_gather on an allocated buffer")


def pool_streams_body(rank, world):
    """Async ops with a post-step, and the flight recorder following them,
    draw no stream from c10's pool per op (ProcessGroupNCCL takes one per
    communicator, once): a pool stream a user's torch.cuda.Stream() hands out
    is never made to wait on one of hsdp's collectives. The pool hands its
    streams out in turn, so the next one after the ops tells how many were
    drawn meanwhile."""
    import torch.distributed as dist

    import hsdp_backend

    dev = _device(rank)
    torch.cuda.set_device(dev)

    def ops():
        t = torch.ones(1024, device=dev)
        hsdp_backend.all_reduce(t, divide_by=2.0, async_op=True).wait()  # a post-step (one rank)
        dist.all_reduce(t, async_op=True).wait()  # none: the recorder follows NCCL's Work
        dist.reduce_scatter_tensor(
            torch.empty(1024, device=dev), t, op=dist.ReduceOp.AVG, async_op=True
        ).wait()
        torch.cuda.synchronize()

    ops()  # the group takes its streams, once
    cycle = [torch.cuda.Stream().stream_id]
    while (next_id := torch.cuda.Stream().stream_id) != cycle[0]:
        cycle.append(next_id)
        assert len(cycle) <= 1024, "c10's stream pool did not cycle"
    rounds = 5  # coprime with the pool's size (32): d draws a round cannot add up to a cycle
    for extended in (False, True):
        # An ephemeral timeout (torch.compile's) is released by a callback on each op's future.
        if extended and _torch_compat.EPHEMERAL_TIMEOUT_ON_ANY_BACKEND:
            dist.distributed_c10d._add_ephemeral_timeout_for_all_pgs(datetime.timedelta(seconds=30))
        start = torch.cuda.Stream().stream_id
        for _ in range(rounds):
            ops()
        draws = (cycle.index(torch.cuda.Stream().stream_id) - cycle.index(start) - 1) % len(cycle)
        assert draws == 0, (
            f"hsdp drew {draws} pool stream(s) (mod {len(cycle)}) in {rounds} rounds"
            f"{' under an ephemeral timeout' if extended else ''}"
        )


def bf16_scaling_body(rank, world):
    """bf16 divide_by and PREMUL_SUM(0.125) against the exact answer in fp64: hsdp's bf16
    result is the fp64 one rounded once (a correct NCCL PREMUL_SUM multiplies each input
    by the rounded factor before summing: exact here, as every value is a small dyadic),
    on whatever this torch's ProcessGroupNCCL does with a bf16 factor (docs/versions.md)."""
    assert world <= 4, "the values below are exact in bf16 up to 4 ranks"
    import hsdp_backend

    dev = _device(rank)
    # Up to 16 x (1 + .. + 4) = 160: every partial sum, scaled or not, is exact in bf16.
    values = torch.arange(1, 17, dtype=torch.float64) * (rank + 1)
    exact = torch.arange(1, 17, dtype=torch.float64) * (world * (world + 1) / 2)
    for what, call, scale in (
        ("divide_by 8", lambda t: hsdp_backend.all_reduce(t, divide_by=8.0), 1 / 8),
        ("PREMUL_SUM(0.125)", lambda t: dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.125)),
         0.125),
    ):  # fmt: skip
        t = values.to(device=dev, dtype=torch.bfloat16)
        call(t)
        want = (exact * scale).to(torch.bfloat16)
        assert torch.equal(t.cpu(), want), f"bf16 {what}: {t.cpu()[:4]} != {want[:4]}"


@one_gpu
@pytest.mark.parametrize(
    "body",
    [
        chained_ops_body,
        pool_streams_body,
        gpu_work_body,
        gpu_memory_body,
        gpu_graphs_body,
        gpu_bounded_wait_body,
        fsdp_body,
        buffers_body,
        bf16_scaling_body,
    ],
)
@pytest.mark.parametrize("world", WORLDS)
def test_gpu(body, world):
    run_on_gpus(body, world)


@one_gpu
@pytest.mark.parametrize("comm", ["pg_alloc", "symm_mem"])
@pytest.mark.parametrize("world", WORLDS)
def test_gpu_fsdp_communication_buffers(comm, world):
    run_on_gpus(fsdp_body, world, comm=comm)


def hsdp_mesh_body(rank, world, comm=None):
    """FSDP2 on an HSDP (replicate x shard) mesh (1 x 1 at one rank, 2 x
    world/2 else) on the GPU with the shim: its buckets and replicate
    all-reduces run on FSDP2's real streams, the parameters equal a plain
    module's after three steps. ``comm``: FSDP2's buffers from the group
    ("pg_alloc") or NCCL symmetric memory ("symm_mem", whose reduce-scatter
    refuses an output not from its own allocate(): the shim must not hand it
    a slice of its bucket)."""
    from torch.distributed.device_mesh import init_device_mesh

    dev = _device(rank)
    torch.cuda.set_device(dev)
    shape = (1, 1) if world == 1 else (2, world // 2)
    mesh = init_device_mesh("cuda", shape, mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16)).to(
        dev
    )
    model = copy.deepcopy(ref)
    _shard_with_comm(model, mesh, comm)
    _train_as_the_plain_module(model, ref, dev, f"HSDP {shape[0]}x{shape[1]}")


def staged_async_body(rank, world):
    """Async ops whose arguments hsdp stages (non-contiguous tensors), issued
    back to back and waited for together: the staged copies live until NCCL
    and the copy back are done (run under TORCH_CUDA_SANITIZER too)."""
    dev = _device(rank)
    torch.cuda.set_device(dev)
    a = torch.arange(24.0, device=dev).view(4, 6).t()
    b = torch.arange(12.0, device=dev).view(3, 4).t()
    out = torch.empty(12 * world, device=dev)
    works = [
        dist.all_reduce(a, op=dist.ReduceOp.AVG, async_op=True),
        dist.all_gather_into_tensor(out, b, async_op=True),
        dist.all_reduce(torch.ones(3, 2, device=dev).t(), async_op=True),
    ]
    for w in works:
        w.wait()
    _check(a, torch.arange(24.0).view(4, 6).t(), "AVG of a staged tensor")
    _check(out, torch.arange(12.0).view(3, 4).t().reshape(-1).repeat(world), "staged all_gather")


def split_from_nccl_body(rank, world):
    """An hsdp group under a plain nccl default group bound to the device:
    torch hands hsdp's creator the default's ProcessGroupNCCL to split from
    (``split_from``), so the inner NCCL is ncclCommSplit's child of it, and
    collectives on it, then on the default group again, give NCCL's sums."""
    import hsdp_backend._registration as registration

    dev = _device(rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    try:
        parents = []
        pick = registration._split_parent

        def recording(opts):
            parent = pick(opts)
            parents.append(parent)
            return parent

        registration._split_parent = recording
        try:
            group = dist.new_group(list(range(world)), backend="hsdp")
        finally:
            registration._split_parent = pick
        assert parents and isinstance(parents[0], dist.ProcessGroupNCCL), (
            f"hsdp's inner NCCL was not split from the default group: {parents!r}"
        )
        t = torch.full((1024,), float(rank + 1), device=dev)
        dist.all_reduce(t, group=group)
        _check(
            t, torch.full((1024,), world * (world + 1) / 2), "all_reduce on the split hsdp group"
        )
        dist.all_reduce(t)
        _check(t, torch.full((1024,), world * world * (world + 1) / 2), "then on the nccl default")
        dist.destroy_process_group(group)
    finally:
        dist.destroy_process_group()


@one_gpu
@pytest.mark.parametrize("world", WORLDS)
def test_gpu_hsdp_group_split_from_a_bound_nccl_default(world):
    run_on_gpus(split_from_nccl_body, world, backend=None)


@one_gpu
@pytest.mark.parametrize("world", WORLDS)
def test_gpu_staged_async(world):
    run_on_gpus(staged_async_body, world)


@one_gpu
@pytest.mark.parametrize("comm", [None, "pg_alloc", "symm_mem"])
@pytest.mark.parametrize("world", sorted({1, 4}))
def test_gpu_hsdp_mesh(world, comm):
    run_on_gpus(hsdp_mesh_body, world, comm=comm)


@one_gpu
@pytest.mark.parametrize("body", ["chained_ops_body", "staged_async_body"])
def test_one_gpu_under_cuda_sanitizer(body):
    code = f"import test_cuda, harness; harness.run_ranks(test_cuda.{body}, 1, device='cuda')"
    # Run from the repository root: the tests' modules and tools/ on the path, as pytest's.
    path = os.pathsep.join([".", "tests", "tests/integration"])
    env = dict(os.environ, TORCH_CUDA_SANITIZER="1", PYTHONPATH=path)
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    assert proc.returncode == 0 and "CSAN" not in proc.stderr, proc.stderr[-4000:]


def parity_body(rank, world):
    """Against NCCL's own AVG (a plain nccl group) and with overlap."""
    import torch.distributed as dist

    import hsdp_backend

    dev = _device(rank)
    torch.cuda.set_device(dev)
    # The ProcessGroupNCCL hsdp wraps (on 2.15 plain "nccl" is ProcessGroupNCCL2).
    nccl = dist.new_group(backend=_torch_compat.WRAPPED_NCCL)
    g = torch.Generator(dev).manual_seed(rank)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(4096, device=dev, dtype=dtype, generator=g)
        a, b = x.clone(), x.clone()
        dist.all_reduce(a, op=dist.ReduceOp.AVG)
        dist.all_reduce(b, op=dist.ReduceOp.AVG, group=nccl)
        assert torch.equal(a, b), f"{dtype}: hsdp's AVG must be NCCL's own"
    # async bucketed reduce across several buckets overlapping compute
    ts = [torch.full((1 << 18,), float(rank), device=dev) for _ in range(4)]
    work = hsdp_backend.all_reduce_coalesced(
        ts, op=dist.ReduceOp.AVG, bucket_bytes=1 << 20, async_op=True
    )
    y = torch.randn(2048, 2048, device=dev) @ torch.randn(2048, 2048, device=dev)
    work.wait()
    for t in ts:
        _check(t, torch.full((t.numel(),), sum(range(world)) / world), "bucketed AVG")
    assert torch.isfinite(y).all()
    # planBuckets (csrc/fusion/FlatPack.cpp) closes a bucket before the
    # tensor that would take it past bucket_bytes: four 1 MiB tensors with
    # 1 MiB buckets are four buckets, each one collective.
    assert hsdp_backend.comm_stats()["all_reduce_coalesced"]["collectives"] == 4


@one_gpu
def test_gpu_parity_and_overlap():
    run_on_gpus(parity_body, max(2, RANKS))


def plain_nccl_bf16_body(rank, world):
    """bf16 PREMUL_SUM(0.5) of ones on the plain ProcessGroupNCCL hsdp wraps, beside hsdp's:
    hsdp must give world/2; the plain group's answer is returned (0 on a release that loses
    the factor, torch 2.11-2.13)."""
    dev = _device(rank)
    plain = dist.new_group(backend=_torch_compat.WRAPPED_NCCL)
    got = {}
    for name, group in (("hsdp", None), ("nccl", plain)):
        t = torch.ones(4, device=dev, dtype=torch.bfloat16)
        dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5), group=group)
        got[name] = t.float().tolist()
    assert got["hsdp"] == [world * 0.5] * 4, got
    return got["nccl"]


@one_gpu
def test_gpu_bf16_premul_sum_beside_plain_nccl():
    world = max(2, RANKS)
    plain = run_on_gpus(plain_nccl_bf16_body, world)[0]
    fixed = _torch_compat.final_release(torch.__version__)
    if fixed is not None:  # a release says what its ProcessGroupNCCL does
        keeps = fixed >= _torch_compat.BF16_PREMUL_SUM_FIXED_IN
        assert (plain == [world * 0.5] * 4) == keeps, (torch.__version__, plain)
