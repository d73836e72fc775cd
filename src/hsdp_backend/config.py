"""hsdp's environment variables: one table, read once per process group,
bad values rejected by name. README.md mirrors this table."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Var:
    name: str
    default: str
    parse: Callable[[str], object]
    help: str


def _choice(*options: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in options:
            raise ValueError(f"expected one of {', '.join(options)}")
        return text

    return parse


def _int(minimum: int, multiple_of: int = 1, maximum: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text.strip().replace("_", ""))
        if value < minimum:
            raise ValueError(f"expected an integer >= {minimum}")
        if maximum is not None and value > maximum:
            raise ValueError(f"expected an integer <= {maximum}")
        if value % multiple_of:
            raise ValueError(f"expected a multiple of {multiple_of}")
        return value

    return parse


def _path(text: str) -> str:
    if not text.strip():
        raise ValueError("expected a directory path")
    return text


def _hosts(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",")] if text.strip() else []
    if any(not n for n in names):
        raise ValueError("expected a comma-separated host name per rank")
    return names


VARS = {
    v.name: v
    for v in [
        Var(
            "HSDP_ENGINE",
            "auto",
            _choice("auto", "shm", "gloo", "nccl_contract"),
            "CPU engine: auto (shared memory when every member of the group is on this host, "
            "else gloo), shm (require shared memory), gloo (always the inner gloo group), "
            "nccl_contract (tests only: CPU tensors take the CUDA route's code, over a double "
            "of ProcessGroupNCCL's contract wrapping gloo)",
        ),
        Var(
            "HSDP_SHM_SLOT_BYTES",
            str(4 << 20),
            _int(64 << 10, 64),
            "bytes a rank moves through shared memory per step; the segment holds 2 slots per "
            "rank. Larger messages are pipelined through the slots",
        ),
        Var(
            "HSDP_SHM_SPIN_US",
            "auto",
            lambda t: t if t == "auto" else _int(0)(t),
            "microseconds a wait spins before sleeping on a futex; auto: 20, or 0 when the group "
            "has more ranks than this machine has cores",
        ),
        Var(
            "HSDP_SHM_ONESHOT_BYTES",
            str(32 << 10),
            _int(0),
            "all-reduces up to this size read every peer's buffer in one round instead of two",
        ),
        Var(
            "HSDP_SHM_DIRECT_READ_BYTES",
            str(256 << 10),
            _int(0),
            "all-gathers and broadcasts of at least this many bytes per rank read peers' "
            "buffers directly (process_vm_readv: one copy instead of two) when the ranks may "
            "read each other's memory; 0 disables",
        ),
        Var(
            "HSDP_FSDP",
            "auto",
            _choice("auto", "off"),
            "auto: FSDP2 modules on hsdp meshes use hsdp_backend.fsdp (HSDP gradients divided once, "
            "replicate all-reduces bucketed across param groups); off: FSDP2's own reduction path",
        ),
        Var(
            "HSDP_FSDP_BUCKET_BYTES",
            str(4 << 20),
            _int(1),
            "capacity of one replicate all-reduce bucket of the FSDP2 shim (param groups' gradient "
            "shards collected into one collective). Smaller than DDP's 25 MB: a CPU collective "
            "costs microseconds to start, and a full bucket reduces while backward goes on",
        ),
        Var(
            "HSDP_TRACE_ENTRIES",
            "64",
            _int(0, maximum=1_000_000),
            "collectives each group's flight recorder keeps on each rank (its last N: sequence "
            "number, op, bytes, route, times, outcome), written on the group's first failure, "
            "on SIGUSR1 and on hsdp_backend.dump_trace(); 0 turns it off",
        ),
        Var(
            "HSDP_TRACE_DIR",
            "/tmp/hsdp-trace",
            _path,
            "directory of the flight records (hsdp-trace.<group>.rank<R>.json); "
            "python -m hsdp_backend.trace DIR reads them",
        ),
        Var(
            "HSDP_TIMEOUT_MS",
            "group",
            lambda t: t if t == "group" else _int(1)(t),
            "deadline of every shared-memory wait; group: the process group's timeout",
        ),
        # Tests only.
        Var(
            "HSDP_TEST_HOSTS",
            "",
            _hosts,
            "tests only: comma-separated host name of each global rank (? : as if the rank "
            "could not read its host identity), used instead of the real host identities: "
            "hierarchical collectives on one machine",
        ),
    ]
}


def read(name: str):
    """The parsed value of ``name`` (its default when unset)."""
    var = VARS[name]
    text = os.environ.get(name, var.default)
    try:
        return var.parse(text)
    except ValueError as exc:
        raise ValueError(f"Invalid value for environment variable {name}={text!r}: {exc}") from None
