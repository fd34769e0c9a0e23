"""Per node: what a server's load of an unsplit checkpoint from the Hub fetches and costs, the
stock way against ``--load-format qwen35-stages`` (issue 33). One run, ratios in the same run.

A checkpoint with the Qwen3.5-35B-A3B structure scaled to ``--size`` is served by
``tests/support/hub_server.py`` (a real HTTP server on 127.0.0.1 with a CDN origin). Each node is a
fresh ``HF_HOME`` and a fresh process, for ``--pp`` pipeline ranks, one rank a node:

- stock: what vLLM's and SGLang's default loaders do on every node: download every
  ``*.safetensors`` of the repo (``huggingface_hub.snapshot_download``, the call vLLM's
  ``download_weights_from_hf`` makes), then read every tensor of it (the rank keeps its own);
- qwen35-stages, first start: ``serve.server_stage`` for the rank (its stage's byte ranges into
  the stage cache), then every tensor of the stage;
- qwen35-stages, second start: the same on the same node (the stage cache is complete).

Every tensor handed over is copied once (what ``load_weights`` does into the model's
parameters). Bytes are the body bytes of ``*.safetensors`` requests in the server's log; time is
the process's wall time (interpreter start and imports included, the same for all).

    python benchmarks/server_fetch.py                # 1 GB, pp=4
    python benchmarks/server_fetch.py --size 3e8 --pp 2
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "examples")]

import tiny_checkpoint  # noqa: E402

from support.hub_server import HubServer  # noqa: E402

REPO = "Qwen/Scaled"
RUNTIME = "vllm"

STOCK = """
import sys
from pathlib import Path
from huggingface_hub import snapshot_download
from safetensors import safe_open
path = Path(snapshot_download(sys.argv[1], allow_patterns=["*.safetensors"]))
n = 0
for f in sorted(path.glob("*.safetensors")):
    with safe_open(f, "pt") as st:
        for name in st.keys():
            n += st.get_tensor(name).clone().numel()
print(n)
"""

STAGES = """
import sys
from qwen35_reshard.servers.unsplit import server_stage
from qwen35_reshard.model.parallelism import Parallelism
sizes = tuple(int(x) for x in sys.argv[3].split(","))
served = server_stage(sys.argv[1], Parallelism(pp=len(sizes), runtime=sys.argv[2], partition=sizes),
                      rank=int(sys.argv[4]))
print(sum(t.clone().numel() for _, t in served.stage.iter_weights()), served.how)
"""


def run(code: str, args: list[str], *, hub: HubServer, hf_home: Path, cache: Path) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(
        PYTHONPATH=str(ROOT), HF_HOME=str(hf_home), HF_ENDPOINT=hub.url, HF_HUB_DISABLE_XET="1",
        HF_HUB_DISABLE_TELEMETRY="1", QWEN35_RESHARD_STAGE_CACHE=str(cache),
    )
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"failed:\n{proc.stderr}")
    return time.perf_counter() - started


def fetched(hub: HubServer) -> int:
    return sum(e.sent for e in hub.log if e.file.endswith(".safetensors") and e.method == "GET")


def gb(n: float) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=float, default=1e9, help="bytes of the checkpoint (default 1e9)")
    p.add_argument("--pp", type=int, default=4, help="pipeline ranks, one a node (default 4)")
    p.add_argument("--work", type=Path, default=None, help="scratch directory (default: a new temp dir)")
    args = p.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="server-fetch-"))
    from qwen35_reshard import make_plan, read_checkpoint
    from qwen35_reshard.model.runtimes import default_partition

    kwargs = tiny_checkpoint.preset("qwen3.5-35b-a3b-scaled", target_bytes=int(args.size))
    model = tiny_checkpoint.build_checkpoint(work / "scaled", **kwargs)
    ckpt = read_checkpoint(model)
    partition = default_partition(ckpt.num_layers, args.pp, RUNTIME)
    plan = make_plan(ckpt, pp=args.pp, runtime=RUNTIME, partition=partition)
    whole = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    print(f"# server_fetch, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, scratch {work}")
    print(f"\n{gb(whole)} of *.safetensors ({len(ckpt.files)} shards), pp={args.pp}, {RUNTIME} partition "
          f"{','.join(map(str, partition))}; one node per rank, each a fresh HF_HOME\n")
    print("| node (rank) | stage data | stock: fetched | stock: s | qwen35-stages: fetched | s "
          "| fetched / stock | time / stock | second start: fetched | s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    totals = [0, 0.0, 0, 0.0]
    with HubServer() as hub:
        hub.add_repo(REPO, model)
        for rank in range(args.pp):
            node = Path(tempfile.mkdtemp(dir=work))
            hub.clear_log()
            stock_s = run(STOCK, [REPO], hub=hub, hf_home=node / "stock", cache=node / "unused")
            stock = fetched(hub)
            hub.clear_log()
            stage_args = [REPO, RUNTIME, ",".join(map(str, partition)), str(rank)]
            ours_s = run(STAGES, stage_args, hub=hub, hf_home=node / "hf", cache=node / "stages")
            ours = fetched(hub)
            hub.clear_log()
            again_s = run(STAGES, stage_args, hub=hub, hf_home=node / "hf", cache=node / "stages")
            again = fetched(hub)
            totals = [totals[0] + stock, totals[1] + stock_s, totals[2] + ours, totals[3] + ours_s]
            row = [gb(plan.stages[rank].data_bytes), gb(stock), f"{stock_s:.2f}", gb(ours), f"{ours_s:.2f}",
                   f"{ours / stock:.2f}", f"{ours_s / stock_s:.2f}", gb(again), f"{again_s:.2f}"]
            print(f"| {rank} | {' | '.join(row)} |")
    row = [gb(sum(s.data_bytes for s in plan.stages)), gb(totals[0]), f"{totals[1]:.2f}", gb(totals[2]),
           f"{totals[3]:.2f}", f"{totals[2] / totals[0]:.2f}", f"{totals[3] / totals[1]:.2f}", "", ""]
    print(f"| all nodes | {' | '.join(row)} |")


if __name__ == "__main__":
    main()
