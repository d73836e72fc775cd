"""The peers suite's rows, tables and figure (benchmarks/peers.py measures).

A peer's ratio is always taken against hsdp measured in the same launch
(the same processes, interleaved), never across launches; the ``hsdp us``
column is hsdp in the main launch (with gloo and DeepSpeed).
"""

from __future__ import annotations

from benchmarks import collectives, report, timing
from benchmarks.peer_env import MPI_PEERS
from benchmarks.peers import CHECK_NAME, IN_RUN_MEMCPY, IN_RUN_REDUCE, POOL
from benchmarks.report import KIB, Column, format_size

PEER_LABEL = {"gloo": "gloo", "ompi": "ompi", "mpich": "mpich", "deepspeed": "ds"}
# The 1-rank launch's contenders (peers.py: _floors).
FLOOR_CONTENDERS = ("hsdp", "hsdp_no_recorder", "torch")


def _peer_status(config: dict, launches: dict) -> dict:
    """Per wanted peer at one world size: measured, or missing with the reason."""
    out = {}
    for peer in config["peers_wanted"]:
        info = config["peers"][peer]
        source = launches.get(peer if peer in MPI_PEERS else "main")
        if not info["available"]:
            out[peer] = {"status": "missing", "reason": info["reason"]}
        elif source is None or "failed" in source:
            out[peer] = {"status": "missing", "reason": (source or {}).get("failed", "not run")}
        elif peer in source["problems"]:
            out[peer] = {"status": "missing", "reason": source["problems"][peer]}
        else:
            out[peer] = {"status": "measured", "checked": True}
            if peer in MPI_PEERS:
                out[peer]["library"] = source.get("library")
    return out


def build_rows(config: dict, reference: dict, per_world: dict) -> tuple[list[dict], dict]:
    """One row per (world, op, size): times, ratios, memcpy fractions; and
    the peer status per world."""
    rows, status = [], {}
    for world, data in sorted(per_world.items()):
        launches = data["launches"]
        st = status[str(world)] = _peer_status(config, launches)
        points = {
            name: {(p["op"], p["bytes"]): p for p in launch["points"]}
            for name, launch in launches.items()
            if "points" in launch
        }
        for p in launches["main"]["points"]:
            op, nbytes = p["op"], p["bytes"]
            cop = collectives.OPS[CHECK_NAME[op]]
            total = cop.total_bytes(nbytes, world)
            hsdp_us = p["us"]["hsdp"]["us"]
            busbw = cop.bus_factor(world) * total / (hsdp_us / 1e6) / 1e9
            mc1, mc2 = reference["memcpy1"][nbytes], reference["memcpy2"][nbytes]
            mcr_us = p["us"][IN_RUN_MEMCPY]["us"]
            mcr_gbps = nbytes / (mcr_us / 1e6) / 1e9
            row = {
                "world": world,
                "op": op,
                "bytes_per_rank": nbytes,
                "numel_per_rank": p["numel"],
                "hsdp": dict(p["us"]["hsdp"], busbw_gbps=busbw),
                POOL: p["us"].get(POOL),
                "peers": {},
                "memcpy1_us": mc1["us"],
                "memcpy2_us": mc2["us"],
                "memcpy1_gbps": mc1["gbps"],
                "memcpy2_gbps": mc2["gbps"],
                "hsdp_memcpy1_fraction": busbw / mc1["gbps"],
                "hsdp_memcpy2_fraction": busbw / mc2["gbps"],
                "memcpy_in_run_us": mcr_us,
                "memcpy_in_run_gbps": mcr_gbps,
                "hsdp_memcpy_in_run_fraction": busbw / mcr_gbps,
                "reduce_in_run_us": (p["us"].get(IN_RUN_REDUCE) or {}).get("us"),
                "spread": max(timing.spread(r["rank0_samples_us"]) for r in p["us"].values()),
                "by_launch": {
                    name: {c: r["us"] for c, r in pts[(op, nbytes)]["us"].items()}
                    for name, pts in points.items()
                    if (op, nbytes) in pts
                },
            }
            for peer in config["peers_wanted"]:
                row["peers"][peer] = _peer_cell(peer, op, nbytes, st[peer], points)
            rows.append(row)
    return rows, status


def _peer_cell(peer: str, op: str, nbytes: int, st: dict, points: dict) -> dict:
    if st["status"] != "measured":
        return {"status": "missing", "reason": st["reason"]}
    if peer == "deepspeed" and op != "all_reduce":
        return {"status": "n/a", "reason": "DeepSpeed's shm op is all-reduce only"}
    pt = points[peer if peer in MPI_PEERS else "main"].get((op, nbytes))
    if pt is None or peer not in pt["us"]:
        return {"status": "missing", "reason": "not measured at this point"}
    us, hsdp_us = pt["us"][peer]["us"], pt["us"]["hsdp"]["us"]
    pool = pt["us"].get(POOL)
    return {
        # time(peer) / time(hsdp on pool buffers), same launch
        "pool_speedup_vs": us / pool["us"] if pool else None,
        "status": "measured",
        "checked": True,
        "us": us,
        "hsdp_us_same_launch": hsdp_us,
        "speedup_vs": us / hsdp_us,  # time(peer) / time(hsdp): > 1 means hsdp is faster
        "spread": timing.spread(pt["us"][peer]["rank0_samples_us"]),
        "reps": pt["us"][peer]["reps"],
        "calls_per_sample": pt["us"][peer]["calls_per_sample"],
    }


