"""The pool that hashes what the loader shim reads (qwen35_reshard/stage/digestpool.py): every
range checked exactly once across files, mismatches named by file and key, each range hashed
before the reader hands it on (the reader's map written into after that, as a server may write
into the views it was handed, changes no verdict), with windows so small and threads so slow
that the reader must wait for them."""

from __future__ import annotations

import mmap
import os
import random
import time

import pytest

from qwen35_reshard.format.digest import SHA256, XXH128, hexdigest
from qwen35_reshard.stage import digestpool
from qwen35_reshard.stage.digestpool import DigestPool, Mismatch, Range


@pytest.mark.parametrize(("workers", "algorithm"), [(0, XXH128), (1, XXH128), (3, SHA256)])
def test_every_range_is_checked_once_and_each_mismatch_named(tmp_path, monkeypatch, workers, algorithm):
    monkeypatch.setattr(digestpool, "AHEAD", 64)
    check = digestpool._Job.check
    monkeypatch.setattr(digestpool._Job, "check", lambda job: time.sleep(0.002) or check(job))  # late threads
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
            private = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)  # the reader's, as the loader's
            pool.feed(path, fd, ranges, size, private)
            for r in ranges:
                found += pool.reached(r.offset)
                private[r.offset : r.offset + r.nbytes] = bytes(r.nbytes)  # the range handed on, written to
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


def _resident(path) -> int:
    """Bytes of the mappings of ``path`` that are in this process's page table (smaps Rss)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        if line[0] in "0123456789abcdef" and "-" in line.split()[0]:
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


def _kernel_at_least(major: int, minor: int) -> bool:
    release = os.uname().release.split(".")
    return (int(release[0]), int(release[1].split("-")[0])) >= (major, minor)


def test_populate_fills_the_page_table_in_one_call_where_the_kernel_can(tmp_path):
    import mmap
    import sys

    path = tmp_path / "f"
    path.write_bytes(os.urandom(64 * mmap.PAGESIZE))
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        fast = digestpool.populate(m, 5, 40 * mmap.PAGESIZE + 3)  # unaligned, as ranges are
        if sys.platform == "linux" and _kernel_at_least(5, 14):
            assert fast, "MADV_POPULATE_READ refused on a kernel that has it"
            assert _resident(path) >= 41 * mmap.PAGESIZE
        assert not digestpool.populate(m, 7, 7)  # nothing to bring in


def test_populate_falls_back_where_the_advice_is_refused(tmp_path, monkeypatch):
    import mmap

    monkeypatch.setattr(digestpool, "MADV_POPULATE_READ", -1)  # EINVAL, as from a kernel before 5.14
    path = tmp_path / "f"
    data = os.urandom(8 * mmap.PAGESIZE)
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            assert not digestpool.populate(m, 0, len(data))
        good = Range("good", 0, len(data), hexdigest(XXH128, data), XXH128)
        bad = Range("bad", 0, len(data), hexdigest(XXH128, bytes(len(data))), XXH128)
        with DigestPool(1) as pool:  # and the pool still checks
            pool.feed(path, fd, [good, bad], len(data))
            assert pool.finish() == [Mismatch(path, "bad")]
    finally:
        os.close(fd)
