"""MODEL as a Hub repo id, against a real HTTP server on 127.0.0.1 speaking the Hub's protocol.

huggingface_hub's real client (never patched) and the tool's range reader talk to
``tests/support/hub_server.py`` through ``HF_ENDPOINT``; the tool runs as a subprocess with its own
``HF_HOME``, so the cache, the kept headers and the token are the test's alone. The server logs
every request, which is how these tests know what each rank fetched: which files whole, which
byte ranges, and how many bytes in all.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qwen35_reshard.source.remote.checkpoint import header_read
from qwen35_reshard.source.remote.parts import GAP_BYTES

from support.helpers import ROOT, one_error_line
from support.hub_server import Fault, HubServer

# The command against a real HTTP server speaking the Hub's protocol: seconds a case.
pytestmark = pytest.mark.slow

REPO = "Qwen/Tiny"
PP = 4
SHARD_BYTES = 150_000  # ten shards: some needed whole by one rank, some straddling ranks
TOKEN = "hf_testtokenNEVERshown0123456789"


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def model(make_checkpoint):
    return make_checkpoint(shard_bytes=SHARD_BYTES)


@pytest.fixture
def hub(model):
    with HubServer() as server:
        server.add_repo(REPO, model, tags=("v1",))
        yield server


@pytest.fixture
def hf_home(tmp_path):
    path = tmp_path / "hf-home"
    path.mkdir()
    return path


def run(args, *, hub, hf_home, env=None, check=True):
    """Run the CLI with HF_ENDPOINT at the fake Hub and a private HF_HOME."""
    full_env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("HF_", "HUGGINGFACE_")) and k != "TRANSFORMERS_OFFLINE"
    }
    full_env.update(
        PYTHONPATH=str(ROOT),
        HF_HOME=str(hf_home),
        HF_ENDPOINT=hub.url if hub is not None else "http://127.0.0.1:9",
        HF_HUB_DISABLE_XET="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_ETAG_TIMEOUT="5",
        QWEN35_RESHARD_RETRY_WAIT="0.01",
    )
    full_env.update(env or {})
    proc = subprocess.run(
        [sys.executable, "-m", "qwen35_reshard", *map(str, args)],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


# --------------------------------------------------------------------------- expectations


def shard_tensors(model: Path) -> dict[str, dict[str, tuple[int, int]]]:
    """{file: {tensor: (absolute begin, end)}} read with struct/json, not with the tool."""
    weight_map = json.loads((model / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for file in sorted(set(weight_map.values())):
        raw = (model / file).read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + n])
        header.pop("__metadata__", None)
        out[file] = {
            name: (8 + n + a, 8 + n + b)
            for name, (a, b) in ((k, v["data_offsets"]) for k, v in header.items())
        }
    return out


def expected_fetch(model: Path, ref, rank: int) -> tuple[set[str], dict[str, list[tuple[int, int]]]]:
    """What rank ``rank`` of a default pp=4 SGLang split needs: the shards it needs whole,
    and for each shard it needs only part of, the merged byte runs of the tensors it needs."""
    src = ref.read_source(model)
    partition = ref.split(src.num_layers, PP, "sglang")
    whole, ranges = set(), {}
    for file, tensors in shard_tensors(model).items():
        mine = sorted(
            span
            for name, span in tensors.items()
            if rank in ref.owners(name, partition=partition, runtime="sglang", tied=src.tied, mtp_kept=True)
        )
        if not mine:
            continue
        if len(mine) == len(tensors):
            whole.add(file)
            continue
        runs = [list(mine[0])]
        for a, b in mine[1:]:
            if a == runs[-1][1]:
                runs[-1][1] = b
            else:
                runs.append([a, b])
        ranges[file] = [(a, b) for a, b in runs if b > a]
    return whole, ranges


def engine_ranges(model: Path, ref, rank: int) -> dict[str, list[tuple[int, int]]]:
    """The byte runs the fetch engine reads for rank ``rank``: every shard's needed runs (a shard
    needed whole: all of its data, its header kept from planning), joined across gaps of at most
    GAP_BYTES (the tool's documented threshold: a gap costs less than another request)."""
    whole, ranges = expected_fetch(model, ref, rank)
    out = {}
    for file in sorted(whole | set(ranges)):
        data = (min(a for a, _ in shard_tensors(model)[file].values()), (model / file).stat().st_size)
        runs = ranges.get(file) or [data]
        joined = [list(runs[0])]
        for a, b in runs[1:]:
            if a - joined[-1][1] <= GAP_BYTES:
                joined[-1][1] = b
            else:
                joined.append([a, b])
        out[file] = [(a, b) for a, b in joined]
    return out


def cdn_fetches(log) -> tuple[set[str], dict[str, list[tuple[int, int]]], int]:
    """From the server log: shard files fetched whole, byte ranges fetched per file (what was
    actually received), and all body bytes the CDN sent."""
    whole, ranges, sent = set(), {}, 0
    for e in log:
        if e.origin != "cdn" or e.method != "GET":
            continue
        sent += e.sent
        if e.range is None:
            whole.add(e.file)
        else:
            a = int(e.range.split("=")[1].split("-")[0])
            ranges.setdefault(e.file, []).append((a, a + e.sent))
    return whole, ranges, sent


def covered(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Union of byte runs, merged."""
    out: list[list[int]] = []
    for a, b in sorted(runs):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        elif b > a:
            out.append([a, b])
    return [(a, b) for a, b in out]


def stage_files(stage: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(stage.iterdir()) if p.is_file()}


def same_as_local(hub_stage: Path, local_stage: Path, *, from_hub: bool = True) -> None:
    """Every file byte-identical, except the manifest's record of where the source was (its
    identity names the repo and commit) and a clone's sha256, which a source in the Hugging Face
    cache knows by its blob's name."""
    got, want = stage_files(hub_stage), stage_files(local_stage)
    assert sorted(got) == sorted(want)
    for name in want:
        if name == "reshard-stage.json":
            g, w = json.loads(got[name]), json.loads(want[name])
            if from_hub:
                assert g["source"]["repo_id"] == REPO and len(g["source"]["commit"]) == 40
            # A Hub source, and a cache snapshot of one, name the repo and commit; a plain directory not.
            assert g["identity"].pop("source").startswith(f"{REPO}@")
            assert w["identity"].pop("source") == "local"
            g.pop("source"), w.pop("source")
            for f in (*g["files"].values(), *w["files"].values()):
                f.pop("sha256", None)
            assert g == w
        else:
            assert got[name] == want[name], name


@pytest.fixture(scope="module")
def local_split(model, tmp_path_factory):
    out = tmp_path_factory.mktemp("local") / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "qwen35_reshard", "--pp", str(PP), str(model), str(out)],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    return out


