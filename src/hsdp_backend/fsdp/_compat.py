"""The FSDP2 shim: its install, its wrappers and FSDP2's gradient tail (torch 2.11-2.15).

The shim wraps ``foreach_reduce`` (as ``_fsdp_param_group`` imports it),
checking its signature first, and ``FSDPParamGroup._init_mp_dtypes`` and
``FSDPModule.reset_iter_state``; it relies on FSDP2's allocation order
inside ``foreach_reduce`` and redoes its gradient tail (cast, per-parameter
views, ``.grad``, hooks: ``PendingGrads.finish``). The FSDP2 internals it
reads, and where those it wraps live, are named by this torch's adapter
(``_fsdp2.FSDP2``); the four it wraps (``FSDPParamGroup.__init__`` only until the first
param group installs the shim) are named where it wraps them
(``_patch``, ``arm``). The buckets (``_buckets``) see none of it; the proof
at install (``_proof``) drives FSDP2 through its public API, switching
between FSDP2's path and the shim's through ``_installed_for_proof``.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hsdp_backend import _torch_compat, config
from hsdp_backend.fsdp._buckets import ReplicateBuckets, Streams
from hsdp_backend.fsdp._fsdp2 import FSDP2

# The shim installs once this package is imported: the proof needs all of it.
FSDP_PACKAGE = "torch.distributed.fsdp"
# The proof's buckets: small, so its few gradients fill several (see _proof).
_PROOF_BUCKET_BYTES = 64

_log = logging.getLogger("hsdp_backend")


class ProofCouldNotRun(RuntimeError):
    """The proof failed before the shim took part (importing FSDP2, building
    its groups and mesh, FSDP2's own run of a case): not a finding about
    the shim's gradients."""


class _Shim:
    """Process-wide state: the original function and the open buckets."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.original = None  # FSDP2's foreach_reduce while the shim is installed
        self.original_init_mp_dtypes = None  # FSDPParamGroup._init_mp_dtypes, likewise
        self.original_reset_iter_state = None  # FSDPModule.reset_iter_state, likewise
        self.armed_init = None  # FSDPParamGroup.__init__ while armed (see arm)
        self.warned: set[str] = set()
        self.buckets = ReplicateBuckets()  # its bucket_bytes: 0 until the first install
        # Why the proof failed, until disable(): later installs do not prove again.
        self.disproof: str | None = None
        # Why the proof could not run (not a finding about the shim), until
        # the next enable(): automatic installs do not try again.
        self.unproven: str | None = None


def install(bucket_bytes: int | None) -> bool:
    """Wraps FSDP2's foreach_reduce (and _init_mp_dtypes, reset_iter_state)
    for this process once the shim has proved itself against FSDP2's own
    path (``_proof``); False, with one warning, when FSDP2's internals are
    not those the shim was written for or the proof finds a difference. See
    hsdp_backend.fsdp.enable."""
    module = FSDP2.param_group_module()

    _disarm(module)  # before _patch reads FSDPParamGroup.__init__
    buckets = _shim.buckets
    if bucket_bytes is not None:
        buckets.bucket_bytes = int(bucket_bytes)
    elif not buckets.bucket_bytes:  # first install; later automatic calls keep a user's choice
        buckets.bucket_bytes = config.resolve().fsdp_bucket_bytes
    with _shim.lock:
        if _shim.original is not None:
            return True
        if _shim.disproof is not None:  # proved wrong in this process already
            return False
        _shim.unproven = None
        _check_torch_version(torch.__version__)
        problem = FSDP2.incompatibility(module)
        if problem is not None:
            _warn_once(
                "incompatible",
                f"hsdp_backend.fsdp: {problem} (the shim was written for torch "
                f"{_torch_compat.SUPPORTED_TEXT}, this is torch {torch.__version__}). FSDP2 keeps its native reduction, which is correct on hsdp "
                "but all-reduces each param group separately and divides twice under HSDP.",
            )
            return False
        try:
            _shim.disproof = _disproof(module)
        except ProofCouldNotRun as exc:
            _shim.unproven = str(exc)
            _warn_once(
                "unproven",
                f"hsdp_backend.fsdp: the shim's proof could not run on torch {torch.__version__}, so "
                f"the shim is not installed: {exc}. This says nothing about the shim's gradients: FSDP2 "
                "itself failed on the proof's tiny model before the shim was involved. FSDP2 keeps its "
                "native reduction, which is correct on hsdp but all-reduces each param group "
                "separately and divides twice under HSDP; hsdp_backend.fsdp.enable() tries again.",
            )
            return False
        if _shim.disproof is not None:
            _warn_once(
                "disproved",
                f"hsdp_backend.fsdp: the shim's gradients are not FSDP2's on torch {torch.__version__}: "
                f"{_shim.disproof}. The shim is not installed: FSDP2 keeps its native reduction, which is "
                "correct on hsdp but all-reduces each param group separately and divides twice under "
                "HSDP. Please report this with your torch version.",
            )
            return False
        _patch(module)
    return True


def uninstall() -> None:
    """Puts FSDP2's own functions back and forgets a failed proof; unfinished
    buckets are dropped."""
    module = FSDP2.param_group_module()

    _disarm(module)
    _shim.buckets.abandon()
    with _shim.lock:
        _unpatch(module)
        _shim.disproof = None
        _shim.unproven = None


def installed() -> bool:
    return _shim.original is not None


def arm(_package=None) -> None:
    """Installs the shim when FSDP2 is first used in this process: at the
    first ``FSDPParamGroup`` (what ``fully_shard`` builds for a module with
    parameters), not when FSDP2 is imported. Importing FSDP2 happens inside
    other imports (``import torch._dynamo`` imports it half-way through its
    own body), where the proof, which needs all of FSDP2 and what it imports,
    cannot run; and a process that imports FSDP2 without using it pays
    nothing. Idempotent; a no-op once installed or proved wrong."""
    module = FSDP2.param_group_module()

    with _shim.lock:
        if _shim.armed_init is not None or _shim.original is not None or _shim.disproof:
            return
        if _shim.unproven is not None:
            return
        param_group = module.FSDPParamGroup
        _shim.armed_init = param_group.__init__

        def first_param_group(self, *args, **kwargs):
            if not _torch_import_in_progress():
                _disarm(module)
                install(None)
            # The class's __init__ now: FSDP2's, or the shim's wrapper of it.
            return _current_init(module, first_param_group)(self, *args, **kwargs)

        param_group.__init__ = first_param_group


def _current_init(module, trigger):
    init = module.FSDPParamGroup.__init__
    return _shim.armed_init if init is trigger else init


def _disarm(module) -> None:
    with _shim.lock:
        if _shim.armed_init is not None:
            module.FSDPParamGroup.__init__ = _shim.armed_init
            _shim.armed_init = None


def _torch_import_in_progress() -> bool:
    """Whether a torch module is still running its body (importlib marks its
    spec ``_initializing``): a fully_shard called from inside an import. The
    proof then waits for the next param group."""
    for name, mod in list(sys.modules.items()):
        if name.startswith("torch") and getattr(
            getattr(mod, "__spec__", None), "_initializing", False
        ):
            return True
    return False


def _proof_module():
    # Imported here: _proof imports FSDP2, which an hsdp process imports only if it uses it.
    from hsdp_backend.fsdp import _proof

    return _proof


def _patch(module) -> None:
    """Puts the shim's wrappers in place of FSDP2's functions."""
    _shim.original = module.foreach_reduce
    module.foreach_reduce = _foreach_reduce
    param_group = module.FSDPParamGroup
    if hasattr(param_group, "_init_mp_dtypes"):
        _shim.original_init_mp_dtypes = param_group._init_mp_dtypes
        param_group._init_mp_dtypes = _init_mp_dtypes
    fsdp_module = FSDP2.fsdp_module_class()
    if not FSDP2.has_reset_iter_state:
        return  # docs/versions.md: after a backward that raised, disable() and enable()
    if fsdp_module is None or not hasattr(fsdp_module, "reset_iter_state"):
        _warn_once(
            "no-reset-iter-state",
            "hsdp_backend.fsdp: FSDPModule.reset_iter_state not found; after a backward that raised, "
            "call hsdp_backend.fsdp.disable() and enable() to drop the shim's buckets",
        )
        return
    _shim.original_reset_iter_state = fsdp_module.reset_iter_state
    fsdp_module.reset_iter_state = _reset_iter_state


def _unpatch(module) -> None:
    """Puts FSDP2's own functions back."""
    if _shim.original is not None:
        module.foreach_reduce = _shim.original
        _shim.original = None
    if _shim.original_init_mp_dtypes is not None:
        module.FSDPParamGroup._init_mp_dtypes = _shim.original_init_mp_dtypes
        _shim.original_init_mp_dtypes = None
    if _shim.original_reset_iter_state is not None:
        FSDP2.fsdp_module_class().reset_iter_state = _shim.original_reset_iter_state
        _shim.original_reset_iter_state = None


def _disproof(module) -> str | None:
    """What the proof finds wrong with the shim on this torch, or None."""
    try:
        _proof = _proof_module()
    except Exception as exc:  # noqa: BLE001 - e.g. FSDP2's own imports failing
        raise ProofCouldNotRun(f"importing it raised {type(exc).__name__}: {exc}") from exc
    start = time.perf_counter()
    try:
        difference = _proof.first_difference(lambda: _installed_for_proof(module))
    except ProofCouldNotRun:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever fails, FSDP2's own path stays
        return f"the proof raised {type(exc).__name__}: {exc}"
    _log.debug(
        "hsdp_backend.fsdp: proved against FSDP2's native path in %.0f ms",
        (time.perf_counter() - start) * 1e3,
    )
    return difference


@contextlib.contextmanager
def _installed_for_proof(module):
    """The shim installed, with buckets of the proof's own: the process's
    buckets, and the sizes they remember from earlier backwards, stay as
    they were."""
    buckets, _shim.buckets = _shim.buckets, ReplicateBuckets(_PROOF_BUCKET_BYTES)
    _patch(module)
    try:
        yield
    finally:
        _unpatch(module)
        _shim.buckets.abandon()
        _shim.buckets = buckets


def _check_torch_version(version: str) -> bool:
    """Warns once when ``version`` is outside the range hsdp was built and
    tested for. The shim still decides by feature checks, not by version."""
    if _torch_compat.unsupported(version) is None:
        return True
    _warn_once(
        "torch-version",
        f"hsdp_backend.fsdp: torch {version} is outside the supported range "
        f"{_torch_compat.SUPPORTED_TEXT}. The FSDP2 shim is used only if "
        "FSDP2's internals match what it expects; install a supported torch, or set HSDP_FSDP=off to "
        "keep FSDP2's own reduction path.",
    )
    return False


def _warn_once(key: str, message: str) -> None:
    if key not in _shim.warned:
        _shim.warned.add(key)
        warnings.warn(message, stacklevel=3)


def _foreach_reduce(*positional, **keywords):
    # By name, whatever this torch's FSDP2 passes positionally (the
    # parameters differ between releases: FSDP2.foreach_reduce_params).
    args = dict(zip(FSDP2.foreach_reduce_params, positional), **keywords)
    original = _shim.original
    fsdp_params, unsharded_grads = args["fsdp_params"], args["unsharded_grads"]
    reduce_scatter_group, all_reduce_group = args["reduce_scatter_group"], args["all_reduce_group"]
    on_hsdp = _runs_on_hsdp(reduce_scatter_group, all_reduce_group)
    if on_hsdp and not FSDP2.per_param_grad_dtypes:
        _check_uniform_grad_dtype(fsdp_params, unsharded_grads)
    if not on_hsdp or not _bucketable(args):
        return original(**args)
    gradient_divide_factor, reduce_dtype = args["gradient_divide_factor"], args["reduce_dtype"]
    device, all_reduce_grads = args["device"], args["all_reduce_grads"]

    shard_size = reduce_scatter_group.size() if reduce_scatter_group is not None else 1
    shard_numels = [
        FSDP2.padded_shard_numel(p, g, shard_size) for p, g in zip(fsdp_params, unsharded_grads)
    ]
    divide_by = float(gradient_divide_factor or shard_size * all_reduce_group.size())
    reduce_dtype = reduce_dtype or unsharded_grads[0].dtype
    buckets = _shim.buckets
    streams = Streams.of(device, args["reduce_scatter_stream"], args["all_reduce_stream"])
    if all_reduce_grads:
        in_backward = buckets.begin_add()
        key, out = buckets.reserve(
            all_reduce_group, divide_by, reduce_dtype, sum(shard_numels), device, streams
        )
        comm = args["reduce_scatter_comm"]
        if FSDP2.any_output_will_do(comm):
            comm = _OutputInto(comm, out)
        # else the output is the comm's own and is copied into the bucket below.
    else:  # accumulate-only micro-batch: FSDP2 keeps the (SUM) partial, as usual
        out, comm = None, args["reduce_scatter_comm"]
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
    # Accumulated into an earlier partial, or the output of a comm that allocates its own.
    if reduced.data_ptr() != out.data_ptr():
        if reduced.shape != out.shape:
            raise RuntimeError(
                f"hsdp_backend.fsdp: FSDP2 reduced {reduced.numel()} gradient elements where the shim "
                f"computed {out.numel()} from the parameters' layout; set HSDP_FSDP=off to use FSDP2's "
                "native path, and please report this with your torch version"
            )
        with streams.writing():  # where FSDP2 wrote `reduced`
            out.copy_(reduced)
    grad_dtypes = FSDP2.grad_dtypes(fsdp_params, args.get("orig_dtype"))
    buckets.add(key, PendingGrads(fsdp_params, shard_numels, grad_dtypes, out), in_backward)
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
    # 2.15: a layout of the reduce-scatter input other than FSDP2's default
    # (dim-0 chunks, padded) would not match the shim's shard sizes.
    prepare = args.get("prepare_reduce_scatter_inputs")
    if prepare is not None and prepare is not FSDP2.default_reduce_scatter_layout():
        return False
    return not any(FSDP2.offloaded(p) for p in args["fsdp_params"])


def _reset_iter_state(self, *args, **kwargs):
    """FSDP2's recovery after a forward or backward raised: FSDP2 discards
    that iteration's gradient reductions, and so does the shim (buckets of a
    backward that never reached its final callback)."""
    _shim.buckets.abandon()
    return _shim.original_reset_iter_state(self, *args, **kwargs)


def use_group_buffers(model, enable: bool) -> int:
    """``hsdp_backend.fsdp.use_group_buffers``: FSDP2's public setter, called
    for each FSDP module whose param groups all have pools (to undo: all
    but those with a custom all-gather or reduce-scatter, which FSDP2's
    setter refuses). Every module is chosen before any is set."""
    fsdp_module = FSDP2.fsdp_module_class()
    chosen = []
    for module in model.modules() if fsdp_module is not None else ():
        if not isinstance(module, fsdp_module):
            continue
        groups = FSDP2.param_groups_of(module)
        if groups and not any(FSDP2.has_custom_comms(g) for g in groups):
            if not enable or all(_groups_have_pools(g) for g in groups):
                chosen.append(module)
    for module in chosen:
        module.set_allocate_memory_from_process_group_for_comm(enable)
    return len(chosen)


def _groups_have_pools(param_group) -> bool:
    device = FSDP2.device(param_group)
    try:
        groups = FSDP2.shard_groups(param_group)
    except (AssertionError, AttributeError):
        return False  # a param group without shard groups (replicate()'s)
    return all(
        dist.get_backend(g) == "hsdp" and g._get_backend(device).supports_tensor_alloc(device)
        for g in groups
    )


def _init_mp_dtypes(self, *args, **kwargs):
    """FSDP2's check that a param group's parameters share one dtype, with an
    error that says what to do when the group runs on hsdp."""
    try:
        return _shim.original_init_mp_dtypes(self, *args, **kwargs)
    except AssertionError as exc:
        groups = FSDP2.mesh_groups(self)
        if "uniform" not in str(exc) or not any(dist.get_backend(g) == "hsdp" for g in groups):
            raise
        listing = FSDP2.names_and_dtypes(self)
        raise TypeError(_mixed_dtype_message(listing) + f" (FSDP2: {exc})") from exc


def _check_uniform_grad_dtype(fsdp_params, unsharded_grads) -> None:
    if len({g.dtype for g in unsharded_grads}) > 1:
        listing = [(FSDP2.name(p), g.dtype) for p, g in zip(fsdp_params, unsharded_grads)]
        raise TypeError(_mixed_dtype_message(listing))


def _mixed_dtype_message(listing) -> str:
    names = ", ".join(f"{name} ({dtype})" for name, dtype in listing)
    return (
        f"hsdp: one fully_shard param group mixes dtypes: {names}. FSDP2 reduces a group's gradients as one "
        "flat buffer of one dtype. Give the module's parameters one dtype (module.to(dtype)), set "
        "MixedPrecisionPolicy(param_dtype=...) so their gradients share one, or call fully_shard "
        "separately on the submodules of each dtype."
    )


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


@dataclass
class PendingGrads:
    """One param group's reduced gradient shard, waiting for its bucket."""

    fsdp_params: list
    shard_numels: list[int]
    grad_dtypes: list[torch.dtype | None]  # per parameter (Fsdp2.grad_dtypes)
    flat: torch.Tensor  # a slice of the bucket's buffer

    def views_flat(self) -> bool:
        """Whether some gradient finish() assigns is a view of ``flat`` (no
        cast), so the bucket's buffer must outlive the backward."""
        return any(d is None or d == self.flat.dtype for d in self.grad_dtypes)

    def finish(self) -> None:
        """FSDP2's tail: cast, view out per parameter, assign or accumulate.
        Consecutive parameters of one gradient dtype are cast as one run, as
        FSDP2 does (2.15's _cast_and_view_sharded_grads; one run before)."""
        offset = 0
        members = list(zip(self.fsdp_params, self.shard_numels, self.grad_dtypes))
        for dtype, run in itertools.groupby(members, key=lambda member: member[2]):
            run = list(run)
            numel = sum(n for _, n, _ in run)
            grads = self.flat.narrow(0, offset, numel) if numel != self.flat.numel() else self.flat
            if dtype is not None and grads.dtype != dtype:
                grads = grads.to(dtype)
            offset += numel
            self._assign(run, grads)

    @staticmethod
    def _assign(run, grads: torch.Tensor) -> None:
        offset = grads.storage_offset()
        for fsdp_param, numel, _ in run:
            param = FSDP2.assign_grad(fsdp_param, FSDP2.shard_view(fsdp_param, grads, offset))
            for hook in FSDP2.post_accumulate_grad_hooks(param):
                hook(param)
            offset += numel


_shim = _Shim()
