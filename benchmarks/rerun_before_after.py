"""Rerun cost of an unchanged source (issue 29): the same split command run again over a
finished split of the 397B-FP8 shape, two source trees interleaved in one run.

    git worktree add --detach /tmp/base main
    python benchmarks/rerun_before_after.py /tmp/base . --rounds 7

Builds the headers-only Qwen3.5-397B-A17B-FP8-shaped checkpoint (sparse: ~189,000 tensors,
~400 GB of holes) on a loop-mounted XFS image (``--workdir``; needs root and mkfs.xfs), and
splits it once per tree with ``--reflink always`` (the holes are shared, not written: a split
of ~100 MB on disk), each into its own OUT. Then per round, alternating which tree goes first:
``python -m qwen35_reshard --pp 4 MODEL OUT`` again (nothing to do) in a fresh interpreter,
with that tree first on ``PYTHONPATH``: wall and CPU seconds, and the bytes the process read
(``rchar`` of /proc/self/io: every read call, page cache or not). Prints medians and
after/before ratios; a rerun that read the tensors' bytes would read ~400 GB.
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

REPO = Path(__file__).resolve().parent.parent
BUILDER = REPO / "examples" / "tiny_checkpoint.py"
PY = sys.executable
PRESET = "qwen3.5-397b-a17b-fp8-headers"

# The CLI in this process, then what it read: rchar counts the bytes of every read call.
CHILD = r"""
import re, sys
from qwen35_reshard.cli.app import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
io = open("/proc/self/io").read()
print(int(re.search(r"rchar: (\d+)", io).group(1)), file=sys.stderr)
sys.exit(code or 0)
"""
KEYS = ("wall", "cpu", "read_mb")


def run(tree: Path, argv: list[str]) -> dict:
    """Wall and CPU seconds and MB read of the CLI with ``argv``, ``tree`` first on PYTHONPATH."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    proc = subprocess.run([PY, "-c", CHILD, *argv], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise SystemExit(f"{tree}: {' '.join(argv)} failed:\n{proc.stdout}\n{proc.stderr}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall": wall, "cpu": cpu, "read_mb": int(proc.stderr.split()[-1]) / 1e6, "out": proc.stdout}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("before", type=Path, help="source tree of the baseline (e.g. a worktree of main)")
    p.add_argument("after", type=Path, help="source tree of the change")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--workdir", type=Path, default=None, help="where the XFS image goes")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="rerun-bench-", dir=args.workdir))
    image, mnt = work / "xfs.img", work / "mnt"
    with open(image, "wb") as f:
        f.truncate(8 << 30)
    mnt.mkdir()
    subprocess.run(["mkfs.xfs", "-q", "-f", str(image)], check=True)
    subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], check=True)
    try:
        model = mnt / "model"
        subprocess.run([PY, str(BUILDER), str(model), "--preset", PRESET], check=True, capture_output=True)
        trees = {"before": args.before.resolve(), "after": args.after.resolve()}
        outs = {name: mnt / f"out-{name}" for name in trees}
        for name, tree in trees.items():
            first = run(tree, ["--pp", "4", "--reflink", "always", "-q", str(model), str(outs[name])])
            print(f"{name}: first split {first['wall']:.1f} s", flush=True)
        rows: dict[str, list[dict]] = {name: [] for name in trees}
        for r in range(args.rounds):
            order = list(trees) if r % 2 == 0 else list(reversed(trees))
            for name in order:
                m = run(trees[name], ["--pp", "4", str(model), str(outs[name])])
                if "nothing to do" not in m["out"]:
                    raise SystemExit(f"{name}: the rerun did something:\n{m['out']}")
                rows[name].append(m)
                print(
                    f"  [round {r + 1}] {name:6s} {m['wall']:6.2f} s wall {m['cpu']:6.2f} s cpu "
                    f"{m['read_mb']:8.1f} MB read",
                    flush=True,
                )
        med = {name: {k: statistics.median(m[k] for m in rows[name]) for k in KEYS} for name in trees}
        print(f"\nrerun of a finished pp=4 split of {PRESET}, medians of {args.rounds} rounds:")
        for k in KEYS:
            b, a = med["before"][k], med["after"][k]
            print(f"  {k:8s} before {b:9.2f}  after {a:9.2f}  after/before {a / b:.3f}")
        return 0
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
