"""Requests to the Hub through huggingface_hub: redacting URLs from its log lines, retrying
408/429/5xx and dropped connections with backoff, and what it takes for a progress bar."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from ..ranged import RETRY_STATUS, redact
from ..remote.engine import backoff, log_retry
from ..remote.store import MAX_RETRY_WAIT, RETRIES, retry_policy

# huggingface_hub 2.4's modules whose warnings name the address requested (a retry of a
# download names the presigned CDN URL): their records are redacted before any handler sees them.
HF_URL_LOGGERS = ("huggingface_hub.utils._http", "huggingface_hub.file_download")


class _RedactUrls(logging.Filter):
    """Rewrites a log record without its URLs' query strings and credentials."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = redact(record.getMessage()), None
        return True


_REDACT_URLS = _RedactUrls()
for _name in HF_URL_LOGGERS:  # the same Logger objects huggingface_hub's modules get, whenever imported
    logging.getLogger(_name).addFilter(_REDACT_URLS)

_T = TypeVar("_T")


def retry_status(e: BaseException | None) -> int | None:
    """The 408/429/5xx answer behind ``e`` (huggingface_hub wraps it), if that is what failed."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        status = getattr(getattr(e, "response", None), "status_code", None)
        if status in RETRY_STATUS:
            return status
        e = e.__cause__ or e.__context__
    return None


def retrying(call: Callable[[], _T], display: str) -> _T:
    """``call()``, a huggingface_hub request about ``display``, tried again with backoff while
    the Hub answers 408, 429 or 5xx or the connection drops (huggingface_hub retries a
    download's GET only on 408 and 429, resolving a revision never), ``RETRIES`` times at most;
    each retry is logged."""
    attempt = 0
    while True:
        try:
            return call()
        except Exception as e:
            status = retry_status(e)
            cause = f"the server answered {status}" if status is not None else transport_cause(e)
            if cause is None or attempt >= RETRIES:
                raise
            attempt += 1
            wait = backoff(retry_policy().wait, attempt, MAX_RETRY_WAIT)
            log_retry(display, cause if status is not None else f"the connection failed ({cause})", wait,
                      attempt, RETRIES)  # fmt: skip
            time.sleep(wait)


def transport_cause(e: BaseException) -> str | None:
    """The name of the network failure behind ``e`` (huggingface_hub wraps it), if any."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        names = {c.__name__ for c in type(e).__mro__}
        if (
            names & {"TransportError", "ConnectionError", "TimeoutError"}
            and "OfflineModeIsEnabled" not in names
        ):
            return type(e).__name__
        e = e.__cause__ or e.__context__
    return None


class Progress:
    """What huggingface_hub takes for a progress bar: forwards byte counts, shows nothing."""

    def __init__(self, on_bytes: Callable[[int], None], **_: object) -> None:
        self._on_bytes = on_bytes

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, n: int = 1) -> None:
        self._on_bytes(n)
