"""MODEL as a Hugging Face Hub repo id: plan from remote headers, fetch only what stages need.

A repo id (``org/name``) is resolved once to a commit; every later request names that commit,
so a branch moving during a run cannot mix two versions. Planning reads ``config.json`` and the
index through huggingface_hub (into its standard cache) and each shard's safetensors header
through two small HTTP range requests (the first bytes, then exactly the rest of the header).
Headers and the repo's file list are kept in huggingface_hub's cached-assets folder, keyed by
repo and commit, so planning the same commit again needs no network.

A split then fetches per source shard, for the stages being built:

- ``cache``: the shard is already in the Hugging Face cache: read there;
- ``whole``: the stages need every tensor of it: downloaded whole by huggingface_hub into the
  standard cache (other tools reuse it), then read like a local file;
- ``ranges``: the shard straddles a stage boundary: only the needed tensors' byte ranges are
  fetched (:mod:`.ranged`) and streamed straight into the stage files; the cache never sees
  these partial bytes.

Offline (``offline=True`` or ``HF_HUB_OFFLINE=1``) only the cache and the kept headers are
used, and a run that needs more names exactly the files missing. The token (``token=``,
``HF_TOKEN`` or the saved login, as huggingface_hub finds it) is passed to huggingface_hub and
to the Hub's own origin only; it is never printed, logged or written anywhere.

Every request to the Hub (resolving the revision, the file list, small files, whole shards,
ranged reads) answered ``408``, ``429`` or ``5xx`` is tried again with backoff, ``RETRIES`` times
at most, each retry logged as a warning (stderr by default). No message (ours, or
huggingface_hub's own log lines about these requests) names a URL with its query string: a
presigned CDN address carries its signature there (see :func:`.ranged.redact`).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from .._version import __version__
from ..errors import JSON_ERRORS, ReshardError, param
from ..format.jsonio import is_sha256
from ..format.names import (
    CACHE_REPO_PREFIX,
    COMMIT,
    CONFIG_NAME,
    INDEX_NAME,
    PICKLE_SUFFIXES,
    SINGLE_FILE_NAME,
    TOOL_NAME,
    partial_name,
    process_token,
)
from ..format.paths import is_plain_name
from ..model.quant import QUANT_SIDE_FILE
from ..units import plural
from .header import Header, parse_header
from .ranged import RETRY_STATUS, RangeReader, backoff, describe, log_retry, redact

if TYPE_CHECKING:
    from .checkpoint import Checkpoint

REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
# config.json model_type of a Qwen3.5 MoE checkpoint (multimodal save, text-only save).
MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
HEADER_PROBE_BYTES = 8  # the length prefix; then exactly the header: not a byte of tensor data
HEADER_WORKERS = 8  # headers fetched at once while planning
LISTING_NAME = "files.json"  # kept beside the headers: the repo's files and sizes at the commit
LFS_NAME = "lfs-sha256.json"  # kept with it: each LFS file's sha256, as the Hub names its blob
HEADER_SUFFIX = ".header"
# First wait before retrying a failed request (doubled each time, up to MAX_RETRY_WAIT s).
RETRY_WAIT_ENV = "QWEN35_RESHARD_RETRY_WAIT"
DEFAULT_RETRY_WAIT = 0.5
MAX_RETRY_WAIT = 8.0
RETRIES = 5  # retries of a request the Hub keeps answering 408/429/5xx, as for ranged reads
# huggingface_hub 2.4's modules whose warnings name the address requested (a retry of a
# download names the presigned CDN URL): their records are redacted before any handler sees them.
HF_URL_LOGGERS = ("huggingface_hub.utils._http", "huggingface_hub.file_download")

FETCH_CACHE, FETCH_WHOLE, FETCH_RANGES = "cache", "whole", "ranges"


@dataclass(frozen=True)
class HubSettings:
    """How to reach the Hub. ``None`` means huggingface_hub's own default (``HF_ENDPOINT``,
    ``HF_HUB_CACHE``, ``HF_ASSETS_CACHE``, ``HF_TOKEN`` or the saved login)."""

    revision: str | None = None
    token: str | None = field(default=None, repr=False)
    endpoint: str | None = None
    cache_dir: str | None = None
    assets_dir: str | None = None
    offline: bool = False


@dataclass(frozen=True)
class HubRepo:
    """A repo pinned to one commit."""

    repo_id: str
    revision: str
    commit: str
    settings: HubSettings = field(repr=False)

    @property
    def offline(self) -> bool:
        from huggingface_hub import constants as hf

        return self.settings.offline or hf.is_offline_mode()

    @property
    def endpoint(self) -> str:
        from huggingface_hub import constants as hf

        return (self.settings.endpoint or hf.ENDPOINT).rstrip("/")

    @property
    def storage(self) -> Path:
        from huggingface_hub import constants as hf
        from huggingface_hub.file_download import repo_folder_name

        cache = Path(self.settings.cache_dir or hf.HF_HUB_CACHE).expanduser()
        return cache / repo_folder_name(repo_id=self.repo_id, repo_type="model")

    @property
    def snapshot(self) -> Path:
        return self.storage / "snapshots" / self.commit

    @property
    def assets(self) -> Path:
        from huggingface_hub.file_download import repo_folder_name
        from huggingface_hub.utils import cached_assets_path

        return cached_assets_path(
            TOOL_NAME,
            namespace=repo_folder_name(repo_id=self.repo_id, repo_type="model"),
            subfolder=self.commit,
            assets_dir=self.settings.assets_dir,
        )

    def describe(self) -> str:
        return f"{self.repo_id}@{self.commit[:12]}"

    def identity(self) -> dict:
        """What the manifests record about the source: never the token or the endpoint's secrets."""
        return {"repo_id": self.repo_id, "revision": self.revision, "commit": self.commit}


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


