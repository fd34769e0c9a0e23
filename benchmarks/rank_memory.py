"""A server rank's memory and time to plan and open its stage of an unsplit checkpoint, at the
largest shapes; with ``--before REF``, the two trees' children interleaved in one run.

    flock /tmp/heavy.lock python -m benchmarks rank_memory --before main --rounds 3

Builds two headers-only (sparse) checkpoints once, under ``--workdir``: the Qwen3.5-397B-A17B-FP8
shape (189,042 tensors, 82 shards) and the Qwen3.8-2.4T-A95B shape (288,034 tensors, 216 shards)
(``examples/tiny_checkpoint.py`` presets). Then per round, per shape, per rank (``--ranks`` of a
``--pp`` split, ``--runtime``'s partition), for each tree (alternating which goes first), in a
fresh interpreter with the tree first on ``PYTHONPATH``:

- ``in place``: what a rank's ``qwen35-stages`` loader does for a local unsplit checkpoint before
  any weight is read: ``server_stage(MODEL, ...)`` (read every header, plan the rank's stage,
  read its shards' headers again, build the stage the loader streams). Measured: its wall time,
  the process's own peak RSS (the interpreter and imports included, as a node pays it;
  measured through ``lib.procs``' launcher, so not the benchmark's own peak carried across
  exec), and its RSS once ``server_stage`` returned with the stage held, i.e. what the rank
  holds while the weights load.
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
trees disagree. Prints medians, each case against ``open cached`` of the same rank (the baseline:
what a rank pays on a later start) and after/before ratios.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path

from benchmarks.lib import checkpoints, procs
from benchmarks.lib.report import median, ratio, table
from benchmarks.lib.trees import Tree, check_imports, order

QUICK = ["--shapes", "tiny", "--rounds", "1", "--pp", "2", "--ranks", "0,1"]
BEFORE = True

# Run in each tree. Reads the module paths of either layout (serve.py before issue 37).
CHILD = r"""
import hashlib, json, sys, time
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
print(json.dumps({"file": qwen35_reshard.__file__, "seconds": seconds, "base": base, "held": rss(),
                  "tensors": tensors, "digest": h.hexdigest()}))
"""
KEYS = ("peak", "seconds", "held")
WHATS = ("in place", "open cached", "split plan")
LAYERS = {"397B": 60, "2.4T": 92, "tiny": 8}


def build(workdir: Path, shapes: list[str], runtime: str, pp: int, ranks: list[int]) -> dict[str, Path]:
    """Each shape's checkpoint (header-only at real shapes), and a split of its tiny-dimension
    twin (for ``open cached``), built once under ``workdir``."""
    out: dict[str, Path] = {}
    for shape in shapes:
        if shape == "tiny":
            model = twin = checkpoints.build(workdir / "tiny", **checkpoints.tiny.preset("tiny"))
        else:
            model = checkpoints.headers(workdir / f"{shape}-headers", shape)
            twin = checkpoints.tiny_twin(workdir / f"{shape}-tiny", shape)
        split = workdir / f"{shape}-split-{runtime}-pp{pp}"
        if not split.exists():
            argv = [
                procs.PY,
                "-m",
                "qwen35_reshard",
                "--pp",
                str(pp),
                "--runtime",
                runtime,
                str(twin),
                str(split),
            ]
            for rank in ranks:
                subprocess.run(
                    [*argv, "--rank", str(rank)],
                    check=True,
                    stdout=subprocess.DEVNULL,
                    env=Tree("after", checkpoints.ROOT).env(),
                    cwd=tempfile.gettempdir(),
                )
        out[shape], out[f"{shape} split"] = model, split
    return out


def main(argv: list[str], trees: list[Tree]) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks rank_memory", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shapes", default="397B,2.4T", help="397B, 2.4T and/or tiny (a check that it runs)")
    ap.add_argument("--pp", type=int, default=8)
    ap.add_argument("--ranks", default="0,7", help="comma-separated ranks to measure")
    ap.add_argument("--runtime", default="vllm")
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "rank-memory")
    args = ap.parse_args(argv)
    ranks = [int(r) for r in args.ranks.split(",")]
    shapes = args.shapes.split(",")
    args.workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    built = build(args.workdir, shapes, args.runtime, args.pp, ranks)
    print(f"checkpoints ready in {time.perf_counter() - t0:.0f} s under {args.workdir}", flush=True)
    cases = [(what, shape, rank) for shape in shapes for what in WHATS for rank in ranks]
    res = {c: {t.label: {k: [] for k in (*KEYS, "base", "floor")} for t in trees} for c in cases}
    tensors: dict[tuple, int] = {}
    with tempfile.TemporaryDirectory() as cache:  # server_stage's stage cache: unused in place
        for r in range(args.rounds):
            for case in cases:
                what, shape, rank = case
                model = built[f"{shape} split"] if what == "open cached" else built[shape]
                child = [what, str(model), args.runtime, str(args.pp), str(rank), cache, str(LAYERS[shape])]
                digests = set()
                for tree in order(trees, r):
                    m = procs.run([procs.PY, "-c", CHILD, *child], env=tree.env())
                    got = json.loads(m.stdout)
                    check_imports(tree, got.pop("file"))
                    digests.add(got.pop("digest"))
                    tensors[case] = got.pop("tensors")
                    got.update(peak=m.peak_rss / 2**20, floor=m.floor / 2**20)
                    for key, value in got.items():
                        res[case][tree.label][key].append(value)
                if len(digests) != 1:
                    raise SystemExit(f"{case}: the two trees opened different stages")
    print(
        f"\n{args.runtime}, pp={args.pp}, medians of {args.rounds} rounds; same stages opened in every tree"
    )
    head = [
        "shape",
        "what",
        "rank (tensors)",
        "tree",
        "peak RSS",
        "time",
        "RSS held",
        "peak / open cached",
        "time / open cached",
    ]
    rows = []
    for case in cases:
        what, shape, rank = case
        for t in trees:
            med = {k: median(v) for k, v in res[case][t.label].items()}
            cached = {k: median(v) for k, v in res[("open cached", shape, rank)][t.label].items()}
            rows.append(
                [
                    shape,
                    what,
                    f"{rank} ({tensors[case]:,})",
                    t.label,
                    f"{med['peak']:.0f} MiB",
                    f"{med['seconds']:.2f} s",
                    f"{med['held']:.0f} MiB",
                    ratio(med["peak"], cached["peak"]),
                    ratio(med["seconds"], cached["seconds"]),
                ]
            )
    print(table(head, rows))
    if len(trees) > 1:
        print("\nafter/before:")
        for case in cases:
            a, b = (res[case][label] for label in ("after", "before"))
            peak, took = (
                ratio(median(a["peak"]), median(b["peak"])),
                ratio(median(a["seconds"]), median(b["seconds"])),
            )
            print(f"- {case[1]} {case[0]} rank {case[2]}: peak RSS {peak}, time {took}")
    floor = max(v for c in cases for t in trees for v in res[c][t.label]["floor"])
    base = median([v for c in cases for t in trees for v in res[c][t.label]["base"]])
    print(
        f"\nRSS of a child after its imports, before it plans (in every peak above): {base:.0f} MiB; "
        f"the launcher a peak may inherit: {floor:.0f} MiB"
    )
    return 0
