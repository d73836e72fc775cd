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
is correct on hsdp.

A change inside FSDP2's gradient tail that keeps those signatures would give
wrong gradients, so the shim also proves itself before it installs
(``_proof``): a tiny model, on a (replicate 1 x shard 1) mesh of two private
hsdp groups of this process alone (no default group needed or touched),
runs two backwards on FSDP2's own path and again through the shim, for fp32
and bf16 gradients reduced in their own dtype, bf16 reduction of fp32
parameters and fp64 reduction. After each backward every gradient must be
FSDP2's bit for bit, with the same dtype, shape, strides, device, DTensor
placements and mesh, and as many post-accumulate-grad hook calls. If any
differs, or the proof raises, nothing is installed: one warning names the
first difference and FSDP2 keeps its native path. The proof runs once per
install (a failed one is not retried until :func:`disable`) and leaves no
group, thread or shared-memory segment behind. Per call the shim also takes
FSDP2's path, unchanged, when:
the device is neither CPU nor CUDA, a user all-reduce hook is set, the reduce dtype is
fp16 (FSDP2 pre-divides to avoid overflow), parameters are offloaded, or the
mesh mixes hsdp with another backend (warned once).

Communication buffers are FSDP2's own unless a module asks for its process
group's, through FSDP2's public setter
(``set_allocate_memory_from_process_group_for_comm(True)``); on one host's
shared-memory groups the all-gather output and reduce-scatter input then
come from the pool, which peers read in place. :func:`use_group_buffers`
makes that call for every FSDP module of a model whose groups have a pool,
and leaves the others as they are.

The shim is installed automatically once an hsdp process group exists, when
FSDP2 is first used (the first ``fully_shard`` of a module with parameters,
whatever was imported in which order; ``HSDP_FSDP=off`` disables it), or
explicitly with :func:`enable`; :func:`disable` undoes every patch it made.
When the proof itself cannot run (FSDP2 fails on the proof's model before
the shim takes part), one warning says so, without blaming the shim's
gradients, and FSDP2 keeps its native path. ``_compat`` installs and wraps;
``_fsdp2`` names FSDP2's internals, one adapter per torch range;
``_buckets`` plans and tracks the buckets without them;
``_proof`` drives FSDP2 through its public API, on a mesh built from
DeviceMesh's and c10d's private names. tests/unit/test_fsdp_internals.py
names every private name of torch these touch and checks each on every
supported release.
"""

from __future__ import annotations

from hsdp_backend import _post_import
from hsdp_backend.fsdp import _compat

__all__ = ["enable", "disable", "is_enabled", "install_automatically", "use_group_buffers"]

# The process-wide state (tests read its warnings and buckets).
_shim = _compat._shim


def enable(bucket_bytes: int | None = None) -> bool:
    """Installs the shim for every FSDP2 module in this process.

    Args:
        bucket_bytes: capacity of one replicate all-reduce bucket; None keeps
            the current one (``HSDP_FSDP_BUCKET_BYTES`` until set).

    Returns:
        True when installed; False (with a warning) when this torch's FSDP2
        internals differ from those the shim was written for, or its
        gradients from FSDP2's in the proof at install, in which case FSDP2
        keeps its native reduction path, which is correct on hsdp.
    """
    return _compat.install(bucket_bytes)


def disable() -> None:
    """Restores FSDP2's own functions and forgets a failed proof (the next
    :func:`enable` proves again). Call between iterations (buckets not yet
    finished are dropped)."""
    _compat.uninstall()


def is_enabled() -> bool:
    """Whether the shim is installed in this process."""
    return _compat.installed()


def use_group_buffers(model, enable: bool = True) -> int:
    """Sets where each FSDP module of ``model`` (itself included) takes its
    all-gather and reduce-scatter buffers, through FSDP2's public
    ``set_allocate_memory_from_process_group_for_comm``: with ``enable``, from
    its process groups' pools, for the modules whose groups are all hsdp's
    with a pool on their device; without, FSDP2's own. Call after
    ``fully_shard``, before the next forward. Returns how many modules were
    set; modules without parameters or with a custom all-gather or
    reduce-scatter (``set_custom_all_gather``) are left as they are, and so,
    with ``enable``, are those on other groups.

    Measured on 2 CPU cores (docs/buffers.md): a few percent faster on a
    bandwidth-bound model, no gain on a latency-bound one."""
    return _compat.use_group_buffers(model, enable)


def install_automatically(settings) -> None:
    """Called for every hsdp process group with its settings (a
    ``config.resolve()``): enables the shim when FSDP2 is first used (the
    first ``fully_shard`` of a module with parameters, once FSDP2 is
    imported: now or later), unless ``HSDP_FSDP=off``. Never inside an
    import, and a process that imports FSDP2 without using it pays
    nothing (``_compat.arm``)."""
    if not settings.fsdp_shim:
        return
    _post_import.when_imported(_compat.FSDP_PACKAGE, _compat.arm)