def _retrying(call: Callable[[], _T], display: str) -> _T:
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


# ---------------------------------------------------------------------------- naming MODEL


def is_repo_id(model: str) -> bool:
    """``org/name`` that is not an existing local path."""
    return bool(REPO_ID.fullmatch(model)) and not os.path.exists(model)


def cache_repo_snapshot(path: Path, revision: str | None) -> Path | None:
    """For a cache repo folder (``.../models--org--name``), its snapshot of ``revision``
    (default ``main``) through ``refs/``; None when ``path`` is not such a folder."""
    if not path.name.startswith(CACHE_REPO_PREFIX) or not (path / "snapshots").is_dir():
        return None
    rev = revision or "main"
    if COMMIT.fullmatch(rev):
        commit = rev
    else:
        ref = path / "refs" / rev
        if not ref.is_file():
            known = sorted(p.name for p in (path / "refs").glob("*")) if (path / "refs").is_dir() else []
            raise ReshardError(
                f"{path}: a Hugging Face cache repo folder with no refs/{rev}"
                + (f" (it has {', '.join(known)})" if known else "")
                + f"; pass a revision it has, or the snapshot directory {path / 'snapshots'}/<commit>"
            )
        commit = ref.read_text().strip()
    snapshot = path / "snapshots" / commit
    if not snapshot.is_dir():
        raise ReshardError(f"{path}: refs/{rev} names commit {commit} but snapshots/{commit} is missing")
    return snapshot


# ---------------------------------------------------------------------------- resolving


