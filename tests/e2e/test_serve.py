"""A pipeline rank's stage of an UNSPLIT checkpoint (qwen35_reshard/servers/unsplit.py, issue 33): what
the servers' qwen35-stages loaders call for a Hub repo id or a local directory.

Each call runs ``serve_stage.py`` in its own process with a private ``HF_HOME``, ``HF_ENDPOINT``
at the tests' Hub server (tests/support/hub_server.py, which logs every request with its User-Agent)
and its own stage cache. What must hold:

- from the Hub, the rank fetches at most its stage's bytes plus the shards' headers, and gets
  exactly the tensors (names and bytes) of the same stage of a split made with the CLI's rules;
  the next start fetches no safetensors byte; another partition is another cache entry;
- several processes building the same rank at once fetch it once;
- from a local directory, the stage is read in place (no file written) with the same tensors,
  or, asked to copy, built in the cache once;
- a Hub error stops with one line, and nothing is left that a later start would open.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import qwen35_reshard
from qwen35_reshard.servers.unsplit import STAGE_CACHE_ENV
from qwen35_reshard.source.checkpoint import source_identity
from qwen35_reshard.source.header import read_header
from qwen35_reshard.source.remote.checkpoint import header_read
from qwen35_reshard.source.remote.parts import GAP_BYTES

from support.helpers import ROOT, SUPPORT, mount_namespace
from support.hub_server import Fault, HubServer

pytestmark = pytest.mark.slow

REPO = "Qwen/Tiny"
DRIVER = SUPPORT / "serve_stage.py"
SHARD_BYTES = 150_000  # ten shards: some needed whole by a rank, some straddling two ranks
PARTITION = [2, 2, 2, 2]  # SGLang's default for 8 layers at pp=4


@pytest.fixture(scope="module")
def model(make_checkpoint):
    return make_checkpoint(shard_bytes=SHARD_BYTES)


@pytest.fixture
def hub(model):
    with HubServer() as server:
        server.add_repo(REPO, model)
        yield server


@pytest.fixture(scope="module")
def split(model, tmp_path_factory):
    """{(partition, rank): {name: sha256}} of stages of splits made the ordinary way."""
    out: dict = {}

    def get(partition: list[int], rank: int) -> dict[str, str]:
        key = (tuple(partition), rank)
        if key not in out:
            d = tmp_path_factory.mktemp("split")
            qwen35_reshard.reshard(model, d, pp=len(partition), runtime="sglang", partition=partition)
            for r in range(len(partition)):
                out[(tuple(partition), r)] = stage_digests(d, r)
        return out[key]

    return get


def stage_digests(out: Path, rank: int) -> dict[str, str]:
    """{name: sha256 of its bytes} of the stage ``rank`` of the split in ``out``."""
    stage = qwen35_reshard.open_stage(out, pp_rank=rank)
    return {
        name: hashlib.sha256(t.contiguous().view(-1).view(torch_uint8()).numpy()).hexdigest()
        for name, t in stage.iter_weights()
    }


def torch_uint8():
    import torch

    return torch.uint8


def serve(
    tmp_path, spec: dict, *, hub=None, background: bool = False, prefix: tuple = (), extra: dict | None = None
):
    """server_stage in its own process (started by ``prefix``, ``extra`` added to its environment);
    its RESULT, or the STAGEERROR line; with its stderr (the log) as ``"log"``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(
        PYTHONPATH=str(ROOT),
        HF_HOME=str(tmp_path / "hf-home"),
        HF_ENDPOINT=hub.url if hub is not None else "http://127.0.0.1:9",
        HF_HUB_DISABLE_XET="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        QWEN35_RESHARD_RETRY_WAIT="0.01",
        **{STAGE_CACHE_ENV: str(tmp_path / "stages")},
        **(extra or {}),
    )
    spec = {"runtime": "sglang", "partition": PARTITION, **spec}
    cmd = [*prefix, sys.executable, str(DRIVER), json.dumps(spec)]
    if background:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    return parse(proc.returncode, proc.stdout, proc.stderr)


