"""The private names of torch the FSDP2 shim and its proof touch, each there on this torch.

The shim (``hsdp_backend.fsdp._compat``, ``_buckets``) wraps and reads
FSDP2's internals, and its proof (``_proof``) builds its one-process mesh
from DeviceMesh's and c10d's private names. ``_compat`` checks the
signature of ``foreach_reduce`` at install and the proof checks the
gradient tail; neither sees an attribute the shim reads only later (a
param group's shard groups, a parameter's strides, the autograd engine's
callback queue). This module names each of them once, with the release
that brought it, so that a new torch that moves one fails here, by name,
before a user's run does. Runs on every supported release
(tests/conftest.py: EVERY_TORCH)."""

import contextlib
import inspect
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import distributed_c10d as c10d
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from hsdp_backend import _torch_compat
from hsdp_backend.fsdp import _compat, _proof

RELEASE = _torch_compat.version()


def _fsdp2(name: str):
    return sys.modules.get(name) or __import__(name, fromlist=["_"])


PARAM_GROUP = "torch.distributed.fsdp._fully_shard._fsdp_param_group"
FULLY_SHARD = "torch.distributed.fsdp._fully_shard._fully_shard"
COLLECTIVES = "torch.distributed.fsdp._fully_shard._fsdp_collectives"

# (module, attribute, since): what the shim wraps or reads by module
# attribute, and the release from which it is there.
MODULE_ATTRIBUTES = [
    (PARAM_GROUP, "foreach_reduce", (2, 11)),  # wrapped, as _fsdp_param_group imports it
    (PARAM_GROUP, "FSDPParamGroup", (2, 11)),
    (PARAM_GROUP, "FSDPParam", (2, 11)),
    (FULLY_SHARD, "FSDPModule", (2, 11)),
    (COLLECTIVES, "_default_reduce_scatter_input_fn", (2, 15)),  # the default layout
]
# (class, attribute, since): methods the shim wraps or calls on FSDP2's classes.
CLASS_ATTRIBUTES = [
    (PARAM_GROUP, "FSDPParamGroup", "_init_mp_dtypes", (2, 11)),  # wrapped for its error
    (PARAM_GROUP, "FSDPParamGroup", "set_allocate_memory_from_process_group", (2, 11)),
    (PARAM_GROUP, "FSDPParamGroup", "_all_gather_process_group", (2, 11)),
    (PARAM_GROUP, "FSDPParamGroup", "_reduce_scatter_process_group", (2, 11)),
    (PARAM_GROUP, "FSDPParam", "to_sharded_dtensor", (2, 11)),
    (FULLY_SHARD, "FSDPModule", "reset_iter_state", (2, 13)),  # wrapped to drop buckets
]


def _since(since) -> bool:
    return RELEASE >= since


@pytest.mark.parametrize(
    "module, name, since", MODULE_ATTRIBUTES, ids=[f"{m}.{n}" for m, n, _ in MODULE_ATTRIBUTES]
)
def test_each_module_attribute_the_shim_names_is_there_from_its_release(module, name, since):
    assert hasattr(_fsdp2(module), name) == _since(since), (
        f"{module}.{name}: expected {'present' if _since(since) else 'absent'} on torch "
        f"{torch.__version__} (there from {since[0]}.{since[1]})"
    )


@pytest.mark.parametrize(
    "module, cls, name, since",
    CLASS_ATTRIBUTES,
    ids=[f"{c}.{n}" for _, c, n, _ in CLASS_ATTRIBUTES],
)
def test_each_method_the_shim_names_is_there_from_its_release(module, cls, name, since):
    owner = getattr(_fsdp2(module), cls)
    assert hasattr(owner, name) == _since(since), (
        f"{cls}.{name}: expected {'present' if _since(since) else 'absent'} on torch "
        f"{torch.__version__} (there from {since[0]}.{since[1]})"
    )
    assert _torch_compat.HAS_RESET_ITER_STATE == hasattr(
        getattr(_fsdp2(FULLY_SHARD), "FSDPModule"), "reset_iter_state"
    )


def test_foreach_reduce_takes_the_parameters_the_shim_calls_it_by():
    # The shim calls the original by these names, whatever FSDP2 passes positionally.
    function = _fsdp2(PARAM_GROUP).foreach_reduce
    assert tuple(inspect.signature(function).parameters) == _torch_compat.FOREACH_REDUCE_PARAMS
    assert _compat._incompatibility(_fsdp2(PARAM_GROUP)) is None


