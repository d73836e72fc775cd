"""The FSDP2 shim's proof at install: passes on this torch, refuses a shim whose gradient tail
differs, leaves nothing behind.

The FSDP2 shim's proof at install (hsdp_backend/fsdp/_proof.py): it passes
on this torch having compared real gradients, on every engine and whether or
not a default group exists yet; a shim whose gradient tail differs from
FSDP2's is refused with one warning that names the difference; and neither
leaves a group, thread or shared-memory segment behind.

The FSDP2 shim's proof at install: it passes on this torch having compared real gradients (every
case, fp32 and bf16, two backwards, the shim's tail run for each group) without moving the
caller's RNG, once per install, on every engine, and on automatic install in a 2-rank world
whether FSDP2 is imported before the default group exists or after; a tail that perturbs one
value, changes a stride or a dtype, or raises is refused with one warning naming the difference
and FSDP2's functions untouched; no group, thread or `/dev/shm` segment is left behind."""

import glob
import importlib
import logging
import os
import re
import sys
import warnings

import pytest
import torch
from harness import run_ranks
from hooks import ENGINES, NCCL_CONTRACT, engine_env, nccl_contract_inner

# Runs on every supported torch release too (scripts/test.sh's compat stages).
pytestmark = pytest.mark.every_torch

# The shim's tail runs once per param group and backward: three groups, two backwards.
FINISHES_PER_CASE = 3 * 2


@pytest.fixture
def shim(monkeypatch):
    """hsdp_backend.fsdp, not installed and with no proof remembered; put back
    as it was afterwards."""
    import torch.distributed.fsdp  # noqa: F401 - what the shim adapts

    from hsdp_backend import fsdp

    was_enabled = fsdp.is_enabled()
    fsdp.disable()
    fsdp._compat._shim.warned.discard("disproved")
    yield fsdp
    monkeypatch.undo()  # FSDP2's and the shim's own functions back before re-enabling
    fsdp.disable()
    if was_enabled:
        fsdp.enable()


def fsdp2_functions():
    """The FSDP2 functions the shim replaces while it is installed."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as module

    return (
        module.foreach_reduce,
        module.FSDPParamGroup._init_mp_dtypes,
        module.FSDPParamGroup.__init__,
        getattr(FSDPModule, "reset_iter_state", None),  # torch >= 2.13
    )


def counting(monkeypatch, owner, name: str) -> list:
    """Replaces ``owner.name`` by a wrapper that records each call's arguments."""
    calls = []
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapper)
    return calls


@pytest.mark.quick
def test_the_proof_passes_on_this_torch_having_compared_real_gradients(shim, monkeypatch):
    from hsdp_backend.fsdp import _compat, _proof

    compared = counting(monkeypatch, _proof, "_difference")
    finishes = counting(monkeypatch, _compat.PendingGrads, "finish")
    proofs = counting(monkeypatch, _proof, "first_difference")
    rng = torch.get_rng_state()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a passing proof warns of nothing
        with torch.no_grad():  # an install may come from anywhere, e.g. a group made under no_grad
            assert shim.enable() is True
    assert torch.equal(torch.get_rng_state(), rng), "the proof moved the caller's RNG"
    assert shim.is_enabled()
    assert fsdp2_functions()[0] is _compat._foreach_reduce

    assert len(compared) == len(_proof.CASES)
    assert len(finishes) == len(_proof.CASES) * FINISHES_PER_CASE, "the shim's tail did not run"
    grad_dtypes = set()
    for native, shimmed in compared:
        for backwards in (native, shimmed):
            assert len(backwards) == 2
            first, second = backwards
            assert sorted(first) == ["0.bias", "0.weight", "1.bias", "1.weight", "2.weight"]
            for name, grad in first.items():
                assert grad.meta["type"] == "DTensor" and grad.meta["hook calls"] == 1, name
                assert grad.values.abs().sum() > 0, name
                # the second backward accumulated into the first's gradient
                assert not torch.equal(second[name].values, grad.values), name
                grad_dtypes.add(grad.meta["dtype"])
    assert grad_dtypes == {torch.float32, torch.bfloat16}

    # Proved once per install: not again while installed, again after disable().
    assert shim.enable() is True and len(proofs) == 1
    shim.disable()
    assert shim.enable() is True and len(proofs) == 2


