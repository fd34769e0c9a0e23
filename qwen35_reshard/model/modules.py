"""The modules of a Qwen3.5 MoE checkpoint as data: each maps its tensors' relative names to a
shape in named sizes of the config (see ``schema``, which walks them for one checkpoint).

A size is a named size of the config (TEXT_SIZES, VISION_SIZES and the few the schema derives),
an int, or a tuple of those meaning their product.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Param:
    """One tensor with exactly this (relative) name."""

    shape: tuple


@dataclass(frozen=True)
class Linear:
    """A Linear module: ``.weight`` [out, in] (+ ``.bias`` [out]), or its quantization method's set
    of tensors for [out, in] (see ``quant``)."""

    out: object
    inp: object
    bias: bool = False


@dataclass(frozen=True)
class Experts:
    """Routed experts: fused [E, 2I, H] + [E, H, I], or one gate/up/down Linear per expert."""


def P(*shape) -> Param:  # noqa: N802 - reads like a shape in the tables below
    return Param(shape)


LAYER_NORMS = {
    "input_layernorm.weight": P("hidden"),
    "post_attention_layernorm.weight": P("hidden"),
}
FULL_ATTENTION = {
    # q_proj is doubled: the second half is the output gate.
    "self_attn.q_proj": Linear(("heads", "head_dim", 2), "hidden"),
    "self_attn.k_proj": Linear(("kv_heads", "head_dim"), "hidden"),
    "self_attn.v_proj": Linear(("kv_heads", "head_dim"), "hidden"),
    "self_attn.o_proj": Linear("hidden", ("heads", "head_dim")),
    "self_attn.q_norm.weight": P("head_dim"),
    "self_attn.k_norm.weight": P("head_dim"),
}
LINEAR_ATTENTION = {  # Gated DeltaNet
    "linear_attn.in_proj_qkv": Linear("conv_dim", "hidden"),
    "linear_attn.in_proj_z": Linear("value_dim", "hidden"),
    "linear_attn.in_proj_b": Linear("linear_value_heads", "hidden"),
    "linear_attn.in_proj_a": Linear("linear_value_heads", "hidden"),
    "linear_attn.conv1d.weight": P("conv_dim", 1, "conv_kernel"),
    "linear_attn.dt_bias": P("linear_value_heads"),
    "linear_attn.A_log": P("linear_value_heads"),
    "linear_attn.norm.weight": P("linear_value_head_dim"),
    "linear_attn.out_proj": Linear("hidden", "value_dim"),
}
SPARSE_MOE = {
    "mlp.gate.weight": P("experts", "hidden"),  # the router
    "mlp.experts": Experts(),
    "mlp.shared_expert.gate_proj": Linear("shared_intermediate", "hidden"),
    "mlp.shared_expert.up_proj": Linear("shared_intermediate", "hidden"),
    "mlp.shared_expert.down_proj": Linear("hidden", "shared_intermediate"),
    "mlp.shared_expert_gate": Linear(1, "hidden"),
}
DECODER_LAYER = {
    "linear_attention": {**LINEAR_ATTENTION, **SPARSE_MOE, **LAYER_NORMS},
    "full_attention": {**FULL_ATTENTION, **SPARSE_MOE, **LAYER_NORMS},
}
EXPERT = {  # one routed expert of the per-expert layout
    "gate_proj": Linear("intermediate", "hidden"),
    "up_proj": Linear("intermediate", "hidden"),
    "down_proj": Linear("hidden", "intermediate"),
}
FUSED_EXPERTS = {
    "gate_up_proj": P("experts", ("intermediate", 2), "hidden"),
    "down_proj": P("experts", "hidden", "intermediate"),
}
# Around the decoder layers ("layers.{i}." of DECODER_LAYER[layer_types[i]]).
LANGUAGE_MODEL_BEFORE = {"embed_tokens.weight": P("vocab", "hidden")}
LANGUAGE_MODEL_AFTER = {"norm.weight": P("hidden")}
LM_HEAD = {"lm_head": Linear("vocab", "hidden")}  # absent when tied to embed_tokens
# Multi-token prediction: "mtp." + these, with "layers.{k}." full-attention decoder layers.
MTP_BEFORE = {
    "fc": Linear("hidden", ("hidden", 2)),
    "pre_fc_norm_embedding.weight": P("hidden"),
    "pre_fc_norm_hidden.weight": P("hidden"),
}
MTP_AFTER = {"norm.weight": P("hidden")}
# Vision tower: "model.visual." + these, with "blocks.{b}." VISION_BLOCKs between.
VISION_BEFORE = {
    "patch_embed.proj.weight": P("v_hidden", "v_in_channels", "v_temporal_patch", "v_patch", "v_patch"),
    "patch_embed.proj.bias": P("v_hidden"),
    "pos_embed.weight": P("v_positions", "v_hidden"),
}
VISION_BLOCK = {
    "norm1.weight": P("v_hidden"),
    "norm1.bias": P("v_hidden"),
    "norm2.weight": P("v_hidden"),
    "norm2.bias": P("v_hidden"),
    "attn.qkv": Linear(("v_hidden", 3), "v_hidden", bias=True),
    "attn.proj": Linear("v_hidden", "v_hidden", bias=True),
    "mlp.linear_fc1": Linear("v_intermediate", "v_hidden", bias=True),
    "mlp.linear_fc2": Linear("v_hidden", "v_intermediate", bias=True),
}
VISION_AFTER = {
    "merger.norm.weight": P("v_hidden"),
    "merger.norm.bias": P("v_hidden"),
    "merger.linear_fc1": Linear("v_merged", "v_merged", bias=True),
    "merger.linear_fc2": Linear("v_out_hidden", "v_merged", bias=True),
}

# Named sizes: config key and transformers' default (what the servers use when a key is absent).
TEXT_SIZES = {
    "hidden": ("hidden_size", 2048),
    "vocab": ("vocab_size", 248320),
    "experts": ("num_experts", 256),
    "intermediate": ("moe_intermediate_size", 512),
    "shared_intermediate": ("shared_expert_intermediate_size", 512),
    "heads": ("num_attention_heads", 16),
    "kv_heads": ("num_key_value_heads", 2),
    "head_dim": ("head_dim", 256),
    "linear_key_heads": ("linear_num_key_heads", 16),
    "linear_value_heads": ("linear_num_value_heads", 32),
    "linear_key_head_dim": ("linear_key_head_dim", 128),
    "linear_value_head_dim": ("linear_value_head_dim", 128),
    "conv_kernel": ("linear_conv_kernel_dim", 4),
}
VISION_SIZES = {
    "v_hidden": ("hidden_size", 1152),
    "v_intermediate": ("intermediate_size", 4304),
    "v_in_channels": ("in_channels", 3),
    "v_patch": ("patch_size", 16),
    "v_temporal_patch": ("temporal_patch_size", 2),
    "v_merge": ("spatial_merge_size", 2),
    "v_out_hidden": ("out_hidden_size", 3584),
    "v_positions": ("num_position_embeddings", 2304),
}