def parse(code: int, stdout: str, stderr: str) -> dict:
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            assert code == 0, stderr
            return {**json.loads(line[len("RESULT "):]), "log": stderr}
        if line.startswith("STAGEERROR "):
            assert code == 3 and "Traceback" not in stdout, stderr
            return {"error": line[len("STAGEERROR "):], "stdout": stdout, "log": stderr}
    raise AssertionError(f"exit {code}\n{stdout}\n{stderr}")


def safetensors_bytes(hub, agent: str | None = None) -> int:
    """Body bytes of *.safetensors sent (headers and data), to requests whose User-Agent has ``agent``."""
    return sum(
        e.sent for e in hub.log
        if e.file.endswith(".safetensors") and e.method == "GET" and (agent is None or agent in e.agent)
    )


def header_bytes(model: Path) -> int:
    """What reading every shard's header costs: the tool's first read, or its 8-byte length and
    the JSON where longer."""
    total = 0
    for f in model.glob("*.safetensors"):
        with open(f, "rb") as fh:
            total += max(8 + int.from_bytes(fh.read(8), "little"), header_read(f.stat().st_size))
    return total


def read_through_gaps(model: Path, partition: list[int], rank: int) -> int:
    """Bytes between two of the stage's tensors in one shard at most GAP_BYTES apart: the fetch
    engine reads them rather than ask again (the tool's documented threshold)."""
    ckpt = qwen35_reshard.read_checkpoint(model)
    plan = qwen35_reshard.make_plan(ckpt, pp=len(partition), runtime="sglang", partition=partition)
    spans: dict[str, list[tuple[int, int]]] = {}
    for t in plan.stages[rank].tensors:
        src = ckpt.tensors[t.name]
        spans.setdefault(src.file, []).append((src.offset, src.offset + src.nbytes))
    gaps = 0
    for runs in spans.values():
        runs.sort()
        gaps += sum(a - b for (_, b), (a, _) in zip(runs, runs[1:], strict=False) if 0 < a - b <= GAP_BYTES)
    return gaps


def stage_bytes(model: Path, partition: list[int], rank: int) -> int:
    ckpt = qwen35_reshard.read_checkpoint(model)
    plan = qwen35_reshard.make_plan(ckpt, pp=len(partition), runtime="sglang", partition=partition)
    return plan.stages[rank].data_bytes


def test_hub_fetches_only_its_stage_once_and_keys_the_cache(tmp_path, hub, model, split):
    whole = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    first = serve(tmp_path, {"model": REPO, "rank": 1, "user_agent": "qwen35-stages/pp1"}, hub=hub)
    assert first.get("how") == "fetched", first
    assert first["digests"] == split(PARTITION, 1)
    got = safetensors_bytes(hub)
    assert got == safetensors_bytes(hub, "qwen35-stages/pp1")  # every request says its rank
    # Exactly the stage's tensors, every shard's header (planning, once: a shard needed whole
    # comes straight into the stage, its header kept) and the small gaps read through.
    headers = header_bytes(model) + read_through_gaps(model, PARTITION, 1)
    assert got == stage_bytes(model, PARTITION, 1) + headers
    assert got < whole / 2
    commit = next(iter(hub.state.repos[REPO].files))
    assert first["where"] == str(tmp_path / "stages" / "models--Qwen--Tiny" / commit / "sglang-pp4-2-2-2-2")

    hub.clear_log()
    again = serve(tmp_path, {"model": REPO, "rank": 1}, hub=hub)
    assert again["how"] == "cached" and again["digests"] == first["digests"]
    assert safetensors_bytes(hub) == 0
    assert [e.path for e in hub.log] == [f"/api/models/{REPO}/revision/main"]  # the commit, nothing else

    # Another partition is another stage: built anew, never the cached one.
    other = serve(tmp_path, {"model": REPO, "rank": 1, "partition": [1, 3, 2, 2]}, hub=hub)
    assert other["how"] == "fetched" and other["where"].endswith("sglang-pp4-1-3-2-2")
    assert other["digests"] == split([1, 3, 2, 2], 1)


