"""The way people split a checkpoint by pipeline stage today, without qwen35-reshard.

For each stage: ``safetensors.torch.load_file`` every shard that holds one of the stage's
tensors (the index says which), keep the stage's tensors, ``save_file`` them as the stage's
``model.safetensors``, fsync it. This is the generous version of that script: it uses the index
to skip shards the stage does not need, places every tensor the way qwen35-reshard does for
SGLang (so both write the same bytes), and never holds more than one stage plus one shard.

    python benchmarks/naive_split.py MODEL OUT --pp 4

Prints one JSON line with the seconds spent importing torch/safetensors and in the split.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

_LAYER = re.compile(r"^model\.(?:language_model\.)?layers\.(\d+)\.")


def sglang_ranges(num_layers: int, pp: int) -> list[tuple[int, int]]:
    """SGLang's default split: the last ``num_layers % pp`` stages get one layer more."""
    base, rem = divmod(num_layers, pp)
    sizes = [base + (1 if r >= pp - rem else 0) for r in range(pp)]
    starts = [sum(sizes[:r]) for r in range(pp)]
    return [(s, s + n) for s, n in zip(starts, sizes, strict=True)]


def owners(name: str, ranges: list[tuple[int, int]], tied: bool, has_mtp: bool) -> set[int]:
    """Stages that hold ``name`` (SGLang placement: see docs/qwen35-checkpoint-facts.md)."""
    pp = len(ranges)
    m = _LAYER.match(name)
    if m:
        layer = int(m.group(1))
        return {r for r, (a, b) in enumerate(ranges) if a <= layer < b}
    if ".embed_tokens." in name:
        return {0, pp - 1} if tied or has_mtp else {0}
    if name.startswith("model.visual."):
        return {0}
    return {pp - 1}  # norm, lm_head, mtp.*


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--pp", type=int, required=True)
    args = p.parse_args(argv)

    t0 = time.perf_counter()
    from safetensors.torch import load_file, save_file

    t1 = time.perf_counter()
    config = json.loads((args.model / "config.json").read_text())
    text = config.get("text_config", config)
    weight_map = json.loads((args.model / "model.safetensors.index.json").read_text())["weight_map"]
    tied = bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    has_mtp = any(n.startswith("mtp.") for n in weight_map)
    ranges = sglang_ranges(text["num_hidden_layers"], args.pp)
    for rank in range(args.pp):
        wanted = {n for n in weight_map if rank in owners(n, ranges, tied, has_mtp)}
        stage = {}
        for shard in sorted({weight_map[n] for n in wanted}):
            tensors = load_file(args.model / shard)
            stage.update({k: v for k, v in tensors.items() if k in wanted})
            del tensors
        out = args.out / f"pp{rank}"
        out.mkdir(parents=True, exist_ok=True)
        save_file(stage, out / "model.safetensors", metadata={"format": "pt"})
        fd = os.open(out / "model.safetensors", os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        del stage
    t2 = time.perf_counter()
    print(json.dumps({"import_seconds": round(t1 - t0, 3), "split_seconds": round(t2 - t1, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
