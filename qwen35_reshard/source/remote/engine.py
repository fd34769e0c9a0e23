"""The fetch engine: many byte ranges of remote files in flight at once, each streamed to its
sink at its offsets, retried from where it stopped.

A :class:`Transport` knows one kind of remote storage (the Hub over HTTPS, an object store):
it opens one ranged read and yields its bytes in order, raising :class:`Transient` for what is
worth another try (a dropped connection, a short body, 408/429/5xx) and a
:class:`~qwen35_reshard.errors.ReshardError` for the rest. The engine does everything else, the
same for every transport:

- ``streams`` reads in flight across all files (:meth:`FetchEngine.start` queues a file's
  parts; one pool of threads takes them in the order queued);
- each part's chunks go to the transfer's sink as they arrive (``sink(offset, chunk)``: the
  copy writes them in place into the stage files), so memory is a chunk per stream, whatever
  the number of streams or the size of a part;
- a part that fails transiently is asked again from its first byte not yet delivered, after a
  backoff; ``retries`` failures in a row without a byte of progress end the run;
- a 429 or 503 halves the streams in flight (at most once per first backoff wait); no part
  starts until fewer than that are in flight, and one stream comes back per that many parts
  finished after the cut (additive increase, multiplicative decrease): the server asked for
  fewer requests, and gets them, without the run failing. A ``Retry-After`` (seconds) is the
  least wait before asking again;
- a read that stalls (no byte for :data:`.settings.READ_TIMEOUT` seconds) is a transient failure, and
  :meth:`FetchEngine.close` never waits on the network: cleanup after Ctrl-C or another
  failure is prompt.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from ...errors import AGAIN, RemoteError
from .parts import Part
from .settings import DEFAULT_STREAMS

SLOW_DOWN_STATUS = (429, 503)  # "too many requests": fewer streams, then try again
log = logging.getLogger(__name__)

Sink = Callable[[int, memoryview], None]


@dataclass(frozen=True)
class RemoteFile:
    """A file of a remote source, as planned: its name there, its size, and what pins the
    version read (the Hub's commit is in every URL; an object store's ETag goes in If-Match).
    Every answer must agree, or the read is refused: bytes of two versions never mix."""

    name: str
    size: int
    identity: str | None = None


class Transient(Exception):
    """A failed read worth another try from where it stopped: a dropped connection, a body
    that ended early, or an answer asking to try again later (``status``: 408, 429, 5xx;
    ``retry_after``: the seconds the server asked to wait, if it said)."""

    def __init__(self, message: str, status: int | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


class Transport(Protocol):
    """One kind of remote storage, read by byte ranges."""

    display: str  # the source as messages name it (``org/name@commit``, ``s3://bucket/prefix``)

    def open(self, file: RemoteFile, start: int, end: int) -> Iterator[bytes]:
        """Bytes ``[start, end)`` of ``file``, as chunks in order; fewer bytes than asked means
        the body ended early. Raises :class:`Transient` to be tried again from the first byte
        not yet yielded, a ReshardError for what another try cannot mend (a refused range, a
        changed file). Closing the iterator closes the request."""
        ...


@dataclass(frozen=True)
class RetryPolicy:
    """Retries of a read: at most ``retries`` in a row without progress, the first after
    ``wait`` seconds, doubled each time up to ``max_wait``."""

    retries: int = 5
    wait: float = 0.5
    max_wait: float = 8.0


class _Cancelled(Exception):
    """The engine was closed while this part was being read."""


def backoff(first: float, attempt: int, most: float) -> float:
    """Seconds to wait before retry number ``attempt`` (1, 2, ...): ``first`` doubled each
    time, never more than ``most``.

    Example:
        >>> backoff(0.5, 3, 8.0)
        2.0
    """
    return min(most, first * 2 ** (attempt - 1))


def read_range(
    transport: Transport,
    file: RemoteFile,
    start: int,
    end: int,
    sink: Sink,
    policy: RetryPolicy,
    *,
    on_transient: Callable[[Transient], None] = lambda e: None,
    before_retry: Callable[[], None] = lambda: None,
    cancelled: threading.Event | None = None,
) -> None:
    """Hand ``sink`` bytes ``[start, end)`` of ``file`` in order, each once, asking again from
    the first byte not yet delivered after a transient failure.

    Args:
        transport: the storage.
        file: the file and its identity.
        start: first byte.
        end: end (exclusive).
        sink: ``sink(offset, chunk)`` for every chunk.
        policy: how often and when to try again.
        on_transient: told every transient failure before its backoff.
        before_retry: called after the backoff, before asking again (may wait for a stream).
        cancelled: once set, stop (raising) between chunks or during a backoff wait.

    Raises:
        RemoteError: ``policy.retries`` failures in a row without progress.

    Example:
        >>> read_range(transport, RemoteFile("a", 100), 0, 100, sink, RetryPolicy())  # doctest: +SKIP
    """
    cancelled = cancelled if cancelled is not None else threading.Event()
    pos, failures = start, 0
    while pos < end:
        try:
            chunks = transport.open(file, pos, end)
            try:
                for chunk in chunks:
                    if cancelled.is_set():
                        raise _Cancelled
                    n = min(len(chunk), end - pos)
                    sink(pos, memoryview(chunk)[:n])
                    pos += n
                    failures = 0
            finally:
                close = getattr(chunks, "close", None)
                if close is not None:
                    close()
            if pos < end:
                raise Transient(f"the answer ended at byte {pos} of {end}")
        except Transient as e:
            failures += 1
            if failures > policy.retries:
                raise RemoteError(
                    f"{transport.display}: {file.name}: bytes {pos}-{end - 1}: {failures} failures in a row, "
                    f"the last: {e}; check the network and {AGAIN} to resume"
                ) from e
            on_transient(e)
            wait = backoff(policy.wait, failures, policy.max_wait)
            if e.retry_after is not None:  # the server's wait, within the policy's longest
                wait = max(wait, min(e.retry_after, policy.max_wait))
            log_retry(
                f"{transport.display}: {file.name}: bytes {pos}-{end - 1}",
                str(e),
                wait,
                failures,
                policy.retries,
            )
            if cancelled.wait(wait):
                raise _Cancelled from e
            before_retry()


def log_retry(display: str, cause: str, wait: float, attempt: int, attempts: int) -> None:
    """Say on the log (stderr by default) that ``display`` is tried again after ``cause``
    (a transport's message: redacted by it, never naming a signed address)."""
    log.warning("%s: %s; retrying in %.2g s (retry %d of %d)", display, cause, wait, attempt, attempts)


class Transfer:
    """The parts of one file queued on an engine, their sink, and how far they have landed.

    ``landed(end)`` is true once every part starting before ``end`` is done: the copy hashes
    a window only after all of its bytes are in place."""

    def __init__(self, file: RemoteFile, parts: list[Part], sink: Sink) -> None:
        self.file = file
        self.parts = sorted(parts, key=lambda p: p.start)
        self.sink = sink
        self._done = [False] * len(self.parts)
        self._first_missing = 0
        self._cond = threading.Condition()
        self.error: BaseException | None = None

    def wait_landed(self, end: int, should_stop: Callable[[], bool] = lambda: False) -> None:
        """Return once every byte before ``end`` this transfer fetches is in the sink.

        Raises:
            BaseException: the error that ended one of its parts (or KeyboardInterrupt when
                ``should_stop`` says so).
        """
        with self._cond:
            while not self._landed(end):
                if self.error is not None:
                    raise self.error
                if should_stop():
                    raise KeyboardInterrupt
                self._cond.wait(0.2)
            if self.error is not None:
                raise self.error

    def _landed(self, end: int) -> bool:
        i = self._first_missing
        return i == len(self.parts) or self.parts[i].start >= end

    def part_done(self, index: int) -> None:
        with self._cond:
            self._done[index] = True
            while self._first_missing < len(self._done) and self._done[self._first_missing]:
                self._first_missing += 1
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._cond:
            if self.error is None:
                self.error = error
            self._cond.notify_all()


class FetchEngine:
    """Reads parts of remote files ``streams`` at a time, for every transfer started on it.

    Threads start with the first transfer and end with :meth:`close`, which also cancels what
    is queued and stops the reads in flight: after it returns, no sink is called again (the
    copy closes the files the sinks write into only then). It waits for a sink call under way,
    never for the network: a thread blocked in a read is left to end at its read timeout, and
    touches nothing of the engine after that. The engine can be used again after that."""

    def __init__(
        self, transport: Transport, *, streams: int = DEFAULT_STREAMS, policy: RetryPolicy | None = None
    ) -> None:
        self.transport = transport
        self.streams = streams
        self.policy = policy if policy is not None else RetryPolicy()
        self.limit = streams  # streams allowed now: fewer after a 429/503
        self._active = 0
        self._queue: collections.deque[tuple[Transfer, int]] = collections.deque()
        self._cond = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()  # set by close(): this generation of threads stops
        self._sinking = 0  # sink calls under way (close waits for them)
        self._last_cut = 0.0
        self._cuts = 0  # 429/503 cuts so far: a part that saw one since its start does not count
        self._since_cut = 0  # parts started after the last cut and finished since

    def start(self, file: RemoteFile, parts: list[Part], sink: Sink) -> Transfer:
        """Queue ``parts`` of ``file`` (after those queued before), their bytes for ``sink``.

        Args:
            file: the file and its identity.
            parts: the requests (see :func:`.parts.plan_parts`).
            sink: ``sink(offset, chunk)``, called from the engine's threads, for every chunk.

        Returns:
            The transfer, to wait on.

        Example:
            >>> t = engine.start(RemoteFile("a", 100), [Part("a", 0, 100)], sink)  # doctest: +SKIP
            >>> t.wait_landed(100)  # doctest: +SKIP
        """
        transfer = Transfer(file, parts, sink)
        with self._cond:
            self._queue.extend((transfer, i) for i in range(len(transfer.parts)))
            while len(self._threads) < min(self.streams, len(self._queue) + self._active):
                t = threading.Thread(target=self._run, args=(self._stop,), name="qwen35-reshard-fetch")
                t.daemon = True  # a read stalled on the network never holds the process at exit
                self._threads.append(t)
                t.start()
            self._cond.notify_all()
        return transfer

    def read(self, file: RemoteFile, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``file`` (clipped to its size), read in this thread.

        Its retries back off on their own and leave the parallel streams' limit alone: this
        one read is not what loaded the server.

        Example:
            >>> engine.read(RemoteFile("a", 100), 0, 8)  # doctest: +SKIP
        """
        end = min(end, file.size)
        buf = bytearray(max(0, end - start))

        def sink(pos: int, chunk: memoryview) -> None:
            buf[pos - start : pos - start + len(chunk)] = chunk

        read_range(self.transport, file, start, end, sink, self.policy)
        return bytes(buf)

    def close(self) -> None:
        """Cancel the parts not started, stop those in flight (see the class), and wait for a
        sink call under way to return."""
        with self._cond:
            stop = self._stop
            stop.set()
            self._queue.clear()
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._sinking == 0)
            # ready for more transfers (a later copy in the same process), with new threads
            self._threads, self._active, self.limit = [], 0, self.streams
            self._stop = threading.Event()

    def _run(self, stop: threading.Event) -> None:
        while True:
            with self._cond:
                while not stop.is_set() and not (self._queue and self._active < self.limit):
                    self._cond.wait()
                if stop.is_set():
                    return
                transfer, index = self._queue.popleft()
                self._active += 1
                cuts = self._cuts
            try:
                if transfer.error is None:
                    part = transfer.parts[index]
                    read_range(
                        self.transport,
                        transfer.file,
                        part.start,
                        part.end,
                        self._guarded(transfer.sink, stop),
                        self.policy,
                        on_transient=self._slow_down,
                        before_retry=lambda: self._within_limit(stop),
                        cancelled=stop,
                    )
                    transfer.part_done(index)
                    self._recover(cuts)
            except BaseException as e:  # handed to whoever waits on the transfer
                transfer.fail(e)
            finally:
                with self._cond:
                    if not stop.is_set():  # close() has reset the count of a stopped generation
                        self._active -= 1
                    self._cond.notify_all()

    def _guarded(self, sink: Sink, stop: threading.Event) -> Sink:
        """``sink`` that refuses once ``stop`` is set, counted while it runs (what close()
        waits for): a read that returns after close() never writes."""

        def guarded(pos: int, chunk: memoryview) -> None:
            with self._cond:
                if stop.is_set():
                    raise _Cancelled
                self._sinking += 1
            try:
                sink(pos, chunk)
            finally:
                with self._cond:
                    self._sinking -= 1
                    self._cond.notify_all()

        return guarded

    def _recover(self, cuts: int) -> None:
        """One stream back per ``limit`` parts finished that started after the last cut (parts
        started before it say nothing of the load at the reduced limit)."""
        with self._cond:
            if cuts != self._cuts or self.limit >= self.streams:
                return
            self._since_cut += 1
            if self._since_cut >= self.limit:
                self._since_cut = 0
                self.limit += 1
                self._cond.notify_all()

    def _within_limit(self, stop: threading.Event) -> None:
        """Before a stream asks again: if more are in flight than the limit allows now (cut
        since it started), give up its place and wait for one, as a part not yet started does:
        a retry is a new request to a server that asked for fewer."""
        with self._cond:
            if stop.is_set():  # close() has reset the count: another generation's now
                raise _Cancelled
            if self._active <= self.limit:
                return
            self._active -= 1
            self._cond.notify_all()
            while not stop.is_set() and self._active >= self.limit:
                self._cond.wait()
            if stop.is_set():
                raise _Cancelled
            self._active += 1

    def _slow_down(self, e: Transient) -> None:
        """Halve the streams in flight after a 429/503 (once per first backoff wait): no part
        starts until fewer than that are in flight."""
        if e.status not in SLOW_DOWN_STATUS:
            return
        with self._cond:
            now = time.monotonic()
            if now - self._last_cut >= self.policy.wait:
                self._last_cut = now
                self._cuts += 1
                self._since_cut = 0
                self.limit = max(1, min(self.limit, self._active) // 2)
                log.warning(
                    "%s: the server answered %d: %d streams from now on",
                    self.transport.display,
                    e.status,
                    self.limit,
                )


class RemoteSource:
    """One remote file as the copy reads it: its parts fetched in place by the engine
    (:meth:`start`, then wait on :attr:`transfer`), or read window by window (:meth:`readinto`,
    for a reader that writes nothing: verifying against the source). ``head`` holds the
    file's first bytes when known already (the header planning kept): read from there."""

    def __init__(self, engine: FetchEngine, file: RemoteFile, head: bytes = b"") -> None:
        self.engine = engine
        self.file = file
        self.head = head
        self.display = f"{engine.transport.display}: {file.name}"
        self.transfer: Transfer | None = None

    def start(self, parts: list[Part], sink: Sink) -> Transfer:
        """Queue ``parts`` on the engine, their chunks for ``sink`` (see :meth:`FetchEngine.start`)."""
        self.transfer = self.engine.start(self.file, parts, sink)
        return self.transfer

    def readinto(self, view: memoryview, pos: int) -> int:
        """Fill ``view`` with the bytes at ``pos`` (up to the file's end); return how many."""
        end = min(pos + len(view), self.file.size)
        if end <= len(self.head):
            view[: end - pos] = self.head[pos:end]
        else:
            view[: end - pos] = self.engine.read(self.file, pos, end)
        return end - pos
