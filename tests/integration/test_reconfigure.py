"""Surviving a lost rank (torch 2.14+'s reconfigure, and shrink_group): the survivors become the
group's members and go on, on hsdp as on gloo.

Groups created with `init_process_group(..., enable_reconfigure=True)` get their members from
`dist._reconfigure(uuid, handles)`, the handles exchanged through a store the test hosts. Four
ranks take all four as members and all-reduce; then a rank is lost (rank 1 exits between
collectives, or rank 0 is SIGKILLed during one: the survivors' all-reduce fails first), the three
survivors reconfigure with their own handles (a set in one scenario, the backend ordering them)
and all-reduce again; in a third scenario rank 1 sits out the second membership and rejoins in a
third, also across two pretended hosts (hierarchical, then flat Gloo for the uneven survivors,
then hierarchical again). Every rank's sums, its new rank, size and sequence number are gloo's in the same scenario,
and getError() says SUCCESS after the reconfigure as on gloo; on hsdp each membership is served
by a shared-memory engine of its own (one segment mapped after a reconfigure: the old
membership's is gone), and nothing is left in /dev/shm. Before its first reconfigure a group
refuses every call, naming what to do. Bad input (a used uuid, another group's or backend's
handle, a handle given twice, one not of Gloo's shape, none, a list without this rank's handle)
is refused by name, and the group goes on serving; a reconfigure that fails in the inner Gloo (a
member that does not come) leaves the group without members, saying so, until a retry serves it.

`dist.shrink_group([3])` (which gloo does not serve) gives the three ranks that stay a group of
their own whose sums are exact, after rank 3 exited, or while it is alive but stuck: there
SHRINK_ABORT ends the survivors' pending all-reduce with an error naming the shrink, well within
the group timeout. Excluding this rank, or a rank outside the group, is refused by name. Through
the NCCL-contract double, a shrink reaches NCCL as its own shrink, SHRINK_ABORT passed on; a rank
given twice, or a group whose NCCL has no communicator yet, is refused first."""

import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist
from conftest import hsdp_segments
from harness import run_ranks

pytestmark = [
    # Runs on every supported torch release too: skipped, saying so, before 2.14.
    pytest.mark.every_torch,
    pytest.mark.skipif(
        not hasattr(dist, "_reconfigure"), reason="torch before 2.14 has no reconfigure"
    ),
]

WORLD = 4
LOST = WORLD - 1  # shrink_group's tests lose the last rank


def _handles(store, tag: str, rank: int, members, as_set: bool = False):
    """The members' handles in rank order, exchanged under `tag` (this rank's among them); a set
    where `as_set` (the backend orders them)."""
    store.set(f"{tag}/{rank}", dist._get_reconfigure_handle())
    handles = [store.get(f"{tag}/{r}").decode() for r in members]
    return set(handles) if as_set else handles


