"""End to end: split synthetic checkpoints with the real naming, through the library and the
real ``qwen35-reshard`` command, and check every output byte against the source.

``check_split`` derives what each stage must hold from the facts doc (``ref.owners``) and
reads both sides with readers that are not the tool's: ``safetensors.safe_open`` for names,
dtypes and shapes, and plain reads at offsets parsed with json/struct for the bytes.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import struct
from pathlib import Path

import pytest

import qwen35_reshard
from qwen35_reshard import ReshardError, WriteOptions
from qwen35_reshard.write import finish

from support.checks import check_split
from support.helpers import run_cli, tree

# Real runs of the command, most of them in a process of their own.
pytestmark = pytest.mark.slow

INDEX = "model.safetensors.index.json"
STAGE_MANIFEST = "reshard-stage.json"
RUN_MANIFEST = "reshard.json"


# --------------------------------------------------------------------------- helpers


def append_tensor(model: Path, shard: str, name: str, dtype: str, shape: list[int], data: bytes) -> None:
    """Add a tensor at the end of a source shard's data and list it in the index."""
    path = model / shard
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header, body = json.loads(raw[8 : 8 + n]), raw[8 + n :]
    header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(body), len(body) + len(data)]}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + body + data)
    index = json.loads((model / INDEX).read_text())
    index["weight_map"][name] = shard
    (model / INDEX).write_text(json.dumps(index, indent=2))


# --------------------------------------------------------------------------- the library

CASES = {
    "fused": {"layout": "fused"},
    "fp8": {"layout": "per_expert_fp8"},
    "per_expert_tied": {"layout": "per_expert", "tied": True},
    "text_only": {"layout": "fused", "text_only": True},
    "text_only_tied": {"layout": "per_expert_fp8", "text_only": True, "tied": True},
}


@pytest.mark.parametrize("runtime", ["sglang", "vllm"])
@pytest.mark.parametrize(
    ("kind", "pp"),
    [
        *((k, pp) for k in ("fused", "fp8") for pp in (1, 2, 3, 4)),
        ("fused", 8),
        ("fp8", 5),
        ("per_expert_tied", 3),
        ("text_only", 3),
        ("text_only_tied", 4),
    ],
)
def test_split_matches_source_and_facts_doc(ref, make_checkpoint, tmp_path, kind, pp, runtime):
    model = make_checkpoint(**CASES[kind], **ref.servable_attention(runtime, pp))
    out = tmp_path / "out"
    done = qwen35_reshard.reshard(model, out, pp=pp, runtime=runtime)
    plan, result = done.plan, done.written
    assert result.built == list(range(pp))
    expected = check_split(ref, model, out, pp=pp, runtime=runtime)
    assert [{t.name for t in s.tensors} for s in plan.stages] == expected


def data_order(path: Path) -> list[str]:
    """Tensor names of a safetensors file in the order of their data."""
    raw = path.read_bytes()
    header = json.loads(raw[8 : 8 + struct.unpack("<Q", raw[:8])[0]])
    header.pop("__metadata__", None)
    return sorted(header, key=lambda n: header[n]["data_offsets"])


@pytest.mark.parametrize(
    ("kind", "runtime", "pp", "ranks", "chunk"),
    [
        ("fused", "vllm", 3, None, 1000),
        ("fp8", "sglang", 4, [1, 3], 4093),
        ("per_expert_tied", "vllm", 2, None, 777),
    ],
)
def test_small_copy_chunks(ref, make_checkpoint, tmp_path, monkeypatch, kind, runtime, pp, ranks, chunk):
    # Real tensors are far larger than the copy chunk: cut the tiny ones across many chunks,
    # with replicated tensors (several destinations) and gaps between the runs a stage reads.
    from qwen35_reshard.transfer.copier import copy_segments
    from qwen35_reshard.write import assemble

    monkeypatch.setattr(assemble, "copy_segments", functools.partial(copy_segments, chunk_bytes=chunk))
    model = make_checkpoint(**CASES[kind], **ref.servable_attention(runtime, pp))
    two = WriteOptions(workers=2)
    qwen35_reshard.reshard(model, tmp_path / "out", pp=pp, runtime=runtime, ranks=ranks, write=two)
    check_split(ref, model, tmp_path / "out", pp=pp, runtime=runtime, ranks=ranks)


