"""The repo's files at the commit: their sizes and LFS sha256, kept beside the headers."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..._version import __version__
from ...errors import JSON_ERRORS, HubError
from ...format.jsonio import is_sha256
from ...format.names import TOOL_NAME
from .cache import LFS_NAME, LISTING_NAME, HubRepo, write_kept
from .http import hub_error, retrying


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
        raise HubError(
            f"{repo.describe()}: offline, and neither the kept file list ({kept}) nor a cached snapshot "
            "is there; plan it once with network access"
        )
    from huggingface_hub import HfApi

    api = HfApi(
        endpoint=repo.settings.endpoint,
        library_name=TOOL_NAME,
        library_version=__version__,
        user_agent=repo.settings.user_agent,
    )

    def fetch() -> list:
        return list(api.list_repo_tree(repo.repo_id, revision=repo.commit, token=repo.settings.token))

    try:
        entries = retrying(fetch, f"{repo.describe()}: the file list")
        listing = {e.path: e.size for e in entries if hasattr(e, "size") and e.size is not None}
    except Exception as e:
        raise hub_error(e, repo, what="the file list") from e
    lfs = {e.path: e.lfs.sha256 for e in entries if getattr(e, "lfs", None) and is_sha256(e.lfs.sha256)}
    write_kept(repo.assets / LFS_NAME, json.dumps(lfs, sort_keys=True).encode())
    write_kept(kept, json.dumps(listing, sort_keys=True).encode())
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
