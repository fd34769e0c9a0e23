"""Fused experts cut per expert as byte ranges of the source (plan/experts.py): the bytes of each
exploded tensor, read from a real safetensors file, equal torch's slicing of the fused tensor
(gate = t[e, :I], up = t[e, I:], down = t[e], I the intermediate size); per-expert tensors are
kept or dropped by the node's experts, scales of every expert kept."""

from __future__ import annotations

import doctest

import pytest
import torch
from safetensors.torch import save_file

from qwen35_reshard.errors import BadInput
from qwen35_reshard.model import experts as names_module
from qwen35_reshard.model.experts import (
    ExpertTensor,
    MoeLayer,
    expert_tensor,
    expert_tensors,
    experts_by_layer,
)
from qwen35_reshard.plan import experts as experts_module
from qwen35_reshard.plan.experts import explode, node_expert_tensors, nodes_expert_tensors
from qwen35_reshard.source.checkpoint import SourceTensor
from qwen35_reshard.source.header import read_header

E, INTER, H, BLOCK = 6, 8, 12, 4
LM = "model.language_model.layers.2.mlp.experts."
OTHER = "model.language_model.layers.5.mlp.experts."  # a per-expert layer


def test_module_examples_run():
    assert doctest.testmod(experts_module).failed == 0
    assert doctest.testmod(names_module).failed == 0


def source_tensors(path) -> dict[str, SourceTensor]:
    header = read_header(path)
    c = header.columns
    return {
        n: SourceTensor(n, str(path), d, s, header.data_start + b, e - b)
        for n, d, s, b, e in zip(c.names, c.dtypes, c.shapes, c.begins, c.ends, strict=True)
    }


