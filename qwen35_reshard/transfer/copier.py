"""Move tensor bytes from one source shard to their output files, reading each byte once.

A source shard is read once, in offset order, in windows of at most ``chunk_bytes``. Each
tensor goes to every stage file that needs it (more than one for tensors replicated on
purpose) and its digest (``format.digest``: xxh3-128 unless asked for another) is computed
on the way, by a second thread, so that hashing runs
beside the copying instead of after it. Two ways to move a window, chosen per source shard:

- kernel (the default on Linux, whenever the tensors go somewhere): ``os.copy_file_range``
  copies each run of bytes file to file inside the kernel, the way ``cp`` does; the hashing
  thread then reads the same bytes through a read-only ``mmap`` of the window, straight from
  the page cache the copy has just filled. No copy of the data passes through Python
  buffers, and storage is read once. Runs under ``KERNEL_COPY_MIN_BYTES``, and every run
  where ``copy_file_range`` is refused (another filesystem, an old kernel), are written with
  ``pwrite`` from the mapping (or, in a window nothing is hashed in, from a buffer).
- buffer (hashing only, as ``verify`` does, or where ``mmap`` is refused): ``os.preadv``
  into a small ring of reused buffers, ``pwrite`` from them, hashing in the second thread.

Sharing (``share_fds``): output files laid out for block sharing (see ``plan``) get the
block-aligned part of each run by ``FICLONERANGE`` (``reflink``): the output shares the
source's blocks, and nothing is read or written for them. Only the ragged head and tail of a
run (less than a block each) are copied, by ``pread`` and ``pwrite``. A tensor whose every
destination is such a file is not hashed at all: hashing would read the bytes that sharing
avoids reading. Its digest is None. Windows are cut at multiples of ``chunk_bytes`` of the
source offset (a multiple of the plan's alignment), so every window but a run's first starts
on a block boundary; runs of such tensors alone, never read, are cut
``LONG_WINDOW_CHUNKS`` times less often.

``copy_file_range``, ``preadv``, ``pwrite`` and the hashers release the GIL. At most
``RING_BUFFERS`` windows are in flight per source shard, so memory stays bounded whatever the
size of the tensors or of the checkpoint.

The page cache is used as a stream, not a store: each output range is handed to writeback as
soon as it is written (write-behind) and dropped from the cache a few ranges later, and each
source window is dropped once hashed. A split of hundreds of GB then moves through a bounded
amount of page cache instead of evicting everything else on the machine, and the data reaches
the disk during the copy rather than all at the final fsync. This is advice to the kernel
only (``posix_fadvise``); durability still comes from the fsync of every finished file.

``sendfile`` is not used as a fallback: it writes at the output's shared file position, which
two workers filling one file would race on.
"""

from __future__ import annotations

import bisect
import collections
import errno
import mmap
import os
from collections.abc import Callable

from ..errors import BadInput
from ..format.digest import TENSOR_DIGEST, hexdigest
from ..source.remote.engine import RemoteSource
from ..source.remote.parts import plan_parts
from . import pages, reflink
from .hasher import RING_BUFFERS, Hasher
from .pages import advise_sequential, close_window, drop_pages, pwrite_all
from .segments import Piece, Run, Segment, piece_runs, source_spans, windows

CHUNK_BYTES = 8 * 1024 * 1024
# Shorter runs (of small tensors: norms, biases, scales) are written from the mapping that
# hashes them: a kernel copy call costs more than it saves there, and on a filesystem that
# shares blocks (XFS, Btrfs) it first tries to share the range, flushing dirty pages to do so.
KERNEL_COPY_MIN_BYTES = 1024 * 1024
# Output runs of at least this size are handed to writeback as soon as they are written and
# dropped from the page cache DROP_LAG runs later; smaller ones (runs of tiny tensors) are
# left to the kernel, to keep the number of calls down. pages.DROP_BEHIND = False keeps
# all pages.
WRITE_BEHIND_BYTES = 1024 * 1024
DROP_LAG = 8
# copy_file_range errors that mean "not between these two files": fall back to pwrite.
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL}


def fetch_in_place(sources: list[tuple[RemoteSource, list[Segment]]]) -> None:
    """Queue every remote source's segments on its fetch engine, in this order (the first
    stages' shards first), the parts planned over all of them together: each chunk that
    arrives is written at its offsets in every output that needs it (no buffer holds a part),
    and :func:`copy_segments` then hashes each window once it has landed.

    Args:
        sources: each remote shard with the segments the copy takes from it (each with its
            destinations).

    Example:
        >>> fetch_in_place([(src, segments)])  # doctest: +SKIP
        >>> copy_segments(src, segments)  # doctest: +SKIP
    """
    if not sources:
        return
    runs = {src.file.name: source_spans(sorted(segs, key=lambda s: s.offset)) for src, segs in sources}
    parts = plan_parts(runs, sources[0][0].engine.streams)
    for src, segs in sources:
        src.start(parts[src.file.name], _InPlace(segs))


