"""Reading a source never leaves MODEL and never ends in a traceback (issue 29, item 5).

Hugging Face cache folders: a ref is one 40-hex commit, read inside the repo folder and never
shown; the snapshot it names resolves inside the folder; a blob whose bytes no longer hash to
its name is refused as it is copied. Sources that the safetensors reference reader or
transformers would refuse (numbers written ``-0``, JSON that is not plain UTF-8) are refused
here before anything is written, and so are file names no filesystem takes. Each case runs
the real command line in this process (a few in a subprocess, for the real exit path).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from test_bad_input import INDEX, assert_clean_failure, assert_nothing_complete, run_cli, shards

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
COMMIT_NOTE = "40-hex commit"


@pytest.fixture
def cache(tiny, tmp_path) -> Path:
    """A fresh Hugging Face cache repo folder (models--Qwen--Tiny) with refs/main."""
    snapshot = Path(tiny.build_checkpoint(tmp_path / "hub", hf_cache=True))
    return snapshot.parent.parent


@pytest.fixture
def outside(make_checkpoint, tmp_path) -> Path:
    """A valid checkpoint outside the cache: what a planted ref would lead a run to."""
    target = tmp_path / "outside" / "snap"
    shutil.copytree(make_checkpoint(), target, symlinks=True)
    return target


@pytest.fixture
def out(tmp_path):
    return tmp_path / "out"


# --------------------------------------------------------------------------- refs


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(b"../../../outside/snap", id="traversal"),
        pytest.param(None, id="absolute"),  # the outside checkpoint's absolute path
        pytest.param(b"abc\nerror: FORGED line", id="several-lines"),
        pytest.param(b"\xff\xfe\x80PLANTED", id="not-utf8"),
        pytest.param(b"0" * 40 + b"\n\nPLANTED", id="commit-then-more"),
        pytest.param(b"", id="empty"),
    ],
)
def test_garbage_in_a_ref_is_one_line_showing_none_of_it(capsys, cache, outside, out, content):
    if content is None:
        content = str(outside).encode()
    (cache / "refs" / "main").write_bytes(content)
    code, stdout, stderr = run_cli(capsys, "--pp", "2", cache, out)
    assert_clean_failure(code, stdout, stderr, out, "refs/main", COMMIT_NOTE)
    for shown in (b"outside", b"FORGED", b"PLANTED"):
        assert shown not in stderr.encode(errors="surrogateescape")
    assert not out.exists() or not any(out.rglob("*.safetensors"))


def test_a_ref_symlinked_out_of_the_repo_folder_is_not_read(capsys, cache, out, tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("SECRET-CONTENT")
    ref = cache / "refs" / "main"
    ref.unlink()
    ref.symlink_to(secret)
    code, stdout, stderr = run_cli(capsys, "--pp", "2", cache, out)
    assert_clean_failure(code, stdout, stderr, out, "refs/main", "symlink out of the cache repo folder")
    assert "SECRET" not in stderr


def test_a_snapshot_symlinked_out_of_the_repo_folder_is_not_followed(capsys, cache, outside, out):
    commit = (cache / "refs" / "main").read_text()
    snapshot = cache / "snapshots" / commit
    shutil.rmtree(snapshot)
    snapshot.symlink_to(outside, target_is_directory=True)
    code, stdout, stderr = run_cli(capsys, "--pp", "2", cache, out)
    assert_clean_failure(code, stdout, stderr, out, commit, "symlink out of the cache repo folder")


@pytest.mark.parametrize("revision", ["../../outside", "/etc", "refs/../../x"])
def test_a_revision_that_leaves_refs_is_refused(capsys, cache, out, revision):
    code, stdout, stderr = run_cli(capsys, "--pp", "2", "--revision", revision, cache, out)
    assert_clean_failure(code, stdout, stderr, out, "--revision", "not a branch, tag or commit")


def test_a_ref_with_a_final_newline_is_read(capsys, cache):
    commit = (cache / "refs" / "main").read_text()
    (cache / "refs" / "main").write_text(commit + "\n")
    code, stdout, stderr = run_cli(capsys, "plan", "--pp", "2", "--json", cache)
    assert code == 0, stderr
    assert commit in json.loads(stdout)["source"]["path"]


def offline_split(hf_home: Path, out: Path) -> subprocess.CompletedProcess:
    """``--pp 2 --quiet Qwen/Tiny OUT`` in a real process, offline, from the cache in ``hf_home``
    (quiet: the plan, printed before the side files are fetched, is not the point here)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(
        PYTHONPATH=str(ROOT), HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", HF_ENDPOINT="http://127.0.0.1:9"
    )
    return subprocess.run(
        [sys.executable, "-m", "qwen35_reshard", "--pp", "2", "--quiet", "Qwen/Tiny", str(out)],
        capture_output=True, text=True, timeout=120, env=env, cwd=out.parent,
    )  # fmt: skip


