"""Plan time of a 397B-shaped GPTQ-Int4 checkpoint against the 397B-FP8 one, and the FP8 dry
run before and after a change, in one run (issue 30).

    git archive main | tar -x -C /tmp/base     # or: git worktree add --detach /tmp/base main
    python benchmarks/plan_quantized.py /tmp/base . --rounds 5

Builds, headers only (sparse), the Qwen3.5-397B-A17B-FP8 shape of ``examples/tiny_checkpoint.py``
(189,042 tensors) and the same model as GPTQ 4-bit, group 128, every decoder Linear but the
routers, ``shared_expert_gate`` and ``in_proj_a/b`` quantized (``examples/quantized_checkpoint.py``:
``qweight``, ``qzeros``, ``scales``, ``g_idx`` each; 377,198 tensors). Then per round, the order
rotating: ``--pp 4 --dry-run --json`` in a fresh interpreter (wall and CPU) and ``make_plan`` in
one process (wall and CPU), for FP8 with the BEFORE tree, FP8 with the AFTER tree and GPTQ with
the AFTER tree (each tree first on ``PYTHONPATH``). Prints medians, GPTQ / FP8 (the issue's
bound: 2) and FP8 after / before (the bound: 1, within the machine's noise).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))

import plan_before_after as pba  # noqa: E402
import quantized_checkpoint as qc  # noqa: E402
import tiny_checkpoint as tc  # noqa: E402

PRESET = "qwen3.5-397b-a17b-fp8-headers"
KEYS = ("dry_wall", "dry_cpu", "plan", "plan_cpu")


def build(work: Path) -> dict[str, Path]:
    fp8, gptq = work / "q397b-fp8-headers", work / "q397b-gptq-int4-headers"
    kwargs = tc.preset(PRESET)
    if not fp8.exists():
        tc.build_checkpoint(fp8, **kwargs)
    if not gptq.exists():
        kwargs.pop("layout")
        qc.build_quantized(gptq, "gptq", bits=4, group=128, **kwargs)
    return {"fp8": fp8, "gptq": gptq}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()))
    args = ap.parse_args()
    models = build(args.workdir)
    before, after = args.before.resolve(), args.after.resolve()
    runs = {
        "fp8 before": (before, models["fp8"]),
        "fp8 after": (after, models["fp8"]),
        "gptq after": (after, models["gptq"]),
    }
    res = {k: {key: [] for key in KEYS} for k in runs}
    out_dir = Path(tempfile.gettempdir()) / "plan-quantized-out"  # never written: a dry run
    for r in range(args.rounds):
        order = list(runs)
        order = order[r % 3 :] + order[: r % 3]
        for k in order:
            tree, model = runs[k]
            dry = [
                pba.PY,
                "-m",
                "qwen35_reshard",
                "--pp",
                "4",
                "--dry-run",
                "--json",
                str(model),
                str(out_dir),
            ]
            wall, cpu, _ = pba.child(tree, dry)
            res[k]["dry_wall"].append(wall)
            res[k]["dry_cpu"].append(cpu)
            m = json.loads(pba.child(tree, [pba.PY, "-c", pba.IN_PROCESS, str(model)])[2])
            if not m["file"].startswith(str(tree)):
                raise SystemExit(f"{tree} is not the tree Python imported; is it a checkout?")
            res[k]["plan"].append(m["plan"])
            res[k]["plan_cpu"].append(m["plan_cpu"])
    med = {k: {key: statistics.median(v) for key, v in d.items()} for k, d in res.items()}
    count = {k: len(json.loads((p / tc.INDEX_NAME).read_text())["weight_map"]) for k, p in models.items()}
    print(f"tensors: fp8 {count['fp8']:,}, gptq {count['gptq']:,}; {args.rounds} rounds, medians")
    for key in KEYS:
        fb, fa, ga = med["fp8 before"][key], med["fp8 after"][key], med["gptq after"][key]
        print(
            f"{key:9s} fp8 before {fb:.3f} s, fp8 after {fa:.3f} s, gptq {ga:.3f} s: "
            f"gptq/fp8 **{ga / fa:.2f}**, fp8 after/before **{fa / fb:.3f}**"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
