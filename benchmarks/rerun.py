"""The cost of running a finished split's command again over an unchanged source: wall, CPU
and bytes read, against the bytes of the checkpoint.

Builds the header-only Qwen3.5-397B-A17B-FP8 checkpoint (~189,000 tensors, ~400 GB of holes) on a
loop-mounted XFS image (``--fs xfs``: root and mkfs.xfs; the holes are shared, not written: a split
of ~100 MB on disk) and splits it once per tree with ``--reflink always``, each into its own OUT
(``--tiny --fs none``: the tiny model in a temporary directory, a check that it runs). Then per
round, the trees' order rotating: ``python -m qwen35_reshard --pp 4 MODEL OUT`` again (nothing to
do) in a fresh interpreter: wall and CPU seconds and the bytes the process read (``rchar`` of
/proc/self/io: every read call, page cache or not). A rerun that read the tensors would read
the checkpoint (the baseline column).

    python -m benchmarks rerun --before main --rounds 7
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from benchmarks.lib import checkpoints, procs
from benchmarks.lib.report import median, ratio, table
from benchmarks.lib.trees import Tree, order

QUICK = ["--tiny", "--fs", "none", "--rounds", "1"]
BEFORE = True

# The CLI in this process, then what it read: rchar counts the bytes of every read call.
_CHILD = r"""
import re, sys
from qwen35_reshard.cli.app import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
print(int(re.search(r"rchar: (\d+)", open("/proc/self/io").read()).group(1)), file=sys.stderr)
sys.exit(code or 0)
"""


@contextmanager
def filesystem(kind: str, work: Path) -> Iterator[Path]:
    """``work`` itself (``none``) or a fresh 8 GB loop-mounted XFS image under it."""
    if kind == "none":
        yield work
        return
    image, mnt = work / "xfs.img", work / "mnt"
    with open(image, "wb") as f:
        f.truncate(8 << 30)
    mnt.mkdir()
    subprocess.run(["mkfs.xfs", "-q", "-f", str(image)], check=True)
    subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def main(argv: list[str], trees: list[Tree]) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks rerun", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--fs", choices=("xfs", "none"), default="xfs")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--workdir", type=Path, default=None, help="where the XFS image goes")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="rerun-bench-", dir=args.workdir))
    try:
        with filesystem(args.fs, work) as fs:
            if args.tiny:
                model = checkpoints.build(fs / "model", **checkpoints.tiny.preset("tiny"))
            else:
                model = checkpoints.headers(fs / "model", "397B")
            reflink = ["--reflink", "always"] if args.fs == "xfs" else []
            outs = {t.label: fs / f"out-{t.label}" for t in trees}
            for t in trees:
                argv_ = [procs.PY, "-c", _CHILD, "--pp", "4", *reflink, "-q", str(model), str(outs[t.label])]
                print(f"{t.label}: first split {procs.run(argv_, env=t.env()).wall:.1f} s", flush=True)
            res = {t.label: {"wall": [], "cpu": [], "read": []} for t in trees}
            for r in range(args.rounds):
                for t in order(trees, r):
                    m = procs.run(
                        [procs.PY, "-c", _CHILD, "--pp", "4", str(model), str(outs[t.label])], env=t.env()
                    )
                    if "nothing to do" not in m.stdout:
                        raise SystemExit(f"{t.label}: the rerun did something:\n{m.stdout}")
                    for key, value in zip(
                        ("wall", "cpu", "read"), (m.wall, m.cpu, int(m.stderr.split()[-1])), strict=True
                    ):
                        res[t.label][key].append(value)
            whole = checkpoints.size(model)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"\nrerun of a finished pp=4 split, medians of {args.rounds} rounds; checkpoint {whole / 1e9:.2f} GB"
    )
    rows = []
    for label, got in res.items():
        w, c, b = (median(got[k]) for k in ("wall", "cpu", "read"))
        rows.append([label, f"{w:.2f}", f"{c:.2f}", f"{b / 1e6:.1f} MB", f"{b / whole:.2e}"])
    print(table(["tree", "wall s", "CPU s", "read", "read / checkpoint"], rows))
    if len(trees) > 1:
        for key in ("wall", "cpu", "read"):
            print(f"{key:5s} after/before {ratio(median(res['after'][key]), median(res['before'][key]))}")
    return 0
