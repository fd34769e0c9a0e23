"""Checkpoints several test files plan from: the small presets of the balanced-split tests, and
the headers-only 397B-A17B-FP8-shaped checkpoint (``fixture_397b``, a module-scoped fixture that
tests/conftest.py registers for every test)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from qwen35_reshard import read_checkpoint


def header_sizes(ref, model_dir: Path) -> tuple[list[int], dict[str, int]]:
    """Bytes of each decoder layer, and name -> bytes of every other tensor, from each shard's
    header alone (the 397B fixture is holes)."""
    root = Path(model_dir)
    weight_map = json.loads((root / "model.safetensors.index.json").read_bytes())["weight_map"]
    sizes = {}
    for file in sorted(set(weight_map.values())):
        with open(root / file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        for name, info in header.items():
            begin, end = info["data_offsets"]
            sizes[name] = end - begin
    layers: dict[int, int] = {}
    for name in list(sizes):
        m = ref.LAYER_RE.match(name)
        if m:
            layers[int(m.group(1))] = layers.get(int(m.group(1)), 0) + sizes.pop(name)
    return [layers[i] for i in range(len(layers))], sizes


SMALL = {
    "untied": {"layers": 32, "vocab": 1024, "layout": "fused"},
    "tied": {"layers": 32, "vocab": 1024, "layout": "per_expert", "tied": True},
    "fp8_big_vocab": {"layers": 24, "vocab": 4096, "layout": "per_expert_fp8"},
}


@pytest.fixture(scope="module")
def fixture_397b(ref, tiny, tmp_path_factory):
    """The benchmark's headers-only 397B-A17B-FP8-shaped checkpoint (~189,000 tensors, sparse)."""
    model = tiny.build_checkpoint(
        tmp_path_factory.mktemp("q397b") / "model", **tiny.preset("qwen3.5-397b-a17b-fp8-headers")
    )
    return read_checkpoint(model), header_sizes(ref, model)
