"""Checked loading, each byte hashed once per node (qwen35_reshard/stage/nodechecks.py,
qwen35_reshard/loader/checks.py): a second loader of the node trusts the first one's check of
the very same file and of nothing else; a checker that dies leaves nothing trusted; the node's
hashing threads are one budget; a stage-v1 manifest (sha256) still loads and verifies; the
bytes hashed are those of the file mapped, even when its path is replaced meanwhile.

The processes that race are stopped with SIGSTOP at a chosen point (their first mapping or
tensor), so each interleaving happens every run."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import qwen35_reshard
from qwen35_reshard import loader
from qwen35_reshard.errors import DamagedStage
from qwen35_reshard.format.manifest import STAGE_FORMAT_V1
from qwen35_reshard.loader import checks
from qwen35_reshard.source.header import read_header
from qwen35_reshard.stage import digestpool
from qwen35_reshard.stage.nodechecks import HASH_THREADS_ENV, RACY_SECONDS, NodeChecks
from qwen35_reshard.verify import verify

MANIFEST = "reshard-stage.json"

# A loader in a process of its own: stops itself (SIGSTOP) right after its first call of
# loader.<argv[2]> (_mapped: a file mapped; _Readahead: a file mapped and claimed, before any
# of it is read), then loads on and prints what it hashed and how it ended.
CHILD = """
import os, signal, sys
from qwen35_reshard import loader
from qwen35_reshard.errors import DamagedStage
from qwen35_reshard.stage import digestpool
hashed = [0]
if hasattr(digestpool, "hexdigest"):
    real_digest = digestpool.hexdigest
    def counted(algorithm, data):
        hashed[0] += len(data)
        return real_digest(algorithm, data)
    digestpool.hexdigest = counted
real = getattr(loader, sys.argv[2])
def stop_once(*args):
    result = real(*args)
    if not stop_once.done:
        stop_once.done = True
        os.kill(os.getpid(), signal.SIGSTOP)
    return result
stop_once.done = False
setattr(loader, sys.argv[2], stop_once)
try:
    n = sum(1 for _ in loader.open_stage(sys.argv[1]).iter_weights())
    print("LOADED", n, hashed[0])
except DamagedStage as e:
    print("DAMAGED", e.tensor, hashed[0])
"""


@pytest.fixture(scope="module")
def source(make_checkpoint):
    return make_checkpoint(layout="per_expert_fp8", mtp=False, vision=False, shard_bytes=100_000)


@pytest.fixture
def out(source, tmp_path):
    """A pp=2 split, several data files a stage, older than a timestamp tick (RACY_SECONDS):
    a check made now may be recorded."""
    plan = qwen35_reshard.make_plan(qwen35_reshard.read_checkpoint(source), pp=2, max_file_bytes=150_000)
    qwen35_reshard.write_plan(plan, tmp_path / "out")
    assert len(loader.open_stage(tmp_path / "out", pp_rank=1).files) >= 2
    time.sleep(2 * RACY_SECONDS)
    return tmp_path / "out"


def _first_file(stage: Path) -> Path:
    return sorted(stage.glob("model-*.safetensors"))[0]


def _flip(path: Path) -> str:
    """Flip a byte of the middle tensor of data file ``path`` in place; its name."""
    header = read_header(path)
    victim = header.tensors[len(header.tensors) // 2]
    with open(path, "r+b") as f:
        at = header.data_start + victim.begin
        b = os.pread(f.fileno(), 1, at)
        os.pwrite(f.fileno(), bytes([b[0] ^ 0xFF]), at)
    return victim.name


def _counting(monkeypatch) -> list[int]:
    """The sizes of the ranges the loader hashes from now on, in this process."""
    sizes: list[int] = []
    real = digestpool.hexdigest

    def counted(algorithm, data):
        sizes.append(len(data))
        return real(algorithm, data)

    monkeypatch.setattr(digestpool, "hexdigest", counted)
    return sizes


def _load(out: Path, rank: int = 1) -> int:
    return sum(1 for _ in loader.open_stage(out, pp_rank=rank).iter_weights())


def test_a_second_loader_trusts_the_first_ones_check_of_the_same_file_only(out, monkeypatch):
    stage = loader.open_stage(out, pp_rank=1)
    hashed = _counting(monkeypatch)
    assert _load(out) == len(stage) and sum(hashed) == stage.nbytes  # the node's first: every byte
    hashed.clear()
    assert _load(out) == len(stage) and hashed == []  # the next worker: nothing again

    # Written in place, its modification time put back: the change time still moves.
    path = _first_file(out / "pp1")
    before = os.stat(path)
    victim = _flip(path)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert os.stat(path).st_mtime_ns == before.st_mtime_ns
    with pytest.raises(DamagedStage) as e:
        _load(out)
    assert e.value.tensor == victim and victim in str(e.value) and "xxh128" in str(e.value)

    # Replaced by another file (its bytes mended): another inode, checked again, then trusted.
    fixed = path.with_suffix(".tmp")
    fixed.write_bytes(path.read_bytes())
    _flip(fixed)  # the same byte again: the original value
    os.replace(fixed, path)
    time.sleep(2 * RACY_SECONDS)
    hashed.clear()
    assert _load(out) == len(stage)
    assert 0 < sum(hashed) < stage.nbytes  # that file only: the others are still the ones checked


def test_a_record_counts_only_for_the_ranges_it_checked(out, monkeypatch, tmp_path):
    """Another stage's view of the same file (another manifest: other digests) is not trusted."""
    hashed = _counting(monkeypatch)
    _load(out)
    stage_dir = out / "pp1"
    manifest = json.loads((stage_dir / MANIFEST).read_text())
    name = next(n for n, t in sorted(manifest["tensors"].items()) if t["xxh128"])
    manifest["tensors"][name]["xxh128"] = "0" * 32  # what the file must hash to, changed
    (stage_dir / MANIFEST).write_text(json.dumps(manifest))
    hashed.clear()
    with pytest.raises(DamagedStage) as e:
        _load(out)
    assert e.value.tensor == name and hashed


