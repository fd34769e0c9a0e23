"""Bytes per node under expert parallelism at the real shapes (Qwen3.5-397B-A17B-FP8 and
Qwen3.8-2.4T-A95B, header-only), against the whole checkpoint every node holds today.

Builds the header-only checkpoints (``examples/tiny_checkpoint.py``'s presets: real names,
shapes and dtypes, holes for data) and, for every ``--ep`` over every ``--nodes`` (an EP group's
nodes; with ``--pp`` P > 1, one EP group per pipeline stage, P x nodes nodes in all), plans the
split with the library (``make_plan(read_checkpoint(MODEL), Parallelism(...))``: a dry run, no
byte written) and reads each node directory's tensor bytes. Prints, per layout: the largest and
the smallest node, the largest node against the whole checkpoint's tensor bytes (what every node
downloads and reads today: the stock loaders, and vLLM's EP filter, which skips reading but not
the download)
and against the largest pipeline stage alone (what a node held with ``--pp`` before EP), and the
plan's time. Layouts the servers would refuse are listed as refused, with the tool's message.

    python -m benchmarks expert_nodes       # both shapes, EP 16/32/64 over 2/4/8 nodes, pp 1 and 2
    python -m benchmarks expert_nodes --shapes 397B --pp 1,4 --before main
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from benchmarks.lib import checkpoints, procs
from benchmarks.lib.report import table
from benchmarks.lib.trees import Tree, check_imports

QUICK = ["--shapes", "tiny", "--ep", "2,4", "--nodes", "1,2", "--pp", "1,2"]
BEFORE = True

# In each tree: every layout's plan, each directory's data bytes (one process per shape: the
# checkpoint is read once).
_CHILD = r"""
import json, sys, time
import qwen35_reshard
from qwen35_reshard import make_plan, read_checkpoint
from qwen35_reshard.errors import ReshardError
try:
    from qwen35_reshard.model.parallelism import Parallelism
except ImportError:  # a tree from before the layout object: stages only
    Parallelism = None
model, runtime, layouts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
ckpt = read_checkpoint(model)
out = {"file": qwen35_reshard.__file__, "whole": sum(t.nbytes for t in ckpt.tensors.values()),
       "files": sum(ckpt.file_sizes.values()), "layouts": []}
for pp, ep, nodes in layouts:
    t0 = time.perf_counter()
    try:
        if Parallelism is None and (ep, nodes) != (1, 1):
            raise ReshardError("this tree has no expert parallelism")
        layout = Parallelism(pp=pp, runtime=runtime, ep=ep, nodes=nodes) if Parallelism else None
        plan = make_plan(ckpt, layout) if layout else make_plan(ckpt, pp=pp, runtime=runtime)
    except ReshardError as e:
        out["layouts"].append({"layout": [pp, ep, nodes], "refused": str(e)})
        continue
    dirs = [s.data_bytes for s in plan.stages]
    out["layouts"].append({"layout": [pp, ep, nodes], "dirs": dirs, "seconds": time.perf_counter() - t0})
print(json.dumps(out))
"""


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main(argv: list[str], trees: list[Tree]) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks expert_nodes", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--shapes", default="397B,2.4T", help="397B, 2.4T and/or tiny (a check that it runs)")
    ap.add_argument("--ep", default="16,32,64", help="expert-parallel sizes (default 16,32,64)")
    ap.add_argument("--nodes", default="2,4,8", help="nodes of an EP group (default 2,4,8)")
    ap.add_argument("--pp", default="1,2", help="pipeline sizes (default 1,2; 1: no PP)")
    ap.add_argument("--runtime", default="vllm", choices=("vllm", "sglang"))
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "bench-experts")
    args = ap.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    grid = [(pp, ep, n) for pp in _ints(args.pp) for ep in _ints(args.ep) for n in _ints(args.nodes)]
    # Without EP, the layout's own pipeline stages: what a node holds with --pp alone.
    stages_only = sorted({(pp, 1, 1) for pp, _, _ in grid})
    for shape in args.shapes.split(","):
        if shape == "tiny":
            model = checkpoints.build(args.workdir / "tiny", **checkpoints.tiny.preset("tiny"))
        else:
            model = checkpoints.headers(args.workdir / f"{shape}-headers", shape)
        for tree in trees:
            layouts = json.dumps(stages_only + grid)
            got = json.loads(
                procs.run([procs.PY, "-c", _CHILD, str(model), args.runtime, layouts], env=tree.env()).stdout
            )
            check_imports(tree, got.pop("file"))
            report(shape, tree, got, args.runtime)
    return 0


def report(shape: str, tree: Tree, got: dict, runtime: str) -> None:
    whole = got["whole"]
    done = {tuple(x["layout"]): x for x in got["layouts"]}
    gb = lambda n: f"{n / 1e9:,.1f} GB" if n >= 1e8 else f"{n / 1e6:,.2f} MB"  # noqa: E731
    rows = []
    for (pp, ep, nodes), x in done.items():
        if ep == 1:
            continue
        if "refused" in x:
            rows.append([tree.label, pp, ep, nodes, pp * nodes, "refused", "", "", "", x["refused"][:80]])
            continue
        stage = max(done[(pp, 1, 1)]["dirs"])
        big, small = max(x["dirs"]), min(x["dirs"])
        rows.append(
            [
                tree.label,
                pp,
                ep,
                nodes,
                pp * nodes,
                gb(big),
                gb(small),
                f"{big / whole:.1%}",
                f"{big / stage:.1%}",
                f"{x['seconds']:.1f} s",
            ]
        )
    print(
        f"\n### {shape} ({gb(whole)} of tensors in {gb(got['files'])} of files), {runtime} placement: "
        "bytes per node against the whole checkpoint per node today\n"
    )
    print(
        table(
            [
                "tree",
                "pp",
                "EP",
                "nodes per stage",
                "nodes",
                "largest node",
                "smallest node",
                "largest / whole",
                "largest / its PP stage",
                "plan",
            ],
            rows,
        )
    )
