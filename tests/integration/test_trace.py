"""Hangs that explain themselves: errors that say where every rank is, the flight recorder, `python
-m hsdp_backend.trace`.

Hangs that explain themselves: the in-segment activity named in timeout
and mismatch errors, the flight recorder's files (on failure, SIGUSR1 and
dump_trace(), on the shared-memory and the gloo route), and
`python -m hsdp_backend.trace` naming the rank and the op that diverged.

On the shared-memory engine, 2-3 ranks: a rank that skips a collective, a rank that calls a
different one, a rank stuck in Python (dumped by SIGUSR1): the errors say where every rank is
and `python -m hsdp_backend.trace` names the right rank and op; on the gloo route: the ring, the
dump on gloo's timeout, `dump_trace()` and the analysis; the ring keeping its last N;
`HSDP_TRACE_ENTRIES=0`; out-of-range settings rejected by name."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
from harness import run_ranks
from test_faults import expect_backend_error

ROOT = pathlib.Path(__file__).resolve().parents[2]


def analyse(trace_dir) -> str:
    # Run from the tests' directory: `-m` from the repository root would
    # import the source tree instead of the installed package.
    proc = subprocess.run(
        [sys.executable, "-m", "hsdp_backend.trace", str(trace_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT / "tests",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def record_path(trace_dir, rank, group="0"):
    return pathlib.Path(trace_dir) / f"hsdp-trace.{group}.rank{rank}.json"


def wait_for(path, seconds=20.0):
    deadline = time.monotonic() + seconds
    while not pathlib.Path(path).exists():
        assert time.monotonic() < deadline, f"{path} was never written"
        time.sleep(0.05)


def warm_up():
    import torch
    import torch.distributed as dist

    for _ in range(3):  # collectives #1-#3 on every rank
        t = torch.ones(16)
        dist.all_reduce(t)


def skip_body(rank, world, trace_dir):
    import torch
    import torch.distributed as dist

    warm_up()
    x = torch.ones(256)
    if rank == world - 1:
        # Skips the all-gather #4 the others call, and calls the all-reduce #5 as its #4.
        _, text = expect_backend_error(lambda: dist.all_reduce(x), "different collectives")
    else:
        out = torch.empty(256 * world)
        _, text = expect_backend_error(
            lambda: dist.all_gather_into_tensor(out, x), "different collectives"
        )
    assert f"Flight record of this rank: {record_path(trace_dir, rank)}" in text, text
    assert record_path(trace_dir, rank).exists()
    return text


def test_a_rank_that_skips_a_collective_is_named(tmp_path):
    texts = run_ranks(
        skip_body,
        3,
        trace_dir=tmp_path,
        env={"HSDP_TRACE_DIR": str(tmp_path), "HSDP_CPU_ROUTE": "shm"},
    )
    # Every rank's error says where each rank is, by c10d sequence number.
    for text in texts:
        assert "rank 2 (this rank)" in text or "rank 2 " in text, text
        assert "all_gather_into_tensor #4" in text, text
        assert "all_reduce #4" in text, text
    report = analyse(tmp_path)
    assert "first divergence at collective #4" in report, report
    assert (
        "=> rank 2 called all_reduce, where ranks 0, 1 called all_gather_into_tensor #4" in report
    ), report


def different_op_body(rank, world):
    import torch
    import torch.distributed as dist

    warm_up()
    x = torch.ones(64)
    if rank == 1:
        expect_backend_error(lambda: dist.broadcast(x, src=0), "different collectives")
    else:
        expect_backend_error(lambda: dist.all_reduce(x), "different collectives")


def test_a_rank_that_calls_a_different_collective_is_named(tmp_path):
    run_ranks(different_op_body, 3, env={"HSDP_TRACE_DIR": str(tmp_path), "HSDP_CPU_ROUTE": "shm"})
    report = analyse(tmp_path)
    assert "=> rank 1 called broadcast, where ranks 0, 2 called all_reduce #4" in report, report


def stuck_body(rank, world, trace_dir):
    import torch
    import torch.distributed as dist

    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())  # collectives #1 and #2
    warm_up()  # #3-#5
    if rank == 1:
        # Stuck in Python after #5: only SIGUSR1 makes it write its record.
        wait_for(record_path(trace_dir, 1), seconds=60)
        return None
    _, text = expect_backend_error(
        lambda: dist.all_reduce(torch.ones(8)), "Timed out after 1500 ms"
    )
    os.kill(pids[1], signal.SIGUSR1)
    return text


def test_a_rank_stuck_in_python_is_named_and_sigusr1_dumps_it(tmp_path):
    texts = run_ranks(
        stuck_body,
        2,
        trace_dir=tmp_path,
        env={"HSDP_TRACE_DIR": str(tmp_path), "HSDP_CPU_ROUTE": "shm", "HSDP_TIMEOUT_MS": "1500"},
    )
    assert "rank 1 finished all_reduce #5 and has called no collective since" in texts[0], texts[0]
    assert (
        "rank 0 (this rank) waits in all_reduce #6 (step 1 of 1) for every rank's post" in texts[0]
    )
    rank1 = json.loads(record_path(tmp_path, 1).read_text())
    assert rank1["reason"] == "SIGUSR1", rank1
    assert [e["seq"] for e in rank1["entries"]] == [1, 2, 3, 4, 5], rank1
    assert {e["state"] for e in rank1["entries"]} == {"completed"}, rank1
    report = analyse(tmp_path)
    assert "=> rank 1 never called it, where rank 0 called all_reduce #6" in report, report
    assert "its last collective is #5 all_reduce (completed)" in report, report


def gloo_stuck_body(rank, world, trace_dir):
    import torch
    import torch.distributed as dist

    import hsdp_backend

    assert hsdp_backend.cpu_route() == "gloo"
    warm_up()
    if rank == 1:
        time.sleep(6)  # stuck in Python past rank 0's gloo timeout
        paths = hsdp_backend.dump_trace()
        assert paths == [str(record_path(trace_dir, 1))], paths
        return None
    with pytest.raises(Exception) as info:  # gloo's own timeout error
        dist.all_reduce(torch.ones(8))
    wait_for(record_path(trace_dir, 0))
    return str(info.value)


def test_the_gloo_route_records_and_dumps_too(tmp_path):
    run_ranks(
        gloo_stuck_body,
        2,
        trace_dir=tmp_path,
        env={
            "HSDP_TRACE_DIR": str(tmp_path),
            "HSDP_CPU_ROUTE": "gloo",
            "HSDP_TEST_COLLECTIVE_TIMEOUT_S": "3",
        },
    )
    rank0 = json.loads(record_path(tmp_path, 0).read_text())
    assert [e["state"] for e in rank0["entries"]] == ["completed"] * 3 + ["failed"], rank0
    assert {e["route"] for e in rank0["entries"]} == {"inner"}, rank0
    report = analyse(tmp_path)
    assert "=> rank 1 never called it, where rank 0 called all_reduce #4" in report, report


def ring_body(rank, world, trace_dir):
    import torch
    import torch.distributed as dist

    import hsdp_backend

    for i in range(10):
        dist.all_reduce(torch.ones(4 + i))
    [path] = hsdp_backend.dump_trace("asked")
    record = json.loads(pathlib.Path(path).read_text())
    assert record["reason"] == "asked" and record["rank"] == rank and record["size"] == world
    assert [e["seq"] for e in record["entries"]] == [7, 8, 9, 10], record
    assert [e["bytes"] for e in record["entries"]] == [40, 44, 48, 52], record
    assert {e["state"] for e in record["entries"]} == {"completed"}, record
    assert {e["route"] for e in record["entries"]} == {"shm"}, record
    assert all(0 < e["start_us"] <= e["end_us"] for e in record["entries"]), record


def test_the_ring_keeps_the_last_n_collectives(tmp_path):
    run_ranks(
        ring_body,
        2,
        trace_dir=tmp_path,
        env={"HSDP_TRACE_DIR": str(tmp_path), "HSDP_TRACE_ENTRIES": "4", "HSDP_CPU_ROUTE": "shm"},
    )
    assert "the ranks agree on every recorded collective, and all completed" in analyse(tmp_path)


def off_body(rank, world):
    import torch
    import torch.distributed as dist

    import hsdp_backend

    dist.all_reduce(torch.ones(4))
    assert hsdp_backend.dump_trace() == [], hsdp_backend.dump_trace()


def test_entries_zero_turns_the_recorder_off(tmp_path):
    run_ranks(off_body, 2, env={"HSDP_TRACE_DIR": str(tmp_path), "HSDP_TRACE_ENTRIES": "0"})
    assert list(tmp_path.iterdir()) == []


def bad_setting_body(rank, world, name, value):
    import datetime

    import torch.distributed as dist

    os.environ[name] = value
    with pytest.raises(ValueError, match=f"{name}={value!r}"):
        dist.init_process_group("hsdp", timeout=datetime.timedelta(seconds=30))


@pytest.mark.parametrize(
    "name,value",
    [
        ("HSDP_TRACE_ENTRIES", "-1"),
        ("HSDP_TRACE_ENTRIES", "2000000"),
        ("HSDP_TRACE_ENTRIES", "many"),
        ("HSDP_TRACE_DIR", " "),
    ],
)
def test_trace_settings_out_of_range_are_rejected_by_name(name, value):
    run_ranks(bad_setting_body, 1, backend=None, name=name, value=value)


def gloo_ring_body(rank, world):
    import torch
    import torch.distributed as dist

    import hsdp_backend

    t = torch.ones(8)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)  # synchronous, with hsdp's divide after gloo's SUM
    dist.all_reduce(t)  # synchronous, gloo's Work returned as it is
    dist.all_reduce(t, async_op=True).wait()
    dist.all_gather_into_tensor(torch.empty(8 * world), t)
    [path] = hsdp_backend.dump_trace()
    record = json.loads(pathlib.Path(path).read_text())
    assert [(e["op"], e["state"]) for e in record["entries"]] == [
        ("all_reduce", "completed")
    ] * 3 + [("all_gather_into_tensor", "completed")], record


def test_the_gloo_route_closes_every_entry(tmp_path):
    run_ranks(gloo_ring_body, 2, env={"HSDP_TRACE_DIR": str(tmp_path), "HSDP_CPU_ROUTE": "gloo"})


def _record(rank, entries, size=2):
    return {
        "rank": rank,
        "size": size,
        "entries": [
            {"seq": seq, "op": op, "bytes": 4, "route": route, "state": state, "error": ""}
            for seq, op, route, state in entries
        ],
    }


def test_analysis_reports_the_earliest_problem():
    from hsdp_backend.trace import first_divergence

    # #2 failed everywhere; rank 0 had issued #3 and #4 before it saw the failure.
    records = {
        0: _record(
            0,
            [
                (1, "all_reduce", "shm", "completed"),
                (2, "broadcast", "shm", "failed"),
                (3, "all_reduce", "shm", "failed"),
                (4, "all_reduce", "shm", "failed"),
            ],
        ),
        1: _record(1, [(1, "all_reduce", "shm", "completed"), (2, "broadcast", "shm", "failed")]),
    }
    finding = first_divergence(records)
    assert finding.seq == 2 and "did not complete on ranks 0, 1" in finding.verdict, finding
    # The same op on different routes is a divergence too.
    records = {
        0: _record(0, [(1, "all_reduce", "shm", "completed")]),
        1: _record(1, [(1, "all_reduce", "inner", "failed")]),
    }
    finding = first_divergence(records)
    assert finding.seq == 1 and "rank 0 via shm; rank 1 via inner" in finding.verdict, finding
    # Agreement.
    records = {r: _record(r, [(1, "barrier", "shm", "completed")]) for r in (0, 1)}
    assert first_divergence(records) is None
