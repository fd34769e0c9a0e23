"""Where a Hub repo lives on this machine: its settings, the commit it is pinned to, its paths
in huggingface_hub's cache and cached-assets folder, and the files this tool keeps there."""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

from ...errors import BadInput, param
from ...format.names import TOOL_NAME, partial_name, process_token
from ...format.paths import is_plain_name

LISTING_NAME = "files.json"  # kept beside the headers: the repo's files and sizes at the commit
LFS_NAME = "lfs-sha256.json"  # kept with it: each LFS file's sha256, as the Hub names its blob
HEADER_SUFFIX = ".header"


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
    # Appended to every request's User-Agent (e.g. "qwen35-stages/pp1"): a server's logs and
    # a test tell the callers apart.
    user_agent: str | None = None
    # Reads in flight at once (None: QWEN35_RESHARD_STREAMS, else the engine's default).
    streams: int | None = None
    # Shards a stage needs whole go through huggingface_hub into its cache (reused by other
    # tools, at twice the disk), instead of straight into the stage.
    hf_cache: bool = False


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

    def cached(self, name: str) -> Path | None:
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


_kept_lock = threading.Lock()  # this process's threads share its temporary names


def write_kept(path: Path, data: bytes) -> None:
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


def read_ref(repo_folder: Path, revision: str) -> str | None:
    """The commit that ``refs/<revision>`` of a Hugging Face cache repo folder names, or None
    when it has no such ref.

    A ref is one 40-hex commit id (huggingface_hub writes nothing else there); anything else
    is refused unread and unshown: the commit becomes a path under ``snapshots/``, and the
    message must not print what a damaged or planted file holds.

    Raises:
        ReshardError: ``revision`` is no ref name, the ref resolves out of the repo folder,
            or it holds anything but a commit id.
    """
    parts = Path(revision).parts
    if Path(revision).is_absolute() or not parts or ".." in parts or not is_plain_name(parts[-1]):
        raise BadInput(f"{param('revision', revision)} is not a branch, tag or commit of {repo_folder}")
    ref = repo_folder / "refs" / revision
    try:
        if not ref.is_file():
            return None
        if not inside(ref, repo_folder):
            raise BadInput(
                f"{ref}: a symlink out of the cache repo folder {repo_folder}; refusing to follow it"
            )
        with open(ref, "rb") as f:
            raw = f.read(_REF_READ)
    except OSError as e:
        raise BadInput(f"{ref}: cannot read ({e.strerror})") from e
    if not _REF.fullmatch(raw):
        raise BadInput(
            f"{ref}: not one 40-hex commit id, as a Hugging Face cache ref holds; the cache folder is "
            f"damaged: delete that file and download again, or pass a snapshot directory "
            f"{repo_folder / 'snapshots'}/<commit>"
        )
    return raw[:40].decode("ascii")


_REF = re.compile(rb"[0-9a-f]{40}\n?")
_REF_READ = 42  # one byte past the longest ref (40 hex digits and a newline): a longer file is none


def inside(path: Path, folder: Path) -> bool:
    """Whether ``path``, symlinks resolved, is inside ``folder`` (symlinks resolved too)."""
    return Path(os.path.realpath(path)).is_relative_to(os.path.realpath(folder))
