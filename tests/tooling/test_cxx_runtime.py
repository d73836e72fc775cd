"""One C++ runtime per process: the build refuses a compiler that links libstdc++ statically.

One C++ runtime per process (cmake/CxxRuntime.cmake): a compiler that
links libstdc++ statically into modules would put a second C++ runtime
beside the shared one torch loads (on one GPU image such an extension
crashed at init_process_group, inside a stream inserting a size_t). The
build's configure step probes the compiler and stops, naming it and what to
set; a compiler that links the shared libstdc++ passes.

The configure step's C++ runtime probe: a compiler wrapper that adds `-static-libstdc++` stops
the build naming it; the system g++ passes."""

import subprocess
from pathlib import Path

import pytest
from harness import ROOT, cmake_configure


def configure(tmp_path: Path, cxx: str) -> tuple[int, str]:
    return cmake_configure(tmp_path / "build", {"CXX": cxx})


@pytest.fixture
def static_libstdcxx_compiler(tmp_path) -> str:
    """The system g++, with -static-libstdc++ added to every command (as the
    GPU image's g++ and some clusters' compiler modules link)."""
    wrapper = tmp_path / "static-g++"
    wrapper.write_text('#!/bin/sh\nexec g++ "$@" -static-libstdc++\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def test_a_compiler_that_links_libstdcxx_statically_stops_the_build_naming_it(
    tmp_path, static_libstdcxx_compiler
):
    rc, out = configure(tmp_path, static_libstdcxx_compiler)
    assert rc != 0, out
    assert (
        f"the C++ compiler {static_libstdcxx_compiler} builds modules that cannot share torch's C++ runtime"
        in out
    ), out
    assert "links libstdc++ statically" in out and "CXX=/usr/bin/g++" in out, out


def test_the_system_compiler_passes_the_probe(tmp_path):
    rc, out = configure(tmp_path, "g++")
    assert "builds modules that share torch's libstdc++" in out, out
    assert rc == 0, out


def gpu_check_sees_a_refusal(log: Path) -> bool:
    """scripts/gpu_check.sh's test of a build log: on a refusal it builds
    again with /usr/bin/g++."""
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--cxx-refused", str(log)], timeout=60
    )
    return proc.returncode == 0


# The refusal as CMake 4.4.3 folded it in pip's log on a GPU image whose CXX
# is /opt/gcc/bin/g++: the line breaks inside the phrase the check looks for.
GPU_IMAGE_LOG = """\
      CMake Error at cmake/CxxRuntime.cmake:24 (message):
        hsdp_backend: the C++ compiler /opt/gcc/bin/g++ builds modules that cannot
        share torch's C++ runtime: it links libstdc++ statically (the module needs
        no libstdc++.so among ['libgcc_s.so.1', 'libc.so.6',
        'ld-linux-x86-64.so.2']): the extension would carry a second C++ runtime
"""


def test_gpu_check_recognises_the_refusal_however_cmake_folds_it(
    tmp_path, static_libstdcxx_compiler
):
    rc, out = cmake_configure(tmp_path / "build", {"CXX": static_libstdcxx_compiler}, folded=True)
    assert rc != 0, out
    (tmp_path / "here.log").write_text(out)
    (tmp_path / "gpu.log").write_text(GPU_IMAGE_LOG)
    assert gpu_check_sees_a_refusal(tmp_path / "here.log"), out
    assert gpu_check_sees_a_refusal(tmp_path / "gpu.log")
    rc, out = cmake_configure(tmp_path / "ok", {"CXX": "g++"}, folded=True)
    assert rc == 0, out
    (tmp_path / "ok.log").write_text(out)
    assert not gpu_check_sees_a_refusal(tmp_path / "ok.log"), out
