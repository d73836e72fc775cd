"""FSDP2 training scenarios for the parity tests (test_fsdp.py).

A scenario trains the examples' transformer (tiny) for a few steps with
fully_shard per block, then the root. ``train_ranks`` runs it inside the
ranks of a launch on whatever backend the default group has; ``reference``
runs the same arithmetic in one process without torch.distributed: every
rank's micro-batches, losses averaged over ranks, gradients summed over
micro-batches, so FSDP's averaged gradients are the reference's exactly up
to rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Scenario:
    """One training configuration.

    Args:
        mesh: (shard,) for FSDP or (replicate, shard) for HSDP.
        mp: "none", "bf16" (bf16 params, fp32 reduce), "bf16-reduce" or
            "fp64-reduce" (fp32 params, gradients reduced in fp64).
        micro_batches: backward passes per optimizer step.
        accumulate: how the micro-batches before the last skip communication:
            "no_sync" (set_requires_gradient_sync(False): nothing reduced),
            "no_all_reduce" (set_requires_all_reduce(False): reduce-scatter,
            no replicate all-reduce) or "none" (every backward reduces and
            adds into .grad).
        reentrant_checkpoint: wrap every other block in reentrant activation
            checkpointing, whose recompute runs a nested backward (on torch
            2.14 FSDP2's post-backward still runs in the outer task).
        divide_factor: set_gradient_divide_factor on every module.
        reshard: reshard_after_forward for the blocks (True, False or an int).
        explicit_prefetch: set_modules_to_forward/backward_prefetch.
        clip: clip_grad_norm_ max norm.
        checkpoint_at: save with torch.distributed.checkpoint after this
            step, rebuild everything from a different seed, load, continue.
        shim: "auto" (as installed), "off" (hsdp_backend.fsdp.disable()) or
            "incompatible" (FSDP2's foreach_reduce replaced by a function of
            another signature before enabling: the shim must refuse).
        bucket_bytes: replicate bucket capacity for the shim.
        stream_ordered: run the shim's GPU code (buckets ordered by FSDP2's
            streams and events, all-reduces on its all-reduce stream) on
            CPU, where streams and events are no-ops.
        pg_alloc: set_allocate_memory_from_process_group_for_comm(True) on
            every module after fully_shard: FSDP2's all-gather outputs and
            reduce-scatter inputs come from the group's allocate_tensor;
            False: the same call with False (FSDP2's own buffers); None:
            neither (FSDP2's own).
        own_rs_buffers: set_custom_reduce_scatter on every module with a comm
            that refuses an output not from its own allocate(), as FSDP2's
            symmetric-memory comm (NCCL's rendezvous) does: the shim must
            not hand it a slice of its bucket.
    """

    mesh: tuple[int, ...]
    steps: int = 10
    mp: str = "none"
    micro_batches: int = 1
    accumulate: str = "no_sync"
    reentrant_checkpoint: bool = False
    divide_factor: float | None = None
    reshard: bool | int = True
    explicit_prefetch: bool = False
    clip: float | None = None
    checkpoint_at: int | None = None
    shim: str = "auto"
    bucket_bytes: int | None = None
    stream_ordered: bool = False
    pg_alloc: bool | None = None
    own_rs_buffers: bool = False
    dim: int = 32
    layers: int = 3
    heads: int = 2
    vocab: int = 128
    seq_len: int = 16
    batch_size: int = 2
    lr: float = 1e-2
    seed: int = 0

    @property
    def world(self) -> int:
        return math.prod(self.mesh)


SCENARIOS: dict[str, Scenario] = {
    # FSDP2's own buffers, chosen by the user (the same call with False).
    "fsdp_w2": Scenario(mesh=(2,), explicit_prefetch=True, pg_alloc=False),
    "fsdp_w2_bf16": Scenario(mesh=(2,), mp="bf16"),
    # vocab 127: the embedding and output rows do not split evenly (FSDP2 pads dim 0).
    "fsdp_w4_reshard_int": Scenario(mesh=(4,), reshard=2, vocab=127),
    "hsdp_2x2": Scenario(mesh=(2, 2), reshard=False, clip=0.5, vocab=127),
    "hsdp_2x2_fp64_reduce": Scenario(mesh=(2, 2), mp="fp64-reduce"),
    "hsdp_2x2_accumulate_into_grad": Scenario(mesh=(2, 2), micro_batches=2, accumulate="none"),
    "hsdp_2x2_reentrant_checkpoint": Scenario(mesh=(2, 2), reentrant_checkpoint=True),
    "hsdp_2x2_bf16": Scenario(mesh=(2, 2), mp="bf16"),
    "hsdp_2x2_bf16_reduce": Scenario(mesh=(2, 2), mp="bf16-reduce"),
    "hsdp_2x2_accumulate_no_sync": Scenario(mesh=(2, 2), micro_batches=3, accumulate="no_sync"),
    "hsdp_2x2_accumulate_no_all_reduce": Scenario(
        mesh=(2, 2), micro_batches=3, accumulate="no_all_reduce"
    ),
    "hsdp_2x2_divide_factor": Scenario(mesh=(2, 2), divide_factor=3.0),
    # FSDP2's PREMUL_SUM(1/factor) in bf16 (set_gradient_divide_factor with a
    # bf16 reduce dtype): what torch 2.11-2.13's ProcessGroupNCCL zeroes.
    "fsdp_w2_bf16_reduce_divide_factor": Scenario(mesh=(2,), mp="bf16-reduce", divide_factor=4.0),
    "hsdp_2x2_bf16_reduce_divide_factor": Scenario(
        mesh=(2, 2), mp="bf16-reduce", divide_factor=8.0
    ),
    "hsdp_2x2_checkpoint": Scenario(mesh=(2, 2), checkpoint_at=5),
    "hsdp_2x2_small_buckets": Scenario(mesh=(2, 2), bucket_bytes=8 << 10, explicit_prefetch=True),
    # A block's gradient shard is ~33 KB: buckets take two groups, the first
    # backward grows them, later ones allocate them from the previous sizes.
    "hsdp_2x2_stream_ordered": Scenario(
        mesh=(2, 2),
        micro_batches=2,
        accumulate="no_all_reduce",
        bucket_bytes=8 << 10,
        stream_ordered=True,
    ),
    "hsdp_2x2_two_groups_per_bucket": Scenario(mesh=(2, 2), bucket_bytes=40 << 10),
    # Reduction in another dtype than the gradients' (a cast to finish them),
    # nine param groups of one bucket each: the shim must finish each bucket
    # once its all-reduce is done and let its buffer go, holding a few buckets
    # of reduce-dtype gradients, not the model's (GPU code too).
    "hsdp_2x2_fp64_reduce_deep_buckets": Scenario(
        mesh=(2, 2), mp="fp64-reduce", layers=8, steps=4, bucket_bytes=8 << 10
    ),
    "hsdp_2x2_fp64_reduce_deep_stream_ordered": Scenario(
        mesh=(2, 2), mp="fp64-reduce", layers=8, steps=4, bucket_bytes=8 << 10, stream_ordered=True
    ),
    "hsdp_2x1_replicate_only": Scenario(mesh=(2, 1)),
    "fsdp_w2_pg_alloc": Scenario(mesh=(2,), pg_alloc=True, explicit_prefetch=True),
    "fsdp_w4_pg_alloc_bf16": Scenario(mesh=(4,), pg_alloc=True, mp="bf16", reshard=2),
    "hsdp_2x2_pg_alloc": Scenario(mesh=(2, 2), pg_alloc=True, reshard=False, clip=0.5),
    "hsdp_2x2_own_reduce_scatter_buffers": Scenario(mesh=(2, 2), own_rs_buffers=True),
    "hsdp_2x2_shim_off": Scenario(mesh=(2, 2), shim="off"),
    "hsdp_2x2_shim_incompatible": Scenario(mesh=(2, 2), shim="incompatible"),
}


def model_args(s: Scenario):
    import argparse

    return argparse.Namespace(dim=s.dim, layers=s.layers, heads=s.heads, vocab=s.vocab, seed=s.seed)


def batches(s: Scenario, rank: int, count: int):
    """``count`` micro-batches of data-parallel rank ``rank``."""
    from examples.train_fsdp import SyntheticData

    data = SyntheticData(s.vocab, s.seq_len, s.batch_size, s.seed, rank)
    return [data.next_batch() for _ in range(count)]


def loss_of(model, inputs, labels):
    import torch.nn.functional as F

    logits = model(inputs)
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(0, 1))


def make_optimizer(params, s: Scenario):
    import torch

    # SGD with momentum: the update is linear in the gradient, so parameter
    # differences measure gradient differences (Adam would renormalise them).
    return torch.optim.SGD(params, lr=s.lr, momentum=0.9)


def num_param_groups(s: Scenario) -> int:
    return s.layers + 1  # one per block, plus the root


# ---------------------------------------------------------------------------
# Single-process reference
# ---------------------------------------------------------------------------


def reference(s: Scenario) -> dict:
    """Losses (mean over ranks, per step) and final parameters, computed in one
    process in fp32."""
    import torch

    from examples.train_fsdp import build_model

    torch.manual_seed(s.seed)
    model = build_model(model_args(s))
    optimizer = make_optimizer(model.parameters(), s)
    data = [batches(s, r, s.steps * s.micro_batches) for r in range(s.world)]
    divisor = s.divide_factor if s.divide_factor is not None else s.world
    losses = []
    for step in range(s.steps):
        optimizer.zero_grad()
        step_loss = 0.0
        for m in range(s.micro_batches):
            total = 0.0
            for r in range(s.world):
                inputs, labels = data[r][step * s.micro_batches + m]
                loss = loss_of(model, inputs, labels)
                (loss / divisor).backward()
                total += loss.item()
            step_loss = total / s.world  # the last micro-batch's, as the ranks report
        if s.clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), s.clip)
        optimizer.step()
        losses.append(step_loss)
    return {
        "losses": losses,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


# ---------------------------------------------------------------------------
# Inside the ranks
# ---------------------------------------------------------------------------


def _build_sharded(s: Scenario, mesh, seed: int):
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from examples.train_fsdp import build_model, mixed_precision_policy

    args = model_args(s)
    args.seed = seed
    model = build_model(args)
    if s.mp == "fp64-reduce":  # a test-only policy; the others are the example's
        policy = MixedPrecisionPolicy(reduce_dtype=torch.float64)
    else:
        policy = mixed_precision_policy(s.mp)
    if s.reentrant_checkpoint:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointImpl,
            checkpoint_wrapper,
        )

        for name in list(model.layers)[::2]:
            model.layers[name] = checkpoint_wrapper(
                model.layers[name], checkpoint_impl=CheckpointImpl.REENTRANT
            )
    blocks = list(model.layers.values())
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=s.reshard)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if s.explicit_prefetch:
        for i, block in enumerate(blocks):
            if i + 1 < len(blocks):
                block.set_modules_to_forward_prefetch([blocks[i + 1]])
            if i > 0:
                block.set_modules_to_backward_prefetch([blocks[i - 1]])
    if s.divide_factor is not None:
        for module in [*blocks, model]:
            module.set_gradient_divide_factor(s.divide_factor)
    if s.pg_alloc is not None:
        for module in [*blocks, model]:
            module.set_allocate_memory_from_process_group_for_comm(s.pg_alloc)
    if s.own_rs_buffers:
        for module in [*blocks, model]:
            module.set_custom_reduce_scatter(_own_buffers_reduce_scatter())
    return model, make_optimizer(model.parameters(), s)


OWN_BUFFER_CALLS = [0]  # reduce-scatters of _own_buffers_reduce_scatter's comms, this rank


def _own_buffers_reduce_scatter():
    """A reduce-scatter comm whose output must come from its own allocate() (FSDP2's
    SymmMemReduceScatter's symm_mem.rendezvous refuses other memory); it raises otherwise."""
    import weakref

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

    class OwnBuffers(ReduceScatter):
        def __init__(self):
            self._handed = []

        def allocate(self, size, *, dtype, device):
            t = torch.empty(*size, dtype=dtype, device=device)
            self._handed = [r for r in self._handed if r() is not None] + [weakref.ref(t)]
            return t

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            ptr = output_tensor.untyped_storage().data_ptr()
            if not any(r() is not None and r().untyped_storage().data_ptr() == ptr
                       for r in self._handed):  # fmt: skip
                raise RuntimeError("the reduce-scatter output is not from this comm's allocate()")
            OWN_BUFFER_CALLS[0] += 1
            return dist.reduce_scatter_tensor(
                output_tensor, input_tensor, op=op, group=group, async_op=async_op
            )

    return OwnBuffers()


def _comm_counts(groups: dict) -> dict:
    import hsdp_backend

    out = {}
    for label, group in groups.items():
        stats = hsdp_backend.comm_stats(group)
        out[label] = {
            op: (c["calls"], c["collectives"], c["bytes"]) for op, c in stats.items() if c["calls"]
        }
    return out


def _train_step(s: Scenario, model, data, step: int):
    """One optimizer step's forwards and backwards; returns the last loss."""
    for m in range(s.micro_batches):
        last = m == s.micro_batches - 1
        if s.micro_batches > 1 and s.accumulate != "none":
            if s.accumulate == "no_sync":
                model.set_requires_gradient_sync(last)
            else:
                model.set_requires_all_reduce(last)
        inputs, labels = data[step * s.micro_batches + m]
        loss = loss_of(model, inputs, labels)
        loss.backward()
    return loss


def _dispatched_collectives():
    """A mode counting the c10d ops that pass through the dispatcher, with
    CommDebugMode's get_comm_counts(): CommDebugMode itself, except on torch
    2.13, whose CommDebugMode raises IndexError when a module runs forward
    twice under it (its module tracker registers one more forward hook per
    run and pops its parent list once per hook; fixed in 2.14). There, a
    dispatch mode that counts the same way (DTensor ops desugared first)."""
    import collections

    import torch
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from hsdp_backend import _torch_compat

    if _torch_compat.version() >= (2, 14):
        return CommDebugMode()

    class Counting(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.counts = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if isinstance(func, torch._ops.HigherOrderOperator):
                return func(*args, **kwargs)
            if any(t == DTensor for t in types):
                return NotImplemented
            out = func(*args, **kwargs)
            self.counts[func._overloadpacket] += 1
            return out

        def get_comm_counts(self):
            return self.counts

    return Counting()


def train_ranks(rank: int, world: int, name: str, checkpoint_dir: str | None = None) -> dict:
    """Runs scenario ``name`` on the default group's backend. Returns the
    per-step losses (mean over ranks), per-step hsdp comm counts, warnings
    raised by the shim, and (rank 0) the full final parameters."""
    import contextlib
    import warnings

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import hsdp_backend
    from hsdp_backend import config
    from hsdp_backend import fsdp as shim
    from hsdp_backend.fsdp import _buckets

    s = SCENARIOS[name]
    assert world == s.world, (world, s.world)
    on_hsdp = dist.get_backend() == "hsdp"
    names = ("shard",) if len(s.mesh) == 1 else ("replicate", "shard")
    mesh = init_device_mesh("cpu", s.mesh, mesh_dim_names=names)
    groups = {n: mesh.get_group(n) for n in names}
    # A 1-D mesh's group is the default one, which a warm pool keeps across tests: what
    # this scenario allocates is the count's growth from here.
    allocations_before = _inner_allocations(groups) if on_hsdp else None
    if s.pg_alloc:
        # NCCL's memory pool needs the group's communicator, which a group
        # made without device_id has only after its first collective: on
        # NCCL, and on hsdp's CUDA route, FSDP2's buffers then need one
        # first (a barrier makes it). The NCCL-contract double holds hsdp to
        # that; the mesh's groups are new, so each gets its barrier.
        for group in groups.values():
            dist.barrier(group=group)
    caught: list[str] = []

    import torch.distributed.fsdp._fully_shard._fsdp_param_group as param_group_module

    original_foreach_reduce = None
    original_ordering = _buckets.ordered_by_streams
    if on_hsdp and s.stream_ordered:
        _buckets.ordered_by_streams = lambda device: True
    if on_hsdp:
        if s.bucket_bytes is not None:
            shim.enable(bucket_bytes=s.bucket_bytes)
        if s.shim in ("off", "incompatible"):
            shim.disable()
        if s.shim == "incompatible":
            original_foreach_reduce = param_group_module.foreach_reduce
            param_group_module.foreach_reduce = lambda *args, **kwargs: original_foreach_reduce(
                *args, **kwargs
            )
            with warnings.catch_warnings(record=True) as record:
                warnings.simplefilter("always")
                assert shim.enable() is False
            caught += [str(w.message) for w in record]
    try:
        model, optimizer = _build_sharded(s, mesh, s.seed)
        if on_hsdp and s.shim not in ("off", "incompatible"):
            # Installed, proved, at the first fully_shard (or by enable() above).
            assert shim.is_enabled(), "the shim should be installed automatically on hsdp"
        if not on_hsdp:
            # gloo: SUM collectives and one division (torch versions whose gloo
            # AVG reduce-scatter sums would otherwise make a bad reference).
            for module in model.modules():
                if hasattr(module, "set_force_sum_reduction_for_comms"):
                    module.set_force_sum_reduction_for_comms(True)
        # Post-accumulate-grad hooks must fire once per parameter per reducing backward.
        hook_calls = {n: 0 for n, _ in model.named_parameters()}
        for n, p in model.named_parameters():
            p.register_post_accumulate_grad_hook(
                lambda _p, n=n: hook_calls.__setitem__(n, hook_calls[n] + 1)
            )
        dp_rank = rank  # every rank is its own data-parallel rank
        data = batches(s, dp_rank, s.steps * s.micro_batches)
        losses, comms, peak_held = [], [], []
        for step in range(s.steps):
            if s.checkpoint_at is not None and step == s.checkpoint_at:
                model, optimizer = _reload(s, mesh, model, optimizer, checkpoint_dir)
            if on_hsdp:
                for g in groups.values():
                    hsdp_backend.reset_comm_stats(g)
            optimizer.zero_grad()
            # The first step's collectives as c10d's dispatcher sees them.
            debug = _dispatched_collectives() if on_hsdp and step == 0 else contextlib.nullcontext()
            with debug:
                loss = _train_step(s, model, data, step)
            if on_hsdp and step == 0:
                dispatched_all_reduces = debug.get_comm_counts().get(torch.ops.c10d.allreduce_, 0)
            # Gradients must be complete here, with no extra call. (Counted
            # before clipping, whose norm all-reduces are not gradient traffic.)
            if on_hsdp:
                comms.append(_comm_counts(groups))
                peak_held.append(shim._shim.buckets.peak_held_bytes)
            if s.clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), s.clip)
            optimizer.step()
            reported = loss.detach().clone()
            dist.all_reduce(reported, op=dist.ReduceOp.SUM)
            losses.append(reported.item() / world)
        reduce_itemsize = {"bf16-reduce": 2, "fp64-reduce": 8}.get(s.mp, 4)
        grad_bytes = sum(p.to_local().numel() * reduce_itemsize for p in model.parameters())
        # numpy, not tensors: torch pickles tensors through file descriptors
        # that die with this process.
        params = {
            _unwrapped(n): p.full_tensor().detach().float().numpy().copy()
            for n, p in model.named_parameters()
        }
        return {
            "losses": losses,
            "comms": comms,
            "hook_calls": sorted(set(hook_calls.values())),
            "warnings": caught,
            "params": params if rank == 0 else None,
            "grad_bytes_per_rank": grad_bytes,
            # the most reduce-dtype gradient bytes the shim held at once, per step
            "peak_held_bytes": peak_held,
            "shim_enabled": shim.is_enabled() if on_hsdp else None,
            "dispatched_all_reduces": dispatched_all_reduces if on_hsdp else None,
            # communication buffers: pool calls (shm) and the double's allocations
            "pooled_calls": sum(
                hsdp_backend.buffer_stats(g)["pooled_calls"] for g in groups.values()
            )
            if on_hsdp
            else None,
            "inner_allocations": _growth(_inner_allocations(groups), allocations_before)
            if on_hsdp
            else None,
            "own_buffer_calls": OWN_BUFFER_CALLS[0],
        }
    finally:
        _buckets.ordered_by_streams = original_ordering
        if original_foreach_reduce is not None:
            param_group_module.foreach_reduce = original_foreach_reduce
        if on_hsdp:
            shim.enable(
                bucket_bytes=config.resolve().fsdp_bucket_bytes
            )  # back to the defaults for the next scenario


def _inner_allocations(groups: dict) -> int | None:
    """Buffers the NCCL-contract double handed out (None on other engines)."""
    import hsdp_testing
    import torch
    from hooks import double_of

    from hsdp_backend import _C

    if (
        "nccl_contract"
        not in _C.cpu_route(groups[next(iter(groups))]._get_backend(torch.device("cpu")))[0]
    ):
        return None
    return sum(
        hsdp_testing.allocations(double_of(g._get_backend(torch.device("cpu"))))
        for g in groups.values()
    )


def _growth(now: int | None, before: int | None) -> int | None:
    return None if now is None or before is None else now - before


def _unwrapped(name: str) -> str:
    """A parameter's name without activation checkpointing's wrapper prefix."""
    return name.replace("_checkpoint_wrapped_module.", "")


def _reload(s: Scenario, mesh, model, optimizer, checkpoint_dir: str):
    """Saves model and optimizer with DCP, rebuilds both from another seed
    (so a load that does nothing would show) and loads them back."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=checkpoint_dir)
    fresh_model, fresh_optimizer = _build_sharded(s, mesh, s.seed + 1000)
    model_sd, optim_sd = get_state_dict(fresh_model, fresh_optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=checkpoint_dir)
    set_state_dict(
        fresh_model,
        fresh_optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
    )
    return fresh_model, fresh_optimizer


def run_scenarios(rank: int, world: int, names: list[str], checkpoint_root: str) -> dict:
    """Rank body of one launch: every scenario in ``names``, in order.
    Returns {name: result dict, or the traceback text}."""
    import os
    import traceback

    import torch.distributed as dist

    out = {}
    for name in names:
        try:
            checkpoint_dir = os.path.join(checkpoint_root, f"{name}-{dist.get_backend()}")
            out[name] = train_ranks(rank, world, name, checkpoint_dir)
        except BaseException:  # noqa: BLE001 - reported per scenario
            out[name] = traceback.format_exc()
            break
    for name in names:
        out.setdefault(name, "not run: an earlier scenario failed on this rank")
    return out