# --------------------------------------------------------------------------- the core


def test_plan_reads_only_headers_and_keeps_them(hub, hf_home, model):
    proc = run(["plan", "--pp", PP, REPO], hub=hub, hf_home=hf_home)
    assert "SGLANG_PP_LAYER_PARTITION=2,2,2,2" in proc.stdout + proc.stderr
    sizes = {f: (model / f).stat().st_size for f in shard_tensors(model)}
    whole, ranges, _ = cdn_fetches(hub.log)
    assert whole == set()  # no shard downloaded
    for file, size in sizes.items():
        (n,) = struct.unpack("<Q", (model / file).read_bytes()[:8])
        # the header in its first read (and the rest of a longer one): no more than that
        assert covered(ranges[file]) == [(0, max(8 + n, header_read(size)))]
    # Planned again with the server gone: the kept headers are enough.
    hub.stop()
    again = run(["plan", "--pp", PP, REPO], hub=None, hf_home=hf_home, env={"HF_HUB_OFFLINE": "1"})
    assert "SGLANG_PP_LAYER_PARTITION=2,2,2,2" in again.stdout + again.stderr


@pytest.mark.parametrize("rank", range(PP))
def test_rank_fetches_only_its_bytes_and_matches_local(hub, hf_home, model, ref, local_split, tmp_path, rank):
    run(["plan", "--pp", PP, REPO], hub=hub, hf_home=hf_home)  # headers kept: the split's log is its data
    hub.clear_log()
    out = tmp_path / "out"
    proc = run(["--pp", PP, "--rank", rank, "--json", REPO, out], hub=hub, hf_home=hf_home)

    want_whole, want_ranges = expected_fetch(model, ref, rank)
    whole, ranges, sent = cdn_fetches(hub.log)
    # Every shard by ranges, straight into the stage: those needed whole too (not their header,
    # kept from planning), nothing into the Hugging Face cache.
    assert whole == set()
    runs = engine_ranges(model, ref, rank)
    assert {f: covered(r) for f, r in ranges.items()} == runs
    assert sent == sum(b - a for r in runs.values() for a, b in r)  # each byte once
    snapshot = next((hf_home / "hub" / "models--Qwen--Tiny" / "snapshots").iterdir())
    assert not any((snapshot / f).exists() for f in runs)

    same_as_local(out / f"pp{rank}", local_split / f"pp{rank}")
    summary = json.loads(proc.stdout)
    stage = summary["fetch"]["stages"][0]
    assert stage["stage"] == rank
    assert {f for f, how in stage["shards"].items() if how == "whole"} == want_whole
    assert {f for f, how in stage["shards"].items() if how == "ranges"} == set(want_ranges)
    assert stage["cache_bytes"] == 0


