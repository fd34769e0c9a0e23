"""What the model's schema check (issue 10) adds to a dry run, on the 397B-FP8 shape.

Builds the headers-only (sparse) Qwen3.5-397B-A17B-FP8-shaped checkpoint of
``examples/tiny_checkpoint.py`` (189,042 tensors, ~46 MB on disk), then, in interleaved
rounds in one process: the dry run's work (read index, config and every header; plan for
``--pp 4``, which includes the check), and the check alone (derive every required tensor
with its shape from config.json and the headers' dtypes, compare). Prints medians, the
number of required tensors and the check's share of the dry run.

    python benchmarks/bench_schema.py [--rounds 5] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

import tiny_checkpoint  # noqa: E402

from qwen35_reshard import make_plan, read_checkpoint  # noqa: E402
from qwen35_reshard.model import schema  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--workdir", type=Path, default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(dir=args.workdir) as work:
        model = Path(work) / "q397b-fp8-headers"
        tiny_checkpoint.build_checkpoint(model, **tiny_checkpoint.preset("qwen3.5-397b-a17b-fp8-headers"))
        gc.disable()  # as the CLI does for reading and planning
        dry, check = [], []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            ckpt = read_checkpoint(model)
            make_plan(ckpt, pp=4)
            dry.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            required = schema.required_tensors(ckpt.config, ckpt.tensors)
            schema.check_complete(required, ckpt.tensors, str(model))
            check.append(time.perf_counter() - t0)
            gc.collect()
        d, c = statistics.median(dry), statistics.median(check)
        runs = ", ".join(f"{x:.3f}" for x in dry)
        print(f"{len(ckpt.tensors):,} tensors in {len(ckpt.files)} shards; schema: {len(required.tensors):,}")
        print(f"dry run (read + plan, check included): median {d:.3f} s  ({runs})")
        alone = ", ".join(f"{x:.3f}" for x in check)
        print(f"schema check alone:                    median {c:.3f} s  ({alone})")
        print(f"check / dry run: {c / d:.1%}")


if __name__ == "__main__":
    main()
