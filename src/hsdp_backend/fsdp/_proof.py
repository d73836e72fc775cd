"""The FSDP2 shim's proof at install: a tiny model trained on FSDP2's native
path and again through the shim must end with the same gradients.

Checking FSDP2's signatures (``_fsdp2.Fsdp2.incompatibility``) cannot see a
change inside FSDP2's gradient tail that keeps them, and the shim redoes that
tail (cast, per-parameter views, ``.grad``, hooks): such a change would give
wrong gradients. So before the shim installs, each case below runs two
backwards (the first assigns ``.grad``, the second accumulates into it) on
both paths, and after each backward every gradient must match FSDP2's: the
same values bit for bit, dtype, shape, strides and device, locally and as a
DTensor, the same placements and mesh, and as many post-accumulate-grad hook
calls. The cases are those the shim serves: fp32 and bf16 gradients reduced
in their own dtype (``.grad`` then views the reduced buffer), bf16 reduced
and cast to fp32 parameters (mixed precision), fp32 reduced in fp64; with a
divide factor where FSDP2 applies one exactly (a power of two, so the one
division on either path is exact). The shim's buckets are small here, so a
backward fills several: flushed mid-backward, grown and moved, and flushed
by the final callback.

The mesh is (replicate 1 x shard 1) over two hsdp groups of this process
alone on a private ``HashStore``: no default process group is needed or
touched. At that size the collectives move no data, so what is proved is
the tail and the bucketing on this torch, not the reductions (the parity
tests cover those). FSDP2 is driven through its public API (``fully_shard``,
``MixedPrecisionPolicy``, ``set_gradient_divide_factor``, backward); the
mesh is not: DeviceMesh's public constructors need a default group, so
``_OneProcessMesh`` passes its private arguments, and the groups are
registered with c10d by its private names (each checked on every release:
tests/unit/test_fsdp_internals.py). ``_compat`` switches between FSDP2's
path and the shim's.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import itertools
import math
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import distributed_c10d as c10d
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from hsdp_backend import _C, config
from hsdp_backend.fsdp._compat import ProofCouldNotRun
from hsdp_backend.fsdp._fsdp2 import FSDP2

# Unlike any user's mesh dims: DTensor caches shardings by mesh equality
# (ranks, shape, names), so an equal user mesh could be handed this one.
_DIM_NAMES = ("hsdp_proof_replicate", "hsdp_proof_shard")
_group_ids = itertools.count()
_BACKWARDS = 2  # the first assigns .grad, the second accumulates into it


@dataclass(frozen=True)
class Case:
    name: str
    param_dtype: torch.dtype
    mp_policy: MixedPrecisionPolicy
    divide_factor: float | None = None
    bias_grad_dtype: torch.dtype | None = None  # biases' Parameter.grad_dtype (2.15)


CASES = (
    Case("fp32", torch.float32, MixedPrecisionPolicy(), divide_factor=2.0),
    Case("bf16", torch.bfloat16, MixedPrecisionPolicy(), divide_factor=2.0),
    Case(
        "bf16 reduce, fp32 params",
        torch.float32,
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16),
        divide_factor=2.0,
    ),
    # No factor: FSDP2 (2.11-2.15) divides fp64 by a factor twice at shard size 1.
    Case(
        "fp64 reduce, fp32 params", torch.float32, MixedPrecisionPolicy(reduce_dtype=torch.float64)
    ),
)
if FSDP2.per_param_grad_dtypes:
    # 2.15: one param group's gradients may mix dtypes (reduced in one, each
    # cast back to its parameter's).
    CASES += (
        Case(
            "fp32, bf16 bias gradients", torch.float32, MixedPrecisionPolicy(), 2.0, torch.bfloat16
        ),
    )


def first_difference(
    shim_installed: Callable[[], contextlib.AbstractContextManager],
) -> str | None:
    """How the shim's gradients differ from FSDP2's in the first case where
    they do, or None when they agree in every case.

    Args:
        shim_installed: a context in which FSDP2 reduces through the shim
            (outside it, FSDP2 takes its own path).

    Raises:
        ProofCouldNotRun: when the setup or FSDP2's own path fails; what
            fails on the shim's path propagates as it is.
    """
    with (
        _collected_on_exit(),
        _proof_mesh() as mesh,
        torch.inference_mode(False),
        torch.enable_grad(),
    ):
        for case in CASES:
            with _could_not_run_on_error(f"FSDP2's own path ({case.name})"):
                native = _train(case, mesh)
            with shim_installed():
                shimmed = _train(case, mesh)
            difference = _difference(native, shimmed)
            if difference is not None:
                return f"{case.name}: {difference}"
    return None


@contextlib.contextmanager
def _proof_mesh() -> Iterator[DeviceMesh]:
    """_one_process_mesh, whose failure to build is the proof's, not the shim's."""
    with contextlib.ExitStack() as stack:
        with _could_not_run_on_error("setting up its process groups"):
            mesh = stack.enter_context(_one_process_mesh())
        yield mesh


@contextlib.contextmanager
def _could_not_run_on_error(where: str) -> Iterator[None]:
    try:
        yield
    except ProofCouldNotRun:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure here is the proof's, not the shim's
        raise ProofCouldNotRun(f"{where} raised {type(exc).__name__}: {exc}") from exc


@dataclass
class _Grad:
    """One parameter's gradient after a backward, as the proof compares it."""

    meta: dict[str, Any]  # everything but the values; the first difference is reported
    values: torch.Tensor | None  # a copy of the local shard

    @staticmethod
    def of(param: nn.Parameter, hook_calls: int) -> _Grad:
        grad = param.grad
        meta: dict[str, Any] = {"type": type(grad).__name__, "hook calls": hook_calls}
        if grad is None:
            return _Grad(meta, None)
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        meta.update(
            {
                "placements": getattr(grad, "placements", None),
                "mesh": getattr(grad, "device_mesh", None),
                "dtype": grad.dtype,
                "shape": tuple(grad.shape),
                "stride": grad.stride(),
                "device": grad.device,
                "requires_grad": grad.requires_grad,
                "local dtype": local.dtype,
                "local shape": tuple(local.shape),
                "local stride": local.stride(),
                "local device": local.device,
            }
        )
        return _Grad(meta, local.detach().clone())


