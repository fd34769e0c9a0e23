"""MODEL as the user wrote it: a local checkpoint directory, a cache repo folder, a single
``model.safetensors``, a Hub repo id, or an object-storage URI (``s3://bucket/prefix``)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import BadInput, param
from ..format.names import CACHE_REPO_PREFIX, COMMIT, INDEX_NAME, SINGLE_FILE_NAME
from .hub.cache import HubSettings, inside, read_ref
from .hub.store import open_hub
from .remote.checkpoint import read_remote_checkpoint
from .remote.store import Store
from .s3.store import is_s3_uri, open_s3

if TYPE_CHECKING:
    from .checkpoint import Checkpoint

REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


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
        commit = read_ref(path, rev)
        if commit is None:
            known = sorted(p.name for p in (path / "refs").glob("*")) if (path / "refs").is_dir() else []
            raise BadInput(
                f"{path}: a Hugging Face cache repo folder with no refs/{rev}"
                + (f" (it has {', '.join(known)})" if known else "")
                + f"; pass a revision it has, or the snapshot directory {path / 'snapshots'}/<commit>"
            )
    snapshot = path / "snapshots" / commit
    if not snapshot.is_dir():
        raise BadInput(f"{path}: refs/{rev} names commit {commit} but snapshots/{commit} is missing")
    if not inside(snapshot, path / "snapshots"):
        raise BadInput(f"{snapshot}: a symlink out of the cache repo folder {path}; refusing to follow it")
    return snapshot


def open_model(model: str, settings: HubSettings) -> tuple[Checkpoint, Store | None]:
    """MODEL as the user wrote it: a local checkpoint directory, a cache repo folder
    (``models--org--name``, resolved through ``refs/``), the ``model.safetensors`` of a
    single-file checkpoint (read as its directory), a Hub repo id or an ``s3://bucket/prefix``
    URI. Returns the checkpoint and, for a repo id or a URI, its store (the pinned repo or the
    listed location; None for local sources), which counts the run's requests and bytes."""
    from .checkpoint import read_checkpoint

    if is_s3_uri(model):
        if settings.revision is not None:
            raise BadInput(
                f"{model}: {param('revision')} applies to a Hub repo id; an object-storage URI is read as "
                "its objects are now"
            )
        store: Store = open_s3(model, streams=settings.streams, user_agent=settings.user_agent)
        return read_remote_checkpoint(store), store

    path = Path(model)
    if path.is_file() and path.name.endswith(".safetensors"):
        path = _single_file_dir(path, model)
    if path.is_dir():
        snapshot = cache_repo_snapshot(path, settings.revision)
        if snapshot is None and settings.revision is not None:
            raise BadInput(
                f"{model}: {param('revision')} applies to a Hub repo id or a cache repo folder "
                "(models--org--name), not to a plain directory"
            )
        return read_checkpoint(snapshot or path), None
    if is_repo_id(model):
        store = open_hub(model, settings)
        return read_remote_checkpoint(store), store
    raise BadInput(
        f"{model}: not a directory, a Hugging Face Hub repo id (org/name) or an s3://bucket/prefix URI; "
        f"pass the checkpoint's directory, its repo id or its URI as {param('model')}"
    )


def _single_file_dir(path: Path, model: str) -> Path:
    """The directory of ``path``, a ``.safetensors`` file named as MODEL, when that file is the
    whole checkpoint: the directory's one data file, as every reader of the directory sees it."""
    if (path.parent / INDEX_NAME).exists():
        raise BadInput(
            f"{model}: one shard of the checkpoint in {path.parent}, whose {INDEX_NAME} lists its shards; "
            f"pass the directory {path.parent} as {param('model')}"
        )
    if path.name != SINGLE_FILE_NAME:
        raise BadInput(
            f"{model}: a checkpoint without {INDEX_NAME} holds its tensors in {SINGLE_FILE_NAME} (the name "
            f"servers and transformers look for); rename the file, or pass a directory as {param('model')}"
        )
    return path.parent
