"""How torch finds hsdp (the autoload and backends entry points), and that neither can break torch.

How torch finds hsdp: the autoload entry point at `import torch`, the
torch.distributed.backends entry point, and that neither can break torch."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from hsdp_backend import _torch_compat


def python(code: str, env: dict | None = None, cwd=None, timeout=120):
    """Runs code in a fresh interpreter (import torch happens there)."""
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=cwd,
        timeout=timeout,
    )
    return proc


@pytest.mark.every_torch
def test_import_torch_registers_hsdp_lazily(tmp_path):
    proc = python(
        """
        import sys, torch, torch.distributed as dist
        print("registered", "HSDP" in dist.Backend._plugins)
        print("extension loaded", "hsdp_backend._C" in sys.modules)
        """,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "registered True" in proc.stdout
    assert "extension loaded False" in proc.stdout


def test_autoload_disabled_by_env(tmp_path):
    proc = python(
        """
        import sys, torch, torch.distributed as dist
        print("imported", "hsdp_backend" in sys.modules)
        print("registered", "HSDP" in dist.Backend._plugins)
        """,
        env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"},
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "imported False" in proc.stdout
    assert "registered False" in proc.stdout


# torch.distributed resolves a backend name through the
# `torch.distributed.backends` entry-point group from torch 2.14 on
# (Backend._ensure_backend_registered, called by init_process_group, new_group
# and split_group); earlier releases never read that group.
TORCH_RESOLVES_DIST_ENTRY_POINTS = _torch_compat.LAZY_BACKEND_REGISTRATION

INIT_AND_ALL_REDUCE = """
    import datetime, torch, torch.distributed as dist
    {imports}
    dist.init_process_group("hsdp", init_method="tcp://127.0.0.1:0",
                            rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
    t = torch.ones(3)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    print("backend", dist.get_backend(), t.tolist())
    dist.destroy_process_group()
    """


def init_process_group(tmp_path, imports="", env=None):
    return python(INIT_AND_ALL_REDUCE.format(imports=imports), env=env, cwd=tmp_path)


def test_init_process_group_finds_hsdp_without_import(tmp_path):
    # Every supported torch: the autoload entry point registered the name at
    # `import torch`.
    proc = init_process_group(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "backend hsdp [1.0, 1.0, 1.0]" in proc.stdout


@pytest.mark.skipif(
    not TORCH_RESOLVES_DIST_ENTRY_POINTS,
    reason=f"torch {torch.__version__} does not read the torch.distributed.backends group",
)
def test_init_process_group_finds_hsdp_without_import_or_autoload(tmp_path):
    # With autoload off, torch.distributed's own entry-point group still
    # resolves the name when a process group asks for it.
    proc = init_process_group(tmp_path, env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert proc.returncode == 0, proc.stderr
    assert "backend hsdp [1.0, 1.0, 1.0]" in proc.stdout


@pytest.mark.skipif(
    TORCH_RESOLVES_DIST_ENTRY_POINTS,
    reason="covered by test_init_process_group_finds_hsdp_without_import_or_autoload",
)
def test_autoload_off_needs_the_import_before_torch_2_14(tmp_path):
    # What docs/versions.md says: on torch 2.13 with TORCH_DEVICE_BACKEND_AUTOLOAD=0
    # nothing registers "hsdp" until `import hsdp_backend`.
    env = {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    proc = init_process_group(tmp_path, env=env)
    assert proc.returncode != 0
    assert "Unknown backend type hsdp" in proc.stderr
    proc = init_process_group(tmp_path, imports="import hsdp_backend", env=env)
    assert proc.returncode == 0, proc.stderr
    assert "backend hsdp [1.0, 1.0, 1.0]" in proc.stdout


def test_failing_registration_never_breaks_import_torch(tmp_path):
    # A sitecustomize plants a registration module that raises, as a broken
    # install would; import torch must still succeed, with a warning.
    (tmp_path / "sitecustomize.py").write_text(
        textwrap.dedent(
            """
        import sys, types
        broken = types.ModuleType("hsdp_backend._registration")
        broken.BACKEND_NAME = "hsdp"
        def register():
            raise RuntimeError("simulated broken install")
        broken.register = register
        sys.modules["hsdp_backend._registration"] = broken
        """
        )
    )
    proc = python(
        """
        import warnings
        warnings.simplefilter("always")
        import torch
        print("torch ok", torch.ones(1).item())
        """,
        env={"PYTHONPATH": str(tmp_path)},
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "torch ok 1.0" in proc.stdout
    assert "simulated broken install" in proc.stderr


def test_unknown_group_backend_is_rejected_by_comm_stats(tmp_path):
    proc = python(
        """
        import datetime, torch, torch.distributed as dist, hsdp_backend
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0",
                                rank=0, world_size=1)
        try:
            hsdp_backend.comm_stats()
        except TypeError as exc:
            print("TypeError", exc)
        dist.destroy_process_group()
        """,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "TypeError" in proc.stdout and "not hsdp" in proc.stdout


def _creator_opts(**over):
    import datetime
    import types

    fields = dict(
        timeout=datetime.timedelta(seconds=7),
        global_ranks_in_group=[0, 2],
        group_id="g7",
        split_from=None,
        enable_reconfigure=False,
    )
    fields.update(over)
    return types.SimpleNamespace(**fields)


def test_inner_nccl_takes_the_users_nccl_options_and_the_groups_fields():
    """A user's ProcessGroupNCCL.Options (pg_options) are the inner NCCL's own,
    with the group's timeout, ranks and name filled in, as torch's NCCL creator
    does; without them, torch's defaults. (Built here without a GPU: only the
    options; the inner NCCL is created when torch sees one.)"""
    import datetime

    import torch.distributed as dist

    from hsdp_backend import _registration

    if not dist.is_nccl_available():
        pytest.skip("this torch has no NCCL")
    user = dist.ProcessGroupNCCL.Options()
    user.is_high_priority_stream = True
    user.config.max_ctas = 4
    got = _registration._inner_nccl_options(_creator_opts(enable_reconfigure=True), user, None)
    assert got is user
    assert got.is_high_priority_stream and got.config.max_ctas == 4
    assert got._timeout == datetime.timedelta(seconds=7)
    assert list(got.global_ranks_in_group) == [0, 2] and got.group_name == "g7"
    assert got.enable_reconfigure
    default = _registration._inner_nccl_options(_creator_opts(), None, None)
    assert not default.is_high_priority_stream and not default.enable_reconfigure
    # options of another kind are not NCCL's: left alone, defaults used
    other = _registration._inner_nccl_options(_creator_opts(), object(), None)
    assert isinstance(other, dist.ProcessGroupNCCL.Options)
    # a split source that is not a ProcessGroupNCCL (an hsdp or gloo parent)
    # is not NCCL's to split: the inner NCCL is built from scratch
    assert _registration._split_parent(_creator_opts(split_from=object())) is None
