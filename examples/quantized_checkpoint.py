"""Build synthetic quantized Qwen3.5 MoE checkpoints by the names and shapes each method writes.

For byte-level work (tests, benchmarks) on the methods no CPU producer writes here: GPTQ, AWQ,
ModelOpt NVFP4 / FP8 (quantization in config.json, or in hf_quant_config.json alone) and a
compressed-tensors W4A16 look-alike. Each quantized Linear gets its method's set of tensors
(../shared/docs/quantized-checkpoint-facts.md, section 3) with deterministic pseudo-random
bytes, as ``tiny_checkpoint.py`` does; the real compressed-tensors checkpoints come from
llm-compressor (tests/support/quant_worker.py).

Which Linear modules are quantized follows the releases: GPTQ, AWQ and compressed-tensors every
decoder Linear but the routers, ``shared_expert_gate`` and ``linear_attn.in_proj_a/b``; ModelOpt
the routed experts of the main layers only (its ``exclude_modules`` list the rest).

    python3 examples/quantized_checkpoint.py /tmp/gptq --method gptq
    python3 examples/quantized_checkpoint.py /tmp/g397 --method gptq --preset qwen3.5-397b-a17b-fp8-headers
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tiny_checkpoint as tc  # noqa: E402
from tiny_checkpoint import TensorSpec  # noqa: E402

METHODS = (
    "gptq",
    "awq",
    "compressed-tensors",
    "modelopt-nvfp4",
    "modelopt-nvfp4-side",
    "modelopt-fp8",
    "modelopt-fp8-side",
)
# Linear modules every release keeps in BF16 (their out features are tiny or they route).
_ALWAYS_BF16 = (
    ".mlp.gate",
    "mlp.shared_expert_gate",
    "linear_attn.in_proj_a",
    "linear_attn.in_proj_b",
    "mtp.fc",
)
MODELOPT_EXCLUDE = ["lm_head", "model.visual*", "mtp*", "*self_attn*", "*linear_attn*", "*shared_expert*"]


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def quantized_set(module: str, n: int, k: int, method: str, *, bits: int, group: int) -> list[TensorSpec]:
    """The tensors ``method`` writes for the Linear ``module`` [n, k] (facts doc, section 3)."""
    t = TensorSpec
    if method == "gptq":
        return [
            t(f"{module}.qweight", "I32", (_ceil(k * bits, 32), n)),
            t(f"{module}.qzeros", "I32", (_ceil(k, group), _ceil(n * bits, 32))),
            t(f"{module}.scales", "F16", (_ceil(k, group), n)),
            t(f"{module}.g_idx", "I32", (k,)),
        ]
    if method == "awq":
        return [
            t(f"{module}.qweight", "I32", (k, _ceil(n * bits, 32))),
            t(f"{module}.qzeros", "I32", (_ceil(k, group), _ceil(n * bits, 32))),
            t(f"{module}.scales", "F16", (_ceil(k, group), n)),
        ]
    if method == "compressed-tensors":
        return [
            t(f"{module}.weight_packed", "I32", (n, _ceil(k * bits, 32))),
            t(f"{module}.weight_scale", "BF16", (n, _ceil(k, group))),
            t(f"{module}.weight_shape", "I64", (2,)),
        ]
    if method.startswith("modelopt-nvfp4"):
        return [
            t(f"{module}.weight", "U8", (n, _ceil(k, 2))),
            t(f"{module}.weight_scale", "F8_E4M3", (n, _ceil(k, 16))),
            t(f"{module}.weight_scale_2", "F32", ()),
            t(f"{module}.input_scale", "F32", ()),
        ]
    if method.startswith("modelopt-fp8"):
        return [
            t(f"{module}.weight", "F8_E4M3", (n, k)),
            t(f"{module}.weight_scale", "F32", ()),
            t(f"{module}.input_scale", "F32", ()),
        ]
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")


def quantized(module: str, method: str) -> bool:
    """Whether the releases of ``method`` quantize the Linear ``module``."""
    if module.startswith("model.visual.") or module == "lm_head" or module.endswith(_ALWAYS_BF16):
        return False
    if method.startswith("modelopt"):
        return ".mlp.experts." in module and not module.startswith("mtp.")
    return ".layers." in module


def quantization_config(method: str, *, bits: int, group: int) -> tuple[dict | None, dict[str, dict]]:
    """config.json's ``quantization_config`` (None: none) and the side files, by name."""
    if method == "gptq":
        q = {
            "quant_method": "gptq",
            "bits": bits,
            "group_size": group,
            "desc_act": False,
            "sym": True,
            "checkpoint_format": "gptq",
        }
        return q, {"quantize_config.json": {k: v for k, v in q.items() if k != "quant_method"}}
    if method == "awq":
        q = {"quant_method": "awq", "bits": bits, "group_size": group, "version": "gemm", "zero_point": True}
        return q, {"quant_config.json": {"w_bit": bits, "q_group_size": group, "version": "GEMM"}}
    if method == "compressed-tensors":
        weights = {
            "num_bits": bits,
            "type": "int",
            "symmetric": True,
            "strategy": "group",
            "group_size": group,
        }
        q = {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": {
                "group_0": {"targets": ["Linear"], "weights": weights, "format": "pack-quantized"}
            },
            "ignore": [
                "lm_head",
                "re:model.visual.*",
                "re:.*shared_expert_gate$",
                "re:.*in_proj_[ab]$",
                "mtp.fc",
            ],
        }
        return q, {}
    algo = "NVFP4" if method.startswith("modelopt-nvfp4") else "FP8"
    side = {
        "producer": {"name": "modelopt", "version": "0.37.0"},
        "quantization": {
            "quant_algo": algo,
            "kv_cache_quant_algo": None,
            "group_size": 16,
            "exclude_modules": MODELOPT_EXCLUDE,
        },
    }
    q = {"quant_method": "modelopt", "quant_algo": algo, "group_size": 16, "ignore": MODELOPT_EXCLUDE}
    return (None if method.endswith("-side") else q), {"hf_quant_config.json": side}


