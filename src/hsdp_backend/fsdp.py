"""FSDP2 (``fully_shard``) on hsdp: HSDP gradients with one division and
replicate all-reduces bucketed across param groups.

What FSDP2 does on its own, per param group and backward (``foreach_reduce``
in torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py):

* 1-D FSDP: one reduce-scatter with AVG (or PREMUL_SUM for a custom divide
  factor). On hsdp that already is the fused primitive: one collective over
  the group's flat gradient buffer, the division folded into the reduction's
  single scaling step. The shim leaves this path alone.
* HSDP (2-D mesh): a reduce-scatter with AVG over the shard group, then an
  all-reduce with AVG over the replicate group, per param group: two
  divisions (two roundings) and one small replicate all-reduce per group.

What the shim changes, for HSDP when both groups run on hsdp:

1. FSDP2's own reduce-scatter runs with SUM (its force-sum path with the
   division withheld) and its output is allocated straight inside a
   replicate bucket: a flat buffer of ``HSDP_FSDP_BUCKET_BYTES`` that
   collects consecutive param groups' gradient shards.
2. A full bucket is all-reduced over the replicate group at once, in place,
   while autograd computes the next blocks' gradients: on CPU as one
   asynchronous collective that hsdp runs on its own thread; on a GPU on
   FSDP2's all-reduce stream after it waited for the reduce-scatter stream
   (buckets are allocated under the reduce-scatter stream, which writes
   them), with an event recorded behind it.
3. After the backward's last param group (an autograd final callback, queued
   behind FSDP2's own) the last bucket is flushed, every bucket is waited for
   and each param group's gradient is finished as FSDP2 would: viewed out of
   the bucket, cast to the gradient dtype, assigned or accumulated into
   ``.grad``. The division by shard x replicate size (or the factor from
   ``set_gradient_divide_factor``) happens once, as the all-reduce's
   PREMUL_SUM factor (NCCL applies it inside the reduction, factor and
   products in the reduce dtype; hsdp's engine in fp32, one rounding). The all-reduces go through ``dist.all_reduce``, so
   c10d's dispatcher (CommDebugMode, the profiler) sees them. On CPU
   gradients are complete when ``loss.backward()`` returns; on a GPU the
   current stream then waits on the last bucket's event, as FSDP2's own
   final callback does: the host never synchronises.

FSDP2 offers no public hook that can defer a param group's gradients to a
later bucket (``set_all_reduce_hook`` runs after the native all-reduce, and
FSDP2 assigns ``.grad`` as soon as it returns), so the shim wraps the one
internal function FSDP2 calls per param group, ``foreach_reduce``, as
imported by ``_fsdp_param_group``. It checks that function's parameters and
``FSDPParam.to_sharded_dtensor`` when it installs; when they differ
(another torch version) it warns once and leaves FSDP2's native path, which
is correct on hsdp. Per call it also takes FSDP2's path, unchanged, when:
the device is neither CPU nor CUDA, a user all-reduce hook is set, the reduce dtype is
fp16 (FSDP2 pre-divides to avoid overflow), parameters are offloaded, or the
mesh mixes hsdp with another backend (warned once).

The shim is installed automatically when an hsdp process group is created
(``HSDP_FSDP=off`` disables it), or explicitly with :func:`enable`.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import sys
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hsdp_backend import _post_import, config

_PARAM_GROUP_MODULE = "torch.distributed.fsdp._fully_shard._fsdp_param_group"
_FULLY_SHARD_MODULE = "torch.distributed.fsdp._fully_shard._fully_shard"

# foreach_reduce's parameters as of torch 2.9-2.14; the shim calls the
# original by these names.
_FOREACH_REDUCE_PARAMS = (
    "fsdp_params",
    "unsharded_grads",
    "reduce_scatter_group",
    "reduce_scatter_stream",
    "reduce_scatter_comm",
    "orig_dtype",
    "reduce_dtype",
    "device",
    "gradient_divide_factor",
    "all_reduce_group",
    "all_reduce_stream",
    "all_reduce_grads",
    "partial_reduce_output",
    "all_reduce_hook",
    "force_sum_reduction_for_comms",
)
TESTED_TORCH = "2.14"
# FSDP2's custom-comm extension points, which foreach_reduce's signature above
# assumes, arrived in 2.9; pyproject.toml requires the same.
SUPPORTED_TORCH = ((2, 13), (2, 14))


class _Shim:
    """Process-wide state: the original function and the open buckets."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.original = None  # FSDP2's foreach_reduce while the shim is installed
        self.original_init_mp_dtypes = None  # FSDPParamGroup._init_mp_dtypes, likewise
        self.original_reset_iter_state = None  # FSDPModule.reset_iter_state, likewise
        self.bucket_bytes = 0
        self.warned: set[str] = set()
        self.buckets = _ReplicateBuckets()