def test_a_repo_id_offline_reads_no_planted_ref(tiny, outside, tmp_path):
    """A repo id resolved offline from the cache: huggingface_hub would take the ref's text as
    the commit (``snapshots/../../../outside/snap``); the tool checks the ref first."""
    hf_home = tmp_path / "hf"
    tiny.build_checkpoint(hf_home / "hub", hf_cache=True)
    repo = hf_home / "hub" / "models--Qwen--Tiny"
    (repo / "refs" / "main").write_bytes(b"../../../../outside/snap")
    assert (repo / "snapshots" / "../../../../outside/snap").resolve() == outside.resolve()
    out = tmp_path / "out"
    proc = offline_split(hf_home, out)
    assert_clean_failure(proc.returncode, proc.stdout, proc.stderr, out, "refs/main", COMMIT_NOTE)
    assert "outside" not in proc.stderr


@pytest.mark.parametrize("name", ["tokenizer.json", "config.json", "model-00001-of-00004.safetensors"])
def test_a_repo_id_offline_follows_no_snapshot_file_out_of_the_cache(tiny, tmp_path, name):
    hf_home = tmp_path / "hf"
    snapshot = Path(tiny.build_checkpoint(hf_home / "hub", hf_cache=True))
    # The cache serves a split: shown on a copy, since a run keeps the small files it read (in
    # huggingface_hub's assets folder) and a second run would not open the snapshot's again.
    shutil.copytree(hf_home, tmp_path / "hf-copy", symlinks=True)
    assert offline_split(tmp_path / "hf-copy", tmp_path / "good").returncode == 0
    planted = tmp_path / "planted"
    shutil.copy(snapshot / name, planted)  # the same bytes, outside the cache
    (snapshot / name).unlink()
    (snapshot / name).symlink_to(planted)
    proc = offline_split(hf_home, tmp_path / "out")
    assert_clean_failure(proc.returncode, proc.stdout, proc.stderr, tmp_path / "out", name, "symlink out")


# --------------------------------------------------------------------------- blobs


def test_a_blob_whose_bytes_are_not_its_name_is_refused(capsys, cache, out):
    blob = max((cache / "blobs").iterdir(), key=lambda p: p.stat().st_size)  # a shard
    data = bytearray(blob.read_bytes())
    data[-1] ^= 1  # one flipped bit in the last tensor: the header still reads
    blob.write_bytes(bytes(data))
    code, stdout, stderr = run_cli(capsys, "--pp", "2", "--quiet", cache, out)  # no progress line
    assert_clean_failure(code, stdout, stderr, out, blob.name[:12], "damaged")
    assert_nothing_complete(out)


# --------------------------------------------------------------------------- file names


def _rename_first_shard(model: Path, new: str) -> None:
    index = json.loads((model / INDEX).read_bytes())
    old = shards(model)[0]
    index["weight_map"] = {k: (new if v == old else v) for k, v in index["weight_map"].items()}
    (model / INDEX).write_text(json.dumps(index))


@pytest.mark.parametrize("command", ["split", "plan", "verify"])
def test_a_shard_name_too_long_for_the_filesystem(capsys, make_checkpoint, tmp_path, command):
    model = make_checkpoint(fresh=True)
    out = tmp_path / "out"
    if command == "verify":
        assert run_cli(capsys, "--pp", "2", model, out)[0] == 0
    _rename_first_shard(model, "x" * 300 + ".safetensors")
    args = {
        "split": ["--pp", "2", model, tmp_path / "o2"],
        "plan": ["plan", "--pp", "2", model],
        "verify": ["verify", out, "--source", model],
    }[command]
    assert_clean_failure(*run_cli(capsys, *args), tmp_path / "o2", "too long for the filesystem")


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("\ud800.safetensors", id="lone-surrogate"),
        pytest.param("a\nerror: forged.safetensors", id="line-break"),
    ],
)
def test_a_shard_name_no_filesystem_takes_is_one_line(capsys, make_checkpoint, out, name):
    model = make_checkpoint(fresh=True)
    index = json.loads((model / INDEX).read_bytes())
    old = shards(model)[0]
    index["weight_map"] = {k: (name if v == old else v) for k, v in index["weight_map"].items()}
    (model / INDEX).write_text(json.dumps(index))  # ASCII, escapes: valid JSON for any string
    code, stdout, stderr = run_cli(capsys, "--pp", "2", model, out)
    assert_clean_failure(code, stdout, stderr, out)


