"""Every hsdp setting: one table of ``HSDP_*`` environment variables.

The package's settings resolve into one object, :class:`hsdp_backend._C.Config`
(``csrc/common/Config.hpp``: its fields, their defaults and their ranges; the
defaults exist only there). Each process group is created with
``resolve()``'s object, so a group reads the environment once. A bad value is
rejected by name: ``ValueError: Invalid value for environment variable
HSDP_SHM_SLOT_BYTES='100': slot_bytes: expected ...``.

The test suite's own settings sit in the table's last section (``tests``):
they steer the test and benchmark tools, not the package, so they are read
one at a time with :func:`read` and keep their defaults here. The tables of
docs/configuration.md and docs/testing.md are generated from this one
(``python -m hsdp_backend.config [--tests]``), and ``tests/test_config.py``
holds them together.

Importing this module stays cheap (no torch): only resolving imports ``_C``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Var:
    name: str
    section: str
    # Config's attribute; None for a test-suite setting.
    field: str | None
    # Environment text -> the field's value (the syntax; Config checks ranges).
    parse: Callable[[str], object]
    # The field's value -> environment text (how the default is shown).
    show: Callable[[object], str]
    help: str
    # Test-suite settings only (None: unset): the others' default is Config's.
    default: str | None = None


def _int(text: str) -> int:
    try:
        return int(text.strip().replace("_", ""))
    except ValueError:
        raise ValueError("expected an integer") from None


def _int_or(word: str) -> Callable[[str], int | None]:
    def parse(text: str) -> int | None:
        if text == word:
            return None
        try:
            return _int(text)
        except ValueError:
            raise ValueError(f"expected {word} or an integer") from None

    return parse


def _shown_or(word: str) -> Callable[[object], str]:
    return lambda value: word if value is None else str(value)


def _choice(true: str, false: str) -> Callable[[str], bool]:
    def parse(text: str) -> bool:
        if text not in (true, false):
            raise ValueError(f"expected {true} or {false}")
        return text == true

    return parse


def _flag(text: str) -> bool:
    if text not in ("0", "1"):
        raise ValueError("expected 0 or 1")
    return text == "1"


def _hosts(text: str) -> list[str]:
    return [n.strip() for n in text.split(",")] if text.strip() else []


def _text(text: str) -> str:
    return text


SECTIONS = {
    "engine": "CPU collectives",
    "trace": "Flight recorder",
    "fsdp": "FSDP2 shim",
    "launcher": "Launcher (`python -m hsdp_backend.run`; set by it, not by hand)",
    "tests": "Tests and benchmarks only (the test suite and the tools beside it; not for training jobs)",
}

# fmt: off
_TABLE = [
    Var("HSDP_ENGINE", "engine", "engine", _text, str,
        "CPU engine: `auto` (shared memory when the group's ranks can share it: one host, or "
        "hierarchical across hosts with the same number of ranks each; else gloo), `shm` "
        "(shared memory on one host, or an error), `gloo` (always the inner gloo group), "
        "`nccl_contract` (tests only: CPU tensors take the CUDA route's code over the "
        "NCCL-contract double)"),
    Var("HSDP_SHM_SLOT_BYTES", "engine", "slot_bytes", _int, str,
        "bytes a rank moves through shared memory per step (>= 64 KiB, a multiple of 64); the "
        "segment holds 2 slots per rank; larger messages are pipelined"),
    Var("HSDP_SHM_SPIN_US", "engine", "spin_us", _int_or("auto"), _shown_or("auto"),
        "microseconds a wait spins before sleeping on the futex; `auto`: 20, or 0 when the "
        "group has more ranks than the machine has cores"),
    Var("HSDP_SHM_YIELD_US", "engine", "yield_us", _int, str,
        "microseconds a wait then polls with `sched_yield` before sleeping (hands the core to "
        "a rank that shares it, or that a process outside the group took; paused for 1024 "
        "waits after a yield that lost the core for a whole time slice); `0`: never yield"),
    Var("HSDP_SHM_ONESHOT_BYTES", "engine", "one_shot_bytes", _int, str,
        "all-reduces up to this size read every peer's buffer in one round instead of two"),
    Var("HSDP_SHM_DIRECT_READ_BYTES", "engine", "direct_read_bytes", _int, str,
        "all-gathers and broadcasts of at least this many bytes per rank read peers' buffers "
        "directly (`process_vm_readv`: one copy instead of two) when the ranks may read each "
        "other's memory; `0` disables"),
    Var("HSDP_SHM_DIRECT_ALLREDUCE_BYTES", "engine", "direct_all_reduce_bytes", _int, str,
        "all-reduces of at least this many bytes per rank gather the reduced parts directly "
        "from their owners' buffers (`process_vm_readv`), as above; `0` disables"),
    Var("HSDP_TIMEOUT_MS", "engine", "timeout_ms", _int_or("group"), _shown_or("group"),
        "deadline of every shared-memory wait; `group`: the process group's timeout"),
    Var("HSDP_TRACE_ENTRIES", "trace", "trace_entries", _int, str,
        "collectives each group's flight recorder keeps on each rank (0-1,000,000; `0` turns "
        "it off): its last N, written on the group's first failure, on SIGUSR1 and on "
        "`hsdp_backend.dump_trace()`"),
    Var("HSDP_TRACE_DIR", "trace", "trace_dir", _text, str,
        "directory of the flight records, `hsdp-trace.<group>.rank<R>.json`; "
        "`python -m hsdp_backend.trace DIR` reads them"),
    Var("HSDP_FSDP", "fsdp", "fsdp_shim", _choice("auto", "off"),
        lambda on: "auto" if on else "off",
        "`auto`: FSDP2 modules on hsdp meshes use `hsdp_backend.fsdp` (HSDP gradients divided "
        "once, replicate all-reduces bucketed across param groups); `off`: FSDP2's own "
        "reduction path"),
    Var("HSDP_FSDP_BUCKET_BYTES", "fsdp", "fsdp_bucket_bytes", _int, str,
        "capacity of one replicate all-reduce bucket of the FSDP2 shim; smaller than DDP's "
        "25 MB because a CPU collective costs microseconds to start and a full bucket reduces "
        "while backward goes on (HSDP 2x2, small model: forward + backward about 5% faster "
        "than with 25 MiB, within this machine's noise)"),
    Var("HSDP_RUN_BACKEND_MAP", "launcher", "run_backend_map", _flag, lambda on: str(int(on)),
        "`1`: the ranks' `init_process_group` with no backend, `gloo` or "
        "`cpu:gloo,cuda:nccl` runs on hsdp (read by the injected `sitecustomize`)"),
    Var("HSDP_RUN_VERBOSE", "launcher", "run_verbose", _flag, lambda on: str(int(on)),
        "`1`: each rank prints one line on stderr per mapped call"),
    Var("HSDP_TEST_HOSTS", "tests", "test_hosts", _hosts, ",".join,
        "the host name of each global rank, comma-separated (`?`: a rank whose identity cannot "
        "be read), used instead of the real host identities, so hierarchical groups run on one "
        "machine"),
    Var("HSDP_TEST_COLLECTIVE_TIMEOUT_S", "tests", None, float, str,
        "the process group timeout of the tests' ranks", "60"),
    Var("HSDP_TEST_LAUNCH_TIMEOUT_S", "tests", None, float, str,
        "wall-clock limit of one multi-process launch (all its ranks and cases)", "300"),
    Var("HSDP_TEST_GROUP_TIMEOUT_S", "tests", None, float, str,
        "the group timeout of the simulated-host ranks (`tests/hosts_rank.py`)", "60"),
    Var("HSDP_TEST_BACKEND", "tests", None, _text, str,
        "the backend the simulated-host ranks initialise", "hsdp"),
    Var("HSDP_TEST_EXPECTED_HOSTS", "tests", None, _hosts, ",".join,
        "set by `tests/hosts_rank.py`: the real host of each rank, for the cases' expectations",
        ""),
    Var("HSDP_TEST_EXIT_RUNS", "tests", None, _int, str,
        "consecutive trainings per exit mode in `tests/test_hosts.py` (200 in the long run)",
        "3"),
    Var("HSDP_TEST_SOAK_OPS", "tests", None, _int, str,
        "collectives of the shared-memory soak test", "5000"),
    Var("HSDP_TEST_SOAK_SECONDS", "tests", None, float, str,
        "how long the soak test with killed ranks runs its rounds (3600: the long mode)", "45"),
    Var("HSDP_TEST_SOAK_SEED", "tests", None, _int, str,
        "the seed that draws which rank the soak test kills, and when", "7"),
    Var("HSDP_TEST_CONFORMANCE_FULL", "tests", None, _flag, lambda on: str(int(on)),
        "`1`: torch's DistributedTest conformance run runs every test, adds world size 3 and "
        "re-checks gloo", "0"),
    Var("HSDP_COMPAT_RUN", "tests", None, _text, str,
        "set by `tests/test_torch_versions.py` in its run on the second torch, so that run "
        "does not start itself again"),
    Var("HSDP_PEERS_DIR", "tests", None, _text, str,
        "where `scripts/setup_peers.sh` installs the benchmark's peers (mpi4py, MPICH, "
        "DeepSpeed) and the peers suite finds them (empty: `.venv/peers`)"),
    Var("HSDP_PEERS_CONFIG", "tests", None, _text, str,
        "set by the peers suite for its MPI launches: the file with the ranks' configuration"),
    Var("HSDP_FUZZ_TRIALS", "tests", None, _int, str,
        "trials of the engine's C++ corruption fuzzer (`tests/cpp/corruption_test.cpp`)", "120"),
    Var("HSDP_FUZZ_SEED", "tests", None, _int, str,
        "the fuzzer's seed (random when unset; printed, to replay a run)"),
]
# fmt: on

VARS = {v.name: v for v in _TABLE}


def _invalid(var: Var, text: str, exc: Exception) -> ValueError:
    return ValueError(f"Invalid value for environment variable {var.name}={text!r}: {exc}")


def resolve(environ=None):
    """The package's settings, from ``environ`` (default: ``os.environ``),
    as an ``hsdp_backend._C.Config``. Unset variables keep Config's defaults."""
    from hsdp_backend import _C

    environ = os.environ if environ is None else environ
    config = _C.Config()
    for var in VARS.values():
        if var.field is None or var.name not in environ:
            continue
        text = environ[var.name]
        try:
            setattr(config, var.field, var.parse(text))
        except (ValueError, TypeError) as exc:
            raise _invalid(var, text, exc) from None
    return config


