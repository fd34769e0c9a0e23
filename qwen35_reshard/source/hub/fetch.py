"""How each source shard reaches the stages a run builds: read from the cache, or fetched by the
fetch engine (every tensor of it, or only the needed byte ranges) straight into the stage
files; with ``hf_cache``, shards needed whole go into the Hugging Face cache first."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...errors import HubError
from ...units import plural
from ..remote.engine import FetchEngine, RemoteFile, RemoteSource, streams_setting
from .cache import HubRepo
from .headers import header_bytes
from .http import Traffic, engine, hf_download
from .listing import repo_listing

if TYPE_CHECKING:
    from ..checkpoint import Checkpoint

FETCH_CACHE, FETCH_WHOLE, FETCH_RANGES = "cache", "whole", "ranges"


@dataclass(frozen=True)
class ShardFetch:
    """How one source shard reaches the stages built by this run."""

    file: str
    how: str  # FETCH_CACHE, FETCH_WHOLE (every tensor of it) or FETCH_RANGES
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
    """Hands the copy each source shard: a cached file, a remote source the fetch engine reads
    (its parts written in place into the stage files), or with ``hf_cache`` a shard needed
    whole downloaded into the cache first. ``on_fetched(n)`` sees that download's progress."""

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
        cached = {f for f in needed if repo.cached(f) is not None}
        self.fetches = fetch_plan(ckpt, needed, cached)
        self.engine: FetchEngine = engine(repo, self.traffic)
        self._sources: dict[str, RemoteSource] = {}

    def prepare(self) -> None:
        """Offline, name every file the run needs that the cache lacks; online, fetch the
        non-weight files every stage gets (small) into the cache."""
        missing = [f.file for f in self.fetches.values() if f.how != FETCH_CACHE]
        missing += [n for n in self.ckpt.extra_files if self.repo.cached(n) is None]
        if self.repo.offline and missing:
            raise HubError(
                f"{self.repo.describe()}: offline, and the Hugging Face cache ({self.repo.storage}) lacks "
                f"{plural(len(missing), 'file')} this run needs: {', '.join(missing)}; run with network "
                f"access, or download {'it' if len(missing) == 1 else 'them'} first (`hf download`)"
            )
        fetch_files(self.repo, self.ckpt.extra_files, self.traffic)

    @property
    def checkpoint_bytes(self) -> int:
        """Bytes of every file of the repo at the commit."""
        return sum(repo_listing(self.repo).values())

    @property
    def download_bytes(self) -> int:
        """Bytes of the shards this run downloads whole into the Hugging Face cache."""
        into_cache = self.repo.settings.hf_cache
        return sum(f.size for f in self.fetches.values() if f.how == FETCH_WHOLE and into_cache)

    def remote(self, file: str) -> RemoteSource | None:
        """``file`` as the fetch engine reads it (one object per file), or None when it comes
        from the Hugging Face cache."""
        fetch = self.fetches[file]
        if fetch.how == FETCH_CACHE or (fetch.how == FETCH_WHOLE and self.repo.settings.hf_cache):
            return None
        src = self._sources.get(file)
        if src is None:
            # The header planning kept: the copy and the check of a whole shard read it there.
            head = header_bytes(self.repo, file)
            src = self._sources[file] = RemoteSource(
                self.engine, RemoteFile(file, fetch.size, self.repo.commit), head
            )
        return src

    def open(self, file: str) -> str | RemoteSource:
        """The source of ``file`` for the copy: a local path or a remote source."""
        src = self.remote(file)
        if src is not None:
            return src
        if self.fetches[file].how == FETCH_WHOLE:
            return hf_download(
                self.repo, file, self.traffic, size=self.fetches[file].size, on_bytes=self.on_fetched
            )
        return str(self.repo.snapshot / file)

    def close(self) -> None:
        """Stop the engine's reads (none is left running after this returns)."""
        self.engine.close()


def fetch_files(repo: HubRepo, names: tuple[str, ...], traffic: Traffic | None = None) -> None:
    """Small files (tokenizer, configs, ...) into the cache, where the copy reads them: all at
    once (each costs round trips, not bandwidth), as many as the streams."""
    listing = repo_listing(repo)
    counted = traffic if traffic is not None else Traffic()
    with ThreadPoolExecutor(max_workers=streams_setting(repo.settings.streams)) as pool:
        list(pool.map(lambda name: hf_download(repo, name, counted, size=listing.get(name, 0)), names))
