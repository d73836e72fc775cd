"""Trains a small transformer with 1-D FSDP2 (``fully_shard``) on CPU.

The script follows torchtitan's layout (model, parallelisation, training loop)
at toy scale, so the hsdp backend can be exercised end to end and compared
against gloo on identical work:

    torchrun --nproc-per-node 2 examples/train_fsdp.py --backend hsdp
    torchrun --nproc-per-node 2 examples/train_fsdp.py --backend gloo

Every run trains on the same synthetic data (a fixed seed), and every rank
builds the same initial weights, so at fp32 hsdp and gloo should report
(nearly) the same losses. Rank 0 prints one line per step: the loss averaged
over ranks, the step time (and, within it, forward + backward, where all of
FSDP2's communication happens), the throughput in tokens/s over all ranks and, on hsdp, the
collectives that step issued (``ag``: all-gather, ``rs``: reduce-scatter,
``ar``: all-reduce, each as ``calls/collectives``, plus the bytes this rank
contributed). With ``--json`` it prints instead one JSON object per step, one
per line on stdout, with the same numbers (see :func:`train`), for programs
to read; the model and final-loss lines then go to stderr.

``examples/train_hsdp.py`` reuses this module's model, data and training loop
on a 2-D (replicate, shard) device mesh.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import resource
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import hsdp_backend  # registers the "hsdp" backend with torch.distributed
import hsdp_backend.fsdp

# ---------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------


@dataclass
class ModelArgs:
    """Shape of the transformer.

    Args:
        dim: model (embedding) width.
        n_layers: number of transformer blocks.
        n_heads: attention heads per block; must divide ``dim``.
        vocab_size: number of token ids.
        multiple_of: the MLP hidden size is rounded up to a multiple of this.
        norm_eps: epsilon of the RMS norms.
    """

    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    vocab_size: int = 2048
    multiple_of: int = 64
    norm_eps: float = 1e-5


def rotary_cos_sin(
    head_dim: int, seq_len: int, device: torch.device | None = None, theta: float = 10000.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine and sine tables for rotary position embeddings (RoPE).

    Real-valued rather than torchtitan's complex ``freqs_cis`` so the tables
    follow the activations' dtype under bf16 mixed precision without special
    casing.

    Args:
        head_dim: per-head width; must be even.
        seq_len: number of positions.
        device: where the activations are (the tables are built there).
        theta: RoPE base.

    Returns:
        ``(cos, sin)``, each of shape ``(seq_len, head_dim // 2)``.
    """
    arange = lambda *a: torch.arange(*a, dtype=torch.float32, device=device)
    freqs = 1.0 / (theta ** (arange(0, head_dim, 2) / head_dim))
    angles = torch.outer(arange(seq_len), freqs)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates pairs of channels of ``x`` by position-dependent angles.

    Args:
        x: ``(batch, seq, heads, head_dim)``.
        cos: ``(seq, head_dim // 2)``.
        sin: ``(seq, head_dim // 2)``.
    """
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.flatten(-2).type_as(x)


class Attention(nn.Module):
    """Causal multi-head self-attention with rotary embeddings.

    Args:
        model_args: the model shape.
    """

    def __init__(self, model_args: ModelArgs):
        super().__init__()
        self.n_heads = model_args.n_heads
        self.head_dim = model_args.dim // model_args.n_heads
        self.wq = nn.Linear(model_args.dim, model_args.dim, bias=False)
        self.wk = nn.Linear(model_args.dim, model_args.dim, bias=False)
        self.wv = nn.Linear(model_args.dim, model_args.dim, bias=False)
        self.wo = nn.Linear(model_args.dim, model_args.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, seq_len, _ = x.shape
        q = self.wq(x).view(bsz, seq_len, self.n_heads, self.head_dim)
        k = self.wk(x).view(bsz, seq_len, self.n_heads, self.head_dim)
        v = self.wv(x).view(bsz, seq_len, self.n_heads, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # SDPA wants (batch, heads, seq, head_dim).
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(bsz, seq_len, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1(x)) * w3(x))``.

    Args:
        dim: input and output width.
        hidden_dim: nominal hidden width (4 * dim); scaled by 2/3 to keep the
            parameter count of a plain 4x MLP, then rounded up to
            ``multiple_of``.
        multiple_of: rounding granularity of the hidden width.
    """

    def __init__(self, dim: int, hidden_dim: int, multiple_of: int):
        super().__init__()
        hidden_dim = int(2 * hidden_dim / 3)
        hidden_dim = multiple_of * math.ceil(hidden_dim / multiple_of)
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``h + mlp(norm(h))``.

    Args:
        model_args: the model shape.
    """

    def __init__(self, model_args: ModelArgs):
        super().__init__()
        self.attention_norm = nn.RMSNorm(model_args.dim, eps=model_args.norm_eps)
        self.attention = Attention(model_args)
        self.ffn_norm = nn.RMSNorm(model_args.dim, eps=model_args.norm_eps)
        self.feed_forward = FeedForward(model_args.dim, 4 * model_args.dim, model_args.multiple_of)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Decoder-only transformer: embedding, blocks, final norm, output head.

    Blocks live in a ``ModuleDict`` keyed by layer index, as in torchtitan, so
    they keep stable fully-qualified names when wrapped.

    Args:
        model_args: the model shape.
    """

    def __init__(self, model_args: ModelArgs):
        super().__init__()
        self.model_args = model_args
        self.tok_embeddings = nn.Embedding(model_args.vocab_size, model_args.dim)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(model_args) for i in range(model_args.n_layers)}
        )
        self.norm = nn.RMSNorm(model_args.dim, eps=model_args.norm_eps)
        self.output = nn.Linear(model_args.dim, model_args.vocab_size, bias=False)
        self.init_weights()

    def init_weights(self) -> None:
        """Small truncated-normal init; output projections scaled by depth.

        Scaling the projections that write into the residual stream by
        ``1/sqrt(2 * n_layers)`` keeps the residual's variance roughly
        independent of depth (GPT-2 / torchtitan style).
        """
        depth_std = 0.02 / math.sqrt(2 * self.model_args.n_layers)
        for name, param in self.named_parameters():
            if param.dim() < 2:  # norm weights stay at 1
                continue
            is_residual_proj = name.endswith(("attention.wo.weight", "feed_forward.w2.weight"))
            nn.init.trunc_normal_(param, std=depth_std if is_residual_proj else 0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Returns logits of shape ``(batch, seq, vocab_size)`` for ``tokens``."""
        h = self.tok_embeddings(tokens)
        # Rebuilt per call: it is tiny, and it avoids a buffer that FSDP would
        # have to leave unsharded and mixed precision would leave in fp32.
        cos, sin = rotary_cos_sin(
            self.model_args.dim // self.model_args.n_heads, tokens.shape[1], tokens.device
        )
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


def build_model(args: argparse.Namespace) -> Transformer:
    """Builds the transformer from the command-line flags.

    Seeds the global RNG with ``args.seed`` first, so every rank (and every
    run) starts from identical weights before FSDP shards them.

    Args:
        args: parsed flags (``dim``, ``layers``, ``heads``, ``vocab``,
            ``seed``).
    """
    if args.dim % args.heads or (args.dim // args.heads) % 2:
        raise ValueError(
            f"--dim {args.dim} must split into --heads {args.heads} heads of even width"
        )
    torch.manual_seed(args.seed)
    model_args = ModelArgs(
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        vocab_size=args.vocab,
    )
    return Transformer(model_args)


# ---------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------


class SyntheticData:
    """Endless stream of micro-batches from a fixed noisy Markov chain.

    Token ``t+1`` is ``successor[t]`` with probability ``1 - noise`` and a
    uniformly random token otherwise. ``successor`` is a random permutation
    fixed by ``seed`` (identical on all ranks), so the data has structure to
    learn and the loss visibly falls within a few steps; uniformly random
    tokens would leave nothing to learn beyond ``log(vocab)``.

    Args:
        vocab_size: number of token ids.
        seq_len: tokens per sample fed to the model.
        batch_size: samples per micro-batch.
        seed: fixes the chain; the rank's samples come from ``seed + rank``.
        rank: this process's rank; each rank draws its own micro-batches.
        noise: probability of a random (unpredictable) next token.
    """

    def __init__(
        self,
        vocab_size: int,
        seq_len: int,
        batch_size: int,
        seed: int,
        rank: int,
        noise: float = 0.1,
    ):
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.noise = noise
        # Own generators: the data must not depend on how many random numbers
        # model construction happened to draw from the global RNG.
        self.successor = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))
        self.generator = torch.Generator().manual_seed(seed + rank)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(inputs, labels)``, each ``(batch_size, seq_len)`` int64;
        ``labels`` is ``inputs`` shifted left by one token."""
        n, g = self.seq_len + 1, self.generator
        tokens = torch.empty(self.batch_size, n, dtype=torch.long)
        tokens[:, 0] = torch.randint(self.vocab_size, (self.batch_size,), generator=g)
        random_tokens = torch.randint(self.vocab_size, (self.batch_size, n), generator=g)
        is_noise = torch.rand(self.batch_size, n, generator=g) < self.noise
        for t in range(1, n):
            tokens[:, t] = torch.where(
                is_noise[:, t], random_tokens[:, t], self.successor[tokens[:, t - 1]]
            )
        return tokens[:, :-1], tokens[:, 1:]


# ---------------------------------------------------------------------------
# Parallelism
# ---------------------------------------------------------------------------


def mixed_precision_policy(mixed_precision: str) -> MixedPrecisionPolicy:
    """FSDP2's policy for ``--mixed-precision``: ``"none"``, ``"bf16"`` (bf16
    compute, fp32 gradient reduction) or ``"bf16-reduce"`` (bf16 compute and
    gradient reduction)."""
    if mixed_precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if mixed_precision == "bf16-reduce":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    return MixedPrecisionPolicy()


def apply_fsdp(
    model: Transformer, mesh: DeviceMesh, mixed_precision: str, comm_buffers: str = "default"
) -> list[nn.Module]:
    """Shards ``model`` in place with FSDP2: each block, then the root;
    returns the FSDP modules (the blocks, then the root).

    On a 1-D mesh this is FSDP; on a 2-D (replicate, shard) mesh it is HSDP:
    parameters are sharded along the last dimension and replicated along the
    first, gradients are reduce-scattered over the shard group and then
    all-reduced over the replicate group.

    Args:
        model: the unsharded model, identical on every rank.
        mesh: 1-D or 2-D CPU device mesh.
        mixed_precision: see :func:`mixed_precision_policy`.
        comm_buffers: ``"fsdp"`` (FSDP2 allocates its all-gather and
            reduce-scatter buffers itself), ``"group"`` (from the process
            group: ``set_allocate_memory_from_process_group_for_comm``; on
            hsdp, CPU buffers its peers read directly, NCCL's pool on CUDA)
            or ``"default"`` (no call: FSDP2's own unless the module asks).
            ``"alternate"``:
            :func:`train` switches every step.
    """
    mp_policy = mixed_precision_policy(mixed_precision)
    layers = list(model.layers.values())
    for layer_id, block in enumerate(layers):
        # As in torchtitan: the last block's parameters are needed again right
        # at the start of backward, so resharding them after forward would
        # only be undone immediately.
        reshard_after_forward = layer_id < len(layers) - 1
        fully_shard(
            block, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward
        )
    # The root picks up what no block owns: embedding, final norm, output head.
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    modules = [*layers, model]
    if comm_buffers in ("fsdp", "group"):
        set_comm_buffers(modules, comm_buffers)
    return modules


def set_comm_buffers(modules: list[nn.Module], source: str) -> None:
    """Where the FSDP modules' next collectives get their buffers: ``"group"``
    (the process group's ``allocate_tensor``) or ``"fsdp"`` (FSDP2's own)."""
    for module in modules:
        module.set_allocate_memory_from_process_group_for_comm(source == "group")


# ---------------------------------------------------------------------------
# Training loop
# ---------------------------------------------------------------------------

# Short names for the per-step comm-stats line; ops not listed print in full.
_OP_ABBREV = {
    "all_gather_into_tensor": "ag",
    "all_gather_into_tensor_coalesced": "agc",
    "all_gather": "agl",
    "reduce_scatter_tensor": "rs",
    "reduce_scatter_tensor_coalesced": "rsc",
    "reduce_scatter": "rsl",
    "all_reduce": "ar",
    "all_reduce_coalesced": "arc",
    "all_reduce_bucketed": "arb",
    "broadcast": "bc",
    "barrier": "barrier",
}


def format_comm_stats(stats: dict[str, dict[str, int]]) -> str:
    """Renders ``hsdp_backend.comm_stats()`` compactly.

    Args:
        stats: ``{op_name: {"calls", "collectives", "bytes"}}``.

    Returns:
        e.g. ``"ag=10/10 rs=5/5 1.27MB"``: ``calls/collectives`` per op that
        ran, then the total bytes this rank contributed.
    """
    parts, total_bytes = [], 0
    for op in sorted(stats):
        counters = stats[op]
        if counters["calls"] == 0:
            continue
        parts.append(f"{_OP_ABBREV.get(op, op)}={counters['calls']}/{counters['collectives']}")
        total_bytes += counters["bytes"]
    parts.append(f"{total_bytes / 1e6:.2f}MB")
    return " ".join(parts)


def step_comm_stats(stats_groups: dict[str, dist.ProcessGroup]) -> dict[str, dict]:
    """hsdp's counters of each group since its last reset, the ops that ran.

    Returns:
        ``{label: {op_name: {"calls", "collectives", "bytes"}}}``.
    """
    return {
        label: {op: c for op, c in hsdp_backend.comm_stats(g).items() if c["calls"]}
        for label, g in stats_groups.items()
    }


def mean_across_ranks(value: torch.Tensor) -> torch.Tensor:
    """Averages a scalar tensor over all ranks (WORLD).

    Args:
        value: scalar tensor; not modified.
    """
    value = value.detach().float().clone()
    dist.all_reduce(value, op=dist.ReduceOp.AVG)
    return value


def train(
    args: argparse.Namespace, mesh: DeviceMesh, stats_groups: dict[str, dist.ProcessGroup]
) -> list[dict[str, float]]:
    """Builds, shards and trains the model; rank 0 logs every step.

    Args:
        args: parsed flags; ``args.json`` logs JSON lines instead of text.
        mesh: the FSDP (1-D) or HSDP (2-D) device mesh.
        stats_groups: label -> process group whose hsdp comm stats are
            reported each step; in the text line the label is omitted when
            there is one group. Ignored unless ``args.backend == "hsdp"``.

    Returns:
        Per step, what rank 0 prints (as one JSON object with ``--json``):
        step, loss (averaged over ranks), step_ms, fwd_bwd_ms, tokens_per_s
        (this rank's times) and, on hsdp, comm_stats (:func:`step_comm_stats`).
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    as_json = getattr(args, "json", False)
    # With --json, stdout carries the step objects only.
    prose = sys.stderr if as_json else sys.stdout
    device = (
        torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else None
    )
    model = build_model(args)
    if device is not None:
        model.to(device)  # the same weights as on CPU: built there from the seed
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        print(
            f"model: {n_params / 1e6:.2f}M params, dim={args.dim} layers={args.layers} "
            f"heads={args.heads} vocab={args.vocab}; mesh {mesh.mesh.tolist()} "
            f"{mesh.mesh_dim_names}; backend={args.backend} mp={args.mixed_precision}",
            file=prose,
            flush=True,
        )
    fsdp_modules = apply_fsdp(model, mesh, args.mixed_precision, args.comm_buffers)
    # Built after fully_shard so the optimizer holds the sharded DTensors.
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    data = SyntheticData(args.vocab, args.seq_len, args.batch_size, args.seed, rank)
    track_comms = args.backend == "hsdp"
    tokens_per_step = args.batch_size * args.seq_len * world_size

    loss_avg = float("nan")
    metrics: list[dict[str, float]] = []
    for step in range(1, args.steps + 1):
        buffers = args.comm_buffers
        if buffers == "alternate":
            # Odd steps on the group's buffers, even steps on FSDP2's: a
            # comparison of the two within one run, step by step.
            buffers = "group" if step % 2 else "fsdp"
            set_comm_buffers(fsdp_modules, buffers)
        shim = getattr(args, "fsdp_shim", "on")
        if shim == "alternate" and args.backend == "hsdp":
            # Two steps through hsdp's FSDP2 shim, two on FSDP2's native
            # reduction, and so on: the shim's gain within one run. The first
            # step after a switch settles (enable() proves the shim again).
            shim = "on" if (step - 1) // 2 % 2 == 0 else "off"
            if shim == "on" and not hsdp_backend.fsdp.is_enabled():
                hsdp_backend.fsdp.enable()
            elif shim == "off" and hsdp_backend.fsdp.is_enabled():
                hsdp_backend.fsdp.disable()
        inputs, labels = data.next_batch()
        if device is not None:
            inputs, labels = inputs.to(device), labels.to(device)
            torch.cuda.synchronize()  # a step's time starts with the GPU idle
        if track_comms:
            for group in stats_groups.values():
                hsdp_backend.reset_comm_stats(group)

        start = time.perf_counter()
        optimizer.zero_grad()
        logits = model(inputs)
        # fp32 loss even when the model computes in bf16.
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(0, 1))
        loss.backward()
        if device is not None:
            torch.cuda.synchronize()
        # Every collective of an FSDP2 step happens in forward and backward;
        # the optimizer step is local (over this rank's shard).
        fwd_bwd = time.perf_counter() - start
        optimizer.step()
        if device is not None:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start

        # Read before the logging all-reduce below so the counts show only
        # the training step's own collectives.
        comms = step_comm_stats(stats_groups) if track_comms else None
        loss_avg = mean_across_ranks(loss).item()
        m = {
            "step": step,
            "loss": loss_avg,
            "step_ms": elapsed * 1e3,
            "fwd_bwd_ms": fwd_bwd * 1e3,
            "tokens_per_s": tokens_per_step / elapsed,
            "comm_buffers": buffers,
            "fsdp_shim": shim if args.backend == "hsdp" else "off",
            # this rank's peak resident memory so far (Linux: KiB)
            "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        }
        if comms is not None:
            m["comm_stats"] = comms
        metrics.append(m)
        if rank == 0:
            print(json.dumps(m) if as_json else format_step(m), flush=True)
    if rank == 0:
        print(f"final loss {loss_avg:.6f}", file=prose, flush=True)
    return metrics


def format_step(m: dict) -> str:
    """The readable line of one step's metrics (see :func:`train`)."""
    comms = ""
    if "comm_stats" in m:
        rendered = {label: format_comm_stats(s) for label, s in m["comm_stats"].items()}
        if len(rendered) == 1:
            comms = "  " + next(iter(rendered.values()))
        else:
            comms = "".join(f"  {label}[{text}]" for label, text in rendered.items())
    return (
        f"step {m['step']:3d}  loss {m['loss']:.6f}  {m['step_ms']:8.1f} ms  "
        f"fwd+bwd {m['fwd_bwd_ms']:8.1f} ms  {m['tokens_per_s']:8.0f} tok/s{comms}"
    )


# ---------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------


def get_parser(description: str = __doc__) -> argparse.ArgumentParser:
    """Flags shared by train_fsdp.py and train_hsdp.py.

    Defaults give a ~1.4M-parameter model whose 20 steps take seconds on two
    CPU ranks.
    """
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--backend",
        default="hsdp",
        help="process-group backend, e.g. hsdp or gloo; fake: torch's fake backend (no "
        "communication at all: the zero-cost-network limit of the same ranks; losses are "
        "meaningless)",
    )
    parser.add_argument("--steps", type=int, default=20, help="training steps")
    parser.add_argument("--dim", type=int, default=128, help="model width")
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--vocab", type=int, default=2048, help="vocabulary size")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sample")
    parser.add_argument("--batch-size", type=int, default=8, help="samples per rank per step")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    parser.add_argument(
        "--mixed-precision",
        choices=("none", "bf16", "bf16-reduce"),
        default="none",
        help="bf16: bf16 parameters/compute with fp32 gradient reduction; "
        "bf16-reduce: gradients reduced in bf16 too",
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds the weights and the data")
    parser.add_argument(
        "--comm-buffers",
        choices=("default", "fsdp", "group", "alternate"),
        default="default",
        help="where FSDP2's all-gather and reduce-scatter buffers come from: fsdp (its own), "
        "group (the process group's allocate_tensor; on hsdp, memory its peers read directly) or "
        "default (no call: FSDP2's own); alternate: "
        "group on odd steps, fsdp on even ones (a paired comparison in one run)",
    )
    parser.add_argument(
        "--fsdp-shim",
        choices=("on", "off", "alternate"),
        default="on",
        help="on hsdp: on, hsdp's FSDP2 shim (one division, bucketed replicate all-reduces); "
        "off, FSDP2's native reduction path (HSDP_FSDP=off); alternate: two steps on, two off, "
        "and so on (a paired comparison in one run)",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the model and the collectives run; cuda: one GPU per rank (LOCAL_RANK), "
        "the mesh on cuda (hsdp serves it through its inner NCCL)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object per step on stdout (step, loss, step_ms, fwd_bwd_ms, "
        "tokens_per_s, and on hsdp comm_stats) instead of the readable line",
    )
    parser.add_argument(
        "--flush-denormal",
        action="store_true",
        help="torch.set_flush_denormal(True): what benchmarks set in every run, so the "
        "garbage a fake all-gather leaves in parameters cannot slow one run's arithmetic",
    )
    return parser


def init_distributed(args: argparse.Namespace, timeout: datetime.timedelta | None = None) -> None:
    """The default process group on ``args.backend`` (rendezvous from
    torchrun's env), with ``timeout`` or torch's default."""
    if args.flush_denormal:
        torch.set_flush_denormal(True)
    if getattr(args, "fsdp_shim", "on") == "off":
        os.environ["HSDP_FSDP"] = "off"  # read when the first hsdp group is created
    if args.device == "cuda":
        # One GPU per rank; ranks beyond the GPUs share them (scripts/gpu_check.sh --ranks).
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    if args.backend == "fake":
        # Every rank does all of FSDP2's own work and no communication.
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group(
            "fake",
            store=FakeStore(),
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
        )
    else:
        dist.init_process_group(backend=args.backend, timeout=timeout)


def run_fsdp(args: argparse.Namespace) -> None:
    mesh = init_device_mesh(args.device, (dist.get_world_size(),), mesh_dim_names=("fsdp",))
    train(args, mesh, {"fsdp": mesh.get_group("fsdp")})


def shut_down() -> None:
    """Destroys the process groups, then frees what still references them.

    DeviceMesh and DTensor keep groups in reference cycles. Left to the
    collector that runs while the interpreter exits, a Gloo group is torn
    down then, and Gloo's transport thread, finding Python finalizing, takes
    the whole process down ("terminate called without an active exception",
    about one run in ten on 2 cores). Collected here, it goes down cleanly.
    """
    dist.destroy_process_group()
    gc.collect()


def main() -> None:
    args = get_parser().parse_args()
    init_distributed(args)
    try:
        run_fsdp(args)
    finally:
        shut_down()


if __name__ == "__main__":
    main()
