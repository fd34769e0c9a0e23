"""The thread that hashes each window of a source shard beside the copy, in order."""

from __future__ import annotations

import mmap
import queue
import threading
from collections.abc import Callable

from ..format.digest import TENSOR_DIGEST, new_hasher
from . import pages
from .pages import close_window, drop_pages
from .segments import Piece, Segment

# One window being copied, one being hashed, and slack for the two to drift.
RING_BUFFERS = 4


class Hasher:
    """A thread that hashes the windows the copying thread hands it, in order.

    At most ``RING_BUFFERS`` windows are in flight: the copying thread waits for room before
    it moves the next one, and a buffer of the ring is reused only after it was hashed.
    Mappings are closed here, once hashed.
    """

    def __init__(
        self,
        src_fd: int,
        segments: list[Segment],
        digests: dict[str, str],
        on_read: Callable[[memoryview], None] | None = None,
        digest: str = TENSOR_DIGEST,
    ) -> None:
        self._src_fd = src_fd
        self._on_read = on_read
        self._room = threading.Semaphore(RING_BUFFERS)
        self._jobs: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self._hashers = {s.name: new_hasher(digest) for s in segments}
        self._digests = digests
        self._cancelled = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="qwen35-reshard-digest", daemon=True)

    def wait_for_room(self) -> None:
        self._room.acquire()
        self.raise_error()

    def submit(
        self, window: mmap.mmap | None, view: memoryview | None, pos: int, pieces: list[Piece]
    ) -> None:
        # Started by the first window to hash: a split that shares blocks hashes nothing in
        # most shards, and a thread start costs milliseconds on a loaded machine.
        if self._thread.ident is None:
            self._thread.start()
        self._jobs.put((window, view, pos, pieces))

    def skip(self) -> None:
        """Give back the room taken for a window with nothing to hash or release: no handoff
        to the thread (a split that shares blocks moves most windows this way)."""
        self._room.release()

    def cancel(self) -> None:
        """Stop hashing: windows still queued are only released."""
        self._cancelled = True

    def finish(self) -> None:
        """Wait until every submitted window is hashed (or released, after ``cancel``)."""
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()

    def raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            window, view, pos, pieces = job
            try:
                if not self._cancelled and self._error is None:
                    if window is not None:
                        base = pos - pos % mmap.ALLOCATIONGRANULARITY
                        with memoryview(window) as mapped:
                            self._hash(mapped, base, pieces)
                    else:
                        self._hash(view, pos, pieces)
            except BaseException as e:  # re-raised in the copying thread
                self._error = e
            finally:
                if window is not None:
                    close_window(window)
                    if pages.DROP_BEHIND:  # copied and hashed: the source window is done with
                        drop_pages(self._src_fd, pos, pieces[-1][2] - pos)
                self._room.release()

    def _hash(self, view: memoryview, base: int, pieces: list[Piece]) -> None:
        hashers = self._hashers
        for seg, a, b in pieces:
            hashers[seg.name].update(view[a - base : b - base])
            if b == seg.offset + seg.nbytes:
                self._digests[seg.name] = hashers.pop(seg.name).hexdigest()
        if self._on_read is not None and pieces:
            self._on_read(view[pieces[0][1] - base : pieces[-1][2] - base])
