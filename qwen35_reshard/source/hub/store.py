"""A Hub repo as a store (:mod:`..remote.store`): pinned to one commit, listed through
huggingface_hub (sizes and LFS sha256, kept by commit), read by ranged GETs of
``/resolve/<commit>/<file>`` (:class:`..ranged.HttpTransport`), with the Hugging Face cache as
its local copies and, with ``hf_cache``, the shared cache shards needed whole go into."""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote

from ..._version import __version__
from ...errors import JSON_ERRORS, BadInput, HubError, ReshardError
from ...format.jsonio import is_sha256
from ...format.names import COMMIT, TOOL_NAME
from ..ranged import HttpTransport, describe, redact
from ..remote.engine import Transport
from ..remote.store import RETRIES, RemoteObject, Store, Traffic, write_kept
from .cache import HubSettings, inside, read_ref
from .http import Progress, retry_status, retrying, transport_cause

log = logging.getLogger(__name__)
LISTING_NAME = "files.json"  # kept beside the headers: the repo's files and sizes at the commit
LFS_NAME = "lfs-sha256.json"  # kept with it: each LFS file's sha256, as the Hub names its blob
# Failures of the local disk while huggingface_hub writes its cache: not the Hub's.
LOCAL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)


class HubStore(Store):
    """A repo pinned to one commit (see the module docstring)."""

    def __init__(
        self, repo_id: str, revision: str, commit: str, settings: HubSettings, traffic: Traffic | None = None
    ) -> None:
        self.repo_id, self.revision, self.commit = repo_id, revision, commit
        self.settings = settings
        self.streams = settings.streams
        self.traffic = traffic if traffic is not None else Traffic()
        self._objects: dict[str, RemoteObject] | None = None

    def __repr__(self) -> str:
        return f"HubStore({self.describe()})"

    @property
    def offline(self) -> bool:
        from huggingface_hub import constants as hf

        return self.settings.offline or hf.is_offline_mode()

    has_shared_cache = True

    @property
    def shared_cache(self) -> bool:
        return self.settings.hf_cache

    @property
    def header_limit(self) -> int:
        from huggingface_hub import constants as hf

        return hf.SAFETENSORS_MAX_HEADER_LENGTH

    @property
    def endpoint(self) -> str:
        from huggingface_hub import constants as hf

        return (self.settings.endpoint or hf.ENDPOINT).rstrip("/")

    @property
    def storage(self) -> Path:
        """The repo's folder in the Hugging Face cache."""
        from huggingface_hub import constants as hf
        from huggingface_hub.file_download import repo_folder_name

        cache = Path(self.settings.cache_dir or hf.HF_HUB_CACHE).expanduser()
        return cache / repo_folder_name(repo_id=self.repo_id, repo_type="model")

    @property
    def snapshot(self) -> Path:
        return self.storage / "snapshots" / self.commit

    @property
    def folder(self) -> Path:
        """huggingface_hub's cached-assets folder for this tool, the repo and the commit."""
        from huggingface_hub.file_download import repo_folder_name
        from huggingface_hub.utils import cached_assets_path

        return cached_assets_path(
            TOOL_NAME,
            namespace=repo_folder_name(repo_id=self.repo_id, repo_type="model"),
            subfolder=self.commit,
            assets_dir=self.settings.assets_dir,
        )

    def local(self, name: str) -> Path | None:
        """The file ``name`` of the cached snapshot, or None when the cache lacks it.

        huggingface_hub links each snapshot file to ``blobs/``: one that resolves out of the
        repo's cache folder (planted, or a damaged cache) is never read.

        Raises:
            ReshardError: ``name`` (or the snapshot) is a symlink out of the cache folder.
        """
        path = self.snapshot / name
        try:
            if not path.is_file():
                return None
        except (OSError, ValueError):  # a name no filesystem holds (too long, a NUL): not cached
            return None
        if not inside(path, self.storage):
            raise BadInput(
                f"{path}: a symlink out of the cache repo folder {self.storage}; refusing to follow it"
            )
        return path

    @property
    def objects(self) -> dict[str, RemoteObject]:
        """The repo's files at the commit: kept on disk once listed (offline: the snapshot's)."""
        if self._objects is None:
            self._objects = self._kept_listing() or self._listing()
        return self._objects

    def _kept_listing(self) -> dict[str, RemoteObject] | None:
        try:
            sizes = json.loads((self.folder / LISTING_NAME).read_bytes())
            lfs = json.loads((self.folder / LFS_NAME).read_bytes())
        except (OSError, *JSON_ERRORS):  # none yet, or damaged: listed again (offline: the snapshot's)
            return None
        if not isinstance(sizes, dict) or not isinstance(lfs, dict):
            return None
        return {n: RemoteObject(s, self.commit, lfs.get(n)) for n, s in sizes.items()}

    def _listing(self) -> dict[str, RemoteObject]:
        if self.offline:
            if self.snapshot.is_dir():  # a snapshot_download: the whole repo is there
                return {
                    p.name: RemoteObject(p.stat().st_size, self.commit, _blob_sha256(p))
                    for p in self.snapshot.iterdir()
                    if p.is_file()
                }
            raise HubError(
                f"{self.describe()}: offline, and neither the kept file list ({self.folder / LISTING_NAME}) "
                "nor a cached snapshot is there; plan it once with network access"
            )
        try:
            _, objects = retrying(
                lambda: revision_info(self, self.commit), f"{self.describe()}: the file list"
            )
        except Exception as e:
            raise hub_error(e, self, what="the file list") from e
        self.keep_listing(objects)
        return objects

    def keep_listing(self, objects: dict[str, RemoteObject]) -> None:
        """Keep ``objects``, the listing at this store's commit, in its folder (where a later
        run, online or offline, reads it instead of asking again)."""
        sizes = {n: o.size for n, o in objects.items()}
        lfs = {n: o.sha256 for n, o in objects.items() if o.sha256 is not None}
        write_kept(self.folder / LFS_NAME, json.dumps(lfs, sort_keys=True).encode())
        write_kept(self.folder / LISTING_NAME, json.dumps(sizes, sort_keys=True).encode())
        self._objects = objects

    def headers(self) -> dict[str, str]:
        """The headers of every request to the Hub: the token, and the tool in the user agent."""
        from huggingface_hub.utils import build_hf_headers

        return build_hf_headers(
            token=self.settings.token,
            library_name=TOOL_NAME,
            library_version=__version__,
            user_agent=self.settings.user_agent,
        )

    def transport(self) -> Transport:
        """Checked ranged reads of ``/resolve/<commit>/<file>`` (redirects followed, the CDN
        address kept, the token for the Hub's own origin only)."""
        from huggingface_hub import get_session, hf_hub_url
        from huggingface_hub.utils import hf_raise_for_status

        return HttpTransport(
            lambda name: hf_hub_url(
                self.repo_id, name, revision=self.commit, endpoint=self.settings.endpoint
            ),
            display=self.describe(),
            session=get_session(),
            headers=self.headers(),
            raise_for_status=hf_raise_for_status,
            counter=self.traffic,
        )

    def error(self, e: BaseException, what: str) -> ReshardError:
        return hub_error(e, self, what=what)

    def download(self, name: str, on_bytes: Callable[[int], None] = lambda n: None) -> str:
        """File ``name`` whole into the Hugging Face cache (where other tools find it), through
        huggingface_hub: a retry resumes from the bytes it kept (``blobs/*.incomplete``)."""
        from huggingface_hub import hf_hub_download

        cached = self.local(name)
        if cached is not None:
            return str(cached)
        if self.offline:
            raise HubError(
                f"{self.describe()}: offline and the Hugging Face cache lacks {name}; run once with network "
                "access, or on a node whose cache has it"
            )

        def get() -> str:
            self.traffic.request()
            return hf_hub_download(
                self.repo_id,
                name,
                revision=self.commit,
                cache_dir=self.settings.cache_dir,
                endpoint=self.settings.endpoint,
                token=self.settings.token,
                user_agent=self.settings.user_agent,
                library_name=TOOL_NAME,
                library_version=__version__,
                tqdm_class=functools.partial(Progress, on_bytes),
            )

        try:
            path = retrying(get, f"{self.describe()}: {name}")
        except OSError as e:
            if e.errno not in LOCAL_ERRNOS:
                raise hub_error(e, self, what=name) from e
            raise  # the cache's disk, not the Hub: the caller names the directory
        except Exception as e:
            raise hub_error(e, self, what=name) from e
        self.traffic.add(self.objects[name].size)
        return path


