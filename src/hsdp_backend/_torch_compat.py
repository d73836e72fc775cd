"""The one place where the torch releases hsdp supports differ for its Python half.

hsdp supports torch 2.11 to 2.15 (``pyproject.toml`` admits exactly these;
each is tested: docs/versions.md). Everything else in the package is written
against one API and asks here where releases part. Each difference names the
release that brought it. The C++ half of the same list is
csrc/common/TorchCompat.hpp; where FSDP2's internals differ, the shim's
adapters say (hsdp_backend.fsdp._fsdp2).

Import-safe: it reads ``torch.__version__`` and nothing else at import (the
autoload entry point imports it inside ``import torch``).
"""

from __future__ import annotations

import torch

SUPPORTED = ((2, 11), (2, 15))  # oldest and newest minor release, both included
SUPPORTED_TEXT = "2.11 to 2.15"


def version(text: str | None = None) -> tuple[int, int] | None:
    """(major, minor) of ``text`` (default: this torch), or None if unreadable."""
    try:
        return tuple(int(x) for x in (text or torch.__version__).split("+")[0].split(".")[:2])
    except ValueError:
        return None


def unsupported(text: str | None = None) -> str | None:
    """Why hsdp cannot run on this torch (or the release ``text`` names), or None."""
    text = text or torch.__version__
    found = version(text)
    if found is not None and not SUPPORTED[0] <= found <= SUPPORTED[1]:
        return (
            f"hsdp_backend supports torch {SUPPORTED_TEXT}; this is torch {text}. Install a "
            "supported torch (pip install 'torch>=2.11,<2.16') and rebuild hsdp_backend against it "
            "(pip install --no-build-isolation .)"
        )
    if text is torch.__version__ and not torch.distributed.is_available():
        return (
            f"torch {text} was built without torch.distributed (USE_DISTRIBUTED=0); hsdp is a "
            "torch.distributed backend and needs a torch with it"
        )
    return None


_THIS = version() or (0, 0)

# 2.14: torch registers its own backends lazily and reads the
# ``torch.distributed.backends`` entry points when a group names an unknown
# backend (Backend._ensure_backend_registered); before, only the
# ``torch.backends`` autoload entry point (or an import) registers "hsdp".
LAZY_BACKEND_REGISTRATION = _THIS >= (2, 14)
# 2.14: torch.distributed hands an ephemeral timeout extension
# (_add_ephemeral_timeout_for_all_pgs, torch.compile's) to every group's
# backends (Backend::addEphemeralTimeout); before, only to ProcessGroupNCCL.
EPHEMERAL_TIMEOUT_ON_ANY_BACKEND = _THIS >= (2, 14)
# 2.14: Backend::registerAbortHook (C10D_BACKEND_HAS_HOOKS), which hsdp serves.
ABORT_HOOKS = _THIS >= (2, 14)
# 2.14: dist.monitored_barrier runs on any backend that implements it (hsdp
# does); before, torch's Python refuses every backend but gloo with
# ValueError("monitored_barrier is only implemented for GLOO backend.")
# before the backend is reached.
MONITORED_BARRIER_ON_ANY_BACKEND = _THIS >= (2, 14)
# 2.13: Work.exception() returns a Work's error to Python; before, its
# binding has no conversion for std::exception_ptr and raises TypeError on
# every backend (gloo's and nccl's alike), so the error is read from wait().
WORK_EXCEPTION_IN_PYTHON = _THIS >= (2, 13)
# 2.14: a Backend's coalesced all-gather and reduce-scatter can be called
# from Python directly (Backend.all_gather_single_coalesced,
# reduce_scatter_single_coalesced); before, only through torch's dispatcher,
# which sends a call holding a tensor of another device to that device's
# kernel instead of the backend.
BACKEND_COALESCED_CALLS_IN_PYTHON = _THIS >= (2, 14)
# 2.14: ProcessGroup's sequence number is its backend's, whatever the
# backend; before, ProcessGroup refuses it ("ProcessGroup <name> does not
# yet support sequence numbers.") for all but gloo, nccl, xccl and ucc, so a
# plugin's number is read from its Backend.
SEQUENCE_NUMBERS_OF_ANY_BACKEND = _THIS >= (2, 14)

# 2.14.0: ProcessGroupNCCL hands NCCL a bf16 PREMUL_SUM's factor intact; 2.11.0 to 2.13.0 lose
# it (csrc/common/TorchCompat.hpp, docs/versions.md). Trusted only of a final release: a
# nightly, a source or vendor build numbered 2.14 may predate the fix.
BF16_PREMUL_SUM_FIXED_IN = (2, 14, 0)