class _InPlace:
    """The sink of a remote shard's transfer: each chunk's bytes written (pwrite) at their
    offsets in every output of the segments it overlaps; bytes of no segment (a small gap
    read through) are dropped."""

    def __init__(self, segments: list[Segment]) -> None:
        self.segments = sorted((s for s in segments if s.nbytes), key=lambda s: s.offset)
        self.starts = [s.offset for s in self.segments]

    def __call__(self, pos: int, chunk: memoryview) -> None:
        end = pos + len(chunk)
        i = max(0, bisect.bisect_right(self.starts, pos) - 1)
        while i < len(self.segments) and self.segments[i].offset < end:
            seg = self.segments[i]
            a, b = max(pos, seg.offset), min(end, seg.offset + seg.nbytes)
            for out_fd, out_off in seg.dests if a < b else ():
                pwrite_all(out_fd, chunk[a - pos : b - pos], out_off + a - seg.offset)
            i += 1


def copy_segments(
    src_path: str | RemoteSource,
    segments: list[Segment],
    *,
    on_progress: Callable[[int], None] = lambda n: None,
    should_stop: Callable[[], bool] = lambda: False,
    chunk_bytes: int = CHUNK_BYTES,
    kernel: bool = True,
    share_fds: frozenset[int] = frozenset(),
    on_shared: Callable[[int], None] = lambda n: None,
    on_read: Callable[[memoryview], None] | None = None,
    digest: str = TENSOR_DIGEST,
) -> dict[str, str | None]:
    """Copy ``segments`` out of ``src_path``; return each tensor's hex digest of the algorithm
    ``digest`` (``format.digest``; what a split records, unless compared with another record).

    Every source byte is read from the file once, however many outputs it goes to; bytes no
    segment covers are skipped. ``on_progress`` gets the number of source bytes copied after
    each window (hashing may trail by a few windows; all digests are final when this
    returns). Runs adjacent in both the source and an output file are copied as one.
    ``kernel=False`` moves the bytes through buffers, as is done anyway when nothing is
    written or the source cannot be mapped. A ``RemoteSource`` whose transfer was started
    (:func:`fetch_in_place`) has its bytes written in place by the fetch engine: each window is
    hashed once landed, read back from its first output; one not started (nothing to write:
    a verification) is read a window at a time. Runs going to an output in
    ``share_fds`` share the source's blocks where the filesystem allows (``on_shared`` gets
    the bytes shared); tensors going only there get None, not a digest. ``on_read`` gets the
    bytes of each window's hashed segments as they are hashed, in source order (from the
    hashing thread): a whole-file digest of a source whose segments tile it.
    """
    segments = sorted(segments, key=lambda s: s.offset)
    unhashed = {s.name for s in segments if s.dests and all(fd in share_fds for fd, _ in s.dests)}
    digests: dict[str, str | None] = dict.fromkeys(unhashed)
    empty = hexdigest(digest, b"")
    digests.update({s.name: empty for s in segments if s.nbytes == 0 and s.name not in unhashed})
    remote = not isinstance(src_path, (str, os.PathLike))
    fd = -1 if remote else os.open(src_path, os.O_RDONLY)
    to_hash = [s for s in segments if s.nbytes and s.name not in unhashed]
    hasher = Hasher(fd, to_hash, digests, on_read, digest)
    try:
        if remote and src_path.transfer is not None:
            mover: _Mover = _ReadBack(src_path, chunk_bytes=chunk_bytes, should_stop=should_stop)
        elif remote:
            mover = _RemoteMover(src_path, chunk_bytes=chunk_bytes)
        else:
            advise_sequential(fd)
            mover = _Mover(
                fd,
                src_path,
                kernel=kernel and any(s.dests for s in segments),
                chunk_bytes=chunk_bytes,
                share_fds=share_fds,
                on_shared=on_shared,
            )
        for pos, n, pieces in windows(segments, chunk_bytes, long_windows=unhashed):
            if should_stop():
                raise KeyboardInterrupt
            hasher.wait_for_room()
            hashed = [p for p in pieces if p[0].name not in unhashed]
            window, view = mover.move(pos, n, pieces, hash_needed=bool(hashed))
            if window is None and view is None:  # shared or copied in the kernel, unhashed
                hasher.skip()
            else:
                hasher.submit(window, view, pos, hashed)
            on_progress(n)
    except BaseException:
        hasher.cancel()
        raise
    finally:
        hasher.finish()
        if fd >= 0:
            os.close(fd)
    hasher.raise_error()
    return digests


