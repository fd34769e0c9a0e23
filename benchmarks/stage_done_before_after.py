"""A split's wall time and when each ``done ppN`` line comes, for two source trees interleaved in
one run (a change's before/after), stderr piped as in a CI job.

    git worktree add --detach /tmp/base main
    python benchmarks/stage_done_before_after.py /tmp/base . MODEL --pp 4 --rounds 5

Per round, alternating which tree goes first, each tree first on ``PYTHONPATH``, in a fresh
interpreter: ``python -m qwen35_reshard --pp PP MODEL OUT`` into a new OUT (on the filesystem of
``--work``: one that shares blocks, XFS, takes the ``syncfs`` path), reading stderr line by line.
Prints the medians of the split's wall time and of the time to the first and the last ``done``
line, and after/before ratios: the cost of finishing stages one by one is in the wall time, the
gain in the first ``done``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PY = sys.executable


def split(tree: Path, model: Path, out: Path, pp: int) -> tuple[float, float, float]:
    """Seconds to the split's end, to its first ``done`` line and to its last, with ``tree``
    first on PYTHONPATH."""
    env = dict(os.environ, PYTHONPATH=str(tree), QWEN35_RESHARD_PROGRESS_SECONDS="3600")
    argv = [PY, "-m", "qwen35_reshard", "--pp", str(pp), str(model), str(out)]
    start = time.perf_counter()
    # Not run from a checkout: "-m" puts the working directory before PYTHONPATH.
    proc = subprocess.Popen(
        argv, env=env, cwd=tempfile.gettempdir(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    done = [time.perf_counter() - start for line in proc.stderr if line.startswith("done ")]
    if proc.wait() != 0 or len(done) != pp:
        raise SystemExit(f"{argv} failed (rc {proc.returncode}, {len(done)} done lines)")
    return time.perf_counter() - start, done[0], done[-1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("model", type=Path)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--work", type=Path, default=None, help="where OUT goes (default: a temporary directory)")
    args = ap.parse_args()
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    keys = ("split", "first_done", "last_done")
    res: dict[str, dict[str, list[float]]] = {k: {key: [] for key in keys} for k in trees}
    work = Path(tempfile.mkdtemp(prefix="stage-done-", dir=args.work))
    try:
        for r in range(args.rounds):
            for k in list(trees) if r % 2 == 0 else list(trees)[::-1]:
                out = work / k
                for key, value in zip(keys, split(trees[k], args.model, out, args.pp), strict=True):
                    res[k][key].append(value)
                shutil.rmtree(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for key in keys:
        b, a = (statistics.median(res[k][key]) for k in trees)
        print(f"{key:10s} median before {b:.3f} s, after {a:.3f} s: after/before **{a / b:.3f}**")
    return 0


if __name__ == "__main__":
    sys.exit(main())