def test_verify_against_the_repo(hub, hf_home, tmp_path):
    out = tmp_path / "out"
    run(["--pp", PP, "--rank", 2, REPO, out], hub=hub, hf_home=hf_home)
    proc = run(["verify", out / "pp2", "--source", REPO, "--json"], hub=hub, hf_home=hf_home)
    report = json.loads(proc.stdout)
    assert report["status"] == "ok", report["findings"]
    assert report["source_bytes_hashed"] > 0


# --------------------------------------------------------------------------- revisions, cache


def test_revision_is_resolved_once_and_pinned(hub, hf_home, model, tmp_path, local_split):
    commit = next(iter(hub.state.repos[REPO].files))
    out = tmp_path / "out"
    run(["--pp", PP, "--rank", 1, "--revision", "v1", REPO, out], hub=hub, hf_home=hf_home)
    named = [e.path for e in hub.log if e.origin == "hub"]
    assert [p for p in named if "v1" in p] == [f"/api/models/{REPO}/revision/v1"]
    # The commit and the file list in that one request (before: a second, /tree/<commit>).
    assert [p for p in named if p.startswith("/api/")] == [f"/api/models/{REPO}/revision/v1"]
    assert all(commit in p for p in named if "/resolve/" in p or "/tree/" in p)
    manifest = json.loads((out / "pp1" / "reshard-stage.json").read_text())
    assert manifest["source"]["commit"] == commit and manifest["source"]["revision"] == "v1"
    same_as_local(out / "pp1", local_split / "pp1")


def test_cache_repo_folder_is_resolved_through_refs(hub, hf_home, model, tmp_path, local_split):
    # All stages at once need every tensor of every shard: with --hf-cache each is downloaded
    # whole, into the cache.
    run(["--pp", PP, "--hf-cache", REPO, tmp_path / "all"], hub=hub, hf_home=hf_home)
    whole, ranges, _ = cdn_fetches(hub.log)
    assert whole == set(shard_tensors(model))
    assert all(covered(r)[0][0] == 0 and len(covered(r)) == 1 for r in ranges.values())  # headers only
    folder = hf_home / "hub" / "models--Qwen--Tiny"
    hub.stop()
    out = tmp_path / "out"
    run(["--pp", PP, "--rank", 3, folder, out], hub=None, hf_home=hf_home)
    same_as_local(out / "pp3", local_split / "pp3", from_hub=False)
    line = one_error_line(
        run(["--pp", PP, "--revision", "v9", folder, tmp_path / "v9"], hub=None, hf_home=hf_home, check=False)
    )
    assert "no refs/v9 (it has main)" in line


# --------------------------------------------------------------------------- offline


def test_offline_splits_from_the_cache_or_names_what_is_missing(
    hub, hf_home, model, ref, tmp_path, local_split
):
    run(["plan", "--pp", PP, REPO], hub=hub, hf_home=hf_home)
    hub.stop()
    offline = {"HF_HUB_OFFLINE": "1"}
    # Planning kept the headers and the small files (read beside the headers), not rank 1's shards.
    proc = run(
        ["--pp", PP, "--rank", 1, REPO, tmp_path / "a"], hub=None, hf_home=hf_home, env=offline, check=False
    )
    whole, ranges = expected_fetch(model, ref, 1)
    line = one_error_line(proc)
    assert "offline" in line
    for name in sorted(whole | set(ranges)):
        assert name in line
    assert "tokenizer.json" not in line
    assert not (tmp_path / "a" / "pp1" / "model.safetensors.index.json").exists()


