"""Communication buffers (`allocate_tensor`): pool memory on CPU, the inner backend's on the CUDA
route; gloo's bytes on both.

Communication buffers: ``allocate_tensor`` hands out memory its peers map
(shm/Pool.hpp) on CPU, and the inner backend's on the CUDA route (the
NCCL-contract double here); collectives on them give gloo's bytes (rank
bodies in buffer_cases.py).

Communication buffers (`allocate_tensor`) on 2-3 ranks: all-gather in place and out of place and
reduce-scatter SUM/AVG on pool buffers, fp32 and bf16, 1-70,000 elements, bitwise equal to hsdp
on ordinary buffers and to gloo (its SUM, exact at 2 ranks), every call on the pooled path
(`buffer_stats`); a released buffer goes back to the pool and is handed out again; a pool tensor
refuses to resize; pool buffers on some ranks only, and another group's buffer: the ordinary
path, the same answer; a buffer used after its group was destroyed; past `HSDP_SHM_POOL_BYTES`:
ordinary memory, counted; no pool (`HSDP_CPU_ROUTE=gloo`, `HSDP_SHM_POOL_BYTES=0`):
`supports_tensor_alloc` false and `allocate_tensor` refused naming rank and op; a hierarchical
group (pretended hosts) matches gloo; through the NCCL-contract double, the request reaches the
inner backend; FSDP2 param groups keep FSDP2's buffers until `hsdp_backend.fsdp.use_group_buffers`
asks for the pool through FSDP2's public setter (a step's collectives then pooled on one host, the
pool taken on a hierarchical group too), undo restores FSDP2's, and a gloo mesh is left alone."""

import buffer_cases
import pytest
from harness import run_ranks
from hooks import NCCL_CONTRACT, engine_env


@pytest.mark.quick
@pytest.mark.parametrize("world", [2, 3])
def test_pool_buffers(world):
    run_ranks(buffer_cases.pool_suite, world)


@pytest.mark.parametrize("world", [2, 3])
def test_reduce_scatters_that_write_around_the_cache(world):
    # From 4 KiB a rank the outputs are written with non-temporal stores,
    # pooled and ordinary alike: still gloo's bytes.
    run_ranks(
        buffer_cases.collectives_match_gloo, world, env={"HSDP_SHM_STREAM_STORE_BYTES": "4096"}
    )


def test_pool_buffers_on_a_hierarchical_group():
    # Pretended hosts: the pool is each host's; results are gloo's.
    run_ranks(
        buffer_cases.collectives_match_gloo, 4, env={"HSDP_TEST_HOSTS": "a,a,b,b"}, flat=False
    )


def test_past_the_bound_is_ordinary_memory():
    run_ranks(
        buffer_cases.past_the_bound_is_ordinary_memory_counted,
        2,
        env={"HSDP_SHM_POOL_BYTES": str(2 << 20)},
    )


@pytest.mark.parametrize(
    "env", [{"HSDP_CPU_ROUTE": "gloo"}, {"HSDP_SHM_POOL_BYTES": "0"}], ids=["gloo", "pool_off"]
)
def test_no_pool_says_why(env):
    run_ranks(buffer_cases.no_pool_says_why, 2, env=env)


def test_nccl_contract_allocation_reaches_the_inner_backend():
    run_ranks(buffer_cases.the_nccl_double_allocates, 2, env=engine_env(NCCL_CONTRACT))


@pytest.mark.parametrize("hosts", ["a,a", "a,a,b,b"], ids=["one_host", "hierarchical"])
def test_fsdp_param_groups_take_the_pool_when_asked(hosts):
    # FSDP2's own buffers by default; the pool through FSDP2's public setter.
    world = len(hosts.split(","))
    env = {"HSDP_TEST_HOSTS": hosts}
    run_ranks(buffer_cases.fsdp_buffers, world, env=env, pooled=world == 2)
