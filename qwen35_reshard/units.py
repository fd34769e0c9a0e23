"""Sizes and counts in words: the one byte formatter and size parser, and plurals.

Every size the tool shows is decimal (1 GB = 10^9 bytes, as disks and the Hub count); sizes
given to it may be decimal or binary (``5GB``, ``4GiB``), as docs/usage.md states.
"""

from __future__ import annotations

import re

_UNITS = ("B", "KB", "MB", "GB", "TB", "PB")
_PARSE = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_PARSE.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*")


def format_bytes(n: float) -> str:
    """``n`` bytes in decimal units: ``512 B``, ``251.82 KB``, ``983.41 MB``, ``1.43 GB``."""
    for unit in _UNITS:
        if abs(n) < 1000 or unit == _UNITS[-1]:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def parse_size(text: str) -> int:
    """Bytes in ``text``: ``5GB``, ``500MB``, ``4GiB``, ``1.5TB`` or a plain ``1048576``.

    Raises ValueError for anything else, zero included.
    """
    m = _SIZE.fullmatch(text)
    if not m or m.group(2).upper() not in _PARSE or float(m.group(1)) <= 0:
        raise ValueError(f"{text!r} is not a size like 5GB, 500MB, 4GiB or 1048576")
    return int(float(m.group(1)) * _PARSE[m.group(2).upper()])


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """``1 file``, ``2 files``, ``0 files``; ``nouns`` for an irregular plural."""
    return f"{count} {noun if count == 1 else (nouns or noun + 's')}"
