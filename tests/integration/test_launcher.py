"""`python -m hsdp_backend.run`: torchrun that puts unchanged scripts on hsdp.

No backend, `"gloo"`, `"cpu:gloo,cuda:nccl"` (both orders,
positional or keyword) land on hsdp's shared-memory engine; other backends untouched; plain
torchrun untouched; a shadowed `sitecustomize` still runs; torch not imported by the hook.

Each launch starts torchrun's agent plus 2 ranks (about 8 s on 2 cores), so
the launches are few; the mapping rules themselves are checked without torch
in a plain interpreter that gets the launcher's environment."""

import os
import subprocess
import sys
import textwrap

import pytest

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(TESTS, "launcher_scripts")
ALLREDUCE = os.path.join(SCRIPTS, "allreduce.py")
ENGINE = os.path.join(SCRIPTS, "engine.py")
# A deadline for what must end, not a timing: torchrun and two ranks each import torch, which
# took over 120 s on 2 cores beside a CPU hog on each and a build.
LAUNCH_TIMEOUT_S = 300


def base_env(**extra) -> dict:
    env = dict(os.environ)
    # Whatever the suite itself was started with must not leak in.
    for name in ("HSDP_RUN_BACKEND_MAP", "HSDP_RUN_VERBOSE"):
        env.pop(name, None)
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def launch(launcher: list[str], script: str, *args, env=None, cwd=None):
    cmd = [
        sys.executable,
        *launcher,
        "--nproc-per-node",
        "2",
        # torchrun's agent binds its store on a port of its own choosing (port 0).
        "--standalone",
        script,
        *args,
    ]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT_S,
        env=env if env is not None else base_env(),
        cwd=cwd,
    )
    assert proc.returncode == 0, (
        f"{cmd} exited {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    )
    return proc


HSDP_RUN = ["-m", "hsdp_backend.run"]
TORCHRUN = ["-m", "torch.distributed.run"]


def rank_lines(stdout: str) -> list[str]:
    return sorted(line for line in stdout.splitlines() if line.startswith("rank "))


@pytest.mark.parametrize(
    "variant, shown",
    [
        ("none", "None"),
        ("gloo", "'gloo'"),
        ("cpu_cuda", "'cpu:gloo,cuda:nccl'"),
        ("cuda_cpu_kw", "'cuda:nccl,cpu:gloo'"),
    ],
)
def test_default_backends_run_on_hsdp(tmp_path, variant, shown):
    proc = launch(HSDP_RUN, ALLREDUCE, variant, env=base_env(HSDP_RUN_VERBOSE="1"), cwd=tmp_path)
    assert rank_lines(proc.stdout) == [
        "rank 0 backend hsdp sum 3.0 marker -",
        "rank 1 backend hsdp sum 3.0 marker -",
    ]
    for rank in (0, 1):
        assert (
            f"[hsdp.run rank {rank}] init_process_group(backend={shown}) -> 'hsdp'" in proc.stderr
        ), proc.stderr


@pytest.mark.every_torch
def test_group_really_runs_on_hsdp_and_chains_sitecustomize(tmp_path):
    # A sitecustomize already on the user's PYTHONPATH, which the injected
    # one shadows: it must still run, as the module named sitecustomize.
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text(
        "import os\nos.environ['CHAINED_SITECUSTOMIZE'] = 'ran-as-' + __name__\n"
    )
    env = base_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(theirs), env.get("PYTHONPATH", "")] if p)
    proc = launch(HSDP_RUN, ENGINE, env=env, cwd=tmp_path)
    assert rank_lines(proc.stdout) == [
        "rank 0 backend hsdp engine shm marker ran-as-sitecustomize",
        "rank 1 backend hsdp engine shm marker ran-as-sitecustomize",
    ]
    assert "[hsdp.run" not in proc.stderr  # quiet unless HSDP_RUN_VERBOSE=1


def test_plain_torchrun_keeps_gloo(tmp_path):
    # The mapping is the launcher's doing only: installing hsdp_backend
    # changes nothing for a script run by torchrun itself.
    proc = launch(TORCHRUN, ALLREDUCE, "gloo", env=base_env(HSDP_RUN_VERBOSE="1"), cwd=tmp_path)
    assert rank_lines(proc.stdout) == [
        "rank 0 backend gloo sum 3.0 marker -",
        "rank 1 backend gloo sum 3.0 marker -",
    ]
    assert "[hsdp.run" not in proc.stderr


