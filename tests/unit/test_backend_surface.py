"""docs/backend-surface.md lists every virtual of the installed torch's c10d Backend, and its hsdp
column is what ProcessGroupHSDP overrides.

docs/backend-surface.md lists every virtual of c10d's Backend: a release that adds one
fails here until the table says what hsdp, Gloo and NCCL do with it, and the table's hsdp
column is what csrc/backend/ProcessGroupHSDP.hpp overrides."""

import pathlib
import re

import pytest
import torch

# Runs on every supported torch release too (scripts/test.sh's compat stages).
pytestmark = pytest.mark.every_torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
HEADER = pathlib.Path(torch.__file__).parent / "include/torch/csrc/distributed/c10d/Backend.hpp"


def _code(text: str) -> str:
    """Declarations only: comments and preprocessor lines (an `#if X(2, 14)` is no call) dropped."""
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r"^\s*#[^\n]*", "", text, flags=re.M)
    return re.sub(r"/\*.*?\*/", "", text, flags=re.S)


def virtuals(text: str) -> set[str]:
    """The names of the virtual methods declared in a header (destructors aside)."""
    names = set(re.findall(r"\bvirtual\s+[^;{}()]*?\b(\w+)\s*\(", _code(text)))
    return names - {"clone"}  # Backend::Options::clone, not a Backend method


def overrides(text: str) -> set[str]:
    return set(re.findall(r"\b(\w+)\s*\([^;{}]*?\)\s*(?:const\s*)?override\b", _code(text), re.S))


def table() -> dict[str, list[str]]:
    rows = {}
    for line in (ROOT / "docs/backend-surface.md").read_text().splitlines():
        m = re.match(r"\| `(\w+)` \|(.*)\|$", line)
        if m:
            rows[m.group(1)] = [c.strip() for c in m.group(2).split("|")]
    return rows


def test_every_virtual_of_the_installed_backend_is_in_the_table():
    listed = table()
    assert len(listed) > 40, "docs/backend-surface.md's table did not parse"
    missing = sorted(virtuals(HEADER.read_text()) - set(listed))
    assert not missing, (
        f"torch {torch.__version__}'s Backend.hpp declares virtuals that "
        f"docs/backend-surface.md does not list: {missing}"
    )


def test_the_hsdp_column_is_what_processgrouphsdp_overrides():
    ours = overrides((ROOT / "csrc/backend/ProcessGroupHSDP.hpp").read_text())
    for name, (_, hsdp, *_) in table().items():
        assert (name in ours) == hsdp.startswith("overrides"), (name, hsdp)
