"""pytest-hsdp alone: a pure-Python wheel, which hsdp_backend's depends on; in a fresh venv of torch
and pytest only it runs the guide's example on gloo and torch's test classes on warm ranks, and
imports no torch in a session without distributed tests."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
from plugin_runs import run_pytest, write_tests

ROOT = Path(__file__).resolve().parents[2]
# Another release than the main venv's, and a CPU build (a fresh venv holds it whole): the one the
# machine's wheels hold, which scripts/setup_compat.sh installs for 2.13 too.
TORCH = "torch==2.13.0+cpu"


def pip(python: Path | str, *args: str, timeout: float = 600) -> str:
    proc = subprocess.run(
        [str(python), "-m", "pip", "--disable-pip-version-check", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"pip {' '.join(args)}:\n{proc.stdout}\n{proc.stderr}"[-4000:]
    return proc.stdout


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, Path]:
    """Both wheels, as a user builds them: the plugin from a copy of its folder (a build writes
    beside its sources), hsdp_backend into the tests' build tree of scripts/setup.sh."""
    out = tmp_path_factory.mktemp("wheels")
    source = out / "pytest-hsdp"
    shutil.copytree(
        ROOT / "pytest-hsdp",
        source,
        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"),
    )
    pip(sys.executable, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", out, source)
    pip(
        sys.executable,
        *("wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out)),
        *("-C", "cmake.define.HSDP_BUILD_TESTING=ON", str(ROOT)),
    )
    found = {w.name.split("-")[0]: w for w in out.glob("*.whl")}
    assert set(found) == {"pytest_hsdp", "hsdp_backend"}, sorted(out.iterdir())
    return found


def dist_info(wheel: Path, name: str) -> str:
    with zipfile.ZipFile(wheel) as z:
        (path,) = [n for n in z.namelist() if re.fullmatch(rf"[^/]+\.dist-info/{name}", n)]
        return z.read(path).decode()


def requires(wheel: Path) -> list[str]:
    return [
        line.split(":", 1)[1].strip()
        for line in dist_info(wheel, "METADATA").splitlines()
        if line.startswith("Requires-Dist:") and "extra ==" not in line
    ]


def test_the_plugins_wheel_is_pure_python_and_brings_no_torch(wheels):
    wheel = wheels["pytest_hsdp"]
    assert wheel.name.endswith("-py3-none-any.whl"), wheel.name
    with zipfile.ZipFile(wheel) as z:
        files = [n for n in z.namelist() if ".dist-info/" not in n]
    assert files and all(re.fullmatch(r"pytest_hsdp/\w+\.py", f) for f in files), files
    assert "[pytest11]\nhsdp = pytest_hsdp" in dist_info(wheel, "entry_points.txt")
    assert [r.split(">")[0] for r in requires(wheel)] == ["pytest"], requires(wheel)


def test_hsdp_backends_wheel_depends_on_the_plugin_instead_of_carrying_it(wheels):
    wheel = wheels["hsdp_backend"]
    with zipfile.ZipFile(wheel) as z:
        assert not [n for n in z.namelist() if n.startswith("pytest_hsdp")]
    assert "pytest11" not in dist_info(wheel, "entry_points.txt")
    assert any(r.startswith("pytest-hsdp") for r in requires(wheel)), requires(wheel)


@pytest.fixture(scope="module")
def venv_alone(wheels, tmp_path_factory):
    """A fresh venv with torch and pytest, then the plugin's wheel alone (removed afterwards:
    a torch is most of a gigabyte)."""
    root = tmp_path_factory.mktemp("alone")
    subprocess.run([sys.executable, "-m", "venv", str(root / "venv")], check=True, timeout=300)
    python = root / "venv" / "bin" / "python"
    try:
        pip(python, "install", "-q", TORCH, "pytest")
        # What installing hsdp_backend's wheel would bring: the plugin's wheel beside it.
        would = pip(
            python,
            *(
                "install",
                "--dry-run",
                "--no-index",
                "--find-links",
                str(wheels["pytest_hsdp"].parent),
            ),
            str(wheels["hsdp_backend"]),
        )
        assert re.search(r"Would install .*pytest-hsdp-0\.1\.0", would), would
        pip(python, "install", "-q", "--no-index", str(wheels["pytest_hsdp"]))
        installed = pip(python, "list", "--format=freeze")
        assert "pytest-hsdp==" in installed and "hsdp-backend" not in installed, installed
        yield python
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run_alone(
    python: Path, d: Path, *args: str, pythonpath: Path | None = None
) -> tuple[dict, str]:
    """A user's pytest in the fresh venv: nothing of this repository on its path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTEST_ADDOPTS")}
    env["PATH"] = f"{python.parent}{os.pathsep}{env.get('PATH', '')}"
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return run_pytest(d, *args, env=env, python=str(python), inherit=False)


def guide_example() -> str:
    """The first Python block of docs/testing-your-code.md: the file a new user writes."""
    text = (ROOT / "docs" / "testing-your-code.md").read_text()
    block = re.search(r"```python\n(# test_my_code\.py\n.*?)```", text, re.S)
    assert block, "docs/testing-your-code.md has no '# test_my_code.py' example"
    return block.group(1)


GLOO_BY_DEFAULT = """
    import importlib.util

    import pytest
    import torch.distributed as dist


    @pytest.mark.world_size(2)
    def test_the_default_group_is_gloo_without_hsdp_backend(rank):
        assert dist.get_backend() == "gloo"
        assert importlib.util.find_spec("hsdp_backend") is None
"""

TORCH_STYLE = """
    import multiprocessing

    import torch
    import torch.distributed as dist
    from torch.testing._internal.common_distributed import MultiProcessTestCase


    class TorchStyle(MultiProcessTestCase):
        @property
        def world_size(self):
            return 2

        def setUp(self):
            super().setUp()
            self._spawn_processes()

        def test_all_reduce_on_a_warm_rank(self):
            assert multiprocessing.current_process().name.startswith("pytest-hsdp-rank")
            store = dist.FileStore(self.file_name, self.world_size)
            dist.init_process_group("gloo", store=store, rank=self.rank, world_size=2)
            t = torch.full((3,), float(self.rank + 1))
            dist.all_reduce(t)
            assert t.tolist() == [3.0] * 3
            dist.destroy_process_group()
"""

INERT = """
    import sys

    def pytest_sessionfinish(session):
        loaded = session.config.pluginmanager.has_plugin("hsdp")
        imported = sorted(m for m in ("torch", "hsdp_backend") if m in sys.modules)
        (session.config.rootpath / "after.txt").write_text(f"{loaded} {imported}")
"""


def passed_all(results: dict, out: str, at_least: int) -> None:
    failed = {name: text for name, (state, text) in results.items() if state != "passed"}
    assert not failed and len(results) >= at_least, out[-6000:]


def test_alone_it_runs_the_guides_example_on_gloo(venv_alone, tmp_path):
    d = write_tests(tmp_path, test_my_code=guide_example(), test_gloo=GLOO_BY_DEFAULT)
    results, out = run_alone(venv_alone, d)
    passed_all(results, out, at_least=5)


def test_alone_it_runs_torchs_test_classes_on_warm_ranks(venv_alone, tmp_path):
    # torch's test utilities import expecttest and numpy: beside the venv, for this run only.
    extra = tmp_path / "torch-test-utilities"
    pip(venv_alone, "install", "-q", "--target", str(extra), "expecttest", "numpy")
    d = write_tests(tmp_path, test_torch_style=TORCH_STYLE)
    results, out = run_alone(venv_alone, d, pythonpath=extra)
    passed_all(results, out, at_least=1)
    assert "torch's own spawning" not in out, out[-3000:]


def test_alone_it_imports_no_torch_in_a_session_without_distributed_tests(venv_alone, tmp_path):
    plain = """
        def test_arithmetic():
            assert 1 + 1 == 2
    """
    d = write_tests(tmp_path, textwrap.dedent(INERT), test_plain=plain)
    results, out = run_alone(venv_alone, d)
    assert results == {"test_arithmetic": ("passed", "")}, out[-3000:]
    assert (d / "after.txt").read_text() == "True []", out[-3000:]
