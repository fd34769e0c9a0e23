"""Move tensor bytes from one source shard to their output files, reading each byte once.

A source shard is read in offset order, in bounded chunks, into one reused buffer; every
tensor's bytes are hashed on the way and written to each stage file that needs them (more
than one for tensors replicated on purpose). Memory stays at the chunk size whatever the
size of the tensors or the checkpoint.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from .errors import ReshardError

CHUNK_BYTES = 8 * 1024 * 1024


@dataclass
class Segment:
    """One source tensor to copy: its source byte range and where each copy goes."""

    name: str
    offset: int  # absolute offset in the source file
    nbytes: int
    dests: list[tuple[int, int]] = field(default_factory=list)  # (output fd, absolute offset)


def copy_segments(
    src_path: str,
    segments: list[Segment],
    *,
    on_progress: Callable[[int], None] = lambda n: None,
    should_stop: Callable[[], bool] = lambda: False,
    chunk_bytes: int = CHUNK_BYTES,
) -> dict[str, str]:
    """Copy ``segments`` out of ``src_path``; return each tensor's sha256 hex digest.

    ``on_progress`` gets the number of source bytes handled after each chunk. Writes that
    are adjacent in both the buffer and an output file go out as one ``pwrite``.
    """
    segments = sorted(segments, key=lambda s: s.offset)
    digests: dict[str, str] = {}
    buf = bytearray(chunk_bytes)
    view = memoryview(buf)
    fd = os.open(src_path, os.O_RDONLY)
    try:
        _advise_sequential(fd)
        i = 0
        while i < len(segments):
            # A span is a run of segments adjacent in the source: read it in whole chunks.
            j = i + 1
            while j < len(segments) and segments[j].offset == segments[j - 1].offset + segments[j - 1].nbytes:
                j += 1
            _copy_span(fd, src_path, segments[i:j], view, digests, on_progress, should_stop)
            i = j
    finally:
        os.close(fd)
    return digests


def _copy_span(
    fd: int,
    src_path: str,
    span: list[Segment],
    view: memoryview,
    digests: dict[str, str],
    on_progress: Callable[[int], None],
    should_stop: Callable[[], bool],
) -> None:
    start = span[0].offset
    end = span[-1].offset + span[-1].nbytes
    hashers = {s.name: hashlib.sha256() for s in span}
    k = 0  # first segment that may overlap the current chunk
    pos = start
    while pos < end:
        if should_stop():
            raise KeyboardInterrupt
        n = min(len(view), end - pos)
        got = os.preadv(fd, [view[:n]], pos)
        if got != n:
            raise ReshardError(
                f"{src_path}: file ended at byte {pos + got} while reading tensor data up to byte "
                f"{end}; was the source changed or truncated during the run?"
            )
        chunk_end = pos + n
        pending: dict[int, list[int]] = {}  # out fd -> [dst offset, buf begin, buf end]
        while k < len(span) and span[k].offset < chunk_end:
            seg = span[k]
            a = max(seg.offset, pos)
            b = min(seg.offset + seg.nbytes, chunk_end)
            piece = view[a - pos : b - pos]
            hashers[seg.name].update(piece)
            for out_fd, out_off in seg.dests:
                dst = out_off + (a - seg.offset)
                op = pending.get(out_fd)
                if op is not None and op[0] + (op[2] - op[1]) == dst and op[2] == a - pos:
                    op[2] = b - pos
                else:
                    if op is not None:
                        _pwrite_all(out_fd, view[op[1] : op[2]], op[0])
                    pending[out_fd] = [dst, a - pos, b - pos]
            if seg.offset + seg.nbytes <= chunk_end:
                digests[seg.name] = hashers.pop(seg.name).hexdigest()
                k += 1
            else:
                break
        for out_fd, (dst, b0, b1) in pending.items():
            _pwrite_all(out_fd, view[b0:b1], dst)
        on_progress(n)
        pos = chunk_end
    # Only empty tensors at the very end of the span are left: they have no bytes to visit.
    for name, hasher in hashers.items():
        digests[name] = hasher.hexdigest()


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data = data[n:]
        offset += n


def _advise_sequential(fd: int) -> None:
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
