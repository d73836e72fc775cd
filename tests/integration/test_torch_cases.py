"""torch's own distributed test classes, unchanged, on pytest_hsdp's warm ranks: the same
outcomes as under torch's harness, faster.

A test file written as torch's distributed tests are (a `MultiProcessTestCase` with a
`FileStore` of its `file_name`, parametrize from torch's helpers, `skip_if_lt_x_gpu`, a
`unittest.SkipTest` with a reason, `expectedFailure`, a rank that `sys.exit`s and one that
dies, a hang under torch's own `TIMEOUT_OVERRIDE`, a `DTensorTestBase` test with `with_comms`
at 4 ranks, an FSDP2 step at 2 ranks and an HSDP one at 4, an `FSDPTest` (which skips without
GPUs), a class expecting an exit code) is run by a pytest of its own twice: under the
plugin, and under torch's spawning (`--hsdp-torch-cases=off`). Every test has the same outcome
in both; under the plugin the tests of one world size share their ranks, a skip says torch's
reason, the class that expects an exit code falls back to torch's spawning and says so once,
bad `world_size`s fail naming the test, a test that leaves its group needs nothing of the next,
and no store file, rank or shared memory is left."""

from __future__ import annotations

import os

import pytest
from plugin_runs import alive, all_gone, every_pid, pids, run_pytest, write_tests

from tools import settings

# Whether the files also run under torch's own harness, against the tables of its outcomes.
TORCH_HARNESS = settings.read("HSDP_TEST_TORCH_HARNESS")

# Torch's harness is read per release: runs on every supported torch too.
# Deadlines, generous for a loaded machine: torch's harness spawns and imports torch per test.
SPAWNED_RUN_S = 1800
pytestmark = [pytest.mark.timeout(SPAWNED_RUN_S + 900), pytest.mark.every_torch]

