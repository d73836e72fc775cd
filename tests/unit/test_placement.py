"""Ranks on CUDA devices without a GPU: rank r on r % count, ranks sharing a device each with
their own NCCL_HOSTID; a shared user NCCL_HOSTID and a device too small are refused by name.

NCCL's duplicate-GPU check compares host hash and bus id, and the host hash is NCCL_HOSTID's
when set (pytest-hsdp/src/pytest_hsdp/_placement.py)."""

import pytest
from pytest_hsdp import _placement
from pytest_hsdp._placement import PlacementError, place


def test_one_rank_per_device_changes_nothing():
    for r in range(4):
        p = place(r, 4, 4, {})
        assert (p.device, p.sharing, p.env) == (r, (r,), {})
    # A user's NCCL_HOSTID is theirs where no device is shared.
    assert place(1, 2, 2, {"NCCL_HOSTID": "mine"}).env == {}
    assert "one rank per device" in place(0, 2, 2, {}).describe(2, 2)


@pytest.mark.parametrize("world,count", [(2, 1), (4, 1), (4, 2), (3, 2)])
def test_ranks_sharing_a_device_get_distinct_host_ids(world, count):
    placements = [place(r, world, count, {}) for r in range(world)]
    assert [p.device for p in placements] == [r % count for r in range(world)]
    for device in range(count):
        on_it = [p for p in placements if p.device == device]
        assert all(p.sharing == tuple(q.rank for q in on_it) for p in on_it)
        if len(on_it) > 1:
            ids = [p.env["NCCL_HOSTID"] for p in on_it]
            assert len(set(ids)) == len(ids), ids
        else:
            assert on_it[0].env == {}
    shared = next(p for p in placements if len(p.sharing) > 1)
    text = shared.describe(world, count)
    assert f"share cuda:{shared.device}" in text and "socket transport" in text, text


def test_a_users_host_id_shared_on_one_device_is_refused_by_name():
    with pytest.raises(PlacementError) as err:
        place(2, 4, 2, {"NCCL_HOSTID": "node-a"})
    text = str(err.value)
    assert "ranks [0, 2] share cuda:0" in text and "NCCL_HOSTID='node-a'" in text, text


def test_no_device_is_refused():
    with pytest.raises(PlacementError, match="needs a CUDA device"):
        place(0, 2, 0, {})


def test_memory_for_the_ranks_of_a_device():
    p = place(0, 4, 1, {})
    _placement.check_memory(p, 80 * 2**30, need_gib=20)  # 4 x 20 GiB fit in 80
    with pytest.raises(PlacementError) as err:
        _placement.check_memory(p, 80 * 2**30, need_gib=21)
    text = str(err.value)
    assert "ranks [0, 1, 2, 3] share cuda:0" in text and "80.0 GiB" in text, text
    assert "84.0 GiB" in text, text
