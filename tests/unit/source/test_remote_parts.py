"""Byte ranges into requests (``source.remote.parts``): coalescing and splitting, pure."""

from __future__ import annotations

import random

import pytest

from qwen35_reshard.source.remote.parts import (
    GAP_BYTES,
    MAX_PART_BYTES,
    MIN_PART_BYTES,
    Part,
    coalesce,
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
