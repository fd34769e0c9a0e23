"""Plan time of the 397B-FP8 shape, two source trees interleaved in one run (a change's before/after).

    git worktree add --detach /tmp/base main
    python benchmarks/plan_before_after.py /tmp/base . --rounds 7

Builds the headers-only Qwen3.5-397B-A17B-FP8-shaped checkpoint once (``--model``), then per
round, alternating which tree goes first: ``python -m qwen35_reshard --pp 4 --dry-run --json``
in a fresh interpreter (wall and CPU time), and in one process ``make_plan`` and every stage
manifest encoded (wall and CPU). Each tree is put first on ``PYTHONPATH``. Prints medians and
after/before ratios, and checks that both trees print the same dry run and manifest bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BUILDER = REPO / "examples" / "tiny_checkpoint.py"
PY = sys.executable

# Run in each tree; reads the module paths of either layout (before and after issue 21).
IN_PROCESS = r"""
import inspect, json, sys, time
import qwen35_reshard
from qwen35_reshard import make_plan, read_checkpoint
try:
    from qwen35_reshard.format.jsonio import dumps
    from qwen35_reshard.write.manifest import stage_index, stage_manifest
except ImportError:
    from qwen35_reshard.ondisk import dumps, stage_index, stage_manifest
# The non-weight files' digests became an argument with issue 23.
extra = ({},) if "side_files" in inspect.signature(stage_manifest).parameters else ()
ckpt = read_checkpoint(sys.argv[1])
t1, c1 = time.perf_counter(), time.process_time()
plan = make_plan(ckpt, pp=4)
t2, c2 = time.perf_counter(), time.process_time()
size = 0
for stage in plan.stages:
    draft = stage_manifest(plan, stage, dumps(stage_index(stage)), *extra)
    size += len(draft.encode({t.name: None for t in stage.tensors}))
t3, c3 = time.perf_counter(), time.process_time()
print(json.dumps({"file": qwen35_reshard.__file__, "plan": t2 - t1, "plan_cpu": c2 - c1,
                  "manifests": t3 - t2, "manifests_cpu": c3 - c2, "bytes": size}))
"""
KEYS = ("dry_wall", "dry_cpu", "plan", "plan_cpu", "manifests", "manifests_cpu")


def child(tree: Path, argv: list[str]) -> tuple[float, float, str]:
    """Wall and CPU seconds of ``argv`` with ``tree`` first on PYTHONPATH, and its stdout."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    # Not run from a checkout: "-c" and "-m" put the working directory before PYTHONPATH.
    cwd = tempfile.gettempdir()
    out = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, check=True).stdout
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--model", type=Path, default=Path(tempfile.gettempdir()) / "q397b-fp8-headers")
    args = ap.parse_args()
    if not args.model.exists():
        cmd = [PY, str(BUILDER), str(args.model), "--preset", "qwen3.5-397b-a17b-fp8-headers"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    res: dict[str, dict[str, list[float]]] = {k: {key: [] for key in KEYS} for k in trees}
    outputs: dict[str, set[str]] = {k: set() for k in trees}
    out_dir = Path(tempfile.gettempdir()) / "plan-before-after-out"  # never written: a dry run
    dry = [PY, "-m", "qwen35_reshard", "--pp", "4", "--dry-run", "--json", str(args.model), str(out_dir)]
    for r in range(args.rounds):
        for k in list(trees) if r % 2 == 0 else list(trees)[::-1]:
            wall, cpu, out = child(trees[k], dry)
            res[k]["dry_wall"].append(wall)
            res[k]["dry_cpu"].append(cpu)
            m = json.loads(child(trees[k], [PY, "-c", IN_PROCESS, str(args.model)])[2])
            if not m.pop("file").startswith(str(trees[k])):
                raise SystemExit(f"{trees[k]} is not the tree Python imported; is it a checkout?")
            outputs[k] |= {out, str(m.pop("bytes"))}
            for key, value in m.items():
                res[k][key].append(value)
    print(f"same dry run and manifest bytes: {outputs['before'] == outputs['after']}")
    for key in KEYS:
        b, a = (statistics.median(res[k][key]) for k in trees)
        print(f"{key:14s} median before {b:.3f} s, after {a:.3f} s: after/before **{a / b:.3f}**")
    return 0


if __name__ == "__main__":
    sys.exit(main())
