"""Requests to the Hub: counting them, redacting URLs from log lines, retrying 408/429/5xx with
backoff, resolving a revision to its commit, downloads into the cache, ranged readers, and one
line for every failure of huggingface_hub."""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from ..._version import __version__
from ...errors import HubError, ReshardError
from ...format.names import COMMIT, TOOL_NAME
from ..ranged import RETRY_STATUS, HttpTransport, describe, redact
from ..remote.engine import FetchEngine, RetryPolicy, backoff, log_retry, streams_setting
from .cache import HubRepo, HubSettings, read_ref

# First wait before retrying a failed request (doubled each time, up to MAX_RETRY_WAIT s).
RETRY_WAIT_ENV = "QWEN35_RESHARD_RETRY_WAIT"
DEFAULT_RETRY_WAIT = 0.5
MAX_RETRY_WAIT = 8.0
RETRIES = 5  # retries of a request the Hub keeps answering 408/429/5xx, as for ranged reads
# huggingface_hub 2.4's modules whose warnings name the address requested (a retry of a
# download names the presigned CDN URL): their records are redacted before any handler sees them.
HF_URL_LOGGERS = ("huggingface_hub.utils._http", "huggingface_hub.file_download")


@dataclass
class Traffic:
    """What this process fetched from the network since this object was made: body bytes,
    counted as they arrive, and every HTTP request huggingface_hub's client sent (ours and
    huggingface_hub's own). Thread-safe."""

    bytes: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _requests_before: int = field(default_factory=lambda: _REQUESTS.count, repr=False)

    def add(self, nbytes: int) -> None:
        with self.lock:
            self.bytes += nbytes

    @property
    def requests(self) -> int:
        return _REQUESTS.count - self._requests_before


class _RequestCounter:
    """Counts the requests of huggingface_hub's shared HTTP client through its event hooks."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()

    def __call__(self, request: object) -> None:
        with self._lock:
            self.count += 1

    def session(self) -> object:
        """huggingface_hub's shared client, counting: hooked once per client it makes."""
        from huggingface_hub import get_session

        client = get_session()
        hooks = client.event_hooks
        if self not in hooks["request"]:
            hooks["request"].append(self)
            client.event_hooks = hooks
        return client


_REQUESTS = _RequestCounter()


class _RedactUrls(logging.Filter):
    """Rewrites a log record without its URLs' query strings and credentials."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = redact(record.getMessage()), None
        return True


_REDACT_URLS = _RedactUrls()
for _name in HF_URL_LOGGERS:  # the same Logger objects huggingface_hub's modules get, whenever imported
    logging.getLogger(_name).addFilter(_REDACT_URLS)

_T = TypeVar("_T")


def _retry_wait() -> float:
    return float(os.environ.get(RETRY_WAIT_ENV, DEFAULT_RETRY_WAIT))


def _retry_status(e: BaseException | None) -> int | None:
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
    the Hub answers 408, 429 or 5xx (huggingface_hub retries a download's GET only on 408 and
    429, resolving a revision never), ``RETRIES`` times at most; each retry is logged."""
    attempt = 0
    while True:
        try:
            return call()
        except Exception as e:
            status = _retry_status(e)
            if status is None or attempt >= RETRIES:
                raise
            attempt += 1
            wait = backoff(_retry_wait(), attempt, MAX_RETRY_WAIT)
            log_retry(display, f"the server answered {status}", wait, attempt, RETRIES)
            time.sleep(wait)


def resolve(repo_id: str, settings: HubSettings) -> HubRepo:
    """Pin ``repo_id`` at ``settings.revision`` (default ``main``) to its commit."""
    from huggingface_hub import HfApi

    _REQUESTS.session()
    revision = settings.revision or "main"
    probe = HubRepo(repo_id, revision, "0" * 40, settings)
    if not COMMIT.fullmatch(revision):
        # huggingface_hub falls back on the cache's ref (offline, or the Hub unreachable),
        # which it reads as it finds it: checked here first, read by no one if damaged.
        read_ref(probe.storage, revision)
    api = HfApi(
        endpoint=settings.endpoint,
        library_name=TOOL_NAME,
        library_version=__version__,
        user_agent=settings.user_agent,
    )
    try:
        resolved = retrying(
            lambda: api.resolve_revision(
                repo_id,
                revision=revision,
                cache_dir=settings.cache_dir,
                local_files_only=probe.offline,
                token=settings.token,
            ),
            f"{repo_id}: revision {revision!r}",
        )
    except Exception as e:
        raise hub_error(e, probe, what=f"revision {revision!r}") from e
    if not COMMIT.fullmatch(resolved.resolved):  # a ref changed since read_ref read it (never shown)
        raise HubError(
            f"{probe.storage}: refs/{revision} is not one 40-hex commit id; the cache folder is damaged: "
            "delete that file and run again with network access"
        )
    return HubRepo(repo_id, revision, resolved.resolved, settings)


