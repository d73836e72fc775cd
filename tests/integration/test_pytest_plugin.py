"""pytest_hsdp, the plugin for users' multi-process tests, as a user runs it: warm pools, failures
explained, nothing left behind.

pytest_hsdp, the pytest plugin for users' multi-process tests, as a user runs it: test files
written here, run by a pytest of their own (a subprocess, as from a user's shell), each test's
outcome read from its JUnit XML report and its failure text checked.

Bodies on 1, 2 and 4 ranks (AVG, parametrize, parent-side fixtures and one
`tmp_path` for all ranks, a 2 x 2 mesh, a test class, the marker's backend), one warm pool
reused (the ranks' pids), a fresh one after a failure on one rank only and after ranks left out
of step, the default group re-made after a test destroyed it; a test's own 2 x 2 mesh with
DTensor ops twice on one pool (the second fails if DTensor's caches keep the first's groups), a
test's environment changes undone; the failure text per rank with the rewritten assert; a world
size of 0, an argument that does not pickle, `sys.exit`, a fork whose child returns; a rank that
never returns (its stacks and hsdp's flight records in the report), one that exits with a code,
one that segfaults, and a passing test after them; no rank outlives a pytest stopped by SIGINT
or SIGKILL, no shared memory is left; a session without marked tests imports no torch; under
pytest-xdist.

Ranks write their process ids to a directory the tests share (passed by environment), which is
how reuse of a warm pool, its replacement after a failure, and that no rank outlives its pytest
are seen."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from plugin_runs import alive, all_gone, every_pid, pids, run_pytest, write_tests

pytestmark = pytest.mark.timeout(600)

CONFTEST = """
import os
import pathlib

import pytest


@pytest.fixture
def settings():
    return {"size": 3, "name": "parent-side"}


def record_pid(tag, rank, pid=None):
    d = pathlib.Path(os.environ["PIDS_DIR"])
    (d / f"{tag}.rank{rank}").write_text(str(pid or os.getpid()))
"""

BASIC = """
import os
import pickle
import time

import pytest
import torch
import torch.distributed as dist

from conftest import record_pid


@pytest.mark.world_size(2)
def test_avg_on_every_rank(rank, world_size, group, device):
    record_pid("first", rank)
    assert world_size == 2 and device == torch.device("cpu")
    assert dist.get_backend(group) == "hsdp"
    t = torch.full((5,), float(rank + 1))
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    assert torch.equal(t, torch.full((5,), 1.5))


@pytest.mark.world_size(2)
@pytest.mark.parametrize("n", [1, 4])
def test_parametrize_and_parent_fixtures(rank, n, settings, tmp_path):
    record_pid(f"param{n}", rank)
    assert settings == {"size": 3, "name": "parent-side"}
    t = torch.ones(n) * (rank + 1)
    dist.all_reduce(t)
    assert t.tolist() == [3.0] * n
    (tmp_path / f"rank{rank}").write_text("x")  # one tmp_path for all ranks
    dist.barrier()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1"]


@pytest.mark.world_size(2)
def test_fails_on_rank_1_only(rank):
    doubled = rank * 2
    assert doubled == 0


@pytest.mark.world_size(2)
def test_a_fresh_pool_after_a_partial_failure(rank):
    record_pid("after_partial", rank)
    dist.barrier()


@pytest.mark.world_size(2)
def test_leaves_a_group_and_destroys_the_default_one(rank):
    dist.new_group([0, 1])
    record_pid("destroyer", rank)
    dist.destroy_process_group()


@pytest.mark.world_size(2)
def test_the_next_test_has_a_default_group(rank):
    record_pid("after_destroy", rank)
    assert dist.is_initialized()
    t = torch.ones(2)
    dist.all_reduce(t)
    assert t.tolist() == [2.0, 2.0]


@pytest.mark.world_size(2)
def test_leaves_the_ranks_out_of_step(rank):
    record_pid("out_of_step", rank)
    if rank == 0:
        dist.all_reduce(torch.ones(1), async_op=True)  # its peer never joins


