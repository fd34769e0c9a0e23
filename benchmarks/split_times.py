"""A split's wall time, when its first and last ``done ppN`` lines come, and verify's time,
against ``cp`` + ``sync`` of the same shards.

Per round, the trees' order rotating, each in a fresh interpreter with the tree first on
``PYTHONPATH``: ``python -m qwen35_reshard --pp PP MODEL OUT`` into a new OUT (stderr piped as
in a CI job, read line by line), then ``python -m qwen35_reshard verify OUT --source MODEL``;
and the baseline, ``cp`` of the model's shards into a new directory and ``sync`` of them. The
model: ``--model`` or, by default, the many-tensor per-expert FP8 checkpoint (~100,000 tensors:
the per-tensor costs); ``--tiny`` the 8-layer tiny model. ``--work`` puts OUT on another
filesystem (on XFS a split shares blocks and takes the ``syncfs`` path).

    python -m benchmarks split_times --rounds 5
    python -m benchmarks split_times --before main --model MODEL --pp 4
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
from pathlib import Path

from benchmarks.lib import checkpoints, procs
from benchmarks.lib.report import median, ratio, table
from benchmarks.lib.trees import Tree, order

QUICK = ["--tiny", "--rounds", "1", "--pp", "2"]
BEFORE = True
KEYS = ("split", "first done", "last done", "verify")


def main(argv: list[str], trees: list[Tree]) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks split_times", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--tiny", action="store_true", help="the 8-layer tiny model (a check that it runs)")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--work", type=Path, default=None, help="where OUT goes (default: a temporary directory)")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="split-times-", dir=args.work))
    try:
        model = args.model
        if model is None:
            recipe = checkpoints.tiny.preset("tiny") if args.tiny else checkpoints.MANY_TENSORS
            model = checkpoints.build(work / "model", **recipe)
        res = {t.label: {k: [] for k in KEYS} for t in trees}
        copies: list[float] = []
        shards = [str(p) for p in checkpoints.shard_files(model)]
        for r in range(args.rounds):
            copy = work / "cp"
            copy.mkdir()
            wall, _ = procs.timed(
                ["sh", "-c", 'd="$1"; shift; cp "$@" "$d/" && sync "$d"/*', "sh", str(copy), *shards]
            )
            copies.append(wall)
            shutil.rmtree(copy)
            for tree in order(trees, r):
                out = work / "out"
                env = tree.env(QWEN35_RESHARD_PROGRESS_SECONDS="3600")
                argv_ = [procs.PY, "-m", "qwen35_reshard", "--pp", str(args.pp), str(model), str(out)]
                wall, done = procs.timed(argv_, env=env, marker="done ")
                if len(done) != args.pp:
                    raise SystemExit(f"{tree.path}: {len(done)} done lines for --pp {args.pp}")
                check = procs.run(
                    [procs.PY, "-m", "qwen35_reshard", "verify", str(out), "--source", str(model)],
                    env=tree.env(),
                )
                for key, value in zip(KEYS, (wall, done[0], done[-1], check.wall), strict=True):
                    res[tree.label][key].append(value)
                shutil.rmtree(out)
    finally:
        subprocess.run(["rm", "-rf", str(work)], check=False)
    base = median(copies)
    print(
        f"\n{model}, --pp {args.pp}, medians of {args.rounds} rounds; cp + sync of the shards: {base:.3f} s"
    )
    rows = []
    for label, got in res.items():
        med = {k: median(v) for k, v in got.items()}
        rows.append([label, *(f"{med[k]:.3f}" for k in KEYS), ratio(med["split"], base)])
    print(table(["tree", *(f"{k} s" for k in KEYS), "split / (cp + sync)"], rows))
    if len(trees) > 1:
        for key in KEYS:
            a, b = (median(res[t][key]) for t in ("after", "before"))
            print(f"{key:10s} after/before {ratio(a, b)}")
    return 0
