"""The CUDA route's promises beyond matching gloo (cases in
nccl_contract_cases.py), through the NCCL-contract double. Every test id
here and in the ops / fusion / FSDP suites that runs through the double
contains ``nccl_contract``: ``pytest tests -k nccl_contract`` selects them."""

import nccl_contract_cases
import pytest
from conftest import NCCL_CONTRACT_WORLDS

NAMES = list(nccl_contract_cases.CASES)


@pytest.mark.parametrize("world", NCCL_CONTRACT_WORLDS)
@pytest.mark.parametrize("name", NAMES)
def test_nccl_contract(launcher, name, world):
    launcher.check("nccl_contract_cases", NAMES, name, world, env={"HSDP_ENGINE": "nccl_contract"})