@pytest.mark.world_size(2)
def test_a_fresh_pool_after_ranks_out_of_step(rank):
    record_pid("after_out_of_step", rank)
    dist.barrier()


@pytest.mark.world_size(2, backend="gloo")
def test_the_marker_names_the_backend(group):
    assert dist.get_backend(group) == "gloo"


@pytest.mark.world_size(4, mesh=(2, 2), mesh_dim_names=("replicate", "shard"))
def test_a_mesh(rank, mesh):
    assert mesh.mesh_dim_names == ("replicate", "shard")
    t = torch.ones(1) * rank
    dist.all_reduce(t, group=mesh.get_group("shard"))
    assert t.item() == (0 + 1 if rank < 2 else 2 + 3)


@pytest.mark.world_size(4)
@pytest.mark.parametrize("round", [1, 2])
def test_builds_a_mesh_of_its_own(rank, round):
    # The second round's mesh equals the first's (shape, ranks), whose groups are gone.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    record_pid(f"own_mesh{round}", rank)
    mesh = init_device_mesh("cpu", (2, 2))
    t = distribute_tensor(torch.arange(8.0), mesh, [Shard(0), Shard(0)])
    assert torch.equal((t * 2 + 1).full_tensor(), torch.arange(8.0) * 2 + 1)
    os.environ["LEFT_BY_A_TEST"] = "1"
    if round == 1:  # tidy: its groups are gone before the plugin looks
        for dim in range(mesh.ndim):
            dist.destroy_process_group(mesh.get_group(dim))


@pytest.mark.world_size(4)
def test_sees_the_pools_environment(rank):
    record_pid("environment", rank)
    assert "LEFT_BY_A_TEST" not in os.environ


@pytest.mark.world_size(1)
def test_one_rank(rank, world_size):
    assert (rank, world_size) == (0, 1)


@pytest.mark.world_size(0)
def test_zero_ranks():
    pass


@pytest.mark.world_size(2)
@pytest.mark.parametrize("fn", [lambda x: x])
def test_an_argument_that_does_not_pickle(fn, rank):
    pass


@pytest.mark.world_size(2)
def test_calls_sys_exit(rank):
    raise SystemExit(3)


@pytest.mark.world_size(2)
def test_forks_and_the_child_returns(rank):
    os.fork()


@pytest.mark.world_size(2)
def test_forks_and_the_child_exits(rank):
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


@pytest.mark.world_size(2)
def test_forks_and_the_child_returns_late(rank):
    if os.fork() == 0:
        time.sleep(0.5)  # after its parent rank is done with the body


class TestInAClass:
    @pytest.mark.world_size(2)
    def test_method(self, rank):
        dist.barrier()


@pytest.mark.world_size(2, device="cuda")
def test_on_cuda(rank, device):
    t = torch.full((4,), float(rank + 1), device=device)
    dist.all_reduce(t)
    assert t.tolist() == [3.0] * 4


@pytest.mark.world_size(2, device="cuda", gpu_memory_gib=0)
def test_no_gpu_memory(rank):
    pass


def test_not_marked():
    assert not dist.is_initialized()  # the body runs here, in pytest's own process
"""

FAULTS = """
import ctypes
import os
import time

import pytest
import torch
import torch.distributed as dist

from conftest import record_pid


@pytest.mark.world_size(2, timeout=8)
def test_rank_1_never_returns(rank):
    record_pid("hang", rank)
    if rank == 1:
        while True:
            time.sleep(0.1)
    dist.all_reduce(torch.ones(3))


@pytest.mark.world_size(2)
def test_rank_1_exits(rank):
    record_pid("exit", rank)
    if rank == 1:
        os._exit(7)
    dist.barrier()


@pytest.mark.world_size(2)
def test_rank_0_crashes(rank):
    record_pid("crash", rank)
    if rank == 0:
        ctypes.string_at(0)
    dist.barrier()


@pytest.mark.world_size(2)
def test_after_the_faults(rank):
    record_pid("after_faults", rank)
    dist.barrier()