def resolve(repo_id: str, settings: HubSettings) -> HubRepo:
    """Pin ``repo_id`` at ``settings.revision`` (default ``main``) to its commit."""
    from huggingface_hub import HfApi

    _REQUESTS.session()
    revision = settings.revision or "main"
    probe = HubRepo(repo_id, revision, "0" * 40, settings)
    api = HfApi(endpoint=settings.endpoint, library_name=TOOL_NAME, library_version=__version__)
    try:
        resolved = _retrying(
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
    return HubRepo(repo_id, revision, resolved.resolved, settings)


def hub_error(e: BaseException, repo: HubRepo, *, what: str) -> ReshardError:
    """One line for a failure of huggingface_hub while fetching ``what``; never names the token."""
    from huggingface_hub import errors as hf

    if isinstance(e, ReshardError):
        return e
    endpoint = redact(repo.endpoint)  # HF_ENDPOINT may carry credentials (https://user:pass@mirror)
    if isinstance(e, hf.GatedRepoError):
        return ReshardError(
            f"{repo.repo_id} is a gated repo and this token has no access: accept its license at "
            f"{endpoint}/{repo.repo_id} and log in (`hf auth login`, HF_TOKEN or a token)"
        )
    if isinstance(e, hf.RepositoryNotFoundError):
        return ReshardError(
            f"{repo.repo_id}: no such model repo on {endpoint} (and no local directory of that "
            "name), or it is private and this token has no access (log in with `hf auth login`, set "
            "HF_TOKEN or pass a token)"
        )
    if isinstance(e, hf.RevisionNotFoundError):
        return ReshardError(
            f"{repo.repo_id}: no revision {repo.revision!r} (branch, tag or commit) in the repo"
        )
    if isinstance(e, hf.RemoteEntryNotFoundError):
        return ReshardError(f"{repo.describe()}: {what} is missing from the repo; the repo is incomplete")
    if repo.offline:
        return ReshardError(
            f"{repo.repo_id}: offline, and the Hugging Face cache lacks {what}; run once with network "
            "access, or on a node whose cache has it"
        )
    status = _retry_status(e)
    if status is not None:
        return ReshardError(
            f"{repo.repo_id}: {what}: the Hub still answered {status} after {RETRIES} retries; try again "
            "later (a split resumes where it stopped)"
        )
    cause = _transport_cause(e)
    if cause is not None:
        return ReshardError(
            f"{endpoint} is unreachable ({cause}) while fetching {what} of {repo.repo_id}; the "
            "Hugging Face cache could not have served it either (it lacks it): check the network or "
            "HF_ENDPOINT"
        )
    return ReshardError(f"{repo.repo_id}: {what}: {type(e).__name__}: {describe(e)}")


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


# ---------------------------------------------------------------------------- planning


def read_hub_checkpoint(repo: HubRepo, *, traffic: Traffic | None = None) -> Checkpoint:
    """The checkpoint at ``repo`` as plain data: config and index through huggingface_hub,
    each shard's header by ranged reads (or from the kept headers / the cache)."""
    from .checkpoint import assemble_checkpoint, load_config, load_quant_side

    traffic = traffic if traffic is not None else Traffic()
    listing = repo_listing(repo)
    config_bytes = _small_file(repo, CONFIG_NAME, listing, traffic)
    config = load_config(config_bytes, f"{repo.describe()}/{CONFIG_NAME}")
    _check_model_type(config, repo)
    index_bytes = None
    if INDEX_NAME in listing:
        index_bytes = _small_file(repo, INDEX_NAME, listing, traffic)
    elif SINGLE_FILE_NAME not in listing:
        raise ReshardError(
            f"{repo.describe()}: no {INDEX_NAME} and no {SINGLE_FILE_NAME} in the repo; not a "
            "safetensors checkpoint"
        )

    def read_headers(files: list[str]) -> dict[str, Header]:
        # As for a local index: the kept header and the cached copy of a shard are found by
        # its name, which must not lead out of (or below) the repo's top level.
        for f in files:
            if not is_plain_name(f):
                raise ReshardError(
                    f"{repo.describe()}/{INDEX_NAME}: shard file name {f!r} is not a plain file name "
                    "at the top of the repo; refusing to follow it"
                )
        absent = [f for f in files if f not in listing]
        if absent:
            raise ReshardError(
                f"{repo.describe()}: {absent[0]} is named by {INDEX_NAME} but missing from the repo"
                + (f" ({len(absent)} such files)" if len(absent) > 1 else "")
                + "; the repo is incomplete"
            )
        return _headers(repo, files, listing, traffic)

    def other_files(files: list[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
        top = [n for n in sorted(listing) if "/" not in n and not n.startswith(".")]
        weights = (".safetensors", *PICKLE_SUFFIXES)
        extra = tuple(n for n in top if n not in (INDEX_NAME, *files) and not n.endswith(weights))
        return extra, tuple(n for n in top if n.endswith(".safetensors") and n not in files)

    ckpt = assemble_checkpoint(
        root=repo.snapshot,
        display=repo.describe(),
        config=config,
        config_bytes=config_bytes,
        index_bytes=index_bytes,
        read_headers=read_headers,
        other_files=other_files,
        hub=repo.identity(),
    )
    side = _small_file(repo, QUANT_SIDE_FILE, listing, traffic) if QUANT_SIDE_FILE in listing else None
    quant_side = load_quant_side(side, f"{repo.describe()}/{QUANT_SIDE_FILE}")
    return replace(ckpt, blob_sha256=repo_lfs_sha256(repo, ckpt.files), quant_side=quant_side)


def repo_listing(repo: HubRepo) -> dict[str, int]:
    """The repo's files and sizes at the commit: kept on disk once fetched."""
    kept = repo.assets / LISTING_NAME
    try:
        listing = json.loads(kept.read_bytes())
    except (OSError, *JSON_ERRORS):  # none yet, or damaged: fetched (offline: the snapshot's)
        listing = None
    if isinstance(listing, dict):
        return listing
    if repo.offline:
        local = _snapshot_listing(repo)
        if local is not None:
            return local
        raise ReshardError(
            f"{repo.describe()}: offline, and neither the kept file list ({kept}) nor a cached snapshot "
            "is there; plan it once with network access"
        )
    from huggingface_hub import HfApi

    api = HfApi(endpoint=repo.settings.endpoint, library_name=TOOL_NAME, library_version=__version__)

    def fetch() -> list:
        return list(api.list_repo_tree(repo.repo_id, revision=repo.commit, token=repo.settings.token))

    try:
        entries = _retrying(fetch, f"{repo.describe()}: the file list")
        listing = {e.path: e.size for e in entries if hasattr(e, "size") and e.size is not None}
    except Exception as e:
        raise hub_error(e, repo, what="the file list") from e
    lfs = {e.path: e.lfs.sha256 for e in entries if getattr(e, "lfs", None) and is_sha256(e.lfs.sha256)}
    _write_kept(repo.assets / LFS_NAME, json.dumps(lfs, sort_keys=True).encode())
    _write_kept(kept, json.dumps(listing, sort_keys=True).encode())
    return listing


def repo_lfs_sha256(repo: HubRepo, files: tuple[str, ...]) -> dict[str, str]:
    """The Hub's LFS sha256 of each of ``files`` at the commit, kept with the file list (the
    etag the Hub serves the blob under); offline or where none was kept, the blob names of the
    cached snapshot's files (which huggingface_hub names by that sha256)."""
    try:
        kept = json.loads((repo.assets / LFS_NAME).read_bytes())
    except (OSError, *JSON_ERRORS):
        kept = None
    if isinstance(kept, dict):
        return {f: kept[f] for f in files if is_sha256(kept.get(f))}
    found = {}
    for f in files:
        target = repo.snapshot / f
        if target.is_symlink() and is_sha256(name := Path(os.readlink(target)).name):
            found[f] = name
    return found


def _snapshot_listing(repo: HubRepo) -> dict[str, int] | None:
    """Files of a cached snapshot that holds the whole repo (a ``snapshot_download``): used
    offline when no file list was kept."""
    if not repo.snapshot.is_dir():
        return None
    return {p.name: p.stat().st_size for p in repo.snapshot.iterdir() if p.is_file()}


def _small_file(repo: HubRepo, name: str, listing: dict[str, int], traffic: Traffic) -> bytes:
    """A config or index file, through huggingface_hub into the standard cache."""
    path = _hf_download(repo, name, traffic, size=listing.get(name, 0))
    return Path(path).read_bytes()


def _hf_download(
    repo: HubRepo,
    name: str,
    traffic: Traffic,
    *,
    size: int,
    on_bytes: Callable[[int], None] | None = None,
) -> str:
    from huggingface_hub import hf_hub_download

    cached = repo.snapshot / name
    if cached.is_file():
        return str(cached)
    if repo.offline:
        raise ReshardError(
            f"{repo.describe()}: offline and the Hugging Face cache lacks {name}; run once with network "
            "access, or on a node whose cache has it"
        )
    progress = functools.partial(_Progress, on_bytes) if on_bytes is not None else None
    try:
        # A retry resumes from the bytes huggingface_hub kept (blobs/*.incomplete).
        path = _retrying(
            lambda: hf_hub_download(
                repo.repo_id,
                name,
                revision=repo.commit,
                cache_dir=repo.settings.cache_dir,
                endpoint=repo.settings.endpoint,
                token=repo.settings.token,
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


def _check_model_type(config: dict, repo: HubRepo) -> None:
    found = config.get("model_type")
    if found not in MODEL_TYPES:
        raise ReshardError(
            f"{repo.describe()}: config.json has model_type {found!r}, not a Qwen3.5 MoE checkpoint "
            f"({' or '.join(MODEL_TYPES)}); this tool splits only those"
        )


def reader(repo: HubRepo, name: str, *, size: int | None, traffic: Traffic) -> RangeReader:
    """A checked, retrying range reader of ``name`` at the repo's commit."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers, hf_raise_for_status

    url = hf_hub_url(repo.repo_id, name, revision=repo.commit, endpoint=repo.settings.endpoint)
    headers = build_hf_headers(token=repo.settings.token, library_name=TOOL_NAME, library_version=__version__)
    return RangeReader(
        url,
        wait=_retry_wait(),
        max_wait=MAX_RETRY_WAIT,
        retries=RETRIES,
        display=f"{repo.describe()}: {name}",
        session=_REQUESTS.session(),
        headers=headers,
        raise_for_status=hf_raise_for_status,
        size=size,
        counter=traffic,
    )


def _headers(repo: HubRepo, files: list[str], listing: dict[str, int], traffic: Traffic) -> dict[str, Header]:
    """Each shard's parsed header: kept on disk, else from the cached shard, else fetched."""
    missing = [
        f
        for f in files
        if not (repo.assets / (f + HEADER_SUFFIX)).is_file() and not (repo.snapshot / f).is_file()
    ]
    if missing and repo.offline:
        raise ReshardError(
            f"{repo.describe()}: offline, and neither kept headers nor cached files exist for "
            f"{plural(len(missing), 'shard')} ({', '.join(missing[:3])}{', ...' * (len(missing) > 3)}); plan "
            "it once with network access"
        )

    def one(f: str) -> Header:
        return parse_header(
            _header_bytes(repo, f, listing[f], traffic)[8:],
            file_size=listing[f],
            where=f"{repo.describe()}: {f}",
        )

    pool = ThreadPoolExecutor(max_workers=HEADER_WORKERS)
    try:
        return dict(zip(files, pool.map(one, files), strict=True))
    finally:
        pool.shutdown(cancel_futures=True)  # on the first error, fetch no more headers


def _header_bytes(repo: HubRepo, f: str, size: int, traffic: Traffic) -> bytes:
    """The shard's first 8 + n bytes (length prefix and header)."""
    kept = repo.assets / (f + HEADER_SUFFIX)
    if kept.is_file():
        return kept.read_bytes()
    local = repo.snapshot / f
    if local.is_file():
        with open(local, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8).ljust(8, b"\0"))
            _check_header_length(n, size, repo, f)
            return struct.pack("<Q", n) + fh.read(n)
    r = reader(repo, f, size=size, traffic=traffic)
    try:
        raw = r.read(0, min(size, HEADER_PROBE_BYTES))
        if len(raw) < 8:
            raise ReshardError(f"{repo.describe()}: {f}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", raw[:8])
        _check_header_length(n, size, repo, f)
        if 8 + n > len(raw):
            raw += r.read(len(raw), 8 + n)
        raw = raw[: 8 + n]
    except ReshardError:
        raise
    except Exception as e:
        raise hub_error(e, repo, what=f"the header of {f}") from e
    finally:
        r.close()
    _write_kept(kept, raw)
    return raw


def header_bytes(repo: HubRepo, file: str) -> bytes:
    """Shard ``file``'s length prefix and header, as planning read them: kept, from the cached
    shard, or fetched by two ranged reads (never the whole shard).

    Raises:
        ReshardError: the repo has no such file, or its header could not be fetched.
    """
    listing = repo_listing(repo)
    if file not in listing:
        raise ReshardError(f"{repo.describe()}: {file} is missing from the repo; the repo is incomplete")
    return _header_bytes(repo, file, listing[file], Traffic())


def _check_header_length(n: int, size: int, repo: HubRepo, f: str) -> None:
    from huggingface_hub import constants as hf

    limit = hf.SAFETENSORS_MAX_HEADER_LENGTH
    if n > limit:
        raise ReshardError(
            f"{repo.describe()}: {f}: header length {n} exceeds the {limit}-byte limit of remote "
            "headers; the file is corrupt or not safetensors"
        )
    if 8 + n > size:
        raise ReshardError(
            f"{repo.describe()}: {f}: header length {n} runs past the end of the {size}-byte file; "
            "the file is truncated or not safetensors"
        )


_kept_lock = threading.Lock()  # this process's threads share its temporary names


def _write_kept(path: Path, data: bytes) -> None:
    """Keep a header or file list: written under a temporary name of this process's (a Hub
    cache may be shared by several processes and hosts) and renamed, so a killed run never
    leaves a torn one that a later offline plan would trust."""
    tmp = path.with_name(partial_name(path.name, process_token()))
    with _kept_lock:
        try:
            tmp.write_bytes(data)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)  # a full disk, Ctrl-C: no temporary left in the cache
            raise


# ---------------------------------------------------------------------------- fetching


@dataclass(frozen=True)
class ShardFetch:
    """How one source shard reaches the stages built by this run."""

    file: str
    how: str  # FETCH_CACHE, FETCH_WHOLE or FETCH_RANGES
    size: int  # the file's size
    needed: int  # data bytes of it that the stages built need (each tensor once)


def fetch_plan(ckpt: Checkpoint, needed: dict[str, set[str]], cached: set[str]) -> dict[str, ShardFetch]:
    """Per shard of ``needed``: read from the cache (``cached``), downloaded whole (every tensor
    of it is needed), or only the needed ranges. Pure."""
    in_file: dict[str, int] = {}
    for t in ckpt.tensors.values():
        in_file[t.file] = in_file.get(t.file, 0) + 1
    out = {}
    for file, names in sorted(needed.items()):
        how = FETCH_CACHE if file in cached else FETCH_WHOLE if len(names) == in_file[file] else FETCH_RANGES
        out[file] = ShardFetch(file, how, ckpt.file_sizes[file], sum(ckpt.tensors[n].nbytes for n in names))
    return out


class HubFetcher:
    """Hands the copy each source shard: a cached file, a file downloaded whole into the
    cache, or a range reader. ``on_fetched(n)`` sees whole-file download progress."""

    def __init__(
        self,
        repo: HubRepo,
        ckpt: Checkpoint,
        needed: dict[str, set[str]],
        *,
        traffic: Traffic | None = None,
        on_fetched: Callable[[int], None] = lambda n: None,
    ) -> None:
        self.repo = repo
        self.ckpt = ckpt
        self.traffic = traffic if traffic is not None else Traffic()
        self.on_fetched = on_fetched
        cached = {f for f in needed if (repo.snapshot / f).is_file()}
        self.fetches = fetch_plan(ckpt, needed, cached)

    def prepare(self) -> None:
        """Offline, name every file the run needs that the cache lacks; online, fetch the
        non-weight files every stage gets (small) into the cache."""
        missing = [f.file for f in self.fetches.values() if f.how != FETCH_CACHE]
        missing += [n for n in self.ckpt.extra_files if not (self.repo.snapshot / n).is_file()]
        if self.repo.offline and missing:
            raise ReshardError(
                f"{self.repo.describe()}: offline, and the Hugging Face cache ({self.repo.storage}) lacks "
                f"{plural(len(missing), 'file')} this run needs: {', '.join(missing)}; run with network "
                f"access, or download {'it' if len(missing) == 1 else 'them'} first (`hf download`)"
            )
        fetch_files(self.repo, self.ckpt.extra_files, self.traffic)

    @property
    def download_bytes(self) -> int:
        """Bytes of the shards this run downloads whole."""
        return sum(f.size for f in self.fetches.values() if f.how == FETCH_WHOLE)

    def open(self, file: str) -> str | RangeReader:
        """The source of ``file`` for the copy: a local path or a range reader."""
        fetch = self.fetches[file]
        if fetch.how == FETCH_RANGES:
            return reader(self.repo, file, size=fetch.size, traffic=self.traffic)
        if fetch.how == FETCH_WHOLE:
            return _hf_download(self.repo, file, self.traffic, size=fetch.size, on_bytes=self.on_fetched)
        return str(self.repo.snapshot / file)


def fetch_files(repo: HubRepo, names: tuple[str, ...], traffic: Traffic | None = None) -> None:
    """Small files (tokenizer, configs, ...) into the cache, where the copy reads them."""
    listing = repo_listing(repo)
    for name in names:
        _hf_download(repo, name, traffic if traffic is not None else Traffic(), size=listing.get(name, 0))


def open_model(
    model: str, settings: HubSettings, *, traffic: Traffic | None = None
) -> tuple[Checkpoint, HubRepo | None]:
    """MODEL as the user wrote it: a local checkpoint directory, a cache repo folder
    (``models--org--name``, resolved through ``refs/``), the ``model.safetensors`` of a
    single-file checkpoint (read as its directory) or a Hub repo id. Returns the checkpoint
    and, for a repo id, the pinned repo (None for local sources)."""
    from .checkpoint import read_checkpoint

    path = Path(model)
    if path.is_file() and path.name.endswith(".safetensors"):
        path = _single_file_dir(path, model)
    if path.is_dir():
        snapshot = cache_repo_snapshot(path, settings.revision)
        if snapshot is None and settings.revision is not None:
            raise ReshardError(
                f"{model}: {param('revision')} applies to a Hub repo id or a cache repo folder "
                "(models--org--name), not to a plain directory"
            )
        return read_checkpoint(snapshot or path), None
    if is_repo_id(model):
        repo = resolve(model, settings)
        return read_hub_checkpoint(repo, traffic=traffic), repo
    raise ReshardError(
        f"{model}: not a directory, and not a Hugging Face Hub repo id (org/name); pass the checkpoint's "
        f"directory or its repo id as {param('model')}"
    )


def _single_file_dir(path: Path, model: str) -> Path:
    """The directory of ``path``, a ``.safetensors`` file named as MODEL, when that file is the
    whole checkpoint: the directory's one data file, as every reader of the directory sees it."""
    if (path.parent / INDEX_NAME).exists():
        raise ReshardError(
            f"{model}: one shard of the checkpoint in {path.parent}, whose {INDEX_NAME} lists its shards; "
            f"pass the directory {path.parent} as {param('model')}"
        )
    if path.name != SINGLE_FILE_NAME:
        raise ReshardError(
            f"{model}: a checkpoint without {INDEX_NAME} holds its tensors in {SINGLE_FILE_NAME} (the name "
            f"servers and transformers look for); rename the file, or pass a directory as {param('model')}"
        )
    return path.parent