@pytest.mark.parametrize("engine", ENGINES)
def test_the_proof_passes_on_every_engine(shim, monkeypatch, engine):
    from hsdp_backend import _registration

    for name, value in engine_env(engine).items():  # the proof's groups take the process's
        monkeypatch.setenv(name, value)
    if engine == NCCL_CONTRACT:  # ... and its hooks
        monkeypatch.setattr(_registration.hooks, "inner_cpu", nccl_contract_inner)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert shim.enable() is True


def _perturb_one_element(finish):
    def perturbed(self):
        self.flat[0] += 1
        finish(self)

    return perturbed


def _widen_to_fp64(finish):
    def widened(self):
        self.grad_dtypes = [torch.float64] * len(self.grad_dtypes)
        finish(self)

    return widened


def _column_major(finish):
    def column_major(self):
        for fsdp_param in self.fsdp_params:
            if len(fsdp_param.sharded_size) == 2:
                rows, _ = fsdp_param.sharded_size
                fsdp_param.contiguous_sharded_stride = (1, rows)
        finish(self)

    return column_major


def _raise(finish):
    def raising(self):
        raise RuntimeError("injected failure in the gradient tail")

    return raising


@pytest.mark.parametrize(
    "tail, difference",
    [
        (
            _perturb_one_element,
            r"fp32: 0\.weight's gradient after backward 1: 1 of 12 values differ",
        ),
        (
            _column_major,
            r"fp32: 0\.weight's gradient after backward 1: local stride \(1, 3\) where FSDP2 gives "
            r"\(4, 1\)",
        ),
        # torch itself refuses a .grad of another dtype than its parameter's
        (_widen_to_fp64, r"the proof raised RuntimeError: .*gradient with dtype 'double'"),
        (_raise, r"the proof raised RuntimeError: injected failure in the gradient tail"),
    ],
    ids=["value", "layout", "dtype", "raises"],
)
def test_a_tail_that_differs_is_refused_with_one_warning(shim, monkeypatch, tail, difference):
    from hsdp_backend.fsdp import _compat, _proof

    monkeypatch.setattr(_compat.PendingGrads, "finish", tail(_compat.PendingGrads.finish))
    proofs = counting(monkeypatch, _proof, "first_difference")
    native = fsdp2_functions()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert shim.enable() is False
        assert shim.enable() is False  # no second proof, no second warning
    messages = [str(w.message) for w in record if "hsdp_backend.fsdp" in str(w.message)]
    assert len(messages) == 1, messages
    assert re.search(difference, messages[0]), messages[0]
    assert "FSDP2 keeps its native reduction" in messages[0]
    assert len(proofs) == 1
    assert not shim.is_enabled()
    assert fsdp2_functions() == native, "FSDP2's functions were left patched"


def test_the_proof_leaves_no_group_thread_or_segment(shim):
    from torch.distributed import distributed_c10d as c10d

    def threads():
        return set(os.listdir("/proc/self/task"))

    def segments_and_groups():
        return sorted(glob.glob("/dev/shm/hsdp-*")), set(c10d._world.pg_map)

    assert shim.enable()  # the first proof starts torch's own pools (autograd, OpenMP)
    shim.disable()
    threads_before, before = threads(), segments_and_groups()
    assert shim.enable()
    assert threads() - threads_before == set(), "the proof left threads running"
    assert segments_and_groups() == before
    shim.disable()
    assert segments_and_groups() == before


