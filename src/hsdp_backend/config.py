"""Every hsdp setting: one table of ``HSDP_*`` environment variables.

The package's settings resolve into one object, :class:`hsdp_backend._C.Config`
(``csrc/common/Config.hpp``: its fields, their defaults and their ranges; the
defaults exist only there). Each process group is created with
``resolve()``'s object, so a group reads the environment once. A bad value is
rejected by name: ``ValueError: Invalid value for environment variable
HSDP_SHM_SLOT_BYTES='100': slot_bytes: expected ...``.

docs/configuration.md's table is generated from this one (``python -m
hsdp_backend.config``), and ``tests/unit/test_config.py`` holds them together.
The settings of the tests and benchmarks are not shipped: their table,
``tools/settings.py`` in the repository, reuses :class:`Var`,
:func:`read_text` and :func:`markdown`.

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
    # Config's attribute; None for a setting of another table (tools/settings.py).
    field: str | None
    # Environment text -> the field's value (the syntax; Config checks ranges).
    parse: Callable[[str], object]
    # The field's value -> environment text (how the default is shown).
    show: Callable[[object], str]
    help: str
    # Rows with no field only (None: unset): a field's default is Config's.
    default: str | None = None
    # An earlier name of the variable, still read when this one is unset.
    older: str | None = None

    def text_in(self, environ) -> tuple[str, str] | None:
        """(the name it was set by, its text) in ``environ``; None: unset."""
        for name in (self.name, self.older):
            if name is not None and name in environ:
                return name, environ[name]
        return None


def parse_int(text: str) -> int:
    try:
        return int(text.strip().replace("_", ""))
    except ValueError:
        raise ValueError("expected an integer") from None


def _int_or(word: str) -> Callable[[str], int | None]:
    def parse(text: str) -> int | None:
        if text == word:
            return None
        try:
            return parse_int(text)
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


def _optional_choice(unset: str, true: str, false: str) -> Callable[[str], bool | None]:
    def parse(text: str) -> bool | None:
        if text not in (unset, true, false):
            raise ValueError(f"expected {unset}, {true} or {false}")
        return None if text == unset else text == true

    return parse


def parse_flag(text: str) -> bool:
    if text not in ("0", "1"):
        raise ValueError("expected 0 or 1")
    return text == "1"


def parse_hosts(text: str) -> list[str]:
    return [n.strip() for n in text.split(",")] if text.strip() else []


def parse_text(text: str) -> str:
    return text


SECTIONS = {
    "engine": "CPU collectives",
    "cuda": "CUDA collectives",
    "trace": "Flight recorder",
    "fsdp": "FSDP2 shim",
    "launcher": "Launcher (`python -m hsdp_backend.run`; set by it, not by hand)",
}

# fmt: off
_TABLE = [
    Var("HSDP_CPU_ROUTE", "engine", "cpu_route", parse_text, str,
        "what serves CPU collectives: `auto` (the shared-memory engine where ranks can share "
        "it: one host, or hierarchical across hosts of equal rank counts; else gloo), `shm` "
        "(the engine, or an error), `gloo` (the inner gloo group). Earlier name: `HSDP_ENGINE`",
        older="HSDP_ENGINE"),
    Var("HSDP_SHM_SLOT_BYTES", "engine", "slot_bytes", parse_int, str,
        "bytes a rank moves through shared memory per step (>= 64 KiB, a multiple of 64); the "
        "segment holds 2 slots per rank; larger messages are pipelined"),
    Var("HSDP_SHM_SPIN_US", "engine", "spin_us", _int_or("auto"), _shown_or("auto"),
        "microseconds a wait spins before sleeping on the futex; `auto`: 20, or 0 when the "
        "group has more ranks than the machine has cores"),
    Var("HSDP_SHM_YIELD_US", "engine", "yield_us", parse_int, str,
        "microseconds a wait then polls with `sched_yield` before sleeping (hands the core to "
        "a rank that shares it, or that a process outside the group took; paused for 1024 "
        "waits after a yield that lost the core for a whole time slice); `0`: never yield"),
    Var("HSDP_SHM_ONESHOT_BYTES", "engine", "one_shot_bytes", parse_int, str,
        "all-reduces up to this size read every peer's buffer in one round instead of two"),
    Var("HSDP_SHM_DIRECT_READ_BYTES", "engine", "direct_read_bytes", _int_or("auto"),
        _shown_or("auto"),
        "all-gathers and broadcasts of at least this many bytes per rank read peers' buffers "
        "directly (one copy instead of two) when the ranks may read each other's memory: "
        "pool buffers through mappings, others with `process_vm_readv`; `auto`: pool buffers "
        "from 8 KiB, others from the size where that is faster, measured when a group is "
        "created (once per process, ranks per host and slot size; 8 KiB to 2 MiB with the "
        "default slot, by CPU); `0` disables"),
    Var("HSDP_SHM_DIRECT_ALLREDUCE_BYTES", "engine", "direct_all_reduce_bytes", parse_int, str,
        "all-reduces of at least this many bytes per rank gather the reduced parts directly "
        "from their owners' buffers (`process_vm_readv`), as above; `0` disables"),
    Var("HSDP_SHM_STREAM_STORE_BYTES", "engine", "stream_store_bytes", _int_or("auto"),
        _shown_or("auto"),
        "reduce-scatters whose output per rank is at least this many bytes write it with "
        "non-temporal stores, around the cache (SUM of floating types); `auto`: the "
        "last-level cache cpu0 shares (sysfs) / (ranks x (ranks + 1)), the size past which "
        "the call's data cannot stay in that cache (2 ranks, 32 MiB: 5.3 MiB), off when the "
        "cache is unknown; `0`: never"),
    Var("HSDP_SHM_STREAM_SLOT_BYTES", "engine", "stream_slot_bytes", parse_int, str,
        "a rank writes a step of at least this many bytes into its slot with non-temporal "
        "stores (a cached store takes each line back from the peers that read it: slow where "
        "their cores share no cache); `0`: never"),
    Var("HSDP_SHM_STREAM_SLOT_TIMED_BYTES", "engine", "stream_slot_timed_bytes", parse_int, str,
        "from this size, where a shared cache beats memory, each rank times its own fills and "
        "streams only while its cached ones run over 3x slower per byte; `0`: always stream"),
    Var("HSDP_SHM_POOL_BYTES", "engine", "pool_bytes", parse_int, str,
        "bytes of communication buffers each rank of a shared-memory group may hand out through "
        "`allocate_tensor` (FSDP2's `set_allocate_memory_from_process_group_for_comm`): memory "
        "its peers map, so collectives on them read peers' buffers with plain loads; past it, "
        "ordinary memory (counted); `0`: no pool (`supports_tensor_alloc` is false on CPU)"),
    Var("HSDP_SHM_POOL_CHUNK_BYTES", "engine", "pool_chunk_bytes", parse_int, str,
        "the pool grows by chunks of at least this many bytes (>= 1 MiB; a larger buffer gets "
        "a chunk of its own)"),
    Var("HSDP_TIMEOUT_MS", "engine", "timeout_ms", _int_or("group"), _shown_or("group"),
        "deadline of every shared-memory wait; `group`: the process group's timeout"),
    Var("HSDP_TRACE_ENTRIES", "trace", "trace_entries", parse_int, str,
        "collectives each group's flight recorder keeps on each rank (0-1,000,000; `0` turns "
        "it off): its last N, written on the group's first failure, on SIGUSR1 and on "
        "`hsdp_backend.dump_trace()`"),
    Var("HSDP_TRACE_DIR", "trace", "trace_dir", parse_text, str,
        "directory of the flight records, `hsdp-trace.<group>.rank<R>.json`; "
        "`python -m hsdp_backend.trace DIR` reads them"),
    Var("HSDP_NCCL_BF16_PREMUL_SUM", "cuda", "nccl_bf16_premul_sum",
        _optional_choice("auto", "intact", "lost"),
        lambda v: "auto" if v is None else ("intact" if v else "lost"),
        "whether the wrapped ProcessGroupNCCL keeps a bf16 PREMUL_SUM factor (2.11-2.13 lose "
        "it); `auto`: a final release says, other builds are probed once on the GPU"),
    Var("HSDP_FSDP", "fsdp", "fsdp_shim", _choice("auto", "off"),
        lambda on: "auto" if on else "off",
        "`auto`: FSDP2 modules on hsdp meshes use `hsdp_backend.fsdp` (HSDP gradients divided "
        "once, replicate all-reduces bucketed across param groups); `off`: FSDP2's own "
        "reduction path"),
    Var("HSDP_FSDP_BUCKET_BYTES", "fsdp", "fsdp_bucket_bytes", parse_int, str,
        "capacity of one replicate all-reduce bucket of the FSDP2 shim; smaller than DDP's "
        "25 MB because a CPU collective costs microseconds to start and a full bucket reduces "
        "while backward goes on (HSDP 2x2, small model: forward + backward about 5% faster "
        "than with 25 MiB, within this machine's noise)"),
    Var("HSDP_RUN_BACKEND_MAP", "launcher", "run_backend_map", parse_flag, lambda on: str(int(on)),
        "`1`: the ranks' `init_process_group` with no backend, `gloo` or "
        "`cpu:gloo,cuda:nccl` runs on hsdp (read by the injected `sitecustomize`)"),
    Var("HSDP_RUN_VERBOSE", "launcher", "run_verbose", parse_flag, lambda on: str(int(on)),
        "`1`: each rank prints one line on stderr per mapped call"),
]
# fmt: on

VARS = {v.name: v for v in _TABLE}


def _invalid(name: str, text: str, exc: Exception) -> ValueError:
    return ValueError(f"Invalid value for environment variable {name}={text!r}: {exc}")


def resolve(environ=None):
    """The package's settings, from ``environ`` (default: ``os.environ``),
    as an ``hsdp_backend._C.Config``. Unset variables keep Config's defaults."""
    from hsdp_backend import _C

    environ = os.environ if environ is None else environ
    config = _C.Config()
    for var in VARS.values():
        found = var.text_in(environ)
        if found is None:
            continue
        name, text = found
        try:
            setattr(config, var.field, var.parse(text))
        except (ValueError, TypeError) as exc:
            raise _invalid(name, text, exc) from None
    return config


