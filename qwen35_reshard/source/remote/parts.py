"""Byte ranges to fetch, cut into requests: near-adjacent runs coalesced, long ones split. Pure.

A request costs a wait (the link's latency) before its first byte; a part of it costs time at
the stream's rate. Reading a gap between two runs instead of asking again is worth it while
the gap takes less time than the wait (``gap < rate x latency``), and a run much longer than
the others is cut so that every stream has work until the end (the last part to finish bounds
the time).
"""

from __future__ import annotations

from typing import NamedTuple

# Gaps read through rather than asked around: rate x latency of a wide-area link, one stream
# at ~35 MB/s with a 30 ms wait per request (the Hub's storage bridge streams faster, a
# 10 MB/s, 30 ms link slower: ~1 MB is the bytes one request's wait is worth at either end).
# Gaps between stages' tensors are whole layers (far larger): this joins small unneeded
# tensors (norms, biases) between needed ones, never a layer.
GAP_BYTES = 1 << 20
# Parts of a long run: about PARTS_PER_STREAM per stream when the bytes allow it, so that
# streams finishing at different rates still end together (the last part bounds the time);
# at least MIN_PART_BYTES (a request's wait is then <= 7 % of a part's time at 10 MB/s and
# 30 ms, 6 % at 50 MB/s and 5 ms), at most MAX_PART_BYTES (a stage of 200 GB in ~3,000
# requests; at the Hub's ~0.4 GB/s per stream a 64 MiB part takes ~0.17 s, and the other
# streams' transfers cover one stream's wait).
MIN_PART_BYTES = 4 << 20
MAX_PART_BYTES = 64 << 20
PARTS_PER_STREAM = 4
# The last parts in the queue are cut smaller (to about the bytes left after them over the
# streams, no less than TAIL_PART_BYTES), so that the streams run out of work together: with
# parts all of one size, each stream's last part ends up to a part's time apart (0.4 s for a
# 4 MiB part at 10 MB/s: a quarter of a 100 MB stage's fetch, measured on the paced Hub), the
# link idling meanwhile. 1 MiB: a request's wait (30 ms at 10 MB/s) is then a quarter of its
# part's time, paid on a few parts only (see docs/development/benchmarks-log.md).
TAIL_PART_BYTES = 1 << 20


class Part(NamedTuple):
    """One request: bytes ``[start, end)`` of one file."""

    file: str
    start: int
    end: int


def coalesce(runs: list[tuple[int, int]], gap: int = GAP_BYTES) -> list[tuple[int, int]]:
    """``runs`` (``[begin, end)``, any order, may touch or overlap) joined where at most
    ``gap`` bytes lie between two of them.

    Args:
        runs: byte ranges of one file.
        gap: the largest gap read through.

    Returns:
        Sorted, disjoint ranges covering every run.

    Example:
        >>> coalesce([(0, 10), (12, 20), (5000, 6000)], gap=100)
        [(0, 20), (5000, 6000)]
    """
    out: list[list[int]] = []
    for a, b in sorted(r for r in runs if r[1] > r[0]):
        if out and a - out[-1][1] <= gap:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def part_size(total: int, streams: int) -> int:
    """Bytes per part for ``total`` bytes over ``streams`` streams: about ``PARTS_PER_STREAM``
    parts per stream, within ``[MIN_PART_BYTES, MAX_PART_BYTES]``.

    Args:
        total: bytes to fetch in all.
        streams: requests in flight at once.

    Returns:
        The part size in bytes.

    Example:
        >>> part_size(10**9, 8) == 31_250_000
        True
    """
    return max(MIN_PART_BYTES, min(MAX_PART_BYTES, -(-total // (streams * PARTS_PER_STREAM))))


def split(file: str, runs: list[tuple[int, int]], size: int) -> list[Part]:
    """``runs`` of ``file`` as parts of at most ``size`` bytes, cut evenly within each run.

    Args:
        file: the file's name.
        runs: sorted, disjoint byte ranges (see :func:`coalesce`).
        size: the largest part.

    Returns:
        The parts in offset order; together they cover exactly ``runs``.

    Example:
        >>> split("a", [(0, 10)], 4)
        [Part(file='a', start=0, end=3), Part(file='a', start=3, end=6), Part(file='a', start=6, end=10)]
    """
    parts = []
    for a, b in runs:
        n = -(-(b - a) // size)
        cuts = [a + (b - a) * i // n for i in range(n + 1)]
        parts += [Part(file, x, y) for x, y in zip(cuts, cuts[1:], strict=False)]
    return parts


def plan_parts(runs: dict[str, list[tuple[int, int]]], streams: int) -> dict[str, list[Part]]:
    """The requests fetching ``runs`` (per file, in the caller's order of files) over ``streams``
    streams: each file's runs coalesced across small gaps, then split into parts sized for the
    bytes of all the files together.

    Args:
        runs: per file, the byte ranges needed.
        streams: requests in flight at once.

    Returns:
        Per file (same order), its parts in offset order.

    Example:
        >>> plan_parts({"a": [(0, 100), (150, 300)]}, 8)
        {'a': [Part(file='a', start=0, end=300)]}
    """
    joined = {f: coalesce(r) for f, r in runs.items()}
    size = part_size(sum(b - a for r in joined.values() for a, b in r), streams)
    return even_tail({f: split(f, r, size) for f, r in joined.items()}, streams)


def even_tail(parts: dict[str, list[Part]], streams: int) -> dict[str, list[Part]]:
    """``parts`` (per file, in the order queued) with each part near the end of the queue cut
    into pieces of about the bytes from its start to the end over ``streams`` (at least
    :data:`TAIL_PART_BYTES`): guided self-scheduling, so that every stream has work until the
    last bytes, whose parts are small. The bytes covered are the same.

    Args:
        parts: per file, its parts in the order the engine takes them.
        streams: requests in flight at once.

    Returns:
        The same files in the same order, the tail's parts cut smaller.

    Example:
        >>> [p.end - p.start for p in even_tail({"a": [Part("a", 0, 8 << 20)]}, 4)["a"]]
        [2097152, 2097152, 2097152, 2097152]
    """
    left = sum(p.end - p.start for ps in parts.values() for p in ps)
    out: dict[str, list[Part]] = {}
    for file, ps in parts.items():
        out[file] = []
        for p in ps:
            target = max(TAIL_PART_BYTES, -(-left // streams))
            left -= p.end - p.start
            out[file] += split(file, [(p.start, p.end)], target) if p.end - p.start > target else [p]
    return out