def test_layer_straddling_two_shards_and_name_sorted_shards(ref, make_checkpoint, tmp_path):
    # Full attention in every other layer: vLLM needs it in each of the 5 stages.
    model = make_checkpoint(layout="fused", layers=12, shard_bytes=1_000_000, full_attention_interval=2)
    src = ref.read_source(model)
    files_of_layer: dict[int, set[str]] = {}
    for name, t in src.tensors.items():
        if m := ref.LAYER_RE.match(name):
            files_of_layer.setdefault(int(m.group(1)), set()).add(t.file)
    straddling = [i for i, files in files_of_layer.items() if len(files) > 1]
    assert straddling, "precondition: a layer straddles two shards"
    # precondition: inside a shard, layers.1x data comes before lower-numbered layers' data
    layer_order = [
        [int(m.group(1)) for n in data_order(model / shard) if (m := ref.LAYER_RE.match(n))]
        for shard in sorted({t.file for t in src.tensors.values()})
    ]
    assert any(ids != sorted(ids) for ids in layer_order), "precondition: name-sorted shards"

    for runtime in ("sglang", "vllm"):
        out = tmp_path / runtime
        qwen35_reshard.reshard(model, out, pp=5, runtime=runtime)
        expected = check_split(ref, model, out, pp=5, runtime=runtime)
        for i in straddling:
            layer = {n for n in src.tensors if n.startswith(f"model.language_model.layers.{i}.")}
            assert sum(layer <= names for names in expected) == 1
            owner = next(r for r, names in enumerate(expected) if layer <= names)
            manifest = json.loads((out / f"pp{owner}" / STAGE_MANIFEST).read_text())
            assert {manifest["tensors"][n]["source_file"] for n in layer} == files_of_layer[i]


def test_single_file_without_index_layers_10_before_2(ref, make_checkpoint, tmp_path):
    model = make_checkpoint(layout="fused", layers=12, single_file=True)
    assert not (model / INDEX).exists()
    order = data_order(model / "model.safetensors")
    ten = order.index("model.language_model.layers.10.input_layernorm.weight")
    assert ten < order.index("model.language_model.layers.2.input_layernorm.weight")
    qwen35_reshard.reshard(model, tmp_path / "out", pp=3, runtime="vllm")
    check_split(ref, model, tmp_path / "out", pp=3, runtime="vllm")


def test_hf_cache_snapshot(ref, make_checkpoint, tmp_path):
    model = make_checkpoint(layout="per_expert_fp8", hf_cache=True)
    assert model.parent.name == "snapshots" and (model / "config.json").is_symlink()
    assert (model / INDEX).is_symlink()
    qwen35_reshard.reshard(model, tmp_path / "out", pp=2)
    check_split(ref, model, tmp_path / "out", pp=2)


def test_source_on_another_filesystem(ref, make_checkpoint, tmp_path, other_fs_dir):
    # The kernel refuses copy_file_range from tmpfs to tmp_path: every byte takes the fallback.
    model = other_fs_dir / "model"
    shutil.copytree(make_checkpoint(layout="per_expert_fp8"), model)
    run_cli("--pp", 3, model, tmp_path / "out")
    check_split(ref, model, tmp_path / "out", pp=3)
    assert "verify OK" in run_cli("verify", tmp_path / "out", "--source", model).stdout


@pytest.mark.parametrize("runtime", ["sglang", "vllm"])
def test_no_mtp_drops_mtp_on_purpose(ref, make_checkpoint, tmp_path, runtime):
    model = make_checkpoint(layout="fused", **ref.servable_attention(runtime, 3))
    no_mtp = WriteOptions(keep_mtp=False)
    plan = qwen35_reshard.reshard(model, tmp_path / "out", pp=3, runtime=runtime, write=no_mtp).plan
    expected = check_split(ref, model, tmp_path / "out", pp=3, runtime=runtime, keep_mtp=False)
    assert not any(n.startswith("mtp.") for names in expected for n in names)
    embed = "model.language_model.embed_tokens.weight"
    # untied and no MTP: SGLang keeps embed_tokens on the first rank only; vLLM everywhere
    assert [embed in names for names in expected] == (
        [True, False, False] if runtime == "sglang" else [True] * 3
    )
    assert len(plan.dropped) == sum(n.startswith("mtp.") for n in ref.read_source(model).tensors) > 0