def test_hub_node_slice_is_the_splits_node_directory_keyed_by_the_ep_layout(tmp_path, hub, model):
    """Under expert parallelism (ep=4 over 2 nodes per stage) a rank builds its node's directory
    of its stage in the stage cache, keyed by the EP layout: byte for byte the split's own
    ``pp1-node1``; the next start fetches nothing; another node count is another entry."""
    spec = {"model": REPO, "rank": 1, "ep": 4, "nodes": 2, "node": 1}
    first = serve(tmp_path, spec, hub=hub)
    assert first.get("how") == "fetched", first
    commit = next(iter(hub.state.repos[REPO].files))
    key = "sglang-pp4-2-2-2-2-ep4-n2"
    assert first["where"] == str(tmp_path / "stages" / "models--Qwen--Tiny" / commit / key)
    assert first["path"] == str(Path(first["where"]) / "pp1-node1")
    d = tmp_path / "split"
    qwen35_reshard.reshard(model, d, pp=4, runtime="sglang", partition=PARTITION, ep=4, nodes=2)
    node_dir = qwen35_reshard.open_stage(d / "pp1-node1")
    assert first["digests"] == {
        name: hashlib.sha256(t.contiguous().view(-1).view(torch_uint8()).numpy()).hexdigest()
        for name, t in node_dir.iter_weights()
    }
    assert not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in first["digests"])
    from qwen35_reshard.servers.stagecache import cache_entries

    (entry,) = cache_entries(tmp_path / "stages")  # listed (cache ls, rm, verify) as its node's
    assert (entry.key, entry.stage, entry.node, entry.partition) == (key, 1, 1, tuple(PARTITION))

    hub.clear_log()
    again = serve(tmp_path, spec, hub=hub)
    assert again["how"] == "cached" and again["digests"] == first["digests"]
    assert safetensors_bytes(hub) == 0
    other = serve(tmp_path, {**spec, "nodes": 4, "node": 2}, hub=hub)
    assert other["how"] == "fetched" and other["where"].endswith("sglang-pp4-2-2-2-2-ep4-n4")
    assert other["path"].endswith("pp1-node2") and other["digests"] != first["digests"]


