"""Classifying tensor names of real Qwen3.5 MoE checkpoints by what owns them."""

from __future__ import annotations

import pytest

from qwen35_reshard.model import names
from qwen35_reshard.model.names import classify


@pytest.mark.parametrize(
    ("kwargs"),
    [
        {"layout": "fused"},
        {"layout": "per_expert_fp8"},
        {"layout": "per_expert", "tied": True},
        {"layout": "fused", "text_only": True},
        {"layout": "per_expert_fp8", "text_only": True, "tied": True},
    ],
    ids=["fused", "fp8", "per_expert_tied", "text_only", "text_only_fp8_tied"],
)
def test_every_name_of_a_real_layout_is_classified(tiny, ref, kwargs):
    _, tensors = tiny.describe_model(layers=12, **kwargs)
    seen_layers = set()
    for t in tensors:
        role = classify(t.name)
        assert role is not None, t.name
        m = ref.LAYER_RE.match(t.name)
        if m:
            assert role == names.Role(names.LAYER, int(m.group(1))), t.name
            seen_layers.add(role.layer)
        else:
            assert role.kind != names.LAYER and role.layer is None, t.name
    assert seen_layers == set(range(12))


@pytest.mark.parametrize(
    ("name", "kind", "layer"),
    [
        ("model.language_model.layers.0.input_layernorm.weight", names.LAYER, 0),
        ("model.language_model.layers.10.mlp.experts.gate_up_proj", names.LAYER, 10),
        ("model.language_model.layers.59.mlp.experts.511.down_proj.weight_scale_inv", names.LAYER, 59),
        ("model.language_model.layers.3.self_attn.q_norm.weight", names.LAYER, 3),
        ("model.layers.93.linear_attn.A_log", names.LAYER, 93),  # text-only / Qwen3-Next
        ("model.language_model.embed_tokens.weight", names.EMBED, None),
        ("model.embed_tokens.weight", names.EMBED, None),
        ("model.language_model.norm.weight", names.NORM, None),
        ("model.norm.weight", names.NORM, None),
        ("lm_head.weight", names.LM_HEAD, None),
        ("mtp.fc.weight", names.MTP, None),
        ("mtp.layers.0.mlp.experts.3.up_proj.weight", names.MTP, None),  # not a decoder layer
        ("mtp.layers.0.self_attn.q_proj.weight_scale_inv", names.MTP, None),
        ("mtp.norm.weight", names.MTP, None),
        ("model.visual.blocks.26.attn.qkv.weight", names.VISUAL, None),  # blocks.N, not layers
        ("model.visual.merger.linear_fc2.bias", names.VISUAL, None),
    ],
)
def test_known_roles(name, kind, layer):
    assert classify(name) == names.Role(kind, layer)


@pytest.mark.parametrize(
    "name",
    [
        "model.language_model.layers.01.input_layernorm.weight",  # a second spelling of layer 1
        "model.language_model.layers.3",  # no trailing dot
        "model.language_model.layers.x.mlp.gate.weight",
        "model.language_model.layers.-1.mlp.gate.weight",
        "model.language_model.rotary_emb.inv_freq",
        "model.language_model.embed_tokens_extra.weight",
        "model.lm_head.weight",
        "visual.blocks.0.attn.qkv.weight",
        "model.mtp.fc.weight",
        "language_model.layers.0.mlp.gate.weight",
        "transformer.h.0.attn.c_attn.weight",
        "Model.layers.0.mlp.gate.weight",
        "",
    ],
)
def test_unknown_names_get_no_role(name):
    assert classify(name) is None


def test_classify_all_agrees_with_classify(tiny):
    """The one-pass classifier gives every name the role classify gives it, names holding a
    newline (which the pass joins on) and unknown ones included, in order."""
    _, tensors = tiny.describe_model(layers=12, layout="per_expert_fp8")
    odd = ["", "model.layers.3", "model.layers.01.x", "lm_head.weight\nmodel.layers.2.x", "mtp.\n"]
    for batch in ([t.name for t in tensors], [t.name for t in tensors] + odd, odd, []):
        keys, roles = names.classify_all(batch)
        assert len(keys) == len(batch)
        assert [roles[k] for k in keys] == [classify(n) for n in batch]
    keys, roles = names.classify_all(["model.layers.7.mlp.gate.weight", "model.visual.pos_embed.weight"])
    assert [roles[k] for k in keys] == [names.Role(names.LAYER, 7), names.Role(names.VISUAL_POS_EMBED)]
