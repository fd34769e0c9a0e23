"""What a split from the Hub fetches, and how long planning from remote headers takes.

Serves synthetic checkpoints from ``tests/support/hub_server.py`` (a real HTTP server on 127.0.0.1
speaking the Hub's file protocol, with a CDN origin) and runs the real command against it:

1. ``--pp 4 --rank R`` for each R, each in a fresh cache as a node of its own: body bytes and
   requests per rank (from the server's request log), against the checkpoint's size and the
   stage's own size; then all four stages at once.
2. ``plan --pp 4`` of a checkpoint with many shards: from a local directory (the baseline),
   from the Hub with a cold cache (every header fetched by range requests), and again with the
   kept headers; median of ``--rounds``.

    python benchmarks/hub_fetch.py                       # 300 MB scaled 35B-A3B + 397B-FP8 headers
    python benchmarks/hub_fetch.py --size 1e9 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "examples")]  # support.hub_server, tiny_checkpoint

import tiny_checkpoint  # noqa: E402

from support.hub_server import HubServer  # noqa: E402

PP = 4


def run(
    args: list[str], *, hub: HubServer | None, hf_home: Path
) -> tuple[float, subprocess.CompletedProcess]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(
        PYTHONPATH=str(ROOT),
        HF_HOME=str(hf_home),
        HF_HUB_DISABLE_XET="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        **({"HF_ENDPOINT": hub.url} if hub else {}),
    )
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "qwen35_reshard", *args], env=env, capture_output=True, text=True
    )
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        sys.exit(f"{' '.join(args)} failed:\n{proc.stderr}")
    return seconds, proc


def gb(n: float) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def per_rank(work: Path, size: float) -> None:
    kwargs = tiny_checkpoint.preset("qwen3.5-35b-a3b-scaled", target_bytes=int(size))
    model = tiny_checkpoint.build_checkpoint(work / "scaled", **kwargs)
    total = sum(p.stat().st_size for p in model.iterdir())
    shards = sum(1 for p in model.glob("*.safetensors"))
    print(f"\n## {PP}-stage split of a {gb(total)} checkpoint ({shards} shards), one fresh cache per node\n")
    print(
        "| ranks | stage bytes | fetched (body bytes) | of checkpoint | requests (Hub + CDN) "
        "| shards whole / ranged |"
    )
    print("|---|---:|---:|---:|---:|---|")
    with HubServer() as hub:
        hub.add_repo("Qwen/Scaled", model)
        for ranks in [[r] for r in range(PP)] + [list(range(PP))]:
            hub.clear_log()
            home = Path(tempfile.mkdtemp(dir=work))
            out = Path(tempfile.mkdtemp(dir=work)) / "out"
            rank_args = [a for r in ranks for a in ("--rank", str(r))] if len(ranks) < PP else []
            _, proc = run(
                ["--pp", str(PP), *rank_args, "--json", "Qwen/Scaled", str(out)], hub=hub, hf_home=home
            )
            doc = json.loads(proc.stdout)
            stage_bytes = sum(s["bytes"] for s in doc["stages"] if s["stage"] in ranks)
            sent = sum(e.sent for e in hub.log)
            whole = {e.file for e in hub.log if e.origin == "cdn" and e.range is None}
            ranged = {f for s in doc["fetch"]["stages"] for f, how in s["shards"].items() if how == "ranges"}
            label = ",".join(map(str, ranks))
            print(
                f"| {label} | {gb(stage_bytes)} | {gb(sent)} | {100 * sent / total:.1f}% | "
                f"{len(hub.log)} ({sum(e.origin == 'hub' for e in hub.log)} + "
                f"{sum(e.origin == 'cdn' for e in hub.log)}) | {len(whole)} / {len(ranged)} |"
            )


def plan_time(work: Path, rounds: int) -> None:
    kwargs = tiny_checkpoint.preset("qwen3.5-397b-a17b-fp8-headers")
    model = tiny_checkpoint.build_checkpoint(work / "big", **kwargs)
    shards = sum(1 for _ in model.glob("*.safetensors"))
    tensors = len(json.loads((model / "model.safetensors.index.json").read_text())["weight_map"])
    print(
        f"\n## plan --pp {PP} of a Qwen3.5-397B-A17B-FP8-shaped checkpoint "
        f"({tensors} tensors, {shards} shards)\n"
    )
    times: dict[str, list[float]] = {"local directory": [], "Hub, cold cache": [], "Hub, kept headers": []}
    requests = []
    with HubServer(hash_lfs=False) as hub:  # 400 GB of holes: no sha256 of them
        hub.add_repo("Qwen/Big", model)
        for _ in range(rounds):
            home = Path(tempfile.mkdtemp(dir=work))
            times["local directory"].append(
                run(["plan", "--pp", str(PP), str(model)], hub=None, hf_home=home)[0]
            )
            hub.clear_log()
            times["Hub, cold cache"].append(
                run(["plan", "--pp", str(PP), "Qwen/Big"], hub=hub, hf_home=home)[0]
            )
            requests.append(len(hub.log))
            times["Hub, kept headers"].append(
                run(["plan", "--pp", str(PP), "Qwen/Big"], hub=hub, hf_home=home)[0]
            )
    base = statistics.median(times["local directory"])
    print("| source | median s | min-max s | / local |")
    print("|---|---:|---:|---:|")
    for name, values in times.items():
        med = statistics.median(values)
        print(f"| {name} | {med:.2f} | {min(values):.2f}-{max(values):.2f} | {med / base:.2f}x |")
    print(f"\ncold-cache plan: {statistics.median(requests):.0f} requests ({shards} shards)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=float, default=3e8, help="bytes of the per-rank checkpoint (default 3e8)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of the plan timing (default 3)")
    p.add_argument("--work", type=Path, default=None, help="scratch directory (default: a new temp dir)")
    args = p.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="hub-bench-"))
    print(f"# hub_fetch, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, scratch {work}")
    per_rank(work, args.size)
    plan_time(work, args.rounds)


if __name__ == "__main__":
    main()