def automatic_install_body(rank, world, order: str):
    """Creates the world's hsdp group and imports what a script imports, in
    the order ``order`` names, then uses FSDP2: the shim proves and installs
    at the first fully_shard, never before, never inside an import, and the
    world is untouched. ``import torch._dynamo`` (what DDP, DTensor,
    functional collectives and torch.compile import) imports FSDP2 half-way
    through its own body: the proof must not run there."""
    import torch.distributed as dist

    from hsdp_backend import fsdp as shim

    proofs = []
    handler = logging.Handler()
    handler.emit = lambda record: proofs.append(record.getMessage())
    log = logging.getLogger("hsdp_backend")
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        if order == "fsdp_first":
            importlib.import_module("torch.distributed.fsdp")
        dist.init_process_group("hsdp", rank=rank, world_size=world)
        if order == "dynamo_after_group":
            importlib.import_module("torch._dynamo")
        importlib.import_module("torch.distributed.fsdp")  # imported by now if fsdp_first
        from torch.distributed import distributed_c10d as c10d
        from torch.distributed.fsdp import fully_shard

        ones = torch.ones(3)
        dist.all_reduce(ones)
        before_use = {"enabled": shim.is_enabled(), "proofs": len(proofs)}
        model = torch.nn.Linear(4, 4)
        fully_shard(model)
        model(torch.ones(2, 4)).sum().backward()
    return {
        "before_use": before_use,
        "enabled": shim.is_enabled(),
        "proofs": [m for m in proofs if "proved against FSDP2's native path" in m],
        "warnings": [str(w.message) for w in record if "hsdp" in str(w.message)],
        "groups": sorted(pg.group_name for pg in c10d._world.pg_map),
        "sum": ones.tolist(),
    }


@pytest.mark.parametrize("order", ["fsdp_first", "group_first", "dynamo_after_group"])
def test_the_proof_runs_at_first_use_whatever_the_import_order(order):
    results = run_ranks(automatic_install_body, 2, backend=None, order=order)
    for result in results:
        assert result["before_use"] == {"enabled": False, "proofs": 0}, result
        assert result["enabled"], result
        assert len(result["proofs"]) == 1, result
        assert result["warnings"] == [], result
        assert len(result["groups"]) == 1, result  # the world's group alone
        assert result["sum"] == [2.0] * 3, result


def no_fsdp_use_body(rank, world):
    """A script that never uses FSDP2, though DTensor and dynamo import it."""
    import torch.distributed as dist

    from hsdp_backend import fsdp as shim

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        dist.init_process_group("hsdp", rank=rank, world_size=world)
        import torch._dynamo  # noqa: F401
        import torch.distributed._functional_collectives as funcol

        total = funcol.all_reduce(torch.ones(2), "sum", dist.group.WORLD)
        total = total.wait() if hasattr(total, "wait") else total
    return {
        "enabled": shim.is_enabled(),
        "proof imported": "hsdp_backend.fsdp._proof" in sys.modules,
        "warnings": [str(w.message) for w in record if "hsdp" in str(w.message)],
        "sum": total.tolist(),
    }


def test_a_script_that_never_uses_fsdp2_pays_nothing_and_sees_nothing():
    for result in run_ranks(no_fsdp_use_body, 2, backend=None):
        assert result == {
            "enabled": False,
            "proof imported": False,
            "warnings": [],
            "sum": [2.0, 2.0],
        }, result


def test_a_proof_that_cannot_run_is_not_blamed_on_the_shim(shim, monkeypatch):
    from hsdp_backend.fsdp import _compat, _proof

    def fsdp2_fails(case, mesh):
        raise AttributeError(
            "partially initialized module 'torch._dynamo' has no attribute 'disable'"
        )

    monkeypatch.setattr(_proof, "_train", fsdp2_fails)
    _compat._shim.warned.discard("unproven")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert shim.enable() is False
    messages = [str(w.message) for w in record if "hsdp_backend.fsdp" in str(w.message)]
    assert len(messages) == 1, messages
    assert (
        "could not run" in messages[0] and "says nothing about the shim's gradients" in messages[0]
    )
    assert "fp32" in messages[0] and "partially initialized module" in messages[0]
    assert "are not FSDP2's" not in messages[0]
    monkeypatch.undo()
    assert shim.enable() is True  # an explicit enable() tries again