def test_offline_split_from_a_full_cache_matches_local(hub, hf_home, tmp_path, local_split):
    run(["--pp", PP, "--hf-cache", REPO, tmp_path / "all"], hub=hub, hf_home=hf_home)
    hub.stop()
    for env, flag in (({"HF_HUB_OFFLINE": "1"}, []), ({}, ["--offline"])):
        out = tmp_path / f"out{len(flag)}"
        run(["--pp", PP, "--rank", 1, *flag, REPO, out], hub=None, hf_home=hf_home, env=env)
        same_as_local(out / "pp1", local_split / "pp1")


def test_unreachable_hub_says_whether_the_cache_could_serve(hub, hf_home, tmp_path):
    hub.stop()
    proc = run(["--pp", PP, "--rank", 0, REPO, tmp_path / "out"], hub=hub, hf_home=hf_home, check=False)
    line = one_error_line(proc)
    assert "unreachable" in line and "cache" in line
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- errors


def variant(model: Path, tmp_path: Path, change) -> Path:
    """A copy of the checkpoint with ``change(dir)`` applied."""
    import shutil

    path = tmp_path / "variant"
    shutil.copytree(model, path)
    change(path)
    return path


def _drop_shard(d: Path) -> None:
    (d / "model-00005-of-00010.safetensors").unlink()


def _huge_header(d: Path) -> None:
    with open(d / "model-00003-of-00010.safetensors", "r+b") as f:
        f.write(struct.pack("<Q", 30_000_000))


def _llama(d: Path) -> None:
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))


@pytest.mark.parametrize(
    "change, args, expected",
    [
        (None, ["Qwen/Nope"], "Qwen/Nope: no such model repo"),
        (None, ["--revision", "nope", REPO], "no revision 'nope'"),
        (
            _drop_shard,
            ["Qwen/Variant"],
            "model-00005-of-00010.safetensors is named by model.safetensors.index.json but missing "
            "from the repo",
        ),
        (_huge_header, ["Qwen/Variant"], "model-00003-of-00010.safetensors: header length 30000000 exceeds"),
        (_llama, ["Qwen/Variant"], "not a Qwen3.5 MoE checkpoint"),
    ],
)
def test_errors_are_one_line(hub, hf_home, model, tmp_path, change, args, expected):
    if change is not None:
        hub.add_repo("Qwen/Variant", variant(model, tmp_path, change))
    out = tmp_path / "out"
    line = one_error_line(run(["--pp", PP, *args, out], hub=hub, hf_home=hf_home, check=False))
    assert expected in line
    assert not out.exists()


