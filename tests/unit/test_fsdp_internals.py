"""The private names of torch the FSDP2 shim and its proof touch, each there on this torch.

The shim reads FSDP2's internals through this torch's adapter
(``hsdp_backend.fsdp._fsdp2.FSDP2``) and wraps four of its functions; its
buckets use the autograd engine's final callback; its proof (``_proof``)
builds its one-process mesh from DeviceMesh's and c10d's private names. The
shim checks ``foreach_reduce``'s signature at install and the proof checks
the gradient tail; neither sees an attribute the shim reads only later (a
param group's shard groups, a parameter's strides). Here each is asked of a
real param group through the adapter, and each wrapped function is looked
for with the release that brought it, so that a torch that moves one fails
here, by name, before a user's run does. Runs on every supported release
(the every_torch marker)."""

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
from hsdp_backend.fsdp import _fsdp2, _proof
from hsdp_backend.fsdp._fsdp2 import FSDP2

# Runs on every supported torch release too (scripts/test.sh's compat stages).
pytestmark = pytest.mark.every_torch

RELEASE = _torch_compat.version()


def _module(name: str):
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
    # FSDP2's public setter of a module's buffers (use_group_buffers calls it).
    (FULLY_SHARD, "FSDPModule", "set_allocate_memory_from_process_group_for_comm", (2, 11)),
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
    assert hasattr(_module(module), name) == _since(since), (
        f"{module}.{name}: expected {'present' if _since(since) else 'absent'} on torch "
        f"{torch.__version__} (there from {since[0]}.{since[1]})"
    )


@pytest.mark.parametrize(
    "module, cls, name, since",
    CLASS_ATTRIBUTES,
    ids=[f"{c}.{n}" for _, c, n, _ in CLASS_ATTRIBUTES],
)
def test_each_method_the_shim_names_is_there_from_its_release(module, cls, name, since):
    owner = getattr(_module(module), cls)
    assert hasattr(owner, name) == _since(since), (
        f"{cls}.{name}: expected {'present' if _since(since) else 'absent'} on torch "
        f"{torch.__version__} (there from {since[0]}.{since[1]})"
    )


@pytest.mark.parametrize(
    "release, adapter",
    [((2, 11), "Fsdp2"), ((2, 12), "Fsdp2"), ((2, 13), "Fsdp2From2_13"), ((2, 14), "Fsdp2From2_13")]
    + [((2, 15), "Fsdp2From2_15")],
)
def test_each_release_has_its_adapter(release, adapter):
    assert type(_fsdp2.for_release(release)).__name__ == adapter


def test_this_torchs_adapter_says_what_its_fsdp2_has():
    fsdp_module = FSDP2.fsdp_module_class()
    assert fsdp_module is _module(FULLY_SHARD).FSDPModule
    assert FSDP2.has_reset_iter_state == hasattr(fsdp_module, "reset_iter_state")
    assert FSDP2.param_group_module() is _module(PARAM_GROUP)
    assert (FSDP2.default_reduce_scatter_layout() is not None) == (RELEASE >= (2, 15))


def test_foreach_reduce_takes_the_parameters_the_shim_calls_it_by():
    # The shim calls the original by these names, whatever FSDP2 passes positionally.
    function = _module(PARAM_GROUP).foreach_reduce
    assert tuple(inspect.signature(function).parameters) == FSDP2.foreach_reduce_params
    assert FSDP2.incompatibility(_module(PARAM_GROUP)) is None
    if RELEASE >= (2, 15):
        default = inspect.signature(function).parameters["prepare_reduce_scatter_inputs"].default
        assert default in (None, FSDP2.default_reduce_scatter_layout())


@contextlib.contextmanager
def _one_param_group():
    """A real FSDP2 param group of a tiny module, on the proof's one-process mesh."""
    with _proof._one_process_mesh() as mesh:
        model = nn.Linear(4, 3)
        fully_shard(model, mesh=mesh)
        model(torch.ones(2, 4)).sum().backward()  # lazy init: the param group's groups exist
        yield model, model._get_fsdp_state()._fsdp_param_group


def test_the_adapter_reads_a_real_param_group():
    with _one_param_group() as (model, param_group):
        assert FSDP2.device(param_group) == torch.device("cpu")
        assert FSDP2.param_groups_of(model) == [param_group]
        assert not FSDP2.has_custom_comms(param_group)
        # FSDP2's default reduce-scatter takes any output; its process-group one (and any
        # other) wants its own allocate()'s (the shim then copies into its bucket).
        assert FSDP2.any_output_will_do(param_group._reduce_scatter_comm)
        model.set_allocate_memory_from_process_group_for_comm(True)
        assert not FSDP2.any_output_will_do(param_group._reduce_scatter_comm)
        model.set_allocate_memory_from_process_group_for_comm(False)
        assert FSDP2.any_output_will_do(param_group._reduce_scatter_comm)
        groups = FSDP2.shard_groups(param_group)
        assert groups and all(dist.get_backend(g) == "hsdp" for g in groups)
        assert FSDP2.mesh_groups(param_group)
        assert FSDP2.names_and_dtypes(param_group) == [
            ("weight", torch.float32),
            ("bias", torch.float32),
        ]
        fsdp_params = param_group.fsdp_params
        grad_dtypes = FSDP2.grad_dtypes(fsdp_params, torch.float32)
        assert grad_dtypes == [torch.float32] * len(fsdp_params)
        for fsdp_param in fsdp_params:
            assert FSDP2.offloaded(fsdp_param) is False
            shape = tuple(fsdp_param.sharded_param.shape)
            full = torch.zeros(shape)  # 1 x 1 mesh: the shard is the whole tensor
            assert FSDP2.padded_shard_numel(fsdp_param, full, 1) == full.numel()
            # A gradient viewed out of a flat buffer, assigned, then accumulated.
            flat = torch.arange(full.numel() + 1, dtype=torch.float32)
            view = FSDP2.shard_view(fsdp_param, flat, 1)
            assert tuple(view.shape) == shape and view.flatten()[0] == 1
            fsdp_param.sharded_param.grad = None
            param = FSDP2.assign_grad(fsdp_param, view.clone())
            assert param is fsdp_param.sharded_param
            assert torch.equal(param.grad.to_local(), view)
            FSDP2.assign_grad(fsdp_param, view.clone())
            assert torch.equal(param.grad.to_local(), 2 * view)
            calls = []
            param.register_post_accumulate_grad_hook(calls.append)
            for hook in FSDP2.post_accumulate_grad_hooks(param):
                hook(param)
            assert calls == [param]


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
