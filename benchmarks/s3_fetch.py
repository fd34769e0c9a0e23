"""What a split from ``s3://bucket/prefix`` fetches and how long it takes, against boto3's own
whole-object download of the same checkpoint (issue 38).

Starts ``tests/support/s3_server.py`` (moto's S3 server, signatures checked) in a process of its
own, paced like a wide-area link (``--rate`` bytes/s per request, ``--latency`` s before each
answer), uploads a scaled Qwen3.5-35B-A3B-shaped checkpoint (``examples/tiny_checkpoint.py``) and
runs, in interleaved rounds:

- stock: every object downloaded whole by one boto3 TransferManager (its defaults: 10
  requests in flight across the objects, 8 MB parts: what ``aws s3 sync`` does), in a
  process of its own as ours runs: the baseline measured in the same run;
- ``qwen35-reshard --pp 4 --rank 1 URI OUT``: one node's stage (ranged reads, the fetch engine);
- ``qwen35-reshard --pp 4 URI OUT``: a whole split straight from the bucket.

For each: bytes fetched (the command's ``--json`` ``fetch.fetched_bytes``), median seconds of the
whole process and of the transfer alone (stock: its downloads; ours: the write after planning,
``result.seconds``), MB/s, and ``(time ours / time stock) / (bytes ours / bytes stock)``: 1.0
means the ranged reads move their bytes as fast as the whole-object download moves its own.

With ``--before REF`` ours run with each tree's code, side by side.

    python -m benchmarks s3_fetch                                  # 200 MB, 10 MB/s, 30 ms, 3 rounds
    python -m benchmarks s3_fetch --size 1e8 --rate 0 --latency 0  # unpaced loopback
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.lib import checkpoints
from benchmarks.lib.links import s3_server
from benchmarks.lib.trees import Tree, order
from benchmarks.s3_clients import boto_client

QUICK = ["--size", "2e7", "--rounds", "1", "--rate", "0", "--latency", "0"]
BEFORE = True
BUCKET, PREFIX, PP = "bench", "qwen/scaled", 4


STOCK = f"""
import sys, time, boto3
from boto3.s3.transfer import TransferConfig, create_transfer_manager
s3 = boto3.client("s3", region_name="us-east-1")
started = time.perf_counter()
with create_transfer_manager(s3, TransferConfig()) as manager:
    done = [manager.download("{BUCKET}", "{PREFIX}/" + n, sys.argv[1] + "/" + n) for n in sys.argv[2:]]
    for d in done:
        d.result()
print(time.perf_counter() - started)
"""


def aws_env(info: dict, tree: Tree) -> dict:
    env = {k: v for k, v in tree.env().items() if not k.startswith("AWS_")}
    env.update(
        AWS_ENDPOINT_URL=info["endpoint"],
        AWS_ACCESS_KEY_ID=info["access_key"],
        AWS_SECRET_ACCESS_KEY=info["secret_key"],
        AWS_DEFAULT_REGION="us-east-1",
        AWS_EC2_METADATA_DISABLED="true",
    )
    return env


def stock(info: dict, names: list[str], dest: Path, tree: Tree) -> tuple[float, float, int]:
    """boto3's download in a process of its own, as ours runs: wall seconds (interpreter start
    included), seconds of the transfer alone, bytes."""
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", STOCK, str(dest), *names],
        env=aws_env(info, tree),
        check=True,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - started
    return wall, float(proc.stdout.split()[-1]), sum((dest / n).stat().st_size for n in names)


def ours(info: dict, args: list[str], work: Path, tree: Tree) -> tuple[float, float, int]:
    """The command: wall seconds, seconds of its write (the fetch and copy, after planning),
    bytes fetched."""
    out = Path(tempfile.mkdtemp(dir=work)) / "out"
    # A fresh node: the headers are fetched too.
    env = {**aws_env(info, tree), "QWEN35_RESHARD_S3_CACHE": tempfile.mkdtemp(dir=work)}
    started = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "qwen35_reshard",
            "--pp",
            str(PP),
            *args,
            "--json",
            f"s3://{BUCKET}/{PREFIX}",
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        sys.exit(f"{args} failed:\n{proc.stderr[-3000:]}")
    doc = json.loads(proc.stdout)
    return seconds, doc["result"]["seconds"], doc["fetch"]["fetched_bytes"]


def main(argv: list[str], trees: list[Tree]) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks s3_fetch", description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=float, default=2e8, help="checkpoint bytes")
    ap.add_argument("--rate", type=float, default=10e6, help="bytes/s per request (0: unpaced)")
    ap.add_argument("--latency", type=float, default=0.03, help="seconds before each answer")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--streams", type=int, default=None, help="ours: --streams (default: the tool's)")
    a = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="s3-bench-"))
    model = checkpoints.scaled(work / "model", a.size)
    names = sorted(p.name for p in model.iterdir() if p.is_file())
    rows: dict[str, list[tuple[float, float, int]]] = {"stock": []}
    with s3_server(a.rate or None, a.latency) as info:
        s3 = boto_client(info, 4)
        s3.create_bucket(Bucket=BUCKET)
        for n in names:
            s3.upload_file(str(model / n), BUCKET, f"{PREFIX}/{n}")
        for r in range(a.rounds):
            dest = Path(tempfile.mkdtemp(dir=work))
            rows["stock"].append(stock(info, names, dest, trees[0]))
            streams = ["--streams", str(a.streams)] if a.streams else []
            for tree in order(trees, r):
                tag = "" if tree.label == "after" else f" ({tree.label})"
                rows.setdefault(f"rank 1{tag}", []).append(ours(info, ["--rank", "1", *streams], work, tree))
                rows.setdefault(f"whole split{tag}", []).append(ours(info, streams, work, tree))
    link = f"{a.rate / 1e6:.0f} MB/s per request, {a.latency * 1e3:.0f} ms" if a.rate else "unpaced loopback"
    total = sum((model / n).stat().st_size for n in names)
    print(f"\n### {total / 1e6:.0f} MB checkpoint ({len(names)} objects), {link}, {a.rounds} rounds\n")
    print("| what | bytes | wall s | transfer s | transfer MB/s | ratio, wall | ratio, transfer |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    base_w = statistics.median(w for w, _, _ in rows["stock"])
    base_t = statistics.median(t for _, t, _ in rows["stock"])
    base_b = rows["stock"][0][2]
    for key, runs in rows.items():
        label = {"stock": "boto3 TransferManager, every object whole (stock)"}.get(
            key, f"qwen35-reshard --pp {PP} {key}"
        )
        w = statistics.median(r[0] for r in runs)
        t = statistics.median(r[1] for r in runs)
        b = runs[0][2]
        share = b / base_b
        print(
            f"| {label} | {b / 1e6:.1f} MB | {w:.2f} | {t:.2f} | {b / t / 1e6:.1f} | "
            f"{(w / base_w) / share:.2f} | {(t / base_t) / share:.2f} |"
        )
    print(
        "\nratio = (time / stock time) / (bytes / stock bytes); wall: the process, start and planning "
        "included; transfer: stock's download alone, ours the write after planning (fetch and copy)."
    )
    return 0
