"""Durability: what makes a write survive a crash, and the temporary files it goes through.

Every file is written under a temporary name (``.NAME.HOST.PID.NONCE.partial``: this process's
own, see :func:`~.claims.temp_name`), made durable and renamed, so a name never becomes final
before the bytes behind it are durable. :class:`Durability` issues
the barriers: file by file with fsync, or a whole filesystem with one ``syncfs``.
"""

from __future__ import annotations

import ctypes
import errno
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..errors import AGAIN, ELSEWHERE, OutError, ReshardError, param
from ..format.names import partial_base
from ..plan.planner import StagePlan
from ..units import format_bytes
from .claims import is_mine, temp_name

# fsyncs issued at once: enough for a journaling filesystem to commit them in one log
# write, few enough not to start a thread per file for a stage of hundreds of files.
FSYNC_THREADS = 16
FILE_MODE = 0o644  # rw-r--r-- before the umask: weights and configs any user may read


class Durability:
    """How a run makes what it wrote durable: file by file, or its filesystem at once.

    ``files(paths)`` makes the bytes of ``paths`` durable, ``dirs(paths)`` the entries
    (renames, removals) of those directories. File by file, each is an fsync, issued side by
    side (a journaling filesystem commits them together). With ``whole_fs``, each is one
    ``syncfs`` of OUT's filesystem, which also makes everything written before it durable,
    names included: one log commit instead of one per file and directory, at the price of
    also flushing other writers' dirty data on that filesystem. A run that shares blocks
    uses it (its files are mostly metadata, and it would pay ~100 fsyncs for a split that
    otherwise takes a fraction of a second); a run that copies fsyncs its own files, whose
    data is being written back as it goes.

    The order of the steps is what makes a crash safe, and it is the same both ways: no name
    becomes final before the bytes behind it are durable, and a barrier separates each step
    from the next.
    """

    def __init__(self, out: Path, *, whole_fs: bool) -> None:
        self.out = out
        self.whole_fs = whole_fs and _syncfs is not None

    def files(self, paths: list[Path], *, lazy: bool = False) -> None:
        """Make the bytes of ``paths`` durable. ``lazy``: needed only by the next barrier's
        renames (or only so that finished work survives a crash, a journal): when the
        filesystem is synced whole, that barrier covers it."""
        self._barrier(paths, os.O_RDONLY, lazy)

    def dirs(self, paths: list[Path], *, lazy: bool = False) -> None:
        """Make the entries of the directories ``paths`` durable (``lazy``: as for files)."""
        self._barrier(list(dict.fromkeys(paths)), os.O_RDONLY | os.O_DIRECTORY, lazy)

    def _barrier(self, paths: list[Path], flags: int, lazy: bool) -> None:
        if not paths or (lazy and self.whole_fs):
            return
        if self.whole_fs:
            self._syncfs()
            return
        fds = [os.open(p, flags) for p in paths]
        try:
            fsync_all(fds)
        finally:
            for fd in fds:
                os.close(fd)

    def _syncfs(self) -> None:
        fd = os.open(self.out, os.O_RDONLY | os.O_DIRECTORY)
        try:
            if _syncfs(fd) != 0:  # since Linux 5.8 it also reports write-back errors
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err), str(self.out))
        finally:
            os.close(fd)


def _load_syncfs():
    """libc's ``syncfs(fd)`` (Linux), or None where there is none."""
    try:
        return ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):
        return None


_syncfs = _load_syncfs()


def fsync_all(fds: list[int]) -> None:
    """fsync every file of ``fds``, side by side: a journaling filesystem commits them together."""
    if len(fds) < 2:
        for fd in fds:
            os.fsync(fd)
        return
    with ThreadPoolExecutor(max_workers=min(FSYNC_THREADS, len(fds))) as pool:
        list(pool.map(os.fsync, fds))


def fsync_dir(path: Path) -> None:
    """Make the entries of the directory ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def partial_path(path: Path) -> Path:
    """``path``'s temporary name, in the same directory (a rename stays within it)."""
    return path.with_name(temp_name(path.name))


def write_tmp(path: Path, data: bytes) -> tuple[Path, Path]:
    """Write ``data`` under ``path``'s temporary name; returns (temporary, final)."""
    tmp = partial_path(path)
    with open(tmp, "wb") as f:
        f.write(data)
    return tmp, path


def write_atomic(path: Path, data: bytes, *, sync_dir: bool = True) -> None:
    """Replace ``path`` with ``data``, durable (``sync_dir``: its name too, else the caller's
    next barrier makes it so)."""
    tmp, _ = write_tmp(path, data)
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    if sync_dir:
        fsync_dir(path.parent)


def remove(path: Path) -> None:
    """Delete the file ``path`` if it is there."""
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def remove_partials(out: Path, stages: list[StagePlan], *, own: bool = True) -> None:
    """Delete this process's temporary files in OUT and in the stages of this run: never
    another run's, which may be writing beside it. ``own=False``: every run's, in the stages
    only, for a caller whose claims prove that no other live run writes them."""
    dirs = [out / s.dirname for s in stages]
    for d in [out, *dirs] if own else dirs:
        try:
            entries = list(d.iterdir())
        except (FileNotFoundError, NotADirectoryError):  # never made, or not ours to clean
            continue
        for p in entries:
            if is_mine(p.name) if own else partial_base(p.name) is not None:
                remove(p)


def write_error(e: OSError, out: Path, needed: int) -> ReshardError:
    """One line for a failed write: a full disk names OUT and the space the run needs."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return OutError(
            f"{param('out_dir')} {out}: no space left on device ({e.strerror}); this run writes "
            f"{format_bytes(needed)}: free space and {AGAIN} to resume"
        )
    return OutError(
        f"{e.filename or out}: {e.strerror or e}; cannot write the split there: {ELSEWHERE} "
        "or fix its permissions"
    )
