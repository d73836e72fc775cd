"""The peers tool (benchmarks/peers.py) in its smallest form: every peer measured and checked, or
reported missing with its reason; the 1-rank floors measured.

`python -m benchmarks.peers` on 2 ranks, one size, all_reduce and reduce_scatter, with whatever peers
this machine has (they are opt-in: scripts/setup_peers.sh; on a clean machine every peer but gloo
is missing, and the tool must still run and say why, never drop one). Each measured peer's ratio is
against hsdp from its own launch. The 1-rank floors (hsdp, hsdp without its flight recorder,
torch's fake backend) are finite and positive, in no order: `fake` hands back a Work that Python
waits for, hsdp's synchronous call returns none. An empty peers directory reports MPICH and
DeepSpeed missing with the setup hint."""

import json
import math
import os
import pathlib

from harness import run_module

ROOT = pathlib.Path(__file__).resolve().parents[2]
PEERS = ("gloo", "ompi", "mpich", "deepspeed")


def _run(tmp_path, flags, timeout, **env):
    out_json = tmp_path / "peers.json"
    proc = run_module("benchmarks.peers", "--quick", "--ranks", "2", "--warmup", "1", *flags, "--json",
                      str(out_json), timeout=timeout, env=env)  # fmt: skip
    return proc.stdout, json.loads(out_json.read_text())


def test_peers_smallest(tmp_path):
    flags = ["--ops", "all_reduce,reduce_scatter", "--sizes", "64K", "--iters", "3"]
    stdout, doc = _run(tmp_path, flags + ["--timeout", "200"], timeout=240)
    assert "vs gloo" in stdout and "hsdp/rdR" in stdout, stdout
    assert doc["suite"] == "peers" and doc["world"] == 2
    assert set(doc["peers"]) == set(PEERS)
    status = doc["peer_status"]
    for peer in PEERS:
        st = status[peer]
        if st["status"] == "missing":
            assert st["reason"], (peer, st)
            assert f"{peer}: missing: {st['reason']}" in stdout
        else:
            assert st["status"] == "measured" and st["checked"] is True, (peer, st)
    assert status["gloo"]["status"] == "measured"  # gloo ships with torch

    rows = doc["rows"]
    assert [(r["op"], r["bytes_per_rank"]) for r in rows] == [
        ("all_reduce", 8),
        ("all_reduce", 65536),
        ("reduce_scatter", 65536),
    ]
    # hsdp on pool buffers where FSDP2 allocates them, and the reduce-scatter's
    # zero-communication limit, both in the same launch.
    assert rows[2]["hsdp_pool"]["us"] > 0 and rows[2]["reduce_in_run_us"] > 0, rows[2]
    assert all(r["hsdp_pool"] is None and r["reduce_in_run_us"] is None for r in rows[:2])
    for r in rows:
        assert math.isfinite(r["hsdp"]["us"]) and r["hsdp"]["us"] > 0, r
        assert r["hsdp"]["reps"] == 3, r
        assert r["memcpy1_us"] > 0 and r["memcpy2_us"] > 0 and r["hsdp_memcpy2_fraction"] > 0
        assert r["memcpy_in_run_us"] > 0 and r["hsdp_memcpy_in_run_fraction"] > 0
        assert r["by_launch"]["main"]["hsdp"] == r["hsdp"]["us"]
        for peer in PEERS:
            cell = r["peers"][peer]
            if status[peer]["status"] == "missing":
                assert cell["status"] == "missing" and cell["reason"], (peer, cell)
            elif peer == "deepspeed" and r["op"] != "all_reduce":
                assert cell["status"] == "n/a", (peer, cell)
            else:
                assert cell["status"] == "measured" and cell["checked"], (peer, cell)
                # the ratio is against hsdp from the peer's own launch
                launch = peer if peer in ("ompi", "mpich") else "main"
                assert cell["hsdp_us_same_launch"] == r["by_launch"][launch]["hsdp"]
                assert cell["speedup_vs"] == cell["us"] / cell["hsdp_us_same_launch"]
                if peer != "deepspeed" and r["op"] == "reduce_scatter":
                    assert cell["pool_speedup_vs"] > 0, (peer, cell)
    floors = doc["floor_1rank_8B_us"]
    assert set(floors) == {"hsdp", "hsdp_no_recorder", "torch"}, floors
    assert all(math.isfinite(us) and us > 0 for us in floors.values()), floors
    assert {m["bytes"] for m in doc["memcpy2"]} == {8, 65536}
    assert all(len(m["per_process_us"]) == 2 for m in doc["memcpy2"])
    if status["deepspeed"]["status"] == "measured":  # its shm workspace unlinked by the ranks
        assert not [f for f in os.listdir("/dev/shm") if f.startswith("deepspeed_allreduce_")]


def test_peers_missing_when_not_installed(tmp_path):
    flags = ["--ops", "ar", "--sizes", "4K", "--peers", "mpich,deepspeed", "--iters", "2"]
    stdout, doc = _run(tmp_path, flags + ["--timeout", "100"], 150, HSDP_PEERS_DIR=str(tmp_path))
    assert set(doc["peers"]) == {"mpich", "deepspeed"}
    for peer in ("mpich", "deepspeed"):
        assert doc["peers"][peer]["available"] is False
        assert "setup_peers.sh" in doc["peers"][peer]["reason"]
        assert f"{peer}: missing: " in stdout
        assert all(r["peers"][peer]["status"] == "missing" for r in doc["rows"])
    assert [r["bytes_per_rank"] for r in doc["rows"]] == [8, 4096]
