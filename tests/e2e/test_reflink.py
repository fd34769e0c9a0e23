"""Block sharing on real XFS and Btrfs filesystems (and its refusal on ext4).

Each filesystem is a loop-mounted image file made for the session (mkfs.xfs, mkfs.btrfs,
mkfs.ext4; root needed). CI runs as root with xfsprogs and btrfs-progs installed by
``.ci/run``, so there these tests must run: with CI=true a filesystem that cannot be made
fails the test instead of skipping it.

What sharing means is measured from the outside: FIEMAP (the ioctl ``filefrag -v`` uses)
flags every extent a file shares with another, and the filesystem's used blocks (df, not
du) show what the split really cost.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from test_crash_resume import command, kill_when

import qwen35_reshard
from qwen35_reshard import WriteOptions
from qwen35_reshard.format.digest import XXH128, hexdigest
from qwen35_reshard.transfer import copier
from qwen35_reshard.transfer.segments import Segment
from qwen35_reshard.verify import verify

# Real XFS and Btrfs filesystems, loop-mounted images (root).
pytestmark = [pytest.mark.slow, pytest.mark.root]

# linux/fiemap.h
FS_IOC_FIEMAP = 0xC020660B
FIEMAP_FLAG_SYNC = 0x1
FIEMAP_EXTENT_LAST = 0x1
FIEMAP_EXTENT_SHARED = 0x2000
IMAGE_BYTES = 1 << 30
# ~100 MB in 12 shards: shards needed whole by a stage, and shards split between stages whose
# runs are long enough (>= 4 MiB) to be laid out for sharing.
CKPT = dict(layers=8, experts=32, hidden=512, moe_intermediate=256, vision=False, shard_bytes=9_000_000)


def _mount(kind: str, base: Path) -> Path:
    """A fresh ``kind`` filesystem loop-mounted under ``base``; fails under CI, else skips."""
    image, mnt = base / f"{kind}.img", base / kind
    mkfs = {
        "xfs": ["mkfs.xfs", "-q", "-f"],
        "btrfs": ["mkfs.btrfs", "-q", "-f"],
        "ext4": ["mkfs.ext4", "-q", "-F"],
    }
    try:
        if os.geteuid() != 0:
            raise OSError("mounting a loop device needs root")
        with open(image, "wb") as f:
            f.truncate(IMAGE_BYTES)
        mnt.mkdir()
        subprocess.run([*mkfs[kind], str(image)], check=True, capture_output=True)
        subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as e:
        why = getattr(e, "stderr", b"") or str(e)
        message = f"cannot make a loop-mounted {kind} filesystem: {why!r}"
        if os.environ.get("CI") == "true":
            pytest.fail(message + " (CI must run these tests: .ci/run installs xfsprogs and btrfs-progs)")
        pytest.skip(message)
    return mnt


@pytest.fixture(scope="module")
def filesystems(tmp_path_factory):
    """``filesystems(kind) -> mount point``, each made once per module and unmounted after."""
    base = tmp_path_factory.mktemp("loopfs")
    mounted: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in mounted:
            mounted[kind] = _mount(kind, base)
        return mounted[kind]

    yield get
    for mnt in mounted.values():
        subprocess.run(["umount", str(mnt)], check=False, capture_output=True)
    for image in base.glob("*.img"):
        image.unlink()


def used_bytes(path: Path) -> int:
    """Bytes in use on the filesystem of ``path`` (what df shows), after a sync."""
    os.sync()
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def shared_bytes(path: Path) -> int:
    """Bytes of ``path`` in extents that FIEMAP flags as shared with another file."""
    total, start, count = 0, 0, 256
    fd = os.open(path, os.O_RDONLY)
    try:
        while True:
            req = bytearray(struct.pack("=QQLLLL", start, 2**64 - 1, FIEMAP_FLAG_SYNC, 0, count, 0))
            req += bytes(56 * count)
            fcntl.ioctl(fd, FS_IOC_FIEMAP, req)
            mapped = struct.unpack_from("=L", req, 20)[0]
            if not mapped:
                return total
            for i in range(mapped):
                logical, _, length, _, _, flags = struct.unpack_from("=QQQQQL", req, 32 + 56 * i)
                if flags & FIEMAP_EXTENT_SHARED:
                    total += length
                start = logical + length
                if flags & FIEMAP_EXTENT_LAST:
                    return total
    finally:
        os.close(fd)


def data_files(out: Path) -> list[Path]:
    return sorted(out.glob("pp*/*.safetensors"))


def tensors_of(path: Path) -> dict[str, bytes]:
    """Every tensor's bytes in the safetensors file ``path``, parsed here, not by the tool."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    return {k: raw[8 + n + v["data_offsets"][0] : 8 + n + v["data_offsets"][1]] for k, v in header.items()}


