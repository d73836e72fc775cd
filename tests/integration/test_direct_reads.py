"""The size from which a group reads peers' ordinary buffers directly: measured together, rank 0
deciding, or set by the user.

From what size a group reads peers' ordinary buffers directly: measured
by each group's ranks together when it is created (shm/Crossover.hpp),
rank 0 deciding; a value the user sets is used as it is.

The direct-read threshold of ordinary buffers: measured by 2- and 3-rank groups, the same on
every rank and one of the sizes measured, a later group adopting it, all-gathers in place and
out of place and broadcasts correct on both sides of it; set on rank 0 (`0`, 4 KiB, 3 MiB) it is
every rank's and nothing is measured (a rank whose own setting says `auto` measuring alone would
hang); `auto` on rank 0 and a value on rank 1: measured on every rank. Where the kernel refuses
`process_vm_readv` (a seccomp filter, as containers install) the group reads no peer's memory,
every op is still right, and `cpu_route_report` says which rank could not read which and why."""

import pytest
from harness import run_ranks

KiB, MiB = 1024, 1024 * 1024
# The sizes the measurement compares the paths at (from 8 KiB by factors of
# 4 up to 512 KiB), and 4 times the last: where direct reads may start.
MEASURABLE = {8 * KiB, 32 * KiB, 128 * KiB, 512 * KiB, 2 * MiB}


def direct_read_bytes(group=None):
    from hsdp_backend import _C, get_hsdp_backend

    return _C.cpu_route(get_hsdp_backend(group))[2]


def gather_and_broadcast_around(threshold, group, rank, world):
    """All-gathers (in place and out of place) and broadcasts on each side of
    `threshold`, compared with what every rank put in."""
    import torch
    import torch.distributed as dist

    for n in sorted({8 * KiB, 64 * KiB, max(threshold, 4) - 4, threshold, 4 * MiB + 12}):
        n //= 4  # floats
        if n == 0:
            continue
        expected = torch.cat([torch.arange(n, dtype=torch.float32) + r * 0.5 for r in range(world)])
        out = torch.empty(world * n)
        out.narrow(0, rank * n, n).copy_(expected.narrow(0, rank * n, n))
        dist.all_gather_into_tensor(out, out.narrow(0, rank * n, n), group=group)
        assert torch.equal(out, expected), ("in place", n)
        out2 = torch.empty(world * n)
        dist.all_gather_into_tensor(out2, expected.narrow(0, rank * n, n).clone(), group=group)
        assert torch.equal(out2, expected), ("out of place", n)
        b = torch.full((n,), float(rank))
        dist.broadcast(
            b, src=dist.get_global_rank(group, world - 1) if group else world - 1, group=group
        )
        assert torch.equal(b, torch.full((n,), float(world - 1))), ("broadcast", n)


def measured_body(rank, world):
    import torch.distributed as dist

    from hsdp_backend import cpu_route_report

    mine = direct_read_bytes()
    assert mine in MEASURABLE, mine
    assert cpu_route_report()["why_no_direct_reads"] == ""
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    assert everyone == [mine] * world, everyone
    gather_and_broadcast_around(mine, None, rank, world)
    # A later group of the same size adopts rank 0's earlier measurement.
    sub = dist.new_group(list(range(world)))
    assert direct_read_bytes(sub) == mine
    gather_and_broadcast_around(mine, sub, rank, world)
    return mine


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_uses_the_threshold_its_group_measured(world):
    run_ranks(measured_body, world)


def set_on_rank_zero_body(rank, world, value):
    import os

    import torch.distributed as dist

    # Rank 0's setting is the group's: a rank whose own setting says auto
    # does not measure alone (it would wait for peers that never join).
    if rank == 0:
        os.environ["HSDP_SHM_DIRECT_READ_BYTES"] = str(value)
    import datetime

    dist.init_process_group("hsdp", timeout=datetime.timedelta(seconds=30))
    assert direct_read_bytes() == value
    gather_and_broadcast_around(value, None, rank, world)


