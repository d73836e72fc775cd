"""Hierarchical collectives (shared memory within hosts, gloo between them) on pretended hosts:
every algorithm path, bitwise.

Hierarchical collectives (shared memory within hosts, gloo between them) on
hosts pretended through HSDP_TEST_HOSTS: what the op cases (test_ops.py) do
not pin down. Every algorithm path (sliced and whole all-reduce, piecewise and
staged all-gather), bitwise-identical results on all ranks, the deferred
division, and the errors. Real hosts (network namespaces): test_hosts.py.

On 2 pretended hosts x 2 ranks: every algorithm path (all-reduce below / above the sliced
threshold and not divisible, all-gather staged and piecewise, in place, reduce-scatter per host
block, broadcast from every root, barriers) exact and bitwise identical on all ranks,
`divide_by` as one step; `HSDP_CPU_ROUTE=shm` on a spanning group (error naming the hosts); hosts
with different numbers of ranks (flat gloo, one log line); ranks that call different collectives
(every rank fails, named by group rank)."""

from harness import run_ranks

TWO_BY_TWO = {"HSDP_TEST_HOSTS": "a,a,b,b"}


def _bytes_everywhere(t, ref):
    """Every rank's bytes of `t`, gathered over the gloo group `ref`."""
    import torch
    import torch.distributed as dist

    raw = t.contiguous().view(torch.uint8).flatten()
    out = [torch.empty_like(raw) for _ in range(dist.get_world_size(ref))]
    dist.all_gather(out, raw, group=ref)
    return out


def paths_body(rank, world):
    import torch
    import torch.distributed as dist

    import hsdp_backend

    ref = dist.new_group(backend="gloo")
    assert hsdp_backend.cpu_route() == "hierarchical"
    g = torch.Generator().manual_seed(100 + rank)
    # All-reduce: below the sliced threshold, sliced (divisible by 2 ranks
    # per host), and large but odd (whole tensor across hosts).
    for n in [3, 40_000, 40_001, 1_000_000]:
        for dtype in [torch.float32, torch.bfloat16]:
            x = torch.randn(n, generator=g).to(dtype)
            mine = x.clone()
            dist.all_reduce(mine, op=dist.ReduceOp.AVG)
            expected = x.double()
            dist.all_reduce(expected, group=ref)
            torch.testing.assert_close(
                mine.double(),
                expected / world,
                rtol=2e-2 if dtype == torch.bfloat16 else 1e-5,
                atol=1e-2 if dtype == torch.bfloat16 else 1e-5,
            )
            every = _bytes_everywhere(mine, ref)
            assert all(torch.equal(every[0], b) for b in every), (
                f"all_reduce n={n} {dtype}: ranks differ"
            )
    # All-gather below and above the direct-read threshold (staged and
    # piecewise intra-host phases: 2 hosts x 1.2 MB is past the 2 MiB a group
    # measures at most), out of place and in place.
    for n in [5, 300_000]:
        piece = torch.arange(n, dtype=torch.float32) + 1000 * rank
        expected = torch.cat(
            [torch.arange(n, dtype=torch.float32) + 1000 * r for r in range(world)]
        )
        out = torch.empty(world * n)
        dist.all_gather_into_tensor(out, piece)
        assert torch.equal(out, expected)
        out.zero_()
        out.narrow(0, rank * n, n).copy_(piece)
        dist.all_gather_into_tensor(out, out.narrow(0, rank * n, n))
        assert torch.equal(out, expected)
    # Reduce-scatter, exact integers, and the deferred division of a chain
    # of sums (hsdp's divide_by): one scaling step on the final values.
    for n in [1, 70_000]:
        full = torch.arange(world * n, dtype=torch.float32) * (rank + 1)
        out = torch.empty(n)
        hsdp_backend.reduce_scatter_tensor(out, full, divide_by=4.0)
        total = sum(r + 1 for r in range(world))
        assert torch.equal(
            out, torch.arange(rank * n, (rank + 1) * n, dtype=torch.float32) * total / 4.0
        )
    t = torch.full((64,), float(rank + 1), dtype=torch.bfloat16)
    hsdp_backend.all_reduce(t, divide_by=3.0)
    assert torch.equal(t, torch.full((64,), 10 / 3, dtype=torch.float32).to(torch.bfloat16))
    # Broadcast from a root on each host, at either local index.
    for root in range(world):
        b = torch.full((300_000,), float(rank))
        dist.broadcast(b, src=root)
        assert torch.equal(b, torch.full((300_000,), float(root)))
    for _ in range(20):
        dist.barrier()
    return True


def test_every_path_gives_exact_and_identical_results():
    run_ranks(paths_body, 4, env=TWO_BY_TWO)


def shm_required_body(rank, world):
    import torch.distributed as dist

    try:
        dist.new_group(backend="hsdp")
    except Exception as exc:  # noqa: BLE001 - the creator's error, whatever its type
        return str(exc)
    return None


def test_shm_required_on_a_group_that_spans_hosts_names_the_hosts():
    messages = run_ranks(
        shm_required_body, 4, backend="gloo", env={**TWO_BY_TWO, "HSDP_CPU_ROUTE": "shm"}
    )
    for text in messages:
        assert text is not None, "HSDP_CPU_ROUTE=shm on a group spanning hosts must fail"
        assert "spans 2 hosts" in text, text
        assert "ranks 0,1 on host a; ranks 2,3 on host b" in text, text


def uneven_body(rank, world):
    import logging

    import torch
    import torch.distributed as dist

    import hsdp_backend

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("hsdp_backend").addHandler(handler)
    g = dist.new_group(backend="hsdp")
    assert hsdp_backend.cpu_route(g) == "gloo"
    t = torch.ones(4)
    dist.all_reduce(t, group=g)
    assert torch.equal(t, torch.full((4,), float(world)))
    lines = [r.getMessage() for r in records]
    assert len(lines) == 1, lines
    return lines[0]


def test_hosts_with_different_numbers_of_ranks_log_one_line_and_use_gloo():
    for line in run_ranks(uneven_body, 4, env={"HSDP_TEST_HOSTS": "a,a,a,b"}):
        assert "runs its CPU collectives on gloo" in line, line
        assert "ranks 0,1,2 on host a; ranks 3 on host b" in line, line


def mismatch_body(rank, world):
    import datetime

    import torch
    import torch.distributed as dist

    g = dist.new_group(backend="hsdp", timeout=datetime.timedelta(seconds=10))
    # Rank 3 (host b's second rank) calls a different size.
    t = torch.ones(8 if rank != 3 else 9)
    try:
        dist.all_reduce(t, group=g)
    except dist.DistBackendError as exc:
        return str(exc)
    return None


def test_ranks_that_call_different_collectives_fail_everywhere_naming_group_ranks():
    import time

    start = time.monotonic()
    messages = run_ranks(mismatch_body, 4, env=TWO_BY_TWO)
    assert time.monotonic() - start < 60
    for rank, text in enumerate(messages):
        assert text is not None, f"rank {rank} did not fail"
        assert "all_reduce" in text, text
    # Host b's ranks see the mismatch in their shared-memory phase, named in
    # the group's ranks (2 and 3, not the host's 0 and 1).
    assert "[rank 2/4]" in messages[2] and "rank 3 called" in messages[2], messages[2]
    # Host a's ranks fail in the inter-host phase.
    assert "inter-host phase" in messages[0], messages[0]
