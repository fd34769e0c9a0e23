"""Read byte ranges of one file on the Hub (or a mirror) over HTTP, every response checked.

A shard that straddles a stage boundary is never downloaded whole: the writer asks for the
byte ranges of the tensors it needs and this reader fetches exactly those, one ``Range``
request per run of adjacent tensors, streamed into the writer's buffers. Nothing it reads is
written into the Hugging Face cache: partial bytes must never pass for the file.

Every answer is checked before a byte is used: ``206 Partial Content`` with the
``Content-Range`` asked for and the file's known size. A server that ignores ``Range`` (a
``200`` with the whole file) is reported, not silently downloaded whole. Dropped connections,
timeouts and ``408/429/5xx`` answers are retried with exponential backoff, resuming at the first
byte not yet received; ``retries`` attempts in a row without a byte of progress end the read.
Each retry is logged (a warning, which reaches stderr when nothing else is configured).

The Hub answers ``/resolve`` of a large file with a redirect to its CDN; the CDN address is kept
for the following ranges (one request per range instead of two) and asked again when it has
expired. The ``Authorization`` header goes only to the Hub's own origin, never to the CDN.
No message names a URL with its query string (the CDN's signature) or credentials: see
:func:`redact`.
"""

from __future__ import annotations

import bisect
import logging
import re
import time
from collections.abc import Callable
from urllib.parse import urljoin, urlsplit

from ..errors import HubError

# Status codes worth another try (as huggingface_hub retries them), and CDN answers that mean
# "this signed address has expired: ask the Hub for a fresh one".
RETRY_STATUS = (408, 429, 500, 502, 503, 504)
EXPIRED_STATUS = (401, 403, 410)
REDIRECT_STATUS = (301, 302, 303, 307, 308)
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+)$")
# A URL's scheme, its credentials (user:password@), the rest up to a query or fragment, and those.
_URL = re.compile(
    r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<userinfo>[^/\s@]*@)?"
    r"(?P<rest>[^\s?#'\"]*)(?P<query>[?#][^\s'\"]*)?"  # a quote ends it: messages quote URLs
)

log = logging.getLogger(__name__)


def redact(text: str) -> str:
    """``text`` with every URL's credentials and query string (a presigned CDN address's
    signature, a token passed as a parameter) replaced by ``...``.

    Args:
        text: a message that may quote URLs (huggingface_hub's errors do).

    Returns:
        The message, safe to print or log.
    """

    def one(m: re.Match) -> str:
        userinfo = "...@" if m.group("userinfo") else ""
        return f"{m.group('scheme')}{userinfo}{m.group('rest')}{'?...' if m.group('query') else ''}"

    return _URL.sub(one, text)


def describe(e: BaseException) -> str:
    """``e``'s message on one line, redacted (huggingface_hub's errors span lines and quote the
    address asked for); its type's name when it says nothing."""
    return redact(" ".join(str(e).split())) or type(e).__name__


def backoff(first: float, attempt: int, most: float) -> float:
    """Seconds to wait before retry number ``attempt`` (1, 2, ...): ``first`` doubled each
    time, never more than ``most``."""
    return min(most, first * 2 ** (attempt - 1))


def log_retry(display: str, cause: str, wait: float, attempt: int, attempts: int) -> None:
    """Say on the log (stderr by default) that ``display`` is tried again after ``cause``."""
    log.warning(
        "%s: %s; retrying in %.2g s (retry %d of %d)", display, redact(cause), wait, attempt, attempts
    )


class RangeError(HubError):
    """A ranged read that could not be completed or whose answer was wrong."""


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    return parts.scheme, (parts.hostname or "").lower(), parts.port


