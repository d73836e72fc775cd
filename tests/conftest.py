import pytest

from harness import CaseLauncher


@pytest.fixture(scope="session")
def launcher():
    return CaseLauncher()
