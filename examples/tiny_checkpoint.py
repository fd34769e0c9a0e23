"""Build synthetic Qwen3.5 MoE Hugging Face checkpoints with the real tensor names.

The checkpoints are for byte-level work (resharding, tests, benchmarks), not for
inference: every tensor holds deterministic pseudo-random bytes derived from the
seed and the tensor's name, so a tensor copied to the wrong place is detectable.
Everything else is shaped like a real release:

- tensor names, shapes and dtypes follow transformers' Qwen3.5 MoE modules
  (hybrid linear/full attention, routed + shared experts, MTP head, vision tower);
- shards are cut in state-dict order (so a layer can straddle two shards) and,
  inside a shard, laid out the way the reference safetensors writer does it:
  by dtype size descending, then by name (``layers.10.`` before ``layers.2.``);
- config.json, the index and the tokenizer/processor side files are present.

Only the standard library is used, so the script runs with a bare ``python3``::

    python3 examples/tiny_checkpoint.py /tmp/tiny
    python3 examples/tiny_checkpoint.py /tmp/q35 --preset qwen3.5-35b-a3b-scaled --target-bytes 2000000000

Tests import it as a module (``build_checkpoint``, ``describe_model``, ``preset``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import struct
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

LAYOUTS = ("fused", "per_expert_fp8", "per_expert")
PRESETS = (
    "tiny",
    "qwen3.5-35b-a3b-scaled",
    "qwen3.5-397b-a17b-fp8-headers",
    "qwen3.8-2.4t-a95b-fp8-headers",
)

# Item size of each dtype we emit (the quantized ones for quantized_checkpoint.py); the
# reference writer lays tensors out by dtype size descending and then by name.
DTYPE_SIZE = {"I64": 8, "F32": 4, "I32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "U8": 1}
FP8_BLOCK = 128

# The default tiny checkpoint is ~1.3 MB: this cuts it into 4 shards with layer
# tensors straddling the cuts.
DEFAULT_SHARD_BYTES = 400_000
DEFAULT_TARGET_BYTES = 2 << 30
INDEX_NAME = "model.safetensors.index.json"
HF_REPO_DIR = "models--Qwen--Tiny"

TINY_VISION = {
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "patch_size": 4,
    "num_position_embeddings": 16,
}
REAL_VISION = {
    "depth": 27,
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_heads": 16,
    "patch_size": 16,
    "num_position_embeddings": 2304,
}

# Tensors above this size get their bytes from a rotated per-tensor pool
# (fast) instead of one randbytes call (slow for gigabytes).
_POOL_CHUNK = 1 << 20
_POOL_SLACK = 1 << 16


class TensorSpec(NamedTuple):
    """One tensor as it appears in a safetensors header."""

    name: str
    dtype: str
    shape: tuple[int, ...]


def nbytes(tensor: TensorSpec) -> int:
    """Size of the tensor's data in bytes."""
    return math.prod(tensor.shape) * DTYPE_SIZE[tensor.dtype]


# --------------------------------------------------------------------------- configs


