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

With ``--before REF`` the qwen35-stages rows run with each tree's code, side by side.

    python -m benchmarks server_fetch                # 1 GB, pp=4
    python -m benchmarks server_fetch --size 3e8 --pp 2 --before main
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from benchmarks.lib import checkpoints, procs
from benchmarks.lib.links import HubServer, hub_env
from benchmarks.lib.report import gb
from benchmarks.lib.trees import Tree

QUICK = ["--size", "2e7", "--pp", "2"]
BEFORE = True
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


def run(code: str, args: list[str], *, tree: Tree, hub: HubServer, node: Path) -> float:
    """Wall seconds of ``code`` with ``tree``'s package, on a node whose caches are under ``node``."""
    return procs.run([procs.PY, "-c", code, *args], env=hub_env(tree.env(), hub, node)).wall


def fetched(hub: HubServer) -> int:
    return sum(e.sent for e in hub.log if e.file.endswith(".safetensors") and e.method == "GET")


def main(argv: list[str], trees: list[Tree]) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks server_fetch", description=__doc__.splitlines()[0])
    p.add_argument("--size", type=float, default=1e9, help="bytes of the checkpoint (default 1e9)")
    p.add_argument("--pp", type=int, default=4, help="pipeline ranks, one a node (default 4)")
    p.add_argument("--work", type=Path, default=None, help="scratch directory (default: a new temp dir)")
    args = p.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="server-fetch-"))
    from qwen35_reshard import make_plan, read_checkpoint
    from qwen35_reshard.model.runtimes import default_partition

    model = checkpoints.scaled(work / "scaled", args.size)
    ckpt = read_checkpoint(model)
    partition = default_partition(ckpt.num_layers, args.pp, RUNTIME)
    plan = make_plan(ckpt, pp=args.pp, runtime=RUNTIME, partition=partition)
    whole = checkpoints.size(model)
    print(f"# server_fetch, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, scratch {work}")
    print(
        f"\n{gb(whole)} of *.safetensors ({len(ckpt.files)} shards), pp={args.pp}, {RUNTIME} partition "
        f"{','.join(map(str, partition))}; one node per rank, each a fresh HF_HOME\n"
    )
    print(
        "| node (rank) | tree | stage data | stock: fetched | stock: s | qwen35-stages: fetched | s "
        "| fetched / stock | time / stock | second start: fetched | s |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    totals = {t.label: [0, 0.0, 0, 0.0] for t in trees}
    with HubServer() as hub:
        hub.add_repo(REPO, model)
        for rank in range(args.pp):
            base = Path(tempfile.mkdtemp(dir=work))
            hub.clear_log()
            stock_s = run(STOCK, [REPO], tree=trees[0], hub=hub, node=base / "stock")
            stock = fetched(hub)
            for tree in trees:
                node = base / tree.label
                hub.clear_log()
                stage_args = [REPO, RUNTIME, ",".join(map(str, partition)), str(rank)]
                ours_s = run(STAGES, stage_args, tree=tree, hub=hub, node=node)
                ours = fetched(hub)
                hub.clear_log()
                again_s = run(STAGES, stage_args, tree=tree, hub=hub, node=node)
                again = fetched(hub)
                t = totals[tree.label]
                totals[tree.label] = [t[0] + stock, t[1] + stock_s, t[2] + ours, t[3] + ours_s]
                row = [
                    tree.label,
                    gb(plan.stages[rank].data_bytes),
                    gb(stock),
                    f"{stock_s:.2f}",
                    gb(ours),
                    f"{ours_s:.2f}",
                    f"{ours / stock:.2f}",
                    f"{ours_s / stock_s:.2f}",
                    gb(again),
                    f"{again_s:.2f}",
                ]
                print(f"| {rank} | {' | '.join(row)} |", flush=True)
    for label, t in totals.items():
        row = [
            label,
            gb(sum(s.data_bytes for s in plan.stages)),
            gb(t[0]),
            f"{t[1]:.2f}",
            gb(t[2]),
            f"{t[3]:.2f}",
            f"{t[2] / t[0]:.2f}",
            f"{t[3] / t[1]:.2f}",
            "",
            "",
        ]
        print(f"| all nodes | {' | '.join(row)} |")
    return 0