def read(name: str, environ=None):
    """The value of one package setting, as ``resolve`` makes it."""
    environ = os.environ if environ is None else environ
    found = VARS[name].text_in(environ)
    value = resolve(dict([found]) if found else {})
    return getattr(value, VARS[name].field)


def read_text(var: Var, environ=None):
    """The value of ``var``, a row with no Config field (the tests' table,
    tools/settings.py): its text in ``environ`` (default: ``os.environ``) or
    its default, parsed; None when both are unset. A bad value is refused by
    name, as ``resolve`` refuses one."""
    environ = os.environ if environ is None else environ
    name, text = var.text_in(environ) or (var.name, var.default)
    if text is None:
        return None
    try:
        return var.parse(text)
    except ValueError as exc:
        raise _invalid(name, text, exc) from None


def default_text(var: Var) -> str:
    """The default of ``var`` as environment text ("" when unset)."""
    if var.field is None:
        return var.default or ""
    from hsdp_backend import _C

    return var.show(getattr(_C.Config(), var.field))


def markdown(table=None, sections=None) -> str:
    """The rows of ``table`` (default: this one) as a Markdown table, section
    by section in the order of ``sections`` (name -> title; default:
    ``SECTIONS``): docs/configuration.md's, and docs/testing.md's from
    tools/settings.py."""
    table = list(VARS.values()) if table is None else list(table)
    sections = SECTIONS if sections is None else sections
    lines = ["| variable | default | meaning |", "|---|---|---|"]
    for section, title in sections.items():
        lines.append(f"| **{title}** | | |")
        for var in table:
            if var.section == section:
                default = default_text(var)
                lines.append(f"| `{var.name}` | {f'`{default}`' if default else ''} | {var.help} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
