"""The ways people split a checkpoint by pipeline stage today, without qwen35-reshard.

``safetensors.torch.load_file`` shards, keep the stage's tensors by layer, ``save_file`` them
as the stage's ``model.safetensors``, fsync it. Three versions of that script (``--way``):

- ``every-shard`` (the default): for each stage, load every shard, keep the stage's tensors,
  save. What a script run once per stage does; every shard is read once per stage.
- ``index``: for each stage, load only the shards the index lists for the stage's tensors.
  The careful version: a shard is read once per stage that needs it (two stages for a shard
  that straddles a stage boundary).
- ``all-in-memory``: load every shard once, sort all tensors into their stages, then save
  each stage. Each shard is read once, but the whole model is held in memory.

All three place every tensor the way qwen35-reshard does for SGLang, so all write the same
bytes; the first two hold at most one stage plus one shard in memory.

    python benchmarks/naive_split.py MODEL OUT --pp 4 [--way every-shard|index|all-in-memory]

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

WAYS = ("every-shard", "index", "all-in-memory")
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
    if name.startswith("model.visual.pos_embed."):
        return {0}
    if name.startswith("model.visual."):
        return set(range(pp))
    return {pp - 1}  # norm, lm_head, mtp.*


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--pp", type=int, required=True)
    p.add_argument("--way", choices=WAYS, default=WAYS[0])
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
    shards = sorted(set(weight_map.values()))
    stages: list[dict] = [{} for _ in range(args.pp)]

    def save(rank: int) -> None:
        out = args.out / f"pp{rank}"
        out.mkdir(parents=True, exist_ok=True)
        save_file(stages[rank], out / "model.safetensors", metadata={"format": "pt"})
        fd = os.open(out / "model.safetensors", os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        stages[rank] = {}

    if args.way == "all-in-memory":
        for shard in shards:
            for name, tensor in load_file(args.model / shard).items():
                for rank in owners(name, ranges, tied, has_mtp):
                    stages[rank][name] = tensor
        for rank in range(args.pp):
            save(rank)
    else:
        for rank in range(args.pp):
            wanted = {n for n in weight_map if rank in owners(n, ranges, tied, has_mtp)}
            needed = sorted({weight_map[n] for n in wanted}) if args.way == "index" else shards
            for shard in needed:
                tensors = load_file(args.model / shard)
                stages[rank].update({k: v for k, v in tensors.items() if k in wanted})
                del tensors
            save(rank)
    t2 = time.perf_counter()
    print(json.dumps({"import_seconds": round(t1 - t0, 3), "split_seconds": round(t2 - t1, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
