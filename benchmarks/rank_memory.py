"""A server rank's memory and time to plan and open its stage of an unsplit checkpoint, at the
largest shapes, two source trees interleaved in one run (a change's before/after).

    git worktree add --detach /tmp/base main
    flock /tmp/heavy.lock python benchmarks/rank_memory.py /tmp/base . --rounds 3

Builds two headers-only (sparse) checkpoints once, under ``--workdir``: the Qwen3.5-397B-A17B-FP8
shape (189,042 tensors, 82 shards) and the Qwen3.8-2.4T-A95B shape (288,034 tensors, 216 shards)
(``examples/tiny_checkpoint.py`` presets). Then per round, per shape, per rank (``--ranks`` of a
``--pp`` split, ``--runtime``'s partition), for each tree (alternating which goes first), in a
fresh interpreter with the tree first on ``PYTHONPATH``:

- ``in place``: what a rank's ``qwen35-stages`` loader does for a local unsplit checkpoint before
  any weight is read: ``server_stage(MODEL, ...)`` (read every header, plan the rank's stage,
  read its shards' headers again, build the stage the loader streams). Measured: its wall time,
  the process's peak RSS (``ru_maxrss``: the interpreter and imports included, as a node pays
  it), and its RSS once ``server_stage`` returned with the stage held, i.e. what the rank holds
  while the weights load.
- ``open cached``: ``open_stage`` of the same rank's stage already in a stage cache (what a
  rank does on every later start), on a stage split from a checkpoint of the same tensor
  names and dtypes with tiny dimensions (the per-tensor cost is all there is), built once.
- ``split plan``: ``make_plan(read_checkpoint(MODEL), ..., ranks=[rank])`` with the collector
  paused (as ``reshard`` runs them), what a rank that builds its stage (from the Hub, or
  ``QWEN35_RESHARD_STAGE_COPY``) plans before it fetches: every stage laid out, as the split's
  run manifest records them all.

Each child also prints a digest of what it made (in place and cached: every tensor's name,
file, dtype, shape, size and offset, and the headers the loader checks files against; the
plan: every file's name, layout, tensors, offsets and header bytes): the run stops if the two
trees disagree. Prints medians and after/before ratios.
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

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples"))
import tiny_checkpoint as tiny  # noqa: E402

PY = sys.executable
SHAPES = {  # name: (preset, layers, shards)
    "397B": ("qwen3.5-397b-a17b-fp8-headers", 60, 82),
    "2.4T": ("qwen3.8-2.4t-a95b-fp8-headers", 92, 216),
}

# Run in each tree. Reads the module paths of either layout (serve.py before issue 37).
CHILD = r"""
import hashlib, json, resource, sys, time
def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS:")) / 1024
what, model, runtime, pp, rank, cache = sys.argv[1:7]
pp, rank = int(pp), int(rank)
import qwen35_reshard
from qwen35_reshard.loader import open_stage
from qwen35_reshard.model.runtimes import default_partition
try:
    from qwen35_reshard.servers.unsplit import server_stage
except ImportError:
    from qwen35_reshard.serve import server_stage
partition = default_partition(int(sys.argv[7]), pp, runtime)
base = rss()
start = time.perf_counter()
h = hashlib.sha256()
if what == "split plan":
    import gc
    from qwen35_reshard import make_plan, read_checkpoint
    gc.disable()  # as reshard() reads and plans (bulk.collector_paused)
    plan = make_plan(read_checkpoint(model), pp=pp, runtime=runtime, partition=partition, ranks=[rank])
    seconds = time.perf_counter() - start
    for s in plan.stages:
        for f in s.files:
            placed = [(t.name, t.out_offset) for t in f.tensors]
            h.update(repr((f.name, f.layout, placed)).encode() + f.header)
    tensors = len(plan.stages[rank].tensors)
else:
    if what == "in place":
        try:  # the layout object (issue 44), else the settings one by one
            from qwen35_reshard.model.parallelism import Parallelism
            given = ((Parallelism(pp=pp, runtime=runtime, partition=tuple(partition)),), {})
        except ImportError:
            given = ((), {"runtime": runtime, "partition": partition})
        stage = server_stage(model, *given[0], rank=rank, cache=cache, **given[1]).stage
    else:
        stage = open_stage(model, pp_rank=rank)
    seconds = time.perf_counter() - start
    for t in stage.tensors.values():
        h.update(repr((t.name, t.file, t.dtype, tuple(t.shape), t.nbytes, t.offset)).encode())
    for f in sorted(stage.headers):
        h.update(f.encode() + bytes(stage.headers[f]))
    tensors = len(stage.tensors)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
held = rss()
print(json.dumps({"file": qwen35_reshard.__file__, "seconds": seconds, "base": base, "peak": peak,
                  "held": held, "tensors": tensors, "digest": h.hexdigest()}))