def test_plain_torchrun_script_naming_hsdp(tmp_path):
    # The script never imports hsdp_backend; torch finds it by entry point.
    proc = launch(TORCHRUN, ALLREDUCE, "hsdp", cwd=tmp_path)
    assert rank_lines(proc.stdout) == [
        "rank 0 backend hsdp sum 3.0 marker -",
        "rank 1 backend hsdp sum 3.0 marker -",
    ]


# --- without torch: a plain interpreter with the launcher's environment ----


def launcher_env(**extra) -> dict:
    from hsdp_backend.run import prepare_env

    return prepare_env(base_env(**extra))


def plain_python(code: str, env: dict, cwd) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=60,
    )
    assert proc.returncode == 0, f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    return proc


def test_prepare_env_only_prepends_and_enables(tmp_path):
    from hsdp_backend.run import launch_dir, prepare_env

    env = prepare_env({"PYTHONPATH": "/a" + os.pathsep + "/b", "OTHER": "x"})
    assert env == {
        "PYTHONPATH": os.pathsep.join([launch_dir(), "/a", "/b"]),
        "HSDP_RUN_BACKEND_MAP": "1",
        "OTHER": "x",
    }
    assert prepare_env(dict(env)) == env  # a nested launch adds nothing
    assert prepare_env({})["PYTHONPATH"] == launch_dir()
    # The injected directory holds the sitecustomize and nothing importable else.
    assert sorted(n for n in os.listdir(launch_dir()) if n != "__pycache__") == ["sitecustomize.py"]


def test_sitecustomize_does_not_import_torch(tmp_path):
    # Every process a rank spawns runs the injected sitecustomize.
    proc = plain_python(
        """
        import sys, sitecustomize
        print("file", sitecustomize.__file__)
        print("torch", "torch" in sys.modules, "hsdp", "hsdp_backend" in sys.modules)
        print("hooked", any(type(f).__name__ == "_Finder" for f in sys.meta_path))
        """,
        launcher_env(),
        tmp_path,
    )
    from hsdp_backend.run import launch_dir

    assert f"file {os.path.join(launch_dir(), 'sitecustomize.py')}" in proc.stdout
    assert "torch False hsdp False" in proc.stdout
    assert "hooked True" in proc.stdout


def test_hook_is_off_without_the_launchers_variable(tmp_path):
    env = launcher_env()
    del env["HSDP_RUN_BACKEND_MAP"]
    proc = plain_python(
        """
        import sys, sitecustomize
        print("hooked", any(type(f).__name__ == "_Finder" for f in sys.meta_path))
        """,
        env,
        tmp_path,
    )
    assert "hooked False" in proc.stdout


def test_other_backends_are_passed_through_and_import_errors_explain(tmp_path):
    proc = plain_python(
        """
        import sys, sitecustomize
        sys.modules["hsdp_backend"] = None  # `import hsdp_backend` now fails
        calls = []
        wrapped = sitecustomize._hsdp_wrap(lambda *a, **k: calls.append((a, k)))
        wrapped("nccl")
        wrapped("mpi", rank=0)
        wrapped(backend="hsdp")
        wrapped(backend="cuda:nccl")
        wrapped("cpu:gloo")
        print("calls", calls)
        try:
            wrapped("gloo")
        except ImportError as exc:
            print("error", exc)
        """,
        launcher_env(HSDP_RUN_VERBOSE="1"),
        tmp_path,
    )
    assert (
        "calls [(('nccl',), {}), (('mpi',), {'rank': 0}), ((), {'backend': 'hsdp'}), "
        "((), {'backend': 'cuda:nccl'}), (('cpu:gloo',), {})]"
    ) in proc.stdout
    assert "error hsdp_backend.run:" in proc.stdout
    assert "hsdp-backend package is installed" in proc.stdout
    assert "[hsdp.run" not in proc.stderr  # nothing was mapped
