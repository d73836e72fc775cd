"""Bad input to the FSDP2 shim: what a user gets is a clear error or a
warning that says what to do, never silently wrong gradients."""

import warnings

import pytest

from harness import run_ranks


def mixed_dtype_params(rank, world):
    import torch
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    class FP32ThenBF16(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8).to(torch.bfloat16)

        def forward(self, x):
            return self.b(self.a(x).to(torch.bfloat16)).float()

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = FP32ThenBF16()
    fully_shard(model, mesh=mesh)
    x = torch.randn(4, 8)
    try:
        model(x).sum().backward()  # FSDP2 checks dtypes at lazy init, in the first forward
    except TypeError as exc:
        return str(exc)
    return None


def mixed_backend_mesh(rank, world):
    """A mesh whose replicate dimension is gloo: the shim warns and leaves
    FSDP2's native path; gradients equal those of an all-hsdp mesh."""
    import torch
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def grads(mesh):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
        model(x).square().sum().backward()
        return {n: p.grad.full_tensor() for n, p in model.named_parameters()}

    names = ("replicate", "shard")
    pure = grads(init_device_mesh("cpu", (2, 2), mesh_dim_names=names))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        mixed_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names, backend_override={"replicate": "gloo"})
        mixed = grads(mixed_mesh)
    assert torch.distributed.get_backend(mixed_mesh.get_group("replicate")) == "gloo"
    for n in pure:
        torch.testing.assert_close(mixed[n], pure[n], rtol=1e-6, atol=1e-7)
    return [str(w.message) for w in record]


def test_mixed_dtype_params_raise_a_clear_error():
    messages = run_ranks(mixed_dtype_params, 4, timeout_s=240)
    for m in messages:
        assert m is not None and "mixes dtypes" in m and "a.weight (torch.float32)" in m and "MixedPrecisionPolicy(param_dtype" in m, m


def test_mesh_mixing_backends_warns_and_stays_correct():
    per_rank = run_ranks(mixed_backend_mesh, 4, timeout_s=240)
    for messages in per_rank:
        assert any("mixes backends" in m and "backend='hsdp'" in m for m in messages), messages


def test_torch_outside_the_supported_range_warns():
    from hsdp_backend import fsdp

    assert fsdp._check_torch_version("2.14.1+cu130")
    fsdp._shim.warned.discard("torch-version")
    with pytest.warns(UserWarning, match=r"torch 2\.8\.0 is outside the supported range 2\.9-2\.14"):
        assert not fsdp._check_torch_version("2.8.0")
    fsdp._shim.warned.discard("torch-version")
    with pytest.warns(UserWarning, match="HSDP_FSDP=off"):
        assert not fsdp._check_torch_version("3.0.0")
