"""Replicate buckets: the FSDP2 shim's bucket planner and in-flight tracker.

Nothing here knows FSDP2: a bucket collects flat gradient shards of the
same (replicate group, divisor, dtype, device), all-reduces them as one
``dist.all_reduce`` with the division as a PREMUL_SUM factor, and hands each
shard back through its own ``finish()`` (``_compat.PendingGrads`` for FSDP2's
gradient tail; plain objects in the tests). The bucket size is a setting
passed in (``ReplicateBuckets.bucket_bytes``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

# Buckets whose all-reduce may be in flight before the oldest is waited for
# and its gradients finished (CPU, where buckets wait for hsdp's Work): the
# shim then holds at most this many buckets beside the open one, not the
# whole model's reduce-dtype gradients until the end of backward.
MAX_IN_FLIGHT = 2


class Pending(Protocol):
    """One param group's reduced shard, waiting for its bucket's all-reduce."""

    flat: torch.Tensor  # a slice of the bucket's buffer (repointed when it moves)

    def views_flat(self) -> bool: ...  # whether finish() leaves gradients viewing flat

    def finish(self) -> None: ...


def ordered_by_streams(device: torch.device) -> bool:
    """Whether buckets on ``device`` are ordered by streams and events (GPUs)
    rather than by waiting for hsdp's async Work (CPU, where the all-reduce
    overlaps backward on hsdp's own thread). Tests switch it to run the
    stream-ordered code on CPU, whose streams and events are no-ops."""
    return device.type != "cpu"


@dataclass
class Streams:
    """The reduce-scatter and all-reduce streams of one reduction, or None
    for both when buckets wait for Work instead."""

    module: Any  # torch.cuda (or torch.cpu under test)
    reduce_scatter: Any
    all_reduce: Any

    @staticmethod
    def of(device: torch.device, reduce_scatter_stream, all_reduce_stream) -> Streams:
        if not ordered_by_streams(device):
            return Streams(None, None, None)
        return Streams(torch.get_device_module(device), reduce_scatter_stream, all_reduce_stream)

    @property
    def ordered(self) -> bool:
        return self.module is not None

    def writing(self):
        """The context in which bucket memory is allocated and written: the
        reduce-scatter stream, which writes each param group's slice."""
        return self.module.stream(self.reduce_scatter) if self.ordered else contextlib.nullcontext()


@dataclass
class Bucket:
    group: Any
    divide_by: float
    buffer: torch.Tensor
    streams: Streams
    used: int = 0
    pending: list[Pending] = field(default_factory=list)
    done: Any = None  # stream-ordered: the event recorded after the all-reduce
    grads_alias: bool = False  # finished gradients are views of the buffer (no cast)

    def held_bytes(self) -> int:
        """Reduce-dtype bytes the shim holds for this bucket beyond the
        gradients' own (0 once finished: dropped, or the gradients' memory)."""
        if self.buffer is None or self.grads_alias:
            return 0
        return self.buffer.numel() * self.buffer.itemsize


def move(bucket: Bucket, buffer: torch.Tensor) -> None:
    """Copies ``bucket``'s filled part into ``buffer`` and repoints its
    param groups' slices there."""
    buffer[: bucket.used].copy_(bucket.buffer[: bucket.used])
    base = bucket.buffer.data_ptr()
    for pending in bucket.pending:
        start = (pending.flat.data_ptr() - base) // pending.flat.itemsize
        pending.flat = buffer[start : start + pending.flat.numel()]
    bucket.buffer = buffer