def flip_a_byte(path: Path) -> str:
    """Flip one byte of the middle tensor of the safetensors file ``path``; that tensor's name."""
    header = read_header(path)
    victim = header.tensors[len(header.tensors) // 2]
    at = header.data_start + victim.begin + victim.nbytes // 2
    with open(path, "r+b") as f:
        byte = os.pread(f.fileno(), 1, at)
        os.pwrite(f.fileno(), bytes([byte[0] ^ 0x01]), at)
    return victim.name


def test_a_damaged_cached_stage_stops_the_load_and_the_next_start_mends_it(tmp_path, hub, model, split):
    first = serve(tmp_path, {"model": REPO, "rank": 0}, hub=hub)
    assert first["how"] == "fetched" and first["digests"] == split(PARTITION, 0)
    stage_dir = Path(first["where"]) / "pp0"
    files = json.loads((stage_dir / "reshard-stage.json").read_text())["files"]
    assert len(files) >= 2, files  # one damaged, the others kept
    # A file of byte ranges fetched (a shard needed whole is also in the Hugging Face cache).
    damaged = stage_dir / next(f for f, info in files.items() if info["layout"] == "gathered")
    victim = flip_a_byte(damaged)
    hub.clear_log()

    # Whoever checks elsewhere opts out: loaded as it is, and the log says it was not checked.
    opt_out = {"QWEN35_RESHARD_VERIFY_LOAD": "0"}
    unchecked = serve(tmp_path, {"model": REPO, "rank": 0}, hub=hub, extra=opt_out)
    assert unchecked["how"] == "cached" and unchecked["digests"][victim] != first["digests"][victim]
    assert "loaded without checking its bytes' digests (QWEN35_RESHARD_VERIFY_LOAD=0)" in unchecked["log"]

    # Checked (the default): the load stops in one line naming the tensor and the file.
    stopped = serve(tmp_path, {"model": REPO, "rank": 0}, hub=hub)
    error = stopped.get("error", "")
    where = f"{stage_dir}/{damaged.name}"
    assert f"{where}: the bytes of tensor {victim!r} do not match its xxh128" in error, stopped
    assert "removed from the stage cache" in error and "next start" in error and "\n" not in error
    assert safetensors_bytes(hub) == 0  # nothing fetched: it was cached
    assert not damaged.exists()

    # The next start fetches that file again, and only it; the one after finds the stage cached.
    mended = serve(tmp_path, {"model": REPO, "rank": 0}, hub=hub)
    assert mended["how"] == "repaired" and mended["digests"] == first["digests"], mended.get("error")
    slack = read_through_gaps(model, PARTITION, 0)
    assert 0 < safetensors_bytes(hub) - header_bytes(model) <= damaged.stat().st_size + slack
    assert serve(tmp_path, {"model": REPO, "rank": 0}, hub=hub)["how"] == "cached"


def test_a_damaged_shard_read_in_place_stops_the_load(tmp_path, make_checkpoint, model):
    """Read in place from a Hugging Face cache folder, whose blobs are named by their sha256:
    a flipped byte stops the load naming the checkpoint's file, with no advice to delete it.
    A plain directory records no sha256: said in the log."""
    snapshot = make_checkpoint(shard_bytes=SHARD_BYTES, hf_cache=True, fresh=True)
    intact = serve(tmp_path, {"model": str(snapshot), "rank": 3})
    assert intact["how"] == "in place" and "unchecked" not in intact["log"], intact.get("error")
    shard = sorted(snapshot.glob("*.safetensors"))[-1]  # held by the last stage (lm_head, norm)
    flip_a_byte(shard.resolve())
    stopped = serve(tmp_path, {"model": str(snapshot), "rank": 3})
    error = stopped.get("error", "")
    assert f"{snapshot}/{shard.name}: its bytes do not match the sha256" in error, stopped
    assert "restore" in error and "delete" not in error and "\n" not in error

    plain = serve(tmp_path, {"model": str(model), "rank": 3})
    assert plain["how"] == "in place"
    said = "loaded unchecked: no digest is recorded for them (a local directory records no sha256"
    assert said in plain["log"]


def test_a_damaged_shard_of_a_downloaded_directory_stops_the_load(tmp_path, model):
    """A directory ``hf download --local-dir`` wrote records each file's sha256 (its LFS ETag)
    and when: a shard damaged without being written (its time unchanged: a disk's doing) is
    named; one modified since the record (by a writer) is no longer what it names: loaded
    unchecked, and said."""
    local = tmp_path / "downloaded"
    shutil.copytree(model, local)
    records = local / ".cache" / "huggingface" / "download"
    records.mkdir(parents=True)
    for shard in local.glob("*.safetensors"):
        digest = hashlib.sha256(shard.read_bytes()).hexdigest()
        (records / f"{shard.name}.metadata").write_text(f"{'c' * 40}\n{digest}\n{time.time()}\n")
    intact = serve(tmp_path, {"model": str(local), "rank": 3})
    assert intact["how"] == "in place" and "unchecked" not in intact["log"], intact.get("error")

    shard = sorted(local.glob("*.safetensors"))[-1]
    stamp = shard.stat()
    flip_a_byte(shard)
    os.utime(shard, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    stopped = serve(tmp_path, {"model": str(local), "rank": 3})
    assert f"{local}/{shard.name}: its bytes do not match the sha256" in stopped.get("error", ""), stopped

    os.utime(shard)  # written after the download: the record no longer speaks for it
    unchecked = serve(tmp_path, {"model": str(local), "rank": 3})
    assert unchecked["how"] == "in place" and "loaded unchecked" in unchecked["log"], unchecked.get("error")


def test_ranks_building_one_stage_at_once_fetch_it_once(tmp_path, hub, model):
    procs = [serve(tmp_path, {"model": REPO, "rank": 2}, hub=hub, background=True) for _ in range(2)]
    results = [parse(p.wait(timeout=300), *p.communicate()) for p in procs]
    assert results[0]["digests"] == results[1]["digests"]
    # Both may read every header; the small gaps between the stage's tensors are read through.
    data = safetensors_bytes(hub) - header_bytes(model) * 2 - read_through_gaps(model, PARTITION, 2)
    assert data <= stage_bytes(model, PARTITION, 2)


def test_local_directory_read_in_place_or_copied(tmp_path, model, split):
    in_place = serve(tmp_path, {"model": str(model), "rank": 3})
    assert in_place["how"] == "in place" and in_place["path"] == str(model)
    assert in_place["digests"] == split(PARTITION, 3)
    assert not (tmp_path / "stages").exists()  # nothing written, nothing copied

    copied = serve(tmp_path, {"model": str(model), "rank": 3, "copy": True})
    assert copied["how"] == "built" and copied["digests"] == split(PARTITION, 3)
    assert Path(copied["where"]).is_relative_to(tmp_path / "stages" / "local")
    assert serve(tmp_path, {"model": str(model), "rank": 3, "copy": True})["how"] == "cached"


def test_a_copied_stage_is_of_the_checkpoint_now_at_the_path(tmp_path, make_checkpoint):
    """Two checkpoints of one layout, other bytes (two training steps), written to one path one
    after the other: the stage cache's key (the source's fingerprint) is the same, yet the second
    start serves the second's bytes, and the start after it finds that stage cached."""
    first = make_checkpoint(shard_bytes=SHARD_BYTES, fresh=True)
    second = make_checkpoint(shard_bytes=SHARD_BYTES, seed=1, fresh=True)
    want = {}
    for n, ckpt in enumerate((first, second)):
        qwen35_reshard.reshard(ckpt, tmp_path / f"split{n}", pp=4, runtime="sglang", partition=PARTITION)
        want[n] = stage_digests(tmp_path / f"split{n}", 1)
    assert want[0] != want[1]
    path = tmp_path / "step"
    shutil.copytree(first, path)
    spec = {"model": str(path), "rank": 1, "copy": True}
    got = serve(tmp_path, spec)
    assert got["how"] == "built" and got["digests"] == want[0], got.get("error")

    shutil.rmtree(path)
    shutil.copytree(second, path)
    # Two ranks of one node start at once on the new step: both are served its bytes.
    procs = [serve(tmp_path, {**spec, "rank": r}, background=True) for r in (1, 2)]
    got, other = (parse(p.wait(timeout=300), *p.communicate()) for p in procs)
    assert got.get("digests") == want[1], got.get("error") or got["how"]
    assert other.get("digests") == stage_digests(tmp_path / "split1", 2), other.get("error")
    assert serve(tmp_path, spec)["how"] == "cached"


def test_hub_error_stops_in_one_line_and_leaves_nothing_usable(tmp_path, hub, model):
    # Every read of one shard this rank needs fails for good: the start stops, naming it.
    shard = sorted(p.name for p in model.glob("*.safetensors"))[-1]
    hub.add_fault(Fault(file=shard, status=500, times=1000))
    failed = serve(tmp_path, {"model": REPO, "rank": 3}, hub=hub)
    assert "error" in failed and "\n" not in failed["error"], failed
    assert shard in failed["error"] and "500" in failed["error"], failed
    stages = list((tmp_path / "stages").rglob("reshard-stage.json"))
    assert stages == []  # no stage finished: a later start builds it

    hub.state.faults.clear()
    assert serve(tmp_path, {"model": REPO, "rank": 3}, hub=hub)["how"] == "fetched"

    missing = serve(tmp_path, {"model": "Qwen/NoSuchRepo", "rank": 0}, hub=hub)
    assert missing["error"].startswith("pipeline rank 0: Qwen/NoSuchRepo: no such model repo"), missing


def test_a_stage_cache_another_run_writes_otherwise_stops_in_one_line(tmp_path, model):
    """A split with other settings (--no-mtp) being written into the stage's cache directory,
    stopped mid-write: the rank stops with the writer's one line naming that run, and builds
    nothing; the other run is unharmed."""
    from e2e.test_concurrent import Run

    fingerprint = source_identity(qwen35_reshard.read_checkpoint(model))["fingerprint"][:16]
    out = tmp_path / "stages" / "local" / fingerprint / "sglang-pp4-2-2-2-2"
    args = ["--pp", "4", "--runtime", "sglang", "--no-mtp", "--workers", "1", str(model), str(out)]
    other = Run(args, tmp_path / "other", stop_at="/pp3/.model-")
    other.wait_stopped()
    try:
        got = serve(tmp_path, {"model": str(model), "rank": 3, "copy": True})
    finally:
        assert other.resume() == 0, other.stderr.read_text()
    assert "being written by another qwen35-reshard run" in got.get("error", ""), got
    assert f"pid {other.proc.pid}" in got["error"] and "other settings" in got["error"]
    assert got["error"].startswith("pipeline rank 3: ") and "\n" not in got["error"]


def test_a_full_disk_stops_in_one_line_and_leaves_nothing_usable(tmp_path, model):
    """The stage cache on a 64 KiB tmpfs (a private mount namespace): the rank stops with one
    line, and no stage manifest is left there for a later start to open."""
    prefix = mount_namespace(tmp_path / "probe")
    if prefix is None:
        pytest.skip("cannot mount a tmpfs here (needs root or unprivileged user namespaces)")
    cache = tmp_path / "stages"
    cache.mkdir()
    # Mount, run, then list what the run left in the cache (the mount vanishes with the namespace).
    shell = (f"mount -t tmpfs -o size=64k tmpfs {cache} || exit 9; \"$@\"; rc=$?; "
             f"find {cache} -name reshard-stage.json -printf 'LEFT %p\\n'; exit $rc")
    spec = {"model": str(model), "rank": 3, "copy": True}
    got = serve(tmp_path, spec, prefix=(*prefix, "sh", "-c", shell, "sh"))
    # The split's own check of the free space before writing, said in its terms and ours.
    assert " free but this run writes " in got.get("error", ""), got
    assert f"the stage cache ({STAGE_CACHE_ENV}) {cache}/" in got["error"], got
    assert got["error"].startswith("pipeline rank 3: ") and "\n" not in got["error"]
    # in the server operator's terms: no parameter or command of the library's (issue 37)
    assert "out_dir" not in got["error"] and "same command" not in got["error"], got
    assert f"or point {STAGE_CACHE_ENV} at another disk" in got["error"], got
    assert "LEFT" not in got["stdout"]


def test_a_wrong_token_stops_in_one_clear_line(tmp_path, hub):
    """The Hub answers every request with a token it does not know 401 "Invalid credentials"
    (public repos too): one line saying the token was refused, no HTTP-library text (issue 37)."""
    hub.check_tokens("hf_valid")
    got = serve(tmp_path, {"model": REPO, "rank": 0, "token": "hf_wrong"}, hub=hub)
    error = got.get("error", "")
    head = f"pipeline rank 0: {hub.url} refused the token (revision 'main' of {REPO}: 401"
    assert error.startswith(head), got
    assert "HfHubHTTPError" not in error and "http" not in error.removeprefix(head[:-len(" 401")]), got
    assert "hf_wrong" not in got["stdout"], got


def test_a_full_hugging_face_cache_names_its_directory(tmp_path, hub):
    """HF_HOME on a 64 KiB tmpfs: the shards a rank needs whole do not fit there; the line names
    the directory that is full and both caches' variables, in the server's terms (issue 37)."""
    prefix = mount_namespace(tmp_path / "probe")
    if prefix is None:
        pytest.skip("cannot mount a tmpfs here (needs root or unprivileged user namespaces)")
    hf_home = tmp_path / "hf-home"
    hf_home.mkdir()
    shell = f"mount -t tmpfs -o size=64k tmpfs {hf_home} || exit 9; exec \"$@\""
    got = serve(tmp_path, {"model": REPO, "rank": 3}, hub=hub, prefix=(*prefix, "sh", "-c", shell, "sh"))
    error = got.get("error", "")
    print(error)
    assert error.startswith("pipeline rank 3: ") and "\n" not in error, got
    assert f"the Hugging Face cache {hf_home}/hub (set by HF_HOME): No space left on device" in error, got
    assert "point HF_HOME at another" in error, got
    assert "out_dir" not in error and "same command" not in error, got