"""


def test_tests_run_on_warm_ranks_and_every_misuse_is_named(tmp_path):
    d = write_tests(tmp_path, CONFTEST, test_basic=BASIC)
    shm_before = set(os.listdir("/dev/shm"))
    results, out = run_pytest(d)

    def outcome(name):
        assert name in results, f"{name} not reported:\n{out[-4000:]}"
        return results[name]

    for name in (
        "test_avg_on_every_rank",
        "test_parametrize_and_parent_fixtures[1]",
        "test_parametrize_and_parent_fixtures[4]",
        "test_a_fresh_pool_after_a_partial_failure",
        "test_leaves_a_group_and_destroys_the_default_one",
        "test_the_next_test_has_a_default_group",
        "test_leaves_the_ranks_out_of_step",
        "test_a_fresh_pool_after_ranks_out_of_step",
        "test_the_marker_names_the_backend",
        "test_a_mesh",
        "test_builds_a_mesh_of_its_own[1]",
        "test_builds_a_mesh_of_its_own[2]",
        "test_sees_the_pools_environment",
        "test_one_rank",
        "test_forks_and_the_child_exits",
        "test_method",
        "test_not_marked",
    ):
        assert outcome(name)[0] == "passed", f"{name}: {outcome(name)[1]}"

    # One pool served the first tests; a partial failure ended it.
    assert len(set(pids(d, "first"))) == 2
    assert pids(d, "first") == pids(d, "param1") == pids(d, "param4")
    state, text = outcome("test_fails_on_rank_1_only")
    assert state == "failure"
    assert "1 of 2 ranks failed" in text and "--- rank 1 ---" in text, text
    assert "--- rank 0 ---" not in text, text
    assert "assert 2 == 0" in text, text  # the assert rewritten on the rank
    assert "_worker.py" not in text, text  # the traceback starts at the body
    assert set(pids(d, "after_partial")).isdisjoint(pids(d, "first"))
    # Destroying the default group keeps the pool (every rank makes a new group).
    assert pids(d, "after_destroy") == pids(d, "destroyer") == pids(d, "after_partial")
    # A test's own mesh and environment go with it; the pool stays.
    assert pids(d, "own_mesh1") == pids(d, "own_mesh2") == pids(d, "environment")
    # Ranks out of step: a fresh pool.
    assert set(pids(d, "after_out_of_step")).isdisjoint(pids(d, "out_of_step"))

    # device='cuda': skipped, saying why, without CUDA (ranks sharing a GPU where there is
    # one are placed by pytest_hsdp/_placement.py, tested in tests/unit/test_placement.py).
    state, text = outcome("test_on_cuda")
    if torch.cuda.is_available():
        assert state == "passed", text
    else:
        assert state == "skipped" and "no CUDA device" in text, (state, text)
    state, text = outcome("test_no_gpu_memory")
    assert state == "failure" and "gpu_memory_gib must be a positive number" in text, text

    state, text = outcome("test_zero_ranks")
    assert state == "failure" and "an int of at least 1" in text, text
    state, text = outcome("test_an_argument_that_does_not_pickle[<lambda>]")
    assert state == "failure" and "argument 'fn'" in text and "cannot be sent" in text, text
    state, text = outcome("test_calls_sys_exit")
    assert state == "failure" and "sys.exit(3)" in text and "--- rank 1 ---" in text, text
    state, text = outcome("test_forks_and_the_child_returns")
    assert state == "failure" and "forked" in text, text
    # A child that returns after its parent rank finished the body is still
    # this test's (its rank waits for it), not the next test's.
    state, text = outcome("test_forks_and_the_child_returns_late")
    assert state == "failure" and "forked" in text, text

    # Nothing outlives the session: ranks, their shared memory.
    assert all_gone(every_pid(d)), [p for p in every_pid(d) if alive(p)]
    leaked = {n for n in set(os.listdir("/dev/shm")) - shm_before if n.startswith("hsdp")}
    assert not leaked, leaked


def test_a_hang_and_a_dead_rank_are_explained_and_the_session_goes_on(tmp_path):
    d = write_tests(tmp_path, CONFTEST, test_faults=FAULTS)
    start = time.monotonic()
    results, out = run_pytest(d)
    state, text = results["test_rank_1_never_returns"]
    assert state == "failure", text
    assert "rank 1 did not return within the test's deadline of 8 s" in text, text
    # Its stacks and hsdp's flight records are in the report.
    assert 'File "' in out and "in test_rank_1_never_returns" in out, out[-6000:]
    assert "flight records" in out, out[-6000:]
    state, text = results["test_rank_1_exits"]
    assert state == "failure" and "rank 1 died during the test (exit code 7)" in text, text
    state, text = results["test_rank_0_crashes"]
    assert state == "failure" and "rank 0 died during the test (killed by SIGSEGV)" in text, text
    assert results["test_after_the_faults"][0] == "passed", results["test_after_the_faults"]
    assert len(set(pids(d, "hang") + pids(d, "exit") + pids(d, "crash"))) == 6  # three pools
    assert time.monotonic() - start < 200
    assert all_gone(every_pid(d))


SLEEPER = """
import os
import time

