"""Read byte ranges of files on the Hub (or a mirror) over HTTP, every answer checked: the
fetch engine's transport for a Hub source (:mod:`.remote.engine` does the rest: streams in
flight, retries from where a read stopped, fewer streams after a 429/503).

A shard that straddles a stage boundary is never downloaded whole: the writer asks for the
byte ranges of the tensors it needs and only those are fetched, written in place into the stage
files. Nothing read this way is written into the Hugging Face cache: partial bytes must never
pass for the file.

Every answer is checked before a byte is used: ``206 Partial Content`` with the
``Content-Range`` asked for and the file's known size. A server that ignores ``Range`` (a
``200`` with the whole file) is reported, not silently downloaded whole. Dropped connections,
timeouts, bodies that end early and ``408/429/5xx`` answers are :class:`Transient`: the engine
asks again from the first byte not yet received.

The Hub answers ``/resolve`` of a large file with a redirect to its CDN; the CDN address is kept
for the following ranges (one request per range instead of two) and asked again when it has
expired. The ``Authorization`` header goes only to the Hub's own origin, never to the CDN.
No message names a URL with its query string (the CDN's signature) or credentials: see
:func:`redact"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator, Mapping
from urllib.parse import urljoin, urlsplit

from ..errors import HubError
from .remote.engine import RemoteFile, Transient
from .remote.settings import read_timeout_setting

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


class RangeError(HubError):
    """A ranged read that could not be completed or whose answer was wrong."""


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    return parts.scheme, (parts.hostname or "").lower(), parts.port


class HttpTransport:
    """Byte ranges of files at ``url_of(name)`` (a ``/resolve/<commit>/<file>`` address), one
    ``GET`` with ``Range`` per read: the fetch engine's transport for the Hub and its mirrors.

    ``headers`` (the Hub's, with the token if any) go to each URL's own origin only.
    ``raise_for_status(response)`` turns the Hub's error answers into exceptions
    (huggingface_hub's ``hf_raise_for_status``). ``counter``, when given, is told every request
    sent (``counter.request()``) and every body byte received (``counter.add(nbytes)``).
    ``read_timeout`` (default: :func:`.remote.settings.read_timeout_setting`) bounds each wait for
    the server, so a stalled answer becomes :class:`Transient` (huggingface_hub's shared client
    waits forever). The CDN address a redirect names is kept per address asked (one request per
    read instead of two), shared by every transport of the process (planning's and the copy's),
    and asked again once expired.
    """

    _locations: dict[str, str] = {}  # address asked -> the CDN address of its last redirect
    _lock = threading.Lock()

    def __init__(
        self,
        url_of: Callable[[str], str],
        *,
        display: str,
        session: object,
        headers: dict[str, str],
        raise_for_status: Callable[[object], None],
        counter: object | None = None,
        read_timeout: float | None = None,
    ) -> None:
        self.url_of = url_of
        self.display = display
        self._session = session
        self._headers = headers
        self._raise_for_status = raise_for_status
        self._counter = counter
        self._timeout = read_timeout if read_timeout is not None else read_timeout_setting()

    def open(self, file: RemoteFile, start: int, end: int) -> Iterator[bytes]:
        """Bytes ``[start, end)`` of ``file`` as they arrive (no re-chunking: a dropped
        connection loses nothing received, and the retry resumes at the first byte not here)."""
        response = self._send(file, start, end)
        try:
            for chunk in response.iter_raw():
                if self._counter is not None:
                    self._counter.add(len(chunk))
                yield chunk
        except Exception as e:  # transport errors: the type lives in the HTTP library
            if not _transient(e):
                raise
            raise Transient(f"the connection failed ({type(e).__name__})") from e
        finally:
            response.close()

    def _send(self, file: RemoteFile, begin: int, end: int) -> object:
        """Send ``GET`` with ``Range: bytes=begin-(end-1)``; the checked answer."""
        origin_url = self.url_of(file.name)
        with self._lock:
            url = self._locations.get(origin_url, origin_url)
        where = f"{self.display}: {file.name}"
        for _ in range(5):  # redirects and one refresh of an expired CDN address
            same_origin = _origin(url) == _origin(origin_url)
            # Another origin (the CDN a redirect names) gets no credentials: only who is asking.
            sent = self._headers if same_origin else _agent_only(self._headers)
            headers = {**sent, "Range": f"bytes={begin}-{end - 1}", "Accept-Encoding": "identity"}
            if self._counter is not None:
                self._counter.request()
            try:
                request = self._session.build_request("GET", url, headers=headers, timeout=self._timeout)
                response = self._session.send(request, stream=True, follow_redirects=False)
            except Exception as e:
                if not _transient(e):
                    raise
                raise Transient(f"the connection failed ({type(e).__name__})") from e
            status = response.status_code
            if status in REDIRECT_STATUS and "Location" in response.headers:
                response.close()
                url = urljoin(url, response.headers["Location"])
                if _origin(url) != _origin(origin_url):
                    with self._lock:
                        self._locations[origin_url] = url
                continue
            if status in EXPIRED_STATUS and not same_origin:
                response.close()
                with self._lock:
                    self._locations.pop(origin_url, None)
                url = origin_url
                continue
            if status in RETRY_STATUS:
                response.close()
                raise Transient(f"the server answered {status}", status, retry_after(response.headers))
            if status != 206:
                self._refuse(response, where, file, begin, end)
            self._check_range(response, where, file, begin, end)
            return response
        raise RangeError(f"{where}: too many redirects while fetching bytes {begin}-{end - 1}")

    def _refuse(self, response: object, where: str, file: RemoteFile, begin: int, end: int) -> None:
        status = response.status_code
        if status == 200:
            response.close()
            raise RangeError(
                f"{where}: the server ignored the Range request for bytes {begin}-{end - 1} and "
                "started sending the whole file; it does not support ranged reads: use an endpoint "
                "(HF_ENDPOINT) that does"
            )
        if status == 416 and begin >= file.size:
            response.close()
            raise RangeError(
                f"{where}: bytes {begin}-{end - 1} lie past the end of the {file.size}-byte file; "
                "the file changed on the server"
            )
        try:
            response.read()
            self._raise_for_status(response)
        except Exception as e:  # the Hub's error names the (signed) address
            raise RangeError(f"{where}: the server refused bytes {begin}-{end - 1}: {describe(e)}") from e
        finally:
            response.close()
        raise RangeError(f"{where}: unexpected answer {status} to a ranged request")

    def _check_range(self, response: object, where: str, file: RemoteFile, begin: int, end: int) -> None:
        encoding = response.headers.get("Content-Encoding", "identity").lower()
        got = _CONTENT_RANGE.match(response.headers.get("Content-Range", "").strip())
        ok = (
            got is not None
            and encoding == "identity"
            and int(got.group(1)) == begin
            and int(got.group(2)) == min(end, file.size) - 1
            and int(got.group(3)) == file.size
        )
        if not ok:
            response.close()
            raise RangeError(
                f"{where}: asked for bytes {begin}-{end - 1} of {file.size} but the answer is "
                f"{response.headers.get('Content-Range')!r} ({encoding}); refusing bytes that may "
                "not be the ones asked for"
            )


def _transient(e: Exception) -> bool:
    # httpx2's TransportError (connection refused/reset, timeouts, protocol errors) without
    # importing it here: ProxyError is a misconfiguration, not worth retrying.
    names = {c.__name__ for c in type(e).__mro__}
    return "TransportError" in names and "ProxyError" not in names


def retry_after(headers: Mapping[str, str]) -> float | None:
    """The seconds a ``Retry-After`` header asks to wait (its HTTP-date form is not used).

    Example:
        >>> retry_after({"retry-after": "2"}), retry_after({})
        (2.0, None)
    """
    raw = str(headers.get("Retry-After", headers.get("retry-after", ""))).strip()
    return float(raw) if raw.isdigit() else None


def _agent_only(headers: dict[str, str]) -> dict[str, str]:
    """The User-Agent of ``headers``, which may also hold the token."""
    return {k: v for k, v in headers.items() if k.lower() == "user-agent"}
