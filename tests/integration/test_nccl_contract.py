"""The CUDA route's promises beyond matching gloo, through the NCCL-contract double (`-k
nccl_contract`).

The CUDA route's promises beyond matching gloo (cases in
nccl_contract_cases.py), through the NCCL-contract double. Every test id
here and in the ops / fusion / FSDP suites that runs through the double
contains ``nccl_contract``: ``pytest tests -k nccl_contract`` selects them.

Through the NCCL-contract double: AVG reaches NCCL as AVG (integers too), `divide_by` and
PREMUL_SUM as one PREMUL_SUM, a tensor factor as a tensor of the data's dtype; synchronous calls
return no Work; async post-steps wait for every inner Work (several buckets and dtypes, staged
arguments, futures); post-steps of a `_coalescing_manager(device=...)` block wait for its end
Work; hsdp's staged copy for a synchronous call in a block lives until the block ran (the double
fails a block whose synchronous calls' tensors were freed, as NCCL keeps only async calls'
tensors); `allocate_tensor` before the communicator exists raises NCCL's error, and a barrier
makes it; injected NCCL errors reach `wait()` and, unwaited, `is_completed()` / `exception()`
(pass-through, chained, bucketed, polled, sync) and the group stays usable; a bounded wait that
expires aborts the group with NCCL's message; groups created under a device-bound default group
(`meta:0` standing for the GPU, torch's own `new_group`): hsdp under an NCCL default joins the
split the non-members make, NCCL under an hsdp default is built anew, a split a parent rank
never joins fails at the timeout. `test_ops.py`, `test_fusion.py`, `test_errors.py` and
`test_fsdp.py` also run through the double (ids contain `nccl_contract`)."""

import nccl_contract_cases
import pytest
from conftest import NCCL_CONTRACT_WORLDS
from harness import case_params, run_ranks
from hooks import NCCL_CONTRACT, engine_env

from hsdp_backend import _torch_compat

NAMES = list(nccl_contract_cases.CASES)


@pytest.mark.parametrize("world", NCCL_CONTRACT_WORLDS)
@pytest.mark.parametrize("name", case_params(nccl_contract_cases.CASES))
def test_nccl_contract(launcher, name, world):
    launcher.check("nccl_contract_cases", NAMES, name, world, env=engine_env(NCCL_CONTRACT))


# The cases whose outcome depends on how the modelled release's
# ProcessGroupNCCL marshals a PREMUL_SUM factor (docs/versions.md).
FACTOR_CASES = [
    "scales_reach_nccl_as_avg_or_one_premul_sum",
    "bf16_factors_never_reach_nccl_where_torch_loses_them",
    "a_tensor_factor_reaches_nccl_as_a_tensor_of_the_data_dtype",
]


@pytest.mark.parametrize("release", [13, 14])
@pytest.mark.parametrize("name", FACTOR_CASES)
def test_nccl_contract_factors_of_release(launcher, name, release):
    """The same cases through the double modelling another release's
    ProcessGroupNCCL (13: a bf16 factor is lost; 14: kept), hsdp told which."""
    env = {**engine_env(NCCL_CONTRACT), "HSDP_TEST_NCCL_RELEASE": str(release)}
    launcher.check("nccl_contract_cases", NAMES, name, 2, env=env)


@pytest.mark.every_torch
@pytest.mark.parametrize(
    "body",
    [
        "hsdp_under_a_bound_nccl_default",
        pytest.param(
            "nccl_under_a_bound_hsdp_default",
            marks=pytest.mark.skipif(
                not _torch_compat.LAZY_BACKEND_REGISTRATION,
                reason="before torch 2.14 torch creates NCCL groups inline and hands them the "
                "device-bound default (hsdp) to split from, which NCCL refuses: there is no "
                "creator for hsdp to wrap (docs/versions.md)",
            ),
        ),
        "a_split_is_collective_over_the_parent",
    ],
)
def test_nccl_contract_splits(body):
    """Groups created under a device-bound default group (nccl_contract_splits.py)."""
    import nccl_contract_splits

    run_ranks(getattr(nccl_contract_splits, body), 3, backend=None, env=engine_env(NCCL_CONTRACT))
