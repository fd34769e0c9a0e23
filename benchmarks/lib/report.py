"""Numbers into tables: medians, ratios against a baseline of the same run, units."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def ratio(value: float, base: float) -> str:
    """``value / base`` as ``0.93x`` (``-`` when there is no baseline)."""
    return f"{value / base:.2f}x" if base else "-"


def gb(n: float) -> str:
    """Bytes as GB, or as MB below 0.1 GB."""
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def table(head: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A markdown table (numbers right-aligned)."""
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def stamp() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
