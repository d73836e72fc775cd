"""The c10d surface beyond hsdp's fast paths (sparse, lists, p2p, object collectives, monitored
barrier), against gloo.

The c10d surface beyond hsdp's fast paths, against gloo (cases in
c10d_surface_cases.py). CPU engines only: these are CPU-tensor calls (the
NCCL-contract double stands for the CUDA route, which serves none of them).

On both CPU engines, world sizes 1-3, against gloo on the same ranks: sparse all-reduce (SUM as
gloo, AVG and PREMUL_SUM) and DDP with sparse embedding gradients (the embedding bitwise equal
to gloo's), several tensors per rank in all_reduce / broadcast / all_gather, uneven list
reduce_scatter, bad arguments raising an instance of the class gloo raises (and naming rank and
op), `monitored_barrier` (every rank arrives; a rank never arrives: every caller raises within
the timeout and rank 0 names the missing rank, as gloo), `batch_isend_irecv` both ways with
mixed sizes and dtypes, `all_to_all_single` with empty splits, object collectives of several
MiB, `Work.exception()` and `then()` chains (also of a collective that cannot complete),
`abort()` / `shutdown()` then a new group, sequence numbers equal to gloo's."""

import c10d_surface_cases
import pytest
from conftest import engine_worlds
from hooks import engine_env

NAMES = list(c10d_surface_cases.CASES)


@pytest.mark.parametrize(
    "engine,world", [(e, w) for e, w in engine_worlds((1, 2, 3)) if e != "nccl_contract"]
)
@pytest.mark.parametrize("name", NAMES)
def test_c10d_surface(launcher, name, world, engine):
    launcher.check("c10d_surface_cases", NAMES, name, world, env=engine_env(engine))