def _us_cell(peer: str):
    def cell(r: dict) -> str:
        c = r["peers"].get(peer)
        if c is None:
            return ""
        return (
            f"{c['us']:.1f}"
            if c["status"] == "measured"
            else "-"
            if c["status"] == "n/a"
            else "missing"
        )

    return cell


def _ratio_cell(peer: str):
    def cell(r: dict) -> str:
        c = r["peers"].get(peer)
        if c is None:
            return ""
        return (
            f"{c['speedup_vs']:.2f}"
            if c["status"] == "measured"
            else "-"
            if c["status"] == "n/a"
            else "missing"
        )

    return cell


def _pool_ratio_cell(peer: str):
    def cell(r: dict) -> str:
        c = r["peers"].get(peer)
        if c is None or c["status"] != "measured" or c.get("pool_speedup_vs") is None:
            return "-"
        return f"{c['pool_speedup_vs']:.2f}"

    return cell


def columns(peers: list[str]) -> list[Column]:
    cols = [
        Column("op", 18, lambda r: r["op"], left=True),
        Column("size", 7, lambda r: format_size(r["bytes_per_rank"])),
        Column("hsdp us", 9, lambda r: f"{r['hsdp']['us']:.1f}"),
        Column("pool us", 9, lambda r: f"{r[POOL]['us']:.1f}" if r.get(POOL) else "-"),
    ]
    cols += [Column(f"{PEER_LABEL[p]} us", 9, _us_cell(p)) for p in peers]
    cols += [
        Column("mc1 us", 8, lambda r: f"{r['memcpy1_us']:.1f}"),
        Column("mc2 us", 8, lambda r: f"{r['memcpy2_us']:.1f}"),
    ]
    cols += [Column(f"vs {PEER_LABEL[p]}", 7, _ratio_cell(p)) for p in peers]
    cols += [
        Column(f"pool vs {PEER_LABEL[p]}", 11, _pool_ratio_cell(p))
        for p in peers
        if p != "deepspeed"
    ]
    cols += [
        Column("hsdp/mc2", 8, lambda r: f"{r['hsdp_memcpy2_fraction']:.3f}"),
        Column("mcR us", 8, lambda r: f"{r['memcpy_in_run_us']:.1f}"),
        Column("hsdp/mcR", 8, lambda r: f"{r['hsdp_memcpy_in_run_fraction']:.3f}"),
        Column("rdR us", 8, lambda r: _us(r["reduce_in_run_us"])),
        Column("hsdp/rdR", 8, lambda r: _over_reduce(r, r["hsdp"])),
        Column("pool/rdR", 8, lambda r: _over_reduce(r, r.get(POOL))),
        Column("spread", 6, lambda r: f"{100 * r['spread']:.0f}%"),
    ]
    return cols


def _us(us) -> str:
    return "-" if us is None else f"{us:.1f}"


def _over_reduce(row: dict, contender) -> str:
    limit = row["reduce_in_run_us"]
    return "-" if limit is None or not contender else f"{contender['us'] / limit:.2f}"


LEGEND = """
us = max over ranks of each rank's median per-call time (float32, per-rank size);
hsdp us is hsdp in the main launch (with gloo and DeepSpeed); ompi / mpich ran in their own
launch, interleaved with hsdp and gloo in the same processes;
vs X = time(X) / time(hsdp in X's launch): > 1 means hsdp is faster; pool us = hsdp on
buffers from allocate_tensor (its shared-memory pool), main launch; pool vs X = time(X) /
time(hsdp on pool buffers in X's launch);
mc1 / mc2 = single-thread memcpy of the per-rank size, 1 process / 2 concurrent processes
(mc2 = the slower process); hsdp/mc2 = hsdp busbw (nccl-tests) / memcpy2 per-process GB/s;
mcR = memcpy2 measured inside the main launch, interleaved with the collectives (every rank
copies its per-rank size at once: caches as cold as theirs); hsdp/mcR = hsdp busbw / its GB/s;
rdR = reduce_scatter's zero-communication limit in the main launch (every rank sums world
private rows of its per-rank size into one with hsdp's own kernel, storing as its
reduce-scatter does: one pass over the bytes a one-pass reduce-scatter moves); hsdp/rdR,
pool/rdR = time / that limit (the most any buffer scheme could gain over hsdp is hsdp/rdR);
'-' = not applicable (DeepSpeed's shm op is all-reduce only); missing: see the reasons below;
spread = interquartile range / median of rank 0's samples, the noisiest contender of the main
launch."""