def _sums(rank: int) -> dict:
    """One small and one multi-step all-reduce: what every member contributes, summed."""
    import torch

    small = torch.tensor([float(rank + 1)])
    dist.all_reduce(small)
    big = torch.arange(300_000, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(big)
    return {"small": small.item(), "big": big.sum().item(), "rank_size": dist.get_world_size()}


def _error() -> str:
    return dist.group.WORLD._get_backend(torch.device("cpu")).get_error().name


def _mapped_segments() -> int:
    with open("/proc/self/maps") as maps:
        return len({line.split()[-2] for line in maps if "/dev/shm/hsdp-" in line})


def lose_a_rank_body(rank, world, kind, how, lost, port):
    import datetime

    import torch

    import hsdp_backend

    # The store is the test's, not rank 0's: rank 0 may be the one lost.
    timeout = datetime.timedelta(seconds=20)
    # Longer than the group's: a survivor may take its timeout to find the loss.
    store = dist.TCPStore(
        "127.0.0.1", port, world, is_master=False, timeout=datetime.timedelta(seconds=60)
    )
    dist.init_process_group(
        kind, store=store, rank=rank, world_size=world, enable_reconfigure=True, timeout=timeout
    )
    out = {"supports": dist._supports_reconfigure()}
    if kind == "hsdp":
        try:
            dist.all_reduce(torch.ones(1))
            out["before"] = "served"
        except dist.DistBackendError as exc:
            out["before"] = str(exc)
    dist._reconfigure(1, _handles(store, "first", rank, range(world))).wait()
    out["first"] = _sums(rank)
    if kind == "hsdp":
        out["first_engine"] = hsdp_backend.cpu_route()
    if how == "between" and rank == lost:
        os._exit(3)  # lost between collectives, without a word
    if how == "during":
        big = torch.ones(4 << 20)  # 16 MiB: many steps on either backend
        if rank == lost:
            threading.Timer(0.05, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
            dist.all_reduce(big, async_op=True)
            time.sleep(60)
        try:
            for _ in range(1000):
                dist.all_reduce(big)
            out["failed"] = None
        except (dist.DistBackendError, RuntimeError) as exc:
            out["failed"] = type(exc).__name__
        out["error_after_failure"] = _error()
    survivors = [r for r in range(world) if r != lost]
    if how != "rejoin" or rank != lost:
        # A set for one scenario: the backend orders the handles (gloo: sorted).
        handles = _handles(store, "second", rank, survivors, as_set=how == "between")
        dist._reconfigure(2, handles).wait()
        out["second"] = _sums(rank)
        out["rank"] = dist.get_rank()
        out["sequence"] = dist.group.WORLD._get_sequence_number_for_group()
        out["error_after_reconfigure"] = _error()
        if kind == "hsdp":
            out["second_engine"] = hsdp_backend.cpu_route()
            out["mapped"] = _mapped_segments()
    if how == "rejoin":
        if rank == survivors[0]:
            store.set("second_done", "1")
        store.wait(["second_done"])
        dist._reconfigure(3, _handles(store, "third", rank, range(world))).wait()
        out["third"] = _sums(rank)
        out["third_rank"] = dist.get_rank()
        if kind == "hsdp":
            out["third_engine"] = hsdp_backend.cpu_route()
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize(
    ("how", "lost", "pretended"),
    [("between", 1, None), ("during", 0, None), ("rejoin", 1, None), ("rejoin", 1, "a,a,b,b")],
    ids=["between", "during", "rejoin", "rejoin-across-hosts"],
)
def test_survivors_reconfigure_and_go_on_as_on_gloo(how, lost, pretended):
    """Across two pretended hosts the first membership is hierarchical, the survivors' (one rank
    on one host, two on the other) flat Gloo, and the rejoined one hierarchical again."""
    before = hsdp_segments()
    may_die = (lost,) if how != "rejoin" else ()
    # Each membership's engine: all on one host, shared memory; else what its hosts allow.
    engines = (
        ("shm", "shm", "shm") if pretended is None else ("hierarchical", "gloo", "hierarchical")
    )
    results = {}
    for kind in ("hsdp", "gloo"):
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        results[kind] = run_ranks(
            lose_a_rank_body,
            WORLD,
            backend=None,
            may_die=may_die,
            fresh=True,
            kind=kind,
            how=how,
            lost=lost,
            port=store.port,
            env={"HSDP_TEST_HOSTS": pretended} if pretended else None,
        )
        del store
    hsdp, gloo = results["hsdp"], results["gloo"]
    survivors = [r for r in range(WORLD) if r != lost]
    for r in range(WORLD):
        if hsdp[r] is None:  # the lost rank
            assert r == lost and how != "rejoin" and gloo[r] is None
            continue
        mine, theirs = hsdp[r], gloo[r]
        assert mine["supports"] and theirs["supports"]
        assert "has no members yet" in mine["before"] and "_reconfigure" in mine["before"]
        assert f"[rank {r}/{WORLD}] all_reduce" in mine["before"], mine["before"]
        for key in ("first", "second", "third", "rank", "sequence", "third_rank"):
            assert mine.get(key) == theirs.get(key), (r, key, mine, theirs)
        assert mine["first"]["small"] == 10.0 and mine["first_engine"] == engines[0]
        if "second" in mine:
            assert mine["second"]["small"] == sum(s + 1 for s in survivors)
            assert mine["second"]["rank_size"] == WORLD - 1
            assert mine["rank"] == survivors.index(r), "the survivors are renumbered in order"
            assert mine["second_engine"] == engines[1]
            mapped = int(engines[1] != "gloo")
            assert mine["mapped"] == mapped, "the old membership's segment is still mapped"
            # The new membership reports none of the old one's failures (gloo: always SUCCESS).
            assert mine["error_after_reconfigure"] == "SUCCESS" == theirs["error_after_reconfigure"]
        if how == "during":
            assert mine["failed"] is not None and theirs["failed"] is not None, (mine, theirs)
            assert mine["error_after_failure"] != "SUCCESS", mine
        if how == "rejoin":
            assert mine["third"]["small"] == 10.0 and mine["third_rank"] == r
            assert mine["third_engine"] == engines[2]
    assert hsdp_segments() == before


def bad_input_body(rank, world):
    import datetime

    import torch

    dist.init_process_group(
        "hsdp",
        init_method="env://",
        enable_reconfigure=True,
        timeout=datetime.timedelta(seconds=20),
    )
    store = dist.distributed_c10d._get_default_store()
    handles = _handles(store, "first", rank, range(world))
    dist._reconfigure(7, handles).wait()
    errors = {}

    def refused(name, **kwargs):
        try:
            dist._reconfigure(**kwargs).wait()
            errors[name] = None
        except (ValueError, RuntimeError) as exc:
            errors[name] = str(exc)
        # The group still serves its members.
        t = torch.tensor([1.0])
        dist.all_reduce(t)
        errors[name + " then all_reduce"] = t.item()

    refused("uuid used", uuid=7, handles=handles)
    others = [h for r, h in enumerate(handles) if r != rank]
    refused("own handle missing", uuid=8, handles=others)
    gloo_handle = handles[0][handles[0].index("gloo:") :]
    refused("gloo's handle", uuid=9, handles=[gloo_handle, *handles[1:]])
    sub = dist.new_group(list(range(world)), backend="gloo")
    gloo_sub = dist._get_reconfigure_handle(sub)
    refused("another backend's group", uuid=10, handles=[*handles[:-1], gloo_sub])
    other_group = handles[0].replace(":1:0gloo", ":1:9gloo", 1)
    refused("another group", uuid=11, handles=[other_group, *handles[1:]])
    refused("twice", uuid=12, handles=[*handles, handles[rank]])
    not_gloo = handles[0][: handles[0].index("gloo:")] + "gloo:x:1:0:nowhere"
    refused("not gloo's shape", uuid=13, handles=[not_gloo, *handles[1:]])
    refused("none", uuid=14, handles=[])
    # A reconfigure that fails in the inner Gloo (rank 1 does not come): rank 0's group has no
    # members, says so, and a retry with a fresh uuid, rank 1 now coming, serves both again.
    handles = _handles(store, "now", rank, range(world))  # a reconfigure changes the handles
    if rank == 0:
        try:
            dist._reconfigure(15, handles, timeout=datetime.timedelta(seconds=2)).wait()
            errors["failed"] = None
        except (ValueError, RuntimeError) as exc:
            errors["failed"] = str(exc)
        try:
            dist.all_reduce(torch.ones(1))
            errors["after failed"] = None
        except dist.DistBackendError as exc:
            errors["after failed"] = str(exc)
        store.set("retry", "1")
    store.wait(["retry"])
    dist._reconfigure(16, _handles(store, "retry", rank, range(world))).wait()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    errors["retried"] = t.item()
    errors["error after retried"] = _error()
    dist.destroy_process_group()
    return errors


def test_bad_input_is_refused_by_name_and_the_group_goes_on():
    before = hsdp_segments()
    results = run_ranks(bad_input_body, 2, backend=None, fresh=True)
    for r, errors in enumerate(results):
        prefix = f"[rank {r}/2] reconfigure: "
        assert prefix + "uuid 7 was used before on this group" in errors["uuid used"], errors
        assert "this rank's own handle is not among the 1 handles" in errors["own handle missing"]
        for name in ("gloo's handle", "another backend's group", "another group"):
            assert errors[name] and "is not a handle of this group (0)" in errors[name], errors
        assert prefix in errors["own handle missing"] and prefix in errors["another group"]
        assert prefix + "handle 2 is given twice" in errors["twice"], errors["twice"]
        assert "handle 0 carries no handle of the inner gloo backend" in errors["not gloo's shape"]
        assert "own handle is not among the 0 handles" in errors["none"], errors["none"]
        assert errors["retried"] == 3.0 and errors["error after retried"] == "SUCCESS", errors
        for name in [n for n in errors if n.endswith("then all_reduce")]:
            assert errors[name] == 2.0, (name, errors)
    failed = results[0]
    assert (
        "[rank 0/2] reconfigure: the group could not take its 2 members (uuid 15)"
        in (failed["failed"])
    ), failed["failed"]
    assert "wait timeout after 2000ms" in failed["failed"] and "frame #" not in failed["failed"]
    assert "has no members yet" in failed["after failed"], failed["after failed"]
    assert hsdp_segments() == before


def shrink_body(rank, world, how):
    import datetime

    import torch

    import hsdp_backend

    dist.init_process_group("hsdp", init_method="env://", timeout=datetime.timedelta(seconds=60))
    store = dist.distributed_c10d._get_default_store()
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    out = {"supports": backend.supports_shrinking, "first": _sums(rank), "refused": []}
    for excluded in ([rank], [world + 3], list(range(world))):
        try:
            backend.shrink(excluded)
        except (ValueError, RuntimeError) as exc:
            out["refused"].append(str(exc))
    pending = None
    if rank == LOST:
        if how == "stuck":
            store.wait(["shrunk"])  # alive, in no collective, until the others shrank
        os._exit(3)
    flags = dist.distributed_c10d.SHRINK_DEFAULT
    if how == "stuck":
        pending = dist.all_reduce(torch.ones(1), async_op=True)  # rank 3 never joins it
        flags = dist.distributed_c10d.SHRINK_ABORT
    start = time.monotonic()
    dist.shrink_group([LOST], shrink_flags=flags)
    if pending is not None:
        try:
            pending.wait()
            out["pending"] = "completed"
        except Exception as exc:  # noqa: BLE001 - its text is the check
            out["pending"] = str(exc)
        out["pending_s"] = time.monotonic() - start
    out["second"] = _sums(rank)
    out["rank"] = dist.get_rank()
    out["engine"] = hsdp_backend.cpu_route()
    if how == "stuck" and rank == 0:
        store.set("shrunk", "1")
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("how", ["exit", "stuck"])
def test_the_ranks_that_stay_shrink_the_group_and_go_on(how):
    before = hsdp_segments()
    results = run_ranks(shrink_body, WORLD, backend=None, may_die=(LOST,), how=how)
    assert results[LOST] is None
    for r, out in enumerate(results[:LOST]):
        assert out["supports"]
        assert (
            f"[rank {r}/{WORLD}] shrink_group: this rank is among the ranks to exclude"
            in (out["refused"][0])
        ), out["refused"]
        assert f"rank {WORLD + 3} to exclude is not in 0..{WORLD - 1}" in out["refused"][1]
        assert "every rank would be excluded" in out["refused"][2], out["refused"]
        assert out["first"]["small"] == 10.0
        big = (torch.arange(300_000, dtype=torch.float32) * 6).sum().item()  # 1 + 2 + 3
        assert out["second"] == {"small": 6.0, "big": big, "rank_size": 3}
        assert out["rank"] == r and out["engine"] == "shm"
        if how == "stuck":
            assert "SHRINK_ABORT" in out["pending"], out["pending"]
            assert out["pending_s"] < 20, out  # not the group's 60 s timeout
    assert hsdp_segments() == before


def shrink_through_nccl_body(rank, world, lost):
    import datetime

    import hsdp_testing
    import torch
    from hooks import double_of

    dist.init_process_group("hsdp", init_method="env://", timeout=datetime.timedelta(seconds=60))
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    out = {"supports": backend.supports_shrinking, "refused": {}}

    def refused(name, excluded):
        try:
            backend.shrink(excluded)
            out["refused"][name] = None
        except (ValueError, RuntimeError) as exc:
            out["refused"][name] = str(exc)

    refused("no communicator", [lost])  # NCCL makes it at the first collective
    out["first"] = _sums(rank)
    refused("twice", [lost, lost])
    if rank == lost:
        os._exit(3)
    dist.shrink_group([lost], shrink_flags=dist.distributed_c10d.SHRINK_ABORT)
    out["second"] = _sums(rank)
    out["rank"] = dist.get_rank()
    out["shrunk_with"] = hsdp_testing.shrunk_with_flags(
        double_of(dist.group.WORLD._get_backend(torch.device("cpu")))
    )
    dist.destroy_process_group()
    return out


def test_a_shrink_reaches_nccl_as_ncclcommshrink():
    """Through the NCCL-contract double (the route NCCL takes, on CPU): hsdp shrinks the inner
    NCCL with its own shrink, SHRINK_ABORT passed on, among the ranks that stay, renumbered as
    NCCL renumbers them; it refuses what NCCL's shrink would do wrong or refuse later: a rank
    given twice (NCCL counts it twice in the child's size) and a group whose NCCL has no
    communicator yet."""
    from hooks import NCCL_CONTRACT, engine_env

    lost = 1
    results = run_ranks(
        shrink_through_nccl_body,
        WORLD,
        backend=None,
        may_die=(lost,),
        env=engine_env(NCCL_CONTRACT),
        lost=lost,
    )
    survivors = [r for r in range(WORLD) if r != lost]
    big = (torch.arange(300_000, dtype=torch.float32) * sum(s + 1 for s in survivors)).sum().item()
    for r in survivors:
        out = results[r]
        assert out["supports"], out
        prefix = f"[rank {r}/{WORLD}] shrink_group: "
        assert (
            prefix + "the group's inner nccl_contract backend has no communicator yet"
            in (out["refused"]["no communicator"])
        ), out
        assert prefix + f"rank {lost} to exclude is given twice" in out["refused"]["twice"], out
        assert out["first"]["small"] == 10.0
        assert out["second"] == {"small": 8.0, "big": big, "rank_size": 3}, out
        assert out["rank"] == survivors.index(r)
        assert out["shrunk_with"] == dist.distributed_c10d.SHRINK_ABORT, "not NCCL's shrink"
