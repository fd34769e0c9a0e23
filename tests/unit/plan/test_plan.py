"""The pure plan: placement per runtime, errors for what no rule covers, and file layout.

Expected placement is recomputed from the facts doc by ``ref.owners`` (conftest), never
taken from the code under test.
"""

from __future__ import annotations

import dataclasses
import json
import re
import struct

import pytest

from qwen35_reshard import ReshardError, make_plan, read_checkpoint
from qwen35_reshard.format.names import MTP_ABSENT, MTP_DROPPED, MTP_KEPT
from qwen35_reshard.model.parallelism import Parallelism
from qwen35_reshard.model.runtimes import servable
from qwen35_reshard.plan.planner import stage_tensors
from qwen35_reshard.source.checkpoint import SourceTensor

DSIZE = {"F32": 4, "BF16": 2, "F8_E4M3": 1}

CHECKPOINTS = {
    "fused": {"layout": "fused"},
    "fp8": {"layout": "per_expert_fp8"},
    "per_expert_tied": {"layout": "per_expert", "tied": True},
    "text_only": {"layout": "fused", "text_only": True},
    "text_only_tied_no_mtp": {"layout": "fused", "text_only": True, "tied": True, "mtp": False},
}


@pytest.fixture(scope="module")
def checkpoints(make_checkpoint):
    return {key: read_checkpoint(make_checkpoint(**kw)) for key, kw in CHECKPOINTS.items()}


@pytest.fixture(scope="module")
def dense(ref, make_checkpoint):
    """Twins of ``checkpoints`` that vLLM can serve in more than 2 stages (``ref.servable_attention``)."""
    twin = ref.servable_attention("vllm", 8)
    return {key: read_checkpoint(make_checkpoint(**kw, **twin)) for key, kw in CHECKPOINTS.items()}


def _expected_stages(ref, ckpt, *, partition, runtime, keep_mtp):
    tied = bool(
        ckpt.config.get(
            "tie_word_embeddings", ckpt.config.get("text_config", {}).get("tie_word_embeddings", False)
        )
    )
    has_mtp = any(n.startswith("mtp.") for n in ckpt.tensors)
    stages = [set() for _ in partition]
    dropped = set()
    for name in ckpt.tensors:
        if name.startswith("mtp.") and not keep_mtp:
            dropped.add(name)
            continue
        owners = ref.owners(
            name, partition=partition, runtime=runtime, tied=tied, mtp_kept=has_mtp and keep_mtp
        )
        for r in owners:
            stages[r].add(name)
    return stages, dropped