def hub_error(e: BaseException, repo: HubRepo, *, what: str) -> ReshardError:
    """One line for a failure of huggingface_hub while fetching ``what``; never names the token."""
    from huggingface_hub import errors as hf

    if isinstance(e, ReshardError):
        return e
    endpoint = redact(repo.endpoint)  # HF_ENDPOINT may carry credentials (https://user:pass@mirror)
    if isinstance(e, hf.GatedRepoError):
        return HubError(
            f"{repo.repo_id} is a gated repo and this token has no access: accept its license at "
            f"{endpoint}/{repo.repo_id} and log in (`hf auth login`, HF_TOKEN or a token)"
        )
    if isinstance(e, hf.RepositoryNotFoundError):
        return HubError(
            f"{repo.repo_id}: no such model repo on {endpoint} (and no local directory of that "
            "name), or it is private and this token has no access (log in with `hf auth login`, set "
            "HF_TOKEN or pass a token)"
        )
    if isinstance(e, hf.RevisionNotFoundError):
        return HubError(f"{repo.repo_id}: no revision {repo.revision!r} (branch, tag or commit) in the repo")
    if isinstance(e, hf.RemoteEntryNotFoundError):
        return HubError(f"{repo.describe()}: {what} is missing from the repo; the repo is incomplete")
    if getattr(getattr(e, "response", None), "status_code", None) == 401:  # the Hub's "Invalid credentials"
        return HubError(
            f"{endpoint} refused the token ({what} of {repo.repo_id}: 401, invalid credentials): the "
            "token in use (HF_TOKEN, the one `hf auth login` saved, or one passed) is not a valid token; "
            "use a valid one, or none for a public repo"
        )
    if repo.offline:
        return HubError(
            f"{repo.repo_id}: offline, and the Hugging Face cache lacks {what}; run once with network "
            "access, or on a node whose cache has it"
        )
    status = _retry_status(e)
    if status is not None:
        return HubError(
            f"{repo.repo_id}: {what}: the Hub still answered {status} after {RETRIES} retries; try again "
            "later (a split resumes where it stopped)"
        )
    cause = _transport_cause(e)
    if cause is not None:
        return HubError(
            f"{endpoint} is unreachable ({cause}) while fetching {what} of {repo.repo_id}; the "
            "Hugging Face cache could not have served it either (it lacks it): check the network or "
            "HF_ENDPOINT"
        )
    return HubError(f"{repo.repo_id}: {what}: {type(e).__name__}: {describe(e)}")


def _transport_cause(e: BaseException) -> str | None:
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


def hf_download(
    repo: HubRepo,
    name: str,
    traffic: Traffic,
    *,
    size: int,
    on_bytes: Callable[[int], None] | None = None,
) -> str:
    from huggingface_hub import hf_hub_download

    cached = repo.cached(name)
    if cached is not None:
        return str(cached)
    if repo.offline:
        raise HubError(
            f"{repo.describe()}: offline and the Hugging Face cache lacks {name}; run once with network "
            "access, or on a node whose cache has it"
        )
    progress = functools.partial(_Progress, on_bytes) if on_bytes is not None else None
    try:
        # A retry resumes from the bytes huggingface_hub kept (blobs/*.incomplete).
        path = retrying(
            lambda: hf_hub_download(
                repo.repo_id,
                name,
                revision=repo.commit,
                cache_dir=repo.settings.cache_dir,
                endpoint=repo.settings.endpoint,
                token=repo.settings.token,
                user_agent=repo.settings.user_agent,
                library_name=TOOL_NAME,
                library_version=__version__,
                tqdm_class=progress,
            ),
            f"{repo.describe()}: {name}",
        )
    except Exception as e:
        raise hub_error(e, repo, what=name) from e
    traffic.add(size)
    return path


class _Progress:
    """What huggingface_hub takes for a progress bar: forwards byte counts, shows nothing."""

    def __init__(self, on_bytes: Callable[[int], None], **_: object) -> None:
        self._on_bytes = on_bytes

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, n: int = 1) -> None:
        self._on_bytes(n)


def engine(repo: HubRepo, traffic: Traffic) -> FetchEngine:
    """The fetch engine for the repo's files at its commit: checked ranged reads, as many in
    flight as the repo's settings say (``streams``), retried with backoff."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers, hf_raise_for_status

    headers = build_hf_headers(
        token=repo.settings.token,
        library_name=TOOL_NAME,
        library_version=__version__,
        user_agent=repo.settings.user_agent,
    )
    transport = HttpTransport(
        lambda name: hf_hub_url(repo.repo_id, name, revision=repo.commit, endpoint=repo.settings.endpoint),
        display=repo.describe(),
        session=_REQUESTS.session(),
        headers=headers,
        raise_for_status=hf_raise_for_status,
        counter=traffic,
    )
    policy = RetryPolicy(retries=RETRIES, wait=_retry_wait(), max_wait=MAX_RETRY_WAIT)
    return FetchEngine(transport, streams=streams_setting(repo.settings.streams), policy=policy)