def test_a_stage_v1_manifest_loads_and_verifies_through_its_sha256(out, source):
    """Stages split before stage-v2 record each tensor's sha256: still loaded and verified,
    a flipped byte still refused by name."""
    stage_dir = out / "pp1"
    manifest = json.loads((stage_dir / MANIFEST).read_text())
    for file in manifest["files"]:
        header = read_header(stage_dir / file)
        raw = (stage_dir / file).read_bytes()
        for t in header.tensors:
            begin = header.data_start + t.begin
            entry = manifest["tensors"][t.name]
            recorded = entry.pop("xxh128")
            entry["sha256"] = recorded and hashlib.sha256(raw[begin : begin + t.nbytes]).hexdigest()
    manifest["format"] = STAGE_FORMAT_V1
    (stage_dir / MANIFEST).write_text(json.dumps(manifest, indent=2))

    stage = loader.open_stage(out, pp_rank=1)
    assert stage.manifest.digest == "sha256" and _load(out) == len(stage)
    assert verify(out, source).ok  # beside a stage-v2 stage, against the source too
    victim = _flip(_first_file(stage_dir))
    with pytest.raises(DamagedStage) as e:
        _load(out)
    assert e.value.tensor == victim and "sha256" in str(e.value)
    found = [f for f in verify(out).findings if f.tensor == victim]
    assert found and "its sha256" in found[0].message


