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


def mb(n: float) -> str:
    return f"{n / 1e6:,.0f} MB"


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def secs(s: float) -> str:
    return f"{s:.2f} s"


def table(head: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A markdown table (numbers right-aligned)."""
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def stamp() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
