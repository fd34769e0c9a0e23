"""The stage cache's entries: list them, check them, remove them (``qwen35-reshard cache``).

The stage cache (:func:`~.unsplit.stage_cache_root`) holds one run directory per source,
revision and split settings, each with the stages the servers of this node built there:

    CACHE/models--org--name/<commit>/<runtime>-pp<N>-<partition>/pp<rank>/   (a Hub repo)
    CACHE/local/<fingerprint>/<runtime>-pp<N>-<partition>/pp<rank>/          (a local directory, copied)
    CACHE/s3/<bucket>/<prefix>/<listing>/<runtime>-pp<N>-<partition>/pp<rank>/   (object storage)

Under expert parallelism the key names the EP layout too (``...-ep<E>-n<nodes>``) and an entry is
a node's directory of its stage (``pp<rank>-node<k>``, ``node<k>`` without PP).

An entry is one stage directory. What a server holds (it records itself while it runs:
:func:`~..write.claims.in_use`), or a start builds (the stage's claim), is never removed.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import takewhile
from pathlib import Path

from ..errors import BadInput, param
from ..format.holder import Owner
from ..format.names import (
    CACHE_REPO_PREFIX,
    CLAIM,
    COMMIT,
    LAST_USED,
    LOCK,
    STAGE_MANIFEST,
    is_split_dirname,
    node_dir_of,
    stage_dir_rank,
)
from ..stage.manifest import stage_is_complete
from ..verify import verify
from ..verify.report import VerifyReport
from ..write import claims
from .unsplit import LOCAL_DIRNAME, S3_DIRNAME, stage_cache_root

# What :func:`~.unsplit.cache_key` makes: runtime, pp, partition, and under expert parallelism
# the EP size and nodes, redundant experts and the initial location's digest.
CACHE_KEY = re.compile(r"[a-z]+-pp[0-9]+(-[0-9]+)+(-ep[0-9]+-n[0-9]+(-r[0-9]+)?(-loc[0-9a-f]+)?)?")


@dataclass(frozen=True)
class CacheEntry:
    """One stage of the stage cache: which model, revision and split settings it is of, its
    size on disk, when a server last started on it (else when it was written), whether it is
    complete (:func:`~..stage.manifest.stage_is_complete`: what a start opens without
    building), and the live servers (or builds) that hold it."""

    path: Path
    model: str  # a repo id, an s3:// URI, or ``local/<fingerprint>`` for a local directory's copy
    revision: str  # the commit (Hub), the listing's identity (s3), the source's fingerprint (local)
    key: str  # <runtime>-pp<N>-<partition>
    stage: int
    size: int  # bytes on disk
    last_used: float  # seconds since the epoch
    complete: bool
    users: tuple[Owner | None, ...] = field(default=())

    @property
    def runtime(self) -> str:
        return self.key.split("-", 1)[0]

    @property
    def partition(self) -> tuple[int, ...]:
        return tuple(int(n) for n in takewhile(str.isdigit, self.key.split("-")[2:]))

    @property
    def node(self) -> int | None:
        """The node of the stage, for a node's directory (expert parallelism); else None."""
        found = node_dir_of(self.path)
        return None if found is None else found[1]

    def to_dict(self) -> dict:
        """The entry as JSON-ready data."""
        return {
            "path": str(self.path),
            "model": self.model,
            "revision": self.revision,
            "runtime": self.runtime,
            "partition": list(self.partition),
            "stage": self.stage,
            "node": self.node,
            "size": self.size,
            "last_used": self.last_used,
            "complete": self.complete,
            "held_by": [u.describe() if u is not None else "unknown" for u in self.users],
        }


