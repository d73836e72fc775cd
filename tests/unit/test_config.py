"""One name, one default and one description per setting: the settings table, the settings object
and the docs' tables agree; bad values are refused by name.

The configuration table (src/hsdp_backend/config.py), the settings object
(hsdp_backend._C.Config, csrc/common/Config.hpp), the tests' own table
(tools/settings.py, not shipped) and the docs' tables agree: every setting has
one name, one default (the object's) and one description, every ``HSDP_*``
name the tree reads is in one of the two tables, and bad values are refused by
name wherever they enter.

The tables of variables in `docs/configuration.md` and here are the ones `config.py` generates;
the settings object (`_C.Config`) and the table cover the same settings, the table shows the
object's defaults, every `HSDP_*` name in the tree is in the table; a bad value of every setting
is refused naming the variable (environment) or the field (object), and a refused value is not
kept."""

import pathlib
import re
import subprocess

import pytest

from hsdp_backend import _C, config
from tools import settings

# Runs on every supported torch release too (scripts/test.sh's compat stages).
pytestmark = pytest.mark.every_torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIELD_VARS = list(config.VARS.values())


def _table(path, heading):
    text = (ROOT / path).read_text()
    section = text[text.index(heading) :]
    end = section.find("\n#", 1)
    section = section if end < 0 else section[:end]
    return "\n".join(line for line in section.splitlines() if line.startswith("|")) + "\n"


def test_the_docs_tables_are_the_generated_ones():
    assert _table("docs/configuration.md", "## Variables") == config.markdown(), (
        "docs/configuration.md's table is stale: paste `python -m hsdp_backend.config`'s output"
    )
    assert _table("docs/testing.md", "## Settings of the tests") == settings.markdown(), (
        "docs/testing.md's table is stale: paste `python -m tools.settings`'s output"
    )


def test_the_package_table_holds_only_settings_of_the_object():
    # The tests' settings live in tools/settings.py, which is not shipped.
    assert all(v.field is not None for v in config.VARS.values())
    assert all(v.field is None for v in settings.VARS.values())
    assert not set(config.VARS) & set(settings.VARS)
    assert set(config.SECTIONS) == {v.section for v in config.VARS.values()}
    assert set(settings.SECTIONS) == {v.section for v in settings.VARS.values()}


def test_every_setting_of_the_object_has_a_variable():
    fields = {n for n in dir(_C.Config) if isinstance(getattr(_C.Config, n), property)}
    assert fields == {v.field for v in FIELD_VARS}


@pytest.mark.parametrize("var", FIELD_VARS, ids=lambda v: v.name)
def test_default_text_reads_back_as_the_objects_default(var):
    # The table shows Config's default; read back, it is that default.
    default = getattr(_C.Config(), var.field)
    assert var.parse(config.default_text(var)) == default
    assert getattr(config.resolve({}), var.field) == default


def test_every_variable_the_tree_reads_is_in_the_table():
    files = subprocess.run(
        ["git", "ls-files", "*.py", "*.cpp", "*.hpp", "*.sh"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    names = set()
    for name in files:
        if not (ROOT / name).exists():  # deleted, not yet committed
            continue
        names |= set(re.findall(r"""["'](HSDP_[A-Z0-9_]+)["']""", (ROOT / name).read_text()))
    assert "HSDP_CPU_ROUTE" in names, "the scan found nothing: it is broken"
    older = {v.older for v in config.VARS.values() if v.older}
    known = set(config.VARS) | set(settings.VARS) | older
    assert names <= known, sorted(names - known)


BAD = {
    "HSDP_CPU_ROUTE": "shared",
    "HSDP_SHM_SLOT_BYTES": "1000",
    "HSDP_SHM_SPIN_US": "-1",
    "HSDP_SHM_YIELD_US": "-1",
    "HSDP_SHM_ONESHOT_BYTES": "x",
    "HSDP_SHM_DIRECT_READ_BYTES": "-5",
    "HSDP_SHM_STREAM_STORE_BYTES": "-1",
    "HSDP_SHM_STREAM_SLOT_BYTES": "-1",
    "HSDP_SHM_STREAM_SLOT_TIMED_BYTES": "x",
    "HSDP_SHM_DIRECT_ALLREDUCE_BYTES": "-1",
    "HSDP_SHM_POOL_BYTES": "-1",
    "HSDP_SHM_POOL_CHUNK_BYTES": "4096",
    "HSDP_TIMEOUT_MS": "0",
    "HSDP_TRACE_ENTRIES": "1000001",
    "HSDP_NCCL_BF16_PREMUL_SUM": "yes",
    "HSDP_TRACE_DIR": " ",
    "HSDP_FSDP": "on",
    "HSDP_FSDP_BUCKET_BYTES": "0",
    "HSDP_RUN_BACKEND_MAP": "yes",
    "HSDP_RUN_VERBOSE": "2",
}


def test_every_setting_has_a_bad_value_here():
    assert set(BAD) == {v.name for v in FIELD_VARS}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_value_is_refused_by_name(name):
    with pytest.raises(ValueError, match=rf"Invalid value for environment variable {name}="):
        config.resolve({name: BAD[name]})


def test_the_object_refuses_bad_values_naming_the_field():
    c = _C.Config()
    with pytest.raises(
        ValueError, match="cpu_route: expected one of auto, shm, gloo, got 'shared'"
    ):
        c.cpu_route = "shared"
    with pytest.raises(ValueError, match="slot_bytes: expected an integer >= 65536"):
        c.slot_bytes = 1000
    assert c.slot_bytes == _C.Config().slot_bytes, "a refused value must not be kept"
    c.spin_us = 0
    c.timeout_ms = None
    assert (c.spin_us, c.timeout_ms) == (0, None)


def test_test_suite_settings_parse_their_defaults():
    for var in settings.VARS.values():
        if var.default is not None:
            settings.read(var.name, {})
    assert settings.read("HSDP_FUZZ_SEED", {}) is None
    assert settings.read("HSDP_TEST_EXIT_RUNS", {"HSDP_TEST_EXIT_RUNS": "7"}) == 7
    with pytest.raises(ValueError, match="variable HSDP_TEST_EXIT_RUNS='many'"):
        settings.read("HSDP_TEST_EXIT_RUNS", {"HSDP_TEST_EXIT_RUNS": "many"})


def test_the_cpu_routes_earlier_name_is_still_read_and_the_new_one_wins():
    assert config.resolve({"HSDP_ENGINE": "gloo"}).cpu_route == "gloo"
    assert config.read("HSDP_CPU_ROUTE", {"HSDP_ENGINE": "shm"}) == "shm"
    both = {"HSDP_CPU_ROUTE": "shm", "HSDP_ENGINE": "gloo"}
    assert config.resolve(both).cpu_route == "shm"
    with pytest.raises(ValueError, match="environment variable HSDP_ENGINE='shared'"):
        config.resolve({"HSDP_ENGINE": "shared"})
