"""Split and verify times of two source trees interleaved in one run (a change's before/after).

    git worktree add --detach /tmp/base main
    python benchmarks/split_verify_before_after.py /tmp/base . MODEL --rounds 3

Per round, alternating which tree goes first, each tree first on ``PYTHONPATH``, in a fresh
interpreter: ``python -m qwen35_reshard --pp 2 MODEL OUT`` into a new OUT, then
``python -m qwen35_reshard verify OUT --source MODEL``. Prints the medians of wall and CPU time
and after/before ratios. A model of many small tensors shows the per-tensor costs, e.g.
``examples/tiny_checkpoint.py MODEL --layout per_expert_fp8 --layers 32 --experts 512 --hidden 64
--moe-intermediate 32 --vocab 256 --no-vision --shard-bytes 20000000`` (~100,000 tensors).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PY = sys.executable


def run(tree: Path, argv: list[str]) -> tuple[float, float]:
    """Wall and CPU seconds of ``argv`` with ``tree`` first on PYTHONPATH."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    # Not run from a checkout: "-m" puts the working directory before PYTHONPATH.
    subprocess.run(argv, env=env, cwd=tempfile.gettempdir(), check=True, stdout=subprocess.DEVNULL)
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("model", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    keys = ("split", "split_cpu", "verify", "verify_cpu")
    res: dict[str, dict[str, list[float]]] = {k: {key: [] for key in keys} for k in trees}
    work = Path(tempfile.mkdtemp(prefix="split-verify-"))
    try:
        for r in range(args.rounds):
            for k in list(trees) if r % 2 == 0 else list(trees)[::-1]:
                out = work / k
                model = str(args.model)
                split = run(trees[k], [PY, "-m", "qwen35_reshard", "--pp", "2", model, str(out)])
                check = run(trees[k], [PY, "-m", "qwen35_reshard", "verify", str(out), "--source", model])
                for key, value in zip(keys, (*split, *check), strict=True):
                    res[k][key].append(value)
                shutil.rmtree(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for key in keys:
        b, a = (statistics.median(res[k][key]) for k in trees)
        print(f"{key:11s} median before {b:.3f} s, after {a:.3f} s: after/before **{a / b:.3f}**")
    return 0


if __name__ == "__main__":
    sys.exit(main())