TORCH_STYLE = """
import copy
import multiprocessing
import os
import pathlib
import sys
import time
import unittest

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.testing._internal import common_distributed
from torch.testing._internal.common_distributed import MultiProcessTestCase, skip_if_lt_x_gpu
from torch.testing._internal.common_fsdp import FSDPTest
from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize
from torch.testing._internal.distributed._tensor.common_dtensor import DTensorTestBase, with_comms

common_distributed.TIMEOUT_OVERRIDE["test_rank_1_hangs"] = 10  # torch's per-test deadline
# Torch's default deadline (300 s) is for one test's spawned ranks on an idle machine; a loaded
# one can take longer to import torch in each.
common_distributed.TIMEOUT_DEFAULT = 1200


def record_pid(tag, rank):
    (pathlib.Path(os.environ["PIDS_DIR"]) / f"{tag}.rank{rank}").write_text(str(os.getpid()))


class CollectivesTest(MultiProcessTestCase):
    def setUp(self):
        super().setUp()
        os.environ["SET_BY_SETUP"] = "yes"  # spawned ranks inherit the parent's environment
        self._spawn_processes()

    @property
    def world_size(self):
        return 2

    def _init(self):
        store = dist.FileStore(self.file_name, self.world_size)
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.world_size)

    def test_all_reduce(self):
        self._init()
        record_pid("all_reduce", self.rank)
        assert os.environ["SET_BY_SETUP"] == "yes"
        t = torch.ones(4) * (self.rank + 1)
        dist.all_reduce(t)
        self.assertEqual(t, torch.full((4,), 3.0))

    def test_fails_on_rank_1(self):
        self._init()
        self.assertEqual(self.rank, 0)

    def test_skips_with_a_reason(self):
        raise unittest.SkipTest("not on this machine")

    @skip_if_lt_x_gpu(2)
    def test_needs_two_gpus(self):
        pass

    @parametrize("n", [1, 3])
    def test_parametrized(self, n):
        self._init()
        record_pid(f"param{n}", self.rank)
        t = torch.full((n,), float(self.rank))
        dist.broadcast(t, src=1)
        self.assertEqual(t, torch.ones(n))

    @unittest.expectedFailure
    def test_expected_failure(self):
        self.assertEqual(self.rank, 7)

    def test_rank_1_exits_3(self):
        if self.rank == 1:
            sys.exit(3)  # torch's parent reads rank 0's exit code only

    def test_rank_1_dies(self):
        if self.rank == 1:
            os._exit(9)

    def test_rank_0_exits_4(self):
        if self.rank == 0:
            sys.exit(4)

    def test_leaves_its_group(self):
        self._init()  # destroyed after the test, as torch's run_test does

    def test_after_a_left_group(self):
        self._init()
        record_pid("after_left", self.rank)
        dist.barrier()

    def test_rank_1_hangs(self):
        if self.rank == 1:
            time.sleep(600)


instantiate_parametrized_tests(CollectivesTest)


class ExpectsAnExitCode(MultiProcessTestCase):
    def setUp(self):
        super().setUp()
        # When it runs, the listed test is join_or_run's wrapper: torch matches what it wraps.
        listed = self.test_every_rank_exits_5
        self.special_return_code_checks = {getattr(listed, "__wrapped__", listed): 5}
        self._spawn_processes()

    @property
    def world_size(self):
        return 2

    def test_every_rank_exits_5(self):
        sys.exit(5)

    def test_not_listed(self):
        # Torch expects exit codes of the listed test only (`fn in special_return_code_checks`).
        names = pathlib.Path(os.environ["PIDS_DIR"]).parent / "names"
        names.mkdir(exist_ok=True)
        (names / f"not_listed.rank{self.rank}").write_text(multiprocessing.current_process().name)


class BadWorldSizes(MultiProcessTestCase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()

    @property
    def world_size(self):
        if self._testMethodName == "test_world_size_raises":
            raise RuntimeError("no world size today")
        return 0

    def test_world_size_raises(self):
        pass

    def test_world_size_zero(self):
        pass


class DTensorOpsTest(DTensorTestBase):
    @property
    def world_size(self):
        return 4

    @with_comms
    def test_shard_and_gather(self):
        record_pid("dtensor", self.rank)
        mesh = init_device_mesh(self.device_type, (self.world_size,))
        full = torch.arange(16.0).reshape(4, 4)
        d = distribute_tensor(full, mesh, [Shard(0)])
        self.assertEqual(d.to_local(), full[self.rank : self.rank + 1])
        self.assertEqual(d.redistribute(mesh, [Replicate()]).to_local(), full)

    @with_comms
    def test_sum_of_a_sharded_tensor(self):
        record_pid("dtensor_sum", self.rank)
        mesh = init_device_mesh(self.device_type, (self.world_size,))
        d = distribute_tensor(torch.ones(8, 2), mesh, [Shard(0)])
        self.assertEqual(d.sum().full_tensor(), torch.tensor(16.0))


# One FSDP2 step against the same step on one process: each rank's batch its own, the
# reference's loss their mean (FSDP2 averages gradients over the data-parallel ranks).
def fsdp2_step(case, mesh_shape, names):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    reference = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    fully_shard(model, mesh=mesh)
    seeds = [torch.Generator().manual_seed(r) for r in range(case.world_size)]
    batches = [torch.randn(3, 8, generator=g) for g in seeds]
    for m, loss in (
        (model, model(batches[case.rank]).square().sum()),
        (reference, sum(reference(b).square().sum() for b in batches) / case.world_size),
    ):
        loss.backward()
        torch.optim.SGD(m.parameters(), lr=0.1).step()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.full_tensor(), q, rtol=1e-5, atol=1e-6)


class OnGPUsOnly(FSDPTest):
    # FSDPTest's own _run skips where there are fewer accelerators than ranks (2.11-2.15).
    @property
    def world_size(self):
        return 2

    def test_fsdp_test_needs_gpus(self):
        fsdp2_step(self, (2,), ("shard",))


class FSDP2Steps(MultiProcessTestCase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()

    @property
    def world_size(self):
        return 2

    def test_fsdp2_step(self):
        record_pid("fsdp", self.rank)
        store = dist.FileStore(self.file_name, self.world_size)
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.world_size)
        fsdp2_step(self, (2,), ("shard",))
        dist.destroy_process_group()


class HSDPStep(DTensorTestBase):
    @property
    def world_size(self):
        return 4

    @with_comms
    def test_hsdp_step(self):
        record_pid("hsdp", self.rank)
        fsdp2_step(self, (2, 2), ("replicate", "shard"))
"""