def enable(bucket_bytes: int | None = None) -> bool:
    """Installs the shim for every FSDP2 module in this process.

    Args:
        bucket_bytes: capacity of one replicate all-reduce bucket; None keeps
            the current one (``HSDP_FSDP_BUCKET_BYTES`` until set).

    Returns:
        True when installed; False (with a warning) when this torch's FSDP2
        internals differ from those the shim was written for, in which case
        FSDP2 keeps its native reduction path, which is correct on hsdp.
    """
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as module

    if bucket_bytes is not None:
        _shim.bucket_bytes = int(bucket_bytes)
    elif not _shim.bucket_bytes:  # first install; later automatic calls keep a user's choice
        _shim.bucket_bytes = config.resolve().fsdp_bucket_bytes
    with _shim.lock:
        if _shim.original is not None:
            return True
        _check_torch_version(torch.__version__)
        problem = _incompatibility(module)
        if problem is not None:
            _warn_once(
                "incompatible",
                f"hsdp_backend.fsdp: {problem} (the shim was written for torch {TESTED_TORCH}, this is "
                f"torch {torch.__version__}). FSDP2 keeps its native reduction, which is correct on hsdp "
                "but all-reduces each param group separately and divides twice under HSDP.",
            )
            return False
        _shim.original = module.foreach_reduce
        module.foreach_reduce = _foreach_reduce
        param_group = module.FSDPParamGroup
        if hasattr(param_group, "_init_mp_dtypes") and _shim.original_init_mp_dtypes is None:
            _shim.original_init_mp_dtypes = param_group._init_mp_dtypes
            param_group._init_mp_dtypes = _init_mp_dtypes
    return True