def test_mtp_per_expert_experts_go_to_the_last_stage(ref, make_checkpoint, tmp_path):
    # fused main layers, per-expert MTP experts (as in the official BF16 release)
    model = make_checkpoint(layout="fused")
    src = ref.read_source(model)
    mtp_experts = {n for n in src.tensors if re.match(r"mtp\.layers\.0\.mlp\.experts\.\d+\.", n)}
    assert len(mtp_experts) == 4 * 3
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in src.tensors)
    qwen35_reshard.reshard(model, tmp_path / "out", pp=4)
    check_split(ref, model, tmp_path / "out", pp=4)
    held = [
        set(json.loads((tmp_path / "out" / f"pp{r}" / INDEX).read_text())["weight_map"]) for r in range(4)
    ]
    assert mtp_experts <= held[3] and not any(mtp_experts & h for h in held[:3])


def test_explicit_partition(ref, make_checkpoint, tmp_path):
    model = make_checkpoint(layout="per_expert_fp8", **ref.servable_attention("vllm", 3))
    qwen35_reshard.reshard(model, tmp_path / "out", pp=3, runtime="vllm", partition=[4, 1, 3])
    check_split(ref, model, tmp_path / "out", pp=3, runtime="vllm", partition=[4, 1, 3])


def test_empty_tensor_is_copied(ref, make_checkpoint, tmp_path):
    # The format allows empty tensors; one at the very end of a shard's data must not break the copy.
    model = make_checkpoint(fresh=True, layout="fused")
    last_shard = sorted(p.name for p in model.glob("model-*.safetensors"))[-1]
    append_tensor(model, last_shard, "model.language_model.layers.7.mlp.empty_probe", "BF16", [0, 64], b"")
    qwen35_reshard.reshard(model, tmp_path / "out", pp=2)
    check_split(ref, model, tmp_path / "out", pp=2)


def test_only_indexed_weights_and_top_level_side_files_are_carried(ref, make_checkpoint, tmp_path):
    model = make_checkpoint(fresh=True, layout="fused")
    clean = tmp_path / "clean"
    qwen35_reshard.reshard(model, clean, pp=2)
    # stale data beside the real shards: a shard the index does not list, a pickle, a subdir
    (model / "stray.safetensors").write_bytes((model / "model-00001-of-00004.safetensors").read_bytes())
    (model / "pytorch_model.bin").write_bytes(b"not a pickle, never opened")
    (model / "original").mkdir()
    (model / "original" / "params.json").write_text("{}")
    out = tmp_path / "out"
    qwen35_reshard.reshard(model, out, pp=2)
    check_split(ref, model, out, pp=2)
    assert tree(out) == tree(clean)


def test_large_side_files_are_copied_in_chunks_with_digests(ref, make_checkpoint, tmp_path, monkeypatch):
    """A side file larger than a chunk (here: every one, chunks of 7 bytes) is read once, chunk
    by chunk, into all its copies: the same bytes in OUT and in every stage, and the sha256
    each stage manifest and reshard.json record is theirs."""
    model = make_checkpoint(layout="fused")
    monkeypatch.setattr(finish, "SIDE_FILE_CHUNK", 7)
    out = tmp_path / "out"
    qwen35_reshard.reshard(model, out, pp=2)
    check_split(ref, model, out, pp=2)
    side = ref.read_source(model).side_files
    want = {name: hashlib.sha256(data).hexdigest() for name, data in side.items()}
    assert json.loads((out / "reshard.json").read_bytes())["side_files"] == want
    for r in range(2):
        assert json.loads((out / f"pp{r}" / "reshard-stage.json").read_bytes())["side_files"] == want


def test_cli_max_file_size_cuts_stage_files(ref, make_checkpoint, tmp_path):
    model = make_checkpoint(layout="per_expert_fp8")
    out = tmp_path / "out"
    run_cli("--pp", 2, "--max-file-size", "100KB", model, out)
    for r in range(2):
        files = sorted((out / f"pp{r}").glob("*.safetensors"))
        assert len(files) > 2
        for p in files:
            raw = p.read_bytes()
            assert len(raw) - 8 - struct.unpack("<Q", raw[:8])[0] <= 100_000, p
    check_split(ref, model, out, pp=2)