def test_a_side_file_name_that_is_not_utf8(capsys, make_checkpoint, out):
    model = make_checkpoint(fresh=True)
    with open(os.path.join(os.fsencode(model), b"notes-\xff.txt"), "wb") as f:
        f.write(b"x")
    code, stdout, stderr = run_cli(capsys, "--pp", "2", model, out)
    assert_clean_failure(code, stdout, stderr, out, "not UTF-8")


# --------------------------------------------------------------------------- what readers refuse


def _rewrite_header(path: Path, edit) -> None:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = edit(raw[8 : 8 + n].rstrip(b" "))
    header += b" " * (-(8 + len(header)) % 8)
    path.write_bytes(struct.pack("<Q", len(header)) + header + raw[8 + n :])


def test_an_offset_written_negative_zero_is_refused(capsys, make_checkpoint, out):
    """Single-file: the shard is copied whole into a stage, -0 and all, where the reference
    reader refuses it (and verify passed it)."""
    from safetensors import SafetensorError, safe_open

    model = make_checkpoint(fresh=True, single_file=True)
    shard = model / "model.safetensors"
    _rewrite_header(shard, lambda h: h.replace(b'"data_offsets":[0,', b'"data_offsets":[-0,', 1))
    with pytest.raises(SafetensorError), safe_open(shard, "np") as f:  # the premise: the reference refuses it
        f.keys()
    code, stdout, stderr = run_cli(capsys, "--pp", "2", model, out)
    assert_clean_failure(code, stdout, stderr, out, "model.safetensors", "-0")


def _transformers_reads(config: Path) -> bool:
    from transformers import PretrainedConfig

    try:
        PretrainedConfig.get_config_dict(str(config.parent))
    except Exception:
        return False
    return True


ENCODINGS = [
    pytest.param(lambda t: t.encode("utf-16"), id="utf-16"),
    pytest.param(lambda t: t.encode("utf-16-le"), id="utf-16-no-bom"),
    pytest.param(lambda t: t.encode("utf-32"), id="utf-32"),
    pytest.param(lambda t: t.encode("utf-8-sig"), id="utf-8-bom"),
    pytest.param(lambda t: t.replace('"', '"\xe9', 1).encode("latin-1"), id="latin-1"),
]


@pytest.mark.parametrize("encode", ENCODINGS)
@pytest.mark.parametrize("name", ["config.json", INDEX])
def test_json_that_is_not_plain_utf8_is_refused(capsys, make_checkpoint, out, name, encode):
    model = make_checkpoint(fresh=True)
    path = model / name
    path.write_bytes(encode(path.read_text(encoding="utf-8")))
    if name == "config.json":
        assert not _transformers_reads(path)  # the premise
    code, stdout, stderr = run_cli(capsys, "--pp", "2", model, out)
    assert_clean_failure(code, stdout, stderr, out, name, "not plain UTF-8")


def test_a_model_path_that_is_not_utf8(capsys, make_checkpoint, tmp_path, out):
    """The manifests record the source's path as JSON text: a path no UTF-8 spells is refused."""
    model = os.fsdecode(os.path.join(os.fsencode(tmp_path), b"model-\xff"))
    shutil.copytree(make_checkpoint(), model)
    code, stdout, stderr = run_cli(capsys, "--pp", "2", model, out)
    assert_clean_failure(code, stdout, stderr, out, "not UTF-8")


@pytest.mark.parametrize("case", ["ref-not-utf8", "name-too-long", "config-utf16"])
def test_real_process_one_line_no_traceback(cache, make_checkpoint, tmp_path, case):
    """The same refusals from a real process: its own stderr encoding and exit path."""
    if case == "ref-not-utf8":
        (cache / "refs" / "main").write_bytes(b"\xff\xfe\x80\nerror: FORGED")
        model = cache
    else:
        model = make_checkpoint(fresh=True)
        if case == "name-too-long":
            _rename_first_shard(model, "x" * 300 + ".safetensors")
        else:
            (model / "config.json").write_bytes((model / "config.json").read_text().encode("utf-16"))
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "qwen35_reshard", "--pp", "2", str(model), str(out)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert_clean_failure(proc.returncode, proc.stdout, proc.stderr, out)
    assert "FORGED" not in proc.stderr
