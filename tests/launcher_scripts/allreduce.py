"""An ordinary torch.distributed script: nothing in it mentions hsdp_backend.

usage: allreduce.py VARIANT, where VARIANT picks the init_process_group call.
Prints "rank R backend B sum S marker M" (M: what a chained sitecustomize
left in the environment, "-" if nothing).
"""

import os
import sys

import torch
import torch.distributed as dist

variant = sys.argv[1]
if variant == "none":
    dist.init_process_group()
elif variant == "gloo":
    dist.init_process_group("gloo")
elif variant == "cpu_cuda":
    dist.init_process_group("cpu:gloo,cuda:nccl")
elif variant == "cuda_cpu_kw":
    dist.init_process_group(backend="cuda:nccl,cpu:gloo")
elif variant == "hsdp":
    dist.init_process_group("hsdp")
else:
    raise SystemExit(f"unknown variant {variant!r}")

rank = dist.get_rank()
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
expected = float(sum(range(1, dist.get_world_size() + 1)))
assert t.item() == expected, (t.item(), expected)
sys.stdout.write(  # one write: ranks run unbuffered (-u)
    f"rank {rank} backend {dist.get_backend()} sum {t.item()} "
    f"marker {os.environ.get('CHAINED_SITECUSTOMIZE', '-')}\n"
)
dist.destroy_process_group()
