"""Fetching from the Hub over a paced link: one node's stage and a whole split against
huggingface_hub's ``snapshot_download``: bytes, time, time to the first data byte, data
throughput, requests per GB and peak RSS per process.

``tests/support/hub_server.py`` (a real HTTP server on 127.0.0.1 with a CDN origin) serves
checkpoints with the Qwen3.5-35B-A3B structure (fused experts, ``--layers`` decoder layers) of
each ``--sizes`` bytes in about ``--shards`` shards (default: 463 MB and 1.8 GB, 35 shards each),
every connection paced by ``--link`` (a rate in bytes/s per connection and a wait per request;
default 10 MB/s and 30 ms, a wide-area link; ``0:0`` is bare loopback, which hides both). Per
round, each command is a fresh process with a fresh ``HF_HOME`` and stage cache:

- ``snapshot_download``: huggingface_hub's with its defaults (what vLLM and SGLang do on every
  node): the baseline, measured in the same run;
- ``--pp 4 --rank 1``: ``qwen35-reshard --pp 4 --rank 1 REPO OUT`` (one node's stage);
- ``--pp 4``: ``qwen35-reshard --pp 4 REPO OUT`` (the whole split);
- with ``--serve``, ``in-server rank 1``: ``server_stage`` for rank 1 (the servers' own path).

Ours run once per tree (``--before REF``: before and after side by side, the order rotating).
Columns: bytes are the body bytes the server sent; time the process's wall time; ``time/bytes``
is (time / stock time) / (bytes / stock bytes), 1.00 meaning time follows bytes; ``first data``
when the first answer carrying tensor data (a whole shard, or a range past the shard's header)
began to be sent, from the process's start; ``data MB/s`` the tensor data's bytes over the time
from then to the last such answer's end; requests per GB of body bytes; the process's own peak
RSS (through ``lib.procs``' launcher). With two sizes or more, a line per command fits time =
fixed + bytes / rate.

    python -m benchmarks wan                                  # 463 MB and 1.8 GB, 10 MB/s, 30 ms
    python -m benchmarks wan --before main --sizes 4.63e8     # before and after, one size
    python -m benchmarks wan --link 50e6:0.005 --serve
"""

from __future__ import annotations

import argparse
import re
import shutil
import struct
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.lib import checkpoints, procs
from benchmarks.lib.links import HubServer, LogEntry, hub_env, link_name
from benchmarks.lib.report import median, stamp, table
from benchmarks.lib.trees import Tree, order

QUICK = ["--sizes", "2e7", "--shards", "6", "--link", "0:0"]
BEFORE = True
REPO = "Qwen/Scaled"
PP = 4

STOCK = """
import sys
from huggingface_hub import snapshot_download
snapshot_download(sys.argv[1])
"""

SERVE = """
import sys
try:
    from qwen35_reshard.servers.unsplit import server_stage
except ImportError:  # before the servers' folder
    from qwen35_reshard.serve import server_stage
partition = [int(x) for x in sys.argv[3].split(",")]
try:  # the layout object (issue 44), else the settings one by one
    from qwen35_reshard.model.parallelism import Parallelism
    given = ((Parallelism(pp=len(partition), partition=tuple(partition)),), {})
except ImportError:
    given = ((), {"runtime": "sglang", "partition": partition})
print(server_stage(sys.argv[1], *given[0], rank=int(sys.argv[2]), **given[1]).how)
"""

_RANGE_START = re.compile(r"bytes=(\d+)-")


@dataclass(frozen=True)
class Fetch:
    """One command's fetch: seconds, body bytes, requests, peak RSS (bytes), seconds from its start
    to the first tensor-data byte, tensor-data bytes and their seconds in flight."""

    seconds: float
    sent: int
    requests: int
    peak_rss: int
    first_data: float
    data: int
    data_seconds: float


def header_ends(model: Path) -> dict[str, int]:
    """Where each shard's tensor data begins (past the 8-byte length and the JSON header)."""
    ends = {}
    for p in checkpoints.shard_files(model):
        with open(p, "rb") as f:
            ends[p.name] = 8 + struct.unpack("<Q", f.read(8))[0]
    return ends


def is_data(e: LogEntry, ends: dict[str, int]) -> bool:
    """Whether the answer carried tensor data: a whole shard, or a range past its header. A range
    from byte 0 is a header read (qwen35-reshard reads a header's first 64 KiB at once: tensor
    bytes it does not use, while planning), not the data's start."""
    if e.method != "GET" or e.sent <= 0 or e.file not in ends:
        return False
    m = _RANGE_START.match(e.range or "")
    if m is None:
        return True
    start = int(m.group(1))
    return start >= ends[e.file] or 0 < start < ends[e.file] < start + e.sent


def fetch(argv: list[str], *, tree: Tree, hub: HubServer, node: Path, ends: dict[str, int]) -> Fetch:
    """Run ``argv`` as a fresh node (its own caches under ``node``) and read the server's log."""
    hub.clear_log()
    latency = hub.state.latency
    t0 = time.monotonic()
    m = procs.run(argv, env=hub_env(tree.env(), hub, node))
    log = hub.log
    data = [e for e in log if is_data(e, ends)]
    first = min((e.started + latency for e in data), default=float("nan"))
    last = max((e.ended for e in data), default=float("nan"))
    data_bytes = sum(e.sent for e in data)
    return Fetch(m.wall, sum(e.sent for e in log), len(log), m.peak_rss, first - t0, data_bytes, last - first)