@pytest.mark.parametrize("value", [0, 4096, 3 * MiB])
def test_a_threshold_set_on_rank_zero_is_everyones_and_not_measured(value):
    run_ranks(set_on_rank_zero_body, 2, backend=None, value=value)


def auto_on_rank_zero_body(rank, world):
    import datetime
    import os

    import torch.distributed as dist

    if rank == 1:
        os.environ["HSDP_SHM_DIRECT_READ_BYTES"] = "4096"
    dist.init_process_group("hsdp", timeout=datetime.timedelta(seconds=30))
    mine = direct_read_bytes()
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    assert everyone == [mine] * world and mine in MEASURABLE, everyone
    gather_and_broadcast_around(mine, None, rank, world)


def test_auto_on_rank_zero_measures_on_every_rank():
    run_ranks(auto_on_rank_zero_body, 2, backend=None)


def forbid_process_vm_readv():
    """Installs a seccomp filter on this process under which process_vm_readv fails with EPERM,
    as a container's default profile makes it (irreversible: fresh processes only)."""
    import ctypes
    import errno
    import struct

    process_vm_readv = 310  # x86_64
    ld_nr = struct.pack("HBBI", 0x20, 0, 0, 0)  # BPF_LD|BPF_W|BPF_ABS: seccomp_data.nr
    jeq = struct.pack("HBBI", 0x15, 0, 1, process_vm_readv)  # BPF_JMP|BPF_JEQ|BPF_K
    deny = struct.pack("HBBI", 0x06, 0, 0, 0x00050000 | errno.EPERM)  # RET ERRNO(EPERM)
    allow = struct.pack("HBBI", 0x06, 0, 0, 0x7FFF0000)  # RET ALLOW
    program = ctypes.create_string_buffer(ld_nr + jeq + deny + allow)

    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = Fprog(4, ctypes.addressof(program))
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_no_new_privs, pr_set_seccomp, seccomp_mode_filter = 38, 22, 2
    assert libc.prctl(pr_set_no_new_privs, 1, 0, 0, 0) == 0, ctypes.get_errno()
    assert libc.prctl(pr_set_seccomp, seccomp_mode_filter, ctypes.byref(fprog), 0, 0) == 0, (
        ctypes.get_errno()
    )


def refused_body(rank, world):
    import datetime

    import torch
    import torch.distributed as dist

    from hsdp_backend import cpu_route_report, get_hsdp_backend

    forbid_process_vm_readv()
    dist.init_process_group("hsdp", timeout=datetime.timedelta(seconds=30))
    report = cpu_route_report()
    assert report["route"] == "shm" and report["direct_read_bytes"] == 0, report
    why = report["why_no_direct_reads"]
    assert "cannot read the memory of rank" in why, why
    assert "Operation not permitted" in why and "seccomp filter" in why, why
    assert not get_hsdp_backend().supports_tensor_alloc(torch.device("cpu"))
    # Every op on the slots, on both sides of the thresholds direct reads would have used.
    gather_and_broadcast_around(64 * KiB, None, rank, world)
    for n in (8, 64 * KiB // 4, 2 * MiB // 4 + 3):
        data = torch.arange(n, dtype=torch.float32) + rank
        dist.all_reduce(data)
        assert torch.equal(
            data, sum(torch.arange(n, dtype=torch.float32) + r for r in range(world))
        )
        full = torch.arange(world * n, dtype=torch.float32) * (rank + 1)
        out = torch.empty(n)
        dist.reduce_scatter_tensor(out, full)
        want = sum(torch.arange(world * n, dtype=torch.float32) * (r + 1) for r in range(world))
        assert torch.equal(out, want.narrow(0, rank * n, n))
    return why


@pytest.mark.skipif(
    __import__("platform").machine() != "x86_64", reason="the filter names x86_64's syscall"
)
def test_a_kernel_that_refuses_cross_memory_reads_leaves_the_slots_and_says_why():
    whys = run_ranks(refused_body, 2, backend=None)
    # Both ranks report the group's one reason: the first rank's that could not read.
    assert whys[0] == whys[1] and whys[0].startswith("rank 0 cannot read the memory of rank 1"), (
        whys
    )