"""
KEYS = ("peak", "seconds", "held")
UNITS = {"peak": "MB", "seconds": "s", "held": "MB"}


def build(workdir: Path, runtime: str, pp: int, ranks: list[int]) -> dict[str, Path]:
    """Each shape's headers-only checkpoint, and a split of its tiny-dimension twin (for
    ``open cached``), built once under ``workdir``."""
    out: dict[str, Path] = {}
    for shape, (preset, _, shards) in SHAPES.items():
        model = workdir / f"{shape}-headers"
        if not model.exists():
            tiny.build_checkpoint(model, **tiny.preset(preset))
        twin = workdir / f"{shape}-tiny"
        split = workdir / f"{shape}-split-{runtime}-pp{pp}"
        if not split.exists():
            kwargs = {**tiny.preset(preset), "hidden": 64, "moe_intermediate": 32, "vocab": 256}
            kwargs["vision_dims"] = tiny.TINY_VISION
            size = sum(map(tiny.nbytes, tiny.describe_model(**_model_args(kwargs))[1]))
            kwargs["shard_bytes"] = -(-size // shards)  # as many shards as the real one
            if not twin.exists():
                tiny.build_checkpoint(twin, **kwargs)
            argv = [PY, "-m", "qwen35_reshard", "--pp", str(pp), "--runtime", runtime, str(twin), str(split)]
            for rank in ranks:
                subprocess.run([*argv, "--rank", str(rank)], check=True, stdout=subprocess.DEVNULL,
                               env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=tempfile.gettempdir())
        out[shape], out[f"{shape} split"] = model, split
    return out


def _model_args(kwargs: dict) -> dict:
    """``build_checkpoint`` arguments without those ``describe_model`` does not take."""
    return {k: v for k, v in kwargs.items() if k not in ("sparse", "shard_bytes")}


def child(tree: Path, args: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    # Not run from a checkout: "-c" puts the working directory before PYTHONPATH.
    done = subprocess.run([PY, "-c", CHILD, *args], env=env, cwd=tempfile.gettempdir(),
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{tree}: {done.stderr.strip()}")
    got = json.loads(done.stdout)
    if not got.pop("file").startswith(str(tree)):
        raise SystemExit(f"{tree} is not the tree Python imported; is it a checkout?")
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pp", type=int, default=8)
    ap.add_argument("--ranks", default="0,7", help="comma-separated ranks to measure")
    ap.add_argument("--runtime", default="vllm")
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "rank-memory")
    args = ap.parse_args()
    ranks = [int(r) for r in args.ranks.split(",")]
    args.workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    built = build(args.workdir, args.runtime, args.pp, ranks)
    print(f"checkpoints ready in {time.perf_counter() - t0:.0f} s under {args.workdir}")
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    whats = ("in place", "open cached", "split plan")
    cases = [(what, shape, rank) for shape in SHAPES for what in whats for rank in ranks]
    res: dict[tuple, dict[str, dict[str, list[float]]]] = {
        c: {k: {key: [] for key in (*KEYS, "base")} for k in trees} for c in cases
    }
    tensors: dict[tuple, int] = {}
    with tempfile.TemporaryDirectory() as cache:  # server_stage's stage cache: unused in place
        for r in range(args.rounds):
            for case in cases:
                what, shape, rank = case
                model = built[f"{shape} split"] if what == "open cached" else built[shape]
                layers = str(SHAPES[shape][1])
                argv = [what, str(model), args.runtime, str(args.pp), str(rank), cache, layers]
                digests = set()
                for k in list(trees) if r % 2 == 0 else list(trees)[::-1]:
                    got = child(trees[k], argv)
                    digests.add(got.pop("digest"))
                    tensors[case] = got.pop("tensors")
                    for key, value in got.items():
                        res[case][k][key].append(value)
                if len(digests) != 1:
                    raise SystemExit(f"{case}: the two trees opened different stages")
    print(f"\n{args.runtime}, pp={args.pp}, medians of {args.rounds} rounds; same stages opened")
    print("| shape | what | rank (tensors) | peak RSS before | after | after/before | time before | after "
          "| after/before | RSS held before | after | after/before |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for case in cases:
        what, shape, rank = case
        cells = [shape, what, f"{rank} ({tensors[case]:,})"]
        for key in KEYS:
            b, a = (statistics.median(res[case][k][key]) for k in trees)
            fmt = "{:.2f} s" if key == "seconds" else "{:.0f} MB"
            cells += [fmt.format(b), fmt.format(a), f"**{a / b:.2f}**"]
        print("| " + " | ".join(cells) + " |")
    base = statistics.median(v for c in cases for k in trees for v in res[c][k]["base"])
    print(f"\nRSS of a child after its imports, before it plans (in every peak above): {base:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