def _text_config(
    *,
    layers: int,
    experts: int,
    hidden: int,
    moe_intermediate: int,
    vocab: int,
    mtp: bool,
    tied: bool,
    full_attention_interval: int,
) -> dict[str, Any]:
    """text_config with attention sizes derived from `hidden`.

    The rules reproduce the real 35B-A3B (hidden 2048) and 397B-A17B (hidden 4096)
    head counts exactly and give small, divisible sizes for tiny models.
    """
    head_dim = min(256, hidden // 4)
    linear_head_dim = min(128, hidden // 4)
    value_heads = 2 * hidden // linear_head_dim
    key_heads = max(d for d in range(1, min(16, value_heads // 2) + 1) if value_heads % d == 0)
    rotary_pairs = head_dim // 8  # partial_rotary_factor 0.25, two dims per frequency
    third = -(-rotary_pairs // 3)
    return {
        "model_type": "qwen3_5_moe_text",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "dtype": "bfloat16",
        "eos_token_id": _special_tokens(vocab)["<|im_end|>"],
        "full_attention_interval": full_attention_interval,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "layer_types": [_layer_type(i, full_attention_interval) for i in range(layers)],
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": linear_head_dim,
        "linear_num_key_heads": key_heads,
        "linear_num_value_heads": value_heads,
        "linear_value_head_dim": linear_head_dim,
        "max_position_embeddings": 262144,
        "moe_intermediate_size": moe_intermediate,
        "mtp_num_hidden_layers": 1 if mtp else 0,
        "num_attention_heads": 2 * hidden // head_dim,
        "num_experts": experts,
        "num_experts_per_tok": min(experts, 10 if experts >= 512 else 8),
        "num_hidden_layers": layers,
        "num_key_value_heads": 2,
        "output_router_logits": False,
        "pad_token_id": None,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": [third, third, rotary_pairs - 2 * third],
            "partial_rotary_factor": 0.25,
            "rope_theta": 10000000,
            "rope_type": "default",
        },
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": moe_intermediate,
        "tie_word_embeddings": tied,
        "use_cache": True,
        "vocab_size": vocab,
    }


def _layer_type(index: int, interval: int) -> str:
    """Every interval-th layer (3, 7, 11, ... for the releases' 4) is full attention, the rest
    Gated DeltaNet."""
    return "full_attention" if (index + 1) % interval == 0 else "linear_attention"


def _special_tokens(vocab: int) -> dict[str, int]:
    """ChatML and vision tokens, placed at the top of the vocabulary as in Qwen."""
    names = (
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<|vision_start|>",
        "<|vision_end|>",
        "<|image_pad|>",
        "<|video_pad|>",
    )
    return {name: vocab - len(names) + i for i, name in enumerate(names)}


def _vision_config(dims: Mapping[str, int], out_hidden: int) -> dict[str, Any]:
    """vision_config; `dims` overrides the TINY_VISION sizes."""
    return {
        "model_type": "qwen3_5_moe_vision",
        "hidden_act": "gelu_pytorch_tanh",
        "in_channels": 3,
        "initializer_range": 0.02,
        "out_hidden_size": out_hidden,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        **TINY_VISION,
        **dims,
    }


def _model_config(
    text: dict[str, Any], vision: dict[str, Any] | None, tensors: Sequence[TensorSpec], *, text_only: bool
) -> dict[str, Any]:
    """config.json: nested for the multimodal model, flat for Qwen3_5MoeForCausalLM."""
    if text_only:
        config = {**text, "architectures": ["Qwen3_5MoeForCausalLM"]}
    else:
        special = _special_tokens(text["vocab_size"])
        config = {
            "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "model_type": "qwen3_5_moe",
            "image_token_id": special["<|image_pad|>"],
            "video_token_id": special["<|video_pad|>"],
            "vision_start_token_id": special["<|vision_start|>"],
            "vision_end_token_id": special["<|vision_end|>"],
            "text_config": text,
            "tie_word_embeddings": text["tie_word_embeddings"],
        }
        if vision is not None:
            config["vision_config"] = vision
    if any(t.dtype == "F8_E4M3" for t in tensors):
        config["quantization_config"] = _quantization_config(tensors)
    return config


def _quantization_config(tensors: Sequence[TensorSpec]) -> dict[str, Any]:
    """Block-FP8 config; like the official -FP8 releases, modules_to_not_convert lists
    the full names of every 2-D weight that stayed BF16 (embeddings, routers, ...)."""
    kept = [
        t.name.removesuffix(".weight")
        for t in tensors
        if t.dtype == "BF16" and len(t.shape) == 2 and t.name.endswith(".weight")
    ]
    return {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "modules_to_not_convert": kept,
        "quant_method": "fp8",
        "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
    }


# --------------------------------------------------------------------------- tensors


def _t(name: str, shape: tuple[int, ...], dtype: str = "BF16") -> TensorSpec:
    return TensorSpec(name, dtype, shape)


def _linear(module: str, out_features: int, in_features: int, fp8: bool) -> list[TensorSpec]:
    """A bias-free Linear weight; in FP8 with its F32 128x128-block inverse scale."""
    if not fp8:
        return [_t(f"{module}.weight", (out_features, in_features))]
    blocks = (-(-out_features // FP8_BLOCK), -(-in_features // FP8_BLOCK))
    return [
        _t(f"{module}.weight", (out_features, in_features), "F8_E4M3"),
        _t(f"{module}.weight_scale_inv", blocks, "F32"),
    ]


def _affine(module: str, out_features: int, in_features: int) -> list[TensorSpec]:
    """A Linear with bias (vision tower)."""
    return [_t(f"{module}.weight", (out_features, in_features)), _t(f"{module}.bias", (out_features,))]


def _layer_norm(module: str, size: int) -> list[TensorSpec]:
    return [_t(f"{module}.weight", (size,)), _t(f"{module}.bias", (size,))]


def _attention(p: str, c: Mapping[str, Any], layer_type: str, fp8: bool) -> list[TensorSpec]:
    """self_attn (q_proj is doubled for the output gate) or Gated DeltaNet linear_attn."""
    h = c["hidden_size"]
    if layer_type == "full_attention":
        heads, kv_heads, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        a = f"{p}self_attn."
        return [
            *_linear(f"{a}q_proj", heads * d * 2, h, fp8),
            *_linear(f"{a}k_proj", kv_heads * d, h, fp8),
            *_linear(f"{a}v_proj", kv_heads * d, h, fp8),
            *_linear(f"{a}o_proj", h, heads * d, fp8),
            _t(f"{a}q_norm.weight", (d,)),
            _t(f"{a}k_norm.weight", (d,)),
        ]
    v_heads = c["linear_num_value_heads"]
    key_dim = c["linear_num_key_heads"] * c["linear_key_head_dim"]
    value_dim = v_heads * c["linear_value_head_dim"]
    conv_dim = 2 * key_dim + value_dim
    a = f"{p}linear_attn."
    return [
        _t(f"{a}dt_bias", (v_heads,)),
        _t(f"{a}A_log", (v_heads,), "F32"),
        _t(f"{a}conv1d.weight", (conv_dim, 1, c["linear_conv_kernel_dim"])),
        _t(f"{a}norm.weight", (c["linear_value_head_dim"],), "F32"),
        *_linear(f"{a}out_proj", h, value_dim, fp8),
        *_linear(f"{a}in_proj_qkv", conv_dim, h, fp8),
        *_linear(f"{a}in_proj_z", value_dim, h, fp8),
        *_linear(f"{a}in_proj_b", v_heads, h, False),
        *_linear(f"{a}in_proj_a", v_heads, h, False),
    ]


def _experts(p: str, c: Mapping[str, Any], per_expert: bool, fp8: bool) -> list[TensorSpec]:
    """Routed experts: fused 3-D tensors, or one Linear triple per expert."""
    e, h, i = c["num_experts"], c["hidden_size"], c["moe_intermediate_size"]
    if not per_expert:
        return [_t(f"{p}mlp.experts.gate_up_proj", (e, 2 * i, h)), _t(f"{p}mlp.experts.down_proj", (e, h, i))]
    out: list[TensorSpec] = []
    for j in range(e):
        x = f"{p}mlp.experts.{j}."
        out += [
            *_linear(f"{x}gate_proj", i, h, fp8),
            *_linear(f"{x}up_proj", i, h, fp8),
            *_linear(f"{x}down_proj", h, i, fp8),
        ]
    return out


def _moe(p: str, c: Mapping[str, Any], per_expert: bool, fp8: bool) -> list[TensorSpec]:
    """Router, routed experts, shared expert and its sigmoid gate."""
    h, s = c["hidden_size"], c["shared_expert_intermediate_size"]
    x = f"{p}mlp.shared_expert."
    return [
        _t(f"{p}mlp.gate.weight", (c["num_experts"], h)),
        *_experts(p, c, per_expert, fp8),
        *_linear(f"{x}gate_proj", s, h, fp8),
        *_linear(f"{x}up_proj", s, h, fp8),
        *_linear(f"{x}down_proj", h, s, fp8),
        *_linear(f"{p}mlp.shared_expert_gate", 1, h, False),
    ]


def _decoder_layer(
    p: str, c: Mapping[str, Any], layer_type: str, *, per_expert: bool, fp8: bool
) -> list[TensorSpec]:
    """One decoder layer under prefix `p`, in the module order transformers saves it."""
    h = c["hidden_size"]
    return [
        *_attention(p, c, layer_type, fp8),
        *_moe(p, c, per_expert, fp8),
        _t(f"{p}input_layernorm.weight", (h,)),
        _t(f"{p}post_attention_layernorm.weight", (h,)),
    ]


def _visual(v: Mapping[str, Any]) -> list[TensorSpec]:
    """Vision tower: patch embedding, `depth` blocks.N, patch merger."""
    p, hv, iv, patch = "model.visual.", v["hidden_size"], v["intermediate_size"], v["patch_size"]
    merged = hv * v["spatial_merge_size"] ** 2
    out = [
        _t(f"{p}patch_embed.proj.weight", (hv, v["in_channels"], v["temporal_patch_size"], patch, patch)),
        _t(f"{p}patch_embed.proj.bias", (hv,)),
        _t(f"{p}pos_embed.weight", (v["num_position_embeddings"], hv)),
    ]
    for b in range(v["depth"]):
        x = f"{p}blocks.{b}."
        out += [
            *_layer_norm(f"{x}norm1", hv),
            *_layer_norm(f"{x}norm2", hv),
            *_affine(f"{x}attn.qkv", 3 * hv, hv),
            *_affine(f"{x}attn.proj", hv, hv),
            *_affine(f"{x}mlp.linear_fc1", iv, hv),
            *_affine(f"{x}mlp.linear_fc2", hv, iv),
        ]
    return [
        *out,
        *_layer_norm(f"{p}merger.norm", hv),
        *_affine(f"{p}merger.linear_fc1", merged, merged),
        *_affine(f"{p}merger.linear_fc2", v["out_hidden_size"], merged),
    ]


def _mtp(c: Mapping[str, Any], fp8: bool) -> list[TensorSpec]:
    """The MTP head: one full-attention MoE layer whose experts are always per-expert."""
    h = c["hidden_size"]
    return [
        _t("mtp.pre_fc_norm_embedding.weight", (h,)),
        _t("mtp.pre_fc_norm_hidden.weight", (h,)),
        *_linear("mtp.fc", h, 2 * h, False),
        *_decoder_layer("mtp.layers.0.", c, "full_attention", per_expert=True, fp8=fp8),
        _t("mtp.norm.weight", (h,)),
    ]


def describe_model(
    *,
    layers: int = 8,
    experts: int = 4,
    hidden: int = 64,
    moe_intermediate: int = 32,
    vocab: int = 256,
    layout: str = "fused",
    mtp: bool = True,
    vision: bool = True,
    tied: bool = False,
    text_only: bool = False,
    dtype_scale: int = 1,
    vision_dims: Mapping[str, int] | None = None,
    text_overrides: Mapping[str, Any] | None = None,
    full_attention_interval: int = 4,
) -> tuple[dict[str, Any], list[TensorSpec]]:
    """config.json content and every tensor in state-dict order, without writing anything.

    Takes the model-shape options of `build_checkpoint` (see there); tests use it for
    the expected names/shapes, presets to size a model before building it.
    text_overrides: text_config values to use instead of the derived ones, e.g. the real
    122B-A10B's head counts ({"num_attention_heads": 32, "linear_num_value_heads": 64}),
    which the rules from hidden_size do not give.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    sizes = (layers, experts, hidden, moe_intermediate, vocab, dtype_scale, full_attention_interval)
    if min(sizes) < 1 or hidden % 4 or vocab < 8:
        raise ValueError("sizes must be positive, hidden a multiple of 4 and vocab at least 8")
    text = _text_config(
        layers=layers,
        experts=experts * dtype_scale,
        hidden=hidden,
        moe_intermediate=moe_intermediate,
        vocab=vocab * dtype_scale,
        mtp=mtp,
        tied=tied,
        full_attention_interval=full_attention_interval,
    )
    text.update(text_overrides or {})
    vision_cfg = None if text_only or not vision else _vision_config(vision_dims or {}, hidden)
    fp8 = layout == "per_expert_fp8"
    p = "model." if text_only else "model.language_model."
    tensors = [_t(f"{p}embed_tokens.weight", (text["vocab_size"], hidden))]
    for i, layer_type in enumerate(text["layer_types"]):
        tensors += _decoder_layer(f"{p}layers.{i}.", text, layer_type, per_expert=layout != "fused", fp8=fp8)
    tensors.append(_t(f"{p}norm.weight", (hidden,)))
    if not tied:
        tensors.append(_t("lm_head.weight", (text["vocab_size"], hidden)))
    if vision_cfg is not None:
        tensors += _visual(vision_cfg)
    if mtp:
        tensors += _mtp(text, fp8)
    return _model_config(text, vision_cfg, tensors, text_only=text_only), tensors


# --------------------------------------------------------------------------- writing


def _tensor_bytes(seed: int, name: str, size: int) -> Iterator[bytes | memoryview]:
    """Deterministic bytes for one tensor, different for every name.

    Small tensors are pure randbytes; big ones repeat a per-name random pool at
    per-chunk random offsets, which is fast enough for multi-GB checkpoints.
    """
    rng = random.Random(f"{seed}:{name}")
    if size <= _POOL_CHUNK:
        yield rng.randbytes(size)
        return
    pool = memoryview(rng.randbytes(_POOL_CHUNK + _POOL_SLACK))
    for start in range(0, size, _POOL_CHUNK):
        offset = rng.randrange(_POOL_SLACK)
        yield pool[offset : offset + min(_POOL_CHUNK, size - start)]


def shard_header(tensors: Sequence[TensorSpec]) -> tuple[bytes, list[TensorSpec]]:
    """The 8-byte length plus JSON header, and the tensors in data order.

    Mirrors the reference writer: `__metadata__` {"format": "pt"} first, compact
    JSON, data sorted by (dtype size descending, name), space padding to 8 bytes.
    """
    ordered = sorted(tensors, key=lambda t: (-DTYPE_SIZE[t.dtype], t.name))
    entries: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in ordered:
        end = offset + nbytes(t)
        entries[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw, ordered


def _write_shard(path: Path, tensors: Sequence[TensorSpec], *, seed: int, sparse: bool) -> str:
    """Write one .safetensors file and return its sha256 (the HF cache blob name).

    With `sparse` the data region is a hole of the right length; its "digest" is
    then the sha256 of the header and the length, since hashing holes is pointless.
    """
    header, ordered = shard_header(tensors)
    digest = hashlib.sha256(header)
    with open(path, "wb") as f:
        f.write(header)
        if sparse:
            data_size = sum(map(nbytes, ordered))
            f.truncate(len(header) + data_size)
            digest.update(f"sparse:{data_size}".encode())
            return digest.hexdigest()
        for t in ordered:
            for chunk in _tensor_bytes(seed, t.name, nbytes(t)):
                f.write(chunk)
                digest.update(chunk)
    return digest.hexdigest()


def _split_shards(tensors: Sequence[TensorSpec], shard_bytes: int) -> list[list[TensorSpec]]:
    """Cut the state-dict-ordered tensors into runs of at most `shard_bytes`
    (a bigger tensor gets a shard of its own), like save_pretrained does."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + nbytes(t) > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += nbytes(t)
    return shards


def _json_bytes(obj: object) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def _write_file(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return hashlib.sha256(data).hexdigest()


def _write_weights(
    model_dir: Path,
    tensors: Sequence[TensorSpec],
    *,
    shard_bytes: int,
    single_file: bool,
    seed: int,
    sparse: bool,
) -> dict[str, str]:
    """Write the shards (+ index) or one model.safetensors; return {file: sha256}."""
    if single_file:
        return {
            "model.safetensors": _write_shard(
                model_dir / "model.safetensors", tensors, seed=seed, sparse=sparse
            )
        }
    shards = _split_shards(tensors, shard_bytes)
    digests: dict[str, str] = {}
    weight_map: dict[str, str] = {}
    for k, shard in enumerate(shards, 1):
        file_name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        digests[file_name] = _write_shard(model_dir / file_name, shard, seed=seed, sparse=sparse)
        weight_map.update(dict.fromkeys((t.name for t in shard), file_name))
    index = {"metadata": {"total_size": sum(map(nbytes, tensors))}, "weight_map": weight_map}
    digests[INDEX_NAME] = _write_file(model_dir / INDEX_NAME, _json_bytes(index))
    return digests


def _side_files(config: Mapping[str, Any]) -> dict[str, bytes]:
    """Non-weight files of a release: generation/tokenizer/processor configs, chat template."""
    text = config.get("text_config", config)
    special = _special_tokens(text["vocab_size"])
    words = ["<unk>", "hello", "world"]
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": i,
                "content": s,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for s, i in special.items()
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": None,
        "decoder": None,
        "model": {
            "type": "WordLevel",
            "vocab": {**{w: i for i, w in enumerate(words)}, **special},
            "unk_token": "<unk>",
        },
    }
    files = {
        "config.json": _json_bytes(config),
        "generation_config.json": _json_bytes(
            {
                "bos_token_id": special["<|endoftext|>"],
                "do_sample": True,
                "eos_token_id": [special["<|im_end|>"], special["<|endoftext|>"]],
                "pad_token_id": special["<|endoftext|>"],
                "temperature": 0.6,
                "top_k": 20,
                "top_p": 0.95,
            }
        ),
        "tokenizer.json": _json_bytes(tokenizer),
        "tokenizer_config.json": _json_bytes(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "unk_token": "<unk>",
                "model_max_length": text["max_position_embeddings"],
            }
        ),
        "chat_template.jinja": (
            b"{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
            b"{{ message['content'] }}<|im_end|>\n{% endfor %}"
            b"{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
        ),
    }
    if "vision_config" in config:
        vision = config["vision_config"]
        files["preprocessor_config.json"] = _json_bytes(
            {
                "image_processor_type": "Qwen2VLImageProcessorFast",
                "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5],
                "merge_size": vision["spatial_merge_size"],
                "patch_size": vision["patch_size"],
                "temporal_patch_size": vision["temporal_patch_size"],
            }
        )
    return files


def _publish_hf_cache(repo_dir: Path, staging: Path, digests: Mapping[str, str]) -> Path:
    """Move files to blobs/<sha256>, link snapshots/<commit>/<file> to them, write refs/main.

    The commit id is the sha1 of the (file, digest) list, so it is deterministic.
    """
    commit = hashlib.sha1(json.dumps(sorted(digests.items())).encode()).hexdigest()
    blobs, snapshot, refs = repo_dir / "blobs", repo_dir / "snapshots" / commit, repo_dir / "refs"
    for directory in (blobs, snapshot, refs):
        directory.mkdir(parents=True)
    for file_name, digest in sorted(digests.items()):
        os.replace(staging / file_name, blobs / digest)
        (snapshot / file_name).symlink_to(f"../../blobs/{digest}")
    staging.rmdir()
    (refs / "main").write_text(commit)
    return snapshot


def _fresh_dir(path: Path) -> Path:
    """Create `path`; refuse a non-empty one so old shards never mix with new ones."""
    if path.exists() and any(path.iterdir()):
        raise FileExistsError(f"{path} is not empty; remove it or pick another directory")
    path.mkdir(parents=True, exist_ok=True)
    return path


def build_checkpoint(
    out_dir: str | os.PathLike[str],
    *,
    layers: int = 8,
    experts: int = 4,
    hidden: int = 64,
    moe_intermediate: int = 32,
    vocab: int = 256,
    layout: str = "fused",
    mtp: bool = True,
    vision: bool = True,
    tied: bool = False,
    text_only: bool = False,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    single_file: bool = False,
    hf_cache: bool = False,
    dtype_scale: int = 1,
    sparse: bool = False,
    seed: int = 0,
    vision_dims: Mapping[str, int] | None = None,
    full_attention_interval: int = 4,
) -> Path:
    """Write a synthetic Qwen3.5 MoE checkpoint and return the model directory.

    layout: "fused" (BF16 mlp.experts.gate_up_proj [E,2I,H] / down_proj [E,H,I]),
        "per_expert" (BF16 mlp.experts.{j}.{gate,up,down}_proj.weight) or
        "per_expert_fp8" (like the official -FP8 releases: every decoder Linear except
        routers and in_proj_a/b is F8_E4M3 with an F32 `.weight_scale_inv`
        [ceil(out/128), ceil(in/128)]; config gets a quantization_config).
    mtp: add mtp.* (its layer is full attention with per-expert experts).
    vision: add model.visual.* and vision_config (ignored when text_only).
    tied: tie_word_embeddings, so no lm_head.weight.
    text_only: Qwen3_5MoeForCausalLM save: model.* prefix, flat config, no vision.
    shard_bytes: max bytes per shard, cut in state-dict order (layers straddle shards).
    single_file: one model.safetensors and no index.
    hf_cache: out_dir becomes a HF cache root; returns .../models--Qwen--Tiny/snapshots/<commit>.
    dtype_scale: multiply the expert count and vocabulary (dim 0 of the experts,
        embeddings and lm_head) by this factor, config included, for benchmarks.
    sparse: headers only; the data region is a hole (file extended with truncate).
    seed: data bytes derive from (seed, tensor name); same arguments, same bytes.
    vision_dims: overrides of TINY_VISION sizes (e.g. REAL_VISION, or {"depth": 27}).
    full_attention_interval: every this many layers one is full attention, the rest linear
        attention (4 in the releases; 1 makes every layer full attention, so that vLLM, which
        needs one in every pipeline stage, can serve any split).
    """
    config, tensors = describe_model(
        layers=layers,
        experts=experts,
        hidden=hidden,
        moe_intermediate=moe_intermediate,
        vocab=vocab,
        layout=layout,
        mtp=mtp,
        vision=vision,
        tied=tied,
        text_only=text_only,
        dtype_scale=dtype_scale,
        vision_dims=vision_dims,
        full_attention_interval=full_attention_interval,
    )
    if shard_bytes < 1:
        raise ValueError("shard_bytes must be positive")
    target = _fresh_dir(Path(out_dir) / HF_REPO_DIR if hf_cache else Path(out_dir))
    files_dir = _fresh_dir(target / ".incoming") if hf_cache else target
    digests = _write_weights(
        files_dir, tensors, shard_bytes=shard_bytes, single_file=single_file, seed=seed, sparse=sparse
    )
    for file_name, data in _side_files(config).items():
        digests[file_name] = _write_file(files_dir / file_name, data)
    return _publish_hf_cache(target, files_dir, digests) if hf_cache else target


# --------------------------------------------------------------------------- presets


def preset(name: str, *, target_bytes: int = DEFAULT_TARGET_BYTES) -> dict[str, Any]:
    """build_checkpoint keyword arguments for a named model.

    "tiny": the default 8-layer fused BF16 model with MTP and vision (~1.3 MB, 4 shards).
    "qwen3.5-35b-a3b-scaled": the 35B-A3B structure (40 layers, 256 experts, MTP,
        27 vision blocks) with hidden/intermediate/vocab shrunk to about `target_bytes`.
    "qwen3.5-397b-a17b-fp8-headers": the real 397B-A17B-FP8 shapes (~189,000 tensors,
        ~400 GB) written sparse: headers are real, data is holes.
    "qwen3.8-2.4t-a95b-fp8-headers": the largest Qwen3.5-architecture release's shape
        (Qwen3.8-2.4T-A95B: 92 layers, 512 per-expert FP8 experts, 288,034 tensors in 216
        shards of ~11 GB, ~2.45 TB), sparse like the 397B one; hidden 8192 and expert
        intermediate 2048 give its size, the other sizes follow from them as above.
    `target_bytes` only affects the scaled preset.
    """
    if name == "tiny":
        return {
            "layers": 8,
            "experts": 4,
            "hidden": 64,
            "moe_intermediate": 32,
            "vocab": 256,
            "layout": "fused",
            "mtp": True,
            "vision": True,
        }
    if name == "qwen3.5-35b-a3b-scaled":
        return _scaled_35b(target_bytes)
    if name in ("qwen3.5-397b-a17b-fp8-headers", "qwen3.8-2.4t-a95b-fp8-headers"):
        big = name == "qwen3.8-2.4t-a95b-fp8-headers"
        return {
            "layers": 92 if big else 60,
            "experts": 512,
            "hidden": 8192 if big else 4096,
            "moe_intermediate": 2048 if big else 1024,
            "vocab": 248320,
            "layout": "per_expert_fp8",
            "mtp": True,
            "vision": True,
            "vision_dims": REAL_VISION,
            "sparse": True,
            "shard_bytes": 11_400_000_000 if big else 5_000_000_000,
        }
    raise ValueError(f"unknown preset {name!r}; choose from {PRESETS}")


def _scaled_35b(target_bytes: int) -> dict[str, Any]:
    """Largest hidden (multiple of 32, moe_intermediate = hidden / 4 as in the real
    model) that fits in target_bytes, then moe_intermediate topped up in steps of 8.
    The vocabulary shrinks with hidden like the real 248320 / 2048."""
    base = {
        "layers": 40,
        "experts": 256,
        "layout": "fused",
        "mtp": True,
        "vision": True,
        "vision_dims": {"depth": 27},
    }

    def sized(hidden: int, intermediate: int) -> dict[str, Any]:
        vocab = max(256, 248320 * hidden // 2048 // 64 * 64)
        return {**base, "hidden": hidden, "moe_intermediate": intermediate, "vocab": vocab}

    def fits(kwargs: dict[str, Any]) -> bool:
        return sum(map(nbytes, describe_model(**kwargs)[1])) <= target_bytes

    hidden = 64
    while fits(sized(hidden + 32, (hidden + 32) // 32 * 8)):
        hidden += 32
    intermediate = hidden // 32 * 8
    while fits(sized(hidden, intermediate + 8)):
        intermediate += 8
    return {**sized(hidden, intermediate), "shard_bytes": max(target_bytes // 12, 1 << 20)}


# --------------------------------------------------------------------------- CLI

_INT_OPTIONS = (
    "layers",
    "experts",
    "hidden",
    "moe_intermediate",
    "vocab",
    "shard_bytes",
    "dtype_scale",
    "seed",
    "full_attention_interval",
)
_FLAG_OPTIONS = ("mtp", "vision", "tied", "text_only", "single_file", "hf_cache", "sparse")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--preset", choices=PRESETS, default="tiny")
    parser.add_argument(
        "--target-bytes",
        type=int,
        default=DEFAULT_TARGET_BYTES,
        help="approximate size of the qwen3.5-35b-a3b-scaled preset",
    )
    parser.add_argument("--layout", choices=LAYOUTS, help="overrides the preset")
    for option in _INT_OPTIONS:
        parser.add_argument(f"--{option.replace('_', '-')}", type=int, help="overrides the preset")
    for option in _FLAG_OPTIONS:
        parser.add_argument(
            f"--{option.replace('_', '-')}",
            action=argparse.BooleanOptionalAction,
            help="overrides the preset",
        )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: build a preset (with optional overrides) and print the model directory."""
    parser = _parser()
    args = parser.parse_args(argv)
    kwargs = preset(args.preset, target_bytes=args.target_bytes)
    for option in ("layout", *_INT_OPTIONS, *_FLAG_OPTIONS):
        if getattr(args, option) is not None:
            kwargs[option] = getattr(args, option)
    try:
        print(build_checkpoint(args.out_dir, **kwargs))
    except (FileExistsError, ValueError) as exc:
        parser.error(str(exc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
