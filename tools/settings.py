"""The settings of the tests and benchmarks: their ``HSDP_*`` environment
variables, in a table of their own beside the rank launcher both share
(tools/ranks.py). They steer the test suite (tests/), the benchmarks
(benchmarks/) and the tools beside them, not the package, so they are not
shipped: the installed package's table (src/hsdp_backend/config.py) holds
only what a training job may set. This one reuses its row type, its reading
of a row and its Markdown renderer.

docs/testing.md's "Settings of the tests" table is generated from this one
(``python -m tools.settings``, from the repository root), and
``tests/unit/test_config.py`` fails when it is stale.

Importing this module stays cheap (no torch).
"""

from __future__ import annotations

from hsdp_backend import config
from hsdp_backend.config import Var, parse_flag, parse_hosts, parse_int, parse_text

SECTIONS = {
    "tests": "The test suite",
    "benchmarks": "Benchmarks (`python -m benchmarks`)",
    "peers": "Benchmarks against peers (`python -m benchmarks.peers`)",
    "cpp": "C++ tests (`bash scripts/cpp_tests.sh`)",
    "build": "Builds (`scripts/setup.sh`, `scripts/setup_compat.sh`, `scripts/cpp_tests.sh`)",
}

# fmt: off
_TABLE = [
    Var("HSDP_TEST_COLLECTIVE_TIMEOUT_S", "tests", None, float, str,
        "the process group timeout of the tests' ranks", "60"),
    Var("HSDP_TEST_LAUNCH_TIMEOUT_S", "tests", None, float, str,
        "wall-clock limit of one multi-process launch (all its ranks and cases)", "300"),
    Var("HSDP_TEST_GROUP_TIMEOUT_S", "tests", None, float, str,
        "the group timeout of the simulated-host ranks (`tests/system/hosts_rank.py`)", "60"),
    Var("HSDP_TEST_BACKEND", "tests", None, parse_text, str,
        "the backend the simulated-host ranks initialise", "hsdp"),
    Var("HSDP_TEST_HOSTS", "tests", None, parse_hosts, ",".join,
        "pretended hosts: the host name of each global rank, comma-separated (`?`: a rank "
        "whose identity cannot be read), handed to hsdp in place of the real host identities "
        "(`tests/hooks.py`), so hierarchical groups run on one machine (e.g. `a,a,b,b`; "
        "`tools/simhosts.py` simulates whole hosts instead)", ""),
    Var("HSDP_TEST_INNER", "tests", None, parse_text, str,
        "`nccl_contract`: the groups' inner CPU backend is the NCCL-contract double "
        "(`csrc/testing`, the `hsdp_testing` module), handed to hsdp in Gloo's place "
        "(`tests/hooks.py`): CPU tensors take the CUDA route's code; with `HSDP_CPU_ROUTE=gloo`", ""),
    Var("HSDP_TEST_NCCL_RELEASE", "tests", None, lambda t: parse_int(t) if t.strip() else None,
        str, "with `HSDP_TEST_INNER=nccl_contract`: the torch minor release (11 to 15) whose "
        "ProcessGroupNCCL the double models, and hsdp's route is told so (default: the installed "
        "torch's)"),
    Var("HSDP_TEST_EXPECTED_HOSTS", "tests", None, parse_hosts, ",".join,
        "set by `tests/system/hosts_rank.py`: the real host of each rank, for the cases' expectations",
        ""),
    Var("HSDP_TEST_EXIT_RUNS", "tests", None, parse_int, str,
        "consecutive trainings per exit mode in `tests/system/test_hosts.py` (50 in the long run)",
        "2"),
    Var("HSDP_TEST_SOAK_OPS", "tests", None, parse_int, str,
        "collectives of the shared-memory soak test", "5000"),
    Var("HSDP_TEST_SOAK_SECONDS", "tests", None, float, str,
        "how long the soak test with killed ranks runs its rounds (3600: the long mode)", "45"),
    Var("HSDP_TEST_SOAK_SEED", "tests", None, parse_int, str,
        "the seed that draws which rank the soak test kills, and when", "7"),
    Var("HSDP_TEST_CONFORMANCE_FULL", "tests", None, parse_flag, str,
        "`1`: torch's DistributedTest conformance run spawns each test's ranks instead of "
        "forking them, runs every test and re-checks gloo's baselines", "0"),
    Var("HSDP_TEST_PROTOCOL_FULL", "tests", None, parse_flag, str,
        "`1`: the spin model proves the step protocol at 3 ranks x 4 calls and pooled calls at "
        "3 ranks x 2 (about 4 min instead of 1; `scripts/check_protocol.sh`)", "0"),
    Var("HSDP_TEST_EVERY_TORCH_FULL", "tests", None, parse_flag, str,
        "`1`: the quick tier runs on every other supported torch release too "
        "(about 10-15 min more; `scripts/test.sh`'s compat stages)", "0"),
    Var("HSDP_TEST_TORCH_HARNESS", "tests", None, parse_flag, str,
        "`1`: the tests of torch's test classes also run their files under torch's own "
        "harness, against their tables (minutes a release; `HSDP_TEST_EVERY_TORCH_FULL=1` "
        "sets it in the compat stages)", "0"),
    Var("HSDP_GPU_CHECK_RANKS", "tests", None, parse_int, str,
        "ranks of tests/integration/test_cuda.py's multi-rank checks, placed on the machine's "
        "GPUs and sharing them where fewer (each with its own `NCCL_HOSTID`); "
        "`scripts/gpu_check.sh --ranks N` sets it", "2"),
    Var("HSDP_PEERS_DIR", "peers", None, parse_text, str,
        "where `scripts/setup_peers.sh` installs the benchmark's peers (mpi4py, MPICH, "
        "DeepSpeed) and the peers suite finds them (empty: `.venv/peers`)"),
    Var("HSDP_BENCH_LOAD", "benchmarks", None, parse_int, str,
        "set by `python -m benchmarks --load N` for the ranks: the CPU-bound processes beside "
        "them, recorded with the results (`rank_env`)", "0"),
    Var("HSDP_PEERS_CONFIG", "peers", None, parse_text, str,
        "set by `benchmarks/peers.py` for its MPI launches: the file with the ranks' configuration"),
    Var("HSDP_FUZZ_TRIALS", "cpp", None, parse_int, str,
        "trials of the engine's C++ corruption fuzzer (`tests/cpp/corruption_test.cpp`)", "120"),
    Var("HSDP_FUZZ_SEED", "cpp", None, parse_int, str,
        "the fuzzer's seed (random when unset; printed, to replay a run)"),
    Var("HSDP_VENV_CACHE", "build", None, parse_text, str,
        "where the other torch releases' venvs and the compiler cache live (outside the clone, "
        "so a second clone reuses them; `scripts/setup_compat.sh`, `scripts/compiler_cache.sh`)",
        "~/.cache/hsdp-backend"),
    Var("HSDP_NO_CCACHE", "build", None, parse_flag, str,
        "`1`: builds compile without ccache (`scripts/compiler_cache.sh`)", "0"),
]
# fmt: on

VARS = {v.name: v for v in _TABLE}


def read(name: str, environ=None):
    """The value of one setting, from ``environ`` (default: ``os.environ``)
    or its default; None when unset with no default. A bad value raises
    ``ValueError: Invalid value for environment variable NAME=...``."""
    return config.read_text(VARS[name], environ)


def markdown() -> str:
    """docs/testing.md's table of these settings."""
    return config.markdown(_TABLE, SECTIONS)


if __name__ == "__main__":
    print(markdown(), end="")
