"""ProcessGroupHSDP's planning and routing against a fake inner backend
(tests/cpp/backend_test.cpp, googletest).

ProcessGroupHSDP's planning and routing against a fake inner backend
(tests/cpp/backend_test.cpp): which c10d op a call asks of a route that does
or does not scale and coalesce natively, and what the caller gets back. The
tests' build (scripts/setup.sh: HSDP_BUILD_TESTING) links it from the
extension's own objects into the package's build tree; it is never installed.

ProcessGroupHSDP against a fake inner backend (`tests/cpp/backend_test.cpp`, googletest, linked
from the extension's own objects by the tests' build): on a route that neither scales nor
coalesces natively (as Gloo) AVG runs as SUM then one division, coalesced reduce-scatter packs
one collective per dtype, buckets pack; on one that does (as NCCL) AVG and a `divide_by`
PREMUL_SUM factor pass through and the callers' tensors go as lists in one launch; a tensor that
is not contiguous is staged and copied back; a reduce scales only at its root; errors name the
rank and op before anything is issued; a call of several inner collectives counts once in the
sequence; the flight recorder's device events on a counting fake device (PrivateUse1): one a
ring slot, recorded per op on the current stream, replaced for another device, destroyed with
the recorder."""

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