def revision_info(repo: HubStore, revision: str) -> tuple[str, dict[str, RemoteObject]]:
    """The commit ``revision`` of ``repo`` names and the repo's top-level files at it (sizes,
    LFS sha256) in one request: the Hub's model info with ``blobs=true`` (what huggingface_hub's
    ``model_info(files_metadata=True)`` asks), through huggingface_hub's session and error
    mapping, without importing its ``HfApi`` (~0.06 s before the first request).

    Raises:
        Exception: huggingface_hub's error for the answer (``hf_raise_for_status``), or the
            transport's.
        HubError: an answer that names no commit.
    """
    from huggingface_hub import get_session
    from huggingface_hub.utils import hf_raise_for_status

    url = f"{repo.endpoint}/api/models/{repo.repo_id}/revision/{quote(revision, safe='')}"
    repo.traffic.request()
    answer = get_session().get(url, headers=repo.headers(), params={"blobs": True})
    hf_raise_for_status(answer)
    try:
        info = answer.json()
        commit = info["sha"]
        files = [
            (f["rfilename"], f.get("size"), (f.get("lfs") or {}).get("sha256")) for f in info["siblings"]
        ]
    except (*JSON_ERRORS, KeyError, TypeError, AttributeError):
        commit, files = None, []
    if not isinstance(commit, str) or not COMMIT.fullmatch(commit):
        raise HubError(
            f"{repo.repo_id}: the Hub's answer for revision {revision!r} names no commit with its files; "
            "check HF_ENDPOINT (a mirror that serves the Hub's API) and try again"
        )
    top = [
        (n, size, sha)
        for n, size, sha in files
        if isinstance(n, str) and "/" not in n and isinstance(size, int)
    ]
    if files and not top:  # files named, none with a size: ``blobs=true`` not understood
        raise HubError(
            f"{repo.repo_id}: the Hub's answer for revision {revision!r} gives no file sizes (asked with "
            "blobs=true); check HF_ENDPOINT (a mirror that serves the Hub's API as it is now) and try again"
        )
    return commit, {n: RemoteObject(size, commit, sha if is_sha256(sha) else None) for n, size, sha in top}


