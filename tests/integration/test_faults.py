"""Faults on the shared-memory engine: killed, stuck and mismatched peers fail every rank clearly,
within the timeout, leaving no shm.

Faults on the shared-memory engine: a peer killed with SIGKILL in the
middle of a collective, a stuck peer, ranks that call different collectives.
Every surviving rank must raise torch.distributed.DistBackendError naming the
rank and the op, well within the timeout, and nothing may stay in /dev/shm.

A peer killed with SIGKILL mid-collective (detected in well under the timeout), a stuck peer
(engine deadline), mismatched calls (size, kind, dtype) failing on every rank, ranks disagreeing
on the segment size falling back to gloo together, ranks with different protocol settings using
rank 0's; no segment left in `/dev/shm` (checked after the whole suite too)."""

import os
import signal
import threading
import time

import pytest
from conftest import hsdp_segments
from harness import run_ranks


def expect_backend_error(fn, *patterns):
    import torch.distributed as dist

    start = time.monotonic()
    try:
        fn()
    except dist.DistBackendError as exc:
        text = str(exc)
        for p in patterns:
            assert p in text, f"{p!r} not in {text!r}"
        return time.monotonic() - start, text
    raise AssertionError(f"expected DistBackendError containing {patterns}")


def dead_peer_body(rank, world):
    import torch
    import torch.distributed as dist

    big = torch.ones(8 << 20)  # 32 MiB: many pipelined steps
    if rank == world - 1:
        # Die in the middle of the collective: the worker runs it while a
        # timer thread kills this process.
        threading.Timer(0.05, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
        dist.all_reduce(big, async_op=True)
        time.sleep(30)
        raise AssertionError("should have been killed")

    def until_failure():
        for _ in range(1000):
            dist.all_reduce(big)

    elapsed, text = expect_backend_error(
        until_failure, f"[rank {rank}/{world}] all_reduce:", f"rank {world - 1}", "exited"
    )
    # Where every rank was: the dead one inside an all-reduce (its last state).
    assert f"rank {world - 1} " in text and " in all_reduce #" in text, text
    return elapsed


@pytest.mark.parametrize("world", [2, 3])
def test_killed_peer_surfaces_within_seconds(world):
    # Group timeout 60 s: detection must come from the liveness check.
    before = hsdp_segments()
    results = run_ranks(
        dead_peer_body, world, may_die=(world - 1,), env={"HSDP_TEST_COLLECTIVE_TIMEOUT_S": "60"}
    )
    for elapsed in results[:-1]:
        assert elapsed < 10, f"dead peer surfaced after {elapsed:.1f} s"
    assert hsdp_segments() == before


def stuck_peer_body(rank, world):
    import torch
    import torch.distributed as dist

    t = torch.ones(16)
    if rank == 1:
        time.sleep(4)  # never calls in time
        # The group is broken now; saying so is the only right answer.
        expect_backend_error(lambda: dist.all_reduce(t), "[rank 1/2] all_reduce:", "rank 0")
        return None
    elapsed, text = expect_backend_error(
        lambda: dist.all_reduce(t), "[rank 0/2] all_reduce:", "Timed out after 1500 ms", "rank 1"
    )
    return elapsed


def test_stuck_peer_times_out_with_engine_deadline():
    results = run_ranks(stuck_peer_body, 2, env={"HSDP_TIMEOUT_MS": "1500"})
    assert 1.4 < results[0] < 4, results[0]


def timeout_set_later_body(rank, world):
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    t = torch.ones(16)
    dist.all_reduce(t)  # the engine's first op, under the group's timeout at creation
    dist.group.WORLD.set_timeout(timedelta(milliseconds=1500))  # what dist.set_timeout calls
    if rank == 1:
        time.sleep(4)  # never calls in time
        expect_backend_error(lambda: dist.all_reduce(t), "[rank 1/2] all_reduce:", "rank 0")
        return None
    expect_backend_error(
        lambda: dist.all_reduce(t), "[rank 0/2] all_reduce:", "Timed out after 1500 ms", "rank 1"
    )


def test_a_timeout_set_after_creation_bounds_the_engines_next_waits():
    # Created with 30 s: only the new timeout makes rank 0 give up before rank 1 calls.
    run_ranks(timeout_set_later_body, 2, env={"HSDP_TEST_COLLECTIVE_TIMEOUT_S": "30"})


def mismatch_body(rank, world):
    import torch
    import torch.distributed as dist

    # Different sizes of the same collective.
    g = dist.new_group(backend="hsdp")
    t = torch.ones(10 + 10 * rank)
    expect_backend_error(
        lambda: dist.all_reduce(t, group=g),
        f"[rank {rank}/{world}] all_reduce:",
        "ranks called different collectives",
        "count=10",
        "count=20",
    )
    # Different collectives altogether.
    g2 = dist.new_group(backend="hsdp")
    if rank == 0:
        expect_backend_error(
            lambda: dist.broadcast(torch.ones(4), src=0, group=g2),
            "different collectives",
            "barrier",
        )
    else:
        expect_backend_error(lambda: dist.barrier(group=g2), "different collectives", "broadcast")
    # Different dtypes.
    g3 = dist.new_group(backend="hsdp")
    x = torch.ones(8, dtype=torch.float32 if rank == 0 else torch.bfloat16)
    expect_backend_error(
        lambda: dist.all_reduce(x, group=g3),
        "different collectives",
        "dtype=float32",
        "dtype=bfloat16",
    )
    # The default group, untouched by the broken ones, still works.
    y = torch.ones(3)
    dist.all_reduce(y)
    assert y.tolist() == [2.0, 2.0, 2.0]


def test_mismatched_calls_fail_on_every_rank():
    run_ranks(mismatch_body, 2)


def slot_size_mismatch_body(rank, world):
    import datetime

    import torch.distributed as dist

    from hsdp_backend import _C, get_hsdp_backend

    # Rank 1 asks for another slot size: the segment cannot be shared, so
    # every rank falls back to gloo together, and says why.
    os.environ["HSDP_SHM_SLOT_BYTES"] = str((1 << 20) * (rank + 1))
    dist.init_process_group("hsdp", timeout=datetime.timedelta(seconds=60))
    engine, why, _direct = _C.cpu_route(get_hsdp_backend())
    assert engine == "gloo", engine
    assert "HSDP_SHM_SLOT_BYTES" in why, why


def test_ranks_disagreeing_on_segment_size_fall_back_together():
    run_ranks(slot_size_mismatch_body, 2, backend=None)


def settings_differ_body(rank, world):
    import datetime

    import torch
    import torch.distributed as dist

    # Rank 1 asks for other protocol thresholds; rank 0's are used by all,
    # so every collective still matches up (no hang, no wrong data).
    if rank == 1:
        os.environ["HSDP_SHM_ONESHOT_BYTES"] = "0"
        os.environ["HSDP_SHM_DIRECT_READ_BYTES"] = "0"
        os.environ["HSDP_SHM_DIRECT_ALLREDUCE_BYTES"] = "0"
    dist.init_process_group("hsdp", timeout=datetime.timedelta(seconds=30))
    for n in (100, 5000, 300_000):
        t = torch.full((n,), float(rank + 1))
        dist.all_reduce(t)
        assert torch.equal(t, torch.full((n,), 3.0)), n
        out = torch.empty(2 * n)
        dist.all_gather_into_tensor(out, torch.full((n,), float(rank)))
        assert torch.equal(out, torch.cat([torch.zeros(n), torch.ones(n)])), n


def test_ranks_with_different_protocol_settings_use_rank_zeros():
    run_ranks(settings_differ_body, 2, backend=None)
