"""The pool that hashes what the loader shim reads (qwen35_reshard/stage/digestpool.py): every
range checked exactly once across files, mismatches named by file and key, with windows so
small that hashing must wait for and run behind the reader."""

from __future__ import annotations

import hashlib
import random

import pytest

from qwen35_reshard.stage import digestpool
from qwen35_reshard.stage.digestpool import DigestPool, Mismatch, Range


@pytest.mark.parametrize("workers", [1, 3])
def test_every_range_is_checked_once_and_each_mismatch_named(tmp_path, monkeypatch, workers):
    monkeypatch.setattr(digestpool, "AHEAD", 64)
    monkeypatch.setattr(digestpool, "BEHIND", 128)
    monkeypatch.setattr(digestpool, "JOB_BYTES", 100)
    monkeypatch.setattr(digestpool, "JOB_RANGES", 3)
    monkeypatch.setattr(digestpool, "SMALL", 10)  # some ranges hashed by threads, some inline
    rng = random.Random(0)
    files, want = [], []
    for n in range(3):
        data = rng.randbytes(2000)
        path = tmp_path / f"f{n}"
        path.write_bytes(data)
        ranges, at = [], 8
        while at < len(data) - 60:
            size = rng.choice([0, 1, 7, 40, 300])
            size = min(size, len(data) - at)
            digest = hashlib.sha256(data[at : at + size]).hexdigest()
            key = f"{n}:{at}"
            if rng.random() < 0.1:  # recorded otherwise: a damaged range
                digest = hashlib.sha256(b"other" + data[at : at + size]).hexdigest()
                want.append(Mismatch(path, key))
            ranges.append(Range(key, at, size, digest))
            at += size + rng.choice([0, 0, 5])
        files.append((path, ranges, len(data)))
    assert len(want) >= 3
    found = []
    with DigestPool(workers) as pool:
        for path, ranges, size in files:
            pool.feed(path, ranges, size)
            for r in ranges:
                found += pool.reached(r.offset)
        found += pool.finish()
    assert sorted(found, key=str) == sorted(want, key=str)


def test_a_whole_file_digest(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 5000)
    digest = hashlib.sha256(b"x" * 5000).hexdigest()
    with DigestPool(2) as pool:
        pool.feed(path, [Range(None, 0, 5000, digest)], 5000)
        assert pool.reached(0) + pool.finish() == []
    with DigestPool(2) as pool:
        pool.feed(path, [Range(None, 0, 5000, "0" * 64)], 5000)
        assert pool.reached(0) + pool.finish() == [Mismatch(path, None)]
