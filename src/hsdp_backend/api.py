"""hsdp's public Python API beyond what torch.distributed already offers."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from hsdp_backend import _C

# Raised for invalid arguments: each is a RuntimeError (what gloo raises) and a
# ValueError or TypeError (what NCCL raises), so handlers written for either catch it.
ArgumentError = _C.ArgumentError
ArgumentTypeError = _C.ArgumentTypeError

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024


def get_hsdp_backend(group: dist.ProcessGroup | None = None):
    """Returns the hsdp backend object behind ``group`` (default: WORLD).

    Raises TypeError when the group does not run on hsdp.
    """
    group = group if group is not None else dist.distributed_c10d._get_default_group()
    backend = group._get_backend(torch.device("cpu"))
    if not _C.is_hsdp(backend):
        raise TypeError(
            f"group {group.group_name!r} runs on backend {backend.name()!r}, not hsdp; "
            "create it with backend='hsdp'"
        )
    return backend


def cpu_route(group: dist.ProcessGroup | None = None) -> str:
    """What serves ``group``'s CPU collectives: ``"shm"`` (the shared-memory
    engine, all members on this host), ``"hierarchical"`` (that engine within
    each host, Gloo between hosts) or ``"gloo"`` (the inner Gloo group)."""
    return _C.cpu_route(get_hsdp_backend(group))[0]


def cpu_route_report(group: dist.ProcessGroup | None = None) -> dict:
    """How ``group``'s CPU collectives are served: ``route`` (as ``cpu_route``), ``why_not_shm``
    (why not on shared memory; empty when they are), ``direct_read_bytes`` (from what size per
    rank all-gathers and broadcasts of ordinary buffers read peers' memory in one copy; 0: never)
    and ``why_no_direct_reads`` (why the engine reads no peer's memory where the settings want
    it: the kernel's answer to the group's probe, e.g. a seccomp filter; then every collective
    stages through shared memory and there is no pool for ``allocate_tensor``)."""
    backend = get_hsdp_backend(group)
    route, why_not, direct_from = _C.cpu_route(backend)
    return {
        "route": route,
        "why_not_shm": why_not,
        "direct_read_bytes": direct_from,
        "why_no_direct_reads": _C.why_no_direct_reads(backend),
    }


def cpu_engine(group: dist.ProcessGroup | None = None) -> str:
    """``cpu_route``'s earlier name ("engine" now means the shared-memory
    engine only); kept for existing callers, with a DeprecationWarning."""
    warnings.warn("hsdp_backend.cpu_engine() is now cpu_route()", DeprecationWarning, stacklevel=2)
    return cpu_route(group)


def comm_stats(group: dist.ProcessGroup | None = None) -> dict[str, dict[str, int]]:
    """Per-op counters of ``group`` since creation or the last reset.

    Returns ``{op_name: {"calls": n, "collectives": n, "bytes": n}}`` where
    ``op_name`` is the torch.distributed call ("all_reduce",
    "all_gather_into_tensor", "reduce_scatter_tensor", ...), ``calls`` counts
    calls into hsdp, ``collectives`` counts what was actually sent (inner
    collectives or synchronisation rounds; a fused call over many tensors is
    one) and ``bytes`` counts the input bytes this rank contributed.
    """
    return _C.comm_stats(get_hsdp_backend(group))


def buffer_stats(group: dist.ProcessGroup | None = None) -> dict[str, int]:
    """Communication buffers of ``group`` on CPU (``allocate_tensor``'s pool).

    ``reserved_bytes`` and ``chunks``: shared memory the pool holds;
    ``live_bytes``: handed out and not yet freed; ``allocations``: buffers
    handed out from the pool; ``fallbacks``: requests past
    ``HSDP_SHM_POOL_BYTES`` served by ordinary memory; ``pooled_calls``:
    collectives whose every rank passed a pool buffer, which read peers'
    buffers with plain loads. All zero for a group without a pool.
    """
    return _C.buffer_stats(get_hsdp_backend(group))


def reset_comm_stats(group: dist.ProcessGroup | None = None) -> None:
    """Zeroes the counters that :func:`comm_stats` reports for ``group``."""
    _C.reset_comm_stats(get_hsdp_backend(group))


def dump_trace(reason: str = "hsdp_backend.dump_trace()") -> list[str]:
    """Writes the flight record of every hsdp group in this process (its last
    ``HSDP_TRACE_ENTRIES`` collectives on this rank) to ``HSDP_TRACE_DIR``;
    returns the files' paths. ``python -m hsdp_backend.trace DIR`` reads the
    files of all ranks and prints the first collective where they diverge.
    Groups also write theirs on their first failure and on SIGUSR1."""
    return list(_C.dump_trace(reason))


def all_reduce_coalesced(
    tensors: list[torch.Tensor],
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    async_op: bool = False,
    divide_by: float = 1.0,
):
    """All-reduces ``tensors`` in place, packed into buckets.

    Tensors are grouped by dtype and packed into buckets of at most
    ``bucket_bytes`` (a larger tensor gets a bucket of its own); each bucket
    is one collective. Tensors that already are adjacent views of one buffer
    are reduced in place without a staging copy.

    Args:
        tensors: tensors on one device; any mix of dtypes.
        op: the reduction; AVG and PREMUL_SUM run as SUM plus one scale.
        group: the process group (default: WORLD); must run on hsdp.
        bucket_bytes: the most bytes one collective carries; <= 0 packs each
            dtype into a single bucket.
        async_op: return the Work instead of waiting for it.
        divide_by: also divide the result by this, in the op's one scaling
            step (see :func:`all_reduce`).
    """
    work = _C.all_reduce_bucketed(
        get_hsdp_backend(group),
        list(tensors),
        op,
        int(bucket_bytes),
        bool(async_op),
        float(divide_by),
    )
    return _finish(work, async_op)


def _finish(work, async_op: bool):
    if async_op:
        return work
    if work is not None:  # None: the backend has completed it (as NCCL does)
        work.wait()
    return None


def all_reduce(
    tensor: torch.Tensor,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    divide_by: float = 1.0,
    async_op: bool = False,
):
    """``dist.all_reduce`` whose result is also divided by ``divide_by``.

    The division is folded into the reduction's own scaling step (AVG's
    divide by the group size, PREMUL_SUM's factor): one step. On CPU (the
    shared-memory engine and the gloo route) bf16/fp16 are scaled in fp32
    and rounded once. On CUDA the step is NCCL's PREMUL_SUM for fp32, fp64
    and fp16 (the factor rounded to the data's dtype, each input multiplied
    in that dtype before summing); for fp16, where one small factor would
    make small inputs subnormal or zero before the sum, a power-of-two part
    of the divisor (about its square root) goes into the reduction and the
    rest runs after it in fp32, rounded once, as FSDP2 splits its fp16
    divisor. bf16 is NCCL's PREMUL_SUM too where ProcessGroupNCCL keeps its
    factor (a final release from 2.14.0, or a build the probe found to;
    ``HSDP_NCCL_BF16_PREMUL_SUM``). Where it does not (2.11 to 2.13 hand
    NCCL a bf16 factor as the low half of a float, zero for every power of
    two: docs/versions.md), a division by the group size alone is NCCL's
    AVG and any other is NCCL's SUM and one multiply after it, in fp32,
    rounded once.
    This is the deferred division of a
    chain of SUM collectives over several groups: e.g. for HSDP gradients,
    ``reduce_scatter_tensor(out, grads, op=SUM, group=shard)`` then
    ``all_reduce(out, op=SUM, group=replicate, divide_by=shard_size * replicate_size)``
    divides once, at the end.

    Args:
        tensor: reduced in place.
        op: SUM, AVG or PREMUL_SUM (other ops take no divisor).
        group: the process group (default: WORLD); must run on hsdp.
        divide_by: a positive, finite divisor (a whole number for integer
            tensors, which divide with truncation).
        async_op: return the Work instead of waiting for it.
    """
    work = _C.all_reduce_divided_by(
        get_hsdp_backend(group), tensor, op, float(divide_by), bool(async_op)
    )
    return _finish(work, async_op)


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    divide_by: float = 1.0,
    async_op: bool = False,
):
    """``dist.reduce_scatter_tensor`` whose result is also divided by
    ``divide_by``, in the same single scaling step (see :func:`all_reduce`).

    Args:
        output: this rank's chunk of the result, ``input.numel() / world`` elements.
        input: the full input, ``world * output.numel()`` elements.
        op: SUM, AVG or PREMUL_SUM.
        group: the process group (default: WORLD); must run on hsdp.
        divide_by: a positive, finite divisor.
        async_op: return the Work instead of waiting for it.
    """
    work = _C.reduce_scatter_divided_by(
        get_hsdp_backend(group), output, input, op, float(divide_by), bool(async_op)
    )
    return _finish(work, async_op)
