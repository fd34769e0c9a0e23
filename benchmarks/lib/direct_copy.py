"""A bare copy of the shards with O_DIRECT reads and writes: no page cache, no hashing.

Each shard is read and written in 8 MiB blocks through aligned buffers with ``O_DIRECT`` on
both ends, ``--threads`` shards at a time (the last partial block goes through the page cache,
as O_DIRECT needs whole blocks), then fsynced. No hashing, no layout work, no page cache: a
reference for what moving these bytes costs on this disk, beside ``cp`` (which goes through the
page cache) and the naive way.

    python benchmarks/direct_copy.py OUT SHARD [SHARD ...] [--threads 2]

Prints one JSON line with the bytes copied.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

BLOCK = 8 * 1024 * 1024
ALIGN = 4096  # O_DIRECT wants offsets, lengths and buffer addresses aligned to the device block


def copy_direct(src: Path, dst: Path) -> int:
    size = src.stat().st_size
    direct_end = size - size % ALIGN
    buf = mmap.mmap(-1, BLOCK)  # anonymous mappings are page-aligned
    try:
        fin = os.open(src, os.O_RDONLY | os.O_DIRECT)
        fout = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    except OSError as e:  # tmpfs and some others refuse O_DIRECT with EINVAL
        raise SystemExit(
            f"error: O_DIRECT open of {src} or {dst} failed ({e.strerror}); use a disk-backed --workdir"
        ) from None
    try:
        pos = 0
        while pos < direct_end:
            view = memoryview(buf)[: min(BLOCK, direct_end - pos)]
            got = os.preadv(fin, [view], pos)
            if got != len(view):
                raise SystemExit(f"{src}: short read at {pos}")
            os.pwrite(fout, view, pos)
            view.release()
            pos += got
    finally:
        os.close(fin)
        os.close(fout)
    with open(src, "rb") as f, open(dst, "r+b") as g:
        f.seek(direct_end)
        g.seek(direct_end)
        g.write(f.read())
        g.flush()
        os.fsync(g.fileno())
    return size


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("shards", type=Path, nargs="+")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(args.threads) as pool:
        copied = sum(pool.map(lambda s: copy_direct(s, args.out / s.name), args.shards))
    print(json.dumps({"bytes": copied}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
