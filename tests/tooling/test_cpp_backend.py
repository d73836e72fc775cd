"""ProcessGroupHSDP's planning and routing against a fake inner backend
(tests/cpp/backend_test.cpp): which c10d op a call asks of a route that does
or does not scale and coalesce natively, and what the caller gets back. The
tests' build (scripts/setup.sh: HSDP_BUILD_TESTING) links it from the
extension's own objects into the package's build tree; it is never installed."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_backend_against_a_fake_inner_backend():
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}-"
    binaries = sorted((ROOT / "build").glob(f"{tag}*/backend_tests"))
    assert binaries, "build/*/backend_tests missing: run scripts/setup.sh (the tests' build)"
    proc = subprocess.run(
        [str(binaries[0]), "--gtest_brief=1"], capture_output=True, text=True, timeout=120
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-8000:]
    assert "[  PASSED  ]" in out and "FAILED" not in out, out[-4000:]
