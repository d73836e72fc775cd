"""Fault-tolerant HSDP: a replica is lost mid-training and the others go on (torch 2.14+, CPU).

    torchrun --nproc-per-node 4 examples/train_hsdp_ft.py --backend hsdp --lose-replica-at 3
    torchrun --nproc-per-node 4 examples/train_hsdp_ft.py --backend gloo --lose-replica-at 3

The default group is created with ``enable_reconfigure=True`` and takes its members from
``dist._reconfigure``. The model (train_fsdp.py's) trains with HSDP on a (replicate, shard)
mesh. At step ``--lose-replica-at`` a replica's ranks (``--lose-replica``, the last by default) leave
without a word. The others
find out when a collective of theirs fails, agree through the store on who is left (the whole
replicas among the ranks that check in), reconfigure the group to those ranks, and rebuild the
mesh and the model on them from their own shards of the parameters and the optimizer state,
which a whole replica holds entirely. The failed step is taken again; each step's loss is the
survivors' average. Under one torchrun the leaving ranks exit with 0 (a crash would end the
job); the store is torchrun's, so any rank may be the one lost.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

# examples/ is sys.path[0] when this file runs as a script (and the import registers hsdp).
from train_fsdp import SyntheticData, apply_fsdp, build_model, get_parser, mean_across_ranks

ME = int(os.environ.get("RANK", "0"))  # this process's name across memberships


def join(store, generation: int, members: list[int]) -> None:
    """Makes `members` (names, in order) the default group's members; every member calls it."""
    store.set(f"handle/{generation}/{ME}", dist._get_reconfigure_handle())
    handles = [store.get(f"handle/{generation}/{m}").decode() for m in members]
    dist._reconfigure(generation, handles).wait()


def agree_on_survivors(store, generation: int, members: list[int], shard: int, wait_s: float):
    """The whole replicas among the ranks that check in: the first to check in waits `wait_s`
    for the others, then decides for all."""
    store.set(f"alive/{generation}/{ME}", "1")
    if store.add(f"checked_in/{generation}", 1) == 1:
        time.sleep(wait_s)
        alive = [m for m in members if store.check([f"alive/{generation}/{m}"])]
        replica_of = {m: range(m // shard * shard, (m // shard + 1) * shard) for m in alive}
        whole = [m for m in alive if all(r in alive for r in replica_of[m])]
        store.set(f"survivors/{generation}", json.dumps(whole))
    return json.loads(store.get(f"survivors/{generation}"))


def build(args, replicas: int, state=None):
    """Model and optimizer sharded on a (replicas, shard) mesh; `state`: the local shards of a
    previous build's model and optimizer state, placed on the new mesh."""
    mesh = init_device_mesh("cpu", (replicas, args.shard), mesh_dim_names=("replicate", "shard"))
    model = build_model(args)
    apply_fsdp(model, mesh, args.mixed_precision)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    if state is not None:

        def on_this_mesh(value):
            # The same shard of the same tensor: this rank's place along "shard" is unchanged.
            if isinstance(value, DTensor):
                return DTensor.from_local(
                    value.to_local(),
                    mesh,
                    value.placements,
                    shape=value.shape,
                    stride=value.stride(),
                )
            return value

        model_state, optim_state = state
        set_model_state_dict(model, {k: on_this_mesh(v) for k, v in model_state.items()})
        optim_state["state"] = {
            k: {n: on_this_mesh(v) for n, v in s.items()} for k, s in optim_state["state"].items()
        }
        set_optimizer_state_dict(model, optimizer, optim_state)
    return model, optimizer


def main() -> None:
    parser = get_parser(__doc__)
    parser.add_argument("--shard", type=int, default=2, help="ranks per replica")
    parser.add_argument(
        "--lose-replica-at", type=int, default=0, help="step a replica leaves at (0: never)"
    )
    parser.add_argument(
        "--lose-replica", type=int, default=-1, help="which replica leaves (-1: the last)"
    )
    parser.add_argument("--timeout", type=float, default=30.0, help="the group's timeout, seconds")
    parser.add_argument(
        "--check-in-s",
        type=float,
        default=2.0,
        help="how long survivors gather: longer than a survivor takes to find the loss",
    )
    args = parser.parse_args()
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        args.backend, enable_reconfigure=True, timeout=datetime.timedelta(seconds=args.timeout)
    )
    store = dist.distributed_c10d._get_default_store()
    lost = args.lose_replica % (world // args.shard)
    members, generation = list(range(world)), 1
    join(store, generation, members)
    model, optimizer = build(args, world // args.shard)
    data = SyntheticData(args.vocab, args.seq_len, args.batch_size, args.seed, ME)
    step, batch = 1, data.next_batch()
    while step <= args.steps:
        if step == args.lose_replica_at and ME // args.shard == lost and len(members) == world:
            sys.stdout.flush()
            os._exit(0)  # the replica is gone: no goodbye, no destroy_process_group
        try:
            optimizer.zero_grad()
            inputs, labels = batch
            loss = F.cross_entropy(model(inputs).float().flatten(0, 1), labels.flatten(0, 1))
            loss.backward()
            loss_avg = mean_across_ranks(loss).item()  # the step's last collective
            optimizer.step()  # local: after every collective of the step succeeded
        except (dist.DistBackendError, RuntimeError) as exc:
            # No optimizer step ran (it follows every collective of the step): this rank's
            # shards are the last step's. A failed backward may leave parameters unsharded:
            # reshard() (FSDP2's, local) frees them.
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()
            state = (get_model_state_dict(model), get_optimizer_state_dict(model, optimizer))
            generation += 1
            left = agree_on_survivors(store, generation, members, args.shard, args.check_in_s)
            if not left or left == members:
                raise RuntimeError(f"rank {ME}: no replica was lost, or none is left") from exc
            members = left
            if ME not in members:
                os._exit(0)
            print(
                f"rank {ME}: {type(exc).__name__} at step {step}; going on with ranks {members}",
                file=sys.stderr,
                flush=True,
            )
            join(store, generation, members)
            model, optimizer = build(args, len(members) // args.shard, state)
            continue
        if dist.get_rank() == 0:
            print(
                json.dumps({"step": step, "loss": loss_avg, "world": dist.get_world_size()}),
                flush=True,
            )
        step, batch = step + 1, data.next_batch()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
