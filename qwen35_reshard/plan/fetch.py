"""What a plan's selected stages need from a remote source (a Hub repo, an object store), and how
it came: pure summaries."""

from __future__ import annotations

from collections.abc import Iterable

from ..source.checkpoint import Checkpoint, SourceTensor
from ..source.remote.fetch import FETCH_CACHE, FETCH_WHOLE, RemoteFetcher, ShardFetch
from .planner import Plan


def needed_by(plan: Plan) -> dict[str, set[str]]:
    """Per source shard, the tensors the plan's selected stages read from it. Pure."""
    needed: dict[str, set[str]] = {}
    for stage in plan.selected:
        needed_of(plan.checkpoint, (t.source for t in stage.tensors), needed)
    return needed


def needed_of(
    ckpt: Checkpoint, tensors: Iterable[SourceTensor], needed: dict[str, set[str]] | None = None
) -> dict[str, set[str]]:
    """``needed`` (file -> checkpoint tensors) with ``tensors`` read from their shards. An expert
    cut from a fused tensor (:mod:`.experts`) names no tensor, only its shard: the fetch then
    takes that shard's ranges, never the whole shard for a part of its fused tensor."""
    needed = {} if needed is None else needed
    for t in tensors:
        names = needed.setdefault(t.file, set())
        if t.name in ckpt.tensors:
            names.add(t.name)
    return needed


def needed_bytes(plan: Plan) -> dict[str, int]:
    """Per source shard, the data bytes the plan's selected stages read from it, each byte once:
    a tensor two stages share counts once, and an expert cut from a fused tensor counts its own
    range (it names no checkpoint tensor, so a count by name would miss it). Pure.

    Args:
        plan: the plan.

    Returns:
        File name -> bytes, for every shard a selected stage reads.
    """
    ranges: dict[str, set[tuple[int, int]]] = {}
    for stage in plan.selected:
        for t in stage.tensors:
            ranges.setdefault(t.source.file, set()).add((t.source.offset, t.source.offset + t.source.nbytes))
    return {file: _union_size(spans) for file, spans in ranges.items()}


def _union_size(spans: Iterable[tuple[int, int]]) -> int:
    """Bytes covered by ``[start, end)`` spans, overlaps counted once."""
    total, reach = 0, -1
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def stage_summary(plan: Plan, fetches: dict[str, ShardFetch]) -> list[dict]:
    """Per stage built: bytes of its tensors that come over the network and from the cache,
    and how each source shard it reads is fetched. Pure."""
    out = []
    for stage in plan.selected:
        fetched = cache = 0
        for t in stage.tensors:
            if fetches[t.source.file].how == FETCH_CACHE:
                cache += t.source.nbytes
            else:
                fetched += t.source.nbytes
        out.append(
            {
                "stage": stage.rank,
                "fetched_bytes": fetched,
                "cache_bytes": cache,
                "shards": {f: fetches[f].how for f in stage.source_files},
            }
        )
    return out


def fetch_report(plan: Plan, fetcher: RemoteFetcher) -> dict:
    """The ``fetch`` section of the summary: what this process fetched against the whole
    checkpoint, how each shard came, and per stage built the bytes fetched and from the cache."""
    traffic = fetcher.traffic
    data = needed_bytes(plan)
    return {
        "repo_id": fetcher.repo.repo_id,
        "commit": fetcher.repo.commit,
        "fetched_bytes": traffic.bytes,
        "requests": traffic.requests,
        "checkpoint_bytes": fetcher.checkpoint_bytes,
        "shard_bytes_to_fetch": sum(
            s.size if s.how == FETCH_WHOLE else data[f]
            for f, s in fetcher.fetches.items()
            if s.how != FETCH_CACHE
        ),
        "shards": {f: s.how for f, s in fetcher.fetches.items()},
        "stages": stage_summary(plan, fetcher.fetches),
    }
