"""The set-up's steps: scikit-build-core's editable install (scripts/venv_steps.sh) and
scripts/compiler_cache.sh (ccache).

`scripts/venv_steps.sh`: the venv's hsdp_backend and pytest_hsdp are this clone's sources
(editable installs, each of its own distribution: a Python change needs no step, a module added
is found),
the extension and the tests' module built into the venv; a venv built from the current sources
and this clone left alone whether its python is named relative to the root or by absolute path.
`scripts/compiler_cache.sh`: builds compile through ccache with paths hashed relative to the
clone and the build directory unhashed (what lets a second clone hit the first one's entries),
and without it under `HSDP_NO_CCACHE=1`."""

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SET_UP = (ROOT / "build" / ".setup-stamp").exists()


@pytest.mark.skipif(not SET_UP, reason="not set up by scripts/setup.sh")
def test_the_venvs_python_packages_are_this_clones_sources(tmp_path):
    probe = ROOT / "src" / "hsdp_backend" / f"_probe_{os.getpid()}.py"
    probe.write_text("ANSWER = 42\n")
    try:
        out = subprocess.run(
            [
                str(ROOT / ".venv" / "bin" / "python"),
                "-c",
                "import hsdp_backend, pytest_hsdp, hsdp_backend._C, hsdp_testing; "
                f"from hsdp_backend import {probe.stem} as p; "
                "print(hsdp_backend.__file__, pytest_hsdp.__file__, p.ANSWER, "
                "hsdp_backend._C.__file__, hsdp_testing.__file__)",
            ],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout.split()
    finally:
        probe.unlink()
    assert out[:3] == [
        str(ROOT / "src" / "hsdp_backend" / "__init__.py"),
        str(ROOT / "pytest-hsdp" / "src" / "pytest_hsdp" / "__init__.py"),
        "42",
    ], out
    assert all("/.venv/" in path for path in out[3:]), out  # compiled into the venv


def test_an_up_to_date_venv_is_left_alone_whichever_way_its_python_is_named():
    """scripts/setup.sh names the main venv's python relative to the root, setup_compat.sh
    names its venvs' by absolute path: either way, a venv built from these sources is
    recognised (no build, nothing printed)."""
    if not SET_UP:
        pytest.skip("not set up by scripts/setup.sh: nothing to recognise")
    for python in (".venv/bin/python", str(ROOT / ".venv" / "bin" / "python")):
        proc = subprocess.run(
            [
                "bash",
                "-c",
                'source scripts/venv_steps.sh && build_package "$0" build/.setup-stamp editable '
                "-C cmake.define.HSDP_BUILD_TESTING=ON && "
                'install_plugin "$0" build/.setup-plugin-stamp editable',
                python,
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert proc.stdout + proc.stderr == "", (python, proc.stdout + proc.stderr)


def compiler_cache_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The build environment scripts/compiler_cache.sh leaves, sourced from the root with a
    `ccache` on PATH (a stand-in: the script only looks it up)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "ccache").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "ccache").chmod(0o755)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("CCACHE_", "CMAKE_", "HSDP_NO_CCACHE", "HSDP_VENV_CACHE"))
    }
    env.update(PATH=f"{bin_dir}:{env['PATH']}", HSDP_VENV_CACHE=str(tmp_path / "cache"), **extra)
    out = subprocess.run(
        ["bash", "-c", "source scripts/compiler_cache.sh && env -0"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        timeout=300,  # a deadline, not a timing: generous for a loaded machine
        check=True,
    ).stdout.decode()
    return dict(item.split("=", 1) for item in out.split("\0") if "=" in item)


def test_builds_compile_through_ccache_with_paths_relative_to_the_clone(tmp_path):
    """CMake takes the launcher from the environment; a second clone hits the first one's
    entries only if paths under the clone are hashed relative to it and the build directory
    is not hashed."""
    env = compiler_cache_env(tmp_path)
    assert env.get("CMAKE_CXX_COMPILER_LAUNCHER") == "ccache"
    assert env.get("CMAKE_C_COMPILER_LAUNCHER") == "ccache"
    assert env.get("CCACHE_BASEDIR") == str(ROOT)
    assert env.get("CCACHE_NOHASHDIR") == "1"
    assert env.get("CCACHE_DIR") == str(tmp_path / "cache" / "ccache")


def test_hsdp_no_ccache_compiles_without_it(tmp_path):
    env = compiler_cache_env(tmp_path, HSDP_NO_CCACHE="1")
    assert "CMAKE_CXX_COMPILER_LAUNCHER" not in env
    assert "CCACHE_DIR" not in env
