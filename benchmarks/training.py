"""The FSDP2 training step end to end on hsdp, against gloo and the no-communication limit:
each rank builds every contender in one process and steps them interleaved, round by round.

    python -m benchmarks training [--ranks 2,4] [--models tiny,small] [--steps N] [--warmup N]

Meshes: 2 ranks, 1-D FSDP; 4 ranks, HSDP 2x2 (replicate 2 x shard 2, shard groups [0, 1] and
[2, 3]), as examples/train_fsdp.py and train_hsdp.py. Models: that example's transformer in fp32,
"tiny" (66 k parameters in 11 FSDP groups: every collective a latency) and "small" (10.6 M:
bandwidth-bound). Each contender is its own copy of the same weights, FSDP2 wrapping, optimizer:

  hsdp         the default group's backend with its defaults (hsdp's FSDP2 shim on)
  gloo         the same mesh on gloo groups
  fake         torch's fake backend: FSDP2's own work and no communication, the step's
               zero-cost-network limit (its losses mean nothing)
  hsdp_pool    hsdp, FSDP2's buffers from the group (set_allocate_memory_from_process_group_for_
               comm) on even rounds, FSDP2's own on odd rounds
  hsdp_native  hsdp with the shim off (hsdp_backend.fsdp.disable(): FSDP2's native reduction)

The hsdp contenders share hsdp's groups (the shim sizes a backward's buckets from the last one on
the group); gloo and fake have their own, each mesh its own dimension names (DTensor takes meshes
of equal ranks and names for one). Each round every contender makes one training step on the
round's batch, after a barrier, in the order above on even rounds and reversed on odd ones, so
noise hits all alike. hsdp_native ends an even round and starts the next: the shim is disabled
before that pair of steps and enabled after it (enable() proves it again), and after each switch
one more hsdp copy of the model, never timed, makes a forward and backward (its gradients
dropped), where the switch's first-step costs land: every contender's steps are timed alike. The first --warmup rounds are not
counted.

Checked on every rank after every round, before the next: round 0's losses of hsdp, gloo,
hsdp_pool and hsdp_native are bit-equal (only all-gathers ran before); later, hsdp_pool's is
hsdp's bit for bit (buffers move no arithmetic), so is hsdp_native's on 1-D FSDP (the shim leaves
FSDP2's reduce-scatter alone; under HSDP native divides twice: rel 1e-5), gloo's within rel 1e-5.
A difference fails the run, naming the rank, the contender and the round.

Reported per (mesh, model): each contender's step (the maximum over ranks of each rank's median
of its counted steps; hsdp_pool's on the group's buffers); gloo/hsdp; hsdp/fake; overhead =
(hsdp - fake) / (gloo - fake), hsdp's cost above the limit as a share of gloo's; exposed
communication = step - fake's; native/shim = median over counted rounds of hsdp_native's step /
hsdp's in the round, pool/off = median over counted even rounds of hsdp_pool's step / its next
(a round's step: the maximum over ranks), with quartiles and pair counts; hsdp's and hsdp_native's
comm_stats of their last step (rank 0). The JSON holds every rank's time of every step. Every
rank sets torch.set_flush_denormal(True), as the suite always did: denormals in the garbage a
fake all-gather leaves must not slow its arithmetic alone.
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.testing._internal.distributed.fake_pg  # noqa: F401  registers the "fake" backend
from torch.distributed.device_mesh import DeviceMesh

import hsdp_backend
import hsdp_backend.fsdp
from benchmarks import common
from examples import train_fsdp as ex

# name -> examples.train_fsdp's model flags; FSDP2 groups = layers + 1 (each block, the root).
MODELS: dict[str, dict[str, int]] = {
    "small": {"dim": 256, "layers": 8, "heads": 8, "vocab": 8192},  # 10.6 M parameters
    "tiny": {"dim": 16, "layers": 10, "heads": 2, "vocab": 768},  # 66 k parameters
}
QUICK_MODELS = ("tiny",)
STEPS = {"small": (16, 8), "tiny": (40, 10)}  # rounds (default, --quick), warm-up included
WARMUP_STEPS = 3
# Tokens per rank and step: batch x seq-len (a small-model step: a few hundred ms on one core).
SEQ_LEN, BATCH_SIZE = 64, 2
SEED, LR, WEIGHT_DECAY = 0, 3e-3, 0.1  # examples/train_fsdp.py's
SETUP = {"batch_size": BATCH_SIZE, "seed": SEED, "lr": LR, "weight_decay": WEIGHT_DECAY}
POOL, NATIVE = "hsdp_pool", "hsdp_native"
CONTENDERS = ("hsdp", "gloo", "fake", POOL, NATIVE)  # NATIVE last: a pair of rounds' boundary
RTOL = 1e-5  # fp32 losses of differently rounded reductions
MESHES = {2: ("fsdp_2", "FSDP 2"), 4: ("hsdp_2x2", "HSDP 2x2")}  # world -> (name, label)


class Contender:
    """One FSDP2 wrapping of the model on ``mesh``, its optimizer and its steps."""

    def __init__(self, mesh: DeviceMesh, spec: argparse.Namespace, comm_buffers: str = "default"):
        self.model = ex.build_model(spec)
        self.params = sum(p.numel() for p in self.model.parameters())
        self.modules = ex.apply_fsdp(self.model, mesh, "none", comm_buffers)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY
        )
        self.ms: list[float] = []
        self.losses: list[float] = []

    def loss(self, batch) -> torch.Tensor:
        inputs, labels = batch
        return F.cross_entropy(self.model(inputs).flatten(0, 1), labels.flatten(0, 1))

    def step(self, batch) -> None:
        """One timed training step (FSDP2 communicates in forward and backward, then the
        optimizer steps over this rank's shard)."""
        start = time.perf_counter()
        self.optimizer.zero_grad()
        loss = self.loss(batch)
        loss.backward()
        self.optimizer.step()
        self.ms.append((time.perf_counter() - start) * 1e3)
        self.losses.append(loss.item())

    def settle(self, batch) -> None:
        """A forward and backward that leave the weights as they are."""
        self.loss(batch).backward()
        self.optimizer.zero_grad()


def mesh_of(backend: str, ranks: common.Ranks) -> DeviceMesh:
    """``backend``'s mesh over all ranks: 1-D on 2 ranks, else (replicate 2, shard W/2)."""
    prefix = "" if backend == "hsdp" else f"{backend}_"
    if ranks.world == 2:
        made = {"hsdp": dist.group.WORLD, "gloo": ranks.gloo}
        group = made[backend] if backend in made else dist.new_group(backend=backend)
        return DeviceMesh.from_group(group, "cpu", mesh_dim_names=(prefix + "fsdp",))
    layout = torch.arange(ranks.world).view(2, -1)
    mine = []
    for dim in (layout.T, layout):  # replicate groups are the columns, shard groups the rows
        for members in dim.tolist():
            group = dist.new_group(members, backend=backend)
            if ranks.rank in members:
                mine.append(group)
    names = (prefix + "replicate", prefix + "shard")
    return DeviceMesh.from_group(mine, "cpu", mesh=layout, mesh_dim_names=names)


def check(ranks: common.Ranks, model: str, r: int, cs: dict[str, Contender], hsdp_1d: bool):
    """This round's losses against hsdp's (see the module's docstring)."""
    want = cs["hsdp"].losses[r]
    if not math.isfinite(want):
        ranks.fail(f"{model} model, hsdp, step {r}", f"loss {want}, expected a finite one")
    for name in ("gloo", POOL, NATIVE):
        got = cs[name].losses[r]
        exact = r == 0 or name == POOL or (name == NATIVE and hsdp_1d)
        bad = got != want if exact else not abs(got - want) <= RTOL * abs(want)
        if bad:
            how = "bit for bit" if exact else f"within rel {RTOL:g}"
            ranks.fail(
                f"{model} model, {name}, step {r}", f"loss {got!r}, expected hsdp's {want!r} {how}"
            )


def train(ranks: common.Ranks, model: str, steps: int, args, meshes) -> dict:
    """Builds the contenders, steps them round by round, checks each round; returns this rank's
    step times and losses, the model's parameter count, hsdp's and native's last comm_stats."""
    spec = argparse.Namespace(**MODELS[model], seed=SEED)
    cs = {c: Contender(meshes[c if c in ("gloo", "fake") else "hsdp"], spec) for c in CONTENDERS}
    settler = Contender(meshes["hsdp"], spec)  # never timed: a switch's first step lands on it
    if not hsdp_backend.fsdp.is_enabled():
        ranks.fail("hsdp_backend.fsdp", "the FSDP2 shim is not installed (see its warning)")
    hsdp_mesh = meshes["hsdp"]
    stats_groups = {d: hsdp_mesh.get_group(d) for d in hsdp_mesh.mesh_dim_names}
    data = ex.SyntheticData(spec.vocab, args.seq_len, BATCH_SIZE, SEED, ranks.rank)
    stats = {}
    for r in range(steps):
        batch = data.next_batch()
        for name in CONTENDERS if r % 2 == 0 else CONTENDERS[::-1]:
            c = cs[name]
            if name == POOL:
                ex.set_comm_buffers(c.modules, "fsdp" if r % 2 else "group")
            if name == NATIVE and r % 2 == 0:  # a pair of native steps begins
                hsdp_backend.fsdp.disable()
                settler.settle(batch)
            last = name in ("hsdp", NATIVE) and r == steps - 1
            for g in stats_groups.values() if last else ():
                hsdp_backend.reset_comm_stats(g)
            dist.barrier(group=ranks.gloo)
            c.step(batch)
            if last:
                stats[name] = ex.step_comm_stats(stats_groups)
            if name == NATIVE and (r % 2 or r == steps - 1):  # the pair ends
                if not hsdp_backend.fsdp.enable():
                    ranks.fail("hsdp_backend.fsdp.enable()", "the shim did not install again")
                settler.settle(batch)
        check(ranks, model, r, cs, hsdp_mesh.ndim == 1)
    ranks.log(f"{model}: {steps} rounds, losses checked")
    mine = {n: {"ms": c.ms, "losses": c.losses} for n, c in cs.items()}
    return {"contenders": mine, "params": cs["hsdp"].params, "comm_stats": stats}


def paired(row: dict, key: str, ratios: list[float]) -> None:
    q = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
    row[key] = statistics.median(ratios)
    row[f"{key}_quartiles"] = [q[0], q[2]]
    row[f"{key}_pairs"] = len(ratios)


def summarize(every: list[dict], model: str, steps: int, warmup: int, world: int) -> dict:
    """One row from every rank's ``train`` (see the module's docstring)."""
    mine = every[0]
    row = {
        "mesh": MESHES[world][0],
        "mesh_label": MESHES[world][1],
        "world": world,
        "model": model,
        "params": mine["params"],
        "fsdp_groups": MODELS[model]["layers"] + 1,
        "steps": steps,
        "warmup": warmup,
    }
    round_ms = {}
    for name in CONTENDERS:
        per_rank = [e["contenders"][name]["ms"] for e in every]
        counted = [r for r in range(warmup, steps) if name != POOL or r % 2 == 0]
        medians = [statistics.median(ms[r] for r in counted) for ms in per_rank]
        round_ms[name] = [max(times) for times in zip(*per_rank)]
        row[name] = {
            "step_ms": max(medians),
            "per_rank_median_ms": medians,
            "counted_rounds": counted,
            "step_ms_per_rank": per_rank,  # [rank][round]
            "final_losses": [e["contenders"][name]["losses"][-1] for e in every],
        }
    h, g, f = (row[c]["step_ms"] for c in ("hsdp", "gloo", "fake"))
    for name in CONTENDERS:
        row[name]["exposed_ms"] = row[name]["step_ms"] - f
    row["speedup"] = g / h
    row["hsdp_over_fake"] = h / f
    row["overhead_vs_gloo"] = (h - f) / (g - f) if g > f else None
    native, hsdp, pool = round_ms[NATIVE], round_ms["hsdp"], round_ms[POOL]
    paired(row, "native_over_shim", [native[r] / hsdp[r] for r in range(warmup, steps)])
    pool_pairs = [pool[r] / pool[r + 1] for r in range(warmup, steps - 1) if r % 2 == 0]
    paired(row, "pool_over_off", pool_pairs)
    row["hsdp_comm_stats_last_step"] = mine["comm_stats"]["hsdp"]
    row["native_comm_stats_last_step"] = mine["comm_stats"][NATIVE]
    return row


def _params(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}k"


def _quartiles(key: str):
    return lambda r: "{:.2f}-{:.2f}".format(*r[f"{key}_quartiles"])


COLUMNS = [
    common.Column("mesh", lambda r: r["mesh_label"]),
    common.Column("model", lambda r: r["model"]),
    common.Column("params", lambda r: _params(r["params"])),
    *(
        common.Column(f"{c.removeprefix('hsdp_')} ms", lambda r, c=c: r[c]["step_ms"])
        for c in CONTENDERS
    ),
    common.Column("gloo/hsdp", lambda r: f"{r['speedup']:.2f}x"),
    common.Column("hsdp/fake", lambda r: f"{r['hsdp_over_fake']:.2f}x"),
    common.Column(
        "overhead",
        lambda r: "n/a" if r["overhead_vs_gloo"] is None else f"{r['overhead_vs_gloo']:.2f}",
    ),
    common.Column("hsdp exp", lambda r: r["hsdp"]["exposed_ms"]),
    common.Column("gloo exp", lambda r: r["gloo"]["exposed_ms"]),
    common.Column("native/shim", lambda r: f"{r['native_over_shim']:.3f}x"),
    common.Column("quartiles", _quartiles("native_over_shim")),
    common.Column("pool/off", lambda r: f"{r['pool_over_off']:.3f}x"),
    common.Column("quartiles", _quartiles("pool_over_off")),
]
LEGEND = """\
ms = median training step (forward + backward + optimizer), max over ranks; fake = no communication
(the limit); overhead = (hsdp - fake) / (gloo - fake); exp = step - fake step; native/shim = hsdp
without / with its FSDP2 shim, pool/off = FSDP2's buffers from the group / its own: medians of paired
steps (< 1: the first is faster), with their quartiles."""


def main() -> None:
    p = common.parser(__doc__, sampling=False)
    p.add_argument("--warmup", type=int, default=None, metavar="N",
                   help="rounds not counted (default %d)" % WARMUP_STEPS)  # fmt: skip
    p.add_argument(
        "--models",
        default=None,
        metavar="M[,M...]",
        help=f"of {', '.join(MODELS)} (default: all; --quick: {', '.join(QUICK_MODELS)})",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        metavar="N",
        help=f"rounds, the first --warmup ({WARMUP_STEPS}) not counted (default, full/--quick: "
        + ", ".join(f"{m} {a}/{b}" for m, (a, b) in STEPS.items())
        + ")",
    )
    p.add_argument("--seq-len", type=int, default=SEQ_LEN, metavar="N", help="tokens per sample")
    args = p.parse_args()
    models = (args.models or ",".join(QUICK_MODELS if args.quick else MODELS)).split(",")
    if unknown := [m for m in models if m not in MODELS]:
        p.error(f"unknown model(s) {unknown}; choose from {', '.join(MODELS)}")
    warmup = WARMUP_STEPS if args.warmup is None else args.warmup
    steps = {m: STEPS[m][args.quick] if args.steps is None else args.steps for m in models}
    for m, n in steps.items():
        if warmup < 0 or not any(r % 2 == 0 for r in range(warmup, n - 1)):
            p.error(f"{m}: --steps {n} and --warmup {warmup} leave no counted pair of rounds")
    torch.set_flush_denormal(True)
    ranks = common.init(args)
    if ranks.world not in MESHES:
        ranks.fail("training", f"no mesh for {ranks.world} ranks; one for {list(MESHES)}")
    meshes = {b: mesh_of(b, ranks) for b in ("hsdp", "gloo", "fake")}
    rows = []
    for m in models:
        every = [None] * ranks.world
        dist.all_gather_object(every, train(ranks, m, steps[m], args, meshes), group=ranks.gloo)
        rows.append(summarize(every, m, steps[m], warmup, ranks.world))
        gc.collect()  # the contenders' reference cycles, between models
    notes = [LEGEND] + [
        f"{r['mesh_label']} {r['model']}: hsdp's last step on rank 0 "
        + " ".join(
            f"{k}[{ex.format_comm_stats(v)}]" for k, v in r["hsdp_comm_stats_last_step"].items()
        )
        for r in rows
    ]
    extra = {"models": {m: MODELS[m] for m in models}, "seq_len": args.seq_len, **SETUP}
    common.emit("training", args, ranks, COLUMNS, rows, notes, extra)
    ex.shut_down()


if __name__ == "__main__":
    main()
