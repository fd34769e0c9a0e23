"""Loading a stage through the shim, checked and unchecked, against ``safetensors.safe_open`` on
the same files (warm page cache by default).

Builds two checkpoints (``--shapes``) and splits each with every tree's own code (``--pp``,
default 2; vLLM's placement), then streams one stage (``--rank``):

- ``large``: the Qwen3.5-35B-A3B structure at ``--size`` bytes (default 1.12e9: a 0.56 GB stage
  of a few hundred large tensors, where bytes dominate);
- ``many``: per-expert FP8 weights with a scale each, 512 experts x 32 layers, small dimensions
  (~49,500 tensors in the stage, as many as a stage of the 397B FP8 checkpoint at pp=4: the
  per-tensor cost is all there is).

Per round, the trees' order rotating, one fresh interpreter per tree (the tree first on
``PYTHONPATH``) warms the stage's files (``--cache warm``; ``cold``: drops the page cache, root)
before each method and times, in rotated order, each tensor copied into a tensor allocated
before the timing (as ``load_weights`` copies into parameters):

- ``safe_open``: ``safe_open(file, framework="pt")`` per file, ``get_tensor`` per name: a
  stock loader on the stage's files, the baseline;
- ``shim checked``: ``loader.open_stage(OUT, pp_rank=R).iter_weights()`` with its defaults
  (every byte checked, what a server gets);
- ``shim unchecked``: the same with ``QWEN35_RESHARD_VERIFY_LOAD=0``;
- ``open_stage``: opening and checking the stage alone (manifest, index, config, headers).

Prints medians, GB/s, speed against ``safe_open`` (ratio of medians, and median of the rounds'
own ratios: steadier on a machine whose speed drifts), checked / unchecked, and each method's
CPU seconds: where the check costs more CPU than the copy, a node with fewer free cores per
loading worker (or a faster disk) pays it in time.

    python -m benchmarks loader                        # 0.56 GB stage and 49,5xx-tensor stage, warm
    python -m benchmarks loader --before main --rounds 7
    python -m benchmarks loader --shapes many --cache warm,cold
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from benchmarks.lib import checkpoints, procs
from benchmarks.lib.report import median, stamp, table
from benchmarks.lib.trees import Tree, check_imports, order

QUICK = ["--shapes", "tiny", "--rounds", "1"]
BEFORE = True
METHODS = ("safe_open", "shim checked", "shim unchecked", "open_stage")

# One round of every method in one tree: warms (or drops) the cache before each, times it.
_CHILD = r"""
import json, os, sys, time
import torch
from safetensors import safe_open
import qwen35_reshard
from qwen35_reshard import loader
out, rank, cache, order = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4].split(",")
stage = loader.open_stage(out, pp_rank=rank)
files = [os.path.join(stage.path, f) for f in stage.files]
DT = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F8_E4M3": torch.float8_e4m3fn,
      "I32": torch.int32, "I64": torch.int64, "U8": torch.uint8, "I8": torch.int8, "BOOL": torch.bool,
      "F64": torch.float64, "I16": torch.int16, "F8_E5M2": torch.float8_e5m2}
dst = {n: torch.empty(tuple(t.shape), dtype=DT[t.dtype]) for n, t in stage.tensors.items()}
for t in dst.values():
    t.view(torch.uint8).zero_() if t.element_size() == 1 else t.zero_()  # faulted in, as parameters are
def safe():
    n = 0
    for f in files:
        with safe_open(f, framework="pt") as h:
            for name in h.keys():
                dst[name].copy_(h.get_tensor(name)); n += 1
    return n
def shim(checked):
    if checked:
        os.environ.pop("QWEN35_RESHARD_VERIFY_LOAD", None)
    else:
        os.environ["QWEN35_RESHARD_VERIFY_LOAD"] = "0"
    n = 0
    for name, tensor in loader.open_stage(out, pp_rank=rank).iter_weights():
        dst[name].copy_(tensor); n += 1
    return n
methods = {"safe_open": safe, "shim checked": lambda: shim(True), "shim unchecked": lambda: shim(False),
           "open_stage": lambda: len(loader.open_stage(out, pp_rank=rank))}
def prepare():
    if cache == "cold":
        os.sync()
        open("/proc/sys/vm/drop_caches", "w").write("3\n")
        return
    buf = bytearray(16 << 20)
    for f in files:
        with open(f, "rb", buffering=0) as h:
            while h.readinto(buf):
                pass
got = {}
for name in order:
    prepare()
    t0, c0 = time.perf_counter(), time.process_time()
    n = methods[name]()
    got[name] = [time.perf_counter() - t0, time.process_time() - c0]
    assert n == len(stage.tensors), (name, n, len(stage.tensors))
print(json.dumps({"file": qwen35_reshard.__file__, "times": got, "tensors": len(stage.tensors),
                  "bytes": stage.nbytes, "files": len(files)}))