def open_hub(repo_id: str, settings: HubSettings) -> HubStore:
    """Pin ``repo_id`` at ``settings.revision`` (default ``main``) to its commit.

    Args:
        repo_id: ``org/name``.
        settings: how to reach the Hub (revision, token, endpoint, cache, offline, ...).

    Returns:
        The repo as a store, pinned to the commit.

    Raises:
        ReshardError: an unknown repo or revision, no access, the Hub unreachable: one line.

    Example:
        >>> open_hub("Qwen/Qwen3.5-35B-A3B", HubSettings()).describe()  # doctest: +SKIP
        'Qwen/Qwen3.5-35B-A3B@5b9807b3028a'
    """
    revision = settings.revision or "main"
    if COMMIT.fullmatch(revision):  # pinned already: its listing is kept, or asked for when needed
        return HubStore(repo_id, revision, revision, settings)
    probe = HubStore(repo_id, revision, "0" * 40, settings)
    # huggingface_hub falls back on the cache's ref (offline, or the Hub unreachable), which it
    # reads as it finds it: checked here first, read by no one if damaged.
    read_ref(probe.storage, revision)
    try:
        if probe.offline:
            commit, objects = _cached_revision(probe), None
        else:
            commit, objects = retrying(lambda: _resolve(probe), f"{repo_id}: revision {revision!r}")
    except Exception as e:
        raise hub_error(e, probe, what=f"revision {revision!r}") from e
    store = HubStore(repo_id, revision, commit, settings, probe.traffic)
    if objects is not None:
        store.keep_listing(objects)
    return store