# What torch's harness gives each test, and so must the plugin; but a world size of 0, where
# torch's harness spawns nothing and passes the test unrun, fails under the plugin.
EXPECTED = {
    "test_all_reduce": "passed",
    "test_fails_on_rank_1": "failure",
    "test_skips_with_a_reason": "skipped",
    "test_needs_two_gpus": "skipped",
    "test_parametrized_n_1": "passed",
    "test_parametrized_n_3": "passed",
    "test_expected_failure": "skipped",  # JUnit's xfail
    "test_rank_1_exits_3": "passed",
    "test_rank_1_dies": "passed",
    "test_rank_0_exits_4": "failure",
    "test_leaves_its_group": "passed",
    "test_after_a_left_group": "passed",
    "test_rank_1_hangs": "failure",
    "test_every_rank_exits_5": "passed",
    "test_not_listed": "passed",
    "test_shard_and_gather": "passed",
    "test_sum_of_a_sharded_tensor": "passed",
    "test_fsdp2_step": "passed",
    "test_hsdp_step": "passed",
    "test_fsdp_test_needs_gpus": "skipped",
    "test_world_size_raises": "failure",
}
PLUGIN_ONLY = {"test_world_size_zero": "failure"}


def test_torch_test_classes_run_unchanged_on_warm_ranks_as_under_torchs_harness(tmp_path):
    d = write_tests(tmp_path, test_torch_style=TORCH_STYLE)
    shm_before = set(os.listdir("/dev/shm"))
    tmp = tmp_path / "tmp"  # the store files' directory (torch makes them with tempfile)
    tmp.mkdir()
    results, out = run_pytest(d, env={"TMPDIR": str(tmp)})
    got = {name: state for name, (state, _) in results.items()}
    assert got == {**EXPECTED, **PLUGIN_ONLY}, out[-6000:]

    def text(name):
        return results[name][1]

    # Warm ranks: one pool per world size served its tests, kept across a group left behind.
    assert len(set(pids(d, "all_reduce"))) == 2
    assert pids(d, "all_reduce") == pids(d, "param1") == pids(d, "param3")
    assert pids(d, "dtensor") == pids(d, "dtensor_sum") == pids(d, "hsdp")
    assert len(set(pids(d, "dtensor"))) == 4 and len(set(pids(d, "fsdp"))) == 2
    # Failures say which rank raised and how; skips give torch's reasons.
    assert "1 of 2 ranks raised" in text("test_fails_on_rank_1"), text("test_fails_on_rank_1")
    assert "--- rank 1 ---" in text("test_fails_on_rank_1")
    assert "not on this machine" in text("test_skips_with_a_reason")
    from torch.testing._internal.common_distributed import TEST_SKIPS

    # This release's message for the code skip_if_lt_x_gpu(2) exits with (its name changed in 2.15).
    two_gpus = next(s.message for s in TEST_SKIPS.values() if s.exit_code == 77)
    assert two_gpus in text("test_needs_two_gpus")
    assert two_gpus in text("test_fsdp_test_needs_gpus")  # FSDPTest's _run: the same code
    assert "Expected exit code 0 but got 4 for rank 0" in text("test_rank_0_exits_4")
    assert "did not return within" in text("test_rank_1_hangs"), text("test_rank_1_hangs")
    assert "no world size today" in text("test_world_size_raises")
    assert "world_size is 0" in text("test_world_size_zero")
    # The test that expects an exit code ran on torch's spawning, said once; its class's other
    # test on warm ranks.
    assert out.count("ExpectsAnExitCode: torch's own spawning, as") == 1, out[-3000:]
    names = [(d.parent / "names" / f"not_listed.rank{r}").read_text() for r in range(2)]
    assert all(n.startswith("pytest-hsdp-rank") for n in names), names
    # Nothing left: ranks, store files, shared memory.
    assert all_gone(every_pid(d)), [p for p in every_pid(d) if alive(p)]
    left = [p for p in tmp.iterdir() if p.is_file()]  # torch's caches make directories there
    assert not left, left
    assert not {n for n in set(os.listdir("/dev/shm")) - shm_before if n.startswith("hsdp")}


@pytest.mark.skipif(not TORCH_HARNESS, reason="torch's own harness: HSDP_TEST_TORCH_HARNESS=1")
def test_the_table_is_torchs_own_outcomes(tmp_path):
    """The same file under torch's own harness: the outcome the table gives every test."""
    d = write_tests(tmp_path, test_torch_style=TORCH_STYLE)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    theirs, out = run_pytest(
        d, "--hsdp-torch-cases=off", env={"TMPDIR": str(tmp)}, timeout=SPAWNED_RUN_S
    )
    assert {name: state for name, (state, _) in theirs.items()} == {
        **EXPECTED,
        "test_world_size_zero": "passed",
    }, out[-6000:]
