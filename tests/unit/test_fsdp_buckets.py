"""The FSDP2 shim's bucket planner and in-flight tracker on plain tensors, without FSDP2.

The FSDP2 shim's bucket planner on plain tensors (no FSDP2): when a bucket closes, a repeated
backward sizing its buckets exactly, a bucket that must grow, the division once, at most two
buckets in flight, `abandon()`."""

import pytest
from harness import run_ranks

# Runs on every supported torch release too (scripts/test.sh's compat stages).
pytestmark = pytest.mark.every_torch


class _Grad:
    """A stand-in for one param group's pending gradient: records its value
    when finished."""

    def __init__(self, flat, finished):
        self.flat = flat
        self._finished = finished

    def views_flat(self):
        return True

    def finish(self):
        self._finished.append(self.flat.clone())


def _buckets_body(rank, world):
    import torch
    import torch.distributed as dist

    import hsdp_backend
    from hsdp_backend.fsdp import _buckets

    cpu = torch.device("cpu")
    streams = _buckets.Streams.of(cpu, None, None)
    # 16 fp32 elements per bucket
    buckets = _buckets.ReplicateBuckets(bucket_bytes=64)
    group = dist.group.WORLD

    def backward(sizes, divide_by=1.0):
        finished = []
        hsdp_backend.reset_comm_stats()
        for i, numel in enumerate(sizes):
            key, out = buckets.reserve(group, divide_by, torch.float32, numel, cpu, streams)
            out.fill_(float(i + 1) * world)  # every rank the same: the sum is world x this
            buckets.add(key, _Grad(out, finished), in_backward=True)
        buckets.finish()
        return finished, hsdp_backend.comm_stats()["all_reduce"]["collectives"]

    # A bucket closes once it holds bucket_bytes: 4 + 4 + 8 fill one, 4 opens the next.
    finished, all_reduces = backward([4, 4, 8, 4])
    assert all_reduces == 2, all_reduces
    assert [t.numel() for t in finished] == [4, 4, 8, 4]
    for i, t in enumerate(finished):
        assert torch.equal(t, torch.full_like(t, (i + 1) * world * world)), (i, t)
    # The same sizes again: each bucket is made as large as it will get (no move).
    moves = []
    original_move = _buckets.move
    _buckets.move = lambda *a: (moves.append(1), original_move(*a))
    try:
        backward([4, 4, 8, 4])
        assert moves == [], "a repeated backward moved a bucket"
        backward([4, 4, 4, 12])  # sizes changed: the open bucket must grow
        assert moves, "a group larger than what is left must move the bucket"
    finally:
        _buckets.move = original_move
    # The division: once, inside the all-reduce.
    finished, _ = backward([16], divide_by=4.0)
    assert torch.equal(finished[0], torch.full((16,), world * world / 4.0)), finished[0]
    # Async on CPU: a full bucket's gradients are finished once its Work is done,
    # at the latest when more than MAX_IN_FLIGHT buckets are in flight.
    finished = []
    for i in range(5):
        key, out = buckets.reserve(group, 1.0, torch.float32, 16, cpu, streams)
        out.fill_(1.0)
        buckets.add(key, _Grad(out, finished), in_backward=True)
        assert len(buckets.in_flight) <= _buckets.MAX_IN_FLIGHT, len(buckets.in_flight)
    buckets.finish()
    assert len(finished) == 5
    assert buckets.peak_held_bytes <= (_buckets.MAX_IN_FLIGHT + 2) * 64, buckets.peak_held_bytes
    # abandon(): nothing left, nothing finished after it.
    finished = []
    key, out = buckets.reserve(group, 1.0, torch.float32, 16, cpu, streams)
    buckets.add(key, _Grad(out, finished), in_backward=True)
    buckets.abandon()
    assert not buckets.open and not buckets.in_flight
    return True


def test_buckets_on_plain_tensors():
    assert run_ranks(_buckets_body, 2) == [True, True]