import pytest

from conftest import record_pid


@pytest.mark.world_size(2)
def test_sleeps(rank):
    record_pid("parent", rank, os.getppid())  # multiprocessing's fork server
    record_pid("sleeper", rank)
    time.sleep(300)
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_no_rank_outlives_an_interrupted_pytest(tmp_path, sig):
    d = write_tests(tmp_path, CONFTEST, test_sleeper=SLEEPER)
    env = {**os.environ, "PIDS_DIR": str(tmp_path / "pids")}
    # pytest's faulthandler writes every thread's stack to stderr on SIGABRT:
    # what an interrupted pytest that does not end was doing.
    stderr = open(tmp_path / "pytest.stderr", "w+b")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q"],
        cwd=d,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=stderr,
        # As at a terminal: a suite started in the background of a shell
        # without job control inherits SIGINT ignored, and so would this
        # pytest (Python then raises no KeyboardInterrupt).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 200
        while len(pids(d, "sleeper")) < 2 and time.monotonic() < deadline:
            assert proc.poll() is None, "pytest ended before its ranks slept"
            time.sleep(0.2)
        ranks = pids(d, "sleeper")
        assert len(ranks) == 2
        deadline = time.monotonic() + 10
        while len(pids(d, "parent")) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        started_by = set(pids(d, "parent")) - {proc.pid}
        proc.send_signal(sig)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            proc.wait(30)
            stderr.seek(0)
            stacks = stderr.read().decode(errors="replace")[-12000:]
            pytest.fail(f"pytest had not ended 60 s after {sig.name}; its stderr:\n{stacks}")
        left = ranks + sorted(started_by)
        assert all_gone(left), [p for p in left if alive(p)]
    finally:
        proc.kill()
        proc.wait()
        stderr.close()


def test_a_session_without_marked_tests_imports_no_torch(tmp_path):
    d = tmp_path / "plain"
    d.mkdir()
    (d / "test_plain.py").write_text(
        "import sys\n\n\ndef test_x():\n    assert 'torch' not in sys.modules\n"
    )
    (tmp_path / "pids").mkdir()
    results, out = run_pytest(d)
    assert results["test_x"][0] == "passed", out[-3000:]
    assert (
        "hsdp"
        in subprocess.run(
            [sys.executable, "-m", "pytest", "--help"], capture_output=True, text=True, timeout=120
        ).stdout
    )  # the plugin is loaded all the same


def test_under_xdist_each_worker_has_its_own_pools(tmp_path):
    d = write_tests(
        tmp_path,
        CONFTEST,
        test_x=(
            "import pytest\nimport torch.distributed as dist\n\n"
            + "".join(
                f"\n\n@pytest.mark.world_size(2)\ndef test_{i}(rank):\n    dist.barrier()\n"
                for i in range(4)
            )
        ),
    )
    results, out = run_pytest(d, "-n", "2", "--hsdp-backend", "gloo")
    assert sorted(results) == [f"test_{i}" for i in range(4)], out[-3000:]
    assert all(r[0] == "passed" for r in results.values()), results
