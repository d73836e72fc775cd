"""One C++ runtime per process (cmake/CxxRuntime.cmake): a compiler that
links libstdc++ statically into modules would put a second C++ runtime
beside the shared one torch loads (on one GPU image such an extension
crashed at init_process_group, inside a stream inserting a size_t). The
build's configure step probes the compiler and stops, naming it and what to
set; a compiler that links the shared libstdc++ passes."""

from pathlib import Path

import pytest
from harness import cmake_configure


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
