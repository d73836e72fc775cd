"""The tests' hooks (tests/hooks.py): what they hand hsdp's creator, and the
settings they refuse.

The tests' hooks into hsdp's creator (`tests/hooks.py`): nothing set leaves the creator alone,
pretended hosts name each global rank (`?`: unreadable) and refuse a rank past the list, an
empty host name or an unknown inner backend refused by name, the double as inner backend with
`HSDP_CPU_ROUTE=gloo`."""

import hooks
import pytest

from hsdp_backend._registration import hooks as package_hooks


@pytest.fixture(autouse=True)
def restore_the_package_hooks(monkeypatch):
    monkeypatch.setattr(package_hooks, "inner_cpu", package_hooks.inner_cpu)
    monkeypatch.setattr(package_hooks, "host_identity", package_hooks.host_identity)


def test_nothing_set_leaves_the_creator_alone():
    hooks.install({"HSDP_TEST_HOSTS": "a,b"})
    hooks.install({})
    assert package_hooks.inner_cpu is None and package_hooks.host_identity is None


def test_pretended_hosts_name_each_global_rank(monkeypatch):
    hooks.install({"HSDP_TEST_HOSTS": "a,b,?"})
    for rank, expected in [("0", "a|test-host"), ("1", "b|test-host"), ("2", "")]:
        monkeypatch.setenv("RANK", rank)
        assert package_hooks.host_identity(None) == expected
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(ValueError, match="names 3 hosts but this is global rank 3"):
        package_hooks.host_identity(None)


@pytest.mark.parametrize(
    "environ,message",
    [
        ({"HSDP_TEST_HOSTS": "a,,b"}, "expected a host name per rank"),
        ({"HSDP_TEST_INNER": "gloo"}, "expected nccl_contract or nothing"),
    ],
)
def test_bad_settings_are_refused_by_name(environ, message):
    with pytest.raises(ValueError, match=message):
        hooks.install(environ)


def test_the_double_is_the_inner_cpu_backend_with_the_gloo_engine():
    hooks.install({"HSDP_TEST_INNER": "nccl_contract"})
    assert package_hooks.inner_cpu is hooks.nccl_contract_inner
    assert hooks.engine_env("nccl_contract") == {
        "HSDP_CPU_ROUTE": "gloo",
        "HSDP_TEST_INNER": "nccl_contract",
    }
    assert hooks.engine_env("shm") == {"HSDP_CPU_ROUTE": "shm"}
