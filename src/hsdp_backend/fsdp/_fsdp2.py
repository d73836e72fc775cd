"""FSDP2's internals as the shim meets them: one adapter per torch range.

Every FSDP2 internal the shim reads is named here, once, with the modules
and classes whose functions it wraps, on the adapter of the releases where
it holds: ``Fsdp2`` (torch 2.11 and 2.12),
``Fsdp2From2_13`` (adds ``FSDPModule.reset_iter_state``) and
``Fsdp2From2_15`` (``foreach_reduce`` without ``orig_dtype`` and with
``prepare_reduce_scatter_inputs``; a dtype per parameter's gradient).
``FSDP2`` is this torch's. ``_compat`` asks it and names none of these
itself; tests/unit/test_fsdp_internals.py checks each on every supported
release.

Import-safe: FSDP2's modules are imported only when a method needs them
(the shim's first use of FSDP2).
"""

from __future__ import annotations

import inspect
import math
import sys
from collections.abc import Iterable

import torch

from hsdp_backend import _torch_compat

FULLY_SHARD_MODULE = "torch.distributed.fsdp._fully_shard._fully_shard"


class Fsdp2:
    """FSDP2 of torch 2.11 and 2.12."""

    # foreach_reduce's parameters (_fsdp_collectives.py), by which the shim
    # calls it, whatever FSDP2 passes positionally.
    foreach_reduce_params: tuple[str, ...] = (
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
    # One dtype for all of a param group's gradients (FSDP2 requires it).
    per_param_grad_dtypes = False
    # No FSDPModule.reset_iter_state: nothing tells the shim that an
    # iteration was abandoned (hsdp_backend.fsdp.disable() and enable()
    # drop its buckets).
    has_reset_iter_state = False

    # What the shim wraps.

    @staticmethod
    def param_group_module():
        """``_fsdp_param_group``: its ``foreach_reduce`` (as it imports it),
        ``FSDPParamGroup`` (``__init__``, ``_init_mp_dtypes``) and ``FSDPParam``."""
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group

        return _fsdp_param_group

    @staticmethod
    def fsdp_module_class():
        """``FSDPModule`` (its ``reset_iter_state``), or None before FSDP2 is imported."""
        return getattr(sys.modules.get(FULLY_SHARD_MODULE), "FSDPModule", None)

    def incompatibility(self, module) -> str | None:
        """Why this FSDP2 is not the one the shim was written for, or None."""
        function = getattr(module, "foreach_reduce", None)
        if function is None:
            return "FSDP2's _fsdp_param_group.foreach_reduce is missing"
        try:
            names = tuple(inspect.signature(function).parameters)
        except (TypeError, ValueError):
            return "FSDP2's foreach_reduce has no inspectable signature"
        if names != self.foreach_reduce_params:
            return f"FSDP2's foreach_reduce takes {names}, expected {self.foreach_reduce_params}"
        fsdp_param_cls = getattr(module, "FSDPParam", None)
        if fsdp_param_cls is None or not hasattr(fsdp_param_cls, "to_sharded_dtensor"):
            return "FSDP2's FSDPParam lacks to_sharded_dtensor"
        return None

    def default_reduce_scatter_layout(self):
        """FSDP2's default ``prepare_reduce_scatter_inputs`` (None: it has none)."""
        return None

    @staticmethod
    def param_groups_of(fsdp_module) -> list:
        """An FSDP module's param groups: FSDP2 keeps a list from 2.12 (one per
        mesh of ``shard_placement_fn``), one or none before."""
        state = fsdp_module._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is not None:
            return list(groups)
        return [] if state._fsdp_param_group is None else [state._fsdp_param_group]

    @staticmethod
    def has_custom_comms(param_group) -> bool:
        """A ``set_custom_all_gather``/``set_custom_reduce_scatter`` of the user's,
        with which FSDP2's process-group allocation cannot be set."""
        names = (type(param_group._all_gather_comm).__name__,
                 type(param_group._reduce_scatter_comm).__name__)  # fmt: skip
        return any(not n.startswith(("Default", "ProcessGroupAlloc")) for n in names)

    @staticmethod
    def any_output_will_do(reduce_scatter_comm) -> bool:
        """Whether a reduce-scatter comm takes any output tensor: FSDP2's default does; its
        process-group and symmetric-memory comms (``set_allocate_memory_from_process_group_for_comm``,
        ``set_symm_mem_for_comm``) and a user's ``set_custom_reduce_scatter`` need the output
        from their own ``allocate()`` (NCCL's symmetric-memory rendezvous refuses other
        memory: "Pointer not within any SymmetricMemory allocation")."""
        return type(reduce_scatter_comm).__name__ == "DefaultReduceScatter"

    # What the shim reads of a param group.

    @staticmethod
    def device(param_group) -> torch.device:
        return param_group.device

    @staticmethod
    def shard_groups(param_group) -> set:
        """The all-gather and reduce-scatter groups. Raises AssertionError or
        AttributeError for a param group without them (replicate()'s)."""
        return {param_group._all_gather_process_group, param_group._reduce_scatter_process_group}

    @staticmethod
    def mesh_groups(param_group) -> list:
        return (
            param_group.mesh_info.mesh.get_all_groups() if hasattr(param_group, "mesh_info") else []
        )

    @staticmethod
    def names_and_dtypes(param_group) -> list[tuple[str, torch.dtype]]:
        return [(Fsdp2.name(p), p.sharded_param.dtype) for p in param_group.fsdp_params]

    # What the shim reads of a parameter.

    @staticmethod
    def name(fsdp_param) -> str:
        return getattr(fsdp_param, "_param_fqn", None) or "?"

    @staticmethod
    def offloaded(fsdp_param) -> bool:
        return fsdp_param.offload_to_cpu

    @staticmethod
    def padded_shard_numel(fsdp_param, unsharded_grad: torch.Tensor, shard_size: int) -> int:
        """Elements of this gradient in the reduce-scatter output (FSDP2 pads
        dim 0 to a multiple of the shard size; Shard(i > 0) is even)."""
        numel = unsharded_grad.numel()
        if numel == 0:
            return 0
        if fsdp_param.fsdp_placement.dim != 0:
            return numel // shard_size
        dim0 = unsharded_grad.size(0)
        return math.ceil(dim0 / shard_size) * (numel // dim0)

    def grad_dtypes(self, fsdp_params, orig_dtype) -> list[torch.dtype | None]:
        """The dtype FSDP2 gives each parameter's reduced gradient (None: the
        reduce dtype, no cast): the param group's ``orig_dtype``."""
        return [orig_dtype] * len(fsdp_params)

    @staticmethod
    def shard_view(fsdp_param, grads: torch.Tensor, storage_offset: int) -> torch.Tensor:
        """The parameter's gradient shard in ``grads``, as FSDP2 views it."""
        return torch.as_strided(
            grads,
            size=fsdp_param.sharded_size,
            stride=fsdp_param.contiguous_sharded_stride,
            storage_offset=storage_offset,
        )

    @staticmethod
    def assign_grad(fsdp_param, grad: torch.Tensor) -> torch.nn.Parameter:
        """``.grad`` assigned (as FSDP2's DTensor) or accumulated into; the parameter."""
        param = fsdp_param.sharded_param
        if param.grad is not None:
            param.grad._local_tensor += grad
        else:
            param.grad = fsdp_param.to_sharded_dtensor(grad)
        return param

    @staticmethod
    def post_accumulate_grad_hooks(param: torch.nn.Parameter) -> Iterable:
        """The hooks autograd would run after accumulating into ``param.grad``."""
        return (getattr(param, "_post_accumulate_grad_hooks", None) or {}).values()


class Fsdp2From2_13(Fsdp2):
    """FSDP2 of torch 2.13 and 2.14."""

    # FSDPModule.reset_iter_state: FSDP2's recovery after a forward or
    # backward raised, which the shim extends to its buckets.
    has_reset_iter_state = True


class Fsdp2From2_15(Fsdp2From2_13):
    """FSDP2 of torch 2.15."""

    # ``orig_dtype`` is gone (each parameter's gradient takes its own dtype,
    # so one param group may mix gradient dtypes: _cast_and_view_sharded_grads),
    # ``reduce_dtype`` is always given, and a keyword-only
    # ``prepare_reduce_scatter_inputs`` lays out the reduce-scatter input.
    foreach_reduce_params = (
        *(p for p in Fsdp2.foreach_reduce_params if p != "orig_dtype"),
        "prepare_reduce_scatter_inputs",
    )
    per_param_grad_dtypes = True

    def default_reduce_scatter_layout(self):
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives

        return getattr(_fsdp_collectives, "_default_reduce_scatter_input_fn", None)

    def grad_dtypes(self, fsdp_params, orig_dtype) -> list[torch.dtype | None]:
        """Each parameter's own ``sharded_grad_dtype``."""
        return [p.sharded_grad_dtype for p in fsdp_params]


def for_release(release: tuple[int, int]) -> Fsdp2:
    """The adapter of ``release`` (major, minor)."""
    if release >= (2, 15):
        return Fsdp2From2_15()
    if release >= (2, 13):
        return Fsdp2From2_13()
    return Fsdp2()


FSDP2 = for_release(_torch_compat.version() or (0, 0))
