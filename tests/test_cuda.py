"""The CUDA route: hsdp over an inner ProcessGroupNCCL. These machines have
no GPU, so this runs only where torch sees one; the same fusion and
deferred-scale code is exercised on CPU by test_ops.py."""

import pytest
import torch

from harness import run_ranks

pytestmark = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs; this machine has none"
)


def cuda_body(rank, world):
    import torch.distributed as dist

    import hsdp_backend

    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    t = torch.full((1000,), float(rank + 1), device=dev, dtype=torch.bfloat16)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    torch.testing.assert_close(t, torch.full_like(t, (world + 1) / 2))
    out = torch.empty(10, device=dev)
    dist.reduce_scatter_tensor(out, torch.ones(10 * world, device=dev), op=dist._make_nccl_premul_sum(0.5))
    torch.testing.assert_close(out, torch.full_like(out, world * 0.5))
    outs = [torch.empty(world * n, device=dev) for n in (3, 5)]
    with dist._coalescing_manager():
        for n, o in zip((3, 5), outs):
            dist.all_gather_into_tensor(o, torch.full((n,), float(rank), device=dev))
    for n, o in zip((3, 5), outs):
        torch.testing.assert_close(o.cpu(), torch.arange(world).float().repeat_interleave(n))
    assert hsdp_backend.comm_stats()["all_gather_into_tensor_coalesced"]["collectives"] == 1


def test_cuda_collectives_through_nccl():
    run_ranks(cuda_body, 2)
