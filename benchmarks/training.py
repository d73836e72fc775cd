"""The FSDP2 training step end to end: the example scripts under torchrun on
hsdp and on gloo, against the same script on 1 rank (default 2 and 4 ranks).

``examples/train_fsdp.py`` on 2 ranks (``--ranks 2``) and ``train_hsdp.py
--replicate 2 --shard 2`` on 4 ranks (``--ranks 4``), each for a "small"
model (10.6 M parameters, bandwidth-bound) and a "tiny" one (66 k
parameters in 11 FSDP groups, latency-bound). Every run is ``python -m
torch.distributed.run`` with ``OMP_NUM_THREADS=1``, a free ``--master-port``
and a per-run timeout; the script runs with ``--json`` and the parent reads
rank 0's per-step JSON objects (never its prose), drops the first
``--warmup`` steps (3) and takes the median over the remaining steps of all
``--repeats`` runs.

All of FSDP2's communication happens in forward + backward (the optimizer
step is local), so the exposed communication is forward + backward on W
ranks minus the same on a compute-only baseline: W independent 1-rank
copies of ``train_fsdp.py`` running at once (FSDP2 issues no collectives on
one rank), which compete for cores and memory bandwidth as the W ranks do.
Runs are interleaved: per repeat and model the baseline, then hsdp and gloo
per configuration, odd repeats in reverse order. Reported per
(configuration, model): the step time on 1 rank, gloo and hsdp; exposed
communication per backend; gloo exposed / hsdp exposed (target >= 5 for the
small model); communication share = exposed / step; the hsdp speedup of the
whole step; hsdp's ``comm_stats`` of the last step. Two more contenders run
the same configuration: torch's fake backend (no communication: the
limit) and ``hsdp_pool``, hsdp with FSDP2's buffers from the process group on
every other step (``--comm-buffers alternate``: odd steps on the group's buffers,
even steps on FSDP2's own), reported as the median over the run's pairs of
steps of pool step / the next step without: a paired comparison, which run-to-run
noise (process placement, the other ranks) does not blur. With more ranks than
cpus the ranks' compute slows down, the baseline under-estimates it and
exposed communication includes that slowdown (a printed caveat).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from benchmarks import report, timing
from benchmarks.suite import BACKENDS, BenchFailure, Suite
from tools.ranks import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name -> the scripts' model flags. FSDP2 groups = layers + 1 (each block and
# the root, as in apply_fsdp).
MODELS: dict[str, dict[str, int]] = {
    # 10.6 M parameters (8.2 M of them outside the embedding): bandwidth-bound.
    "small": {"dim": 256, "layers": 8, "heads": 8, "vocab": 8192},
    # 66 k parameters in 11 groups: every collective is a latency.
    "tiny": {"dim": 16, "layers": 10, "heads": 2, "vocab": 768},
}
QUICK_MODELS = ("tiny",)
# Steps per run (default, --quick), warm-up included.
STEPS = {"small": (12, 6), "tiny": (20, 8)}
# Steps dropped from the start of each run (lazy init, first allocations).
WARMUP_STEPS = 3
# Runs per (configuration, backend) (default, --quick).
REPEATS = (2, 1)
# Tokens per rank per step: batch x seq-len; a small-model step takes a few
# hundred ms on one core.
SEQ_LEN = 64
BATCH_SIZE = 2
# gloo exposed / hsdp exposed should be at least this for the small model.
TARGET_RATIO = 5.0
# Wall-clock limit of one torchrun (capped by what is left of --timeout).
RUN_TIMEOUT_S = 600.0
# How long torchrun gets to stop its workers after SIGTERM.
STOP_GRACE_S = 40.0
# FSDP2 issues no collectives on a 1-rank mesh (unshard and reduce are local
# copies), so the backend of the baseline does not matter; gloo, the neutral one.
BASELINE_BACKEND = "gloo"
# Each configuration runs on these; "fake" is torch's fake backend: the same
# W ranks do all of FSDP2's own work and no communication at all, the step's
# zero-cost-network limit (the examples' --backend fake).
# "hsdp_pool" is hsdp with FSDP2's communication buffers from the group
# (set_allocate_memory_from_process_group_for_comm, buffers in hsdp's
# shared-memory pool) on odd steps and FSDP2's own on even steps (the
# examples' --comm-buffers alternate).
POOL = "hsdp_pool"
# "hsdp_native" is hsdp with its FSDP2 shim on odd steps and off on even
# steps (the examples' --fsdp-shim alternate; off: FSDP2's native reduction
# path on the same groups).
NATIVE = "hsdp_native"
TRAINING_BACKENDS = (*BACKENDS, "fake", POOL, NATIVE)
# hsdp's targets against that limit: (hsdp - fake) / (gloo - fake) at most
# this, and on the small model hsdp / fake at most LIMIT_RATIO_TARGET.
OVERHEAD_TARGET = 1 / 6
LIMIT_RATIO_TARGET = 1.15


@dataclass(frozen=True)
class TrainingMesh:
    """One configuration: the example script and its world size."""

    name: str  # key in the JSON
    label: str  # in the tables
    world: int
    script: str  # in examples/
    extra: tuple[str, ...] = ()  # script flags
    copies: int = 1  # independent runs started at once (the baseline: W copies of 1 rank)


MESHES = (
    TrainingMesh("fsdp_2", "FSDP 2", 2, "train_fsdp.py"),
    TrainingMesh("hsdp_2x2", "HSDP 2x2", 4, "train_hsdp.py", ("--replicate", "2", "--shard", "2")),
)
BASELINE_SCRIPT = "train_fsdp.py"


def baseline(mesh: TrainingMesh) -> TrainingMesh:
    """The compute-only baseline of ``mesh``: ``mesh.world`` concurrent
    1-rank runs (FSDP2 issues no collectives on one rank)."""
    return TrainingMesh(
        f"1_rank_x{mesh.world}", f"1 rank x{mesh.world}", 1, BASELINE_SCRIPT, copies=mesh.world
    )


def example_module(examples: str):
    """The example ``train_fsdp`` module (model, comm-stats rendering)."""
    if examples not in sys.path:
        sys.path.insert(0, examples)
    import train_fsdp

    return train_fsdp


def param_counts(examples: str, models: dict[str, dict[str, int]]) -> dict[str, int]:
    """Exact parameter count of each model, built on the meta device from the
    example's own ``Transformer``."""
    import torch

    train_fsdp = example_module(examples)
    counts = {}
    for model, a in models.items():
        with torch.device("meta"):
            net = train_fsdp.Transformer(
                train_fsdp.ModelArgs(
                    dim=a["dim"], n_layers=a["layers"], n_heads=a["heads"], vocab_size=a["vocab"]
                )
            )
        counts[model] = sum(p.numel() for p in net.parameters())
    return counts