def disable() -> None:
    """Restores FSDP2's own functions. Call between iterations (buckets not yet
    finished are dropped)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as module

    _shim.buckets.abandon()
    with _shim.lock:
        if _shim.original is not None:
            module.foreach_reduce = _shim.original
            _shim.original = None
        if _shim.original_init_mp_dtypes is not None:
            module.FSDPParamGroup._init_mp_dtypes = _shim.original_init_mp_dtypes
            _shim.original_init_mp_dtypes = None
        if _shim.original_reset_iter_state is not None:
            sys.modules[
                _FULLY_SHARD_MODULE
            ].FSDPModule.reset_iter_state = _shim.original_reset_iter_state
            _shim.original_reset_iter_state = None


def is_enabled() -> bool:
    """Whether the shim is installed in this process."""
    return _shim.original is not None


def install_automatically(settings) -> None:
    """Called for every hsdp process group with its settings (a
    ``config.resolve()``): enables the shim once FSDP2 is imported (now, or
    when the process imports it), unless ``HSDP_FSDP=off``."""
    if not settings.fsdp_shim:
        return
    _post_import.when_imported(_PARAM_GROUP_MODULE, lambda _module: enable())


def _check_torch_version(version: str) -> bool:
    """Warns once when ``version`` is outside the range hsdp was built and
    tested for. The shim still decides by feature checks, not by version."""
    try:
        major_minor = tuple(int(x) for x in version.split("+")[0].split(".")[:2])
    except ValueError:
        major_minor = None
    low, high = SUPPORTED_TORCH
    if major_minor is not None and low <= major_minor <= high:
        return True
    _warn_once(
        "torch-version",
        f"hsdp_backend.fsdp: torch {version} is outside the supported range "
        f"{low[0]}.{low[1]}-{high[0]}.{high[1]} (tested: {TESTED_TORCH}). The FSDP2 shim is used only if "
        "FSDP2's internals match what it expects; install a supported torch, or set HSDP_FSDP=off to "
        "keep FSDP2's own reduction path.",
    )
    return False


def _incompatibility(module) -> str | None:
    function = getattr(module, "foreach_reduce", None)
    if function is None:
        return "FSDP2's _fsdp_param_group.foreach_reduce is missing"
    try:
        names = tuple(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return "FSDP2's foreach_reduce has no inspectable signature"
    if names != _FOREACH_REDUCE_PARAMS:
        return f"FSDP2's foreach_reduce takes {names}, expected {_FOREACH_REDUCE_PARAMS}"
    fsdp_param_cls = getattr(module, "FSDPParam", None)
    if fsdp_param_cls is None or not hasattr(fsdp_param_cls, "to_sharded_dtensor"):
        return "FSDP2's FSDPParam lacks to_sharded_dtensor"
    return None


def _warn_once(key: str, message: str) -> None:
    if key not in _shim.warned:
        _shim.warned.add(key)
        warnings.warn(message, stacklevel=3)


# ---------------------------------------------------------------------------
# The wrapped foreach_reduce
# ---------------------------------------------------------------------------


def _foreach_reduce(
    fsdp_params,
    unsharded_grads,
    reduce_scatter_group,
    reduce_scatter_stream,
    reduce_scatter_comm,
    orig_dtype,
    reduce_dtype,
    device,
    gradient_divide_factor,
    all_reduce_group,
    all_reduce_stream,
    all_reduce_grads,
    partial_reduce_output,
    all_reduce_hook,
    force_sum_reduction_for_comms=False,
):
    args = dict(
        fsdp_params=fsdp_params,
        unsharded_grads=unsharded_grads,
        reduce_scatter_group=reduce_scatter_group,
        reduce_scatter_stream=reduce_scatter_stream,
        reduce_scatter_comm=reduce_scatter_comm,
        orig_dtype=orig_dtype,
        reduce_dtype=reduce_dtype,
        device=device,
        gradient_divide_factor=gradient_divide_factor,
        all_reduce_group=all_reduce_group,
        all_reduce_stream=all_reduce_stream,
        all_reduce_grads=all_reduce_grads,
        partial_reduce_output=partial_reduce_output,
        all_reduce_hook=all_reduce_hook,
        force_sum_reduction_for_comms=force_sum_reduction_for_comms,
    )
    original = _shim.original
    on_hsdp = _runs_on_hsdp(reduce_scatter_group, all_reduce_group)
    if on_hsdp:
        _check_uniform_grad_dtype(fsdp_params, unsharded_grads)
    if not on_hsdp or not _bucketable(args):
        return original(**args)

    shard_size = reduce_scatter_group.size() if reduce_scatter_group is not None else 1
    shard_numels = [
        _padded_shard_numel(p, g, shard_size) for p, g in zip(fsdp_params, unsharded_grads)
    ]
    divide_by = float(gradient_divide_factor or shard_size * all_reduce_group.size())
    reduce_dtype = reduce_dtype or unsharded_grads[0].dtype
    buckets = _shim.buckets
    _wrap_reset_iter_state()
    streams = _Streams.of(device, reduce_scatter_stream, all_reduce_stream)
    if all_reduce_grads:
        in_backward = buckets.begin_add()
        key, out = buckets.reserve(
            all_reduce_group, divide_by, reduce_dtype, sum(shard_numels), device, streams
        )
        comm = _OutputInto(reduce_scatter_comm, out)
    else:  # accumulate-only micro-batch: FSDP2 keeps the (SUM) partial, as usual
        out, comm = None, reduce_scatter_comm
    # FSDP2's own copy-in and reduce-scatter with SUM and no division: the
    # partial-output path returns the reduced shard instead of finishing it.
    result = original(
        **{
            **args,
            "reduce_scatter_comm": comm,
            # 1.0, not None: with force-sum FSDP2 pre-divides non-fp32/bf16
            # (fp64) inputs by ~sqrt of the factor, which defaults to S x R.
            "gradient_divide_factor": 1.0,
            "all_reduce_grads": False,
            "all_reduce_hook": None,
            "force_sum_reduction_for_comms": True,
        }
    )
    reduced = result[-1]
    if not isinstance(reduced, torch.Tensor):
        raise RuntimeError(
            "hsdp_backend.fsdp: FSDP2's foreach_reduce did not return the reduced gradient shard "
            f"last (got {type(reduced).__name__}); set HSDP_FSDP=off to use FSDP2's native path"
        )
    if not all_reduce_grads:
        return result
    if reduced.data_ptr() != out.data_ptr():  # accumulated into an earlier partial
        if reduced.shape != out.shape:
            raise RuntimeError(
                f"hsdp_backend.fsdp: FSDP2 reduced {reduced.numel()} gradient elements where the shim "
                f"computed {out.numel()} from the parameters' layout; set HSDP_FSDP=off to use FSDP2's "
                "native path, and please report this with your torch version"
            )
        with streams.writing():  # where FSDP2 wrote `reduced`
            out.copy_(reduced)
    buckets.add(key, _PendingGrads(fsdp_params, shard_numels, orig_dtype, out), in_backward)
    # FSDP2 clears its partial and keeps nothing: the bucket owns the gradient.
    return (*result[:-1], None)


def _runs_on_hsdp(reduce_scatter_group, all_reduce_group) -> bool:
    groups = [g for g in (reduce_scatter_group, all_reduce_group) if g is not None]
    names = [dist.get_backend(g) for g in groups]
    if all(n == "hsdp" for n in names):
        return bool(names)
    if any(n == "hsdp" for n in names):
        _warn_once(
            "mixed-mesh",
            f"hsdp_backend.fsdp: this FSDP2 mesh mixes backends {names} (shard, replicate); the shim "
            "needs both on hsdp and leaves FSDP2's native reduction in place. Create the mesh's "
            "groups with backend='hsdp' (e.g. init_process_group('hsdp') before init_device_mesh).",
        )
    return False


def _bucketable(args: dict[str, Any]) -> bool:
    """Whether this call can take the bucketed HSDP path (see module docs)."""
    if (
        args["all_reduce_group"] is None
        or args["device"].type not in ("cpu", "cuda")
        or args["all_reduce_hook"] is not None
    ):
        return False
    reduce_dtype = args["reduce_dtype"] or args["unsharded_grads"][0].dtype
    if reduce_dtype not in (torch.float32, torch.bfloat16, torch.float64):
        return False
    return not any(p.offload_to_cpu for p in args["fsdp_params"])


def _wrap_reset_iter_state() -> None:
    """Wraps FSDPModule.reset_iter_state, once. Done at the first bucketed
    reduction, not in enable(): enable() may run inside FSDP2's own package
    import, before the module defining FSDPModule has finished loading."""
    if _shim.original_reset_iter_state is not None:
        return
    fsdp_module = getattr(sys.modules.get(_FULLY_SHARD_MODULE), "FSDPModule", None)
    with _shim.lock:
        if _shim.original is None or _shim.original_reset_iter_state is not None:
            return
        if fsdp_module is None or not hasattr(fsdp_module, "reset_iter_state"):
            _warn_once(
                "no-reset-iter-state",
                "hsdp_backend.fsdp: FSDPModule.reset_iter_state not found; after a backward that raised, "
                "call hsdp_backend.fsdp.disable() and enable() to drop the shim's buckets",
            )
            return
        _shim.original_reset_iter_state = fsdp_module.reset_iter_state
        fsdp_module.reset_iter_state = _reset_iter_state


def _reset_iter_state(self, *args, **kwargs):
    """FSDP2's recovery after a forward or backward raised: FSDP2 discards
    that iteration's gradient reductions, and so does the shim (buckets of a
    backward that never reached its final callback)."""
    _shim.buckets.abandon()
    return _shim.original_reset_iter_state(self, *args, **kwargs)


def _init_mp_dtypes(self, *args, **kwargs):
    """FSDP2's check that a param group's parameters share one dtype, with an
    error that says what to do when the group runs on hsdp."""
    try:
        return _shim.original_init_mp_dtypes(self, *args, **kwargs)
    except AssertionError as exc:
        groups = self.mesh_info.mesh.get_all_groups() if hasattr(self, "mesh_info") else []
        if "uniform" not in str(exc) or not any(dist.get_backend(g) == "hsdp" for g in groups):
            raise
        listing = [
            (getattr(p, "_param_fqn", None) or "?", p.sharded_param.dtype) for p in self.fsdp_params
        ]
        raise TypeError(_mixed_dtype_message(listing) + f" (FSDP2: {exc})") from exc


def _check_uniform_grad_dtype(fsdp_params, unsharded_grads) -> None:
    if len({g.dtype for g in unsharded_grads}) > 1:
        listing = [
            (getattr(p, "_param_fqn", None) or "?", g.dtype)
            for p, g in zip(fsdp_params, unsharded_grads)
        ]
        raise TypeError(_mixed_dtype_message(listing))


def _mixed_dtype_message(listing) -> str:
    names = ", ".join(f"{name} ({dtype})" for name, dtype in listing)
    return (
        f"hsdp: one fully_shard param group mixes dtypes: {names}. FSDP2 reduces a group's gradients as one "
        "flat buffer of one dtype. Give the module's parameters one dtype (module.to(dtype)), set "
        "MixedPrecisionPolicy(param_dtype=...) so their gradients share one, or call fully_shard "
        "separately on the submodules of each dtype."
    )


def _padded_shard_numel(fsdp_param, unsharded_grad: torch.Tensor, shard_size: int) -> int:
    """Elements of this gradient in the reduce-scatter output (FSDP2 pads
    dim 0 to a multiple of the shard size; Shard(i > 0) is even)."""
    numel = unsharded_grad.numel()
    if numel == 0:
        return 0
    if fsdp_param.fsdp_placement.dim != 0:
        return numel // shard_size
    dim0 = unsharded_grad.size(0)
    return math.ceil(dim0 / shard_size) * (numel // dim0)


class _OutputInto:
    """FSDP2's reduce-scatter comm, except that the reduce-scatter output (the
    second allocation of a foreach_reduce call; the first is the input) is a
    slice of a replicate bucket, so the bucket needs no packing."""

    def __init__(self, comm, out: torch.Tensor):
        self._comm = comm
        self._out = out
        self._allocations = 0

    def allocate(self, size, *, dtype, device):
        self._allocations += 1
        if (
            self._allocations == 2
            and math.prod(size) == self._out.numel()
            and dtype == self._out.dtype
        ):
            return self._out
        return self._comm.allocate(size, dtype=dtype, device=device)

    def __call__(self, *args, **kwargs):
        return self._comm(*args, **kwargs)


# ---------------------------------------------------------------------------
# Replicate buckets
# ---------------------------------------------------------------------------


@dataclass
class _PendingGrads:
    """One param group's reduced gradient shard, waiting for its bucket."""

    fsdp_params: list
    shard_numels: list[int]
    orig_dtype: torch.dtype | None
    flat: torch.Tensor  # a slice of the bucket's buffer

    def finish(self) -> None:
        """FSDP2's tail: cast, view out per parameter, assign or accumulate."""
        grads = self.flat
        if self.orig_dtype is not None and grads.dtype != self.orig_dtype:
            grads = grads.to(self.orig_dtype)
        offset = grads.storage_offset()
        for fsdp_param, numel in zip(self.fsdp_params, self.shard_numels):
            grad = torch.as_strided(
                grads,
                size=fsdp_param.sharded_size,
                stride=fsdp_param.contiguous_sharded_stride,
                storage_offset=offset,
            )
            param = fsdp_param.sharded_param
            if param.grad is not None:
                param.grad._local_tensor += grad
            else:
                param.grad = fsdp_param.to_sharded_dtensor(grad)
            for hook in (getattr(param, "_post_accumulate_grad_hooks", None) or {}).values():
                hook(param)
            offset += numel