@pytest.mark.parametrize("where", ["folder", "outside"])
def test_shard_named_by_a_path_is_refused(hub, hf_home, model, tmp_path, where):
    """An index and file list (a mirror's, or a hostile server's) naming a shard by a path are
    refused like a local index naming one: a name leading out through '..' to a file on this
    machine had that file read as the shard (taken for a cached copy), and a name in a folder
    crashed writing its kept header with a traceback."""
    index = json.loads((model / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    if where == "outside":
        outside = tmp_path / "outside.safetensors"
        outside.write_bytes((model / shard).read_bytes())
        name = "../" * 40 + str(outside).lstrip("/")
    else:
        name = f"sub/{shard}"

    def rename(d: Path) -> None:
        wm = {k: name if v == shard else v for k, v in index["weight_map"].items()}
        (d / "model.safetensors.index.json").write_text(json.dumps({**index, "weight_map": wm}))

    commit = hub.add_repo("Qwen/Variant", variant(model, tmp_path, rename))
    files = hub.state.repos["Qwen/Variant"].files[commit]
    files[name] = files.pop(shard)  # the file list names it so, as the index does
    out = tmp_path / "out"
    line = one_error_line(run(["--pp", PP, "Qwen/Variant", out], hub=hub, hf_home=hf_home, check=False))
    assert f"shard file name {name!r} is not a plain file name" in line
    assert not out.exists()


def test_server_ignoring_range_is_detected(hub, hf_home, tmp_path):
    hub.set_ignore_range(True)
    line = one_error_line(run(["plan", "--pp", PP, REPO], hub=hub, hf_home=hf_home, check=False))
    assert "ignored the Range request" in line
    # Refused, not silently downloaded whole: no shard reached the cache.
    assert not list((hf_home / "hub").rglob("*.safetensors"))
    assert not [p for p in (hf_home / "hub").rglob("blobs/*") if len(p.name) == 64]  # LFS blobs: sha256


@pytest.mark.parametrize("private", [False, True])
def test_gated_or_private_repo_and_the_token(hub, hf_home, model, tmp_path, private):
    repo = "Qwen/Locked"
    hub.add_repo(repo, model, gated=not private, private=private, token=TOKEN)
    line = one_error_line(
        run(["--pp", PP, "--rank", 3, repo, tmp_path / "no"], hub=hub, hf_home=hf_home, check=False)
    )
    assert ("no such model repo" if private else "gated repo") in line
    assert ("private" if private else "accept its license") in line

    # With the token (HF_TOKEN, then --token) it works, and the token is nowhere to be seen.
    outs = []
    for i, (env, flag) in enumerate((({"HF_TOKEN": TOKEN}, []), ({}, ["--token", TOKEN]))):
        out = tmp_path / f"out{i}"
        proc = run(["--pp", PP, "--rank", 3, "--json", *flag, repo, out], hub=hub, hf_home=hf_home, env=env)
        assert TOKEN not in proc.stdout + proc.stderr
        outs.append(out)
    for root in (*outs, hf_home):
        for p in root.rglob("*"):
            if p.is_file():
                assert TOKEN.encode() not in p.read_bytes(), p
    assert not any(e.auth for e in hub.log if e.origin == "cdn")  # never sent past the Hub
    assert any(e.auth for e in hub.log if e.origin == "hub")


# --------------------------------------------------------------------------- retries, resume


def test_dropped_connections_are_retried_and_resumed(hub, hf_home, model, ref, tmp_path, local_split):
    """A reset mid-body of any read (a shard needed in part, and one needed whole) is asked
    again from its first byte not received. Before: a whole shard went through huggingface_hub,
    which started that download again from its last 10 MB chunk (here: byte 0)."""
    run(["plan", "--pp", PP, REPO], hub=hub, hf_home=hf_home)
    whole, ranges = expected_fetch(model, ref, 0)
    ranged_file, whole_file = sorted(ranges)[0], sorted(whole)[0]
    hub.add_fault(Fault(ranged_file, after=5000, ranged=True))
    hub.add_fault(Fault(whole_file, after=20000, ranged=True))
    hub.clear_log()
    out = tmp_path / "out"
    run(["--pp", PP, "--rank", 0, REPO, out], hub=hub, hf_home=hf_home)
    same_as_local(out / "pp0", local_split / "pp0")

    got = [e for e in hub.log if e.origin == "cdn"]
    runs = engine_ranges(model, ref, 0)
    for file, after in ((ranged_file, 5000), (whole_file, 20000)):
        first = runs[file][0][0]
        asked = [e.range for e in got if e.file == file]
        assert asked[0].startswith(f"bytes={first}-") and asked[1].startswith(f"bytes={first + after}-")
    # Nothing was fetched twice: each read resumed exactly where it stopped.
    _, _, sent = cdn_fetches(hub.log)
    assert sent == sum(b - a for r in runs.values() for a, b in r)


def test_interrupted_run_resumes_keeping_what_is_done(hub, hf_home, model, ref, tmp_path, local_split):
    run(["plan", "--pp", PP, REPO], hub=hub, hf_home=hf_home)
    whole, ranges = expected_fetch(model, ref, 3)
    stuck = sorted(ranges)[-1]
    hub.add_fault(Fault(stuck, after=0, times=100, ranged=True))  # never delivers a byte
    out = tmp_path / "out"
    line = one_error_line(run(["--pp", PP, "--rank", 3, REPO, out], hub=hub, hf_home=hf_home, check=False))
    assert stuck in line and "run the same command again" in line
    assert not (out / "pp3" / "model.safetensors.index.json").exists()

    hub.state.faults.clear()
    hub.clear_log()
    run(["--pp", PP, "--rank", 3, REPO, out], hub=hub, hf_home=hf_home)
    same_as_local(out / "pp3", local_split / "pp3")
    again, _, _ = cdn_fetches(hub.log)
    assert again == set()  # every shard by ranges, straight into the stage


def test_a_hub_answering_5xx_falls_back_on_the_cached_commit(hub, hf_home, tmp_path, local_split):
    """As huggingface_hub's resolve_revision does: the Hub down (5xx on resolving the revision,
    every retry), the commit refs/main names, and what was kept for it, serve the run."""
    run(["plan", "--pp", PP, REPO], hub=hub, hf_home=hf_home)
    hub.add_fault(Fault(path=f"/api/models/{REPO}/revision/main", status=500, times=99))
    hub.clear_log()
    run(["--pp", PP, "--rank", 1, REPO, tmp_path / "out"], hub=hub, hf_home=hf_home)
    same_as_local(tmp_path / "out" / "pp1", local_split / "pp1")
    assert [e.status for e in hub.log if "/revision/" in e.path] == [500]


def test_a_damaged_kept_file_list_is_fetched_again(hub, hf_home, tmp_path, local_split):
    run(["plan", "--pp", PP, REPO], hub=hub, hf_home=hf_home)
    kept = list(Path(hf_home).rglob("files.json"))
    assert kept
    for path in kept:
        path.write_bytes(b'{"model.safetensors.index.json": \xff')  # torn, not even UTF-8
    run(["--pp", PP, "--rank", 1, REPO, tmp_path / "out"], hub=hub, hf_home=hf_home)
    same_as_local(tmp_path / "out" / "pp1", local_split / "pp1")
    assert all(isinstance(json.loads(path.read_bytes()), dict) for path in kept)


# --------------------------------------------------------------------------- Hub faults (issue 23)

SIGNED = ("X-Amz-Signature", "Expires=")  # what the CDN address's query string carries


def no_secrets(proc) -> None:
    text = proc.stdout + proc.stderr
    assert not [s for s in SIGNED if s in text], text
    assert "Traceback" not in text


def test_5xx_and_429_on_every_request_are_retried_and_logged(hub, hf_home, model, ref, tmp_path, local_split):
    """One 5xx or 429 answer to any request (resolving the revision, a small file, a header's
    ranged read, a shard downloaded whole) is retried with backoff, each retry a line on
    stderr; the run succeeds. Before: one 503 or 500 on a whole download failed the run at
    once (huggingface_hub retries a download's GET only on 408/429), as did one on resolving."""
    whole, ranges = expected_fetch(model, ref, 0)
    w503, w500 = sorted(whole)[:2]
    ranged = sorted(ranges)[0]
    hub.add_fault(Fault(path=f"/api/models/{REPO}/revision/main", status=503))
    hub.add_fault(Fault(path=r"/resolve/[0-9a-f]{40}/tokenizer\.json$", status=503))  # its HEAD
    hub.add_fault(Fault("config.json", status=502))
    hub.add_fault(Fault(ranged, status=429, ranged=True))  # its header, while planning
    hub.add_fault(Fault(w503, status=503, ranged=True))  # its header, or its data
    hub.add_fault(Fault(w500, status=500, ranged=True))
    out = tmp_path / "out"
    proc = run(["--pp", PP, "--rank", 0, REPO, out], hub=hub, hf_home=hf_home)
    same_as_local(out / "pp0", local_split / "pp0")
    no_secrets(proc)
    retries = [line for line in proc.stderr.splitlines() if "retrying in" in line]
    for where, status in (
        ("revision 'main'", 503),
        ("config.json", 502),
        (ranged, 429),
        (w503, 503),
        (w500, 500),
    ):
        assert [r for r in retries if where in r and f"answered {status}" in r and "(retry 1 of 5)" in r], (
            where,
            proc.stderr,
        )
    assert not any(f.times for f in hub.state.faults)  # every fault was met
    tokenizer = [(e.method, e.status) for e in hub.log if e.path.endswith("/tokenizer.json")]
    assert tokenizer[0] == ("HEAD", 503) and ("GET", 200) in tokenizer
    gets = [e for e in hub.log if e.origin == "cdn" and e.method == "GET"]
    assert [e.status for e in gets if e.file == w503][:2] == [503, 206]
    assert [e.status for e in gets if e.file == w500][:2] == [500, 206]


def test_a_reset_while_the_index_downloads_is_retried(hub, hf_home, tmp_path, local_split):
    """A TCP reset on the index's requests is retried like every other download's (issue 44);
    the run succeeds. Before: the start ended, "unreachable (ReadError)"."""
    index = r"/resolve/[0-9a-f]{40}/model\.safetensors\.index\.json$"
    hub.add_fault(Fault(path=index, reset=True, times=2))
    out = tmp_path / "out"
    proc = run(["--pp", PP, "--rank", 1, REPO, out], hub=hub, hf_home=hf_home)
    same_as_local(out / "pp1", local_split / "pp1")
    assert not any(f.times for f in hub.state.faults)  # both resets were met
    retries = [r for r in proc.stderr.splitlines() if "retrying in" in r and "safetensors.index.json" in r]
    assert len(retries) == 2 and "the connection failed" in retries[0], proc.stderr


def test_a_hub_that_keeps_failing_is_one_line_without_the_signed_address(hub, hf_home, model, ref, tmp_path):
    """Retries are bounded (5, then one error line), and no message names the presigned CDN
    address: before, the error line quoted it, signature and all."""
    whole, _ = expected_fetch(model, ref, 0)
    stuck = sorted(whole)[0]
    hub.add_fault(Fault(stuck, status=503, times=100, ranged=True))
    proc = run(["--pp", PP, "--rank", 0, REPO, tmp_path / "out"], hub=hub, hf_home=hf_home, check=False)
    line = one_error_line(proc)
    no_secrets(proc)
    assert stuck in line and "6 failures in a row, the last: the server answered 503" in line
    assert len([r for r in proc.stderr.splitlines() if "retrying in" in r and stuck in r]) == 5
    assert len([e for e in hub.log if e.origin == "cdn" and e.file == stuck]) == 6


def test_errors_and_huggingface_hub_warnings_name_no_signed_address(hub, hf_home, model, ref, tmp_path):
    """A ranged read refused outright (404 from the CDN) is one line naming the file, not the
    signed address; huggingface_hub's own warning about a dropped download names it neither."""
    whole, ranges = expected_fetch(model, ref, 0)
    run(["plan", "--pp", PP, REPO], hub=hub, hf_home=hf_home)
    hub.add_fault(Fault(sorted(whole)[0], after=20000, ranged=False))  # huggingface_hub warns, resumes
    hub.add_fault(Fault(sorted(ranges)[0], status=404, ranged=True))
    proc = run(
        ["--pp", PP, "--rank", 0, "--hf-cache", REPO, tmp_path / "out"], hub=hub, hf_home=hf_home, check=False
    )
    line = one_error_line(proc)
    no_secrets(proc)
    assert sorted(ranges)[0] in line and "refused bytes" in line and "404" in line
    assert f"/{sorted(ranges)[0]}?...'" in line  # the address named, its query string not
    assert "Error while downloading from http://127.0.0.1" in proc.stderr  # the warning is there, redacted


def test_verify_source_repo_on_a_node_without_the_shards(hub, hf_home, model, ref, tmp_path):
    """The node that received a stage checks it against the repo with an empty cache: the
    shards it needs are fetched (those needed in part by ranges), or, offline, one line names
    what is missing. Before: a FileNotFoundError traceback (a clone's header was read from
    the cache), exit 1, nothing on stdout under --json."""
    out = tmp_path / "out"
    run(["--pp", PP, "--rank", 2, REPO, out], hub=hub, hf_home=hf_home)
    elsewhere = tmp_path / "other-node"
    elsewhere.mkdir()
    hub.clear_log()
    proc = run(["verify", out / "pp2", "--source", REPO, "--json"], hub=hub, hf_home=elsewhere)
    report = json.loads(proc.stdout)
    assert report["status"] == "ok", report["findings"]
    whole, ranges = expected_fetch(model, ref, 2)
    got_whole, got_ranges, _ = cdn_fetches(hub.log)
    assert got_whole == set() and whole | set(ranges) <= set(got_ranges)

    offline = tmp_path / "offline-node"
    offline.mkdir()
    run(["plan", "--pp", PP, REPO], hub=hub, hf_home=offline)  # headers kept, no shard
    proc = run(
        ["verify", out / "pp2", "--source", REPO, "--json"],
        hub=hub,
        hf_home=offline,
        env={"HF_HUB_OFFLINE": "1"},
        check=False,
    )
    line = one_error_line(proc)
    assert "offline" in line and all(f in line for f in whole | set(ranges))
    assert json.loads(proc.stdout)["status"] == "error"


def test_a_mirror_that_lists_no_sizes_is_one_line_naming_the_endpoint(hub, hf_home, tmp_path):
    """A mirror that answers the model info without the sizes ``blobs=true`` asks for: one line
    naming HF_ENDPOINT, not a checkpoint said to lack its config."""
    hub.state.ignore_blobs = True
    out = tmp_path / "out"
    proc = run(["--pp", PP, REPO, out], hub=hub, hf_home=hf_home, check=False)
    line = one_error_line(proc)
    assert "gives no file sizes" in line and "HF_ENDPOINT" in line
    assert not out.exists()


def test_offline_with_no_cached_revision_is_one_line(hf_home, tmp_path):
    """Offline, a repo the cache never saw: one line saying so, no traceback."""
    out = tmp_path / "out"
    proc = run(["--pp", PP, REPO, out], hub=None, hf_home=hf_home, env={"HF_HUB_OFFLINE": "1"}, check=False)
    line = one_error_line(proc)
    assert "offline" in line and "revision 'main'" in line
    assert not out.exists()


def test_offline_one_missing_file_is_named_in_the_singular(hub, hf_home, tmp_path):
    """ "lacks 1 file", not "lacks 1 files"."""
    run(["--pp", PP, "--hf-cache", REPO, tmp_path / "all"], hub=hub, hf_home=hf_home)
    for copy in hf_home.rglob("tokenizer.json"):  # the cache's, and the copy kept for planning
        copy.unlink()
    proc = run(
        ["--pp", PP, "--rank", 1, "--offline", REPO, tmp_path / "out"], hub=None, hf_home=hf_home, check=False
    )
    assert "lacks 1 file this run needs: tokenizer.json;" in one_error_line(proc)


def test_credentials_in_hf_endpoint_are_never_printed(hub, hf_home, tmp_path):
    """A mirror named with its credentials (``HF_ENDPOINT=http://user:pass@host``) is named
    without them when it cannot be reached."""
    url = hub.url.replace("http://", "http://mirror-user:s3cret-pass@")
    hub.stop()
    proc = run(["plan", "--pp", PP, REPO], hub=hub, hf_home=hf_home, env={"HF_ENDPOINT": url}, check=False)
    line = one_error_line(proc)
    assert "unreachable" in line and "http://...@127.0.0.1" in line
    assert "s3cret" not in proc.stdout + proc.stderr


def test_sigkill_with_many_streams_in_flight_then_resume(hub, hf_home, model, tmp_path, local_split):
    """A whole split from the repo id, killed (SIGKILL) while 8 ranged reads are in flight
    (parts written in place into the stage files), then run again: every stage equals the
    local split's."""
    run(["plan", "--pp", PP, REPO], hub=hub, hf_home=hf_home)
    hub.set_pacing(rate=100_000, latency=0.05)  # slow enough that the reads overlap for seconds
    hub.reset_peak()
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(PYTHONPATH=str(ROOT), HF_HOME=str(hf_home), HF_ENDPOINT=hub.url, HF_HUB_DISABLE_XET="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "qwen35_reshard", "--pp", str(PP), "--streams", "8", REPO, str(out)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 60
    while hub.state.in_flight < 8 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert hub.state.in_flight >= 8, "never 8 reads in flight"
    proc.kill()
    assert proc.wait(timeout=30) == -signal.SIGKILL, proc.stderr.read().decode()
    proc.stderr.close()
    assert not all((out / f"pp{r}" / "model.safetensors.index.json").exists() for r in range(PP))

    hub.set_pacing()
    run(["--pp", PP, REPO, out], hub=hub, hf_home=hf_home)
    for r in range(PP):
        same_as_local(out / f"pp{r}", local_split / f"pp{r}")


def test_a_shard_needed_whole_is_checked_against_the_hubs_sha256(hub, hf_home, model, ref, tmp_path):
    """A shard every tensor of which the stage needs comes straight into the stage, not through
    the Hugging Face cache: its bytes are hashed as they land and compared with the Hub's LFS
    sha256. A byte that changed on the server (after the Hub named its sha256) fails the run."""
    changed = tmp_path / "changed"
    shutil.copytree(model, changed)
    hub.add_repo("Qwen/Changed", changed)  # the sha256 of each file is taken here
    whole, _ = expected_fetch(model, ref, 0)
    victim = sorted(whole)[0]
    data = bytearray((changed / victim).read_bytes())
    data[-1] ^= 0x01  # a tensor byte: the header (and so the plan) stays the same
    (changed / victim).write_bytes(bytes(data))
    proc = run(
        ["--pp", PP, "--rank", 0, "Qwen/Changed", tmp_path / "out"], hub=hub, hf_home=hf_home, check=False
    )
    line = one_error_line(proc)
    assert victim in line and "not the Hub's (LFS sha256" in line and "run the same command again" in line
    assert not (tmp_path / "out" / "pp0" / "model.safetensors.index.json").exists()
    snapshot = next((hf_home / "hub" / "models--Qwen--Changed" / "snapshots").iterdir())
    assert not (snapshot / victim).exists()  # not through the cache
