"""What a user installs holds nothing only the tests or benchmarks use, and calls none of its own
functions through its PLT.

What a user installs holds nothing that only the tests or the benchmarks
use: the test double of NCCL and the engine's kernel alone live in the tests'
module, hsdp_testing, which only the tests' build makes (scripts/setup.sh:
-C cmake.define.HSDP_BUILD_TESTING=ON), and hsdp takes the double through
its creator's injection point (tests/hooks.py), never by name.

What a user installs holds nothing only the tests or benchmarks use: the extension's names and
exported symbols have no test double and no benchmark kernel, the users' settings no test
setting (`HSDP_CPU_ROUTE=nccl_contract` refused); the extension calls none of its own functions
through its PLT (no jump-slot relocation names a function of namespace `hsdp`: the build's
`-fno-semantic-interposition` and `-Bsymbolic-functions`); configured as a plain `pip install .`
the project installs no `hsdp_testing`, as the tests' build it does."""

import subprocess

import pytest
from harness import cmake_configure

from hsdp_backend import _C, config
from tools import settings

TEST_ONLY = ("nccl_contract", "NcclContract", "reduce_rows", "hsdp::testing")


def test_the_extension_names_no_test_double_and_no_benchmark_kernel():
    assert not [n for n in dir(_C) if any(t in n for t in TEST_ONLY)], dir(_C)
    symbols = subprocess.run(
        ["nm", "-DC", "--defined-only", _C.__file__], capture_output=True, text=True, check=True
    ).stdout
    assert "hsdp::" in symbols, "nm found none of the extension's own symbols"
    assert not [t for t in TEST_ONLY if t in symbols]


def plt_callees(module: str) -> list[str]:
    """The functions a module calls through its PLT (its jump-slot relocations)."""
    relocations = subprocess.run(
        ["readelf", "-rW", module], capture_output=True, text=True, check=True
    ).stdout
    return [line.split()[4] for line in relocations.splitlines() if "JUMP_SLOT" in line]


def test_the_extension_calls_its_own_functions_directly():
    """Built with -fno-semantic-interposition and linked with
    -Bsymbolic-functions (CMakeLists.txt): a call between two of hsdp's
    functions is a direct call, not a jump through the PLT (an indirect jump
    and a line of the instruction cache more, on a path that crosses some
    sixty of them per call)."""
    callees = plt_callees(_C.__file__)
    assert any(name.startswith("_ZN3c10") for name in callees), callees  # torch's: still there
    own = [name for name in callees if "4hsdp" in name]  # mangled: a name in namespace hsdp
    assert not own, f"{len(own)} of hsdp's own functions called through the PLT: {own[:5]}"


def test_the_users_settings_hold_no_setting_of_the_tests():
    assert not set(config.VARS) & set(settings.VARS)
    assert not [name for name in config.VARS if "TEST" in name]
    assert not hasattr(_C.Config(), "test_hosts")
    with pytest.raises(ValueError, match="cpu_route: expected one of auto, shm, gloo, got"):
        _C.Config().cpu_route = "nccl_contract"


def test_only_the_tests_build_installs_the_tests_module(tmp_path):
    """The same sources configured as a plain `pip install .` does and as
    scripts/setup.sh does: only the latter installs hsdp_testing (and the
    package's extension is built alike in both)."""
    installs = {}
    for name, defines in [("plain", ()), ("tests", ("HSDP_BUILD_TESTING=ON",))]:
        rc, out = cmake_configure(tmp_path / name, {}, defines=defines)
        assert rc == 0, out
        installs[name] = (tmp_path / name / "cmake_install.cmake").read_text()
    assert "hsdp_testing" not in installs["plain"]
    assert "hsdp_testing" in installs["tests"]
    for text in installs.values():
        assert "/_C." in text or "_C.cpython" in text, text
