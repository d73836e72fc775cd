"""What every suite prints and draws: sizes, the one table printer, the figure
helpers. Printing and plotting only; no measurement here."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30

_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kmg]?)(i?b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": KIB, "m": MIB, "g": GIB}


def parse_size(text: str) -> int:
    """Parses a byte count such as ``8``, ``4K``, ``64KiB``, ``1M``, ``16MB``.

    Suffixes are binary (K = 1024). Raises ValueError on anything else.
    """
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (examples: 8, 4K, 64KiB, 1M, 16M)")
    return int(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]


def format_size(nbytes: int) -> str:
    """``4096`` -> ``4 KiB``; exact binary units only, else bytes."""
    for unit, name in ((GIB, "GiB"), (MIB, "MiB"), (KIB, "KiB")):
        if nbytes >= unit and nbytes % unit == 0:
            return f"{nbytes // unit} {name}"
    return f"{nbytes} B"


def short_size(nbytes: int) -> str:
    """``4096`` -> ``4K`` (plot ticks)."""
    text = format_size(nbytes)
    for long, short in ((" KiB", "K"), (" MiB", "M"), (" GiB", "G"), (" B", "")):
        text = text.replace(long, short)
    return text


def format_params(n: int | None) -> str:
    """``10_620_000`` -> ``10.62M``, ``66_000`` -> ``66.0k``."""
    if n is None:
        return "?"
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}k"


# ---------------------------------------------------------------- tables


@dataclass(frozen=True)
class Column:
    """One column: its header, width, and the text of a row's cell."""

    header: str
    width: int
    cell: Callable[[Any], str]
    left: bool = False  # text columns (names) are left-aligned, numbers right-aligned


def print_table(
    columns: Sequence[Column], rows: Sequence[Any], title: str | None = None, markdown: bool = False
) -> None:
    """Prints ``rows`` under ``title``: fixed-width columns for the terminal,
    or, with ``markdown``, a table to paste into docs/benchmarks.md."""
    if title is not None:
        print(f"\n{title}")
    if markdown:
        print("| " + " | ".join(c.header for c in columns) + " |")
        print("|" + "|".join("---" if c.left else "---:" for c in columns) + "|")
        for r in rows:
            print("| " + " | ".join(c.cell(r) for c in columns) + " |")
        return

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            f"{text:<{c.width}}" if c.left else f"{text:>{c.width}}"
            for c, text in zip(columns, cells, strict=True)
        )

    print(line([c.header for c in columns]))
    for r in rows:
        print(line([c.cell(r) for c in columns]), flush=True)


# ---------------------------------------------------------------- figures


@contextlib.contextmanager
def figure(
    path: str, panels: int, title: str, panel_size: tuple[float, float] = (6, 4.5)
) -> Iterator[list]:
    """Yields ``panels`` axes side by side; on exit titles the figure and
    writes it to ``path`` as PNG (matplotlib, headless)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        1, panels, figsize=(panel_size[0] * panels, panel_size[1]), squeeze=False
    )
    try:
        yield list(axes[0])
        fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)


def colors() -> list[str]:
    """matplotlib's default colour cycle."""
    import matplotlib.pyplot as plt

    return plt.rcParams["axes.prop_cycle"].by_key()["color"]


def grouped_bars(
    ax, labels: Sequence[str], series: Sequence[tuple[str, Sequence[float], dict]]
) -> list[list[float]]:
    """One group of bars per label, one bar per series ``(name, values,
    matplotlib bar options)``, centred on the label's tick. Returns each
    series' bar positions (for annotations)."""
    width = 0.8 / len(series)
    positions = []
    for k, (name, values, options) in enumerate(series):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(labels))]
        ax.bar(xs, values, width, label=name, **options)
        positions.append(xs)
    ax.set_xticks(range(len(labels)), labels)
    return positions
