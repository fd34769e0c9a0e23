"""The page cache as a stream: writing at an offset, advice to drop or read ahead, unmapping."""

from __future__ import annotations

import mmap
import os

# False keeps every page the copy reads and writes in the page cache (a benchmark's ablation).
DROP_BEHIND = True


def close_window(window: mmap.mmap) -> None:
    try:
        window.close()
    except BufferError:
        pass  # a traceback still holds a view of it: unmapped when that is garbage-collected


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """Write all of ``data`` at ``offset`` of ``fd`` (pwrite may write less than asked)."""
    while data:
        n = os.pwrite(fd, data, offset)
        data = data[n:]
        offset += n


def drop_pages(fd: int, offset: int, size: int) -> None:
    """POSIX_FADV_DONTNEED on a range: on Linux it starts asynchronous writeback of the range's
    dirty pages and drops its clean ones from the page cache. Advice only: errors are ignored."""
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, offset, size, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass


def advise_sequential(fd: int) -> None:
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