@pytest.mark.parametrize("keep_mtp", [True, False], ids=["mtp", "no_mtp"])
@pytest.mark.parametrize("pp", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("runtime", ["sglang", "vllm"])
@pytest.mark.parametrize("kind", sorted(CHECKPOINTS))
def test_placement_follows_the_facts_doc(ref, checkpoints, dense, kind, runtime, pp, keep_mtp):
    ckpt = (dense if ref.servable_attention(runtime, pp) else checkpoints)[kind]
    plan = make_plan(ckpt, pp=pp, runtime=runtime, keep_mtp=keep_mtp)
    partition = ref.split(8, pp, runtime)
    expected, dropped = _expected_stages(ref, ckpt, partition=partition, runtime=runtime, keep_mtp=keep_mtp)

    assert list(plan.partition) == partition
    assert plan.launch_env == ref.launch_env(runtime, partition)
    assert len(plan.stages) == pp and [s.rank for s in plan.stages] == list(range(pp))
    assert plan.ranks == tuple(range(pp))
    has_mtp = CHECKPOINTS[kind].get("mtp", True)
    assert plan.mtp == (MTP_ABSENT if not has_mtp else MTP_KEPT if keep_mtp else MTP_DROPPED)
    assert set(plan.dropped) == dropped and len(plan.dropped) == len(dropped)
    start = 0
    for stage, size, names in zip(plan.stages, partition, expected, strict=True):
        assert (stage.start_layer, stage.end_layer) == (start, start + size)
        start += size
        placed = [t.name for t in stage.tensors]
        assert len(placed) == len(set(placed)), "a tensor placed twice in one stage"
        assert set(placed) == names, f"stage {stage.rank}"
        for t in stage.tensors:
            assert t.source is ckpt.tensors[t.name]
            copies = sum(t.name in e for e in expected)
            assert t.replicated == (copies > 1), t.name
    # every source tensor is somewhere, or dropped on purpose
    assert set().union(*expected) | dropped == set(ckpt.tensors)


@pytest.mark.parametrize("pp", [1, 3, 4])
@pytest.mark.parametrize("runtime", ["sglang", "vllm"])
@pytest.mark.parametrize("kind", sorted(CHECKPOINTS))
def test_one_stage_placed_alone_is_the_plans_stage(ref, checkpoints, dense, kind, runtime, pp):
    # What a server rank reading in place uses (serve.in_place_stage): make_plan's stage, in
    # source order, without any stage's files laid out.
    ckpt = (dense if ref.servable_attention(runtime, pp) else checkpoints)[kind]
    partition = ref.split(8, pp, runtime)
    plan = make_plan(ckpt, pp=pp, runtime=runtime, partition=partition)
    order = {name: i for i, name in enumerate(ckpt.tensors)}
    for stage in plan.stages:
        placed = stage_tensors(ckpt, plan.layout, rank=stage.rank)
        assert placed.mtp == plan.mtp
        assert placed.tensors == sorted((t.source for t in stage.tensors), key=lambda s: order[s.name])
    one_more = Parallelism(pp=pp, runtime=runtime, partition=(*partition[:-1], partition[-1] + 1))
    with pytest.raises(ReshardError, match="sums to 9"):
        stage_tensors(ckpt, one_more, rank=0)


def test_fp8_experts_and_scales_travel_with_their_layer(ref, checkpoints):
    ckpt = checkpoints["fp8"]
    plan = make_plan(ckpt, pp=3)
    for stage in plan.stages:
        names = {t.name for t in stage.tensors}
        for layer in range(stage.start_layer, stage.end_layer):
            for j in range(4):
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    base = f"model.language_model.layers.{layer}.mlp.experts.{j}.{proj}"
                    assert {f"{base}.weight", f"{base}.weight_scale_inv"} <= names
        other = {int(m.group(1)) for n in names if (m := ref.LAYER_RE.match(n))}
        assert other == set(range(stage.start_layer, stage.end_layer))
    mtp_experts = {n for n in ckpt.tensors if n.startswith("mtp.layers.0.mlp.experts.")}
    assert len(mtp_experts) == 4 * 3 * 2
    assert mtp_experts <= {t.name for t in plan.stages[-1].tensors}


def test_explicit_partition_overrides_the_default(ref, dense):
    ckpt = dense["fused"]
    for runtime in ("sglang", "vllm"):
        plan = make_plan(ckpt, pp=3, runtime=runtime, partition=[1, 3, 4])
        assert [(s.start_layer, s.end_layer) for s in plan.stages] == [(0, 1), (1, 4), (4, 8)]
        assert plan.launch_env == ref.launch_env(runtime, [1, 3, 4])
        expected, _ = _expected_stages(ref, ckpt, partition=[1, 3, 4], runtime=runtime, keep_mtp=True)
        assert [{t.name for t in s.tensors} for s in plan.stages] == expected


@pytest.mark.parametrize(
    ("pp", "partition"),
    [(3, [2, 2, 2]), (3, [3, 3, 3]), (3, [0, 4, 4]), (3, [4, 4, 0]), (2, [2, 3, 3]), (4, [4, 4])],
    ids=["sum_low", "sum_high", "empty_first", "empty_last", "too_many", "too_few"],
)
def test_invalid_partition_from_the_library_is_refused(checkpoints, pp, partition):
    # The CLI validates --partition; the library's make_plan/reshard(partition=...) must too.
    with pytest.raises(ReshardError, match="partition"):
        make_plan(checkpoints["fused"], pp=pp, partition=partition)


# vLLM cannot serve a pipeline stage with only linear-attention layers (measured on vLLM 0.32.0's
# CPU build: "Workers disagree on supported KV cache layouts"). The tiny checkpoint's full
# attention is at layers 3 and 7.


def _one_line(e: pytest.ExceptionInfo) -> str:
    message = str(e.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("ranks", [None, [2]], ids=["all", "rank2"])
def test_vllm_refuses_a_default_split_with_a_stage_without_full_attention(checkpoints, ranks):
    # Stage 2 (layers 6-7) has layer 7, but the split is one: stage 0 (layers 0-2) makes it unservable.
    with pytest.raises(ReshardError) as e:
        make_plan(checkpoints["fused"], pp=3, runtime="vllm", ranks=ranks)
    message = _one_line(e)
    for needle in (
        "runtime='vllm' cannot serve",
        "default split for pp=3 (partition 3,3,2)",
        "stage 0 (layers 0-2) has only linear-attention layers",
        "measured on vLLM 0.32.0's CPU build",
        "Workers disagree on supported KV cache layouts",
        "the model has 2 full-attention layers: use at most pp=2",
    ):
        assert needle in message, message
    assert "--" not in message  # library terms: the command line maps them to its flags


def test_vllm_refuses_an_explicit_partition_with_a_stage_without_full_attention(checkpoints):
    with pytest.raises(ReshardError) as e:
        make_plan(checkpoints["fused"], pp=2, runtime="vllm", partition=[1, 7])
    message = _one_line(e)
    assert message.startswith("runtime='vllm' cannot serve partition='1,7': stage 0 (layer 0) has only ")
    assert "partition='balanced'" in message and "fewer stages" in message


def test_sglang_accepts_the_splits_vllm_refuses(checkpoints):
    for pp, partition in ((3, None), (3, [3, 3, 2]), (2, [1, 7]), (8, None)):
        plan = make_plan(checkpoints["fused"], pp=pp, runtime="sglang", partition=partition)
        assert len(plan.stages) == pp


@pytest.mark.parametrize("runtime", ["sglang", "vllm"])
def test_every_split_of_the_tiny_checkpoint_is_refused_exactly_when_a_stage_lacks_full_attention(
    checkpoints, runtime
):
    ckpt = checkpoints["fused"]
    types = ckpt.config["text_config"]["layer_types"]
    full = {i for i, t in enumerate(types) if t == "full_attention"}
    assert full == {3, 7}
    refused = 0
    for cuts in range(2**7):  # every split of 8 layers: a cut or none after each of layers 0..6
        bounds = [0, *(i + 1 for i in range(7) if cuts >> i & 1), 8]
        stages = list(zip(bounds[:-1], bounds[1:], strict=True))
        partition = [b - a for a, b in stages]
        lacking = any(not (full & set(range(a, b))) for a, b in stages)
        # One rule: the one --partition balanced chooses by (balance.py) is the one the plan enforces.
        assert (servable(runtime, types, partition) is not None) == (runtime == "vllm" and lacking)
        if runtime == "vllm" and lacking:
            refused += 1
            with pytest.raises(ReshardError, match="has only linear-attention layers"):
                make_plan(ckpt, pp=len(partition), runtime=runtime, partition=partition)
        else:
            make_plan(ckpt, pp=len(partition), runtime=runtime, partition=partition)
    # Servable by vLLM: one cut among layers 3..6 after full attention at 3, or none at all.
    assert refused == (128 - 5 if runtime == "vllm" else 0)


def test_unknown_runtime_is_refused_even_with_a_partition(checkpoints):
    with pytest.raises(ReshardError, match="tgi"):
        make_plan(checkpoints["fused"], pp=2, runtime="tgi")
    with pytest.raises(ReshardError, match="tgi"):
        make_plan(checkpoints["fused"], pp=2, runtime="tgi", partition=[4, 4])


def test_ranks_select_stages_but_every_stage_is_planned(checkpoints):
    plan = make_plan(checkpoints["fused"], pp=4, ranks=[2, 0, 2])
    assert plan.ranks == (0, 2)
    assert [s.rank for s in plan.selected] == [0, 2]
    assert len(plan.stages) == 4
    for bad in (4, -1):
        with pytest.raises(ReshardError, match=f"ranks={bad} is out of range"):
            make_plan(checkpoints["fused"], pp=4, ranks=[bad])


@pytest.mark.parametrize("pp", [0, 9])
def test_bad_pp(checkpoints, pp):
    with pytest.raises(ReshardError, match=r"\bpp\b"):
        make_plan(checkpoints["fused"], pp=pp)


def _with_tensor(ckpt, name, *, nbytes=4):
    extra = SourceTensor(name, ckpt.files[0], "F32", (nbytes // 4,), 10**9, nbytes)
    return dataclasses.replace(ckpt, tensors={**ckpt.tensors, name: extra})


@pytest.mark.parametrize(
    "name",
    [
        "model.language_model.rotary_emb.inv_freq",
        "model.layers_extra.0.weight",
        "visual.blocks.0.norm1.weight",
        "model.language_model.layers.03.input_layernorm.weight",
    ],
)
def test_a_tensor_no_rule_places_is_an_error_naming_it(checkpoints, name):
    with pytest.raises(ReshardError, match=re.escape(repr(name))):
        make_plan(_with_tensor(checkpoints["fused"], name), pp=2)


def test_layer_beyond_num_hidden_layers_is_an_error(checkpoints):
    name = "model.language_model.layers.8.input_layernorm.weight"
    with pytest.raises(ReshardError, match=re.escape(name)):
        make_plan(_with_tensor(checkpoints["fused"], name), pp=2)


def test_a_missing_layer_is_an_error(checkpoints):
    ckpt = checkpoints["fused"]
    kept = {n: t for n, t in ckpt.tensors.items() if ".layers.5." not in n}
    with pytest.raises(ReshardError, match="decoder layer 5"):
        make_plan(dataclasses.replace(ckpt, tensors=kept), pp=2)


def test_missing_lm_head_with_an_untied_config_is_refused(make_checkpoint):
    # config.json says untied but no lm_head ships: a server would run with lm_head unloaded
    # (issue 10; it used to be taken as tied).
    model = make_checkpoint(fresh=True, layout="fused", tied=True)
    config = json.loads((model / "config.json").read_text())
    config["tie_word_embeddings"] = config["text_config"]["tie_word_embeddings"] = False
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ReshardError, match="lacks tensor 'lm_head.weight'"):
        make_plan(read_checkpoint(model), pp=3, keep_mtp=False)


def _parse_header(prefix: bytes):
    (n,) = struct.unpack("<Q", prefix[:8])
    assert len(prefix) == 8 + n
    return json.loads(prefix[8:])


def _check_files(stage, ckpt, *, max_file_bytes=None, max_header_bytes=None):
    count = len(stage.files)
    file_order = {f: i for i, f in enumerate(ckpt.files)}
    for k, f in enumerate(stage.files, start=1):
        assert f.name == f"model-{k:05d}-of-{count:05d}.safetensors"
        if f.layout == "clone":  # the source shard's own bytes, header included
            assert f.header == b"" and f.size == ckpt.file_sizes[f.source_file]
            continue
        header = _parse_header(f.header)
        assert header.pop("__metadata__") == {"format": "pt"}
        assert len(f.header) % 8 == 0
        assert list(header) == [t.name for t in f.tensors]
        pos = 0
        for t in f.tensors:
            s = t.source
            assert header[t.name] == {
                "dtype": s.dtype,
                "shape": list(s.shape),
                "data_offsets": [pos, pos + s.nbytes],
            }
            assert t.out_offset == pos
            assert (len(f.header) + pos) % DSIZE[s.dtype] == 0, f"{t.name} misaligned"
            pos += s.nbytes
        assert f.data_bytes == pos and f.size == len(f.header) + pos
        keys = [(-DSIZE[t.source.dtype], file_order[t.source.file], t.source.offset) for t in f.tensors]
        assert keys == sorted(keys), "not in (alignment, source file, source offset) order"
        if max_file_bytes is not None:
            assert f.size <= max_file_bytes
        if max_header_bytes is not None and len(f.tensors) > 1:
            assert len(f.header) <= max_header_bytes


@pytest.mark.parametrize("kind", ["fused", "fp8"])
def test_stage_files_are_laid_out_aligned_and_in_source_order(checkpoints, kind):
    plan = make_plan(checkpoints[kind], pp=3)
    for stage in plan.stages:
        # Whole-shard clones keep the source's own header; the files the tool lays out are
        # checked here: one gathered file per stage for these small checkpoints.
        assert len([f for f in stage.files if f.layout != "clone"]) == 1
        _check_files(stage, checkpoints[kind])


@pytest.mark.parametrize(("max_file", "max_header"), [(60_000, None), (None, 6_000), ("smallest", None)])
def test_size_limits_cut_stages_into_more_files(checkpoints, max_file, max_header):
    ckpt = checkpoints["fp8"]
    limits = {}
    if max_file == "smallest":  # the largest tensor's own file: every file holds one tensor or few
        with pytest.raises(ReshardError, match=r"pass max_file_bytes=(\d+) or more") as refused:
            make_plan(ckpt, pp=2, max_file_bytes=1)
        max_file = int(re.search(r"max_file_bytes=(\d+) or more", str(refused.value)).group(1))
    if max_file is not None:
        limits["max_file_bytes"] = max_file
    if max_header is not None:
        limits["max_header_bytes"] = max_header
    plan = make_plan(ckpt, pp=2, **limits)
    whole = make_plan(ckpt, pp=2)
    for stage, ref_stage in zip(plan.stages, whole.stages, strict=True):
        assert len(stage.files) > 1
        _check_files(stage, ckpt, max_file_bytes=max_file, max_header_bytes=max_header)
        # same tensors in the same order, just cut differently
        assert [t.name for t in stage.tensors] == [t.name for t in ref_stage.tensors]


def test_plan_is_a_function_of_the_input(make_checkpoint):
    model = make_checkpoint(layout="per_expert_fp8", full_attention_interval=2)
    a = make_plan(read_checkpoint(model), pp=3, runtime="vllm")
    b = make_plan(read_checkpoint(model), pp=3, runtime="vllm")
    assert [(f.name, f.header) for s in a.stages for f in s.files] == [
        (f.name, f.header) for s in b.stages for f in s.files
    ]