def _resolve(probe: HubStore) -> tuple[str, dict[str, RemoteObject] | None]:
    """The commit ``probe.revision`` names and the listing at it, in one request; where the Hub
    cannot be reached (or answers 5xx), the cache's ref as huggingface_hub's
    ``resolve_revision`` falls back on it (and no listing: the kept one, if any, is read)."""
    try:
        commit, objects = revision_info(probe, probe.revision)
    except Exception as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        reachable = transport_cause(e) is None and not (isinstance(status, int) and status >= 500)
        cached = None if reachable or isinstance(e, ReshardError) else read_ref(probe.storage, probe.revision)
        if cached is None:
            raise
        log.warning(
            "Could not reach the Hub (%s). Using cached commit hash for '%s'.", describe(e), probe.repo_id
        )
        return cached, None
    _keep_ref(probe.storage, probe.revision, commit)
    return commit, objects


def _cached_revision(probe: HubStore) -> str:
    """Offline: the commit the cache's ref names, through huggingface_hub (its own refusal)."""
    from huggingface_hub import HfApi

    settings = probe.settings
    api = HfApi(endpoint=settings.endpoint, library_name=TOOL_NAME, library_version=__version__)
    resolved = api.resolve_revision(
        probe.repo_id, revision=probe.revision, cache_dir=settings.cache_dir, local_files_only=True
    )
    if not COMMIT.fullmatch(resolved.resolved):  # a ref changed since read_ref read it (never shown)
        raise HubError(
            f"{probe.storage}: refs/{probe.revision} is not one 40-hex commit id; the cache folder is "
            "damaged: delete that file and run again with network access"
        )
    return resolved.resolved


def _keep_ref(storage: Path, revision: str, commit: str) -> None:
    """``refs/<revision>`` of the Hugging Face cache naming ``commit``, as huggingface_hub's
    ``resolve_revision`` keeps it (best effort: a read-only cache still plans); an offline run
    and a cache repo folder given as MODEL resolve the revision there."""
    ref = storage / "refs" / revision
    try:
        if not ref.is_file() or ref.read_text() != commit:
            ref.parent.mkdir(parents=True, exist_ok=True)
            write_kept(ref, commit.encode())
    except OSError as e:
        log.warning("Ignored error while caching commit hash for %s: %s", storage.name, e)


def hub_error(e: BaseException, repo: HubStore, *, what: str) -> ReshardError:
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
    status = retry_status(e)
    if status is not None:
        return HubError(
            f"{repo.repo_id}: {what}: the Hub still answered {status} after {RETRIES} retries; try again "
            "later (a split resumes where it stopped)"
        )
    cause = transport_cause(e)
    if cause is not None:
        return HubError(
            f"{endpoint} is unreachable ({cause}) while fetching {what} of {repo.repo_id}; the "
            "Hugging Face cache could not have served it either (it lacks it): check the network or "
            "HF_ENDPOINT"
        )
    return HubError(f"{repo.repo_id}: {what}: {type(e).__name__}: {describe(e)}")


def _blob_sha256(path: Path) -> str | None:
    """The sha256 huggingface_hub names a cached LFS file's blob by (its link's target)."""
    name = Path(os.readlink(path)).name if path.is_symlink() else ""
    return name if is_sha256(name) else None