class RangeReader:
    """Byte ranges of the file at ``url`` (a ``/resolve/<commit>/<file>`` address).

    ``headers`` (the Hub's, with the token if any) go to ``url``'s origin only. ``size`` is
    the file's size when known; otherwise it is learned from the first answer and every later
    answer must agree. ``raise_for_status(response)`` turns the Hub's error answers into
    exceptions (huggingface_hub's ``hf_raise_for_status``). ``counter.add(nbytes)``, when
    given, is told every body byte received.
    """

    def __init__(
        self,
        url: str,
        *,
        display: str,
        session: object,
        headers: dict[str, str],
        raise_for_status: Callable[[object], None],
        size: int | None = None,
        counter: object | None = None,
        retries: int = 5,
        wait: float = 0.5,
        max_wait: float = 8.0,
    ) -> None:
        self.url = url
        self.display = display
        self.size = size
        self._counter = counter
        self._session = session
        self._headers = headers
        self._raise_for_status = raise_for_status
        self._retries = retries
        self._wait = wait
        self._max_wait = max_wait
        self._location: str | None = None  # the CDN address of the last redirect
        self._spans: list[tuple[int, int]] = []
        self._starts: list[int] = []
        self._response = None
        self._chunks = None
        self._pos = -1  # next byte the open response delivers
        self._end = -1  # end (exclusive) of the open response's range
        self._left = memoryview(b"")  # bytes received but not yet handed out

    # ------------------------------------------------------------------ public

    def read(self, begin: int, end: int) -> bytes:
        """Bytes ``[begin, end)`` of the file (fewer only where the file ends first)."""
        buf = bytearray(end - begin)
        n = self.readinto(memoryview(buf), begin, until_eof=True)
        return bytes(buf[:n])

    def expect(self, spans: list[tuple[int, int]]) -> None:
        """Announce the runs ``[begin, end)`` about to be read, in order: one request per run."""
        self._spans = sorted(spans)
        self._starts = [b for b, _ in self._spans]

    def readinto(self, view: memoryview, pos: int, *, until_eof: bool = False) -> int:
        """Fill ``view`` with the bytes at ``pos``, continuing the open response when it is
        there; return the bytes filled: all of them, or with ``until_eof`` up to the file's end."""
        filled, failures, end = 0, 0, self._span_end(pos, pos + len(view))
        while filled < len(view):
            want = pos + filled
            if until_eof and self.size is not None and want >= self.size:
                break
            try:
                if self._response is None or self._pos != want:
                    end = self._span_end(want, pos + len(view))
                    self._open(want, end)
                    continue
                n = self._take(view[filled:])
            except RangeError:
                self.close()
                raise
            except Exception as e:  # transport errors: the type lives in the HTTP library
                self.close()
                if not _transient(e):
                    raise
                failures += 1
                status = isinstance(e, _RetryableStatus)
                what = str(e) if status else "the connection failed"
                why = "" if status else f" ({type(e).__name__})"
                if failures > self._retries:
                    raise RangeError(
                        f"{self.display}: {what} {failures} times in a row while fetching bytes "
                        f"{want}-{end - 1}{why}; check the network and run the same command again to resume"
                    ) from e
                wait = backoff(self._wait, failures, self._max_wait)
                where = f"{self.display}: bytes {want}-{end - 1}"
                log_retry(where, what + why, wait, failures, self._retries)
                time.sleep(wait)
                continue
            filled += n
            failures = 0
        return filled

    def close(self) -> None:
        if self._response is not None:
            self._response.close()
        self._response = self._chunks = None
        self._left = memoryview(b"")
        self._pos = self._end = -1

    # ------------------------------------------------------------------ internals

    def _span_end(self, pos: int, fallback: int) -> int:
        i = bisect.bisect_right(self._starts, pos) - 1
        if i >= 0 and self._spans[i][0] <= pos < self._spans[i][1]:
            return self._spans[i][1]
        return fallback

    def _take(self, view: memoryview) -> int:
        """Copy what the open response has into ``view``; 0 never returns (the body ended early
        raises, so the caller resumes)."""
        if not self._left:
            chunk = next(self._chunks, b"")
            if not chunk:
                raise _BodyEnded(f"{self.display}: the answer ended at byte {self._pos} of {self._end}")
            if self._counter is not None:
                self._counter.add(len(chunk))
            self._left = memoryview(chunk)
        n = min(len(view), len(self._left), self._end - self._pos)
        view[:n] = self._left[:n]
        self._left = self._left[n:]
        self._pos += n
        if self._pos == self._end:
            self._finish()
        return n

    def _finish(self) -> None:
        response = self._response
        self._response = self._chunks = None
        self._left = memoryview(b"")
        if response is not None:
            response.close()

    def _open(self, begin: int, end: int) -> None:
        """Send ``GET`` with ``Range: bytes=begin-(end-1)`` and check the answer."""
        self.close()
        if self.size is not None:
            end = min(end, self.size)
        url = self._location or self.url
        for _ in range(5):  # redirects and one refresh of an expired CDN address
            same_origin = _origin(url) == _origin(self.url)
            # Another origin (the CDN a redirect names) gets no credentials: only who is asking.
            sent = self._headers if same_origin else _agent_only(self._headers)
            headers = {**sent, "Range": f"bytes={begin}-{end - 1}"}
            headers["Accept-Encoding"] = "identity"
            request = self._session.build_request("GET", url, headers=headers)
            response = self._session.send(request, stream=True, follow_redirects=False)
            status = response.status_code
            if status in REDIRECT_STATUS and "Location" in response.headers:
                response.close()
                url = urljoin(url, response.headers["Location"])
                if _origin(url) != _origin(self.url):
                    self._location = url
                continue
            if status in EXPIRED_STATUS and self._location is not None and url == self._location:
                response.close()
                self._location = None
                url = self.url
                continue
            if status in RETRY_STATUS:
                response.close()
                raise _RetryableStatus(f"the server answered {status}")
            if status != 206:
                self._refuse(response, begin, end)
            self._check_range(response, begin, end)
            self._response = response
            # Chunks as they arrive (no re-chunking): a dropped connection then loses nothing
            # that was received, and the retry resumes at the first byte not yet here.
            self._chunks = response.iter_raw()
            self._pos, self._end = begin, min(end, self.size)
            return
        raise RangeError(f"{self.display}: too many redirects while fetching bytes {begin}-{end - 1}")

    def _refuse(self, response: object, begin: int, end: int) -> None:
        status = response.status_code
        if status == 200:
            response.close()
            raise RangeError(
                f"{self.display}: the server ignored the Range request for bytes {begin}-{end - 1} and "
                "started sending the whole file; it does not support ranged reads: use an endpoint "
                "(HF_ENDPOINT) that does"
            )
        if status == 416 and self.size is not None and begin >= self.size:
            response.close()
            raise RangeError(
                f"{self.display}: bytes {begin}-{end - 1} lie past the end of the {self.size}-byte file; "
                "the file changed on the server"
            )
        try:
            response.read()
            self._raise_for_status(response)
        except Exception as e:  # the Hub's error names the (signed) address
            raise RangeError(
                f"{self.display}: the server refused bytes {begin}-{end - 1}: {describe(e)}"
            ) from e
        finally:
            response.close()
        raise RangeError(f"{self.display}: unexpected answer {status} to a ranged request")

    def _check_range(self, response: object, begin: int, end: int) -> None:
        encoding = response.headers.get("Content-Encoding", "identity").lower()
        got = _CONTENT_RANGE.match(response.headers.get("Content-Range", "").strip())
        total = int(got.group(3)) if got else None
        expected_end = min(end, total) if total is not None else end
        ok = (
            got is not None
            and encoding == "identity"
            and int(got.group(1)) == begin
            and int(got.group(2)) == expected_end - 1
            and (self.size is None or total == self.size)
        )
        if not ok:
            response.close()
            raise RangeError(
                f"{self.display}: asked for bytes {begin}-{end - 1} but the answer is "
                f"{response.headers.get('Content-Range')!r} ({encoding}); refusing bytes that may "
                "not be the ones asked for"
            )
        if self.size is None:
            self.size = total


class _BodyEnded(Exception):
    """The connection delivered fewer bytes than the range: resume at the first missing byte."""


class _RetryableStatus(Exception):
    """An answer that asks to try again later (408, 429, 5xx)."""


def _transient(e: Exception) -> bool:
    if isinstance(e, (_BodyEnded, _RetryableStatus)):
        return True
    # httpx2's TransportError (connection refused/reset, timeouts, protocol errors) without
    # importing it here: ProxyError is a misconfiguration, not worth retrying.
    names = {c.__name__ for c in type(e).__mro__}
    return "TransportError" in names and "ProxyError" not in names


def _agent_only(headers: dict[str, str]) -> dict[str, str]:
    """The User-Agent of ``headers``, which may also hold the token."""
    return {k: v for k, v in headers.items() if k.lower() == "user-agent"}