def parse_steps(stdout: str) -> dict:
    """Rank 0's ``--json`` output: per-step ms and losses, the last step's
    hsdp comm stats (None on other backends) and the final loss. Raises
    ValueError when no step object is there."""
    steps = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    if not steps:
        raise ValueError("no JSON step objects on stdout (was the script run with --json?)")
    return {
        "step_ms": [s["step_ms"] for s in steps],
        "fwd_bwd_ms": [s["fwd_bwd_ms"] for s in steps],
        "losses": [s["loss"] for s in steps],
        "tokens_per_s": [s["tokens_per_s"] for s in steps],
        "comm_buffers": [s.get("comm_buffers", "fsdp") for s in steps],
        "fsdp_shim": [s.get("fsdp_shim", "off") for s in steps],
        "comm_stats_last_step": steps[-1].get("comm_stats"),
        "max_rss_mib": max(s.get("max_rss_mib", 0.0) for s in steps),
        "final_loss": steps[-1]["loss"],
    }


def _stop_torchrun(proc: subprocess.Popen) -> None:
    """SIGTERM to torchrun (it stops its workers, which live in their own
    sessions), SIGKILL to its process group if it does not exit in time."""
    if proc.poll() is not None:
        return
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(5)


def run_torchrun(cmd: list[str], env: dict, timeout_s: float) -> tuple[int | None, str, str]:
    """Runs ``cmd`` in its own session; ``(returncode or None on timeout, stdout, stderr)``.

    torchrun is stopped on timeout and on any exception here (Ctrl-C, SIGTERM).
    """
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # Ctrl-C reaches the parent only; it stops torchrun
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        _stop_torchrun(proc)
        try:  # workers that outlived torchrun would hold the pipes open
            out, err = proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            out, err = "", "(output not collected: pipes still held open)"
        return None, out or "", err or ""
    finally:
        _stop_torchrun(proc)