def read(name: str, environ=None):
    """The value of one setting (a package setting through ``resolve``)."""
    var = VARS[name]
    environ = os.environ if environ is None else environ
    if var.field is not None:
        return getattr(resolve({name: environ[name]} if name in environ else {}), var.field)
    text = environ.get(name, var.default)
    if text is None:  # unset, and no default
        return None
    try:
        return var.parse(text)
    except ValueError as exc:
        raise _invalid(var, text, exc) from None


def default_text(var: Var) -> str:
    """The default of ``var`` as environment text ("" when unset)."""
    if var.field is None:
        return var.default or ""
    from hsdp_backend import _C

    return var.show(getattr(_C.Config(), var.field))


USER_SECTIONS = ("engine", "trace", "fsdp", "launcher")


def markdown(sections=USER_SECTIONS) -> str:
    """The table of the variables of ``sections``, section by section:
    docs/configuration.md's (what users set, the default) and
    docs/testing.md's (``("tests",)``)."""
    lines = ["| variable | default | meaning |", "|---|---|---|"]
    for section in sections:
        lines.append(f"| **{SECTIONS[section]}** | | |")
        for var in VARS.values():
            if var.section == section:
                default = default_text(var)
                lines.append(f"| `{var.name}` | {f'`{default}`' if default else ''} | {var.help} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import sys

    print(markdown(("tests",) if sys.argv[1:] == ["--tests"] else USER_SECTIONS), end="")
