"""Bad input: one ``error:`` line naming the file, tensor or flag, exit code 2, nothing written.

Each case damages a freshly built synthetic checkpoint the way a real one goes wrong, runs the
real command line, and checks that the output directory holds nothing a server or ``verify``
could take for a finished stage: no stage index, no stage manifest, no run manifest.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from qwen35_reshard import cli

INDEX = "model.safetensors.index.json"


# --------------------------------------------------------------------------- helpers


def run_cli(capsys, *args) -> tuple[int, str, str]:
    """``cli.main`` in this process: (exit code, stdout, stderr). Restores the SIGTERM handler."""
    previous = signal.getsignal(signal.SIGTERM)
    try:
        code = cli.main([str(a) for a in args])
    finally:
        signal.signal(signal.SIGTERM, previous)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_clean_failure(code: int, stdout: str, stderr: str, out: Path, *needles: str) -> None:
    assert code == 2, stderr
    assert "Traceback" not in stderr
    lines = stderr.splitlines()
    assert len(lines) == 1 and stderr.endswith("\n"), stderr
    assert lines[0].startswith("error: "), stderr
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not named in: {lines[0]}"
    assert stdout == ""
    assert_nothing_complete(out)


def assert_nothing_complete(out: Path) -> None:
    """No stage index, stage manifest or run manifest anywhere under OUT."""
    if not out.exists():
        return
    found = [p for p in out.rglob("*") if p.name in (INDEX, "reshard-stage.json", "reshard.json")]
    assert found == [], found


def shards(model: Path) -> list[str]:
    return sorted(set(json.loads((model / INDEX).read_bytes())["weight_map"].values()))


def read_shard(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def write_shard(path: Path, header: dict | bytes, data: bytes, *, pad: bool = True) -> None:
    text = header if isinstance(header, bytes) else json.dumps(header, separators=(",", ":")).encode()
    if pad:
        text += b" " * (-(8 + len(text)) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def tensors_by_offset(header: dict) -> list[tuple[str, dict]]:
    return sorted(
        ((k, v) for k, v in header.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"]
    )


def edit_json(path: Path, change) -> None:
    obj = json.loads(path.read_bytes())
    change(obj)
    path.write_text(json.dumps(obj, indent=2))


def edit_first_shard(model: Path, change) -> str:
    """Apply ``change(header, data) -> (header, data)`` to the first shard; return its name."""
    name = shards(model)[0]
    header, data = read_shard(model / name)
    header, data = change(header, data)
    write_shard(model / name, header, data)
    return name


@pytest.fixture
def model(make_checkpoint):
    """A private tiny checkpoint (8 layers, 4 shards) that the test may damage."""
    return make_checkpoint(fresh=True)


@pytest.fixture
def out(tmp_path):
    return tmp_path / "out"


# --------------------------------------------------------------------------- config and index


def test_config_missing(capsys, model, out):
    (model / "config.json").unlink()
    assert_clean_failure(*run_cli(capsys, "--pp", "2", model, out), out, "config.json", "missing")


def test_config_not_json(capsys, model, out):
    (model / "config.json").write_text('{"text_config": ')
    assert_clean_failure(*run_cli(capsys, "--pp", "2", model, out), out, "config.json", "not valid JSON")


def test_config_without_num_hidden_layers(capsys, model, out):
    edit_json(model / "config.json", lambda c: c["text_config"].pop("num_hidden_layers"))
    assert_clean_failure(*run_cli(capsys, "--pp", "2", model, out), out, "config.json", "num_hidden_layers")


def test_no_weights_at_all(capsys, model, out):
    for name in [*shards(model), INDEX]:
        (model / name).unlink()
    assert_clean_failure(*run_cli(capsys, "--pp", "2", model, out), out, str(model), INDEX)


def test_index_not_json(capsys, model, out):
    (model / INDEX).write_text("[")
    assert_clean_failure(*run_cli(capsys, "--pp", "2", model, out), out, INDEX, "not valid JSON")


def test_index_without_weight_map(capsys, model, out):
    (model / INDEX).write_text('{"metadata": {"total_size": 1}}')
    assert_clean_failure(*run_cli(capsys, "--pp", "2", model, out), out, INDEX, "weight_map")


def test_index_names_a_missing_shard(capsys, model, out):
    gone = shards(model)[2]
    (model / gone).unlink()
    assert_clean_failure(*run_cli(capsys, "--pp", "2", model, out), out, gone, "missing")


@pytest.mark.parametrize("target", ["../x.safetensors", "/etc/passwd", "sub/x.safetensors", ".."])
def test_weight_map_file_name_leaving_the_model_directory(capsys, model, out, target):
    (model.parent / "x.safetensors").write_bytes((model / shards(model)[0]).read_bytes())

    def change(index):
        name = next(iter(index["weight_map"]))
        index["weight_map"][name] = target

    edit_json(model / INDEX, change)
    assert_clean_failure(*run_cli(capsys, "--pp", "2", model, out), out, repr(target), "refusing")


def test_shard_symlink_pointing_outside(capsys, model, out, tmp_path):
    victim = shards(model)[1]
    outside = tmp_path / "elsewhere" / victim
    outside.parent.mkdir()
    shutil.move(model / victim, outside)
    (model / victim).symlink_to(outside)
    assert_clean_failure(
        *run_cli(capsys, "--pp", "2", model, out), out, victim, "outside the model directory"
    )


def test_side_file_symlink_pointing_outside(capsys, model, out, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("not yours")
    (model / "tokenizer.json").unlink()
    (model / "tokenizer.json").symlink_to(secret)
    assert_clean_failure(*run_cli(capsys, "--pp", "2", model, out), out, "tokenizer.json", "outside")


def test_hf_cache_symlink_outside_blobs(capsys, tiny, tmp_path, out):
    snapshot = Path(tiny.build_checkpoint(tmp_path / "hub", hf_cache=True))
    victim = sorted(snapshot.glob("*.safetensors"))[0]
    stolen = tmp_path / "hub" / "stolen.safetensors"  # inside the cache, outside the repo's blobs/
    shutil.copy(victim.resolve(), stolen)
    victim.unlink()
    victim.symlink_to(stolen)
    assert_clean_failure(*run_cli(capsys, "--pp", "2", snapshot, out), out, victim.name, "outside")


def test_hf_cache_symlinks_into_blobs_are_fine(capsys, tiny, tmp_path, out):
    snapshot = Path(tiny.build_checkpoint(tmp_path / "hub", hf_cache=True))
    code, _, stderr = run_cli(capsys, "--pp", "2", snapshot, out)
    assert code == 0, stderr


# --------------------------------------------------------------------------- shard headers


def test_header_length_larger_than_the_file(capsys, model, out):
    name = shards(model)[0]
    raw = (model / name).read_bytes()
    (model / name).write_bytes(struct.pack("<Q", len(raw)) + raw[8:])
    assert_clean_failure(*run_cli(capsys, "--pp", "2", model, out), out, name, "runs past the end")


def test_header_length_over_100_mb(capsys, model, out):
    """A 150 MB (sparse) file whose header claims 100,000,001 bytes: refused before reading it."""
    name = shards(model)[0]
    with open(model / name, "wb") as f:
        f.write(struct.pack("<Q", 100_000_001) + b"{")
        f.truncate(150_000_000)
    assert_clean_failure(*run_cli(capsys, "--pp", "2", model, out), out, name, "100000000-byte limit")


@pytest.mark.parametrize(
    "body, needle",
    [(b'{"a": {"dtype": "BF16",', "not valid JSON"), (b" {}", "does not start with '{'"), (b"[]", "start")],
)
def test_invalid_header_json(capsys, model, out, body, needle):
    name = edit_first_shard(model, lambda h, d: (body, d))
    assert_clean_failure(*run_cli(capsys, "--pp", "2", model, out), out, name, needle)


def test_offsets_overlap(capsys, model, out):
    def change(header, data):
        name, info = tensors_by_offset(header)[1]
        info["data_offsets"] = [o - 2 for o in info["data_offsets"]]
        return header, data

    shard = edit_first_shard(model, change)
    assert_clean_failure(*run_cli(capsys, "--pp", "2", model, out), out, shard, "overlaps")


def test_offsets_leave_a_hole(capsys, model, out):
    def change(header, data):
        for _, info in tensors_by_offset(header)[1:]:
            info["data_offsets"] = [o + 8 for o in info["data_offsets"]]
        return header, data + bytes(8)

    shard = edit_first_shard(model, change)
    assert_clean_failure(*run_cli(capsys, "--pp", "2", model, out), out, shard, "hole")


def test_offsets_run_past_the_end(capsys, model, out):
    shard = edit_first_shard(model, lambda h, d: (h, d[:-8]))
    assert_clean_failure(*run_cli(capsys, "--pp", "2", model, out), out, shard, "past the end")


def test_trailing_bytes_after_the_data(capsys, model, out):
    shard = edit_first_shard(model, lambda h, d: (h, d + b"\0"))
    assert_clean_failure(*run_cli(capsys, "--pp", "2", model, out), out, shard, "trailing")


def test_dtype_times_shape_does_not_match_the_size(capsys, model, out):
    victim = {}

    def change(header, data):
        name, info = tensors_by_offset(header)[0]
        info["shape"] = [info["shape"][0] + 1, *info["shape"][1:]]
        victim["name"] = name
        return header, data

    shard = edit_first_shard(model, change)
    assert_clean_failure(*run_cli(capsys, "--pp", "2", model, out), out, shard, victim["name"], "needs")


def test_unsupported_dtype(capsys, model, out):
    def change(header, data):
        tensors_by_offset(header)[0][1]["dtype"] = "F4"
        return header, data

    shard = edit_first_shard(model, change)
    assert_clean_failure(*run_cli(capsys, "--pp", "2", model, out), out, shard, "'F4'")


def test_duplicate_tensor_name_within_a_shard(capsys, model, out):
    shard = shards(model)[0]
    header, data = read_shard(model / shard)
    name, info = tensors_by_offset(header)[-1]
    text = json.dumps(header, separators=(",", ":"))
    text = text[:-1] + "," + json.dumps({name: info}, separators=(",", ":"))[1:]  # same key, again
    write_shard(model / shard, text.encode(), data)
    assert_clean_failure(*run_cli(capsys, "--pp", "2", model, out), out, shard, repr(name), "twice")


def test_duplicate_tensor_name_across_shards(capsys, model, out):
    first, second = shards(model)[:2]
    h1, d1 = read_shard(model / first)
    name, info = tensors_by_offset(h1)[0]
    b, e = info["data_offsets"]
    h2, d2 = read_shard(model / second)
    h2[name] = {**info, "data_offsets": [len(d2), len(d2) + e - b]}
    write_shard(model / second, h2, d2 + d1[b:e])
    assert_clean_failure(
        *run_cli(capsys, "--pp", "2", model, out), out, f"{name!r} appears in both {first} and {second}"
    )


def test_tensor_that_the_index_lists_in_another_shard(capsys, model, out):
    first, second = shards(model)[:2]
    victim = next(n for n, f in json.loads((model / INDEX).read_bytes())["weight_map"].items() if f == second)
    edit_json(model / INDEX, lambda index: index["weight_map"].update({victim: first}))
    result = run_cli(capsys, "--pp", "2", model, out)
    assert_clean_failure(*result, out, f"{second}: holds tensor {victim!r}", f"lists it in {first}")


def test_tensor_in_a_shard_that_the_index_does_not_list(capsys, model, out):
    victim = sorted(json.loads((model / INDEX).read_bytes())["weight_map"])[5]
    edit_json(model / INDEX, lambda index: index["weight_map"].pop(victim))
    assert_clean_failure(*run_cli(capsys, "--pp", "2", model, out), out, repr(victim), "does not list it")


def test_index_entry_missing_from_its_shard(capsys, model, out):
    ghost = "model.language_model.layers.0.mlp.ghost.weight"
    edit_json(model / INDEX, lambda index: index["weight_map"].update({ghost: shards(model)[0]}))
    assert_clean_failure(*run_cli(capsys, "--pp", "2", model, out), out, repr(ghost), INDEX)


# --------------------------------------------------------------------------- layers and the split


def test_layer_id_at_or_above_num_hidden_layers(capsys, model, out):
    edit_json(model / "config.json", lambda c: c["text_config"].update(num_hidden_layers=6))
    assert_clean_failure(*run_cli(capsys, "--pp", "2", model, out), out, "layers.6.", "num_hidden_layers=6")


def test_layer_with_no_tensors(capsys, model, out):
    edit_json(model / "config.json", lambda c: c["text_config"].update(num_hidden_layers=9))
    assert_clean_failure(*run_cli(capsys, "--pp", "2", model, out), out, "decoder layer 8 has no tensors")


@pytest.mark.parametrize("entry", [["full_attention"], {"type": "full_attention"}, None])
def test_layer_types_entry_that_is_no_name(capsys, model, out, entry):
    edit_json(model / "config.json", lambda c: c["text_config"]["layer_types"].__setitem__(3, entry))
    assert_clean_failure(*run_cli(capsys, "--pp", "2", model, out), out, "layer_types must list 8 entries")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("partition", [[], ["--partition", "balanced"]])
def test_num_hidden_layers_far_beyond_the_weights(capsys, model, out, partition):
    """A config naming 10**15 layers fails on the first layer the weights lack, at once: not
    after walking every layer id it names (which never ended), nor out of memory (balanced)."""

    def change(config):
        config["text_config"].update(num_hidden_layers=10**15)
        del config["text_config"]["layer_types"]

    edit_json(model / "config.json", change)
    result = run_cli(capsys, "--pp", "2", *partition, model, out)
    assert_clean_failure(*result, out, "decoder layer 8 has no tensors", f"of {10**15} layers")


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("where", "key", "needle"),
    [
        ("text_config", "num_experts", "'mtp.layers.0.mlp.experts.4.gate_proj.weight'"),
        ("text_config", "mtp_num_hidden_layers", "'mtp.layers.1."),
        ("vision_config", "depth", "'model.visual.blocks.2."),
    ],
)
def test_repeated_module_count_far_beyond_the_weights(capsys, model, out, where, key, needle):
    """A count of experts, MTP layers or vision blocks no checkpoint could hold is told as the
    first tensor missing, at once: the schema walk does not list 10**12 modules first."""
    edit_json(model / "config.json", lambda c: c[where].update({key: 10**12}))
    assert_clean_failure(*run_cli(capsys, "--pp", "2", model, out), out, needle, "which config.json requires")


@pytest.mark.parametrize("pp", ["9", "0"])
def test_pp_out_of_range(capsys, make_checkpoint, out, pp):
    model = make_checkpoint()
    assert_clean_failure(*run_cli(capsys, "--pp", pp, model, out), out, "--pp")


@pytest.mark.parametrize("partition", ["1,2,5", "a,b", "0,8", "3,3", "4,4,", "-1,9", ""])
def test_bad_partition(capsys, make_checkpoint, out, partition):
    model = make_checkpoint()
    code, stdout, stderr = run_cli(capsys, "--pp", "2", f"--partition={partition}", model, out)
    assert_clean_failure(code, stdout, stderr, out, "--partition", partition)


@pytest.mark.parametrize("command", [[], ["--dry-run"], ["plan"]], ids=["split", "dry_run", "plan"])
@pytest.mark.parametrize("existing", [False, True], ids=["absent", "empty"])
def test_vllm_split_with_a_stage_without_full_attention(capsys, make_checkpoint, out, command, existing):
    # The tiny checkpoint's full attention is at layers 3 and 7; vLLM needs it in every stage.
    model = make_checkpoint()
    if existing:
        out.mkdir()
    target = [] if command == ["plan"] else [out]
    cases = [
        (
            ["--pp", "3"],
            ["--runtime vllm", "--pp 3 (partition 3,3,2)", "stage 0 (layers 0-2)", "at most --pp 2"],
        ),
        (
            ["--pp", "2", "--partition", "1,7"],
            ["--runtime vllm", "--partition 1,7", "stage 0 (layer 0)", "--partition balanced picks"],
        ),
    ]
    for args, needles in cases:
        code, stdout, stderr = run_cli(capsys, *command, *args, "--runtime", "vllm", model, *target)
        needles += ["only linear-attention layers", "vLLM 0.32.0", "Workers disagree on supported KV"]
        assert_clean_failure(code, stdout, stderr, out, *needles)
        assert out.exists() == existing and (not existing or os.listdir(out) == [])
    # The same splits for SGLang are planned.
    code, _, stderr = run_cli(capsys, "plan", "--pp", "2", "--partition", "1,7", model)
    assert code == 0, stderr


def test_bad_rank(capsys, make_checkpoint, out):
    model = make_checkpoint()
    assert_clean_failure(*run_cli(capsys, "--pp", "2", "--rank", "2", model, out), out, "--rank 2")


def test_tensor_that_no_rule_places(capsys, model, out):
    stray = "model.language_model.rotary_emb.inv_freq"

    def rename(header, data):
        old, info = tensors_by_offset(header)[0]
        del header[old]
        header[stray] = info
        index_path = model / INDEX
        edit_json(index_path, lambda index: index["weight_map"].update({stray: index["weight_map"].pop(old)}))
        return header, data

    edit_first_shard(model, rename)
    assert_clean_failure(*run_cli(capsys, "--pp", "2", model, out), out, repr(stray), "no placement rule")


@pytest.mark.parametrize("where", ["inside", "equal"])
def test_out_inside_model_or_equal(capsys, make_checkpoint, where):
    model = make_checkpoint(fresh=True)
    out = model / "split" if where == "inside" else model
    before = sorted(p.name for p in model.iterdir())
    code, stdout, stderr = run_cli(capsys, "--pp", "2", model, out)
    assert_clean_failure(code, stdout, stderr, model / "split", "OUT", "inside MODEL")
    assert sorted(p.name for p in model.iterdir()) == before


def test_out_inside_model_through_a_symlink(capsys, make_checkpoint, tmp_path):
    model = make_checkpoint(fresh=True)
    link = tmp_path / "link"
    link.symlink_to(model)
    code, stdout, stderr = run_cli(capsys, "--pp", "2", model, link / "out")
    assert_clean_failure(code, stdout, stderr, model / "out", "inside MODEL")


# --------------------------------------------------------------------------- pickled weights


class _Trap:
    """Unpickling this creates a directory: proof that something loaded the pickle."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