def check_identical_to_source(model: Path, out: Path) -> int:
    """Every output tensor has its source tensor's bytes; returns how many were compared."""
    source: dict[str, bytes] = {}
    for p in sorted(model.glob("*.safetensors")):
        source.update(tensors_of(p))
    n = 0
    for p in data_files(out):
        for name, data in tensors_of(p).items():
            assert data == source[name], f"{p.name}: {name} differs from the source"
            n += 1
    return n


@pytest.fixture(scope="module")
def checkpoints(filesystems, tiny):
    """``checkpoints(kind, **extra) -> model dir`` on that filesystem, built once per arguments."""
    built: dict[tuple, Path] = {}

    def get(kind: str, **extra) -> Path:
        key = (kind, tuple(sorted(extra.items())))
        if key not in built:
            root = filesystems(kind)
            built[key] = tiny.build_checkpoint(root / f"model-{len(built)}", **{**CKPT, **extra})
        return built[key]

    return get


@pytest.mark.parametrize("kind", ["xfs", "btrfs"])
def test_split_shares_the_sources_blocks(checkpoints, kind):
    model = checkpoints(kind)
    out = model.parent / f"out-{model.name}"
    checkpoint = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    before = used_bytes(out.parent)
    done = qwen35_reshard.reshard(model, out, pp=4, write=WriteOptions(reflink="always"))
    plan, result = done.plan, done.written
    growth = used_bytes(out.parent) - before
    try:
        written = sum(p.stat().st_size for p in data_files(out))
        assert result.sharing and result.bytes_shared + result.bytes_copied == written
        layouts = {f.layout for s in plan.stages for f in s.files}
        assert {"clone", "aligned"} <= layouts, layouts
        # FIEMAP's view, not the tool's: at least 99% of the data files' bytes are shared.
        fiemap = sum(shared_bytes(p) for p in data_files(out))
        assert fiemap >= 0.99 * written, (fiemap, written)
        assert result.bytes_shared >= 0.99 * written
        # The disk paid for headers, heads, tails and metadata only: at most 1% of the checkpoint.
        assert growth <= 0.01 * checkpoint, (growth, checkpoint)
        assert check_identical_to_source(model, out) == len(plan.checkpoint.tensors) + 1  # embed twice
        report = verify(out, source=model)
        assert report.ok, report.findings
        assert verify(out).ok
        from safetensors.torch import load_file

        loaded = sum(len(load_file(p)) for p in data_files(out))
        assert loaded == sum(len(s.tensors) for s in plan.stages)
    finally:
        shutil.rmtree(out)


def test_the_layout_is_the_same_on_every_filesystem(checkpoints, filesystems, tmp_path):
    """XFS sharing and an ext4 copy give byte-identical data files and indexes."""
    model = checkpoints("xfs")
    shared, copied = model.parent / "out-same", filesystems("ext4") / "out-same"
    try:
        qwen35_reshard.reshard(model, shared, pp=4)
        result = qwen35_reshard.reshard(model, copied, pp=4).written
        assert not result.sharing and result.bytes_shared == 0
        names = sorted(p.relative_to(shared) for p in shared.glob("pp*/*.safetensors*"))
        assert names == sorted(p.relative_to(copied) for p in copied.glob("pp*/*.safetensors*"))
        for name in names:
            assert (shared / name).read_bytes() == (copied / name).read_bytes(), name
        # Copied bytes were read, so their digests are recorded: verify checks every tensor.
        manifest = json.loads((copied / "pp1" / "reshard-stage.json").read_bytes())
        assert all(t["xxh128"] for t in manifest["tensors"].values())
        assert verify(copied, source=model).ok
    finally:
        shutil.rmtree(shared, ignore_errors=True)
        shutil.rmtree(copied, ignore_errors=True)


