"""The README and docs/ resolve (links, anchors, code blocks), the README stays a user's page, and
docs/testing.md's index is generated.

The README and docs/ resolve: relative links and images name files of the tree and their
anchors headings of the page, the README's Python blocks compile, the files, modules and example
flags its shell blocks name exist; the README stays a user's page (at most 250 lines, no tracker
numbers); docs/testing.md's index of the test files is the one their docstrings give; the prose
of README, CHANGELOG and docs/ stays at most 130 kB."""

import importlib.util
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

# Runs on every supported torch release too (scripts/test.sh's compat stages).
pytestmark = pytest.mark.every_torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def _anchors(page: pathlib.Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation
    other than '-' dropped, spaces as '-'."""
    text = BLOCK.sub("", page.read_text())
    headings = re.findall(r"^#+ (.+)$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_name_files_and_headings_of_the_tree(page):
    text = page.read_text()
    missing = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue
        name, _, anchor = target.partition("#")
        path = (page.parent / name).resolve() if name else page
        if not path.exists():
            missing.append(target)
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            missing.append(target)
    assert not missing, f"{page.name} links to files or headings that do not exist: {missing}"


def test_the_readme_is_a_users_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; details belong in docs/"
    assert not re.search(r"\bissue \d|\bsession\b", "\n".join(lines), re.I)


def test_the_index_of_test_files_is_generated_from_their_docstrings():
    from tools import test_index

    text = (ROOT / "docs/testing.md").read_text()
    section = text[text.index("### Unit (`tests/unit`)") :]
    section = section[: section.index("\n\n", section.rindex("\n| test_")) + 1]
    assert section == test_index.markdown(), (
        "docs/testing.md's index is stale: paste `python -m tools.test_index`'s output"
    )


# The prose a reader is asked to read: the README, the changelog and docs/ (docs/results/ holds
# dated run records, read when one is linked).
PROSE_BYTES_AT_MOST = 130_000


def test_the_prose_stays_under_its_cap():
    pages = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
    sizes = {p.name: len(p.read_bytes()) for p in pages}
    assert sum(sizes.values()) <= PROSE_BYTES_AT_MOST, (
        f"{sum(sizes.values())} bytes of prose, more than {PROSE_BYTES_AT_MOST}: "
        f"condense before adding (largest: {sorted(sizes.items(), key=lambda kv: -kv[1])[:3]})"
    )


def _blocks(lang):
    text = (ROOT / "README.md").read_text()
    return [body for kind, body in BLOCK.findall(text) if kind == lang]


def test_python_blocks_compile():
    blocks = _blocks("python")
    assert blocks
    for body in blocks:
        compile(body, "README.md", "exec")


def _help(script: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(ROOT / script), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_shell_blocks_name_what_exists():
    blocks = _blocks("bash")
    assert blocks
    problems = []
    for body in blocks:
        for line in body.splitlines():
            words = shlex.split(line.split("#")[0] if " #" in line else line)
            for i, word in enumerate(words):
                if word == "-m" and i + 1 < len(words) and "." in words[i + 1]:
                    if importlib.util.find_spec(words[i + 1]) is None:
                        problems.append(f"module {words[i + 1]}")
                if re.match(r"(scripts|examples|tests)/", word) and not (ROOT / word).exists():
                    problems.append(f"file {word}")
                if word.startswith("examples/") and word.endswith(".py"):
                    usage = _help(word)
                    for flag in words[i + 1 :]:
                        if flag.startswith("--") and flag not in usage:
                            problems.append(f"{word} has no flag {flag}")
    assert not problems, problems
