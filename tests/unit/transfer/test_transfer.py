"""The copy engine on random layouts: every destination gets exactly the source bytes, every
tensor its digest, gaps are never copied, and a short source or a stop request ends the copy.
Both ways of moving bytes are covered: the kernel copy, with its real refusal across
filesystems (then pwrite from the mapping), and the buffers used where a source cannot be
mapped."""

import os
import random
import threading
from pathlib import Path

import pytest

from qwen35_reshard.errors import ReshardError
from qwen35_reshard.format.digest import SHA256, XXH128, hexdigest
from qwen35_reshard.transfer.copier import copy_segments
from qwen35_reshard.transfer.segments import Segment


def _random_case(rng: random.Random, src_dir: Path, out_dir: Path, trial: int):
    sizes = [rng.choice([0, 0, 1, 3, 7, 100, 4096, 5000, 70000]) for _ in range(rng.randint(1, 40))]
    data = rng.randbytes(16 + sum(sizes))
    src = src_dir / f"src{trial}"
    src.write_bytes(data)
    outs = [os.open(out_dir / f"out{trial}-{i}", os.O_RDWR | os.O_CREAT) for i in range(rng.randint(1, 3))]
    cursor = dict.fromkeys(outs, 8)
    segments, pos = [], 16
    for k, n in enumerate(sizes):
        if rng.random() >= 0.2:  # else: a tensor this copy does not need (a gap)
            dests = []
            for fd in rng.sample(outs, rng.randint(1, len(outs))):  # replicated to several files
                dests.append((fd, cursor[fd]))
                cursor[fd] += n
            segments.append(Segment(f"t{k}", pos, n, dests))
        pos += n
    rng.shuffle(segments)
    return src, data, outs, segments


def _check_random_layouts(rng: random.Random, src_dir: Path, out_dir: Path, *, kernel: bool) -> None:
    for trial in range(25):
        src, data, outs, segments = _random_case(rng, src_dir, out_dir, trial)
        small = sum(s.nbytes for s in segments) < 20_000  # tiny windows only where they stay few
        chunk = rng.choice([1, 7, 64, 4096] if small else [4096, 10000, 1 << 20])
        progress: list[int] = []
        try:
            digests = copy_segments(
                str(src), segments, chunk_bytes=chunk, on_progress=progress.append, kernel=kernel
            )
            assert set(digests) == {s.name for s in segments}
            assert sum(progress) == sum(s.nbytes for s in segments)  # gaps are not read
            for s in segments:
                want = data[s.offset : s.offset + s.nbytes]
                assert digests[s.name] == hexdigest(XXH128, want), (trial, s.name)
                for fd, off in s.dests:
                    assert os.pread(fd, s.nbytes, off) == want, (trial, s.name, chunk)
        finally:
            for fd in outs:
                os.close(fd)


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "buffers"])
@pytest.mark.parametrize("seed", range(4))
def test_random_layouts_copy_exact_bytes_and_digests(tmp_path, seed, kernel):
    _check_random_layouts(random.Random(seed), tmp_path, tmp_path, kernel=kernel)


@pytest.mark.slow  # a copy across filesystems, byte by byte
@pytest.mark.parametrize("seed", range(2))
def test_copy_across_filesystems_falls_back_to_pwrite(tmp_path, other_fs_dir, seed):
    _check_random_layouts(random.Random(seed), other_fs_dir, tmp_path, kernel=True)


def test_hash_only_segments_read_and_hash(tmp_path):
    data = random.Random(9).randbytes(300_000)
    src = tmp_path / "src"
    src.write_bytes(data)
    segments = [Segment("a", 0, 100_000), Segment("b", 100_000, 0), Segment("c", 150_000, 150_000)]
    for digest in (XXH128, SHA256):  # the one a split records; sha256 for a stage-v1 one
        assert copy_segments(str(src), segments, chunk_bytes=4096, digest=digest) == {
            "a": hexdigest(digest, data[:100_000]),
            "b": hexdigest(digest, b""),
            "c": hexdigest(digest, data[150_000:]),
        }


def test_short_source_is_an_error_naming_the_file(tmp_path):
    src = tmp_path / "src"
    src.write_bytes(b"x" * 100)
    fd = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT)
    before = set(threading.enumerate())  # others' threads (e.g. tqdm's monitor) are not the copy's
    try:
        with pytest.raises(ReshardError, match="src: file ended at byte 100"):
            copy_segments(str(src), [Segment("a", 50, 100, [(fd, 0)])], chunk_bytes=16)
    finally:
        os.close(fd)
    assert not [t for t in threading.enumerate() if t not in before and t.is_alive()]  # the hasher ended


def test_stop_request_interrupts_the_copy(tmp_path):
    src = tmp_path / "src"
    src.write_bytes(b"x" * 100)
    fd = os.open(tmp_path / "out", os.O_RDWR | os.O_CREAT)
    try:
        with pytest.raises(KeyboardInterrupt):
            copy_segments(
                str(src), [Segment("a", 0, 100, [(fd, 0)])], chunk_bytes=16, should_stop=lambda: True
            )
    finally:
        os.close(fd)


@pytest.mark.parametrize("kernel", [True, False])
def test_runs_for_sharing_outputs_are_copied_where_the_filesystem_refuses(tmp_path, kernel):
    """Segments that go only to a sharing output are cut into long windows, never read for a
    digest; where sharing is refused (here, a filesystem without reflinks, or the same source
    on one that has them but unaligned), their bytes are copied all the same, a chunk at a time
    through a buffer when there is no kernel copy: never read past a chunk-sized buffer."""
    data = os.urandom(5 << 20)
    src, out = tmp_path / "src.bin", tmp_path / "out.bin"
    src.write_bytes(data)
    fd = os.open(out, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, len(data))
        segments = [Segment("a", 0, 3 << 20, [(fd, 0)]), Segment("b", 3 << 20, 2 << 20, [(fd, 3 << 20)])]
        share = frozenset({fd})
        digests = copy_segments(str(src), segments, chunk_bytes=64 << 10, kernel=kernel, share_fds=share)
    finally:
        os.close(fd)
    assert digests == {"a": None, "b": None}
    assert out.read_bytes() == data


def test_hashing_dest_less_segments_gaps_empty_and_adjacent(tmp_path):
    """Segments that go nowhere (as verify hashes): read and hashed only."""
    data = os.urandom(10_000)
    path = tmp_path / "f"
    path.write_bytes(data)
    ranges = [("a", 0, 0), ("b", 0, 3000), ("c", 3000, 0), ("d", 3000, 1), ("e", 5000, 4999), ("f", 9999, 0)]
    for chunk in (1, 7, 4096, 1 << 20):
        got = copy_segments(str(path), [Segment(k, o, n) for k, o, n in ranges], chunk_bytes=chunk)
        assert got == {k: hexdigest(XXH128, data[o : o + n]) for k, o, n in ranges}, chunk