"""


def build(shape: str, work: Path, size: float) -> Path:
    if shape == "large":
        return checkpoints.scaled(work / "model-large", size)
    if shape == "many":
        return checkpoints.many_tensors(work / "model-many")
    return checkpoints.build(work / "model-tiny", **checkpoints.tiny.preset("tiny"))


def measure(shape: str, work: Path, args: argparse.Namespace, trees: list[Tree], caches: list[str]) -> None:
    model = build(shape, work, args.size)
    outs = {}
    for t in trees:  # each tree loads a split its own code wrote
        outs[t.label] = work / f"out-{shape}-{t.label}"
        shutil.rmtree(outs[t.label], ignore_errors=True)
        argv = [procs.PY, "-m", "qwen35_reshard", "--pp", str(args.pp), "--runtime", "vllm", "-q"]
        subprocess.run(
            [*argv, str(model), str(outs[t.label])],
            check=True,
            env=t.env(),
            cwd="/",
            stdout=subprocess.DEVNULL,
        )
    times: dict[tuple[str, str, str], list[float]] = {}
    cpu: dict[tuple[str, str, str], list[float]] = {}
    info: dict = {}
    for r in range(args.rounds):
        for cache in caches:
            for t in order(trees, r):
                k = r % len(METHODS)
                rotated = ",".join(METHODS[k:] + METHODS[:k])  # no method always first
                argv = [procs.PY, "-c", _CHILD, str(outs[t.label]), str(args.rank), cache, rotated]
                got = json.loads(procs.run(argv, env=t.env()).stdout)
                check_imports(t, got.pop("file"))
                info = got
                for name, (wall, cpu_s) in got["times"].items():
                    times.setdefault((cache, t.label, name), []).append(wall)
                    cpu.setdefault((cache, t.label, name), []).append(cpu_s)
    size = info["bytes"]
    print(
        f"\n### {shape}: stage {args.rank} of a pp={args.pp} split: {info['tensors']:,} tensors, "
        f"{size / 1e9:.3f} GB in {info['files']} files; medians of {args.rounds} rounds\n"
    )
    rows = []
    for cache in caches:
        for t in trees:
            base = times[(cache, t.label, "safe_open")]
            for name in METHODS:
                ts = times[(cache, t.label, name)]
                paired = median([b / x for b, x in zip(base, ts, strict=True)])
                speed = "-" if name == "open_stage" else f"{size / median(ts) / 1e9:.2f}"
                rows.append(
                    [cache, t.label, name, f"{median(ts):.3f}", speed,
                     f"{median(base) / median(ts):.2f}x", f"{paired:.2f}x",
                     f"{median(cpu[(cache, t.label, name)]):.2f}"]
                )  # fmt: skip
    print(table(["cache", "tree", "method", "median s", "GB/s", "speed vs safe_open", "same, per round",
                 "CPU s"], rows))  # fmt: skip
    print()
    for cache in caches:
        for t in trees:
            on, off = times[(cache, t.label, "shim checked")], times[(cache, t.label, "shim unchecked")]
            per_round = median([a / b for a, b in zip(on, off, strict=True)])
            extra = median(cpu[(cache, t.label, "shim checked")]) - median(
                cpu[(cache, t.label, "shim unchecked")]
            )
            print(
                f"- {cache}, {t.label}: checked / unchecked {median(on) / median(off):.2f}x "
                f"(per round {per_round:.2f}x); the check's CPU: {extra:+.2f} s, "
                f"{extra / size * 1e9:+.2f} s per GB"
            )
        if len(trees) > 1:
            for name in METHODS:
                a, b = (median(times[(cache, label, name)]) for label in ("after", "before"))
                print(f"- {cache}, {name}: after/before {a / b:.2f}x")


def main(argv: list[str], trees: list[Tree]) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks loader", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="large,many", help="large, many (see above) or tiny (a check)")
    ap.add_argument(
        "--size", type=float, default=1.12e9, help="the large checkpoint's bytes (default 1.12e9)"
    )
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--rank", type=int, default=0, help="the stage that is loaded")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cache", default="warm", help="warm, cold or both (cold needs root)")
    ap.add_argument("--workdir", type=Path, default=None, help="parent of the temporary work directory")
    args = ap.parse_args(argv)
    caches = args.cache.split(",")
    if "cold" in caches and os.geteuid() != 0:
        raise SystemExit("error: --cache cold drops the page cache, which needs root; use --cache warm")
    work = Path(tempfile.mkdtemp(prefix="bench-loader-", dir=args.workdir))
    try:
        print(
            f"## Loader, {stamp()}, {platform.node()} ({os.cpu_count()} cores), load average "
            f"{os.getloadavg()[0]:.1f}; each round one fresh interpreter per tree, methods interleaved"
        )
        for shape in args.shapes.split(","):
            measure(shape, work, args, trees, caches)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0
