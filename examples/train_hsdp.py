"""Trains the train_fsdp.py transformer with HSDP on a 2-D CPU device mesh.

HSDP (hybrid sharded data parallel) shards parameters within each "shard"
group and replicates those shards across the "replicate" groups. Each step
all-gathers parameters and reduce-scatters gradients over the shard group,
then all-reduces the gradient shards over the replicate group:

    torchrun --nproc-per-node 4 examples/train_hsdp.py --backend hsdp
    torchrun --nproc-per-node 4 examples/train_hsdp.py --backend gloo

The world size must equal ``--replicate * --shard`` (default 2 x 2). Model,
data, flags and per-step output are those of train_fsdp.py; on hsdp the
comm-stats columns are reported separately for this rank's shard group and
replicate group.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

# examples/ is sys.path[0] when this file runs as a script, so the sibling
# module imports directly (and registers the hsdp backend on import).
from train_fsdp import get_parser, init_distributed, shut_down, train


def main() -> None:
    parser = get_parser(__doc__)
    parser.add_argument(
        "--replicate", type=int, default=2, help="size of the replicate mesh dimension"
    )
    parser.add_argument("--shard", type=int, default=2, help="size of the shard mesh dimension")
    args = parser.parse_args()

    init_distributed(args)
    try:
        run_hsdp(args)
    finally:
        shut_down()


def run_hsdp(args) -> None:
    world_size = dist.get_world_size()
    if world_size != args.replicate * args.shard:
        raise ValueError(
            f"world size {world_size} != --replicate {args.replicate} * --shard {args.shard}"
        )
    # Row-major layout: ranks that differ in the last ("shard") coordinate
    # are adjacent, e.g. shard groups [0, 1], [2, 3] and replicate groups
    # [0, 2], [1, 3] on the default 2 x 2 mesh.
    mesh = init_device_mesh(
        args.device, (args.replicate, args.shard), mesh_dim_names=("replicate", "shard")
    )
    train(
        args,
        mesh,
        {"shard": mesh.get_group("shard"), "replicate": mesh.get_group("replicate")},
    )


if __name__ == "__main__":
    main()