TABLE_COLUMNS = [
    report.Column("mesh", 8, lambda r: r["mesh_label"], left=True),
    report.Column("model", 5, lambda r: r["model"], left=True),
    report.Column("params", 7, lambda r: report.format_params(r["params"])),
    report.Column("compute", 8, lambda r: f"{r['baseline']['fwd_bwd_ms']:.1f}"),
    report.Column("gloo f+b", 8, lambda r: f"{r['gloo']['fwd_bwd_ms']:.1f}"),
    report.Column("hsdp f+b", 8, lambda r: f"{r['hsdp']['fwd_bwd_ms']:.1f}"),
    report.Column("gloo exp", 8, lambda r: f"{r['gloo']['exposed_ms']:.1f}"),
    report.Column("hsdp exp", 8, lambda r: f"{r['hsdp']['exposed_ms']:.1f}"),
    report.Column("gloo/hsdp exp", 13, lambda r: _ratio(r["exposed_ratio_gloo_over_hsdp"])),
    report.Column("gloo share", 10, lambda r: f"{100 * r['gloo']['comm_share']:.0f}%"),
    report.Column("hsdp share", 10, lambda r: f"{100 * r['hsdp']['comm_share']:.0f}%"),
    report.Column("gloo step", 9, lambda r: f"{r['gloo']['step_ms']:.1f}"),
    report.Column("hsdp step", 9, lambda r: f"{r['hsdp']['step_ms']:.1f}"),
    report.Column("speedup", 7, lambda r: f"{r['speedup']:.2f}x"),
    report.Column("fake step", 9, lambda r: f"{r['fake']['step_ms']:.1f}"),
    report.Column("hsdp/fake", 9, lambda r: f"{r['hsdp_over_fake']:.2f}x"),
    report.Column("overhead", 8, lambda r: _overhead(r["overhead_vs_gloo"])),
    report.Column("pool step", 9, lambda r: f"{r[POOL]['step_ms']:.1f}"),
    report.Column("pool/off", 8, lambda r: f"{r['pool_over_off']:.2f}x"),
    report.Column("quartiles", 11, lambda r: "{:.2f}-{:.2f}".format(*r["pool_over_off_quartiles"])),
    report.Column("pool/fake", 9, lambda r: f"{r['pool_over_fake']:.2f}x"),
    report.Column("native step", 11, lambda r: f"{r[NATIVE]['step_ms']:.1f}"),
    report.Column("native/shim", 11, lambda r: f"{r['native_over_shim']:.3f}x"),
    report.Column(
        "quartiles", 11, lambda r: "{:.2f}-{:.2f}".format(*r["native_over_shim_quartiles"])
    ),
    report.Column(
        "runs", 11, lambda r: "{:.3f}-{:.3f}".format(*_range(r["native_over_shim_per_run"]))
    ),
    report.Column(
        "rss hsdp/native",
        15,
        lambda r: f"{r['hsdp']['max_rss_mib']:.0f}/{r[NATIVE]['max_rss_mib']:.0f}",
    ),
    report.Column(
        "loss hsdp/native",
        17,
        lambda r: f"{r['hsdp']['final_loss']:.4f}/{r[NATIVE]['final_loss']:.4f}",
    ),
    report.Column("spread", 6, lambda r: f"{100 * r['spread']:.0f}%"),
]
LEGEND = """
compute = forward + backward of the same script on 1 rank, W copies running at once (no
collectives, the same competition for cores); gloo f+b, hsdp f+b = rank 0's forward +
backward on W ranks, where FSDP2 does all its communication; fake step = the step on torch's
fake backend (the same W ranks, no communication: the zero-cost-network limit); hsdp/fake =
hsdp step / fake step; overhead = (hsdp step - fake step) / (gloo step - fake step), hsdp's
cost above the limit as a fraction of gloo's; exp = exposed communication =
f+b - compute; gloo/hsdp exp = gloo exp / hsdp exp; share = exp / step; step = forward +
backward + optimizer step (local, over this rank's shard); speedup = gloo step / hsdp step;
hsdp = hsdp's defaults (on these CPU meshes FSDP2's buffers come from the groups' pools);
pool step = hsdp with FSDP2's buffers from the group (hsdp's shared-memory pool), on the odd
steps of runs that alternate (--comm-buffers alternate); pool/off = median over those runs'
pairs of steps of pool step / the next step (FSDP2's buffers, < 1: the pool is faster), with
its quartiles; pool/fake =
pool step / fake step; native step = hsdp with its FSDP2 shim off (FSDP2's native reduction
on the same groups) in runs that alternate two steps each way (--fsdp-shim alternate; the
first step after a switch not counted); native/shim = median over those runs' pairs of steps
of native step / the next counted step (through the shim, > 1: the shim is faster), its
quartiles and the range of its per-run medians; rss =
rank 0's peak resident MiB, hsdp/native; loss = the last step's loss on each; spread =
interquartile range / median of the pooled steps, the noisiest contender."""


def _range(values: list[float]) -> tuple[float, float]:
    return min(values), max(values)


