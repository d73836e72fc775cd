"""The bf16 PREMUL_SUM gate on NCCL: a final release from 2.14.0 keeps the factor, 2.11-2.13
lose it, any other build is probed; HSDP_NCCL_BF16_PREMUL_SUM overrides both.

A nightly, source or vendor build numbered 2.14 may predate the fix (read from each wheel's
getNcclReduceOp: docs/versions.md), so its number is not trusted."""

import pytest

from hsdp_backend import config
from hsdp_backend._torch_compat import final_release, nccl_bf16_premul_sum


@pytest.mark.parametrize(
    "text,release",
    [
        ("2.14.0", (2, 14, 0)),
        ("2.14.1+cu130", (2, 14, 1)),
        ("2.13.0+cpu", (2, 13, 0)),
        ("2.15.0+rocm7.1", (2, 15, 0)),
        ("2.14.0a0+git1234abc", None),  # a source build
        ("2.14.0a0+08f3c9e.nv26.01", None),  # a vendor container's build
        ("2.14.0.dev20260101", None),  # a nightly
        ("2.14.0.dev20260101+cu130", None),
        ("2.14.0rc1", None),
        ("2.14.0+git1234abc", None),
        ("2.14", None),
        ("not a version", None),
    ],
)
def test_final_releases_are_told_from_other_builds(text, release):
    assert final_release(text) == release


def _never():
    raise AssertionError("a final release must not be probed")


@pytest.mark.parametrize(
    "text,intact",
    [
        ("2.11.0", False),
        ("2.12.1+cu128", False),
        ("2.13.0+cu130", False),
        ("2.14.0", True),
        ("2.15.0+cu130", True),
    ],
)
def test_a_final_release_decides_without_a_probe(text, intact):
    assert nccl_bf16_premul_sum(None, _never, text) is intact


@pytest.mark.parametrize("text", ["2.14.0a0+gitabc", "2.15.0.dev20261201", "2.14.0rc2"])
@pytest.mark.parametrize("answer", [True, False])
def test_other_builds_are_probed(text, answer):
    asked = []
    got = nccl_bf16_premul_sum(None, lambda: asked.append(1) or answer, text)
    assert got is answer and asked == [1]


def test_the_setting_overrides_release_and_probe():
    assert nccl_bf16_premul_sum(False, _never, "2.15.0") is False
    assert nccl_bf16_premul_sum(True, _never, "2.11.0") is True
    assert nccl_bf16_premul_sum(True, _never, "2.14.0a0+gitabc") is True


@pytest.mark.parametrize("text,value", [("auto", None), ("intact", True), ("lost", False)])
def test_the_setting_parses(text, value):
    assert config.resolve({"HSDP_NCCL_BF16_PREMUL_SUM": text}).nccl_bf16_premul_sum is value


def test_a_bad_setting_is_refused_by_name():
    with pytest.raises(ValueError, match="HSDP_NCCL_BF16_PREMUL_SUM='yes'.*auto, intact or lost"):
        config.resolve({"HSDP_NCCL_BF16_PREMUL_SUM": "yes"})
