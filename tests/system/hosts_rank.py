"""One rank of a test on simulated hosts (test_hosts.py), started by torchrun
on every host: ``hosts_rank.py JOB OUT_DIR [ARGS...]``. The default group is
created on $HSDP_TEST_BACKEND (hsdp) with a timeout of
$HSDP_TEST_GROUP_TIMEOUT_S seconds; the job's result is pickled to
OUT_DIR/result.<rank>.pkl (a traceback text when the job raised)."""

from __future__ import annotations

import datetime
import os
import pickle
import sys
import time
import traceback

from tools import settings  # the repository root is on PYTHONPATH (test_hosts.py)


def hostnames() -> list[str]:
    import socket

    import torch.distributed as dist

    names: list = [None] * dist.get_world_size()
    dist.all_gather_object(names, socket.gethostname())
    return names


def job_ops(rank: int, world: int, out: str, *names: str):
    """Every op case of ops_cases.py (or `names`) on the default group."""
    import harness
    import ops_cases

    os.environ["HSDP_TEST_EXPECTED_HOSTS"] = ",".join(hostnames())
    return harness.run_cases(rank, world, "ops_cases", list(names) or list(ops_cases.CASES))


def job_fsdp(rank: int, world: int, out: str, *names: str):
    """FSDP2 parity scenarios (fsdp_parity.py) on the default group."""
    import fsdp_parity

    return fsdp_parity.run_scenarios(rank, world, list(names), os.path.join(out, "checkpoints"))


def job_fault(rank: int, world: int, out: str, op: str):
    """Runs `op` in a loop (publishing the iteration in OUT/progress.<rank>)
    until it fails; returns what the failure was and when it came."""
    import torch
    import torch.distributed as dist

    import hsdp_backend

    with open(os.path.join(out, f"pid.{rank}"), "w") as f:
        f.write(str(os.getpid()))
    engine = hsdp_backend.cpu_route()
    n = 1 << 18  # 1 MiB of fp32 per rank
    t = torch.ones(n)
    big = torch.empty(world * n)
    i = 0
    start = time.time()
    try:
        while time.time() - start < 300:
            if op == "all_reduce":
                dist.all_reduce(t)
                t.fill_(1.0)
            else:
                dist.all_gather_into_tensor(big, t)
            i += 1
            with open(os.path.join(out, f"progress.{rank}"), "w") as f:
                f.write(str(i))
    except dist.DistBackendError as exc:
        failed_at = time.time()
        # The group must now refuse work at once, not hang or half-run.
        try:
            dist.all_reduce(t)
            again = None
        except Exception as second:  # noqa: BLE001 - its type is checked by the test
            again = f"{type(second).__name__}: {second}"
        return {
            "engine": engine,
            "iterations": i,
            "error": str(exc),
            "failed_at": failed_at,
            "again": again,
            "again_s": time.time() - failed_at,
        }
    except Exception as exc:  # noqa: BLE001 - any other type is a failure of the test
        return {
            "engine": engine,
            "iterations": i,
            "error": f"{type(exc).__name__}: {exc}",
            "failed_at": time.time(),
            "wrong_type": True,
        }
    return {"engine": engine, "iterations": i, "error": None, "failed_at": None}


def job_train_and_exit(rank: int, world: int, out: str, how: str = "destroy"):
    """A short FSDP2 training, then the end of the process (the clean-exit
    test), `how`: "destroy" (destroy_process_group, then exit), "exit" (the
    interpreter exits with the groups alive), "abort" (abort every group,
    then exit), "host_gone" (host 1's ranks leave at once with os._exit, host
    0's then destroy their groups)."""
    import fsdp_parity

    result = fsdp_parity.run_scenarios(
        rank, world, ["fsdp_w4_reshard_int"], os.path.join(out, "ckpt")
    )
    return {"ok": isinstance(result["fsdp_w4_reshard_int"], dict), "how": how}


JOBS = {"ops": job_ops, "fsdp": job_fsdp, "fault": job_fault, "train_and_exit": job_train_and_exit}


def main() -> None:
    job, out, *args = sys.argv[1:]
    import torch
    import torch.distributed as dist

    import hsdp_backend  # noqa: F401  registers "hsdp"

    torch.set_num_threads(1)
    timeout = settings.read("HSDP_TEST_GROUP_TIMEOUT_S")
    dist.init_process_group(
        settings.read("HSDP_TEST_BACKEND"), timeout=datetime.timedelta(seconds=timeout)
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        result = JOBS[job](rank, world, out, *args)
    except BaseException:  # noqa: BLE001 - reported to the test
        result = traceback.format_exc()
    with open(os.path.join(out, f"result.{rank}.pkl.tmp"), "wb") as f:
        pickle.dump(result, f)
    os.rename(os.path.join(out, f"result.{rank}.pkl.tmp"), os.path.join(out, f"result.{rank}.pkl"))
    if job == "fault":
        # The group is broken; leaving it cannot be clean. The test checks
        # what each rank raised, and every host's /dev/shm.
        os._exit(0)
    how = args[0] if job == "train_and_exit" and args else "destroy"
    if how == "host_gone":
        # Host 1 leaves first; host 0 waits until it is gone, then destroys.
        local_world = int(os.environ["LOCAL_WORLD_SIZE"])
        if rank >= world - local_world:
            os._exit(0)
        time.sleep(2)
        dist.destroy_process_group()
    elif how == "abort":
        dist.distributed_c10d._abort_process_group()
    elif how == "destroy":
        dist.destroy_process_group()
    # "exit": nothing; the interpreter exits with the groups alive.


if __name__ == "__main__":
    main()
