"""docs/testing.md's index of the test files: one row per ``tests/<tier>/test_*.py``, the first
paragraph of its module docstring. What a file proves is written once, in that docstring; the
index is generated from them (``python -m tools.test_index``, from the repository root), and
``tests/unit/test_docs.py`` fails when it is stale or a test file has no docstring.

Importing this module stays cheap (no torch).
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
TIERS = {
    "unit": "Unit",
    "integration": "Integration",
    "system": "System",
    "tooling": "Tooling",
}


def summary(path: pathlib.Path) -> str:
    """The first paragraph of ``path``'s module docstring, on one line."""
    doc = ast.get_docstring(ast.parse(path.read_text()))
    if not doc:
        raise ValueError(f"{path.relative_to(ROOT)} has no module docstring saying what it proves")
    return " ".join(doc.split("\n\n")[0].split())


def markdown() -> str:
    """The index: one table per tier."""
    out = []
    for tier, title in TIERS.items():
        out += [f"### {title} (`tests/{tier}`)", "", "| file | what it proves |", "|---|---|"]
        for path in sorted((ROOT / "tests" / tier).glob("test_*.py")):
            text = summary(path).replace("|", "\\|")  # a pipe would end the cell
            out.append(f"| {path.name} | {text} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(markdown(), end="")