def _overhead(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def _ratio(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f}x"


class TrainingSuite(Suite):
    name = "training"
    help = (
        "FSDP2 training step (examples/train_fsdp.py, train_hsdp.py) under torchrun on hsdp "
        "and on gloo, against the same script on 1 rank"
    )
    output_stem = "bench_training"
    quick_help = "tiny model only, 8 steps, 1 run per backend"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group(
            "configurations (--ranks: "
            + ", ".join(f"{m.world} = {m.label}" for m in MESHES)
            + "; the 1-rank baseline always runs)"
        )
        g.add_argument(
            "--examples",
            default=os.path.join(ROOT, "examples"),
            metavar="DIR",
            help="the example scripts (default: the repository's examples/)",
        )
        g.add_argument(
            "--models",
            default=None,
            metavar="M[,M...]",
            help=f"subset of {','.join(MODELS)} (default: all; --quick: {','.join(QUICK_MODELS)})",
        )
        g.add_argument(
            "--steps",
            type=int,
            default=None,
            metavar="N",
            help="training steps per run, --warmup of them dropped (default: "
            + ", ".join(f"{m} {n[0]}" for m, n in STEPS.items())
            + "; --quick: "
            + ", ".join(f"{m} {n[1]}" for m, n in STEPS.items())
            + ")",
        )
        g.add_argument(
            "--warmup",
            type=int,
            default=WARMUP_STEPS,
            metavar="N",
            help="steps dropped from the start of each run (default: %(default)s)",
        )
        g.add_argument(
            "--repeats",
            type=int,
            default=None,
            metavar="N",
            help=f"runs per configuration and backend, interleaved (default: {REPEATS[0]}; "
            f"--quick: {REPEATS[1]})",
        )
        g.add_argument(
            "--seq-len",
            type=int,
            default=SEQ_LEN,
            metavar="N",
            help="tokens per sample (default: %(default)s)",
        )
        g.add_argument(
            "--batch-size",
            type=int,
            default=BATCH_SIZE,
            metavar="N",
            help="samples per rank per step (default: %(default)s)",
        )
        g.add_argument(
            "--seed", type=int, default=0, metavar="S", help="the scripts' --seed (default: 0)"
        )

    def configure(self, args: argparse.Namespace) -> dict:
        examples = os.path.abspath(args.examples)
        missing = [
            s
            for s in {BASELINE_SCRIPT, *(m.script for m in MESHES)}
            if not os.path.isfile(os.path.join(examples, s))
        ]
        if missing:
            raise ValueError(f"{', '.join(sorted(missing))} not found in {examples} (--examples)")
        known = {m.world: m for m in MESHES}
        unknown = [w for w in args.ranks if w not in known]
        if unknown:
            raise ValueError(
                f"training suite: no configuration for world size(s) {unknown}; choose from "
                + ", ".join(f"{w} ({m.label})" for w, m in known.items())
            )
        meshes = [m for m in MESHES if m.world in args.ranks]
        if args.models:
            models = []
            for item in args.models.split(","):
                item = item.strip().lower()
                if item not in MODELS:
                    raise ValueError(f"unknown model {item!r}; choose from {', '.join(MODELS)}")
                if item not in models:
                    models.append(item)
        else:
            models = list(QUICK_MODELS if args.quick else MODELS)
        steps = {
            m: args.steps if args.steps is not None else STEPS[m][1 if args.quick else 0]
            for m in models
        }
        for m, n in steps.items():
            if args.warmup < 0 or n - args.warmup < 1:
                raise ValueError(
                    f"{m} model: --steps {n} leaves no measured step after --warmup {args.warmup}"
                )
        repeats = args.repeats if args.repeats is not None else REPEATS[1 if args.quick else 0]
        if repeats < 1:
            raise ValueError("--repeats must be >= 1")
        if args.seq_len < 1 or args.batch_size < 1:
            raise ValueError("--seq-len and --batch-size must be >= 1")
        return {
            "examples": examples,
            "models": models,
            "model_args": {m: dict(MODELS[m]) for m in models},
            "params": param_counts(examples, {m: MODELS[m] for m in models}),
            "meshes": meshes,
            "steps": steps,
            "warmup_steps": args.warmup,
            "repeats": repeats,
            "seq_len": args.seq_len,
            "batch_size": args.batch_size,
            "seed": args.seed,
            "baseline_backend": BASELINE_BACKEND,
        }

    @staticmethod
    def _plan(config: dict) -> list[tuple[int, str, TrainingMesh, str]]:
        """``(repeat, model, mesh, backend)`` in run order.

        Per repeat and model, per configuration: its baseline, then hsdp and
        gloo; odd repeats run the same list backwards, so no contender always
        goes first (as the other suites alternate).
        """
        plan = []
        for rep in range(config["repeats"]):
            for model in config["models"]:
                seq = []
                for mesh in config["meshes"]:
                    seq.append((baseline(mesh), config["baseline_backend"]))
                    seq += [(mesh, b) for b in TRAINING_BACKENDS]
                if rep % 2:
                    seq.reverse()
                plan += [(rep, model, mesh, b) for mesh, b in seq]
        return plan

    @staticmethod
    def _command(config: dict, model: str, mesh: TrainingMesh, backend: str) -> list[str]:
        a = config["model_args"][model]
        flags = {
            "--backend": "hsdp" if backend in (POOL, NATIVE) else backend,
            "--steps": config["steps"][model],
            "--dim": a["dim"],
            "--layers": a["layers"],
            "--heads": a["heads"],
            "--vocab": a["vocab"],
            "--seq-len": config["seq_len"],
            "--batch-size": config["batch_size"],
            "--mixed-precision": "none",
            "--seed": config["seed"],
        }
        if backend == POOL:
            flags["--comm-buffers"] = "alternate"
        if backend == NATIVE:
            flags["--fsdp-shim"] = "alternate"
            # A pair takes four steps (two each way, the first of each settling).
            flags["--steps"] = max(flags["--steps"], config["warmup_steps"] + 5)
        script = os.path.join(config["examples"], mesh.script)
        args = [str(x) for kv in flags.items() for x in kv]
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(mesh.world),
            "--master-port",
            str(free_port()),
            script,
            *args,
            "--json",
            # Every run alike: a fake all-gather leaves garbage in parameters,
            # and denormals in it must not slow that run's arithmetic alone.
            "--flush-denormal",
            *mesh.extra,
        ]

    def run_all(
        self, config: dict, ranks: list[int], env: dict, deadline: float, verbose: bool
    ) -> tuple[dict[int, Any], dict[int, str], dict[int, float]]:
        # OMP_NUM_THREADS=1 everywhere, the 1-rank baseline included, so it
        # computes as one rank of W does (an explicit --env may override).
        run_env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
        plan = self._plan(config)
        per_world: dict[int, Any] = {}
        wall: dict[int, float] = {}
        for i, (rep, model, mesh, backend) in enumerate(plan):
            time_left = deadline - time.monotonic()
            if time_left <= 0:
                raise BenchFailure(f"no time left for run {i + 1} of {len(plan)} (see --timeout)")
            what = f"{model} model, {mesh.label}, {backend}"
            print(
                f"[{i + 1}/{len(plan)}] repeat {rep + 1}/{config['repeats']}: {what} "
                f"({config['steps'][model]} steps)...",
                flush=True,
            )
            cmds = [self._command(config, model, mesh, backend) for _ in range(mesh.copies)]
            t0 = time.monotonic()
            # Copies start together (one thread each waits on its torchrun).
            with concurrent.futures.ThreadPoolExecutor(len(cmds)) as pool:
                finished = list(
                    pool.map(
                        lambda c: run_torchrun(c, run_env, min(RUN_TIMEOUT_S, time_left)), cmds
                    )
                )
            elapsed = time.monotonic() - t0
            copies = []
            for cmd, (rc, out, err) in zip(cmds, finished, strict=True):
                if rc != 0:
                    why = "timed out" if rc is None else f"exited with code {rc}"
                    raise BenchFailure(
                        f"{what}: torchrun {why} after {elapsed:.1f} s\ncommand: {' '.join(cmd)}\n"
                        f"--- stdout (end) ---\n{out[-3000:].rstrip()}\n"
                        f"--- stderr (end) ---\n{err[-4000:].rstrip()}"
                    )
                try:
                    copies.append(parse_steps(out))
                except ValueError as exc:
                    raise BenchFailure(
                        f"{what}: {exc}\ncommand: {' '.join(cmd)}\n--- stdout ---\n{out[-3000:]}"
                    ) from None
                if verbose:
                    for line in out.splitlines():
                        print(f"  {line}", file=sys.stderr, flush=True)
            parsed = copies[0]
            warm = config["warmup_steps"]
            measured = [ms for c in copies for ms in c["step_ms"][warm:]]
            measured_fwd_bwd = [ms for c in copies for ms in c["fwd_bwd_ms"][warm:]]
            # An alternating contender: its samples are the steps of one kind
            # (POOL: on the group's buffers; NATIVE: without the shim), each
            # over the next step of the other kind, a pair. NATIVE's first
            # step after each switch settles (the shim proves itself again
            # before it): neither a sample nor in a pair.
            paired = {POOL: ("comm_buffers", "group", "fsdp"), NATIVE: ("fsdp_shim", "off", "on")}
            if backend in paired:
                key, mine, other = paired[backend]
                kinds = [
                    "settling" if backend == NATIVE and i and k != c[key][i - 1] else k
                    for c in copies
                    for i, k in enumerate(c[key])
                    if i >= warm
                ]
                counted = [i for i, k in enumerate(kinds) if k != "settling"]
                pairs = [
                    measured[i] / measured[j]
                    for i, j in zip(counted, counted[1:])
                    if (kinds[i], kinds[j]) == (mine, other)
                ]
                measured_fwd_bwd = [ms for ms, k in zip(measured_fwd_bwd, kinds) if k == mine]
                measured = [ms for ms, k in zip(measured, kinds) if k == mine]
                if not pairs:
                    raise BenchFailure(f"{what}: no pair of steps with {key} {mine} and {other}")
            if not measured:
                raise BenchFailure(
                    f"{what}: {len(parsed['step_ms'])} steps, none after the {warm} warm-up steps"
                )
            run = {
                "model": model,
                "mesh": mesh.name,
                "world": mesh.world,
                "backend": backend,
                "repeat": rep,
                "command": cmds[0],
                "wall_s": elapsed,
                "copies": mesh.copies,
                "measured_ms": measured,
                "measured_fwd_bwd_ms": measured_fwd_bwd,
                "median_ms": statistics.median(measured),
                "median_fwd_bwd_ms": statistics.median(measured_fwd_bwd),
                **({"pairs": pairs} if backend in paired else {}),
                **parsed,
            }
            print(
                f"    median {run['median_ms']:.1f} ms, fwd+bwd {run['median_fwd_bwd_ms']:.1f} ms "
                f"over {len(measured)} steps (run {elapsed:.1f} s)",
                flush=True,
            )
            per_world.setdefault(mesh.world, []).append(run)
            wall[mesh.world] = wall.get(mesh.world, 0.0) + elapsed
        return per_world, {}, wall

    def report(self, config: dict, reference: dict, per_world: dict[int, Any]) -> dict:
        runs = [r for _, rs in sorted(per_world.items()) for r in rs]

        def runs_of(model: str, mesh: str, backend: str) -> list[dict]:
            return [
                r for r in runs if (r["model"], r["mesh"], r["backend"]) == (model, mesh, backend)
            ]

        def pooled(model: str, mesh: str, backend: str, key: str = "measured_ms") -> list[float]:
            return [ms for r in runs_of(model, mesh, backend) for ms in r[key]]

        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        models = {
            m: {
                **config["model_args"][m],
                "params": config["params"][m],
                "fsdp_groups": config["model_args"][m]["layers"] + 1,
                "steps": config["steps"][m],
            }
            for m in config["models"]
        }
        base_backend = config["baseline_backend"]
        rows = []
        for mesh in config["meshes"]:
            for m in config["models"]:
                base = baseline(mesh)
                base_samples = pooled(m, base.name, base_backend, "measured_fwd_bwd_ms")
                base_ms = statistics.median(base_samples)
                row = {
                    "mesh": mesh.name,
                    "mesh_label": mesh.label,
                    "world": mesh.world,
                    "script": mesh.script,
                    "model": m,
                    "params": models[m]["params"],
                    "fsdp_groups": models[m]["fsdp_groups"],
                    "oversubscribed": mesh.world > (cpus or 1),
                    "baseline": {
                        "backend": base_backend,
                        "copies": base.copies,
                        "step_ms": statistics.median(pooled(m, base.name, base_backend)),
                        "fwd_bwd_ms": base_ms,
                        "spread": timing.spread(base_samples),
                        "steps_measured": len(base_samples),
                    },
                }
                for b in TRAINING_BACKENDS:
                    samples = pooled(m, mesh.name, b, "measured_fwd_bwd_ms")
                    step = statistics.median(pooled(m, mesh.name, b))
                    fwd_bwd = statistics.median(samples)
                    exposed = fwd_bwd - base_ms
                    row[b] = {
                        "step_ms": step,
                        "fwd_bwd_ms": fwd_bwd,
                        "exposed_ms": exposed,
                        "comm_share": exposed / step,
                        "spread": timing.spread(samples),
                        "steps_measured": len(samples),
                        "per_run_median_ms": [r["median_ms"] for r in runs_of(m, mesh.name, b)],
                        "final_loss": runs_of(m, mesh.name, b)[-1]["final_loss"],
                        "max_rss_mib": max(r["max_rss_mib"] for r in runs_of(m, mesh.name, b)),
                    }
                h, g, f = row["hsdp"], row["gloo"], row["fake"]
                row["exposed_ratio_gloo_over_hsdp"] = (
                    g["exposed_ms"] / h["exposed_ms"] if h["exposed_ms"] > 0 else None
                )
                row["speedup"] = g["step_ms"] / h["step_ms"]
                pairs = [x for r in runs_of(m, mesh.name, POOL) for x in r["pairs"]]
                row["pool_over_off"] = statistics.median(pairs)
                row["pool_over_off_pairs"] = len(pairs)
                row["pool_over_off_quartiles"] = timing.quartiles(pairs)
                row["pool_over_fake"] = row[POOL]["step_ms"] / f["step_ms"]
                # Native step over the shim's step after it: > 1, the shim is faster.
                pairs = [x for r in runs_of(m, mesh.name, NATIVE) for x in r["pairs"]]
                row["native_over_shim"] = statistics.median(pairs)
                row["native_over_shim_quartiles"] = timing.quartiles(pairs)
                row["native_over_shim_per_run"] = [
                    statistics.median(r["pairs"]) for r in runs_of(m, mesh.name, NATIVE)
                ]
                row["hsdp_over_fake"], row["overhead_vs_gloo"] = timing.against_limit(
                    h["step_ms"], g["step_ms"], f["step_ms"]
                )
                row["spread"] = max(row[k]["spread"] for k in ("baseline", *TRAINING_BACKENDS))
                row["hsdp_comm_stats_last_step"] = runs_of(m, mesh.name, "hsdp")[-1][
                    "comm_stats_last_step"
                ]
                rows.append(row)

        self._print_table(config, models, rows)
        print(LEGEND)
        print()
        format_comm_stats = example_module(config["examples"]).format_comm_stats
        for r in rows:
            # The same work on both backends: at fp32 the losses agree.
            stats = r["hsdp_comm_stats_last_step"] or {}
            shown = "  ".join(f"{label}[{format_comm_stats(s)}]" for label, s in stats.items())
            print(
                f"{r['mesh_label']} {r['model']}: hsdp comm_stats, last step, rank 0: "
                f"{shown or '(none reported)'}; final loss hsdp "
                f"{r['hsdp']['final_loss']} / gloo {r['gloo']['final_loss']}"
            )
        verdicts = []
        for r in rows:
            over = r["overhead_vs_gloo"]
            met = over is not None and over <= OVERHEAD_TARGET
            shown = "n/a (gloo at or below the limit)" if over is None else f"{over:.2f}"
            line = (
                f"{r['mesh_label']} {r['model']}: hsdp/fake {r['hsdp_over_fake']:.2f}x, overhead "
                f"(hsdp - fake) / (gloo - fake) {shown}, target <= 1/6 {'met' if met else 'NOT met'}"
            )
            verdict = {"mesh": r["mesh"], "model": r["model"], "overhead_target_met": met}
            if r["model"] == "small":
                near = r["hsdp_over_fake"] <= LIMIT_RATIO_TARGET
                line += (
                    f"; hsdp/fake target <= {LIMIT_RATIO_TARGET}x {'met' if near else 'NOT met'}"
                )
                verdict["limit_ratio_target_met"] = near
            print(line)
            verdicts.append(verdict)
        for r in rows:
            if r["model"] != "small":
                continue
            ratio = r["exposed_ratio_gloo_over_hsdp"]
            met = ratio is not None and ratio >= TARGET_RATIO
            verdicts.append({"mesh": r["mesh"], "model": r["model"], "target_met": met})
            shown = "n/a (hsdp exposed <= 0)" if ratio is None else f"{ratio:.1f}x"
            print(
                f"{r['mesh_label']} small: gloo exposed / hsdp exposed {shown}, target >= "
                f"{TARGET_RATIO:g}x {'met' if met else 'NOT met'}"
            )
        caveats = self._caveats(config, cpus)
        for c in caveats:
            print(c)
        return {
            "examples": config["examples"],
            "models": models,
            "meshes": [dataclasses.asdict(m) for m in config["meshes"]],
            "baselines": [dataclasses.asdict(baseline(m)) for m in config["meshes"]],
            "baseline_backend": base_backend,
            "seq_len": config["seq_len"],
            "batch_size": config["batch_size"],
            "mixed_precision": "none",
            "seed": config["seed"],
            "warmup_steps": config["warmup_steps"],
            "repeats": config["repeats"],
            "omp_num_threads": 1,
            "cpus": cpus,
            "target_exposed_ratio_small": TARGET_RATIO,
            "target_overhead_vs_gloo": OVERHEAD_TARGET,
            "target_hsdp_over_fake_small": LIMIT_RATIO_TARGET,
            "results": rows,
            "verdicts": verdicts,
            "caveats": caveats,
            "runs": runs,
        }

    @staticmethod
    def _caveats(config: dict, cpus: int | None) -> list[str]:
        caveats = []
        for mesh in config["meshes"]:
            if mesh.world > (cpus or 1):
                caveats.append(
                    f"caveat: {mesh.label} runs {mesh.world} ranks on {cpus} cpus; its baseline runs "
                    f"{mesh.world} 1-rank copies at once, so compute is slowed alike, but a rank "
                    f"waiting in a collective also waits for descheduled peers: exposed "
                    f"communication includes scheduling delays a machine with a core per rank "
                    f"would not have"
                )
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
        if load > (cpus or 1) / 2:
            caveats.append(
                f"caveat: load average {load:.1f} on {cpus} cpus at the end: other processes "
                "competed for the cores; the interleaving spreads that over both backends, "
                "absolute times are noisy"
            )
        return caveats

    @staticmethod
    def _print_table(config: dict, models: dict, rows: list[dict]) -> None:
        lines = [
            f"training step, rank 0, ms (median of the steps after {config['warmup_steps']} "
            f"warm-up steps of each run, {config['repeats']} run(s) per backend and "
            f"configuration, interleaved; fp32, seq-len {config['seq_len']}, batch "
            f"{config['batch_size']} per rank, OMP_NUM_THREADS=1):"
        ]
        for m, a in models.items():
            lines.append(
                f"  {m}: {report.format_params(a['params'])} params ({a['params']} exact), "
                f"dim {a['dim']}, {a['layers']} layers, {a['heads']} heads, vocab {a['vocab']}, "
                f"{a['fsdp_groups']} FSDP groups, {a['steps']} steps per run"
            )
        report.print_table(TABLE_COLUMNS, rows, title="\n".join(lines))

    def plot(self, section: dict, path: str) -> None:
        models = list(section["models"])
        title = (
            f"FSDP2 training step, hsdp vs gloo (seq-len {section['seq_len']}, batch "
            f"{section['batch_size']} per rank, fp32)"
        )
        with report.figure(path, len(models), title) as axes:
            colors = report.colors()
            for ax, m in zip(axes, models, strict=True):
                rows = [r for r in section["results"] if r["model"] == m]
                width = 0.25
                for i, r in enumerate(rows):
                    base = r["baseline"]["fwd_bwd_ms"]
                    ax.bar(
                        i - width,
                        base,
                        width,
                        color="grey",
                        label="compute (1-rank copies)" if i == 0 else None,
                    )
                    for k, b in enumerate(BACKENDS):
                        # The backend's compute part, then its exposed communication on top.
                        x, step, c = i + k * width, r[b]["fwd_bwd_ms"], colors[k]
                        ax.bar(x, min(base, step), width, color=c, label=b if i == 0 else None)
                        if step > base:
                            ax.bar(
                                x,
                                step - base,
                                width,
                                bottom=base,
                                color=c,
                                alpha=0.4,
                                hatch="//",
                                label=f"{b} exposed comm" if i == 0 else None,
                            )
                    # The limit: the same ranks' forward + backward without communication.
                    ax.hlines(
                        r["fake"]["fwd_bwd_ms"],
                        i - 1.5 * width,
                        i + 1.5 * width,
                        colors="black",
                        linestyles="dashed",
                        label="fake backend (no communication)" if i == 0 else None,
                    )
                    top = max(r[b]["fwd_bwd_ms"] for b in BACKENDS)
                    ax.annotate(
                        f"exposed gloo/hsdp {_ratio(r['exposed_ratio_gloo_over_hsdp'])}",
                        (i + width / 2, top),
                        ha="center",
                        va="bottom",
                        fontsize="small",
                    )
                ax.set_xticks(range(len(rows)), [r["mesh_label"] for r in rows])
                ax.set_xlim(-0.75, len(rows) - 0.25)
                ax.set_ylim(top=1.35 * max(r[b]["fwd_bwd_ms"] for r in rows for b in BACKENDS))
                ax.set_ylabel("forward + backward, rank 0, ms (median)")
                a = section["models"][m]
                ax.set_title(
                    f"{m} model ({report.format_params(a['params'])} params, "
                    f"{a['fsdp_groups']} FSDP groups)"
                )
                ax.grid(True, axis="y", alpha=0.3)
                ax.legend(fontsize="small")


SUITE = TrainingSuite()