def _move(bucket: "_Bucket", buffer: torch.Tensor) -> None:
    """Copies ``bucket``'s filled part into ``buffer`` and repoints its
    param groups' slices there."""
    buffer[: bucket.used].copy_(bucket.buffer[: bucket.used])
    base = bucket.buffer.data_ptr()
    for pending in bucket.pending:
        start = (pending.flat.data_ptr() - base) // pending.flat.itemsize
        pending.flat = buffer[start : start + pending.flat.numel()]
    bucket.buffer = buffer


def _ordered_by_streams(device: torch.device) -> bool:
    """Whether buckets on ``device`` are ordered by streams and events (GPUs)
    rather than by waiting for hsdp's async Work (CPU, where the all-reduce
    overlaps backward on hsdp's own thread). Tests switch it to run the
    stream-ordered code on CPU, whose streams and events are no-ops."""
    return device.type != "cpu"


@dataclass
class _Streams:
    """FSDP2's reduce-scatter and all-reduce streams of one foreach_reduce
    call, or None for both when buckets wait for Work instead."""

    module: Any  # torch.cuda (or torch.cpu under test)
    reduce_scatter: Any
    all_reduce: Any

    @staticmethod
    def of(device: torch.device, reduce_scatter_stream, all_reduce_stream) -> "_Streams":
        if not _ordered_by_streams(device):
            return _Streams(None, None, None)
        return _Streams(torch.get_device_module(device), reduce_scatter_stream, all_reduce_stream)

    @property
    def ordered(self) -> bool:
        return self.module is not None

    def writing(self):
        """The context in which bucket memory is allocated and written: the
        reduce-scatter stream, which writes each param group's slice."""
        return self.module.stream(self.reduce_scatter) if self.ordered else contextlib.nullcontext()


