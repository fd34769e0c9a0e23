"""How each source shard of a store reaches the stages a run builds: read from a local copy
(``cache``), or fetched by the fetch engine straight into the stage files, every tensor of it
(``whole``) or only the needed byte ranges (``ranges``). A store that keeps a cache other tools
share (the Hub's, with ``hf_cache``) may take a shard needed whole into it first."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...errors import RemoteError
from ...units import plural
from .checkpoint import fetch_small_files, header_bytes, missing_offline
from .engine import FetchEngine, RemoteSource
from .store import Store, Traffic

if TYPE_CHECKING:
    from ..checkpoint import Checkpoint

FETCH_CACHE, FETCH_WHOLE, FETCH_RANGES = "cache", "whole", "ranges"


@dataclass(frozen=True)
class ShardFetch:
    """How one source shard reaches the stages built by this run."""

    file: str
    how: str  # FETCH_CACHE, FETCH_WHOLE (every tensor of it) or FETCH_RANGES
    size: int  # the file's size


def fetch_plan(ckpt: Checkpoint, needed: dict[str, set[str]], cached: set[str]) -> dict[str, ShardFetch]:
    """Per shard of ``needed``: read from a local copy (``cached``), fetched whole (every tensor
    of it is needed), or only the needed ranges. Pure.

    Example:
        >>> fetch_plan(ckpt, {"model.safetensors": {"lm_head.weight"}}, set())  # doctest: +SKIP
    """
    in_file: dict[str, int] = {}
    for t in ckpt.tensors.values():
        in_file[t.file] = in_file.get(t.file, 0) + 1
    out = {}
    for file, names in sorted(needed.items()):
        how = FETCH_CACHE if file in cached else FETCH_WHOLE if len(names) == in_file[file] else FETCH_RANGES
        out[file] = ShardFetch(file, how, ckpt.file_sizes[file])
    return out


class RemoteFetcher:
    """Hands the copy each source shard of a store: a local path, or a remote source the fetch
    engine reads (its parts written in place into the stage files). ``on_fetched(n)`` sees the
    progress of a whole shard downloaded into the store's shared cache.

    Args:
        store: the store the checkpoint was read from.
        ckpt: its checkpoint.
        needed: per source shard, the tensors wanted from it.
        on_fetched: told the bytes of a download into a shared cache as they arrive.

    Example:
        >>> fetcher = RemoteFetcher(store, ckpt, {ckpt.files[0]: set()})  # doctest: +SKIP
        >>> fetcher.prepare(); src = fetcher.open(ckpt.files[0]); fetcher.close()  # doctest: +SKIP
    """

    def __init__(
        self,
        store: Store,
        ckpt: Checkpoint,
        needed: dict[str, set[str]],
        *,
        on_fetched: Callable[[int], None] = lambda n: None,
    ) -> None:
        self.repo = store
        self.ckpt = ckpt
        self.on_fetched = on_fetched
        cached = {f for f in needed if store.local(f) is not None}
        self.fetches = fetch_plan(ckpt, needed, cached)
        self.engine: FetchEngine = store.engine()
        self._sources: dict[str, RemoteSource] = {}

    @property
    def traffic(self) -> Traffic:
        return self.repo.traffic

    def prepare(self) -> None:
        """Offline, name every file the run needs that is neither local nor kept; online, fetch
        the non-weight files every stage gets (small) into the store's folder."""
        store = self.repo
        if store.offline:
            missing = [f.file for f in self.fetches.values() if f.how != FETCH_CACHE]
            missing += missing_offline(store, self.ckpt.extra_files)
            if missing:
                lacks = plural(len(missing), "file")
                raise RemoteError(
                    f"{store.describe()}: offline, and what is cached here lacks {lacks} "
                    f"this run needs: {', '.join(missing)}; run with network access, or download "
                    f"{'it' if len(missing) == 1 else 'them'} first (`hf download`)"
                )
        fetch_small_files(store, self.ckpt.extra_files, self.engine)

    @property
    def checkpoint_bytes(self) -> int:
        """Bytes of every object of the store's version."""
        return sum(o.size for o in self.repo.objects.values())

    @property
    def download_bytes(self) -> int:
        """Bytes of the shards this run downloads whole into the store's shared cache."""
        if not self.repo.shared_cache:
            return 0
        return sum(f.size for f in self.fetches.values() if f.how == FETCH_WHOLE)

    def remote(self, file: str) -> RemoteSource | None:
        """``file`` as the fetch engine reads it, or None when it is read from a local path."""
        fetch = self.fetches[file]
        if fetch.how == FETCH_CACHE or (fetch.how == FETCH_WHOLE and self.repo.shared_cache):
            return None
        src = self._sources.get(file)
        if src is None:
            # The header planning kept: the copy and the check of a whole shard read it there.
            head = header_bytes(self.repo, file, self.engine)
            src = self._sources[file] = RemoteSource(self.engine, self.repo.remote(file), head)
        return src

    def open(self, file: str) -> str | RemoteSource:
        """The source of ``file`` for the copy: a local path or a remote source."""
        src = self.remote(file)
        if src is not None:
            return src
        local = self.repo.local(file)
        if local is not None:
            return str(local)
        return self.repo.download(file, self.on_fetched)

    def close(self) -> None:
        """Stop the engine's reads (none is left running after this returns)."""
        self.engine.close()