def describe_quantized(
    method: str, *, bits: int = 4, group: int = 32, **model: Any
) -> tuple[dict, list[TensorSpec]]:
    """config.json and every tensor of a ``method`` checkpoint of the per-expert BF16 model
    ``model`` (``tiny_checkpoint.describe_model``'s options), and the side files."""
    config, tensors = tc.describe_model(**{**model, "layout": "per_expert"})
    out: list[TensorSpec] = []
    for spec in tensors:
        module = spec.name.removesuffix(".weight")
        if spec.name.endswith(".weight") and len(spec.shape) == 2 and quantized(module, method):
            out += quantized_set(module, *spec.shape, method, bits=bits, group=group)
        else:
            out.append(spec)
    q, side = quantization_config(method, bits=bits, group=group)
    if q is not None:
        config["quantization_config"] = q
    return config, out, side


def build_quantized(
    out_dir: str | Path,
    method: str,
    *,
    bits: int = 4,
    group: int = 32,
    shard_bytes: int = tc.DEFAULT_SHARD_BYTES,
    sparse: bool = False,
    seed: int = 0,
    **model: Any,
) -> Path:
    """Write a synthetic ``method`` checkpoint into ``out_dir`` and return it."""
    config, tensors, side = describe_quantized(method, bits=bits, group=group, **model)
    target = tc._fresh_dir(Path(out_dir))
    tc._write_weights(target, tensors, shard_bytes=shard_bytes, single_file=False, seed=seed, sparse=sparse)
    for name, data in {**tc._side_files(config), **{n: tc._json_bytes(v) for n, v in side.items()}}.items():
        tc._write_file(target / name, data)
    return target


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--method", choices=METHODS, required=True)
    parser.add_argument("--preset", choices=tc.PRESETS, default="tiny")
    parser.add_argument("--group", type=int, help="group size (default 32 for tiny, else 128)")
    args = parser.parse_args(argv)
    kwargs = tc.preset(args.preset)
    kwargs.pop("layout", None)
    group = args.group or (32 if args.preset == "tiny" else 128)
    print(build_quantized(args.out_dir, args.method, group=group, **kwargs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