def cache_entries(cache: str | os.PathLike[str] | None = None) -> list[CacheEntry]:
    """Every stage in the stage cache, by model, revision, settings and stage.

    Args:
        cache: the stage cache (default: ``QWEN35_RESHARD_STAGE_CACHE``, else
            ``$HF_HOME/qwen35-stages``).

    Returns:
        The entries; none when the cache does not exist.

    Raises:
        BadInput: ``cache`` is not a directory.

    Example:
        >>> from qwen35_reshard.servers.stagecache import cache_entries
        >>> cache_entries(OUT)
        []
    """
    root = _root(cache)
    if not root.exists():
        return []
    now = time.time_ns()
    found = []
    for model_dir in sorted(root.iterdir()):
        if model_dir.name == LOCAL_DIRNAME:
            runs = [(f"{LOCAL_DIRNAME}/{d.name}", d.name, d) for d in _dirs(model_dir)]
        elif model_dir.name.startswith(CACHE_REPO_PREFIX):
            model = model_dir.name[len(CACHE_REPO_PREFIX) :].replace("--", "/")
            runs = [(model, d.name, d) for d in _dirs(model_dir) if COMMIT.fullmatch(d.name)]
        elif model_dir.name == S3_DIRNAME:
            runs = _s3_runs(model_dir)
        else:
            continue
        for model, revision, revision_dir in runs:
            for run in _dirs(revision_dir):
                for stage_dir in _dirs(run):
                    node = node_dir_of(stage_dir)
                    rank = stage_dir_rank(stage_dir) if node is None else node[0]
                    if rank is not None:
                        found.append(_entry(stage_dir, model, revision, run.name, rank, now))
    return found


def verify_cache(
    cache: str | os.PathLike[str] | None = None, *, models: Sequence[str] = ()
) -> list[tuple[CacheEntry, VerifyReport]]:
    """Check each entry (of ``models``, or all) as ``verify`` checks a stage: its files, and
    every tensor's bytes against the digest its manifest records (xxh3-128; sha256 in stage-v1).

    Args:
        cache: the stage cache (default as :func:`cache_entries`).
        models: only these models' entries (repo ids, or ``local/<fingerprint>``).

    Returns:
        Each entry with verify's report (its findings: data, not raised).

    Raises:
        BadInput: ``cache`` is not a directory, or no entry is of a model of ``models``.

    Example:
        >>> from qwen35_reshard.servers.stagecache import verify_cache
        >>> verify_cache(OUT)
        []
    """
    entries = _of_models(cache_entries(cache), models)
    return [(e, verify(e.path)) for e in entries]


@dataclass(frozen=True)
class Removal:
    """What :func:`remove_entries` did (or would do, ``dry_run``): the entries removed, the
    bytes freed, and the entries it was asked to remove but refused (held by a live server
    or build)."""

    removed: list[CacheEntry]
    refused: list[CacheEntry]
    dry_run: bool

    @property
    def freed(self) -> int:
        return sum(e.size for e in self.removed)

    def to_dict(self) -> dict:
        """The removal as JSON-ready data."""
        return {
            "dry_run": self.dry_run,
            "freed": self.freed,
            "removed": [e.to_dict() for e in self.removed],
            "refused": [e.to_dict() for e in self.refused],
        }


def remove_entries(
    cache: str | os.PathLike[str] | None = None,
    *,
    models: Sequence[str] = (),
    older_than: float | None = None,
    keep_newest: bool = False,
    everything: bool = False,
    dry_run: bool = False,
) -> Removal:
    """Remove the entries of ``models``, unused for ``older_than`` seconds, or all but the newest
    revision of each model (``keep_newest``); the criteria given must all hold. A stage a running
    server holds (or a start is building) is refused, whatever was asked.

    Args:
        cache: the stage cache (default as :func:`cache_entries`).
        models: only these models' entries (repo ids, or ``local/<fingerprint>``).
        older_than: only entries no server started on for this many seconds.
        keep_newest: keep every entry of each model's most recently used revision.
        everything: no criterion: every entry (refused unless asked, as no criterion is).
        dry_run: say what would be removed; remove nothing.

    Returns:
        A :class:`Removal`: removed, refused, bytes freed.

    Raises:
        BadInput: no criterion and not ``everything``, or no entry is of a model of ``models``.
        OSError: an entry could not be deleted.

    Example:
        >>> from qwen35_reshard.servers.stagecache import remove_entries
        >>> remove_entries(OUT, everything=True).removed
        []
    """
    if not (models or older_than is not None or keep_newest or everything):
        raise BadInput(
            f"say which entries to remove: {param('models')}, {param('older_than')}, {param('keep_newest')} "
            f"or {param('everything')}"
        )
    every = cache_entries(cache)
    entries = _of_models(every, models)
    if older_than is not None:
        entries = [e for e in entries if e.last_used < time.time() - older_than]
    if keep_newest:
        newest: dict[str, tuple[float, str]] = {}
        for e in every:
            newest[e.model] = max(newest.get(e.model, (0.0, "")), (e.last_used, e.revision))
        entries = [e for e in entries if e.revision != newest[e.model][1]]
    root = _root(cache)
    now = _server_now(root) if entries and not dry_run else time.time_ns()
    removed, refused = [], []
    for e in entries:
        users = tuple(claims.users(e.path, now))
        if not users and not dry_run:
            users = _remove_unused(e.path, now)
        if users:
            refused.append(CacheEntry(**{**e.__dict__, "users": users}))
            continue
        if not dry_run:
            _prune_empty(e.path.parent, root)
        removed.append(e)
    return Removal(removed, refused, dry_run)


