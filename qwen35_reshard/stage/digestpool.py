"""Hash byte ranges of files in a few threads, each before a reader hands its bytes on.

The loader shim hands a server each tensor as a view of its file's copy-on-write memory map;
the server copies it into its parameters. :class:`DigestPool` hashes those same ranges and
compares them with the digests recorded for them (``format.digest``), **before** the reader
hands them on: :meth:`DigestPool.reached` returns only once every range starting at or
before the reader's position is hashed. So it may hash through the very map the reader hands
views of (``feed(..., mapped=)``): what it reads there is still the file's bytes (a server
writes only into views it was handed), and the server's copy then finds the pages already in
the map and in the CPU's caches, instead of a second map being filled for the check (measured
on the 0.56 GB stage: filling a second map's page table cost as much as the hashing). Without
``mapped`` the pool maps the file read-only itself (a check made after the views were handed
out). ``hashlib`` and ``xxhash`` release the GIL for large buffers, so threads run on as many
cores; how many: the caller's (the loader takes them from the node's budget and from the
cores its copy leaves free, ``loader.checks``); none hashes every range in the reader's thread,
each job as the reader reaches it.

With threads, ranges are handed to them up to ``AHEAD`` bytes ahead of the reader (a thread
brings its job's bytes in at once, :func:`populate`, so cold reads start before the reader
gets there). Between the points where there is something to do a call costs one comparison:
the reader calls it once per tensor. Findings are data: the ranges whose bytes differ, by the
key the caller gave them.
"""

from __future__ import annotations

import mmap
import os
import sys
from collections import deque
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import repeat
from pathlib import Path
from typing import NamedTuple

from ..format.digest import hexdigest

AHEAD = 256 << 20  # bytes handed to the threads ahead of the reader: a few hundred ms of disk
JOB_BYTES = 16 << 20  # ranges hashed by one thread in one go: few enough jobs, fine enough spread
JOB_RANGES = 2048  # and at most this many (a stage of small tensors has tens of thousands)
# Ranges under this are hashed by the reader's own thread: hashlib holds the GIL for buffers
# under 2 KiB, so a thread hashing thousands of small tensors only takes turns with the
# reader (who then waits for the GIL) for no parallelism; alone it costs ~1 us a tensor.
SMALL = 16 << 10
THREAD_NAME = "qwen35-reshard-digest"
# madvise(2) advice 22 on Linux since 5.14 (include/uapi/asm-generic/mman-common.h); Python 3.11's
# mmap module does not name it. None off Linux, where 22 may mean something else.
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22 if sys.platform == "linux" else None)


def populate(mapped: mmap.mmap, start: int, stop: int) -> bool:
    """Bring bytes ``[start, stop)`` of ``mapped`` into memory and into its page table in one
    call, before they are hashed: ``MADV_POPULATE_READ`` (Linux >= 5.14). Faulting them in page
    by page as the hash reads costs ~0.007 CPU-s per GB more here, a fifth of xxh3-128's own
    0.032 (``python -m benchmarks loader --digests``, the table of ways to get the bytes to the
    hasher). Elsewhere (an older kernel refuses it: EINVAL) the bytes are only asked for ahead
    (``MADV_WILLNEED``, which does not wait) and faulted in as the hash reads them.

    Returns:
        Whether the page table was filled in one call.
    """
    if stop <= start:
        return False
    aligned = start - start % mmap.PAGESIZE
    if MADV_POPULATE_READ is not None:
        try:
            mapped.madvise(MADV_POPULATE_READ, aligned, stop - aligned)
            return True
        except OSError:
            pass
    if hasattr(mmap, "MADV_WILLNEED"):
        mapped.madvise(mmap.MADV_WILLNEED, aligned, stop - aligned)
    return False


class Range(NamedTuple):
    """``nbytes`` bytes at ``offset`` of a file whose ``algorithm`` digest (``format.digest``)
    must be ``digest``; ``key`` says which (a tensor's name; None for a whole file). A tuple:
    one is made per tensor."""

    key: str | None
    offset: int
    nbytes: int
    digest: str
    algorithm: str


def ranges_of(
    keys: Iterable[str], offsets: Iterable[int], sizes: Iterable[int], digests: Iterable[str], algorithm: str
) -> list[Range]:
    """One :class:`Range` per tensor, from columns: its key, offset, size and digest.

    Why ``tuple.__new__`` mapped over the columns: a stage of small tensors has ~50,000, and
    ``Range(...)`` calls a Python-level ``__new__`` for each; this makes them in C.
    """
    rows = zip(keys, offsets, sizes, digests, repeat(algorithm))
    return list(map(tuple.__new__, repeat(Range), rows))


@dataclass(frozen=True)
class Mismatch:
    """A range whose bytes are not the recorded ones: the file and the range's key."""

    path: Path
    key: str | None


