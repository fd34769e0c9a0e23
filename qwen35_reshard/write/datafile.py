"""One data file of a stage: its header, and making it under its temporary name (cloned
from its source shard, or created at its size with its header, its data copied later)."""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import ReshardError
from ..format.names import CLONE
from ..plan.layout import OutputFile
from ..plan.planner import Plan, StagePlan
from ..transfer import reflink as reflinks
from ..transfer.copier import copy_segments
from ..transfer.segments import Segment
from .durability import FILE_MODE, remove
from .sources import SourceAccess

Digests = dict[str, str | None]  # tensor name -> its digest (format.digest; None: shared, never read)


@dataclass
class OpenFile:
    """A data file being written: open under its temporary name until its sources are copied."""

    stage: StagePlan
    plan: OutputFile
    tmp: Path
    final: Path
    fd: int
    pending_sources: set[str]  # source shards whose tensors are still to be copied into it


def header(f: OutputFile, source: SourceAccess) -> bytes:
    """The bytes before ``f``'s data buffer: the plan's, or for a CLONE its source's own
    (read through ``source``, as the data is)."""
    if f.layout != CLONE:
        return f.header
    src = source.open(f.source_file)
    if not isinstance(src, str | os.PathLike):
        buf = memoryview(bytearray(f.data_start))
        src.readinto(buf, 0)
        return bytes(buf)
    with open(src, "rb") as fh:
        return fh.read(f.data_start)


def matches(path: Path, f: OutputFile, head: bytes) -> bool:
    """A finished file of an earlier run fits the plan: same size, same ``head`` bytes."""
    try:
        with open(path, "rb") as fh:
            return os.fstat(fh.fileno()).st_size == f.size and fh.read(len(head)) == head
    except OSError:
        return False


def stamp(path: Path) -> list[int] | None:
    """What tells that the file ``path`` is still the one seen before, unchanged: its inode,
    size, and modification and change times (None when it is gone)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def file_digests(path: Path, f: OutputFile) -> Digests | None:
    """The digest of each tensor of the stage's data file ``path``, laid out as ``f``; None when it
    cannot be read whole (missing, short, changed while read)."""
    segments = [Segment(t.name, f.data_start + t.out_offset, t.source.nbytes) for t in f.tensors]
    try:
        return copy_segments(str(path), segments)
    except (OSError, ReshardError):
        return None


def clone(plan: Plan, f: OutputFile, tmp: Path) -> bool:
    """Make ``tmp`` share every block of ``f``'s source shard; False where refused."""
    src = os.open(plan.checkpoint.path(f.source_file), os.O_RDONLY)
    try:
        dst = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
        try:
            ok = reflinks.clone_file(src, dst) and os.fstat(dst).st_size == f.size
        finally:
            os.close(dst)
    finally:
        os.close(src)
    if not ok:
        remove(tmp)
    return ok


def create(
    stage: StagePlan, f: OutputFile, tmp: Path, final: Path, head: bytes, *, preallocate: bool
) -> OpenFile:
    """Create ``tmp`` at ``f``'s size with ``head`` written; its data comes later.

    Preallocating makes a full disk fail here, before any copying; a file that will share
    blocks with the source is only sized (allocating blocks it will share would need the
    space the sharing saves).
    """
    # Readable too: the bytes the fetch engine writes in place are read back to be hashed.
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    try:
        if preallocate and hasattr(os, "posix_fallocate") and f.size:
            try:
                os.posix_fallocate(fd, 0, f.size)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
        else:
            os.ftruncate(fd, f.size)
        os.pwrite(fd, head, 0)
    except BaseException:  # not yet known to the caller's cleanup: clean up here
        os.close(fd)
        remove(tmp)
        raise
    return OpenFile(stage, f, tmp, final, fd, {t.source.file for t in f.tensors})