def test_unplaced_tensor_is_an_error_naming_it(make_checkpoint, tmp_path):
    model = make_checkpoint(fresh=True, layout="fused")
    append_tensor(
        model,
        "model-00001-of-00004.safetensors",
        "model.language_model.rotary_emb.inv_freq",
        "F32",
        [4],
        b"\0" * 16,
    )
    with pytest.raises(ReshardError, match=re.escape("'model.language_model.rotary_emb.inv_freq'")):
        qwen35_reshard.reshard(model, tmp_path / "out", pp=2)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    proc = run_cli("--pp", 2, "--json", model, tmp_path / "cli", check=False)
    assert proc.returncode == 2
    assert "error:" in proc.stderr and "model.language_model.rotary_emb.inv_freq" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert json.loads(proc.stdout)["status"] == "error"
    assert not (tmp_path / "cli").exists()


def test_transformers_reads_stage_files_and_config(ref, make_checkpoint, tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig

    for kind in ("fp8", "text_only"):
        model = make_checkpoint(**CASES[kind])
        out = tmp_path / kind
        qwen35_reshard.reshard(model, out, pp=2)
        source = {}
        for shard in sorted(model.glob("*.safetensors")):
            source.update(load_file(shard))
        for r in range(2):
            stage = out / f"pp{r}"
            loaded = {}
            for f in sorted(stage.glob("*.safetensors")):
                loaded.update(load_file(f))
            assert set(loaded) == set(json.loads((stage / INDEX).read_text())["weight_map"])
            for name, t in loaded.items():
                s = source[name]
                assert t.dtype == s.dtype and t.shape == s.shape, name
                assert torch.equal(t.view(torch.uint8), s.view(torch.uint8)), name
            config = AutoConfig.from_pretrained(stage)
            text = getattr(config, "text_config", None) if kind != "text_only" else config
            assert text.num_hidden_layers == 8
        assert any(t.dtype == torch.float8_e4m3fn for t in source.values()) == (kind == "fp8")


def test_two_runs_give_identical_bytes(ref, make_checkpoint, tmp_path):
    model = make_checkpoint(layout="per_expert_fp8", **ref.servable_attention("vllm", 3))
    qwen35_reshard.reshard(model, tmp_path / "a", pp=3, runtime="vllm", write=WriteOptions(workers=1))
    qwen35_reshard.reshard(model, tmp_path / "b", pp=3, runtime="vllm", write=WriteOptions(workers=3))
    run_cli("--pp", 3, "--runtime", "vllm", "--workers", 2, model, tmp_path / "c")
    a = tree(tmp_path / "a")
    assert len([p for p in a if p.endswith(".safetensors")]) >= 3
    assert tree(tmp_path / "b") == a
    assert tree(tmp_path / "c") == a


# --------------------------------------------------------------------------- the command line


@pytest.mark.parametrize(
    ("runtime", "extra", "partition"),
    [("sglang", [], [2, 3, 3]), ("vllm", [], [3, 3, 2]), ("sglang", ["--partition", "1,4,3"], [1, 4, 3])],
)
def test_cli_json_summary(ref, make_checkpoint, tmp_path, runtime, extra, partition):
    model = make_checkpoint(layout="fused", **ref.servable_attention(runtime, 3))
    out = tmp_path / "out"
    proc = run_cli("--pp", 3, "--runtime", runtime, *extra, "--json", model, out)
    summary = json.loads(proc.stdout)  # stdout is the JSON summary and nothing else
    env = ref.launch_env(runtime, partition)
    assert summary["status"] == "ok"
    assert summary["launch_env"] == env
    assert summary["partition"] == partition
    assert [(s["stage"], s["dir"]) for s in summary["stages"]] == [(r, f"pp{r}") for r in range(3)]
    starts = [0, partition[0], partition[0] + partition[1]]
    assert [s["layers"] for s in summary["stages"]] == [
        {"start": a, "end": a + n} for a, n in zip(starts, partition, strict=True)
    ]
    assert env in proc.stderr  # the human output, on stderr
    check_split(ref, model, out, pp=3, runtime=runtime, partition=partition)


def test_cli_results_on_stdout_progress_on_stderr(make_checkpoint, tmp_path):
    proc = run_cli("--pp", 2, make_checkpoint(layout="fused"), tmp_path / "out")
    assert "SGLANG_PP_LAYER_PARTITION=4,4" in proc.stdout
    assert "SGLANG_PP_LAYER_PARTITION" not in proc.stderr and "source bytes" in proc.stderr


def test_cli_rank_builds_only_that_stage(ref, make_checkpoint, tmp_path):
    model = make_checkpoint(layout="per_expert_fp8")
    full = tmp_path / "full"
    run_cli("--pp", 3, model, full)
    out = tmp_path / "node"
    run_cli("--pp", 3, "--rank", 1, model, out)
    check_split(ref, model, out, pp=3, ranks=[1])
    assert tree(out / "pp1") == tree(full / "pp1")
    # the other nodes, later, into the same OUT: the result is the full split
    summary = json.loads(run_cli("--pp", 3, "--rank", 0, "--rank", 2, "--json", model, out).stdout)
    assert summary["result"]["built"] == [0, 2]
    check_split(ref, model, out, pp=3)
    assert tree(out) == tree(full)


def test_cli_no_mtp(ref, make_checkpoint, tmp_path):
    model = make_checkpoint(layout="per_expert_fp8")
    summary = json.loads(run_cli("--pp", 2, "--no-mtp", "--json", model, tmp_path / "out").stdout)
    mtp = sorted(n for n in ref.read_source(model).tensors if n.startswith("mtp."))
    assert summary["mtp"] == "dropped" and sorted(summary["dropped"]) == mtp
    check_split(ref, model, tmp_path / "out", pp=2, keep_mtp=False)


@pytest.mark.parametrize("existing", [False, True], ids=["absent", "empty"])
def test_cli_dry_run_writes_nothing(ref, make_checkpoint, tmp_path, existing):
    model = make_checkpoint(layout="fused", **ref.servable_attention("vllm", 3))
    out = tmp_path / "out"
    if existing:
        out.mkdir()
    before = tree(model)
    proc = run_cli("--pp", 3, "--runtime", "vllm", "--dry-run", "--json", model, out)
    summary = json.loads(proc.stdout)
    assert summary["status"] == "dry_run"
    assert summary["launch_env"] == "VLLM_PP_LAYER_PARTITION=3,3,2"
    assert [s["layers"] for s in summary["stages"]] == [
        {"start": 0, "end": 3},
        {"start": 3, "end": 6},
        {"start": 6, "end": 8},
    ]
    assert "VLLM_PP_LAYER_PARTITION=3,3,2" in proc.stderr
    assert out.exists() == existing and (not existing or os.listdir(out) == [])
    assert tree(model) == before


def test_cli_plan_subcommand(make_checkpoint, tmp_path):
    # Full attention in every other layer: vLLM needs it in each of the 5 stages.
    model = make_checkpoint(layout="fused", layers=12, full_attention_interval=2)
    proc = run_cli("plan", "--pp", 5, "--json", model)
    summary = json.loads(proc.stdout)
    assert summary["launch_env"] == "SGLANG_PP_LAYER_PARTITION=2,2,2,3,3"
    assert len(summary["stages"]) == 5
    proc = run_cli("plan", "--pp", 5, "--runtime", "vllm", model)
    assert "VLLM_PP_LAYER_PARTITION=2,2,3,3,2" in proc.stdout and proc.stderr == ""


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--pp", "3", "--partition", "2,2,2"], "sums to 6"),
        (["--pp", "3", "--partition", "4,4"], "2 entries"),
        (["--pp", "9"], "--pp 9"),
        (["--pp", "2", "--rank", "2"], "--rank 2"),
        (["--pp", "3", "--partition", ""], "integers"),
    ],
)
def test_cli_bad_arguments_fail_cleanly(make_checkpoint, tmp_path, args, needle):
    proc = run_cli(*args, make_checkpoint(layout="fused"), tmp_path / "out", check=False)
    assert proc.returncode == 2
    assert needle in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()
