"""The page cache: evict a checkpoint's files from it, read them into it, drop it all, or count
what of them it holds. Stdlib only: server_load's servers' interpreters import it too."""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Iterable
from pathlib import Path


def evict(paths: Iterable[str | Path]) -> None:
    """Write back and evict these files' pages (``posix_fadvise(DONTNEED)``; any user), and
    check with ``mincore`` that none is left."""
    paths = list(paths)
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)  # dirty pages (a file just written) are not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    left = resident_bytes(paths)
    if left:
        raise RuntimeError(f"{left} bytes of {len(paths)} file(s) stayed in the page cache after DONTNEED")


def resident_bytes(paths: Iterable[str | Path]) -> int:
    """Bytes of these files in the page cache (``mincore`` on a fresh read-only mapping)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    )
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for path in paths:
        size = os.path.getsize(path)
        if not size:
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr is None or addr == ctypes.c_void_p(-1).value:
                raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
            try:
                vec = ctypes.create_string_buffer(-(-size // page))
                if libc.mincore(addr, size, vec) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
                pages = len(vec.raw) - vec.raw.count(0)  # only the low bit is defined; others are 0
                total += min(pages * page, size)
            finally:
                libc.munmap(addr, size)
        finally:
            os.close(fd)
    return total


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