@dataclass
class _Bucket:
    group: Any
    divide_by: float
    buffer: torch.Tensor
    streams: _Streams
    used: int = 0
    pending: list[_PendingGrads] = field(default_factory=list)
    done: Any = None  # stream-ordered: the event recorded after the all-reduce
    grads_alias: bool = False  # finished gradients are views of the buffer (no cast)

    def held_bytes(self) -> int:
        """Reduce-dtype bytes the shim holds for this bucket beyond the
        gradients' own (0 once finished: dropped, or the gradients' memory)."""
        if self.buffer is None or self.grads_alias:
            return 0
        return self.buffer.numel() * self.buffer.itemsize


# Buckets whose all-reduce may be in flight before the oldest is waited for
# and its gradients finished (CPU, where buckets wait for hsdp's Work): the
# shim then holds at most this many buckets beside the open one, not the
# whole model's reduce-dtype gradients until the end of backward.
_MAX_IN_FLIGHT = 2


class _ReplicateBuckets:
    """Buckets of one backward pass, keyed by (replicate group, divisor, dtype).

    ``reserve`` hands out the next slice of the open bucket; ``add`` records
    the param group that filled it and flushes the bucket once it holds at
    least ``bucket_bytes`` (so a backward issues at most
    ``floor(gradient bytes / bucket_bytes) + 1`` all-reduces per key). A
    flushed bucket's gradients are finished (cast, ``.grad``) as soon as its
    all-reduce is done, as FSDP2 finishes each group right after its own
    all-reduce: on GPUs on the all-reduce stream right behind it, on CPU
    when its Work completes (at the latest once more than ``_MAX_IN_FLIGHT``
    buckets are in flight). ``finish`` (the autograd final callback) flushes
    the rest, waits for every all-reduce and finishes what is left.
    ``peak_held_bytes``: the most reduce-dtype bytes held at once in the
    last backward.
    """

    def __init__(self) -> None:
        self.open: dict[tuple, _Bucket] = {}
        # (Work or None when stream-ordered, bucket)
        self.in_flight: list[tuple[Any, _Bucket]] = []
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
        streams: _Streams,
    ) -> tuple[tuple, torch.Tensor]:
        """The bucket key and a ``numel`` slice of that bucket's buffer."""
        key = (group.group_name, divide_by, dtype, device)
        sizes = self.sizes_now.setdefault(key, [])
        sizes.append(numel)
        bucket_numel = _shim.bucket_bytes // dtype.itemsize
        bucket = self.open.get(key)
        with streams.writing():
            if bucket is None:
                capacity = self._planned_capacity(key, len(sizes) - 1, bucket_numel) or max(
                    numel, bucket_numel
                )
                bucket = _Bucket(
                    group, divide_by, torch.empty(capacity, dtype=dtype, device=device), streams
                )
                self.open[key] = bucket
            elif bucket.used + numel > bucket.buffer.numel():
                # An under-full bucket and a param group larger than what is
                # left (first backward, or the order changed): move the bucket
                # to a larger buffer. It holds < bucket_bytes: a small copy.
                _move(
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

    def add(self, key: tuple, pending: _PendingGrads, in_backward: bool) -> None:
        """Records the param group that filled its reserved slice."""
        bucket = self.open[key]
        bucket.pending.append(pending)
        self._note_held()
        if bucket.used * bucket.buffer.itemsize >= _shim.bucket_bytes:
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
    def _finish_bucket(bucket: _Bucket) -> None:
        pending, bucket.pending = bucket.pending, []
        for p in pending:
            p.finish()
            if p.orig_dtype is None or p.orig_dtype == bucket.buffer.dtype:
                bucket.grads_alias = True

    def _finish_completed(self) -> None:
        """CPU: finishes the gradients of buckets whose all-reduce is done,
        oldest first, waiting for the oldest while too many are in flight."""
        while self.in_flight:
            work, bucket = self.in_flight[0]
            if work is None or not bucket.pending:
                break
            if len(self.in_flight) <= _MAX_IN_FLIGHT and not work.is_completed():
                break
            try:
                _wait(work, bucket)
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
                    _wait(work, bucket)
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
                _wait(work, bucket)
            except Exception:  # noqa: BLE001 - the failure was reported by the backward that raised
                pass


def _wait(work, bucket: _Bucket) -> None:
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


_shim = _Shim()
