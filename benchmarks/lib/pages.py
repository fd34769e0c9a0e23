"""The page cache: evict a checkpoint's files from it, read them into it, or drop it all."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


def evict(paths: Iterable[Path]) -> None:
    """Write back and evict these files' pages (``posix_fadvise(DONTNEED)``; any user)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm(paths: Iterable[Path]) -> None:
    """Read these files into the page cache."""
    buf = bytearray(16 << 20)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def drop_all() -> bool:
    """Write back dirty pages and drop the whole page cache; False when not permitted (not root)."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True
