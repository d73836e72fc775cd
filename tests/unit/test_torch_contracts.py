"""What differs between torch 2.11 and 2.15 as a user meets it: releases outside the range refused,
2.15's contracts honoured.

What differs between the torch releases hsdp supports (2.11 to 2.15), as
a user meets it: a torch outside the range is refused clearly at build and
at group creation; torch 2.15's contracts (a split checks that the parent's
communicator exists; torch's own flight-recorder hook stays off a backend
that records itself) are honoured. Runs on every supported release
(the every_torch marker); the 2.15 contracts are skipped, saying
so, on the releases that do not have them.

What differs between releases as a user meets it: a torch outside 2.11-2.15 or without
distributed refused at configure (a fake torch) and at group creation; 2.15's split check,
flight-recorder listing."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from harness import cmake_configure, run_ranks
from hooks import NCCL_CONTRACT, engine_env

from hsdp_backend import _torch_compat

# Runs on every supported torch release too (scripts/test.sh's compat stages).
pytestmark = pytest.mark.every_torch

ROOT = Path(__file__).resolve().parents[2]
AT_LEAST_2_15 = _torch_compat.version() >= (2, 15)


@pytest.mark.parametrize("release", ["2.10.0", "2.16.0", "3.0.0+cpu"])
def test_a_release_outside_the_range_is_named_with_the_range(release):
    problem = _torch_compat.unsupported(release)
    assert problem is not None
    assert f"this is torch {release}" in problem and "2.11 to 2.15" in problem


@pytest.mark.parametrize("release", ["2.11.0", "2.12.1", "2.13.0+cpu", "2.14.1+cu130", "2.15.0"])
def test_every_supported_release_is_accepted(release):
    assert _torch_compat.unsupported(release) is None


def test_a_torch_without_distributed_is_named(monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_available", lambda: False)
    problem = _torch_compat.unsupported()
    assert problem is not None and "built without torch.distributed" in problem, problem
    assert f"torch {torch.__version__}" in problem


def test_group_creation_on_an_unsupported_torch_raises_naming_the_range(tmp_path):
    """The creator refuses before loading the extension (built for another
    torch, it would fail to load with an undefined symbol)."""
    script = textwrap.dedent(
        f"""
        import warnings, torch, torch.distributed as dist
        torch.__version__ = "2.16.0"
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            import hsdp_backend
        print("WARNED", any("supports torch 2.11 to 2.15" in str(w.message) for w in record))
        try:
            dist.init_process_group("hsdp", init_method="file://{tmp_path}/store", rank=0, world_size=1)
        except Exception as exc:
            print("RAISED", type(exc).__name__, exc)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"},
    )
    out = proc.stdout + proc.stderr
    assert "WARNED True" in out, out
    assert (
        "RAISED" in out
        and "[rank 0/1] init_process_group: hsdp_backend supports torch 2.11 to 2.15" in out
    ), out
    assert "this is torch 2.16.0" in out, out


@pytest.mark.parametrize(
    "release, distributed, expected",
    [
        ("2.16.0", True, ["hsdp_backend supports torch 2.11 to 2.15", "has torch 2.16.0"]),
        ("2.10.1", True, ["hsdp_backend supports torch 2.11 to 2.15", "has torch 2.10.1"]),
        ("2.14.1", False, ["was built without torch.distributed"]),
    ],
    ids=["2.16", "2.10", "no-distributed"],
)
def test_the_build_refuses_a_torch_it_cannot_serve_saying_why(
    tmp_path, release, distributed, expected
):
    """CMake's configure step reads the interpreter's torch: a fake torch on
    its path stops it with what is wrong and what to install."""
    fake = tmp_path / "fake" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        textwrap.dedent(
            f"""
            import types
            __version__ = "{release}"
            _C = types.SimpleNamespace(_GLIBCXX_USE_CXX11_ABI=True)
            version = types.SimpleNamespace(cuda=None)
            distributed = types.SimpleNamespace(is_available=lambda: {distributed})
            """
        )
    )
    rc, out = cmake_configure(tmp_path / "build", {"PYTHONPATH": str(tmp_path / "fake")})
    assert rc != 0, out
    for text in expected:
        assert text in out, out


