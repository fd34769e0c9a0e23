"""Byte ranges into requests (``source.remote.parts``): coalescing and splitting, pure."""

from __future__ import annotations

import heapq
import random

import pytest

from qwen35_reshard.source.remote.parts import (
    GAP_BYTES,
    MAX_PART_BYTES,
    MIN_PART_BYTES,
    TAIL_PART_BYTES,
    Part,
    coalesce,
    even_tail,
    part_size,
    plan_parts,
    split,
)


def test_gaps_up_to_the_threshold_are_read_through_larger_ones_are_not():
    assert coalesce([(0, 10), (10 + GAP_BYTES, 20 + GAP_BYTES)]) == [(0, 20 + GAP_BYTES)]
    assert coalesce([(0, 10), (11 + GAP_BYTES, 20 + GAP_BYTES)]) == [
        (0, 10),
        (11 + GAP_BYTES, 20 + GAP_BYTES),
    ]


def test_coalesce_sorts_merges_overlaps_and_drops_empty_runs():
    assert coalesce([(50, 60), (0, 10), (5, 20), (30, 30)], gap=0) == [(0, 20), (50, 60)]


@pytest.mark.parametrize("seed", range(20))
def test_split_covers_exactly_the_runs_within_the_size(seed):
    rng = random.Random(seed)
    runs, at = [], 0
    for _ in range(rng.randint(1, 6)):
        at += rng.randint(0, 1000)
        n = rng.randint(1, 5000)
        runs.append((at, at + n))
        at += n
    size = rng.randint(1, 700)
    parts = split("f", runs, size)
    assert all(p.file == "f" and 0 < p.end - p.start <= size for p in parts)
    covered = sorted((p.start, p.end) for p in parts)
    assert coalesce(covered, gap=0) == coalesce(runs, gap=0)
    assert sum(p.end - p.start for p in parts) == sum(b - a for a, b in runs)  # no overlap


def test_split_cuts_evenly():
    sizes = [p.end - p.start for p in split("f", [(0, 100)], 30)]
    assert len(sizes) == 4 and max(sizes) - min(sizes) <= 1


def test_part_size_gives_every_stream_several_parts_within_bounds():
    assert part_size(1, 8) == MIN_PART_BYTES
    assert part_size(10**12, 8) == MAX_PART_BYTES
    assert part_size(2 * 10**9, 16) == -(-2 * 10**9 // 64)


def test_plan_parts_sizes_parts_for_all_files_together():
    big = 40 * MIN_PART_BYTES
    parts = plan_parts({"a": [(0, big)], "b": [(0, 100), (200, 300)]}, 8)
    assert list(parts) == ["a", "b"]
    assert parts["b"] == [Part("b", 0, 300)]  # one request across a 100-byte gap
    sizes = {p.end - p.start for p in parts["a"]}
    assert max(sizes) <= part_size(big + 300, 8) and len(parts["a"]) >= 8


def finish_spread(parts: list[Part], streams: int, rate: float = 10e6, wait: float = 0.03) -> float:
    """Seconds between the first and the last stream running out of work, the engine's streams
    taking ``parts`` in order (each costs ``wait`` then its bytes at ``rate``)."""
    free = [0.0] * streams
    for p in parts:
        heapq.heappush(free, heapq.heappop(free) + wait + (p.end - p.start) / rate)
    return max(free) - min(free)


def test_the_queues_last_parts_are_small_so_the_streams_end_together():
    # One node's stage of the paced benchmark (~104 MB over 8 streams): 4 MiB parts left the
    # link idle for up to a part's time (0.4 s at 10 MB/s) while the last parts finished.
    total, streams = 104_000_000, 8
    before = split("a", [(0, total)], part_size(total, streams))
    parts = plan_parts({"a": [(0, total)]}, streams)["a"]
    sizes = [p.end - p.start for p in parts]
    assert sizes[0] == before[0].end - before[0].start  # the bulk as before
    assert all(TAIL_PART_BYTES // 2 <= n <= 2 * TAIL_PART_BYTES for n in sizes[-streams:])
    assert finish_spread(before, streams) > 0.4
    assert finish_spread(parts, streams) <= TAIL_PART_BYTES / 10e6 + 0.03


@pytest.mark.parametrize("seed", range(10))
def test_even_tail_covers_the_same_bytes_in_the_same_order(seed):
    rng = random.Random(seed)
    parts: dict[str, list[Part]] = {}
    for f in "abcd"[: rng.randint(1, 4)]:
        at, ps = 0, []
        for _ in range(rng.randint(1, 5)):
            at += rng.randint(0, 3 << 20)
            n = rng.randint(1, 6 << 20)
            ps.append(Part(f, at, at + n))
            at += n
        parts[f] = ps
    out = even_tail(parts, rng.randint(1, 16))
    assert list(out) == list(parts)
    for f, ps in parts.items():
        spans = [(p.start, p.end) for p in out[f]]
        assert coalesce(spans, gap=0) == coalesce([(p.start, p.end) for p in ps], gap=0)
        assert [p.start for p in out[f]] == sorted(p.start for p in out[f])  # offset order kept
        small = {(p.start, p.end) for p in ps if p.end - p.start <= TAIL_PART_BYTES}
        assert small <= {(p.start, p.end) for p in out[f]}  # a small part is never cut
        assert all(p.end - p.start >= TAIL_PART_BYTES // 2 for p in out[f] if (p.start, p.end) not in small)
