"""The benchmark's peers suite in its smallest form: every peer runs or is reported missing with
its reason.

The benchmark's ``peers`` suite in its smallest form: 2 ranks, one size,
all_reduce only, with whatever peers this machine has. The peers are
opt-in (scripts/setup_peers.sh), so on a clean machine every peer but gloo
is missing: the suite must still run and say why, never drop a peer.

`python -m benchmarks peers` in its smallest form (2 ranks, one size, all_reduce): with whatever
peers the machine has, every peer that cannot run reported as missing with the reason, never
dropped; the 1-rank floors measured (hsdp, hsdp without its flight recorder, torch's fake
backend), each finite and positive (no order: `fake` hands back a Work that Python waits for,
hsdp's synchronous call returns none)."""

import json
import math
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
PEERS = ("gloo", "ompi", "mpich", "deepspeed")
FLOORS = ("all_reduce_8B", "all_reduce_8B_no_recorder", "torch_all_reduce_8B")


def test_peers_suite_smallest(tmp_path):
    out_json = tmp_path / "peers.json"
    cmd = [
        sys.executable,
        "-m",
        "benchmarks",
        "peers",
        "--quick",
        "--ranks",
        "2",
        "--ops",
        "all_reduce,reduce_scatter",
        "--sizes",
        "64K",
        "--iters",
        "3",
        "--warmup",
        "1",
        "--timeout",
        "100",
        "--json",
        str(out_json),
        "--plot",
        "",
    ]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert "vs gloo" in proc.stdout, proc.stdout

    section = json.loads(out_json.read_text())["peers"]
    assert set(section["peers"]) == set(PEERS)
    status = section["peer_status_by_world"]["2"]
    for peer in PEERS:
        st = status[peer]
        if st["status"] == "missing":
            assert st["reason"], (peer, st)
            assert f"{peer}: missing: " in proc.stdout
        else:
            assert st == {**st, "status": "measured", "checked": True}, (peer, st)
    assert status["gloo"]["status"] == "measured"  # gloo ships with torch

    rows = section["results"]
    assert [(r["op"], r["bytes_per_rank"]) for r in rows] == [
        ("all_reduce", 8),
        ("all_reduce", 65536),
        ("reduce_scatter", 65536),
    ]
    # hsdp on pool buffers: measured where FSDP2 allocates buffers, and each
    # measured MPI peer's ratio to it taken in that peer's own launch.
    assert rows[2]["hsdp_pool"]["us"] > 0, rows[2]
    assert all(r["hsdp_pool"] is None for r in rows[:2])
    # The reduce-scatter's zero-communication limit, in the same launch.
    assert rows[2]["reduce_in_run_us"] > 0, rows[2]
    assert all(r["reduce_in_run_us"] is None for r in rows[:2])
    assert "hsdp/rdR" in proc.stdout, proc.stdout
    for peer in ("ompi", "mpich"):
        cell = rows[2]["peers"][peer]
        if cell["status"] == "measured":
            assert cell["pool_speedup_vs"] > 0, (peer, cell)
    for r in rows:
        assert math.isfinite(r["hsdp"]["us"]) and r["hsdp"]["us"] > 0
        assert r["memcpy1_us"] > 0 and r["memcpy2_us"] > 0
        assert r["hsdp_memcpy2_fraction"] > 0
        assert r["memcpy_in_run_us"] > 0 and r["hsdp_memcpy_in_run_fraction"] > 0
        for peer in PEERS:
            cell = r["peers"][peer]
            if status[peer]["status"] == "missing":
                assert cell["status"] == "missing" and cell["reason"], (peer, cell)
            elif peer == "deepspeed" and r["op"] != "all_reduce":
                assert cell["status"] == "n/a", (peer, cell)
            else:
                assert cell["status"] == "measured" and cell["checked"], (peer, cell)
                assert cell["speedup_vs"] == cell["us"] / cell["hsdp_us_same_launch"]
    # No order among them: torch's fake backend does nothing but still hands
    # back a Work that Python waits for, and hsdp's synchronous call
    # returns none, so hsdp may run below it.
    floors = {k: section[f"floor_1rank_{k}_us"] for k in FLOORS}
    assert all(math.isfinite(us) and us > 0 for us in floors.values()), floors
    assert {m["bytes"] for m in section["memcpy2"]} == {8, 65536}


def test_peers_missing_when_not_installed(tmp_path):
    """An empty peers directory: MPICH and DeepSpeed are reported missing with
    the setup hint, and the run still succeeds."""
    out_json = tmp_path / "peers.json"
    cmd = [
        sys.executable,
        "-m",
        "benchmarks",
        "peers",
        "--quick",
        "--ranks",
        "2",
        "--ops",
        "ar",
        "--sizes",
        "4K",
        "--peers",
        "mpich,deepspeed",
        "--iters",
        "2",
        "--warmup",
        "1",
        "--timeout",
        "60",
        "--json",
        str(out_json),
        "--plot",
        "",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HSDP_PEERS_DIR": str(tmp_path / "none")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=90, cwd=ROOT, env=env)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-4000:]}"
    section = json.loads(out_json.read_text())["peers"]
    for peer in ("mpich", "deepspeed"):
        assert section["peers"][peer]["available"] is False
        assert "setup_peers.sh" in section["peers"][peer]["reason"]
        assert all(r["peers"][peer]["status"] == "missing" for r in section["results"])
