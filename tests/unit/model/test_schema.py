"""The model's schema (issue 10): every tensor config.json implies, with its shape.

Proven against the real thing: tiny ``Qwen3_5MoeForConditionalGeneration`` and text-only
``Qwen3_5MoeForCausalLM`` models saved by transformers in both expert layouts (and tied) hold
exactly the tensors the schema derives, and removing any single one of them is caught. Then
checkpoints built by ``examples/tiny_checkpoint.py`` (fused, per-expert, FP8, MTP, vision,
text-only, tied) lose one tensor of each class the issue lists and are refused before anything
is written: exit 2, one line naming the tensor and how many others are missing.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration

from qwen35_reshard import loader, make_plan, read_checkpoint
from qwen35_reshard.errors import ReshardError
from qwen35_reshard.model import schema
from qwen35_reshard.source.header import TensorEntry, read_header
from qwen35_reshard.verify import verify

from support.helpers import drop_tensor, drop_tensor_file
from support.tiny_model import DTYPE, IMPL, tiny_config

INDEX = "model.safetensors.index.json"


# --------------------------------------------------------------------------- helpers


def headers(model: Path) -> dict[str, TensorEntry]:
    """name -> header entry (dtype, shape, ...) of every tensor in the model directory's
    safetensors files."""
    out = {}
    for path in sorted(model.glob("*.safetensors")):
        for t in read_header(path, display=str(path)).tensors:
            out[t.name] = t
    return out


def derive(model: Path, present: dict[str, TensorEntry]) -> schema.Schema:
    config = json.loads((model / "config.json").read_bytes())
    return schema.required_tensors(config, present)


def edit_config(model: Path, change) -> None:
    path = model / "config.json"
    config = json.loads(path.read_bytes())
    change(config.get("text_config", config))
    path.write_text(json.dumps(config, indent=2))


def check(model: Path) -> None:
    """Read and plan ``model`` as a dry run does: the source check runs in the plan."""
    make_plan(read_checkpoint(model), pp=2)


def split(model: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "qwen35_reshard", "--pp", "2", str(model), str(out), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


# --------------------------------------------------------------------------- transformers saves


@pytest.fixture(scope="module")
def saves(tmp_path_factory) -> dict[str, Path]:
    """What transformers itself writes: multimodal and text-only, per-expert and fused, tied."""
    root = tmp_path_factory.mktemp("qwen35-schema")
    torch.manual_seed(0)
    config = tiny_config()
    multimodal = Qwen3_5MoeForConditionalGeneration._from_config(config, dtype=DTYPE, **IMPL)
    text = Qwen3_5MoeForCausalLM._from_config(config.text_config, dtype=DTYPE, **IMPL)
    tied_config = config.text_config.__class__(
        **{**config.text_config.to_dict(), "tie_word_embeddings": True}
    )
    tied = Qwen3_5MoeForCausalLM._from_config(tied_config, dtype=DTYPE, **IMPL)
    out = {}
    for name, model in {"multimodal": multimodal, "text": text, "text-tied": tied}.items():
        out[f"{name}/per-expert"] = root / name / "per-expert"
        model.save_pretrained(out[f"{name}/per-expert"], max_shard_size="100KB")
        out[f"{name}/fused"] = root / name / "fused"
        model.save_pretrained(out[f"{name}/fused"], max_shard_size="100KB", save_original_format=False)
    return out


SAVES = [f"{m}/{layout}" for m in ("multimodal", "text", "text-tied") for layout in ("per-expert", "fused")]


@pytest.mark.parametrize("which", SAVES)
def test_transformers_saves_hold_exactly_the_schema(saves, which):
    model = saves[which]
    present = headers(model)
    derived = derive(model, present)
    assert derived.tensors == {n: t.shape for n, t in present.items()}
    assert derived.vision == which.startswith("multimodal") and not derived.mtp
    assert ("lm_head.weight" in derived.tensors) == (not which.startswith("text-tied"))
    prefix = "model.language_model." if which.startswith("multimodal") else "model."
    assert f"{prefix}layers.7.mlp.gate.weight" in derived.tensors
    fused = f"{prefix}layers.0.mlp.experts.gate_up_proj"
    assert (fused in derived.tensors) == which.endswith("fused")
    check(model)  # the whole source check (read, plan) passes


@pytest.mark.parametrize("which", SAVES)
def test_removing_any_single_tensor_of_a_transformers_save_is_caught(saves, which):
    present = headers(saves[which])
    for name in present:
        rest = {n: v for n, v in present.items() if n != name}
        derived = derive(saves[which], rest)
        missing, wrong = schema.compare(derived.tensors, rest)
        assert name in missing and not wrong, name
        # check_complete takes what the walk found under each name instead of looking again
        assert derived.found == [rest.get(n) for n in derived.names], name
        with pytest.raises(ReshardError, match=f"lacks tensor {re.escape(repr(name))}"):
            schema.check_complete(derived, rest, "model")


@pytest.mark.parametrize(
    ("which", "name"),
    [
        ("multimodal/per-expert", "model.language_model.layers.5.mlp.experts.3.down_proj.weight"),
        ("multimodal/fused", "model.language_model.layers.2.mlp.experts.gate_up_proj"),
        ("text/fused", "lm_head.weight"),
        ("multimodal/fused", "model.visual.blocks.1.attn.qkv.bias"),
    ],
)
def test_a_transformers_save_missing_a_tensor_is_refused(saves, tmp_path, which, name):
    model = tmp_path / "model"
    subprocess.run(["cp", "-r", str(saves[which]), str(model)], check=True)
    drop_tensor(model, name)
    with pytest.raises(ReshardError, match=f"'{name}'.*0 others"):
        check(model)


# --------------------------------------------------------------------------- synthetic checkpoints

LM = "model.language_model."
# (build_checkpoint kwargs, tensor to drop): each class of missing tensor the issue lists.
MISSING = {
    "lm_head, untied": ({}, "lm_head.weight"),
    "final norm": ({}, f"{LM}norm.weight"),
    "embed_tokens": ({}, f"{LM}embed_tokens.weight"),
    "router": ({}, f"{LM}layers.5.mlp.gate.weight"),
    "full attention": ({}, f"{LM}layers.3.self_attn.k_norm.weight"),
    "linear attention": ({}, f"{LM}layers.6.linear_attn.A_log"),
    "fused expert tensor": ({}, f"{LM}layers.4.mlp.experts.down_proj"),
    "shared expert": ({}, f"{LM}layers.1.mlp.shared_expert.up_proj.weight"),
    "shared expert gate": ({}, f"{LM}layers.1.mlp.shared_expert_gate.weight"),
    "per-expert down_proj": ({"layout": "per_expert"}, f"{LM}layers.2.mlp.experts.3.down_proj.weight"),
    "fp8 scale": ({"layout": "per_expert_fp8"}, f"{LM}layers.7.mlp.experts.1.gate_proj.weight_scale_inv"),
    "fp8 weight": ({"layout": "per_expert_fp8"}, f"{LM}layers.0.linear_attn.in_proj_qkv.weight"),
    # Kept BF16 by modules_to_not_convert: no scale counts as missing with it ("0 others").
    "bf16 weight of an fp8 checkpoint": (
        {"layout": "per_expert_fp8"},
        f"{LM}layers.2.mlp.shared_expert_gate.weight",
    ),
    "mtp": ({}, "mtp.layers.0.mlp.experts.2.up_proj.weight"),
    "mtp head": ({}, "mtp.pre_fc_norm_hidden.weight"),
    "vision": ({}, "model.visual.blocks.1.mlp.linear_fc2.bias"),
    "text-only layer": (
        {"text_only": True, "layout": "per_expert"},
        "model.layers.0.post_attention_layernorm.weight",
    ),
}


@pytest.mark.parametrize("case", list(MISSING))
def test_each_class_of_missing_tensor_is_refused(make_checkpoint, case):
    kwargs, name = MISSING[case]
    model = make_checkpoint(fresh=True, **kwargs)
    drop_tensor(model, name)
    with pytest.raises(ReshardError) as e:
        check(model)
    assert f"'{name}'" in str(e.value) and "0 others" in str(e.value) and "\n" not in str(e.value)


def test_a_missing_fp8_weight_counts_its_scale_too(make_checkpoint):
    model = make_checkpoint(fresh=True, layout="per_expert_fp8")
    name = f"{LM}layers.3.self_attn.o_proj.weight"
    drop_tensor(model, name)
    drop_tensor(model, name + "_scale_inv")
    with pytest.raises(ReshardError, match=f"'{name}'.*1 other"):
        check(model)


def test_the_cli_refuses_before_writing_anything(make_checkpoint, tmp_path):
    model = make_checkpoint(fresh=True, layout="per_expert")
    name = f"{LM}layers.6.mlp.experts.0.down_proj.weight"
    drop_tensor(model, name)
    drop_tensor(model, f"{LM}layers.7.mlp.gate.weight")
    out = tmp_path / "out"
    r = split(model, out)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: ") and "Traceback" not in r.stderr
    assert f"'{name}'" in r.stderr and "1 other" in r.stderr
    assert not out.exists() and r.stdout == ""


@pytest.mark.parametrize(
    ("kwargs", "change", "name", "expected", "found"),
    [
        (
            {},
            lambda c: c.update(moe_intermediate_size=16),
            f"{LM}layers.0.mlp.experts.gate_up_proj",
            [4, 32, 64],
            [4, 64, 64],
        ),
        ({}, lambda c: c.update(vocab_size=512), f"{LM}embed_tokens.weight", [512, 64], [256, 64]),
        (
            {"layout": "per_expert_fp8"},
            lambda c: c.update(num_key_value_heads=1),
            f"{LM}layers.3.self_attn.k_proj.weight",
            [16, 64],
            [32, 64],
        ),
    ],
)
def test_a_shape_contradicting_the_config_is_refused(make_checkpoint, kwargs, change, name, expected, found):
    model = make_checkpoint(fresh=True, **kwargs)
    edit_config(model, change)
    with pytest.raises(ReshardError) as e:
        check(model)
    assert f"'{name}'" in str(e.value) and str(expected) in str(e.value) and str(found) in str(e.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"layout": "per_expert"},
        {"layout": "per_expert_fp8"},
        {"tied": True},
        {"mtp": False, "vision": False},
        {"text_only": True, "tied": True, "layout": "per_expert_fp8"},
    ],
)
def test_complete_synthetic_checkpoints_hold_exactly_the_schema(make_checkpoint, kwargs):
    model = make_checkpoint(**kwargs)
    present = headers(model)
    assert derive(model, present).tensors == {n: t.shape for n, t in present.items()}


def test_an_unlisted_safetensors_file_is_ignored_with_a_warning(make_checkpoint, tmp_path):
    model = make_checkpoint(fresh=True)
    (model / "model-extra.safetensors").write_bytes(
        (model / sorted(model.glob("model-*"))[0].name).read_bytes()
    )
    ckpt = read_checkpoint(model)
    assert ckpt.unlisted == ("model-extra.safetensors",)
    r = split(model, tmp_path / "out")
    assert r.returncode == 0, r.stderr
    warnings = [line for line in r.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "model-extra.safetensors" in warnings[0]
    assert not list((tmp_path / "out").rglob("model-extra.safetensors"))


# --------------------------------------------------------------------------- stages


def drop_from_stage(stage: Path, name: str) -> None:
    """Remove ``name`` from a finished stage consistently: data file, manifest and index agree,
    as in a stage split from a checkpoint that lacked the tensor (before issue 10)."""
    manifest_path = stage / "reshard-stage.json"
    m = json.loads(manifest_path.read_bytes())
    file = m["tensors"].pop(name)["file"]
    drop_tensor_file(stage / file, name)
    m["files"][file] = {"bytes": (stage / file).stat().st_size, "tensors": m["files"][file]["tensors"] - 1}
    index = json.loads((stage / INDEX).read_bytes())
    del index["weight_map"][name]
    index["metadata"]["total_size"] = sum(t["nbytes"] for t in m["tensors"].values())
    raw = json.dumps(index, indent=2).encode()
    (stage / INDEX).write_bytes(raw)
    m["index_sha256"] = hashlib.sha256(raw).hexdigest()
    manifest_path.write_text(json.dumps(m))


@pytest.mark.parametrize(
    ("runtime", "rank", "name"),
    [
        ("sglang", 1, f"{LM}layers.6.mlp.shared_expert.down_proj.weight"),
        ("sglang", 1, "lm_head.weight"),
        ("sglang", 0, "model.visual.merger.linear_fc1.weight"),
        ("vllm", 1, f"{LM}embed_tokens.weight"),  # vLLM builds embed_tokens on every rank
        ("sglang", 1, "mtp.layers.0.mlp.gate.weight"),
    ],
)
def test_a_stage_lacking_what_its_layers_and_role_need_is_refused(
    make_checkpoint, tmp_path, runtime, rank, name
):
    model = make_checkpoint()
    out = tmp_path / "out"
    r = split(model, out, "--runtime", runtime)
    assert r.returncode == 0, r.stderr
    drop_from_stage(out / f"pp{rank}", name)
    with pytest.raises(loader.StageError, match=f"lacks tensor '{re.escape(name)}' .*needs for its layers"):
        loader.open_stage(out, pp_rank=rank)
    loader.open_stage(out, pp_rank=1 - rank)  # the other stage is fine
    for source in (None, model):
        report = verify(out, source=source)
        assert report.findings[0].tensor == name and "needs for its layers" in report.findings[0].message
        if source is None:  # the stage is otherwise consistent: the schema alone finds it
            assert len(report.findings) == 1, report.findings


def test_an_fp8_scale_of_another_block_shape_is_refused(make_checkpoint):
    model = make_checkpoint(fresh=True, layout="per_expert_fp8")
    path = model / "config.json"
    config = json.loads(path.read_bytes())
    config["quantization_config"]["weight_block_size"] = [32, 32]
    path.write_text(json.dumps(config))
    with pytest.raises(ReshardError) as e:
        check(model)
    msg = str(e.value)
    # in_proj_qkv [256, 64]: [2, 1] blocks of 128, [8, 2] of 32.
    assert f"'{LM}layers.0.linear_attn.in_proj_qkv.weight_scale_inv' has shape [2, 1]" in msg
    assert "config.json implies [8, 2]" in msg and "others with a wrong shape" in msg


def test_a_missing_tensor_of_any_shape_is_missing():
    """A required tensor whose shape the config cannot tell (an FP8 scale without
    weight_block_size) is still required: absent, it is reported, not taken as any shape."""
    present = {"a.weight": TensorEntry("a.weight", "F8_E4M3", (4, 4), 0, 16)}
    assert schema.compare({"a.weight": (4, 4), "a.weight_scale_inv": None}, present) == (
        ["a.weight_scale_inv"],
        [],
    )
    assert schema.compare({"a.weight": None}, present) == ([], [])
    assert schema.compare({"a.weight": (4, 8)}, present) == ([], [("a.weight", (4, 8), (4, 4))])
