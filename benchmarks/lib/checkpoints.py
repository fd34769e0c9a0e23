"""The checkpoints the benchmarks measure, built by ``examples/tiny_checkpoint.py`` (the real
tensor names and dtypes; data random, or holes for the header-only shapes of the largest models).
A checkpoint already built at the path with the same recipe is reused (``.recipe`` beside it)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

from benchmarks.lib.trees import ROOT

sys.path.insert(0, str(ROOT / "examples"))
import tiny_checkpoint as tiny  # noqa: E402

# name: (preset, decoder layers, shards) of the header-only real shapes (sparse: holes for data).
HEADER_SHAPES = {
    "397B": ("qwen3.5-397b-a17b-fp8-headers", 60, 82),
    "2.4T": ("qwen3.8-2.4t-a95b-fp8-headers", 92, 216),
}

# Per-expert FP8 weights with a scale each, 512 experts x 32 layers, small dimensions: ~49,500
# tensors in stage 0 of pp=2, as many as a stage of the 397B FP8 checkpoint at pp=4.
MANY_TENSORS: dict[str, Any] = {
    "layout": "per_expert_fp8",
    "layers": 32,
    "experts": 512,
    "hidden": 64,
    "moe_intermediate": 32,
    "vocab": 256,
    "vision": False,
    "shard_bytes": 20_000_000,
}


def build(path: Path, **kwargs: Any) -> Path:
    """``tiny_checkpoint.build_checkpoint(path, **kwargs)``, unless ``path`` holds that already."""
    recipe = path.parent / f".{path.name}.recipe"
    want = json.dumps(kwargs, sort_keys=True, default=str)
    if path.is_dir() and recipe.exists() and recipe.read_text() == want:
        return path
    shutil.rmtree(path, ignore_errors=True)
    tiny.build_checkpoint(path, **kwargs)
    recipe.write_text(want)
    return path


def scaled(path: Path, size: float, *, layers: int = 40, shards: int | None = None) -> Path:
    """The Qwen3.5-35B-A3B structure (fused experts, MTP, vision) with ``layers`` decoder layers,
    its tensors within a few percent of ``size`` bytes and, given ``shards``, in that many shards."""
    target = size * 40 / layers  # the preset sizes 40 layers
    for _ in range(3):  # its dimensions come in steps: aim again from what it gave
        kwargs = {**tiny.preset("qwen3.5-35b-a3b-scaled", target_bytes=int(target)), "layers": layers}
        total = _tensor_bytes(kwargs)
        if abs(total - size) < 0.01 * size:
            break
        target *= size / total
    if shards:
        kwargs["shard_bytes"] = _shard_bytes(kwargs, shards)
    return build(path, **kwargs)


def _specs(kwargs: dict[str, Any]) -> list:
    return tiny.describe_model(**{k: v for k, v in kwargs.items() if k not in ("sparse", "shard_bytes")})[1]


def _tensor_bytes(kwargs: dict[str, Any]) -> int:
    return sum(map(tiny.nbytes, _specs(kwargs)))


def _shard_bytes(kwargs: dict[str, Any], shards: int) -> int:
    """The smallest shard size that cuts the model into at most ``shards`` shards (as the
    builder cuts: tensors in order, a new shard when the next one would not fit)."""
    specs = _specs(kwargs)
    lo, hi = 1, sum(map(tiny.nbytes, specs))
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if len(tiny._split_shards(specs, mid)) <= shards else (mid + 1, hi)
    return lo


def headers(path: Path, shape: str) -> Path:
    """The header-only checkpoint of a real shape (``HEADER_SHAPES``)."""
    return build(path, **tiny.preset(HEADER_SHAPES[shape][0]))


def tiny_twin(path: Path, shape: str) -> Path:
    """A checkpoint with the tensor names and dtypes of a real shape, tiny dimensions, and as
    many shards: the per-tensor costs alone."""
    preset, _, shards = HEADER_SHAPES[shape]
    kwargs = {**tiny.preset(preset), "hidden": 64, "moe_intermediate": 32, "vocab": 256, "sparse": False}
    kwargs["vision_dims"] = tiny.TINY_VISION
    described = {k: v for k, v in kwargs.items() if k not in ("sparse", "shard_bytes")}
    size = sum(map(tiny.nbytes, tiny.describe_model(**described)[1]))
    kwargs["shard_bytes"] = -(-size // shards)
    return build(path, **kwargs)


def many_tensors(path: Path) -> Path:
    """``MANY_TENSORS``: where the per-tensor cost is all there is."""
    return build(path, **MANY_TENSORS)


def shard_files(model: Path) -> list[Path]:
    """The model's ``*.safetensors`` files, by name."""
    return sorted(model.glob("*.safetensors"))


def size(model: Path) -> int:
    """Bytes of the model's weight files."""
    return sum(p.stat().st_size for p in shard_files(model))