def cores() -> int:
    """The cores this process may run on (its affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class DigestPool:
    """Threads that hash ranges of files ahead of a reader that goes through them in order.

    Positions are counted in the reader's order over every file fed (:meth:`feed`): the
    threads take ranges up to ``AHEAD`` past the reader within the files fed so far; ``workers``
    threads.

    Example:
        >>> import os, pathlib, tempfile
        >>> from qwen35_reshard.format.digest import XXH128, hexdigest
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "f"
        >>> _ = p.write_bytes(b"abcd")
        >>> fd = os.open(p, os.O_RDONLY)
        >>> with DigestPool(2) as pool:
        ...     pool.feed(p, fd, [Range("ab", 0, 2, hexdigest(XXH128, b"ab"), XXH128),
        ...                       Range("cd", 2, 2, hexdigest(XXH128, b"xx"), XXH128)], size=4)
        ...     pool.finish()
        [Mismatch(path=PosixPath('...f'), key='cd')]
        >>> os.close(fd)
    """

    def __init__(self, workers: int) -> None:
        """``workers`` threads hash beside the reader; 0: the reader's thread hashes everything."""
        self._threads = (
            ThreadPoolExecutor(max_workers=workers, thread_name_prefix=THREAD_NAME) if workers else None
        )
        self._base = self._end = 0  # where the file fed last starts and ends, in the reader's order
        self._todo: deque[_Job] = deque()
        self._running: deque[tuple[int, Future[list[Mismatch]]]] = deque()  # (start, job)
        self._next = 0  # the reader's next position where there is something to do

    def feed(
        self, path: Path, fd: int, ranges: Sequence[Range], size: int, mapped: mmap.mmap | None = None
    ) -> None:
        """Hash ``ranges`` of the file open as ``fd`` (``path`` in findings; ``size`` bytes;
        the ranges in offset order) as the reader goes through it, after the files fed before.
        Called for every file the reader goes through, with no ranges where none is hashed.
        ``mapped``: the reader's own map of the file to hash through (none of its views handed
        on yet); None: a read-only map of ``fd``.

        Raises:
            OSError: the file cannot be mapped.
        """
        self._base, self._end = self._end, self._end + size
        if not ranges:
            return
        if mapped is None:
            mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        job: list[Range] = []
        for r in ranges:
            if job and (
                r.offset + r.nbytes - job[0].offset > JOB_BYTES
                or len(job) >= JOB_RANGES
                or (r.nbytes < SMALL) != (job[0].nbytes < SMALL)
            ):
                self._todo.append(_Job(self._base, path, mapped, job))
                job = []
            job.append(r)
        if job:
            self._todo.append(_Job(self._base, path, mapped, job))

    def reached(self, offset: int) -> list[Mismatch]:
        """The reader is at ``offset`` of the file fed last and hands on what starts there next:
        returns once every range starting at or before it is hashed (threads: hand them those
        up to ``AHEAD`` past it). Returns the mismatches found since the last call that
        returned any (each once)."""
        pos = self._base + offset
        if pos < self._next:
            return []
        found = []
        ahead = AHEAD if self._threads is not None else 0
        while self._todo and self._todo[0].start <= pos + ahead:
            self._start(self._todo.popleft())
        while self._running and self._running[0][0] <= pos:
            found += self._running.popleft()[1].result()
        self._next = min(
            self._todo[0].start - ahead if self._todo else self._end,
            self._running[0][0] if self._running else self._end,
        )
        return found

    def _start(self, job: _Job) -> None:
        """Hand ``job`` to a thread; one of small ranges (:data:`SMALL`) is hashed here, now."""
        if job.ranges[0].nbytes < SMALL or self._threads is None:
            done: Future[list[Mismatch]] = Future()
            done.set_result(job.check())
            self._running.append((job.start, done))
        else:
            self._running.append((job.start, self._threads.submit(job.check)))

    def finish(self) -> list[Mismatch]:
        """Hash what is left; every mismatch not yet returned."""
        found = []
        while self._todo:
            self._start(self._todo.popleft())
        while self._running:
            found += self._running.popleft()[1].result()
        return found

    def __enter__(self) -> DigestPool:
        return self

    def __exit__(self, *exc: object) -> None:
        # Stopped early (a mismatch, the server's error): ranges not started are dropped.
        self._todo.clear()
        if self._threads is not None:
            self._threads.shutdown(wait=True, cancel_futures=True)


@dataclass(frozen=True)
class _Job:
    """Ranges of one file hashed by one thread in one go; ``base``: where the file starts in
    the reader's order."""

    base: int
    path: Path
    mapped: mmap.mmap
    ranges: list[Range]

    @property
    def start(self) -> int:
        return self.base + self.ranges[0].offset

    def check(self) -> list[Mismatch]:
        """Hash each range; those whose digest is not the recorded one."""
        populate(self.mapped, self.ranges[0].offset, self.ranges[-1].offset + self.ranges[-1].nbytes)
        with memoryview(self.mapped) as view:
            return [
                Mismatch(self.path, key)
                for key, offset, nbytes, digest, algorithm in self.ranges
                if hexdigest(algorithm, view[offset : offset + nbytes]) != digest
            ]