def final_release(text: str) -> tuple[int, int, int] | None:
    """(major, minor, micro) of a final release's version (``2.14.1``, ``2.14.1+cu130``: a
    local label names the wheel's CUDA), or None for anything else: a pre-release or nightly
    (``2.14.0a0+git1234abc``, ``2.14.0.dev20260101``, ``2.14.0rc1``), a source build's
    ``+git`` label, text that is no version."""
    public, _, local = text.partition("+")
    parts = public.split(".")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        return None
    if local and not (local.startswith("cu") or local.startswith("rocm") or local == "cpu"):
        return None  # a source or vendor build (+git..., +nv...): its code is not the release's
    return int(parts[0]), int(parts[1]), int(parts[2])


def nccl_bf16_premul_sum(setting: bool | None, probe, text: str | None = None) -> bool:
    """Whether the ProcessGroupNCCL hsdp wraps keeps a bf16 PREMUL_SUM's factor: ``setting``
    (HSDP_NCCL_BF16_PREMUL_SUM) where given; else what the release ``text`` (default: this
    torch) is known to do; else ``probe()``'s answer (a one-rank PREMUL_SUM on the device)."""
    if setting is not None:
        return setting
    release = final_release(text or torch.__version__)
    if release is not None:
        return release >= BF16_PREMUL_SUM_FIXED_IN
    return probe()


def probe_nccl_bf16_premul_sum() -> bool:
    """Asks this process's ProcessGroupNCCL: a one-rank bf16 PREMUL_SUM(0.5) of ones on the
    current device is 0.5 where the factor survives (0 where it is lost: its low half; an
    error where the release reads it as a float). Run once a process, for builds whose
    release says nothing (``final_release``)."""
    global _probed
    if _probed is None:
        import torch.distributed as dist

        one = dist.ProcessGroupNCCL(dist.HashStore(), 0, 1)
        try:
            t = torch.ones(4, dtype=torch.bfloat16, device=torch.cuda.current_device())
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist._make_nccl_premul_sum(0.5)
            one.allreduce([t], opts).wait()
            _probed = bool(torch.equal(t, torch.full_like(t, 0.5)))
        except RuntimeError:
            _probed = False
        finally:
            one.shutdown()
    return _probed


_probed: bool | None = None

# The backend name of torch's own ProcessGroupNCCL, the one hsdp's CUDA route
# wraps on every release (docs/gpu.md): 2.14 registers it as "nccl-legacy"
# too, and 2.15 makes plain "nccl" ProcessGroupNCCL2 (torchcomms' engine)
# unless TORCH_DIST_USE_NCCL2=0. Comparisons of hsdp against NCCL use this.
WRAPPED_NCCL = "nccl-legacy" if _THIS >= (2, 14) else "nccl"


def split_source(opts):
    """The backend a new group's communicator is to be split from (or None),
    for a creator called with ``opts`` (_DistributedBackendOptions).

    2.13: torch hands it to every creator (``opts.split_from``). Before,
    torch computes it just the same (``_get_split_source`` of a default group
    bound to a device) and has the new group's non-members split from it
    (``perform_nocolor_split``), but hands it only to its own inline NCCL
    creator: a plugin's members must find it themselves, or the non-members
    wait in NCCL's split for them."""
    if hasattr(opts, "split_from"):
        return opts.split_from
    from torch.distributed import distributed_c10d as c10d

    if not c10d.is_initialized():
        return None  # this is the default group
    default = c10d._get_default_group()
    if not default.bound_device_id:
        return None
    return c10d._get_split_source(default)


# 2.15: torch attaches its own FlightRecorderHook to every group of a backend
# not in distributed_c10d._FR_SELF_RECORDING_BACKENDS; hsdp records itself
# (hsdp_backend.trace), so it is listed there, as gloo is.
def mark_self_recording(backend_name: str) -> None:
    """Tells torch's flight recorder (2.15) that ``backend_name`` records
    its own operations, so that torch attaches no FlightRecorderHook, whose
    entries hsdp would never retire (every op shown unfinished in
    torchfrtrace). Nothing to do before 2.15."""
    from torch.distributed import distributed_c10d

    recording = getattr(distributed_c10d, "_FR_SELF_RECORDING_BACKENDS", None)
    if recording is not None:
        recording.add(backend_name)