def print_tables(config, reference, per_world, rows, status) -> None:
    mc = [
        {"bytes": n, "us1": m["us"], "gb1": m["gbps"], **reference["memcpy2"][n]}
        for n, m in sorted(reference["memcpy1"].items())
    ]
    report.print_table(
        [
            Column("size", 8, lambda m: format_size(m["bytes"])),
            Column("mc1 us", 10, lambda m: f"{m['us1']:.2f}"),
            Column("mc1 GB/s", 8, lambda m: f"{m['gb1']:.2f}"),
            Column("mc2 us", 10, lambda m: f"{m['us']:.2f}"),
            Column("mc2 GB/s", 8, lambda m: f"{m['gbps']:.2f}"),
        ],
        mc,
        title="memcpy (float32, 1 thread per process; mc2: 2 processes at once, per process):",
    )
    peers = config["peers_wanted"]
    for world, data in sorted(per_world.items()):
        report.print_table(
            columns(peers),
            [r for r in rows if r["world"] == world],
            title=f"world size {world} (float32):",
        )
        for peer, st in status[str(world)].items():
            if st["status"] != "measured":
                print(f"  {peer}: missing: {st['reason']}")
            elif st.get("library"):
                print(f"  {peer}: {st['library']}")
    floor = next(iter(per_world.values()))["floor"] if per_world else {}
    us = {name: floor[name]["us"] if name in floor else float("nan") for name in FLOOR_CONTENDERS}
    print(
        f"\n1-rank all_reduce 8 B (per-call floor): hsdp {us['hsdp']:.2f} us, hsdp without its "
        f"flight recorder {us['hsdp_no_recorder']:.2f} us, torch's fake backend (does nothing) "
        f"{us['torch']:.2f} us: hsdp - torch = {us['hsdp'] - us['torch']:.2f} us"
    )
    print(LEGEND)


def plot(section: dict, path: str) -> None:
    ops = section["ops"]
    rows = [r for r in section["results"] if r["bytes_per_rank"] >= KIB]
    worlds = sorted({r["world"] for r in rows})
    peers = list(section["peers"])
    title = "hsdp vs peers: time(peer) / time(hsdp), > 1 = hsdp faster; and hsdp / memcpy2"
    with report.figure(path, len(ops) + 1, title, panel_size=(4.8, 4.2)) as axes:
        colors = report.colors()
        styles = ["o-", "s--", "^:", "d-."]
        for ax, op in zip(axes, ops, strict=False):
            for w_i, world in enumerate(worlds):
                sel = [r for r in rows if r["op"] == op and r["world"] == world]
                for p_i, peer in enumerate(peers):
                    pts = [
                        (r["bytes_per_rank"], r["peers"][peer]["speedup_vs"])
                        for r in sel
                        if r["peers"][peer]["status"] == "measured"
                    ]
                    if pts:
                        ax.plot(
                            *zip(*pts, strict=True),
                            styles[w_i % len(styles)],
                            color=colors[p_i % len(colors)],
                            label=f"vs {peer} W={world}",
                        )
            ax.axhline(1.0, color="black", lw=0.8)
            _size_axis(ax, [r["bytes_per_rank"] for r in rows if r["op"] == op])
            ax.set_yscale("log")
            ax.set_title(op)
            ax.set_ylabel("time(peer) / time(hsdp)")
            ax.legend(fontsize="x-small")
        ax = axes[-1]
        for o_i, op in enumerate(ops):
            for w_i, world in enumerate(worlds):
                sel = [r for r in rows if r["op"] == op and r["world"] == world]
                if sel:
                    ax.plot(
                        [r["bytes_per_rank"] for r in sel],
                        [r["hsdp_memcpy2_fraction"] for r in sel],
                        styles[w_i % len(styles)],
                        color=colors[o_i % len(colors)],
                        label=f"{op} W={world}",
                    )
                    ax.plot(
                        [r["bytes_per_rank"] for r in sel],
                        [r["hsdp_memcpy_in_run_fraction"] for r in sel],
                        "x:",
                        color=colors[o_i % len(colors)],
                        label=f"{op} W={world} (in run)",
                    )
        _size_axis(ax, [r["bytes_per_rank"] for r in rows])
        ax.set_title("hsdp busbw / memcpy2 GB/s (x: memcpy2 in the run)")
        ax.legend(fontsize="x-small")


def _size_axis(ax, sizes) -> None:
    ticks = sorted(set(sizes))
    if not ticks:
        ax.set_axis_off()
        return
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [report.short_size(t) for t in ticks])
    ax.set_xlabel("bytes per rank")
    ax.grid(True, which="both", alpha=0.3)
