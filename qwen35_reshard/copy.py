"""Move tensor bytes from one source shard to their output files, reading each byte once.

A source shard is read once, in offset order, in bounded chunks into a small ring of reused
buffers. The reading thread writes each chunk to every stage file that needs it (more than
one for tensors replicated on purpose) and hands the same buffer to a hashing thread, which
updates each tensor's sha256. ``os.preadv``, ``os.pwrite`` and ``hashlib`` release the GIL,
so hashing runs beside the reads and writes instead of after them; a buffer is reused only
once it has been both written and hashed. Memory stays at ``RING_BUFFERS`` chunks whatever
the size of the tensors or the checkpoint.
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from .errors import ReshardError

CHUNK_BYTES = 8 * 1024 * 1024
# One buffer being read and written, one being hashed, and slack for the two to drift.
RING_BUFFERS = 4
_EMPTY_SHA256 = hashlib.sha256().hexdigest()


@dataclass
class Segment:
    """One source tensor to copy: its source byte range and where each copy goes."""

    name: str
    offset: int  # absolute offset in the source file
    nbytes: int
    dests: list[tuple[int, int]] = field(default_factory=list)  # (output fd, absolute offset)


# A piece of a segment inside one chunk: (segment, absolute begin, absolute end).
_Piece = tuple[Segment, int, int]


def copy_segments(
    src_path: str,
    segments: list[Segment],
    *,
    on_progress: Callable[[int], None] = lambda n: None,
    should_stop: Callable[[], bool] = lambda: False,
    chunk_bytes: int = CHUNK_BYTES,
) -> dict[str, str]:
    """Copy ``segments`` out of ``src_path``; return each tensor's sha256 hex digest.

    Every source byte is read exactly once, however many outputs it goes to. ``on_progress``
    gets the number of source bytes read and written after each chunk (hashing may trail by
    a few chunks; all digests are final when this returns). Writes that are adjacent in both
    the buffer and an output file go out as one ``pwrite``.
    """
    segments = sorted(segments, key=lambda s: s.offset)
    digests = {s.name: _EMPTY_SHA256 for s in segments if s.nbytes == 0}
    hasher = _Hasher([s for s in segments if s.nbytes], digests, chunk_bytes)
    fd = os.open(src_path, os.O_RDONLY)
    try:
        hasher.start()
        _advise_sequential(fd)
        for pos, n, pieces in _chunks(segments, chunk_bytes):
            if should_stop():
                raise KeyboardInterrupt
            index = hasher.take_free_buffer()
            view = hasher.views[index]
            got = os.preadv(fd, [view[:n]], pos)
            if got != n:
                raise ReshardError(
                    f"{src_path}: file ended at byte {pos + got} while reading tensor data up to byte "
                    f"{pos + n}; was the source changed or truncated during the run?"
                )
            _write_pieces(view, pos, pieces)
            hasher.submit(index, pos, pieces)
            on_progress(n)
    except BaseException:
        hasher.cancel()
        raise
    finally:
        hasher.finish()
        os.close(fd)
    hasher.raise_error()
    return digests


def _chunks(segments: list[Segment], chunk_bytes: int) -> Iterator[tuple[int, int, list[_Piece]]]:
    """Cut runs of source-adjacent, non-empty segments into reads of at most ``chunk_bytes``.

    Yields ``(position, length, pieces)``; gaps between runs (tensors this run does not
    need) are skipped, never read.
    """
    segs = [s for s in segments if s.nbytes]
    i = 0
    while i < len(segs):
        j = i + 1
        while j < len(segs) and segs[j].offset == segs[j - 1].offset + segs[j - 1].nbytes:
            j += 1
        span = segs[i:j]
        k, pos, end = 0, span[0].offset, span[-1].offset + span[-1].nbytes
        while pos < end:
            chunk_end = min(pos + chunk_bytes, end)
            pieces: list[_Piece] = []
            while k < len(span) and span[k].offset < chunk_end:
                seg = span[k]
                seg_end = seg.offset + seg.nbytes
                pieces.append((seg, max(seg.offset, pos), min(seg_end, chunk_end)))
                if seg_end > chunk_end:
                    break  # continues in the next chunk
                k += 1
            yield pos, chunk_end - pos, pieces
            pos = chunk_end
        i = j


def _write_pieces(view: memoryview, pos: int, pieces: list[_Piece]) -> None:
    """Write each piece of the chunk at ``pos`` (held in ``view``) to all its destinations."""
    pending: dict[int, list[int]] = {}  # out fd -> [dst offset, buf begin, buf end]
    for seg, a, b in pieces:
        for out_fd, out_off in seg.dests:
            dst = out_off + (a - seg.offset)
            op = pending.get(out_fd)
            if op is not None and op[0] + (op[2] - op[1]) == dst and op[2] == a - pos:
                op[2] = b - pos
            else:
                if op is not None:
                    _pwrite_all(out_fd, view[op[1] : op[2]], op[0])
                pending[out_fd] = [dst, a - pos, b - pos]
    for out_fd, (dst, b0, b1) in pending.items():
        _pwrite_all(out_fd, view[b0:b1], dst)


class _Hasher:
    """A thread that hashes the chunks the reader hands it, and the ring of buffers they share.

    The reader takes a free buffer, fills and writes it, and submits it; the thread hashes it
    and puts it back on the free list. Chunks are hashed in submission order, so each tensor's
    sha256 sees its bytes in order.
    """

    def __init__(self, segments: list[Segment], digests: dict[str, str], chunk_bytes: int) -> None:
        self.views = [memoryview(bytearray(chunk_bytes)) for _ in range(RING_BUFFERS)]
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(RING_BUFFERS):
            self._free.put(i)
        self._jobs: queue.SimpleQueue[tuple[int, int, list[_Piece]] | None] = queue.SimpleQueue()
        self._hashers = {s.name: hashlib.sha256() for s in segments}
        self._digests = digests
        self._cancelled = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="qwen35-reshard-sha256", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def take_free_buffer(self) -> int:
        index = self._free.get()
        self.raise_error()
        return index

    def submit(self, index: int, pos: int, pieces: list[_Piece]) -> None:
        self._jobs.put((index, pos, pieces))

    def cancel(self) -> None:
        """Stop hashing: chunks still queued are only handed back."""
        self._cancelled = True

    def finish(self) -> None:
        """Wait until every submitted chunk is hashed (or dropped, after ``cancel``)."""
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()

    def raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        hashers, digests = self._hashers, self._digests
        while (job := self._jobs.get()) is not None:
            index, pos, pieces = job
            if not self._cancelled and self._error is None:
                try:
                    view = self.views[index]
                    for seg, a, b in pieces:
                        hashers[seg.name].update(view[a - pos : b - pos])
                        if b == seg.offset + seg.nbytes:
                            digests[seg.name] = hashers.pop(seg.name).hexdigest()
                except BaseException as e:  # re-raised in the reader's thread
                    self._error = e
            self._free.put(index)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data = data[n:]
        offset += n


def _advise_sequential(fd: int) -> None:
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