def test_reflink_always_is_refused_on_ext4_with_one_line(checkpoints, filesystems):
    model = checkpoints("xfs")
    out = filesystems("ext4") / "out-always"
    proc = subprocess.run(
        [sys.executable, "-m", "qwen35_reshard", "--pp", "4", "--reflink", "always", str(model), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "--reflink always" in lines[0] and "cannot share blocks" in lines[0]
    assert "Traceback" not in proc.stderr
    assert not list(out.glob("pp*/*.safetensors"))
    shutil.rmtree(out, ignore_errors=True)


def cloning(out: Path) -> bool:
    """Whole-shard clones are being made: a data file is under its temporary name, and the
    stages' indexes (written once the copy has started) are not yet."""
    partial = any(out.glob("pp*/.model-*.safetensors.*.partial"))
    return partial and not any(out.glob("pp*/.model.safetensors.index.json.*.partial"))


def indexing(out: Path) -> bool:
    """The clones are made and the stages' side files and indexes are being written (under
    temporary names) while the rest is copied: no data file has its final name yet."""
    indexes = any(out.glob("pp*/.model.safetensors.index.json.*.partial"))
    return indexes and not any(out.glob("pp*/model-*.safetensors"))


@pytest.mark.parametrize("moment", [cloning, indexing], ids=["while-cloning", "while-indexing"])
def test_interrupted_split_resumes(checkpoints, tmp_path, moment):
    """SIGKILL while the clones are made, or once they are and the rest is copied.

    A run that shares blocks keeps nothing it wrote before its first barrier (its clones cost
    nothing to make again, and what it copies is journaled every PROGRESS_BYTES): the next run
    starts over, and its output is exact and shared all the same."""
    model = checkpoints("btrfs", shard_bytes=1_500_000)
    out = model.parent / f"out-killed-{moment.__name__}"
    checkpoint = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    before = used_bytes(out.parent)
    kill_when(model, out, tmp_path / "logs", lambda: moment(out))
    assert not (out / "reshard.json").exists()
    assert not list(out.glob("pp*/model-*.safetensors"))  # no data file got its final name
    done = subprocess.run(command(model, out), capture_output=True, text=True, timeout=300)
    try:
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout)["result"]
        assert result["files_kept"] == 0 and result["bytes_shared"] > 0
        assert not list(out.rglob("*.partial"))
        assert verify(out, source=model).ok
        check_identical_to_source(model, out)
        written = sum(p.stat().st_size for p in data_files(out))
        assert sum(shared_bytes(p) for p in data_files(out)) >= 0.95 * written
        assert used_bytes(out.parent) - before <= 0.05 * checkpoint
    finally:
        shutil.rmtree(out)


def test_a_checkpoint_with_no_block_aligned_shard(checkpoints, tiny):
    """One file whose data starts off any block boundary, needed by every stage in part:
    every stage file is laid out and shares the aligned middle of its runs."""
    model = checkpoints("xfs", single_file=True, shard_bytes=10**12)
    src = model / "model.safetensors"
    data_start = 8 + struct.unpack("<Q", src.read_bytes()[:8])[0]
    assert data_start % 4096, "the builder happened to align the data: change the checkpoint"
    out = model.parent / "out-unaligned"
    done = qwen35_reshard.reshard(model, out, pp=4)
    plan, result = done.plan, done.written
    try:
        assert {f.layout for s in plan.stages for f in s.files} <= {"aligned", "gathered"}
        written = sum(p.stat().st_size for p in data_files(out))
        assert result.bytes_shared >= 0.9 * written
        assert sum(shared_bytes(p) for p in data_files(out)) >= 0.9 * written
        check_identical_to_source(model, out)
        assert verify(out, source=model).ok
    finally:
        shutil.rmtree(out)


def _blob_clones(out: Path) -> dict[str, dict]:
    """``stage/file -> manifest entry`` of every clone of a source shard in the split ``out``."""
    clones = {}
    for m in sorted(out.glob("pp*/reshard-stage.json")):
        files = json.loads(m.read_bytes())["files"]
        clones.update({f"{m.parent.name}/{n}": f for n, f in files.items() if f["layout"] == "clone"})
    return clones


def test_a_damaged_clone_of_a_shared_cache_blob_fails_verify_with_the_source(filesystems, tiny):
    """A shared clone of a Hugging Face cache blob is never read, so its bytes were never
    checked against the blob's name: the manifest records no sha256 for it (as for any shared
    bytes), and ``verify --source`` catches a changed byte."""
    root = filesystems("xfs") / "hf"
    model = tiny.build_checkpoint(root, **CKPT, hf_cache=True)
    out = root.parent / "out-hf"
    done = qwen35_reshard.reshard(model, out, pp=4)
    result = done.written
    try:
        assert result.sharing
        clones = _blob_clones(out)
        assert clones
        assert all("sha256" not in f for f in clones.values()), clones
        name = sorted(clones)[0]
        assert verify(out).ok
        with open(out / name, "r+b") as fh:  # copy-on-write: the source stays intact
            fh.seek(-1, os.SEEK_END)
            last = fh.read(1)
            fh.seek(-1, os.SEEK_END)
            fh.write(bytes([last[0] ^ 1]))
        findings = verify(out, source=model).findings
        assert {(f.kind, f.file) for f in findings} == {("different", name.split("/")[1])}, findings
        assert (model / clones[name]["source"]).read_bytes()[-1:] == last
    finally:
        shutil.rmtree(out)
        shutil.rmtree(root)


def test_a_damaged_cache_blob_shared_whole_records_no_digest_it_did_not_check(filesystems, tiny):
    """Issue 29: a cache blob whose bytes no longer hash to its name, shared whole into a
    stage (never read, so never checked), was recorded with its name as the clone's sha256:
    the split exited 0 and verify then failed it. Exit 0 means OUT holds MODEL's bytes and
    records only digests it checked: verify passes, with and without the source."""
    root = filesystems("xfs") / "hf-damaged"
    model = tiny.build_checkpoint(root, **CKPT, hf_cache=True)
    out = root.parent / "out-hf-damaged"
    blobs = sorted((model / "../../blobs").resolve().iterdir(), key=lambda p: p.stat().st_size)
    try:
        for blob in blobs:  # every shard's last data byte: whichever the stages share whole
            if blob.stat().st_size > 1 << 20:  # the shards, not config.json and the like
                with open(blob, "r+b") as fh:
                    fh.seek(-1, os.SEEK_END)
                    last = fh.read(1)
                    fh.seek(-1, os.SEEK_END)
                    fh.write(bytes([last[0] ^ 1]))
                assert hashlib.sha256(blob.read_bytes()).hexdigest() != blob.name
        run = subprocess.run(
            [sys.executable, "-m", "qwen35_reshard", "--pp", "2", str(root / "models--Qwen--Tiny"), str(out)],
            capture_output=True,
            text=True,
        )
        assert run.returncode == 0, run.stderr
        report = verify(out)
        assert report.ok, report.findings
        clones = _blob_clones(out)
        assert clones, "no shard is shared whole: change the checkpoint"
        assert all("sha256" not in f for f in clones.values()), clones
        assert verify(out, source=model).ok
        check_identical_to_source(model, out)
    finally:
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(root)


def test_free_space_counts_only_the_bytes_copied(checkpoints):
    """A filesystem with less room than the stages' size: sharing fits, a copy is refused."""
    model = checkpoints("xfs")
    out = model.parent / "out-tight"
    stages = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    filler = model.parent / "filler"
    st = os.statvfs(model.parent)
    room = stages // 2  # what is left free: half of what a copy needs, far more than sharing does
    with open(filler, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, st.f_bavail * st.f_frsize - room)
    try:
        with pytest.raises(qwen35_reshard.ReshardError, match="free"):
            qwen35_reshard.reshard(model, out, pp=4, write=WriteOptions(reflink="never"))
        shutil.rmtree(out, ignore_errors=True)
        result = qwen35_reshard.reshard(model, out, pp=4).written
        assert result.sharing and result.bytes_copied < room
        assert verify(out, source=model).ok
    finally:
        filler.unlink()
        shutil.rmtree(out, ignore_errors=True)


def test_reflink_always_is_refused_on_ext4_even_with_nothing_to_share(filesystems, tiny):
    """The tiny checkpoint's stages are all gathered files: still, always means always."""
    model = tiny.build_checkpoint(filesystems("ext4") / "tiny-always")
    with pytest.raises(qwen35_reshard.ReshardError, match="cannot share blocks"):
        always = WriteOptions(reflink="always")
        qwen35_reshard.reshard(model, model.parent / "out-tiny-always", pp=4, write=always)
    never = WriteOptions(reflink="never")
    result = qwen35_reshard.reshard(model, model.parent / "out-tiny-never", pp=4, write=never).written
    assert not result.sharing and result.bytes_shared == 0


def test_a_refused_run_leaves_a_finished_split_as_it_was(filesystems, tiny):
    """Refusing to start (here: sharing required where it is impossible) removes nothing: not
    the run record of the stages already built, not a split that --overwrite would replace."""
    model = tiny.build_checkpoint(filesystems("ext4") / "tiny-refused")
    out = model.parent / "out-refused"
    qwen35_reshard.reshard(model, out, pp=2, ranks=[0])
    before = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    with pytest.raises(qwen35_reshard.ReshardError, match="cannot share blocks"):
        qwen35_reshard.reshard(model, out, pp=2, ranks=[1], write=WriteOptions(reflink="always"))
    with pytest.raises(qwen35_reshard.ReshardError, match="cannot share blocks"):
        qwen35_reshard.reshard(model, out, pp=4, write=WriteOptions(overwrite=True, reflink="always"))
    assert {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()} == before
    # And OUT is still this split's: the next run builds the missing stage.
    result = qwen35_reshard.reshard(model, out, pp=2, ranks=[1]).written
    assert result.built == [1] and result.complete == [0, 1]


@pytest.mark.parametrize("kind", ["xfs", "btrfs"])
def test_a_shared_run_is_shared_in_one_call_and_only_its_edges_copied(filesystems, monkeypatch, kind):
    """Tensors going only to a sharing output, back to back over many chunks, are shared by one
    FICLONERANGE for the run (not one per chunk-sized window), their ragged head and tail
    copied; a tensor beside them that also goes to a plain output is copied and hashed."""
    root = filesystems(kind)
    src, shared, plain = root / "run-src.bin", root / "run-shared.bin", root / "run-plain.bin"
    data = os.urandom(40 << 20)
    src.write_bytes(data)
    calls = []
    clone_range = copier.reflink.clone_range
    monkeypatch.setattr(copier.reflink, "clone_range", lambda *a: calls.append(a) or clone_range(*a))
    chunk = 1 << 20
    sizes = [3 << 20, 7 << 20, (5 << 20) + 12345, 2 << 20]  # the last one also goes to ``plain``
    offsets = [1000 + sum(sizes[:i]) for i in range(len(sizes))]
    shift = 64 * 4096  # the output keeps the source offset modulo the block size
    out_fd = os.open(shared, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    plain_fd = os.open(plain, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(out_fd, shift + offsets[-1] + sizes[-1])
        places = enumerate(zip(offsets, sizes, strict=True))
        segments = [Segment(f"t{i}", o, n, [(out_fd, shift + o)]) for i, (o, n) in places]
        segments[-1].dests.append((plain_fd, 0))
        digests = copier.copy_segments(str(src), segments, chunk_bytes=chunk, share_fds=frozenset({out_fd}))
    finally:
        os.close(out_fd)
        os.close(plain_fd)
    run = sum(sizes[:-1])
    assert run > 10 * chunk and len([c for c in calls if c[1] < offsets[3]]) == 1  # (src_fd, src_offset, ...)
    last = data[offsets[3] : offsets[3] + sizes[3]]
    assert digests == {"t0": None, "t1": None, "t2": None, "t3": hexdigest(XXH128, last)}
    out = shared.read_bytes()
    for o, n in zip(offsets, sizes, strict=True):
        assert out[shift + o : shift + o + n] == data[o : o + n]
    assert plain.read_bytes() == last
    assert shared_bytes(shared) >= run - 2 * 4096
