"""Bad input to the FSDP2 shim: what a user gets is a clear error or a
warning that says what to do, never silently wrong gradients.

Mixed-dtype param groups (clear `TypeError`), a mesh mixing hsdp and gloo (warning, gradients
equal to the all-hsdp mesh's), torch outside the supported range (warning), a backward that
raises with buckets in flight then `reset_iter_state()` (no stale gradients: equal to FSDP2's
native path under the same failure), buckets filled from a nested backward (all finished)."""

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
        mixed_mesh = init_device_mesh(
            "cpu", (2, 2), mesh_dim_names=names, backend_override={"replicate": "gloo"}
        )
        mixed = grads(mixed_mesh)
    assert torch.distributed.get_backend(mixed_mesh.get_group("replicate")) == "gloo"
    for n in pure:
        torch.testing.assert_close(mixed[n], pure[n], rtol=1e-6, atol=1e-7)
    return [str(w.message) for w in record]


def test_mixed_dtype_params_raise_a_clear_error():
    messages = run_ranks(mixed_dtype_params, 4, timeout_s=240)
    for m in messages:
        assert (
            m is not None
            and "mixes dtypes" in m
            and "a.weight (torch.float32)" in m
            and "MixedPrecisionPolicy(param_dtype" in m
        ), m


def test_mesh_mixing_backends_warns_and_stays_correct():
    per_rank = run_ranks(mixed_backend_mesh, 4, timeout_s=240)
    for messages in per_rank:
        assert any("mixes backends" in m and "backend='hsdp'" in m for m in messages), messages


def test_torch_outside_the_supported_range_warns():
    from hsdp_backend.fsdp import _compat

    for inside in ("2.11.0+cu130", "2.12.1", "2.13.0+cpu", "2.14.1+cu130", "2.15.0"):
        assert _compat._check_torch_version(inside), inside
    for outside, key in (("2.10.0", "2\\.10\\.0"), ("2.16.0", "2\\.16\\.0")):
        _compat._shim.warned.discard("torch-version")
        with pytest.warns(
            UserWarning, match=rf"torch {key} is outside the supported range 2\.11 to 2\.15"
        ):
            assert not _compat._check_torch_version(outside)
    _compat._shim.warned.discard("torch-version")
    with pytest.warns(UserWarning, match="HSDP_FSDP=off"):
        assert not _compat._check_torch_version("3.0.0")


def backward_fails_midway(rank, world):
    """A backward that raises after some param groups were bucketed (some
    buckets in flight), then FSDP2's reset_iter_state: the next steps must not
    see any gradient the shim held. Compared with FSDP2's native path under the
    same failure (not with a clean run: FSDP2 2.14 itself does not recover to
    a clean run's numbers)."""

    import fsdp_parity
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from hsdp_backend import config
    from hsdp_backend import fsdp as shim

    s = fsdp_parity.Scenario(mesh=(2, 2), layers=4, steps=3)
    shim.enable(bucket_bytes=4 << 10)  # several buckets per backward, flushed mid-backward
    mesh = init_device_mesh("cpu", s.mesh, mesh_dim_names=("replicate", "shard"))
    data = fsdp_parity.batches(s, rank, s.steps + 1)

    def train(fail_first: bool):
        model, optimizer = fsdp_parity._build_sharded(s, mesh, s.seed)
        fail = {"armed": fail_first}

        def arm(_module, _inputs, output):
            def boom(grad):
                if fail["armed"]:
                    fail["armed"] = False
                    raise RuntimeError("injected failure in backward")
                return grad

            output.register_hook(boom)

        model.layers["1"].register_forward_hook(arm)
        losses = []
        if fail_first:
            try:
                fsdp_parity.loss_of(model, *data[-1]).backward()
            except RuntimeError as exc:
                assert "injected failure" in str(exc)
            else:
                raise AssertionError("the injected failure did not fire")
            model.reset_iter_state()
            optimizer.zero_grad()
        for inputs, labels in data[: s.steps]:
            optimizer.zero_grad()
            loss = fsdp_parity.loss_of(model, inputs, labels)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return losses, {n: p.full_tensor() for n, p in model.named_parameters()}

    try:
        losses, params = train(True)
        assert shim._shim.original_reset_iter_state is not None, "reset_iter_state was not wrapped"
        shim.disable()
        native_losses, native_params = train(True)
    finally:
        shim.enable(bucket_bytes=config.resolve().fsdp_bucket_bytes)
    torch.testing.assert_close(losses, native_losses, rtol=1e-5, atol=0)
    for n in native_params:
        torch.testing.assert_close(params[n], native_params[n], rtol=1e-5, atol=1e-6)
    return True


def test_a_failed_backward_leaves_no_stale_gradients():
    assert run_ranks(backward_fails_midway, 4, timeout_s=240) == [True] * 4


def nested_backward_body(rank, world):
    """Buckets filled from an outer backward and from a nested (reentrant)
    backward inside it: the nested task's final callback finishes what is
    bucketed by then, the outer one the rest; nothing is dropped."""
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from hsdp_backend.fsdp import _buckets, _compat

    buckets = _buckets.ReplicateBuckets(bucket_bytes=4 << 20)
    params, seen_after_nested = [], []

    def add_group(value: float):
        # A stand-in for one param group: the FSDPParam attributes the tail reads.
        param = torch.nn.Parameter(torch.zeros(4))
        fsdp_param = SimpleNamespace(
            sharded_size=torch.Size([4]),
            contiguous_sharded_stride=(1,),
            sharded_param=param,
            to_sharded_dtensor=lambda t: t,
        )
        in_backward = buckets.begin_add()
        cpu = torch.device("cpu")
        key, out = buckets.reserve(
            dist.group.WORLD, 1.0, torch.float32, 4, cpu, _buckets.Streams.of(cpu, None, None)
        )
        out.fill_(value)
        buckets.add(key, _compat.PendingGrads([fsdp_param], [4], [torch.float32], out), in_backward)
        params.append(param)

    class OuterThenNested(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            add_group(1.0)  # in the outer backward
            with torch.enable_grad():  # backward runs with grad mode off
                inner = torch.ones(2, requires_grad=True)
                y = inner * 3
                y.register_hook(lambda g: (add_group(2.0), g)[1])  # in the nested backward
                torch.autograd.backward(y.sum())  # a nested graph task
            seen_after_nested.extend(p.grad is not None for p in params)
            add_group(3.0)  # outer again
            return grad

    OuterThenNested.apply(torch.ones(2, requires_grad=True)).sum().backward()
    return seen_after_nested, [p.grad.tolist() for p in params]


def test_nested_backward_finishes_every_bucket():
    [(seen_after_nested, grads)] = run_ranks(nested_backward_body, 1, timeout_s=120)
    assert seen_after_nested == [True, True]  # the nested task's callback finished both
    assert grads == [[1.0] * 4, [2.0] * 4, [3.0] * 4]
