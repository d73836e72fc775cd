"""The README's table of environment variables is the configuration table
(src/hsdp_backend/config.py), in name and default: a setting added, renamed or
re-defaulted in one place and not the other fails here."""

import pathlib
import re

from hsdp_backend import config

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def readme_table() -> dict[str, str]:
    text = README.read_text()
    section = text[text.index("## Environment variables") :]
    section = section[: section.index("\n## ", 1)]
    return dict(re.findall(r"^\| `(HSDP_[A-Z_]+)` \| `([^`]*)` \|", section, flags=re.M))


def test_readme_lists_every_setting_with_its_default():
    documented = readme_table()
    table = {name: var.default for name, var in config.VARS.items()}
    assert documented == table, (
        f"only in README: {sorted(set(documented) - set(table))}; "
        f"only in config.py: {sorted(set(table) - set(documented))}; "
        f"defaults differ: {[n for n in table if n in documented and documented[n] != table[n]]}"
    )