def _remove_unused(stage_dir: Path, now: int) -> tuple[Owner | None, ...]:
    """Delete ``stage_dir`` unless it is used; returns its users (then nothing is deleted).

    Under the stage's claim, the one a build takes (a build waits for it), the users are
    looked for once more just before deleting: a server records its use before it opens the
    stage (:func:`~.unsplit._open_in_use`), so one that opened it is seen here."""
    claim = stage_dir / CLAIM
    held = claims.try_take(claim)
    if held is not None:
        return (held.owner,)
    try:
        users = tuple(claims.users(stage_dir, now))
        if not users:
            shutil.rmtree(stage_dir)
    finally:
        claims.release(claim)
    return users


def _root(cache: str | os.PathLike[str] | None) -> Path:
    root = Path(cache) if cache is not None else stage_cache_root()
    if root.exists() and not root.is_dir():
        raise BadInput(f"the stage cache {root} is not a directory (QWEN35_RESHARD_STAGE_CACHE)")
    return root


def _dirs(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_dir() and not p.is_symlink())


def _entry(stage_dir: Path, model: str, revision: str, key: str, rank: int, now: int) -> CacheEntry:
    size, newest = 0, 0.0
    for p in stage_dir.iterdir():
        st = p.lstat()
        size += st.st_blocks * 512
        if p.name in (LAST_USED, STAGE_MANIFEST):
            newest = max(newest, st.st_mtime)
    return CacheEntry(
        path=stage_dir,
        model=model,
        revision=revision,
        key=key,
        stage=rank,
        size=size,
        last_used=newest or stage_dir.stat().st_mtime,
        complete=stage_is_complete(stage_dir),
        users=tuple(claims.users(stage_dir, now)),
    )


def _s3_runs(s3: Path) -> list[tuple[str, str, Path]]:
    """``(model, revision, revision directory)`` of each object-storage source under ``s3``
    (``s3/<bucket>/<prefix>/<listing>/<key>``; the prefix may have several parts, ``_`` for
    none): the URI, and the listing's identity."""
    found = set()
    for key in s3.rglob("*-pp*"):
        if CACHE_KEY.fullmatch(key.name) and key.is_dir() and len(key.relative_to(s3).parts) >= 4:
            revision = key.parent
            where = revision.parent.relative_to(s3).as_posix()
            found.add((f"s3://{where.removesuffix('/_')}", revision.name, revision))
    return sorted(found)


def _of_models(entries: list[CacheEntry], models: Sequence[str]) -> list[CacheEntry]:
    if not models:
        return entries
    unknown = sorted(set(models) - {e.model for e in entries})
    if unknown:
        held = sorted({e.model for e in entries})
        raise BadInput(
            f"{param('models')}: the stage cache holds no entry of {unknown[0]}"
            f"{' (it holds ' + ', '.join(held) + ')' if held else ' (it is empty)'}"
        )
    return [e for e in entries if e.model in models]


def _server_now(root: Path) -> int:
    """The stage cache's file server's clock, now: how a record of another host is judged."""
    probe = root / claims.temp_name(".qwen35-stages-now")
    probe.touch()
    try:
        return probe.stat().st_mtime_ns
    finally:
        probe.unlink()


def _prune_empty(run: Path, root: Path) -> None:
    """Delete the run directory once no stage is left in it (its own records with it), then
    its revision's and model's directories once empty."""
    if any(is_split_dirname(p.name) or p.name == LOCK for p in run.iterdir()):
        return  # stages left, or a start deciding what to build there
    shutil.rmtree(run)
    for parent in (run.parent, run.parent.parent):
        if parent == root or any(parent.iterdir()):
            return
        parent.rmdir()
