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
- a 429 or 503 halves the streams in flight (at most once per first backoff wait), each part
  finished after that gives one back (additive increase, multiplicative decrease): the server
  asked for fewer requests, and gets them, without the run failing.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from ...errors import BadInput, RemoteError, param
from .parts import Part

# huggingface_hub's snapshot_download fetches with 8 threads (max_workers=8): at least as
# many streams, no more by default (too many streams can collapse a link's throughput:
# huggingface_hub issue #4893).
DEFAULT_STREAMS = 8
STREAMS_ENV = "QWEN35_RESHARD_STREAMS"  # the servers' in-server fetch reads it (no CLI there)
SLOW_DOWN_STATUS = (429, 503)  # "too many requests": fewer streams, then try again

log = logging.getLogger(__name__)

Sink = Callable[[int, memoryview], None]


def streams_setting(streams: int | None) -> int:
    """The number of streams: ``streams`` if given, else ``QWEN35_RESHARD_STREAMS``, else
    :data:`DEFAULT_STREAMS`.

    Args:
        streams: the caller's setting (None: not set).

    Returns:
        A positive number of streams.

    Raises:
        ReshardError: the setting is not a positive integer.

    Example:
        >>> streams_setting(4)
        4
    """
    if streams is None:
        raw = os.environ.get(STREAMS_ENV, "").strip()
        if not raw:
            return DEFAULT_STREAMS
        if not raw.isdigit() or int(raw) < 1:
            raise BadInput(f"{STREAMS_ENV}={raw!r}: set it to a positive number of streams, e.g. 8")
        return int(raw)
    if streams < 1:
        raise BadInput(f"{param('streams')} must be at least 1, got {streams}")
    return streams


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
    that ended early, or an answer asking to try again later (``status``: 408, 429, 5xx)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


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
    cancelled: Callable[[], bool] = lambda: False,
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
        cancelled: polled between chunks: stop (raising) when it says so.

    Raises:
        RemoteError: ``policy.retries`` failures in a row without progress.

    Example:
        >>> read_range(transport, RemoteFile("a", 100), 0, 100, sink, RetryPolicy())  # doctest: +SKIP
    """
    pos, failures = start, 0
    while pos < end:
        try:
            chunks = transport.open(file, pos, end)
            try:
                for chunk in chunks:
                    if cancelled():
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
                    f"the last: {e}; check the network and run the same command again to resume"
                ) from e
            on_transient(e)
            wait = backoff(policy.wait, failures, policy.max_wait)
            log_retry(
                f"{transport.display}: {file.name}: bytes {pos}-{end - 1}",
                str(e),
                wait,
                failures,
                policy.retries,
            )
            time.sleep(wait)


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
    is queued and waits for the reads in flight to stop: after it returns, no sink is called
    again (the copy closes the files the sinks write into only then). The engine can be used
    again after that."""

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
        self._closed = False
        self._last_cut = 0.0

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
            if self._closed:
                raise RuntimeError("the fetch engine is closed")
            self._queue.extend((transfer, i) for i in range(len(transfer.parts)))
            while len(self._threads) < min(self.streams, len(self._queue) + self._active):
                t = threading.Thread(target=self._run, name="qwen35-reshard-fetch", daemon=True)
                self._threads.append(t)
                t.start()
            self._cond.notify_all()
        return transfer

    def read(self, file: RemoteFile, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``file`` (clipped to its size), read in this thread.

        Example:
            >>> engine.read(RemoteFile("a", 100), 0, 8)  # doctest: +SKIP
        """
        end = min(end, file.size)
        buf = bytearray(max(0, end - start))

        def sink(pos: int, chunk: memoryview) -> None:
            buf[pos - start : pos - start + len(chunk)] = chunk

        read_range(self.transport, file, start, end, sink, self.policy, on_transient=self._slow_down)
        return bytes(buf)

    def close(self) -> None:
        """Cancel the parts not started, stop those in flight, wait for the threads to end."""
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._cond.notify_all()
        for t in self._threads:
            t.join()
        with self._cond:  # ready for more transfers (a later copy in the same process)
            self._threads, self._closed, self.limit = [], False, self.streams

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not (self._queue and self._active < self.limit):
                    self._cond.wait()
                if self._closed:
                    return
                transfer, index = self._queue.popleft()
                self._active += 1
            try:
                if transfer.error is None:
                    part = transfer.parts[index]
                    read_range(
                        self.transport,
                        transfer.file,
                        part.start,
                        part.end,
                        transfer.sink,
                        self.policy,
                        on_transient=self._slow_down,
                        cancelled=lambda: self._closed,
                    )
                    transfer.part_done(index)
                    with self._cond:
                        self.limit = min(self.streams, self.limit + 1)
            except BaseException as e:  # handed to whoever waits on the transfer
                transfer.fail(e)
            finally:
                with self._cond:
                    self._active -= 1
                    self._cond.notify_all()

    def _slow_down(self, e: Transient) -> None:
        """Halve the streams in flight after a 429/503 (once per first backoff wait)."""
        if e.status not in SLOW_DOWN_STATUS:
            return
        with self._cond:
            now = time.monotonic()
            if now - self._last_cut >= self.policy.wait:
                self._last_cut = now
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
