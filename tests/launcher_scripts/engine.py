"""No-backend init, then checks what really serves the default group."""

import os
import sys

import torch
import torch.distributed as dist

dist.init_process_group()
t = torch.ones(4)
dist.all_reduce(t)
assert t.tolist() == [2.0] * 4, t

import hsdp_backend  # noqa: E402  only to inspect the group, after init

sys.stdout.write(  # one write: ranks run unbuffered (-u)
    f"rank {dist.get_rank()} backend {dist.get_backend()} "
    f"engine {hsdp_backend.cpu_route()} "
    f"marker {os.environ.get('CHAINED_SITECUSTOMIZE', '-')}\n"
)
dist.destroy_process_group()
