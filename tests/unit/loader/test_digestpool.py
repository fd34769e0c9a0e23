"""The pool that hashes what the loader shim reads (qwen35_reshard/stage/digestpool.py): every
range checked exactly once across files, mismatches named by file and key, with windows so
small that hashing must wait for and run behind the reader."""

from __future__ import annotations

import os
import random

import pytest

from qwen35_reshard.format.digest import SHA256, XXH128, hexdigest
from qwen35_reshard.stage import digestpool
from qwen35_reshard.stage.digestpool import DigestPool, Mismatch, Range


@pytest.mark.parametrize(("workers", "algorithm"), [(0, XXH128), (1, XXH128), (3, SHA256)])
def test_every_range_is_checked_once_and_each_mismatch_named(tmp_path, monkeypatch, workers, algorithm):
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
            digest = hexdigest(algorithm, data[at : at + size])
            key = f"{n}:{at}"
            if rng.random() < 0.1:  # recorded otherwise: a damaged range
                digest = hexdigest(algorithm, b"other" + data[at : at + size])
                want.append(Mismatch(path, key))
            ranges.append(Range(key, at, size, digest, algorithm))
            at += size + rng.choice([0, 0, 5])
        files.append((path, ranges, len(data)))
    assert len(want) >= 3
    found = []
    fds = [os.open(path, os.O_RDONLY) for path, _, _ in files]
    with DigestPool(workers) as pool:
        for (path, ranges, size), fd in zip(files, fds, strict=True):
            pool.feed(path, fd, ranges, size)
            for r in ranges:
                found += pool.reached(r.offset)
        found += pool.finish()
    for fd in fds:
        os.close(fd)
    assert sorted(found, key=str) == sorted(want, key=str)


def test_a_whole_file_digest(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * 5000)
    digest = hexdigest(SHA256, b"x" * 5000)
    fd = os.open(path, os.O_RDONLY)
    with DigestPool(2) as pool:
        pool.feed(path, fd, [Range(None, 0, 5000, digest, SHA256)], 5000)
        assert pool.reached(0) + pool.finish() == []
    with DigestPool(2) as pool:
        pool.feed(path, fd, [Range(None, 0, 5000, "0" * 64, SHA256)], 5000)
        assert pool.reached(0) + pool.finish() == [Mismatch(path, None)]
    os.close(fd)