def _start(out: Path, stop_after: str) -> subprocess.Popen:
    """A loader of ``out``'s stage 1 in a process of its own, once stopped (see CHILD)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(out / "pp1"), stop_after],
        stdout=subprocess.PIPE,
        text=True,
        env=os.environ,
    )
    _, status = os.waitpid(proc.pid, os.WUNTRACED)
    assert os.WIFSTOPPED(status), status
    return proc


def _resume(proc: subprocess.Popen) -> list[str]:
    os.kill(proc.pid, signal.SIGCONT)
    out, _ = proc.communicate(timeout=120)
    return out.split()


def test_the_bytes_hashed_are_those_of_the_file_mapped_even_once_its_path_is_replaced(out):
    """The loader maps a damaged file; before it hashes, the path is given intact bytes (a new
    file renamed over it). Hashing through the path again (the code before issue 43) checked
    the new file and handed the server the damaged one's bytes; hashed through the descriptor
    mapped, the damage is found."""
    path = _first_file(out / "pp1")
    intact = path.read_bytes()
    victim = _flip(path)
    proc = _start(out, "_mapped")  # the damaged file is mapped: stopped there
    fresh = path.with_suffix(".tmp")
    fresh.write_bytes(intact)
    os.replace(fresh, path)
    said = _resume(proc)
    assert said[:2] == ["DAMAGED", victim], said


def test_a_file_being_checked_by_another_loader_is_waited_for(out):
    """Two loaders of the node: the first holds the first file's check (stopped once it claimed
    it, before it reads), the second finds it taken (stopped likewise). The first finishes: the second
    hashes nothing, every file was checked once."""
    first = _start(out, "_Readahead")
    second = _start(out, "_Readahead")
    assert _resume(first)[0] == "LOADED"
    said = _resume(second)
    assert said[0] == "LOADED" and said[2] == "0", said


def test_a_checker_that_dies_leaves_nothing_trusted(out):
    """The first loader dies while it holds the damaged file's check: the second, waiting for
    its verdict, gets none, hashes the file itself and refuses it by name."""
    victim = _flip(_first_file(out / "pp1"))
    time.sleep(2 * RACY_SECONDS)
    first = _start(out, "_Readahead")
    second = _start(out, "_Readahead")
    first.kill()
    first.wait()
    said = _resume(second)
    assert said[:2] == ["DAMAGED", victim], said


@pytest.fixture
def torch_threads():
    """Sets torch's intra-op threads (the copy's) for the test, as they were after it."""
    import torch

    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def test_the_node_budget_of_hashing_threads_is_shared_by_its_loaders(out, monkeypatch, torch_threads):
    """However many loaders: together they hold at most the node's budget of threads; one
    that gets none hashes in its own thread and still refuses damage by name. A loader takes
    threads only on the cores the copy's torch threads leave (4 cores here, the copy on 1)."""
    monkeypatch.setattr(checks, "cores", lambda: 4)
    torch_threads(1)
    monkeypatch.setenv(HASH_THREADS_ENV, "3")
    loaders = [NodeChecks.open() for _ in range(4)]
    taken = [n.take_threads(2) for n in loaders]
    assert taken == [2, 1, 0, 0]
    sizes = []
    real = digestpool.DigestPool.__init__

    def init(self, workers):
        sizes.append(workers)
        real(self, workers)

    monkeypatch.setattr(digestpool.DigestPool, "__init__", init)
    victim = _flip(_first_file(out / "pp1"))
    with pytest.raises(DamagedStage) as e:
        _load(out)
    assert sizes == [0] and e.value.tensor == victim
    for n in loaders:
        n.close()
    with pytest.raises(DamagedStage):
        _load(out)
    assert sizes[1] == 2  # loader.checks.WORKER_THREADS, the budget free again
    torch_threads(4)  # the copy on every core: a hashing thread would only take turns with it
    with pytest.raises(DamagedStage):
        _load(out)
    assert sizes[2] == 0


def test_a_copy_to_a_gpu_leaves_every_core_to_the_check():
    """The copy's threads: torch's intra-op threads for a copy into CPU tensors; none where
    CUDA is initialized (the server's parameters on a GPU: host-to-device copies)."""
    import torch

    assert checks.copy_threads(torch) == torch.get_num_threads()  # no GPU initialized here
    for initialized, threads in ((True, 0), (False, 16)):
        gpu_server = SimpleNamespace(
            cuda=SimpleNamespace(is_initialized=lambda initialized=initialized: initialized),
            get_num_threads=lambda: 16,
        )
        assert checks.copy_threads(gpu_server) == threads


@pytest.mark.parametrize(
    ("nanos", "after", "recorded"),
    [(0, 1.0, False), (0, 2.5, True), (123_456_789, 0.5, True)],
    ids=["coarse-within-its-granularity", "coarse-settled", "fine-settled"],
)
def test_a_file_changed_within_a_coarse_filesystems_granularity_is_not_recorded(
    tmp_path, monkeypatch, nanos, after, recorded
):
    """A filesystem of whole-second times (ext3, FAT's two seconds) keeps a file's times through a
    write up to its granularity later: a check that began 1 s after the time seen could have
    missed a write and must not be trusted by the node's other loaders."""
    monkeypatch.setenv("QWEN35_RESHARD_CHECKED_DIR", str(tmp_path / "node"))
    data = tmp_path / "data"
    data.write_bytes(b"x" * 64)
    when = int(time.time()) - 10
    checks = NodeChecks.open()
    fd = os.open(data, os.O_RDONLY)
    try:
        claim = checks.claim(fd, "expected")
        assert claim.state == "mine"
        # The identity a coarse filesystem gives: both times whole seconds (or fine ones).
        seen = (*claim.checked[:3], when * 10**9 + nanos, when * 10**9 + nanos)
        claim.checked, claim.started = seen, when + nanos / 1e9 + after
        claim.record(seen)
        assert (checks.claim(fd, "expected").state == "trusted") is recorded
    finally:
        os.close(fd)
        checks.close()
