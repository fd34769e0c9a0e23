"""``qwen35-reshard verify``: a clean split passes; each kind of damage is found and named.

Splits are made by the real tool from synthetic checkpoints, then damaged on disk the way
real accidents do it (a flipped byte, a truncated copy, a stale file, an edited index, a
stage copied from another split). Every check goes through ``verify.verify`` and, where the
exit code and output matter, through the real command line.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

import qwen35_reshard
from qwen35_reshard import WriteOptions, cli, loader
from qwen35_reshard.format.digest import XXH128, hexdigest
from qwen35_reshard.verify import verify

INDEX = "model.safetensors.index.json"
MANIFEST = "reshard-stage.json"
RUN_MANIFEST = "reshard.json"
RUN_MARKER = ".reshard-run.json"


# --------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def model(tiny, tmp_path_factory):
    """The default tiny checkpoint: fused experts, MTP, vision tower, 4 shards."""
    return Path(tiny.build_checkpoint(tmp_path_factory.mktemp("src") / "model"))


@pytest.fixture(scope="module")
def model_every_other(tiny, tmp_path_factory):
    """The default tiny checkpoint with full attention in every other layer, as vLLM needs one
    in each stage of a 4-stage split."""
    return Path(tiny.build_checkpoint(tmp_path_factory.mktemp("src") / "model", full_attention_interval=2))


@pytest.fixture(scope="module")
def pristine(model, tmp_path_factory):
    """A pp=4 SGLang split made by the real command, never modified: copy it before damaging."""
    out = tmp_path_factory.mktemp("split") / "out"
    assert cli.main(["--pp", "4", str(model), str(out)]) == 0
    return out


@pytest.fixture
def out(pristine, tmp_path):
    """A private copy of the pristine split that a test may damage."""
    return Path(shutil.copytree(pristine, tmp_path / "out", symlinks=True))


def run_verify(*args: str) -> tuple[int, str, str]:
    """The real command line in a subprocess: (exit code, stdout, stderr)."""
    p = subprocess.run(
        [sys.executable, "-m", "qwen35_reshard", "verify", *map(str, args)], capture_output=True, text=True
    )
    return p.returncode, p.stdout, p.stderr


def kinds(report, kind: str) -> list:
    return [f for f in report.findings if f.kind == kind]


def only(report, kind: str):
    """The single finding of ``report``, which must be of ``kind``."""
    assert [f.kind for f in report.findings] == [kind], report.findings
    return report.findings[0]


def data_file(stage: Path) -> Path:
    return sorted(stage.glob("*.safetensors"))[0]


def laid_out_file(stage: Path) -> Path:
    """A data file whose header the tool wrote (not a whole-shard clone, whose header is the
    source's own and so not held to the writer's rules)."""
    files = json.loads((stage / MANIFEST).read_bytes())["files"]
    return stage / next(n for n, f in sorted(files.items()) if f["layout"] != "clone")


def header_of(path: Path) -> tuple[int, dict]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, json.loads(raw[8 : 8 + n])


def data_bytes(paths) -> int:
    return sum(p.stat().st_size - 8 - header_of(p)[0] for p in paths)


def edit_json(path: Path, change) -> None:
    obj = json.loads(path.read_bytes())
    change(obj)
    path.write_text(json.dumps(obj, indent=2))


def set_file_bytes(stage: Path, file: str, data: bytes) -> None:
    """Replace a data file and record its new size in the manifest (so only the rule under test fails)."""
    (stage / file).write_bytes(data)
    edit_json(stage / MANIFEST, lambda m: m["files"][file].update(bytes=len(data)))


# --------------------------------------------------------------------------- a clean split


def test_clean_split_passes_with_and_without_source(out, model):
    for source in (None, model):
        report = verify(out, source)
        assert report.ok, report.findings
        assert [s.stage for s in report.stages] == ["pp0", "pp1", "pp2", "pp3"]
        assert all(s.complete and s.tensors and s.bytes_hashed for s in report.stages)
        assert report.not_built == []
    # Every data byte of every stage was hashed, and each needed source tensor once.
    assert sum(s.bytes_hashed for s in verify(out).stages) == data_bytes(out.glob("pp*/*.safetensors"))
    assert verify(out, model).source_bytes_hashed == data_bytes(model.glob("*.safetensors"))


def test_cli_ok_exit_0_and_json(out, model):
    code, stdout, stderr = run_verify(out, "--source", model, "--json")
    assert code == 0, stderr
    doc = json.loads(stdout)
    assert doc["status"] == "ok" and doc["findings"] == []
    assert doc["counts"] == {"missing": 0, "extra": 0, "different": 0, "corrupt": 0, "incomplete": 0}
    assert [s["stage"] for s in doc["stages"]] == ["pp0", "pp1", "pp2", "pp3"]
    assert stderr.splitlines()[-1].startswith("verify OK")
    assert "Traceback" not in stderr


def test_single_stage_directory_on_its_own(out, model, tmp_path):
    """A node that received only its stage checks just that directory, wherever it is."""
    node = Path(shutil.copytree(out / "pp2", tmp_path / "node" / "pp2"))
    report = verify(node, model)
    assert report.ok, report.findings
    assert [(s.stage, s.rank) for s in report.stages] == [("pp2", 2)]
    code, _, stderr = run_verify(node)
    assert code == 0, stderr


@pytest.mark.parametrize("runtime", ["sglang", "vllm"])
def test_replicated_tensors_pass_against_source(ref, tiny, tmp_path, runtime):
    """vLLM builds embed_tokens and the vision tower on every rank: replicated on purpose."""
    model = tiny.build_checkpoint(
        tmp_path / "m",
        layout="per_expert_fp8",
        tied=True,
        shard_bytes=150_000,
        **ref.servable_attention(runtime, 3),
    )
    out = tmp_path / "out"
    qwen35_reshard.reshard(model, out, pp=3, runtime=runtime)
    report = verify(out, model)
    assert report.ok, report.findings


def test_text_only_and_single_file_sources(tiny, tmp_path):
    model = tiny.build_checkpoint(tmp_path / "m", text_only=True, single_file=True, mtp=False)
    qwen35_reshard.reshard(model, tmp_path / "out", pp=2, partition=[3, 5])
    assert verify(tmp_path / "out", model).ok


def test_rank_subset_fails_unless_asked_for_and_notes_stages_not_asked(model, tmp_path):
    out = tmp_path / "out"
    assert cli.main(["--pp", "4", "--rank", "1", str(model), str(out)]) == 0
    report = verify(out, model)  # the whole split (issue 29): three stages missing
    assert not report.ok and report.missing_stages == [0, 2, 3]
    assert {f.stage for f in report.findings} == {"pp0", "pp2", "pp3"}
    report = verify(out, model, ranks=[1])
    assert report.ok, report.findings
    assert [s.stage for s in report.stages] == ["pp1"]
    assert report.not_built == [0, 2, 3]


def test_bounded_chunks_give_the_same_answer(out, model):
    """Hashing in 4 KB reads (tensors span many reads, reads span many tensors) agrees."""
    assert verify(out, model, chunk_bytes=4096).ok


# --------------------------------------------------------------------------- damaged data files


def test_flipped_byte_is_different_naming_the_tensor(out, model):
    stage = out / "pp1"
    path = data_file(stage)
    n, header = header_of(path)
    name, info = next((k, v) for k, v in header.items() if k != "__metadata__" and v["data_offsets"][1] > 100)
    raw = bytearray(path.read_bytes())
    raw[8 + n + info["data_offsets"][0] + 5] ^= 0xFF
    path.write_bytes(bytes(raw))
    report = verify(out)
    f = only(report, "different")
    assert (f.stage, f.file, f.tensor) == ("pp1", path.name, name)
    assert "xxh128" in f.message
    # Against the source the same damaged byte is one problem, not a second one from the
    # source's side; the repair it calls for is the same.
    against = verify(out, model)
    assert [(f.kind, f.tensor) for f in against.findings] == [("different", name)]
    assert "xxh128" in against.findings[0].message and against.repairable
    code, stdout, stderr = run_verify(out)
    assert code == 1 and stderr == ""
    assert name in stdout and stdout.splitlines()[-2].startswith("verify FAILED")
    # The report ends with the command that mends it, naming the source the split records.
    assert stdout.splitlines()[-1].endswith(f"verify {out} --source {model.resolve()} --repair")


def test_bytes_changed_with_manifest_updated_only_source_finds_it(out, model):
    """A manifest can be rewritten to match damaged bytes; the source cannot."""
    stage = out / "pp2"
    path = data_file(stage)
    n, header = header_of(path)
    name, info = next((k, v) for k, v in header.items() if k != "__metadata__")
    begin, end = info["data_offsets"]
    raw = bytearray(path.read_bytes())
    raw[8 + n + begin] ^= 0x01
    path.write_bytes(bytes(raw))
    digest = hexdigest(XXH128, raw[8 + n + begin : 8 + n + end])
    edit_json(stage / MANIFEST, lambda m: m["tensors"][name].update(xxh128=digest))
    assert verify(out).ok
    f = only(verify(out, model), "different")
    assert (f.stage, f.tensor) == ("pp2", name)


def test_truncated_file_is_corrupt(out):
    path = data_file(out / "pp0")
    path.write_bytes(path.read_bytes()[:-10])
    f = only(verify(out), "corrupt")
    assert (f.stage, f.file) == ("pp0", path.name) and "truncated" in f.message


@pytest.mark.parametrize(
    "damage, needle",
    [
        ("trailing", "trailing bytes"),
        ("newline_padding", "padded with bytes other than spaces"),
        ("leading_space", "does not start with '{'"),
        ("duplicate", "appears twice"),
        ("no_format", "format"),
        ("unaligned_start", "not a multiple of 8"),
        ("size_mismatch", "needs"),
        ("overlap", "overlaps"),
    ],
)
def test_strict_header_rules(out, damage, needle):
    """Files the reference reader would accept (or mostly would) but our writer never writes."""
    stage = out / "pp3"
    path = laid_out_file(stage)
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    text, data = raw[8 : 8 + n].rstrip(b" "), raw[8 + n :]
    pad = n - len(text)

    def rebuilt(body: bytes, padding: bytes | None = None) -> bytes:
        body += padding if padding is not None else b" " * (-(8 + len(body)) % 8)
        return struct.pack("<Q", len(body)) + body + data

    if damage == "trailing":
        new = raw + b"\0"
    elif damage == "newline_padding":
        new = rebuilt(text, b"\n" * pad) if pad else rebuilt(text + b"\n" * 8)
    elif damage == "leading_space":
        new = rebuilt(b" " + text)
    elif damage == "duplicate":
        first = json.loads(text)
        name = next(k for k in first if k != "__metadata__")
        entry = json.dumps({name: first[name]}, separators=(",", ":"))[1:-1]
        new = rebuilt(text[:-1] + b"," + entry.encode() + b"}")
    elif damage == "no_format":
        new = rebuilt(text.replace(b'"__metadata__":{"format":"pt"}', b'"__metadata__":{"fmt":"pt"}'))
    elif damage == "unaligned_start":
        new = rebuilt(text, b"" if (8 + len(text)) % 8 else b" ")
    else:
        hdr = json.loads(text)
        name, info = next((k, v) for k, v in hdr.items() if k != "__metadata__" and v["data_offsets"][0] > 0)
        if damage == "size_mismatch":
            info["shape"] = [1]
        else:  # overlap: start one element early, end one element early
            size = 4 if info["dtype"] == "F32" else 2
            info["data_offsets"] = [o - size for o in info["data_offsets"]]
        new = rebuilt(json.dumps(hdr, separators=(",", ":")).encode())
    assert new != raw
    set_file_bytes(stage, path.name, new)
    found = kinds(verify(out), "corrupt")
    assert len(found) == 1 and needle in found[0].message, found
    assert (found[0].stage, found[0].file) == ("pp3", path.name)
    if damage not in ("newline_padding", "no_format", "unaligned_start"):  # the loader's rules too
        with pytest.raises(loader.StageError):
            loader.open_stage(stage)


def test_unaligned_tensor_is_corrupt(tiny, tmp_path):
    """A tensor not at a multiple of its element size: the reference reader lets it through."""
    model = tiny.build_checkpoint(tmp_path / "m")
    add_source_tensor(model, "model.language_model.layers.0.mlp.odd_probe", "BF16", [3], b"abcdef")
    out = tmp_path / "out"
    # One layer per stage: no stage needs the probe's shard whole, so the probe lands in a file
    # the tool laid out (a whole-shard clone keeps its source's header: the writer's rules are
    # not its).
    qwen35_reshard.reshard(model, out, pp=8)
    stage = out / "pp0"
    path = data_file(stage)
    assert json.loads((stage / "reshard-stage.json").read_bytes())["files"][path.name]["layout"] == "gathered"
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    hdr = json.loads(raw[8 : 8 + n])
    meta = hdr.pop("__metadata__")
    # Put the 6-byte BF16 tensor first: every F32 tensor after it is now 2 bytes off.
    items = sorted(hdr.items(), key=lambda kv: (not kv[0].endswith("odd_probe"), kv[1]["data_offsets"][0]))
    body, blob, pos = {"__metadata__": meta}, b"", 0
    for name, v in items:
        b, e = v["data_offsets"]
        body[name] = {**v, "data_offsets": [pos, pos + e - b]}
        blob += raw[8 + n + b : 8 + n + e]
        pos += e - b
    text = json.dumps(body, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    set_file_bytes(stage, path.name, struct.pack("<Q", len(text)) + text + blob)
    found = only(verify(out), "corrupt")
    assert "not a multiple of its 4-byte F32 elements" in found.message


def add_source_tensor(model: Path, name: str, dtype: str, shape: list[int], data: bytes) -> None:
    """Append a tensor to the first shard of a source checkpoint and list it in the index."""
    index = json.loads((model / INDEX).read_bytes())
    shard = sorted(set(index["weight_map"].values()))[0]
    raw = (model / shard).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    hdr, body = json.loads(raw[8 : 8 + n]), raw[8 + n :]
    hdr[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(body), len(body) + len(data)]}
    text = json.dumps(hdr, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    (model / shard).write_bytes(struct.pack("<Q", len(text)) + text + body + data)
    index["weight_map"][name] = shard
    (model / INDEX).write_text(json.dumps(index))


# --------------------------------------------------------------------------- index, files, config


def test_index_missing_is_incomplete(out):
    (out / "pp1" / INDEX).unlink()
    f = only(verify(out), "incomplete")
    assert (f.stage, f.file) == ("pp1", INDEX)
    assert not verify(out).stages[1].complete


def test_manifest_missing_is_incomplete(out):
    (out / "pp1" / MANIFEST).unlink()
    f = only(verify(out), "incomplete")
    assert f.stage == "pp1" and MANIFEST in f.message
    with pytest.raises(loader.StageError):
        loader.open_stage(out, pp_rank=1)


def test_plain_checkpoint_is_not_a_stage(model):
    """A directory with an index but no manifest is never accepted as a finished stage."""
    report = verify(model)
    assert kinds(report, "incomplete") and not report.ok


@pytest.mark.parametrize("layout", ["gathered", "clone"])
def test_a_missing_digest_is_accepted_only_where_blocks_can_be_shared(tiny, tmp_path, layout):
    """``"xxh128": null`` means "shared with the source, never read": only a clone or an
    aligned file can hold such a tensor; anywhere else the manifest is damaged."""
    # Small shards: some are needed whole by a stage (clones), the rest are gathered.
    model = tiny.build_checkpoint(tmp_path / "m", shard_bytes=60_000)
    out = tmp_path / "out"
    qwen35_reshard.reshard(model, out, pp=4)
    stage = out / "pp1"
    manifest = json.loads((stage / MANIFEST).read_bytes())
    file = next(f for f, info in sorted(manifest["files"].items()) if info["layout"] == layout)
    name = next(n for n, t in sorted(manifest["tensors"].items()) if t["file"] == file)
    edit_json(stage / MANIFEST, lambda m: m["tensors"][name].update(xxh128=None))
    if layout == "clone":
        report = verify(out)
        assert report.ok and report.stages[1].bytes_unrecorded == manifest["tensors"][name]["nbytes"]
        assert verify(out, model).ok  # --source compares those bytes with the source
    else:
        f = only(verify(out), "corrupt")
        assert (f.stage, f.file) == ("pp1", MANIFEST) and "xxh128" in f.message


def test_damaged_manifest_is_corrupt(out):
    (out / "pp0" / MANIFEST).write_text("{not json")
    f = only(verify(out), "corrupt")
    assert (f.stage, f.file) == ("pp0", MANIFEST)


def test_index_lists_a_tensor_the_stage_lacks_and_drops_one(out):
    def change(index):
        wm = index["weight_map"]
        dropped = sorted(wm)[0]
        del wm[dropped]
        wm["model.language_model.layers.99.foo.weight"] = next(iter(wm.values()))

    edit_json(out / "pp2" / INDEX, change)
    report = verify(out)
    assert {f.kind for f in report.findings} == {"extra", "missing"}
    assert kinds(report, "extra")[0].tensor == "model.language_model.layers.99.foo.weight"
    assert kinds(report, "missing")[0].file == INDEX


def test_reformatted_index_is_different(out):
    edit_json(out / "pp0" / INDEX, lambda index: None)  # same content, other bytes
    f = only(verify(out), "different")
    assert f.file == INDEX and "not the one" in f.message


def test_stale_safetensors_file_is_extra(out):
    shutil.copy(data_file(out / "pp1"), out / "pp1" / "model-00002-of-00002.safetensors")
    f = only(verify(out), "extra")
    assert (f.stage, f.file) == ("pp1", "model-00002-of-00002.safetensors")


def test_missing_data_file(out):
    path = data_file(out / "pp3")
    path.unlink()
    report = verify(out)
    f = only(report, "missing")
    assert (f.stage, f.file) == ("pp3", path.name)


def test_a_stage_file_leading_out_of_the_stage_is_not_followed(out, tmp_path):
    """A data file symlinked out of the stage and a manifest symlinked to /dev/zero (which
    would never end) are findings; neither verify nor the loader reads through them."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    path = data_file(out / "pp1")
    shutil.move(path, elsewhere / path.name)  # the same bytes, outside the stage
    path.symlink_to(elsewhere / path.name)
    (out / "pp2" / MANIFEST).unlink()
    (out / "pp2" / MANIFEST).symlink_to("/dev/zero")
    report = verify(out)
    assert {(f.stage, f.file, f.kind) for f in report.findings} == {
        ("pp1", path.name, "corrupt"),
        ("pp2", MANIFEST, "corrupt"),
    }
    assert all("outside the directory: not followed" in f.message for f in report.findings)
    with pytest.raises(loader.StageError, match="outside the directory"):
        loader.open_stage(out, pp_rank=1)
    code, _, err = run_verify(out)
    assert code == 1 and "Traceback" not in err