def test_the_release_flags_say_what_this_torch_does(tmp_path):
    """Each of _torch_compat's flags about torch's own API, checked against
    the torch at hand (one rank): a flag that says the wrong thing fails
    here, on the release where it is wrong."""
    script = textwrap.dedent(
        f"""
        import torch, torch.distributed as dist
        import hsdp_backend
        from hsdp_backend import _torch_compat as compat
        dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
        work = dist.all_reduce(torch.ones(2), async_op=True)
        work.wait()
        try:
            readable = work.exception() is None
        except TypeError:
            readable = False
        assert readable == compat.WORK_EXCEPTION_IN_PYTHON, readable
        direct = hasattr(torch._C._distributed_c10d.Backend, "all_gather_single_coalesced")
        assert direct == compat.BACKEND_COALESCED_CALLS_IN_PYTHON, direct
        g = dist.new_group(backend="hsdp")
        try:
            any_backend = g._get_sequence_number_for_group() == 0
        except RuntimeError as exc:
            assert "does not yet support sequence numbers" in str(exc), exc
            any_backend = False
        assert any_backend == compat.SEQUENCE_NUMBERS_OF_ANY_BACKEND, any_backend
        try:
            dist.monitored_barrier(group=g)
            monitored = True
        except ValueError as exc:
            assert "only implemented for GLOO" in str(exc), exc
            monitored = False
        assert monitored == compat.MONITORED_BARRIER_ON_ANY_BACKEND, monitored
        dist.destroy_process_group()
        print("FLAGS AGREE")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert "FLAGS AGREE" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.skipif(not AT_LEAST_2_15, reason="torch < 2.15 has no _FR_SELF_RECORDING_BACKENDS")
def test_torch_attaches_no_flight_recorder_hook_to_hsdp_groups():
    from torch.distributed import distributed_c10d as c10d

    assert "hsdp" in c10d._FR_SELF_RECORDING_BACKENDS
    for result in run_ranks(flight_recorder_hooks_body, 2):
        assert result == {"hooks": 0, "sum": [2.0]}, result


def flight_recorder_hooks_body(rank, world):
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    sub = dist.new_group([0, 1])
    t = torch.ones(1)
    dist.all_reduce(t, group=sub)
    return {"hooks": len(c10d._world.pg_flight_recorder_hooks), "sum": t.tolist()}


def split_before_any_collective_body(rank, world):
    import torch.distributed as dist

    try:
        dist.split_group(split_ranks=[[0, 1]])
        first = "split"
    except Exception as exc:  # noqa: BLE001 - what the user sees
        first = f"{type(exc).__name__}: {exc}"
    ones = torch.ones(2)
    dist.all_reduce(ones)  # the group is usable, and its communicator now exists
    child = dist.split_group(split_ranks=[[0, 1]])
    twos = torch.ones(2)
    dist.all_reduce(twos, group=child)
    return {"first": first, "sum": ones.tolist(), "child sum": twos.tolist()}


@pytest.mark.skipif(not AT_LEAST_2_15, reason="Backend::isInitialized() arrived in torch 2.15")
def test_a_split_before_the_communicator_exists_raises_clearly_and_the_group_stays_usable():
    """Through the NCCL-contract double, which has no communicator until its
    first collective (as ProcessGroupNCCL: isInitialized() false). torch
    2.15's split_group asks the parent's backend, hsdp, which answers for its
    inner ones: torch's own error, on every rank, before any split starts
    (were hsdp to answer true, its split would raise its own error instead:
    ProcessGroupHSDP::split checks too, for callers that do not ask)."""
    results = run_ranks(
        split_before_any_collective_body, 2, env=engine_env(NCCL_CONTRACT), fresh=True
    )
    for result in results:
        assert result["first"].startswith("RuntimeError"), result
        assert "Parent process group backend is not initialized" in result["first"], result
        assert result["sum"] == [2.0, 2.0] and result["child sum"] == [2.0, 2.0], result