class _Mover:
    """Moves one window of the source to its destinations and returns it for hashing."""

    def __init__(
        self,
        fd: int,
        src_path: str,
        *,
        kernel: bool,
        chunk_bytes: int,
        share_fds: frozenset[int] = frozenset(),
        on_shared: Callable[[int], None] = lambda n: None,
    ) -> None:
        self.fd = fd
        self.share_fds = share_fds
        self.on_shared = on_shared
        self.block = reflink.block_size(fd) if share_fds else 0
        self.src_path = src_path
        self.map = kernel  # hash through an mmap of the window (else: read into a buffer)
        self.kernel_copy = kernel and hasattr(os, "copy_file_range")
        self.chunk_bytes = chunk_bytes
        self.buffers: list[memoryview] = []
        self.next_buffer = 0
        self.spare = memoryview(b"")
        self.written: collections.deque[tuple[int, int, int]] = collections.deque()

    def move(
        self, pos: int, n: int, pieces: list[Piece], *, hash_needed: bool = True
    ) -> tuple[mmap.mmap | None, memoryview | None]:
        """Copy the window ``[pos, pos + n)``; return ``(mapping, None)`` or ``(None, buffer)``
        for hashing, or ``(None, None)`` when nothing needs hashing."""
        file_size = os.fstat(self.fd).st_size
        if file_size < pos + n:  # never touch a mapping past the end of the file: that is SIGBUS
            self._truncated(file_size, pos + n)
        runs = piece_runs(pieces)
        if self.share_fds:
            runs = self._share(runs)
        if not hash_needed:
            # Nothing to hand the hasher, and the window may be longer than the ring's buffers:
            # what sharing left is copied in the kernel, or a chunk at a time.
            if self.kernel_copy:
                runs = self._kernel_copies(runs)
            for run in runs:
                self._copy_through_buffer(*run)
            return None, None
        window = self._map(pos, n) if self.map else None
        if window is None:
            view = self._read(pos, n)
            self._write_from(view, pos, runs)
            return None, view
        try:
            base = pos - pos % mmap.ALLOCATIONGRANULARITY
            for out_fd, src, size, dst in runs:
                kernel = self.kernel_copy and size >= KERNEL_COPY_MIN_BYTES
                done = self._copy_in_kernel(out_fd, src, size, dst) if kernel else 0
                if done < size:  # short, or no kernel copy between these files: from the mapping
                    with memoryview(window) as view:
                        pwrite_all(out_fd, view[src + done - base : src + size - base], dst + done)
                self._behind(out_fd, dst, size)
        except BaseException:
            close_window(window)
            raise
        return window, None

    def _share(self, runs: list[Run]) -> list[Run]:
        """Share the block-aligned middle of each run into a sharing output; return what is
        left to copy: other outputs' runs, ragged heads and tails, and whatever was refused."""
        left: list[Run] = []
        bs = self.block
        for run in runs:
            out_fd, src, size, dst = run
            a = -(-src // bs) * bs  # first block boundary in the run
            b = (src + size) // bs * bs  # last one
            if out_fd not in self.share_fds or b <= a or (dst - src) % bs:
                left.append(run)
                continue
            if not reflink.clone_range(self.fd, a, b - a, out_fd, dst + a - src):
                self.share_fds = frozenset()  # this filesystem does not share: copy from now on
                left.append(run)
                continue
            self.on_shared(b - a)
            # The ragged head and tail, less than a block each, by pread and pwrite: the kernel
            # copy would first try to share them, which flushes the file's dirty pages.
            if a > src:
                pwrite_all(out_fd, self._pread(src, a - src), dst)
            if src + size > b:
                pwrite_all(out_fd, self._pread(b, src + size - b), dst + b - src)
        return left

    def _kernel_copies(self, runs: list[Run]) -> list[Run]:
        """Copy runs with copy_file_range; return the short ones and the parts it refused, to
        copy some other way."""
        left = []
        for out_fd, src, size, dst in runs:
            done = self._copy_in_kernel(out_fd, src, size, dst) if size >= KERNEL_COPY_MIN_BYTES else 0
            if done < size:
                left.append((out_fd, src + done, size - done, dst + done))
            if done:
                self._behind(out_fd, dst, done)
        return left

    def _copy_through_buffer(self, out_fd: int, src: int, size: int, dst: int) -> None:
        """Copy a run nobody hashes by pread and pwrite, a chunk at a time, through a buffer of
        its own (the ring's may still be in the hasher's hands)."""
        step = min(self.chunk_bytes, size)
        if len(self.spare) < step:
            self.spare = memoryview(bytearray(step))
        for at in range(0, size, step):
            view = self.spare[: min(step, size - at)]
            got = os.preadv(self.fd, [view], src + at)
            if got != len(view):
                self._truncated(src + at + got, src + at + len(view))
            pwrite_all(out_fd, view, dst + at)
        self._behind(out_fd, dst, size)

    def _map(self, pos: int, n: int) -> mmap.mmap | None:
        base = pos - pos % mmap.ALLOCATIONGRANULARITY
        try:
            return mmap.mmap(self.fd, pos + n - base, prot=mmap.PROT_READ, offset=base)
        except OSError:
            self.map = self.kernel_copy = False  # a filesystem without mmap: read instead
            return None

    def _copy_in_kernel(self, out_fd: int, src: int, size: int, dst: int) -> int:
        """Copy a run with copy_file_range; return how much was copied before it was refused."""
        done = 0
        while done < size:
            try:
                got = os.copy_file_range(self.fd, out_fd, size - done, src + done, dst + done)
            except OSError as e:
                if e.errno not in _NO_KERNEL_COPY:
                    raise
                self.kernel_copy = False
                break
            if got == 0:
                self._truncated(src + done, src + size)
            done += got
        return done

    def _buffer(self, n: int) -> memoryview:
        """The next buffer of the ring (the hasher is done with it), cut to ``n`` bytes."""
        if len(self.buffers) < RING_BUFFERS:
            self.buffers.append(memoryview(bytearray(self.chunk_bytes)))
        view = self.buffers[self.next_buffer][:n]
        self.next_buffer = (self.next_buffer + 1) % RING_BUFFERS
        return view

    def _read(self, pos: int, n: int) -> memoryview:
        view = self._buffer(n)
        got = os.preadv(self.fd, [view], pos)
        if got != n:
            self._truncated(pos + got, pos + n)
        if pages.DROP_BEHIND:
            drop_pages(self.fd, pos, n)  # the bytes are in the buffer now
        return view

    def _pread(self, pos: int, n: int) -> memoryview:
        data = os.pread(self.fd, n, pos)
        if len(data) != n:
            self._truncated(pos + len(data), pos + n)
        return memoryview(data)

    def _write_from(self, view: memoryview, base: int, runs: list[Run]) -> None:
        for out_fd, src, size, dst in runs:
            pwrite_all(out_fd, view[src - base : src - base + size], dst)
            self._behind(out_fd, dst, size)

    def _behind(self, out_fd: int, dst: int, size: int) -> None:
        """Start writeback of a run just written; drop the run written DROP_LAG runs ago,
        by now normally on disk (pages not yet clean are left for the fsync)."""
        if size < WRITE_BEHIND_BYTES:
            return
        drop_pages(out_fd, dst, size)  # on dirty pages: starts their writeback, drops nothing
        if pages.DROP_BEHIND:
            self.written.append((out_fd, dst, size))
            if len(self.written) > DROP_LAG:
                drop_pages(*self.written.popleft())

    def _truncated(self, at: int, wanted: int) -> None:
        raise BadInput(
            f"{self.src_path}: file ended at byte {at} while reading tensor data up to byte "
            f"{wanted}; was the source changed or truncated during the run?"
        )


class _RemoteMover(_Mover):
    """Moves windows read from a ``RemoteSource`` through the buffer ring: no file to map,
    to copy from in the kernel or to drop from the page cache."""

    def __init__(self, source: RemoteSource, *, chunk_bytes: int) -> None:
        super().__init__(-1, source.display, kernel=False, chunk_bytes=chunk_bytes)
        self.source = source

    def move(
        self, pos: int, n: int, pieces: list[Piece], *, hash_needed: bool = True
    ) -> tuple[mmap.mmap | None, memoryview | None]:
        view = self._buffer(n)
        self.source.readinto(view, pos)
        self._write_from(view, pos, piece_runs(pieces))
        return None, view


class _ReadBack(_Mover):
    """Hands the hasher each window of a remote source whose bytes the fetch engine writes in
    place: once the window has landed, its pieces are read back from their first output (from
    the page cache: just written), then the window is handed to writeback and dropped as a
    local copy's would be."""

    def __init__(self, source: RemoteSource, *, chunk_bytes: int, should_stop: Callable[[], bool]) -> None:
        super().__init__(-1, source.display, kernel=False, chunk_bytes=chunk_bytes)
        self.transfer = source.transfer
        self.should_stop = should_stop

    def move(
        self, pos: int, n: int, pieces: list[Piece], *, hash_needed: bool = True
    ) -> tuple[mmap.mmap | None, memoryview | None]:
        self.transfer.wait_landed(pos + n, self.should_stop)
        view = self._buffer(n)
        for seg, a, b in pieces:
            out_fd, out_off = seg.dests[0]
            got = os.preadv(out_fd, [view[a - pos : b - pos]], out_off + a - seg.offset)
            if got != b - a:
                raise AssertionError(f"{self.src_path}: an output ended before bytes written to it")
        for out_fd, _, size, dst in piece_runs(pieces):
            self._behind(out_fd, dst, size)
        return None, view