def test_a_stage_file_that_is_no_regular_file_is_not_opened(out):
    """A FIFO in place of config.json would block a reader forever: it is a finding."""
    (out / "pp0" / "config.json").unlink()
    os.mkfifo(out / "pp0" / "config.json")
    proc = subprocess.run(
        [sys.executable, "-m", "qwen35_reshard", "verify", str(out / "pp0")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    assert "config.json: cannot read (not a regular file)" in proc.stdout


def test_a_stage_in_a_hugging_face_cache_snapshot_opens(pristine, tmp_path):
    """A stage uploaded to the Hub and fetched again lives in a cache snapshot whose files are
    symlinks into the repo's blobs/: those are followed, as for a source checkpoint."""
    repo = tmp_path / "models--org--stage"
    snapshot, blobs = repo / "snapshots" / ("0" * 40), repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for path in sorted((pristine / "pp1").iterdir()):
        blob = blobs / hashlib.sha256(path.read_bytes()).hexdigest()
        shutil.copyfile(path, blob)
        (snapshot / path.name).symlink_to(os.path.relpath(blob, snapshot))
    assert verify(snapshot).findings == []
    stage = loader.open_stage(snapshot)
    assert len(list(stage.iter_weights())) == len(stage)


def test_config_changed_or_missing(out, model):
    edit_json(out / "pp0" / "config.json", lambda c: c.update(tie_word_embeddings=True))
    f = only(verify(out), "different")
    assert (f.stage, f.file) == ("pp0", "config.json")
    (out / "pp1" / "config.json").unlink()
    report = verify(out, model)
    assert {(f.kind, f.stage, f.file) for f in report.findings} == {
        ("different", "pp0", "config.json"),
        ("missing", "pp1", "config.json"),
    }


@pytest.mark.timeout(60)
@pytest.mark.parametrize("layers", [2, 10**15], ids=["fewer", "huge"])
def test_config_with_other_num_hidden_layers_is_different(out, layers):
    """A stage config.json naming fewer layers than the stage holds (an IndexError traceback
    before), or 10**15 with no layer_types (a list that never ended), is a finding like any
    changed config: exit 1, one 'different' finding per file, no traceback."""

    def change(config):
        config["text_config"]["num_hidden_layers"] = layers
        del config["text_config"]["layer_types"]

    edit_json(out / "pp3" / "config.json", change)
    code, stdout, stderr = run_verify(out)
    assert code == 1 and "Traceback" not in stderr, stderr
    assert "pp3/config.json differs from the source's config.json" in stdout, stdout
    assert {(f.kind, f.stage, f.file) for f in verify(out).findings} == {("different", "pp3", "config.json")}


def test_side_file_differs_from_source(out, model):
    (out / "pp2" / "tokenizer.json").write_text("{}")
    (out / "pp3" / "generation_config.json").unlink()
    # The stage manifest records every non-weight file's sha256: no source needed to see it.
    for report in (verify(out), verify(out, model)):
        assert sorted((f.kind, f.stage, f.file) for f in report.findings) == [
            ("different", "pp2", "tokenizer.json"),
            ("missing", "pp3", "generation_config.json"),
        ]


def test_leftover_partial_file_is_incomplete(out):
    (out / "pp2" / ".model-00001-of-00001.safetensors.partial").write_bytes(b"x")
    f = only(verify(out), "incomplete")
    assert f.file == ".model-00001-of-00001.safetensors.partial"


# --------------------------------------------------------------------------- the run directory


def test_run_marker_means_incomplete(out):
    shutil.copy(out / RUN_MANIFEST, out / RUN_MARKER)
    (out / RUN_MANIFEST).unlink()
    f = only(verify(out), "incomplete")
    assert f.stage is None and RUN_MARKER in f.message
    # A node checking its own finished stage is not failed by the run beside it.
    assert verify(out / "pp1").ok


def test_run_manifest_missing_is_incomplete(out):
    (out / RUN_MANIFEST).unlink()
    f = only(verify(out), "incomplete")
    assert f.file == RUN_MANIFEST


def test_stage_recorded_complete_but_missing(out):
    shutil.rmtree(out / "pp2")
    f = only(verify(out), "missing")
    assert f.stage == "pp2"


def test_stage_directory_beyond_pp_is_extra(out):
    shutil.copytree(out / "pp3", out / "pp4")
    f = only(verify(out), "extra")
    assert f.stage == "pp4"


def test_stage_moved_to_the_wrong_directory(out):
    os.rename(out / "pp1", out / "tmp")
    os.rename(out / "pp2", out / "pp1")
    os.rename(out / "tmp", out / "pp2")
    report = verify(out)
    assert {(f.kind, f.stage) for f in report.findings} == {("different", "pp1"), ("different", "pp2")}


def test_stage_from_another_split(out, model, tmp_path):
    other = tmp_path / "other"
    qwen35_reshard.reshard(model, other, pp=4, partition=[1, 3, 2, 2])
    shutil.rmtree(out / "pp1")
    shutil.copytree(other / "pp1", out / "pp1")
    report = verify(out)
    assert {(f.kind, f.stage) for f in report.findings} == {("different", "pp1")}
    assert "another split" in report.findings[0].message


# --------------------------------------------------------------------------- against the source


def _claim(stage: Path, **settings) -> None:
    edit_json(stage / MANIFEST, lambda m: m.update(settings))


def test_tensors_on_the_wrong_stage_are_extra(model_every_other, tmp_path):
    """A vLLM stage passed off as SGLang: embed_tokens and model.visual.* are extra on pp1."""
    model = model_every_other
    qwen35_reshard.reshard(model, tmp_path / "v", pp=4, runtime="vllm")
    node = Path(shutil.copytree(tmp_path / "v" / "pp1", tmp_path / "node" / "pp1"))
    _claim(node, runtime="sglang")
    assert verify(node).ok
    report = verify(node, model)
    extra = kinds(report, "extra")
    assert extra and len(extra) == len(report.findings)
    names = {f.tensor for f in extra}
    assert "model.language_model.embed_tokens.weight" in names
    assert all(n.startswith(("model.visual.", "model.language_model.embed_tokens.")) for n in names)
    assert "stage(s) [0, 3]" in next(f for f in extra if "embed_tokens" in f.tensor).message


def test_tensors_missing_from_their_stage(model_every_other, tmp_path):
    """An SGLang stage passed off as vLLM lacks the replicated embed_tokens and vision pos_embed."""
    model = model_every_other
    qwen35_reshard.reshard(model, tmp_path / "s", pp=4)
    node = Path(shutil.copytree(tmp_path / "s" / "pp1", tmp_path / "node" / "pp1"))
    _claim(node, runtime="vllm")
    report = verify(node, model)
    missing = kinds(report, "missing")
    assert missing and len(missing) == len(report.findings)
    assert {f.tensor for f in missing} == {
        "model.language_model.embed_tokens.weight", "model.visual.pos_embed.weight"
    }


def test_files_swapped_within_a_stage_differ_from_the_plan(model, tmp_path):
    """A self-consistent stage whose files are not laid out as the plan says: only the source
    (with the file limits the run identity records) can tell."""
    out = tmp_path / "out"
    qwen35_reshard.reshard(model, out, pp=2, write=WriteOptions(max_file_bytes=150_000))
    stage = out / "pp1"
    a, b = sorted(p.name for p in stage.glob("*.safetensors"))[:2]
    os.rename(stage / a, stage / "tmp")
    os.rename(stage / b, stage / a)
    os.rename(stage / "tmp", stage / b)
    swap = {a: b, b: a}

    def fix_index(index):
        index["weight_map"] = {n: swap.get(f, f) for n, f in index["weight_map"].items()}

    edit_json(stage / INDEX, fix_index)
    index_sha = hashlib.sha256((stage / INDEX).read_bytes()).hexdigest()

    def fix_manifest(m):
        m["files"][a], m["files"][b] = m["files"][b], m["files"][a]
        for info in m["tensors"].values():
            info["file"] = swap.get(info["file"], info["file"])
        m["index_sha256"] = index_sha

    edit_json(stage / MANIFEST, fix_manifest)
    assert verify(out).ok, verify(out).findings
    report = verify(out, model)
    assert {(f.kind, f.stage, f.file) for f in report.findings} == {
        ("different", "pp1", a),
        ("different", "pp1", b),
    }
    assert "header differs from the plan's" in report.findings[0].message


def test_other_checkpoint_with_same_shapes_differs_everywhere(tiny, out, tmp_path):
    """Same config, index and sizes (so the same fingerprint), other bytes: every tensor differs."""
    other = tiny.build_checkpoint(tmp_path / "other", seed=1)
    report = verify(out, other)
    assert {f.kind for f in report.findings} == {"different"}
    assert len(report.findings) == sum(s.tensors for s in report.stages)


def test_other_checkpoint_is_reported(tiny, out, tmp_path):
    other = tiny.build_checkpoint(tmp_path / "other", layers=4)
    report = verify(out, other)
    assert not report.ok
    assert all(f.kind == "different" for f in report.findings)
    assert any("another checkpoint" in f.message for f in report.findings)


def test_no_mtp_split_against_source(model, tmp_path):
    qwen35_reshard.reshard(model, tmp_path / "out", pp=2, write=WriteOptions(keep_mtp=False))
    assert verify(tmp_path / "out", model).ok


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("what", ["missing", "file", "empty"])
def test_bad_target_is_one_line_error(tmp_path, what):
    target = tmp_path / "x"
    if what == "file":
        target.write_text("hi")
    elif what == "empty":
        target.mkdir()
    code, stdout, stderr = run_verify(target, "--json")
    assert code == 2
    assert stderr.count("\n") == 1 and stderr.startswith("error: ") and str(target) in stderr
    assert json.loads(stdout)["status"] == "error"


def test_bad_source_is_one_line_error(out, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{")
    code, _, stderr = run_verify(out, "--source", bad)
    assert code == 2 and stderr.count("\n") == 1 and stderr.startswith("error: ") and "config.json" in stderr
    assert "Traceback" not in stderr


def test_findings_are_plain_data(out):
    (out / "pp0" / INDEX).unlink()
    doc = verify(out).to_dict()
    assert json.loads(json.dumps(doc)) == doc
    assert doc["status"] == "failed" and doc["counts"]["incomplete"] == 1
    assert doc["findings"][0] == {
        "kind": "incomplete",
        "message": doc["findings"][0]["message"],
        "stage": "pp0",
        "file": INDEX,
        "tensor": None,
    }


# JSON that json.loads refuses with other errors than JSONDecodeError: nesting past Python's
# recursion limit (RecursionError), an integer past its 4300-digit limit (ValueError).
UNLOADABLE_JSON = {
    "deep": b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "long_int": b'{"a": ' + b"9" * 5000 + b"}",
}


@pytest.mark.parametrize("body", sorted(UNLOADABLE_JSON))
@pytest.mark.parametrize("file", [MANIFEST, INDEX, "config.json", RUN_MANIFEST, "header"])
def test_json_python_cannot_load_is_a_finding_not_a_traceback(out, file, body):
    """A manifest, index, config, run manifest or safetensors header of crafted JSON: reported
    (verify) or refused (loader) with one line, like any other damaged file."""
    stage = out / "pp0"
    text = UNLOADABLE_JSON[body]
    if file == "header":
        path = laid_out_file(stage)
        text += b" " * (-(8 + len(text)) % 8)
        set_file_bytes(stage, path.name, struct.pack("<Q", len(text)) + text)
        file = path.name
    else:
        (out if file == RUN_MANIFEST else stage).joinpath(file).write_bytes(text)
    report = verify(out)
    assert any(f.file == file for f in report.findings), report.findings
    code, _, stderr = run_verify(out)
    assert code == 1 and stderr == "", stderr
    with pytest.raises(loader.StageError):
        loader.open_stage(out, pp_rank=0)


@pytest.mark.parametrize(
    "damage",
    ["config_is_a_directory", "config_symlink_loop", "data_file_symlink_loop", "side_file_is_a_directory"],
)
@pytest.mark.slow  # a split per case
def test_a_stage_file_that_cannot_be_read_is_a_finding_not_a_traceback(out, model, damage):
    """A stage file in its place but unreadable (a directory, a symlink to itself): reported
    (verify, with and without --source) or refused (loader) in one line naming it."""
    stage = out / "pp0"
    name = {"config": "config.json", "data": laid_out_file(stage).name, "side": "tokenizer.json"}[
        damage.split("_")[0]
    ]
    (stage / name).unlink()
    if damage.endswith("directory"):
        (stage / name).mkdir()
    else:
        (stage / name).symlink_to(name)
    for source in (None, model):
        report = verify(out, source)
        assert any(f.file == name for f in report.findings)  # side files: their recorded sha256
        code, _, stderr = run_verify(out, *(["--source", source] if source else []))
        assert stderr == "" and code == 1, stderr
    if name != "tokenizer.json":  # the loader reads no side file
        with pytest.raises(loader.StageError, match=name):
            loader.open_stage(out, pp_rank=0)


def test_a_file_name_with_a_nul_byte_is_a_damaged_manifest(out):
    """No file can have such a name: the manifest naming one is damaged (not a traceback)."""
    stage = out / "pp0"
    old = laid_out_file(stage).name

    def rename(m):
        m["files"]["x\0.safetensors"] = m["files"].pop(old)
        for t in m["tensors"].values():
            if t["file"] == old:
                t["file"] = "x\0.safetensors"

    edit_json(stage / MANIFEST, rename)
    f = only(verify(out), "corrupt")
    assert (f.stage, f.file) == ("pp0", MANIFEST) and "plain *.safetensors name" in f.message
    with pytest.raises(loader.StageError, match=MANIFEST):
        loader.open_stage(out, pp_rank=0)


def test_a_clone_whose_header_the_reference_reader_refuses_is_corrupt(out):
    """A clone keeps its source's header, so verify holds it to the reference reader's rules at
    least: here its metadata is edited into a list, same length, same tensors and bytes."""
    stage, path = next(
        (stage, stage / name)
        for stage in sorted(out.glob("pp*"))
        for name, f in sorted(json.loads((stage / MANIFEST).read_bytes())["files"].items())
        if f["layout"] == "clone"
    )
    raw = path.read_bytes()
    meta = b'"__metadata__":{"format":"pt"}'
    assert raw.count(meta) == 1
    path.write_bytes(raw.replace(meta, b'"__metadata__":[]'.ljust(len(meta))))
    from safetensors import safe_open

    with pytest.raises(Exception, match="deserializing header"):
        safe_open(str(path), framework="pt")
    f = only(verify(out), "corrupt")
    assert (f.stage, f.file) == (stage.name, path.name) and "__metadata__" in f.message
    with pytest.raises(loader.StageError, match="__metadata__"):
        loader.open_stage(stage)


def test_a_manifest_listing_a_data_file_without_tensors_is_damaged(out, model):
    """The writer never writes a data file without tensors; a manifest listing one (here beside
    a matching empty file) is damaged: verify says so, with or without --source, and the loader
    refuses it at open rather than failing while loading."""
    stage = out / "pp0"
    body = b'{"__metadata__":{"format":"pt"}}'
    body += b" " * (-(8 + len(body)) % 8)
    empty = struct.pack("<Q", len(body)) + body
    (stage / "model-99999-of-99999.safetensors").write_bytes(empty)
    edit_json(
        stage / MANIFEST,
        lambda m: m["files"].update(
            {"model-99999-of-99999.safetensors": {"bytes": len(empty), "tensors": 0, "layout": "gathered"}}
        ),
    )
    for source in (None, model):
        f = only(verify(out, source), "corrupt")
        assert (f.stage, f.file) == ("pp0", MANIFEST) and "no tensors" in f.message
    with pytest.raises(loader.StageError, match="no tensors"):
        loader.open_stage(stage)


@pytest.mark.parametrize("mtp", [[], "maybe"])
def test_a_manifest_mtp_other_than_kept_dropped_or_absent_is_damaged(out, model, mtp):
    edit_json(out / "pp3" / MANIFEST, lambda m: m.update(mtp=mtp))
    for source in (None, model):
        f = only(verify(out, source), "corrupt")
        assert (f.stage, f.file) == ("pp3", MANIFEST) and "mtp" in f.message
    with pytest.raises(loader.StageError, match="mtp"):
        loader.open_stage(out, pp_rank=3)