class ReplicateBuckets:
    """Buckets of one backward pass, keyed by (replicate group, divisor, dtype, device).

    ``reserve`` hands out the next slice of the open bucket; ``add`` records
    the param group that filled it and flushes the bucket once it holds at
    least ``bucket_bytes`` (so a backward issues at most
    ``floor(gradient bytes / bucket_bytes) + 1`` all-reduces per key). A
    flushed bucket's gradients are finished (cast, ``.grad``) as soon as its
    all-reduce is done, as FSDP2 finishes each group right after its own
    all-reduce: on GPUs on the all-reduce stream right behind it, on CPU
    when its Work completes (at the latest once more than ``MAX_IN_FLIGHT``
    buckets are in flight). ``finish`` (the autograd final callback) flushes
    the rest, waits for every all-reduce and finishes what is left.
    ``peak_held_bytes``: the most reduce-dtype bytes held at once in the
    last backward.
    """

    def __init__(self, bucket_bytes: int = 0) -> None:
        self.bucket_bytes = bucket_bytes
        self.open: dict[tuple, Bucket] = {}
        # (Work or None when stream-ordered, bucket)
        self.in_flight: list[tuple[Any, Bucket]] = []
        # Autograd graph tasks in which our final callback is queued. A nested
        # backward (reentrant activation checkpointing) is its own task: it
        # gets a callback too, which finishes early what is bucketed by then.
        self.callback_tasks: set[int] = set()
        # Param-group sizes reserved per key, in order, in this backward and in
        # the previous one. Backward order repeats from step to step, so the
        # previous sizes tell a new bucket exactly how large it will get.
        self.sizes_now: dict[tuple, list[int]] = {}
        self.sizes_before: dict[tuple, list[int]] = {}
        self.peak_held_bytes = 0
        self._peak_now = 0

    def _note_held(self) -> None:
        held = sum(b.held_bytes() for b in self.open.values())
        held += sum(b.held_bytes() for _, b in self.in_flight)
        self._peak_now = max(self._peak_now, held)

    def begin_add(self) -> bool:
        """Makes sure a final callback of the current backward will finish
        what is added; False outside autograd (the caller finishes at once)."""
        task = torch._C._current_graph_task_id()
        if task == -1:
            return False
        if task not in self.callback_tasks:
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self.finish(task))
            self.callback_tasks.add(task)
        return True

    def reserve(
        self,
        group,
        divide_by: float,
        dtype: torch.dtype,
        numel: int,
        device: torch.device,
        streams: Streams,
    ) -> tuple[tuple, torch.Tensor]:
        """The bucket key and a ``numel`` slice of that bucket's buffer."""
        key = (group.group_name, divide_by, dtype, device)
        sizes = self.sizes_now.setdefault(key, [])
        sizes.append(numel)
        bucket_numel = self.bucket_bytes // dtype.itemsize
        bucket = self.open.get(key)
        with streams.writing():
            if bucket is None:
                capacity = self._planned_capacity(key, len(sizes) - 1, bucket_numel) or max(
                    numel, bucket_numel
                )
                bucket = Bucket(
                    group, divide_by, torch.empty(capacity, dtype=dtype, device=device), streams
                )
                self.open[key] = bucket
            elif bucket.used + numel > bucket.buffer.numel():
                # An under-full bucket and a param group larger than what is
                # left (first backward, or the order changed): move the bucket
                # to a larger buffer. It holds < bucket_bytes: a small copy.
                move(
                    bucket,
                    torch.empty(max(bucket.used + numel, bucket_numel), dtype=dtype, device=device),
                )
        start = bucket.used
        bucket.used += numel
        return key, bucket.buffer[start : bucket.used]

    def _planned_capacity(self, key: tuple, index: int, bucket_numel: int) -> int | None:
        """Elements the bucket opened at reservation ``index`` will hold, if
        this backward repeats the previous one's sizes; else None."""
        before = self.sizes_before.get(key, [])
        if before[: index + 1] != self.sizes_now[key]:
            return None
        total = 0
        for numel in before[index:]:
            total += numel
            if total >= bucket_numel:
                break
        return total

    def add(self, key: tuple, pending: Pending, in_backward: bool) -> None:
        """Records the param group that filled its reserved slice."""
        bucket = self.open[key]
        bucket.pending.append(pending)
        self._note_held()
        if bucket.used * bucket.buffer.itemsize >= self.bucket_bytes:
            self.flush(key)
        if not in_backward:  # no final callback would finish it
            self.finish()

    def flush(self, key) -> None:
        bucket = self.open.pop(key)
        if not bucket.pending:
            return
        # The division as a PREMUL_SUM factor on an ordinary all_reduce: it
        # goes through c10d's dispatcher (CommDebugMode, the profiler and
        # compiled code see it), and hsdp still applies it once, inside the
        # reduction (NCCL natively; the shared-memory engine in fp32).
        op = (
            dist.ReduceOp.SUM
            if bucket.divide_by == 1
            else dist._make_nccl_premul_sum(1.0 / bucket.divide_by)
        )
        data = bucket.buffer[: bucket.used]
        streams = bucket.streams
        if not streams.ordered:
            self.in_flight.append(
                (dist.all_reduce(data, op=op, group=bucket.group, async_op=True), bucket)
            )
            self._finish_completed()
            return
        # As FSDP2's own HSDP all-reduce: on its all-reduce stream, after the
        # reduce-scatters that wrote the bucket; ordered, so no Work to keep.
        # The gradients are finished right behind it on that stream (the
        # reduce-dtype buffer is then free once the casts have run); the
        # final callback makes the consumers' stream wait for the event.
        streams.all_reduce.wait_stream(streams.reduce_scatter)
        with streams.module.stream(streams.all_reduce):
            dist.all_reduce(data, op=op, group=bucket.group)
            self._finish_bucket(bucket)
            bucket.done = streams.all_reduce.record_event()
        if bucket.buffer.is_cuda:  # read and written there too, not only where allocated
            bucket.buffer.record_stream(streams.all_reduce)
        if not bucket.grads_alias:
            bucket.buffer = None  # cast: free once the all-reduce stream is past the casts
        self.in_flight.append((None, bucket))

    @staticmethod
    def _finish_bucket(bucket: Bucket) -> None:
        pending, bucket.pending = bucket.pending, []
        for p in pending:
            p.finish()
            if p.views_flat():
                bucket.grads_alias = True

    def _finish_completed(self) -> None:
        """CPU: finishes the gradients of buckets whose all-reduce is done,
        oldest first, waiting for the oldest while too many are in flight."""
        while self.in_flight:
            work, bucket = self.in_flight[0]
            if work is None or not bucket.pending:
                break
            if len(self.in_flight) <= MAX_IN_FLIGHT and not work.is_completed():
                break
            try:
                wait(work, bucket)
            except Exception:
                self.abandon()
                raise
            self._finish_bucket(bucket)
            self.in_flight.pop(0)

    def finish(self, task: int | None = None) -> None:
        """Flushes every open bucket, waits for all and finishes every param
        group's gradients (whichever backward added them)."""
        self.callback_tasks.discard(task)
        if not self.open and not self.in_flight:
            return  # an outer backward's callback after a nested one finished all
        try:
            for key in list(self.open):
                self.flush(key)
            in_flight, self.in_flight = self.in_flight, []
            failure = None
            for work, bucket in in_flight:  # wait for all, even after a failure
                try:
                    wait(work, bucket)
                except Exception as exc:  # noqa: BLE001 - re-raised below
                    failure = failure or exc
            if failure is not None:
                raise failure
            for _, bucket in in_flight:
                self._finish_bucket(bucket)
        finally:
            self.open.clear()
            self.in_flight.clear()
            self.sizes_before, self.sizes_now = self.sizes_now, {}
            self.peak_held_bytes, self._peak_now = self._peak_now, 0

    def abandon(self) -> None:
        in_flight, self.in_flight = self.in_flight, []
        self.open.clear()
        self.callback_tasks.clear()
        self.sizes_now = {}
        for work, bucket in in_flight:
            try:
                wait(work, bucket)
            except Exception:  # noqa: BLE001 - the failure was reported by the backward that raised
                pass


def wait(work, bucket: Bucket) -> None:
    """Orders what follows after ``bucket``'s all-reduce: waits for its Work
    (CPU), or makes the current stream wait on its event (GPU, no host wait)."""
    if work is not None:
        work.wait()
        return
    streams = bucket.streams
    current = streams.module.current_stream()
    if bucket.done is not None:
        current.wait_event(bucket.done)
    if bucket.buffer is not None and bucket.buffer.is_cuda:  # `.grad` views of it are used there
        bucket.buffer.record_stream(current)