def main(argv: list[str], trees: list[Tree]) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks wan", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="4.63e8,1.811e9", help="checkpoint bytes, comma-separated")
    p.add_argument("--shards", type=int, default=35, help="shards per checkpoint, about (default 35)")
    p.add_argument("--layers", type=int, default=16, help="decoder layers (default 16)")
    p.add_argument(
        "--link", default="10e6:0.03", help="RATE:LATENCY, bytes/s per connection and s per request"
    )
    p.add_argument("--rounds", type=int, default=1, help="rounds (medians; default 1)")
    p.add_argument("--serve", action="store_true", help="also the servers' in-server path for rank 1")
    p.add_argument("--work", type=Path, default=None, help="scratch directory (default: a new temp dir)")
    args = p.parse_args(argv)
    rate, latency = (float(x) for x in args.link.split(":"))
    work = Path(tempfile.mkdtemp(prefix="bench-wan-", dir=args.work))
    print(f"# wan, {stamp()}: {link_name(rate, latency)}; scratch {work}", flush=True)
    whats = {"--pp 4 --rank 1": ["--rank", "1"], "--pp 4": []}
    rows, fits = [], {}
    try:
        with HubServer() as hub:
            hub.set_pacing(rate or None, latency)
            for size in (float(s) for s in args.sizes.split(",")):
                model = checkpoints.scaled(
                    work / f"model-{size:g}", size, layers=args.layers, shards=args.shards
                )
                ends = header_ends(model)
                repo = f"{checkpoints.size(model) / 1e6:,.0f} MB, {len(ends)} shards"
                hub.add_repo(REPO, model)
                from qwen35_reshard import read_checkpoint
                from qwen35_reshard.model.runtimes import default_partition

                partition = ",".join(
                    map(str, default_partition(read_checkpoint(model).num_layers, PP, "sglang"))
                )
                runs: dict[tuple[str, str], list[Fetch]] = {}
                for r in range(args.rounds):
                    node = Path(tempfile.mkdtemp(dir=work))
                    stock = [procs.PY, "-c", STOCK, REPO]
                    runs.setdefault(("snapshot_download", "stock"), []).append(
                        fetch(stock, tree=trees[0], hub=hub, node=node, ends=ends)
                    )
                    shutil.rmtree(node)
                    for tree in order(trees, r):
                        todo = {
                            w: [procs.PY, "-m", "qwen35_reshard", "--pp", str(PP), *x, REPO]
                            for w, x in whats.items()
                        }
                        if args.serve:
                            todo["in-server rank 1"] = [procs.PY, "-c", SERVE, REPO, "1", partition]
                        for what, cmd in todo.items():
                            node = Path(tempfile.mkdtemp(dir=work))
                            cmd = cmd if what.startswith("in-server") else [*cmd, str(node / "out")]
                            got = fetch(cmd, tree=tree, hub=hub, node=node, ends=ends)
                            runs.setdefault((what, tree.label), []).append(got)
                            shutil.rmtree(node)
                    print(f"  {repo}: round {r + 1} done", flush=True)
                shutil.rmtree(model)
                base = runs[("snapshot_download", "stock")]
                b_s, b_b = median([f.seconds for f in base]), median([f.sent for f in base])
                for (what, label), fs in runs.items():
                    s, b = median([f.seconds for f in fs]), median([f.sent for f in fs])
                    first, data = median([f.first_data for f in fs]), median([f.data for f in fs])
                    dsec = median([f.data_seconds for f in fs])
                    fits.setdefault((what, label), []).append((b, s))
                    rows.append(
                        [
                            repo,
                            what,
                            label,
                            f"{b / 1e6:,.0f} MB",
                            f"{s:.1f} s",
                            f"{(s / b_s) / (b / b_b):.2f}",
                            f"{first:.2f} s",
                            f"{data / dsec / 1e6:.1f}",
                            f"{median([f.requests for f in fs]) / (b / 1e9):,.0f}",
                            f"{max(f.peak_rss for f in fs) / 2**20:.0f} MiB",
                        ]
                    )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"\n{link_name(rate, latency)}; {args.layers} layers, fused experts; "
        f"medians of {args.rounds} round(s)\n"
    )
    head = [
        "repo",
        "what",
        "code",
        "bytes",
        "time",
        "time/bytes vs stock",
        "first data byte",
        "data MB/s",
        "requests/GB",
        "peak RSS",
    ]
    print(table(head, rows))
    for (what, label), pts in fits.items():
        if len(pts) >= 2:
            (b1, s1), (b2, s2) = pts[0], pts[-1]
            slope = (s2 - s1) / (b2 - b1)
            print(
                f"- {what} ({label}): fixed {s1 - b1 * slope:.2f} s + {1 / slope / 1e6:.0f} MB/s "
                "(a line through the sizes)"
            )
    return 0