def read_bytes(t: SourceTensor) -> bytes:
    with open(t.file, "rb") as f:
        f.seek(t.offset)
        return f.read(t.nbytes)


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.fixture
def fused(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "model.language_model.embed_tokens.weight": torch.randn(5, H, generator=g, dtype=torch.bfloat16),
        LM + "gate_up_proj": torch.randn(E, 2 * INTER, H, generator=g).to(torch.bfloat16),
        LM + "down_proj": torch.randn(E, H, INTER, generator=g).to(torch.bfloat16),
        LM + "gate_up_proj_scale_inv": torch.randn(E, 2 * INTER // BLOCK, H // BLOCK, generator=g),
        LM + "down_proj_scale_inv": torch.randn(E, H // BLOCK, INTER // BLOCK, generator=g),
        "mtp.layers.0.mlp.experts.gate_up_proj": torch.randn(E, 2 * INTER, H, generator=g).to(torch.bfloat16),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    return tensors, source_tensors(path)


def test_exploded_bytes_equal_torch_slices(fused):
    tensors, src = fused
    local = {1, 4, 5}
    out = node_expert_tensors(list(src.values()), lambda layer: local, scale_block=BLOCK)
    by_name = {t.name: t for t in out}
    gate_up, down = tensors[LM + "gate_up_proj"], tensors[LM + "down_proj"]
    gate_up_s, down_s = tensors[LM + "gate_up_proj_scale_inv"], tensors[LM + "down_proj_scale_inv"]
    half = INTER // BLOCK  # scale rows of gate (and of up)
    for e in range(E):
        if e in local:
            assert read_bytes(by_name[f"{LM}{e}.gate_proj.weight"]) == raw(gate_up[e, :INTER])
            assert read_bytes(by_name[f"{LM}{e}.up_proj.weight"]) == raw(gate_up[e, INTER:])
            assert read_bytes(by_name[f"{LM}{e}.down_proj.weight"]) == raw(down[e])
            assert by_name[f"{LM}{e}.gate_proj.weight"].shape == (INTER, H)
            assert by_name[f"{LM}{e}.down_proj.weight"].shape == (H, INTER)
        else:
            assert f"{LM}{e}.gate_proj.weight" not in by_name and f"{LM}{e}.down_proj.weight" not in by_name
        # Every expert's scales, cut the same way.
        assert read_bytes(by_name[f"{LM}{e}.gate_proj.weight_scale_inv"]) == raw(
            gate_up_s[e, : INTER // BLOCK]
        )
        assert read_bytes(by_name[f"{LM}{e}.up_proj.weight_scale_inv"]) == raw(gate_up_s[e, half:])
        assert read_bytes(by_name[f"{LM}{e}.down_proj.weight_scale_inv"]) == raw(down_s[e])
    mtp = tensors["mtp.layers.0.mlp.experts.gate_up_proj"]
    assert read_bytes(by_name["mtp.layers.0.mlp.experts.4.up_proj.weight"]) == raw(mtp[4, INTER:])
    # Nothing fused is left (the servers' fused flag is sticky), nothing else touched.
    assert not [n for n in by_name if expert_tensor(n) and expert_tensor(n).expert is None]
    assert (
        by_name["model.language_model.embed_tokens.weight"] == src["model.language_model.embed_tokens.weight"]
    )
    assert all(
        t.dtype == src[LM + "gate_up_proj"].dtype
        for n, t in by_name.items()
        if n.endswith(".weight") and "experts" in n
    )


def test_each_layer_is_asked_for_its_experts_once(fused):
    _, src = fused
    asked = []
    node_expert_tensors(list(src.values()), lambda layer: asked.append(layer) or {0}, scale_block=BLOCK)
    assert sorted(asked) == [MoeLayer(0, mtp=True), MoeLayer(2)]  # one call each


def test_a_scale_block_straddling_gate_and_up_is_refused(fused):
    _, src = fused
    scale = src[LM + "gate_up_proj_scale_inv"]
    with pytest.raises(BadInput, match="straddles gate and up"):
        explode(scale, [0], scale_block=3, weight=src[LM + "gate_up_proj"])
    with pytest.raises(BadInput, match="scale_block"):
        node_expert_tensors([scale, src[LM + "gate_up_proj"]], lambda layer: {0})


def per_expert(names_and_dtypes):
    return [SourceTensor(n, "f", d, (2, 2), i * 8, 8) for i, (n, d) in enumerate(names_and_dtypes)]


@pytest.mark.parametrize(
    ("suffixes", "heavy"),
    [
        (("weight",), "weight"),  # BF16
        (("weight", "weight_scale_inv"), "weight"),  # block FP8 (the official FP8 release)
        (("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"), "weight_packed"),
        (("weight", "weight_scale", "weight_scale_2", "input_scale"), "weight"),  # ModelOpt NVFP4
        (("qweight", "qzeros", "scales", "g_idx"), "qweight"),  # GPTQ
    ],
)
def test_per_expert_tensors_keep_every_scale_and_only_local_weights(suffixes, heavy):
    names = [
        f"{LM}{e}.{proj}.{s}"
        for e in range(4)
        for proj in ("gate_proj", "up_proj", "down_proj")
        for s in suffixes
    ]
    tensors = per_expert((n, "BF16") for n in names)
    kept = {t.name for t in node_expert_tensors(tensors, lambda layer: {1, 2})}
    dropped = set(names) - kept
    assert dropped == {f"{LM}{e}.{p}.{heavy}" for e in (0, 3) for p in ("gate_proj", "up_proj", "down_proj")}
    assert experts_by_layer(dict.fromkeys(kept)) == {MoeLayer(2): {1, 2}}


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("model.layers.7.mlp.experts.11.down_proj.weight", ExpertTensor(MoeLayer(7), 11, "down_proj.weight")),
        (
            "model.language_model.layers.0.mlp.experts.0.gate_proj.weight_packed",
            ExpertTensor(MoeLayer(0), 0, "gate_proj.weight_packed"),
        ),
        ("mtp.layers.0.mlp.experts.3.up_proj.weight", ExpertTensor(MoeLayer(0, True), 3, "up_proj.weight")),
        (LM + "down_proj_scale_inv", ExpertTensor(MoeLayer(2), None, "down_proj_scale_inv")),
        ("model.language_model.layers.2.mlp.shared_expert.up_proj.weight", None),
        ("model.language_model.layers.2.mlp.gate.weight", None),
        ("mtp.fc.weight", None),
        ("model.visual.blocks.0.mlp.linear_fc1.weight", None),
        ("lm_head.weight", None),
    ],
)
def test_names(name, expected):
    assert expert_tensor(name) == expected


@pytest.mark.parametrize("rest", ["07.up_proj.weight", "1.w1.weight", "1.up_proj", "gate_up_proj_bias"])
def test_names_under_experts_the_servers_would_not_load_are_refused(rest):
    with pytest.raises(BadInput, match="not a routed-expert tensor"):
        expert_tensor(LM + rest)


def test_a_bad_expert_id_is_refused_after_a_good_one_of_the_same_part():
    with pytest.raises(BadInput, match="'07'"):
        expert_tensors([LM + "1.up_proj.weight", LM + "07.up_proj.weight"])


def test_names_parsed_at_once_are_parsed_as_one_by_one(fused):
    _, src = fused
    extra = [LM + "3.gate_proj.weight_packed", "mtp.layers.1.mlp.experts.0.down_proj.weight", "mtp.fc.weight"]
    names = [*src, *extra]
    assert expert_tensors(names) == [expert_tensor(n) for n in names]


def test_several_nodes_at_once_get_what_each_gets_alone(fused):
    _, src = fused
    tensors = list(src.values()) + per_expert(
        (f"{LM}{e}.{p}.{s}", "F8_E4M3")
        for e in range(E)
        for p in ("gate_proj", "down_proj")
        for s in ("weight", "x")
    )
    nodes = [lambda layer: {0, 1}, lambda layer: {2, 3} if layer.mtp else {4, 5}, lambda layer: set()]
    together = nodes_expert_tensors(tensors, nodes, scale_block=BLOCK)
    assert together == [node_expert_tensors(tensors, f, scale_block=BLOCK) for f in nodes]
    assert [len(n) for n in together] == [len(together[0])] * 2 + [len(together[0]) - 14]