@contextlib.contextmanager
def _one_param_group():
    """A real FSDP2 param group of a tiny module, on the proof's one-process mesh."""
    with _proof._one_process_mesh() as mesh:
        model = nn.Linear(4, 3)
        fully_shard(model, mesh=mesh)
        model(torch.ones(2, 4)).sum().backward()  # lazy init: the param group's groups exist
        yield model, model._get_fsdp_state()._fsdp_param_group


def test_a_param_group_and_its_params_have_what_the_shim_reads():
    with _one_param_group() as (model, param_group):
        # _group_buffers_by_default: the param group's device and shard groups.
        assert param_group.device == torch.device("cpu")
        for group in (
            param_group._all_gather_process_group,
            param_group._reduce_scatter_process_group,
        ):
            assert dist.get_backend(group) == "hsdp"
        # _init_mp_dtypes' message: the mesh of its groups and its params' names.
        assert param_group.mesh_info.mesh.get_all_groups()
        fsdp_params = param_group.fsdp_params
        assert {p._param_fqn for p in fsdp_params} == {"weight", "bias"}
        for fsdp_param in fsdp_params:
            # _padded_shard_numel, _bucketable and PendingGrads' tail.
            assert fsdp_param.fsdp_placement.dim == 0
            assert fsdp_param.offload_to_cpu is False
            assert tuple(fsdp_param.sharded_size) == tuple(fsdp_param.sharded_param.shape)
            assert len(fsdp_param.contiguous_sharded_stride) == len(fsdp_param.sharded_size)
            assert hasattr(fsdp_param, "sharded_grad_dtype") == _torch_compat.PER_PARAM_GRAD_DTYPES
            # A gradient is assigned as FSDP2's DTensor and accumulated into its local tensor.
            grad = fsdp_param.to_sharded_dtensor(torch.zeros(fsdp_param.sharded_size))
            assert isinstance(grad._local_tensor, torch.Tensor)
            param = fsdp_param.sharded_param
            param.register_post_accumulate_grad_hook(lambda _p: None)
            assert len(param._post_accumulate_grad_hooks) == 1
        # Where set_allocate_memory_from_process_group_for_comm lands.
        param_group.set_allocate_memory_from_process_group(True)
        model.set_allocate_memory_from_process_group_for_comm(False)


def test_the_autograd_engine_has_the_final_callback_the_buckets_use():
    # _buckets.ReplicateBuckets: outside a backward there is no graph task
    # (-1); inside, a callback queued on the engine runs at its end.
    assert torch._C._current_graph_task_id() == -1
    ran = []
    x = torch.ones(1, requires_grad=True)

    def hook(grad):
        assert torch._C._current_graph_task_id() != -1
        torch.autograd.Variable._execution_engine.queue_callback(lambda: ran.append(True))
        return grad

    x.register_hook(hook)
    (x * 2).sum().backward()
    assert ran == [True]


def test_the_proofs_mesh_is_built_from_names_this_torch_has():
    # _proof._OneProcessMesh: a DeviceMesh without a default group, and its sub-meshes.
    parameters = inspect.signature(DeviceMesh.__init__).parameters
    for name in ("_init_backend", "_rank", "_layout", "_rank_map", "_root_mesh"):
        assert name in parameters, f"DeviceMesh.__init__ lacks {name} on torch {torch.__version__}"
    assert tuple(inspect.signature(DeviceMesh._create_sub_mesh).parameters)[1:] == (
        "layout",
        "submesh_dim_names",
    )
    # _proof._one_process_group: a group registered with c10d by hand.
    for name in ("_register_process_group", "_unregister_process_group", "_world"):
        assert hasattr(c10d, name), f"c10d.{name} is gone on torch {torch.__version__}"
    assert isinstance(c10d._world.pg_map, dict)
    for name in ("_set_default_backend", "_register_backend", "_set_group_name", "_get_backend"):
        assert hasattr(dist.ProcessGroup, name), name
    with _proof._one_process_mesh() as mesh:
        assert mesh["hsdp_proof_shard"].get_group().size() == 1
        names = [g.group_name for g in mesh.get_all_groups()]
        assert all(c10d._resolve_process_group(n) is not None for n in names)
    assert not [n for n in names if n in {g.group_name for g in c10d._world.pg_map}]