def _train(case: Case, mesh: DeviceMesh) -> list[dict[str, _Grad]]:
    """Every parameter's gradient after each backward of ``case``'s model:
    three param groups (two blocks and the root) of different sizes."""
    model = nn.Sequential(
        _Linear(4, 3, True, case.param_dtype),
        _Linear(3, 5, True, case.param_dtype),
        _Linear(5, 3, False, case.param_dtype),
    )
    if case.bias_grad_dtype is not None:
        for layer in model:
            if layer.bias is not None:
                layer.bias.grad_dtype = case.bias_grad_dtype
    for module in (model[0], model[1], model):
        fully_shard(module, mesh=mesh, mp_policy=case.mp_policy)
        if case.divide_factor is not None:
            module.set_gradient_divide_factor(case.divide_factor)
    hook_calls: Counter[str] = Counter()
    for name, param in model.named_parameters():
        param.register_post_accumulate_grad_hook(lambda _p, name=name: hook_calls.update([name]))
    after_each = []
    for step in range(_BACKWARDS):
        inputs = _values((4, 4), offset=step).to(case.param_dtype)
        model(inputs).float().square().sum().backward()
        after_each.append({n: _Grad.of(p, hook_calls[n]) for n, p in model.named_parameters()})
    return after_each


class _Linear(nn.Module):
    """A linear layer as a broadcast product and a sum: on CPU, bf16 matrix
    products of such tiny shapes take milliseconds, elementwise ops
    microseconds. Its parameters take no values from the caller's RNG."""

    def __init__(self, n_in: int, n_out: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(_values((n_out, n_in), offset=n_in).to(dtype))
        self.bias = nn.Parameter(_values((n_out,), offset=n_out).to(dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = (x.unsqueeze(-2) * self.weight).sum(-1)
        return y if self.bias is None else y + self.bias


def _values(shape: tuple[int, ...], offset: int) -> torch.Tensor:
    """Irregular values in [-1, 1] that round in every dtype, without an RNG."""
    steps = torch.arange(math.prod(shape), dtype=torch.float64, device="cpu")
    return torch.sin(steps * 0.7 + offset).reshape(shape)


def _difference(native: list[dict[str, _Grad]], shimmed: list[dict[str, _Grad]]) -> str | None:
    """The first way a gradient of ``shimmed`` is not ``native``'s, or None."""
    for backward, (wants, gots) in enumerate(zip(native, shimmed), start=1):
        for name, want in wants.items():
            got = gots[name]
            where = f"{name}'s gradient after backward {backward}"
            for key, value in want.meta.items():
                if got.meta.get(key) != value:
                    return f"{where}: {key} {got.meta.get(key)} where FSDP2 gives {value}"
            if want.values is not None:
                unequal = (_bits(want.values) != _bits(got.values)).flatten()
                if unequal.any():
                    i = int(unequal.nonzero()[0])
                    return (
                        f"{where}: {int(unequal.sum())} of {unequal.numel()} values differ "
                        f"(element {i}: {got.values.flatten()[i].item()!r} where FSDP2 gives "
                        f"{want.values.flatten()[i].item()!r})"
                    )
    return None


def _bits(values: torch.Tensor) -> torch.Tensor:
    """The values as integers of their width: equal only when bit for bit
    equal (unlike floats: -0.0 == 0.0, NaN != NaN)."""
    return values.view(
        {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[values.element_size()]
    )


class _OneProcessMesh(DeviceMesh):
    """A (1 x 1) mesh over ``groups``, usable without a default group.

    DeviceMesh asks the default group for this process's rank whenever it
    slices a sub-mesh (FSDP2 slices out the shard dim); here the process is
    rank 0 of every group, and sub-meshes take that rank from their root.
    """

    def __init__(self, groups: list[dist.ProcessGroup]) -> None:
        super().__init__(
            "cpu",
            torch.zeros((1, 1), dtype=torch.int, device="cpu"),
            mesh_dim_names=_DIM_NAMES,
            _init_backend=False,
            _rank=0,
        )
        self._dim_group_names = [group.group_name for group in groups]

    def _create_sub_mesh(self, layout, mesh_dim_names: tuple[str, ...]) -> DeviceMesh:
        sub_mesh = DeviceMesh(
            self.device_type,
            _layout=layout,
            _rank_map=self._rank_map,
            mesh_dim_names=mesh_dim_names,
            _root_mesh=self,
            _init_backend=False,
            _rank=self._rank,
        )
        sub_mesh._dim_group_names = [
            self._dim_group_names[self.mesh_dim_names.index(name)] for name in mesh_dim_names
        ]
        return sub_mesh


@contextlib.contextmanager
def _collected_on_exit() -> Iterator[None]:
    """Frees on exit what the block left in reference cycles: FSDP2's modules
    and states, which hold the proof's groups (and so their threads) until
    collected. No automatic collection runs inside the block, so none of its
    objects has aged out of the youngest generation, and collecting that one
    (tens of ms) frees them all, where a full collection takes ~0.2 s."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
        gc.collect(0)


@contextlib.contextmanager
def _one_process_mesh() -> Iterator[DeviceMesh]:
    """The proof's mesh; its groups are shut down and unregistered on exit."""
    groups: list[dist.ProcessGroup] = []
    try:
        for dim in _DIM_NAMES:
            groups.append(_one_process_group(f"{dim}/{next(_group_ids)}"))
        yield _OneProcessMesh(groups)
    finally:
        for group in groups:
            _release(group)


def _one_process_group(name: str) -> dist.ProcessGroup:
    """An hsdp group of this process alone, with the process's hsdp settings
    (engine included), registered with c10d under ``name``: DeviceMesh looks
    groups up by name, the shim asks c10d for their backend."""
    store = dist.HashStore()
    timeout = datetime.timedelta(seconds=60)  # nothing waits for a peer at size 1
    inner = dist.ProcessGroupGloo(dist.PrefixStore("hsdp/gloo/", store), 0, 1, timeout)
    backend = _C.create_backend(store, 0, 1, timeout, inner, None, config.resolve())
    group = dist.ProcessGroup(store, 0, 1)
    custom = dist.ProcessGroup.BackendType.CUSTOM
    group._set_default_backend(custom)
    group._register_backend(torch.device("cpu"), custom, backend)
    group._set_group_name(name)
    c10d._register_process_group(name, group)
    c10d._world.pg_map[group] = ("hsdp", store)
    return group


def _release(group: dist.ProcessGroup) -> None:
    c10d._world.pg_map.pop(group, None)
    c10d._unregister_process_group(group.group_name)
    group.shutdown()
