"""Default vs balanced split of the Qwen3.5 MoE models, from their tensor shapes alone.

For each model shape (397B-A17B, 122B-A10B, 35B-A3B; BF16 with fused experts as released,
and block-FP8 with per-expert tensors as the -FP8 releases), both runtimes, MTP kept and
dropped, and each pp, it prints the runtime's default layer split and its fullest stage
beside the balanced split (``--partition balanced``) and its fullest stage. The tensors come
from examples/tiny_checkpoint.py's ``describe_model`` (real names, shapes and dtypes; nothing
is written), the stage bytes from the same placement rules and optimiser the tool uses.

It also times the optimiser on the 397B-FP8 shape at pp = 16 against planning that split
(``make_plan``), the rest of a dry run, measured in the same run.

    python -m benchmarks partition_table                 # pp = 2, 4, 8
    python -m benchmarks partition_table --pp 2,3,4,8,16

This tree only (the tables are the current placement rules'; the timing's baseline is make_plan
in the same run). tests/unit/plan/test_balance.py loads ``checkpoint`` from here.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples"))

import tiny_checkpoint  # noqa: E402

from qwen35_reshard.plan.balance import choose  # noqa: E402
from qwen35_reshard.plan.planner import make_plan  # noqa: E402
from qwen35_reshard.source.checkpoint import Checkpoint, SourceTensor  # noqa: E402

if TYPE_CHECKING:
    from benchmarks.lib.trees import Tree

QUICK = ["--pp", "2", "--rounds", "1"]
BEFORE = False

GB = 1e9
COMMON = {"vocab": 248320, "vision_dims": tiny_checkpoint.REAL_VISION, "mtp": True}
# Sizes from the public configs (../shared/docs/qwen35-checkpoint-facts.md §1); the head
# counts describe_model derives from hidden_size are right for 397B and 35B, not for 122B.
SHAPES = {
    "397B-A17B": {"layers": 60, "experts": 512, "hidden": 4096, "moe_intermediate": 1024},
    "122B-A10B": {
        "layers": 48,
        "experts": 256,
        "hidden": 3072,
        "moe_intermediate": 1024,
        "text_overrides": {"num_attention_heads": 32, "linear_num_value_heads": 64},
    },
    "35B-A3B": {"layers": 40, "experts": 256, "hidden": 2048, "moe_intermediate": 512},
}
LAYOUTS = {"BF16": "fused", "FP8": "per_expert_fp8"}


def checkpoint(shape: str, dtype: str) -> Checkpoint:
    """A headers-only Checkpoint (no files behind it) with the model's real tensors."""
    config, specs = tiny_checkpoint.describe_model(**SHAPES[shape], **COMMON, layout=LAYOUTS[dtype])
    tensors, offset = {}, 0
    for spec in specs:
        n = tiny_checkpoint.nbytes(spec)
        tensors[spec.name] = SourceTensor(spec.name, "shapes", spec.dtype, spec.shape, offset, n)
        offset += n
    text = config.get("text_config", config)
    return Checkpoint(
        root=Path(f"{shape}-{dtype}"),
        config=config,
        config_sha256="",
        index_sha256=None,
        num_layers=text["num_hidden_layers"],
        tied_embeddings=False,
        files=("shapes",),
        file_sizes={"shapes": offset},
        tensors=tensors,
        extra_files=(),
    )


def weights() -> list[str]:
    """What each group weighs (the byte model's inputs), to check against the notes."""
    lines = [
        "| model | linear-attn layer | full-attn layer | embed | lm_head | MTP block | vision |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for shape in SHAPES:
        for dtype in LAYOUTS:
            c = choose(checkpoint(shape, dtype), pp=2, runtime="vllm")  # vLLM: embed and vision on all
            s0, s1 = c.default_stages[0].parts, c.default_stages[-1].parts
            full = [b for b, f in zip(c.costs.layer_bytes, c.costs.full_attention, strict=True) if f]
            lines.append(
                f"| {shape} {dtype} | {_gb(c.costs.layer_bytes[0])} | {_gb(full[0])} | {_gb(s0['embed'])} "
                f"| {_gb(s1['lm_head'])} | {_gb(s1['mtp'])} | {_gb(s0['visual'])} |"
            )
    return lines


def table(pps: list[int]) -> list[str]:
    lines = [
        "| model | runtime | MTP | pp | default split | fullest GB | balanced split | fullest GB | saved |",
        "|---|---|---|---:|---|---:|---|---:|---:|",
    ]
    for shape in SHAPES:
        for dtype in LAYOUTS:
            ckpt = checkpoint(shape, dtype)
            for runtime in ("sglang", "vllm"):
                for keep_mtp in (True, False):
                    for pp in pps:
                        c = choose(ckpt, pp=pp, runtime=runtime, keep_mtp=keep_mtp)
                        before = max(s.total_bytes for s in c.default_stages)
                        after = max(s.total_bytes for s in c.stages)
                        saved = "optimal" if c.default_optimal else f"{(before - after) / before:.1%}"
                        lines.append(
                            f"| {shape} {dtype} | {runtime} | {'kept' if keep_mtp else 'no'} | {pp} "
                            f"| {_split(c.default)} | {before / GB:.2f} | {_split(c.partition)} "
                            f"| {after / GB:.2f} | {saved} |"
                        )
    return lines


def timing(rounds: int) -> list[str]:
    """Optimiser time against make_plan time for the same split, 397B FP8 at pp = 16."""
    ckpt = checkpoint("397B-A17B", "FP8")
    opt, plan = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        c = choose(ckpt, pp=16, runtime="sglang", keep_mtp=True)
        t1 = time.perf_counter()
        make_plan(ckpt, pp=16, runtime="sglang", partition=list(c.partition))
        t2 = time.perf_counter()
        opt.append(t1 - t0)
        plan.append(t2 - t1)
    o, p = statistics.median(opt), statistics.median(plan)
    return [
        f"397B-A17B FP8 shape ({len(ckpt.tensors)} tensors), pp=16, sglang, median of {rounds}: "
        f"balanced partition {o * 1000:.0f} ms (costs from headers + optimiser), "
        f"make_plan {p * 1000:.0f} ms; ratio {o / p:.2f}"
    ]


def _gb(n: int) -> str:
    return f"{n / GB:.2f}"


def _split(partition: tuple[int, ...]) -> str:
    return ",".join(map(str, partition))


def main(argv: list[str], trees: list[Tree]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks partition_table", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--pp", default="2,4,8", help="comma-separated stage counts (default 2,4,8)")
    parser.add_argument("--rounds", type=int, default=3, help="timing rounds (default 3)")
    args = parser.parse_args(argv)
    pps = [int(p) for p in args.pp.split(",")]
    print("\n".join(weights()))
    print()
    print("\n".join(table(pps)))
    print()
    print("\n".join(timing(args.rounds)))
    return 0
