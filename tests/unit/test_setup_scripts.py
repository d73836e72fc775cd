"""The set-up's shortcuts: scripts/sync_python.py (Python-only changes) and
scripts/compiler_cache.sh (ccache).

The set-up's steps. scripts/sync_python.py: the shortcut when only a package's Python files
changed; scripts/compiler_cache.sh: every build's compiler cache.

`scripts/sync_python.py`: the same files copied over the installed ones; a module added or removed, or an installed copy
whose extension does not import, left to a rebuild (exit 1, nothing copied); a venv built from
the current sources left alone whether its python is named relative to the root or by absolute
path. `scripts/compiler_cache.sh`: builds compile through ccache with paths hashed relative to
the clone and the build directory unhashed (what lets a second clone hit the first one's
entries), and without it under `HSDP_NO_CCACHE=1`.

A venv whose installed copy of the package is refreshed by copying must end up exactly as a
rebuild would leave it, or the shortcut must refuse (exit 1) so that the caller rebuilds."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def make_package(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / "pkgx" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkgx"


def sync(source: Path, installed_parent: Path) -> int:
    env = {**os.environ, "PYTHONPATH": str(installed_parent)}
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "sync_python.py"), str(source)],
        env=env,
        cwd=ROOT,
        timeout=60,
    ).returncode


def test_the_same_files_are_copied_over_the_installed_ones(tmp_path):
    installed = make_package(
        tmp_path / "site", {"__init__.py": "", "_C.py": "", "sub/mod.py": "old = 1\n"}
    )
    source = make_package(
        tmp_path / "src", {"__init__.py": "", "_C.py": "", "sub/mod.py": "new = 2\n"}
    )
    assert sync(source, tmp_path / "site") == 0
    assert (installed / "sub" / "mod.py").read_text() == "new = 2\n"


def test_an_added_or_removed_module_is_left_to_a_rebuild(tmp_path):
    installed = make_package(tmp_path / "site", {"__init__.py": "", "_C.py": "", "a.py": "x\n"})
    source = make_package(
        tmp_path / "src", {"__init__.py": "", "_C.py": "", "a.py": "y\n", "b.py": ""}
    )
    assert sync(source, tmp_path / "site") == 1
    assert (installed / "a.py").read_text() == "x\n"  # nothing copied
    (source / "b.py").unlink()
    (source / "a.py").unlink()
    assert sync(source, tmp_path / "site") == 1


def test_an_installed_copy_whose_extension_does_not_import_is_left_to_a_rebuild(tmp_path):
    make_package(tmp_path / "site", {"__init__.py": "", "a.py": ""})
    source = make_package(tmp_path / "src", {"__init__.py": "", "a.py": ""})
    assert sync(source, tmp_path / "site") == 1


def test_an_up_to_date_venv_is_left_alone_whichever_way_its_python_is_named():
    """scripts/setup.sh names the main venv's python relative to the root, setup_compat.sh
    names its venvs' by absolute path: either way, a venv built from these sources is
    recognised (no copy, no build, nothing printed)."""
    if not (ROOT / "build" / ".setup-stamp").exists():
        return  # not set up by scripts/setup.sh: nothing to recognise
    for python in (".venv/bin/python", str(ROOT / ".venv" / "bin" / "python")):
        proc = subprocess.run(
            [
                "bash",
                "-c",
                'source scripts/venv_steps.sh && build_package "$0" build/.setup-stamp '
                "-C cmake.define.HSDP_BUILD_TESTING=ON",
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
        timeout=60,
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
