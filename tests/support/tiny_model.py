"""The tiny random Qwen3.5 MoE model of the proofs against real model code (transformers,
SGLang): its config (8 layers, linear and full attention, 8 experts, a vision tower), and
weights made distinct."""

from __future__ import annotations

import torch
from torch import nn
from transformers import Qwen3_5MoeConfig

DTYPE = torch.bfloat16
HIDDEN, INTER, EXPERTS, VOCAB, LAYERS = 64, 32, 8, 128, 8
# The same kernels on both sides make "equal" mean bit-for-bit equal.
IMPL = {"attn_implementation": "eager", "experts_implementation": "eager"}
INDEX = "model.safetensors.index.json"


def tiny_config() -> Qwen3_5MoeConfig:
    return Qwen3_5MoeConfig(
        text_config={
            "vocab_size": VOCAB, "hidden_size": HIDDEN, "num_hidden_layers": LAYERS,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
            "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
            "linear_num_key_heads": 2, "linear_num_value_heads": 4,
            "moe_intermediate_size": INTER, "shared_expert_intermediate_size": INTER,
            "num_experts": EXPERTS, "num_experts_per_tok": 2, "max_position_embeddings": 256,
            # Full attention every other layer: every stage of the vLLM splits below has one, as vLLM needs.
            "full_attention_interval": 2,
            # head_dim 32 x partial_rotary_factor 0.25 = 8 rotary dims = 4 frequencies = 2+1+1
            "rope_parameters": {
                "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                "mrope_section": [2, 1, 1], "mrope_interleaved": True,
            },
        },
        vision_config={
            "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 4,
            "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": HIDDEN,
            "num_position_embeddings": 16,
        },
    )


def perturb(module: nn.Module, seed: int, *, fresh: bool = False) -> None:
    """Make every parameter distinct and non-trivial (RMSNorm weights start at zero).

    ``fresh`` overwrites instead (modules built outside transformers leave experts uninitialised).
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(module.named_parameters()):
            noise = (torch.randn(p.shape, generator=g) * 0.05).to(p.dtype)
            p.copy_(noise) if fresh else p.add_(noise)
