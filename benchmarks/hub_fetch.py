"""What a split from the Hub fetches, and how long planning from remote headers takes.

Serves synthetic checkpoints from ``tests/support/hub_server.py`` (a real HTTP server on 127.0.0.1
speaking the Hub's file protocol, with a CDN origin) and runs the real command against it:

1. ``--pp 4 --rank R`` for each R, each in a fresh cache as a node of its own: body bytes and
   requests per rank (from the server's request log), against the checkpoint's size and the
   stage's own size; then all four stages at once.
2. ``plan --pp 4`` of a checkpoint with many shards (the 397B-FP8 header-only shape; ``--shape
   tiny`` the tiny model): from a local directory (the baseline), from the Hub with a cold cache
   (every header fetched by range requests), and again with the kept headers; median of
   ``--rounds``.

With ``--before REF`` both run with each tree's code, side by side.

    python -m benchmarks hub_fetch                       # 300 MB scaled 35B-A3B + 397B-FP8 headers
    python -m benchmarks hub_fetch --size 1e9 --rounds 5 --before main
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.lib import checkpoints, procs
from benchmarks.lib.links import HubServer, hub_env
from benchmarks.lib.report import gb
from benchmarks.lib.trees import Tree, order

QUICK = ["--size", "2e7", "--rounds", "1", "--shape", "tiny"]
BEFORE = True
PP = 4


def run(args: list[str], *, tree: Tree, hub: HubServer, hf_home: Path) -> procs.Measure:
    """``qwen35-reshard ARGS`` with ``tree``'s code, a node of its own whose cache is ``hf_home``."""
    env = hub_env(tree.env(), hub, hf_home)
    env["HF_HOME"] = str(hf_home)
    return procs.run([procs.PY, "-m", "qwen35_reshard", *args], env=env)


def per_rank(work: Path, size: float, trees: list[Tree]) -> None:
    model = checkpoints.scaled(work / "scaled", size)
    total = sum(p.stat().st_size for p in model.iterdir())
    shards = sum(1 for p in model.glob("*.safetensors"))
    print(f"\n## {PP}-stage split of a {gb(total)} checkpoint ({shards} shards), one fresh cache per node\n")
    print(
        "| ranks | tree | stage bytes | fetched (body bytes) | of checkpoint | requests (Hub + CDN) "
        "| shards whole / ranged |"
    )
    print("|---|---|---:|---:|---:|---:|---|")
    with HubServer() as hub:
        hub.add_repo("Qwen/Scaled", model)
        for ranks, tree in [(r, t) for r in [[r] for r in range(PP)] + [list(range(PP))] for t in trees]:
            hub.clear_log()
            home = Path(tempfile.mkdtemp(dir=work))
            out = Path(tempfile.mkdtemp(dir=work)) / "out"
            rank_args = [a for r in ranks for a in ("--rank", str(r))] if len(ranks) < PP else []
            m = run(
                ["--pp", str(PP), *rank_args, "--json", "Qwen/Scaled", str(out)],
                tree=tree,
                hub=hub,
                hf_home=home,
            )
            doc = json.loads(m.stdout)
            stage_bytes = sum(s["bytes"] for s in doc["stages"] if s["stage"] in ranks)
            sent = sum(e.sent for e in hub.log)
            whole = {e.file for e in hub.log if e.origin == "cdn" and e.range is None}
            ranged = {f for s in doc["fetch"]["stages"] for f, how in s["shards"].items() if how == "ranges"}
            label = ",".join(map(str, ranks))
            print(
                f"| {label} | {tree.label} | {gb(stage_bytes)} | {gb(sent)} | {100 * sent / total:.1f}% | "
                f"{len(hub.log)} ({sum(e.origin == 'hub' for e in hub.log)} + "
                f"{sum(e.origin == 'cdn' for e in hub.log)}) | {len(whole)} / {len(ranged)} |"
            )


def plan_time(work: Path, rounds: int, shape: str, trees: list[Tree]) -> None:
    if shape == "tiny":
        model = checkpoints.build(work / "tiny", **checkpoints.tiny.preset("tiny"))
    else:
        model = checkpoints.headers(work / "big", "397B")
    shards = sum(1 for _ in model.glob("*.safetensors"))
    tensors = len(json.loads((model / "model.safetensors.index.json").read_text())["weight_map"])
    print(
        f"\n## plan --pp {PP} of {'the tiny' if shape == 'tiny' else 'a Qwen3.5-397B-A17B-FP8-shaped'} "
        "checkpoint "
        f"({tensors} tensors, {shards} shards)\n"
    )
    times: dict[tuple[str, str], list[float]] = {}
    requests = []
    with HubServer(hash_lfs=False) as hub:  # 400 GB of holes: no sha256 of them
        hub.add_repo("Qwen/Big", model)
        for r in range(rounds):
            for tree in order(trees, r):
                home = Path(tempfile.mkdtemp(dir=work))
                for name, source in (
                    ("local directory", str(model)),
                    ("Hub, cold cache", "Qwen/Big"),
                    ("Hub, kept headers", "Qwen/Big"),
                ):
                    hub.clear_log()
                    wall = run(["plan", "--pp", str(PP), source], tree=tree, hub=hub, hf_home=home).wall
                    times.setdefault((name, tree.label), []).append(wall)
                    if name == "Hub, cold cache" and tree.label == "after":
                        requests.append(len(hub.log))
    print("| source | tree | median s | min-max s | / local |")
    print("|---|---|---:|---:|---:|")
    for (name, label), values in times.items():
        med, base = statistics.median(values), statistics.median(times[("local directory", label)])
        print(f"| {name} | {label} | {med:.2f} | {min(values):.2f}-{max(values):.2f} | {med / base:.2f}x |")
    print(f"\ncold-cache plan: {statistics.median(requests):.0f} requests ({shards} shards)")


def main(argv: list[str], trees: list[Tree]) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks hub_fetch", description=__doc__.splitlines()[0])
    p.add_argument("--size", type=float, default=3e8, help="bytes of the per-rank checkpoint (default 3e8)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of the plan timing (default 3)")
    p.add_argument("--shape", choices=("397b", "tiny"), default="397b", help="the plan timing's checkpoint")
    p.add_argument("--work", type=Path, default=None, help="scratch directory (default: a new temp dir)")
    args = p.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="hub-bench-"))
    print(f"# hub_fetch, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, scratch {work}")
    per_rank(work, args.size, trees)
    plan_time(work, args.rounds, args.shape, trees)
    return 0
