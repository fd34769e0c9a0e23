"""Planning time (dry run, make_plan, manifests, schema check) of the 397B-FP8 shape, against
json-parsing its headers.

Builds the header-only Qwen3.5-397B-A17B-FP8 checkpoint (189,042 tensors in 82 shards, holes for
data; ``--shape tiny``: the 8-layer tiny model) and, with ``--gptq``, the same model as GPTQ
4-bit, group 128 (``examples/quantized_checkpoint.py``: 377,198 tensors). Then per round, the
trees' order rotating, each in a fresh interpreter with the tree first on ``PYTHONPATH``:

- ``dry run``: ``python -m qwen35_reshard --pp 4 --dry-run --json MODEL OUT`` (wall, CPU, the
  process's own peak RSS);
- in one process: ``make_plan``, every stage manifest encoded, and the model's schema check
  alone (every required tensor derived from config.json and compared), wall and CPU;
- the baseline, ``start-up + JSON``: a fresh interpreter that imports the CLI and json-parses the
  index and every shard header: what any dry run does before it checks or plans anything.

Prints medians, dry run / baseline, GPTQ / FP8 and after / before; stops if the trees print
different dry runs or manifest bytes.

    python -m benchmarks plan --rounds 7
    python -m benchmarks plan --before main --gptq
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from benchmarks.lib import checkpoints, procs
from benchmarks.lib.report import median, ratio, table
from benchmarks.lib.trees import ROOT, Tree, check_imports, order

QUICK = ["--shape", "tiny", "--rounds", "1"]
BEFORE = True

_FLOOR = r"""
import json, struct, sys
from pathlib import Path
import qwen35_reshard.cli.app, qwen35_reshard.cli.report
json.loads((Path(sys.argv[1]) / 'model.safetensors.index.json').read_bytes())
for p in sorted(Path(sys.argv[1]).glob("*.safetensors")):
    with open(p, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        json.loads(f.read(n))
"""

# Run in each tree; reads the module paths of older layouts too.
_IN_PROCESS = r"""
import gc, inspect, json, sys, time
import qwen35_reshard
from qwen35_reshard import make_plan, read_checkpoint
try:
    from qwen35_reshard.format.jsonio import dumps
    from qwen35_reshard.write.manifest import stage_index, stage_manifest
except ImportError:
    from qwen35_reshard.ondisk import dumps, stage_index, stage_manifest
from qwen35_reshard.model import schema
extra = ({},) if "side_files" in inspect.signature(stage_manifest).parameters else ()
gc.disable()  # as the CLI reads and plans
ckpt = read_checkpoint(sys.argv[1])
clock = lambda: (time.perf_counter(), time.process_time())
(t1, c1) = clock()
plan = make_plan(ckpt, pp=4)
(t2, c2) = clock()
size = 0
for stage in plan.stages:
    draft = stage_manifest(plan, stage, dumps(stage_index(stage)), *extra)
    size += len(draft.encode({t.name: None for t in stage.tensors}))
(t3, c3) = clock()
required = schema.required_tensors(ckpt.config, ckpt.tensors)
schema.check_complete(required, ckpt.tensors, sys.argv[1])
(t4, c4) = clock()
print(json.dumps({"file": qwen35_reshard.__file__, "tensors": len(ckpt.tensors), "bytes": size,
                  "make_plan": t2 - t1, "make_plan cpu": c2 - c1, "manifests": t3 - t2,
                  "manifests cpu": c3 - c2, "schema check": t4 - t3}))
"""
KEYS = ("dry run", "dry run cpu", "make_plan", "make_plan cpu", "manifests", "manifests cpu", "schema check")


def build(work: Path, shape: str, gptq: bool) -> dict[str, Path]:
    sys.path.insert(0, str(ROOT / "examples"))
    import quantized_checkpoint as qc

    if shape == "tiny":
        kwargs = checkpoints.tiny.preset("tiny")
        models = {"fp8": checkpoints.build(work / "tiny", **kwargs)}
    else:
        kwargs = checkpoints.tiny.preset(checkpoints.HEADER_SHAPES["397B"][0])
        models = {"fp8": checkpoints.headers(work / "q397b-fp8-headers", "397B")}
    if gptq:
        gptq_dir = work / f"{shape}-gptq-int4"
        if not gptq_dir.exists():
            kwargs.pop("layout")
            qc.build_quantized(gptq_dir, "gptq", bits=4, group=128 if shape != "tiny" else 32, **kwargs)
        models["gptq"] = gptq_dir
    return models


def main(argv: list[str], trees: list[Tree]) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--shape", choices=("397b", "tiny"), default="397b")
    ap.add_argument("--gptq", action="store_true", help="also the GPTQ-Int4 twin (its plan / FP8's)")
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "bench-plan")
    args = ap.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    models = build(args.workdir, args.shape, args.gptq)
    out_dir = args.workdir / "never-written"  # a dry run writes nothing
    res: dict[tuple[str, str], dict[str, list[float]]] = {}
    floor: list[float] = []
    outputs: dict[str, set[str]] = {}
    tensors: dict[str, int] = {}
    for r in range(args.rounds):
        floor.append(procs.run([procs.PY, "-c", _FLOOR, str(models["fp8"])], env=trees[0].env()).wall)
        for kind, model in models.items():
            for tree in order(trees, r):
                got = res.setdefault((kind, tree.label), {k: [] for k in (*KEYS, "peak")})
                dry = [
                    procs.PY,
                    "-m",
                    "qwen35_reshard",
                    "--pp",
                    "4",
                    "--dry-run",
                    "--json",
                    str(model),
                    str(out_dir),
                ]
                m = procs.run(dry, env=tree.env())
                got["dry run"].append(m.wall)
                got["dry run cpu"].append(m.cpu)
                got["peak"].append(m.peak_rss / 1e6)
                doc = json.loads(procs.run([procs.PY, "-c", _IN_PROCESS, str(model)], env=tree.env()).stdout)
                check_imports(tree, doc.pop("file"))
                tensors[kind] = doc.pop("tensors")
                outputs.setdefault(kind, set()).add(f"{_stable(m.stdout)}|{doc.pop('bytes')}")
                for key, value in doc.items():
                    got[key].append(value)
    if any(len(v) != 1 for v in outputs.values()):
        raise SystemExit("the trees planned differently: different dry runs or manifest bytes")
    base = median(floor)
    print(
        f"\n{', '.join(f'{k}: {tensors[k]:,} tensors' for k in models)}; medians of {args.rounds} rounds; "
        f"baseline (start-up + JSON of every header): {base:.3f} s"
    )
    head = ["model", "tree", *KEYS, "peak RSS", "dry run / baseline"]
    rows = []
    for (kind, label), got in res.items():
        med = {k: median(v) for k, v in got.items()}
        rows.append(
            [
                kind,
                label,
                *(f"{med[k]:.3f}" for k in KEYS),
                f"{med['peak']:.0f} MB",
                ratio(med["dry run"], base),
            ]
        )
    print(table(head, rows))
    for key in KEYS:
        cells = []
        if len(trees) > 1:
            for kind in models:
                a, b = (median(res[(kind, t)][key]) for t in ("after", "before"))
                cells.append(f"{kind} after/before {ratio(a, b)}")
        if "gptq" in models:
            cells.append(
                f"gptq/fp8 {ratio(median(res[('gptq', 'after')][key]), median(res[('fp8', 'after')][key]))}"
            )
        if cells:
            print(f"{key:14s} " + ", ".join(cells))
    return 0


def _stable(dry_json: str) -> str:
    """The dry run's JSON without what differs between two runs of one tree (times)."""
    doc = json.loads(dry_json)
    doc.pop("seconds", None)
    for key in ("result", "run"):
        if isinstance(doc.get(key), dict):
            doc[key].pop("seconds", None)
    return json.dumps(doc, sort_keys=True)
