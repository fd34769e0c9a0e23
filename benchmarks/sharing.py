"""Block sharing on XFS and Btrfs: a split (``--reflink auto``) against ``cp --reflink=always``
and a plain copy of the shards, time and the filesystem's growth.

Root only: each filesystem of ``--fs`` is made in a loop-mounted image file; a ``--size``
checkpoint (the Qwen3.5-35B-A3B structure) is built on it and, interleaved, with the page cache
dropped (or, without root to drop it, the source read into it) before each: the split, its dry
run, ``cp --reflink=always`` and ``cp --reflink=never`` of the shards (each then ``sync``), and
a floor: the shards cloned, the non-weight files copied into OUT and each stage directory, one
``syncfs``, which is what a split that shares must create and make durable, with nothing else.
Reports the time, the growth of the filesystem's used space (df), the bytes the split shared,
and the split against the bound of issue 13 (2 x ``cp --reflink=always`` + its dry run). With
``--before REF`` the split and its dry run run with REF's code too.

    python -m benchmarks sharing --fs xfs,btrfs --size 2e9
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from benchmarks.lib import checkpoints, pages, procs
from benchmarks.lib.report import gb, median
from benchmarks.lib.trees import Tree

QUICK = ["--fs", "xfs", "--size", "3e7", "--rounds", "1"]
BEFORE = True
PY = procs.PY
shard_files = checkpoints.shard_files


def prepare_cache(model: Path) -> None:
    if not pages.drop_all():
        os.sync()
        pages.warm(shard_files(model))


def used_bytes(path: Path) -> int:
    """Bytes in use on the filesystem of ``path``, as df shows them, after a sync."""
    subprocess.run(["sync", "-f", str(path)], check=True)
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def mount_image(kind: str, work: Path, size: int) -> Path:
    """A fresh loop-mounted ``kind`` filesystem of ``size`` bytes under ``work``."""
    image, mnt = work / f"{kind}.img", work / kind
    with open(image, "wb") as f:
        f.truncate(size)
    mnt.mkdir(exist_ok=True)
    mkfs = {"xfs": ["mkfs.xfs", "-q", "-f"], "btrfs": ["mkfs.btrfs", "-q", "-f"]}[kind]
    subprocess.run([*mkfs, str(image)], check=True, capture_output=True)
    subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], check=True)
    return mnt


def measure_sharing(kind: str, size: int, args: argparse.Namespace, trees: list[Tree]) -> list[dict]:
    """reshard against cp --reflink=always and a plain copy on a loop-mounted ``kind`` filesystem."""
    mnt = mount_image(kind, args.workdir, int(2.5 * size) + 2**30)
    try:
        model, out = mnt / "model", mnt / "out"
        checkpoints.scaled(model, size)
        checkpoint = sum(p.stat().st_size for p in shard_files(model))
        shards = " ".join(f"'{p}'" for p in shard_files(model))
        todo: dict[str, tuple[list[str], Tree]] = {}
        for t in trees:
            tag = "" if t.label == "after" else f" ({t.label})"
            todo[f"reshard{tag}"] = (
                [PY, "-m", "qwen35_reshard", "--pp", str(args.pp), "--json", str(model), str(out)],
                t,
            )
            todo[f"reshard --dry-run{tag}"] = (
                [PY, "-m", "qwen35_reshard", "--pp", str(args.pp), "--dry-run", str(model), str(out)],
                t,
            )
        todo |= {
            name: (argv, trees[0])
            for name, argv in {
                "cp --reflink=always + sync": [
                    "sh",
                    "-c",
                    f"mkdir -p '{out}' && cp --reflink=always {shards} '{out}/' && sync '{out}'/*",
                ],
                "cp --reflink=never + sync": [
                    "sh",
                    "-c",
                    f"mkdir -p '{out}' && cp --reflink=never {shards} '{out}/' && sync '{out}'/*",
                ],
                _SHARING_FLOOR: ["sh", "-c", _sharing_floor(model, out, args.pp)],
            }.items()
        }
        rows = []
        for r in range(args.rounds):
            for name in list(todo)[r % len(todo) :] + list(todo)[: r % len(todo)]:
                shutil.rmtree(out, ignore_errors=True)
                prepare_cache(model)
                before = used_bytes(mnt)
                argv, tree = todo[name]
                m = procs.run(argv, env=tree.env())
                growth = used_bytes(mnt) - before
                result = json.loads(m.stdout)["result"] if name.split(" (")[0] == "reshard" else {}
                shared = result and result["bytes_shared"] / (result["bytes_shared"] + result["bytes_copied"])
                rows.append(
                    {
                        "fs": kind,
                        "method": name,
                        "round": r,
                        "wall": m.wall,
                        "growth": growth,
                        "checkpoint": checkpoint,
                        "shared": shared,
                    }
                )
                print(
                    f"  [{kind} round {r + 1}] {name:28s} {m.wall:7.2f} s  disk +{growth / 1e6:.1f} MB",
                    flush=True,
                )
        shutil.rmtree(out, ignore_errors=True)
        subprocess.run(todo["reshard"][0], check=True, capture_output=True, env=trees[0].env(), cwd="/")
        v = subprocess.run(
            [PY, "-m", "qwen35_reshard", "verify", str(out), "--source", str(model)],
            capture_output=True,
            env=trees[0].env(),
            cwd="/",
        )
        if v.returncode:
            raise SystemExit(f"{kind}: verify --source failed:\n{(v.stdout + v.stderr).decode()[-2000:]}")
        return rows
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
        (args.workdir / f"{kind}.img").unlink(missing_ok=True)


# The files a split that shares must create and the one barrier that makes them durable, with
# nothing else: every shard cloned whole, each stage's and OUT's non-weight files copied, one
# syncfs. A split also writes headers, indexes and manifests, copies what cannot be shared and
# checks what it wrote; this is less than any split does, not a way to split.
_SHARING_FLOOR = "floor: clones + side files + syncfs"


def _sharing_floor(model: Path, out: Path, pp: int) -> str:
    shards = " ".join(f"'{p}'" for p in shard_files(model))
    side = " ".join(
        f"'{p}'"
        for p in sorted(model.iterdir())
        if p.is_file() and p.suffix != ".safetensors" and p.name != "model.safetensors.index.json"
    )
    dirs = " ".join(f"'{out}/pp{r}'" for r in range(pp))
    return (
        f"mkdir -p {dirs} && cp --reflink=always {shards} '{out}/' && "
        f"for d in '{out}' {dirs}; do cp {side} \"$d/\"; done && sync -f '{out}'"
    )


def sharing_report(rows: list[dict]) -> list[str]:
    lines = []
    for kind in dict.fromkeys(r["fs"] for r in rows):
        mine = [r for r in rows if r["fs"] == kind]
        checkpoint = mine[0]["checkpoint"]
        lines += [
            f"### Block sharing on {kind} (loop-mounted image), {gb(checkpoint)} checkpoint, "
            f"median of {max(r['round'] for r in mine) + 1} rounds, interleaved",
            "",
            "| method | wall s (median) | disk growth (df) | growth / checkpoint |",
            "|---|---:|---:|---:|",
        ]
        med = {}
        for method in dict.fromkeys(r["method"] for r in mine):
            runs = [r for r in mine if r["method"] == method]
            wall, growth = median([r["wall"] for r in runs]), median([r["growth"] for r in runs])
            med[method] = wall
            lines.append(f"| {method} | {wall:.2f} | {growth / 1e6:.1f} MB | {growth / checkpoint:.2%} |")
        shared = median([r["shared"] for r in mine if r["method"] == "reshard"])
        reflink, plain = med["cp --reflink=always + sync"], med["cp --reflink=never + sync"]
        split, planning = med["reshard"], med["reshard --dry-run"]
        lines += [
            "",
            f"- reshard / (cp --reflink=always + sync) time **{split / reflink:.1f}x**; reshard / "
            "(2 x cp --reflink=always + its own dry run, the issue's bound as read here) "
            f"**{split / (2 * reflink + planning):.2f}x** (read as 2 x (cp + dry run): "
            f"{split / (2 * (reflink + planning)):.2f}x); "
            f"reshard / plain copy **{split / plain:.2f}x**; {shared:.2%} of the output's data-file "
            "bytes shared with the source (the tool's count; verify --source passed)",
            f"- the bound gives the split's writing (reshard minus its dry run: "
            f"{(split - planning) * 1000:.0f} ms) 2 x cp --reflink=always = {2 * reflink * 1000:.0f} ms; "
            f"creating the files and one barrier alone ({_SHARING_FLOOR}) takes "
            f"{med[_SHARING_FLOOR] * 1000:.0f} ms",
        ]
        if "reshard (before)" in med:
            old, old_plan = med["reshard (before)"], med["reshard --dry-run (before)"]
            lines.append(
                f"- after/before: split **{split / old:.2f}x**, dry run **{planning / old_plan:.2f}x**"
            )
        lines.append("")
    return ["", *lines] if lines else []


def main(argv: list[str], trees: list[Tree]) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks sharing", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--fs", default="xfs,btrfs", help="filesystems, comma-separated (root: loop-mounted images)"
    )
    p.add_argument("--size", type=float, default=2e9, help="checkpoint bytes (default 2e9)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--workdir", type=Path, default=None, help="parent of the images")
    args = p.parse_args(argv)
    args.workdir = Path(tempfile.mkdtemp(prefix="bench-sharing-", dir=args.workdir))
    try:
        rows = []
        for kind in args.fs.split(","):
            print(f"block sharing on {kind}:", flush=True)
            rows += measure_sharing(kind, int(args.size), args, trees)
    finally:
        shutil.rmtree(args.workdir, ignore_errors=True)
    print("\n".join(sharing_report(rows)))
    return 0