@pytest.mark.parametrize("names", [["pytorch_model.bin"], ["consolidated.pt"], ["a.bin", "b.pt"]])
def test_pickled_weights_only_are_refused_never_loaded(capsys, make_checkpoint, tmp_path, out, names):
    model = make_checkpoint(fresh=True)
    for name in [*shards(model), INDEX]:
        (model / name).unlink()
    marker = tmp_path / "unpickled"
    for name in names:
        (model / name).write_bytes(pickle.dumps(_Trap(marker)))
    code, stdout, stderr = run_cli(capsys, "--pp", "2", model, out)
    assert_clean_failure(code, stdout, stderr, out, "pickled", names[0])
    assert not marker.exists()


def test_index_naming_pickled_files_is_refused(capsys, model, out, tmp_path):
    marker = tmp_path / "unpickled"
    (model / "pytorch_model-00001-of-00001.bin").write_bytes(pickle.dumps(_Trap(marker)))
    edit_json(
        model / INDEX,
        lambda index: index["weight_map"].update(
            dict.fromkeys(index["weight_map"], "pytorch_model-00001-of-00001.bin")
        ),
    )
    assert_clean_failure(
        *run_cli(capsys, "--pp", "2", model, out), out, "pytorch_model-00001-of-00001.bin", "pickled"
    )
    assert not marker.exists()


# --------------------------------------------------------------------------- the real entry point


def test_real_process_json_and_existing_out_untouched(model, tmp_path):
    """Through ``python -m qwen35_reshard``: one line on stderr, a JSON error on stdout, and an
    existing (empty) OUT left without anything that looks complete."""
    (model / "config.json").write_text("{")
    out = tmp_path / "out"
    out.mkdir()
    p = subprocess.run(
        [sys.executable, "-m", "qwen35_reshard", "--pp", "2", "--json", str(model), str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2
    assert p.stderr.count("\n") == 1 and p.stderr.startswith("error: ") and "config.json" in p.stderr
    assert json.loads(p.stdout)["status"] == "error"
    assert list(out.iterdir()) == []
