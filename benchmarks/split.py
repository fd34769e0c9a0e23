"""Benchmark qwen35-reshard against plain copies (cp, O_DIRECT) and the naive load/filter/save way.

Run by hand, not as a test. For each checkpoint size it builds a synthetic checkpoint with
the Qwen3.5-35B-A3B structure (examples/tiny_checkpoint.py, preset qwen3.5-35b-a3b-scaled:
40 layers of both kinds, 256 fused experts, MTP, vision tower, real names) and then measures,
on the same files and in interleaved order, for ``--rounds`` rounds:

- ``reshard``: ``qwen35-reshard --pp P --workers W MODEL OUT`` (one row per ``--workers`` value);
- ``cp``: ``cp`` of the source shards the stages need (all of them for pp >= 2), then
  ``sync`` of the copies, so that it too ends with its data on disk as the other two do;
- ``O_DIRECT copy``: benchmarks/direct_copy.py, the same shards copied with O_DIRECT reads
  and writes, two at a time: a copy of the bytes with no page cache and no hashing;
- ``naive, WAY``: benchmarks/naive_split.py --way WAY (``load_file`` shards, keep the stage's
  tensors, ``save_file`` per stage, fsync), one row per ``--naive`` way: ``every-shard`` (each
  stage loads every shard), ``index`` (each stage loads the shards the index lists for it) and
  ``all-in-memory`` (each shard loaded once, the whole model held until it is saved);
- with ``--ablation``, also reshard with the page cache kept (``pages.DROP_BEHIND = False``);
- with ``--before REF``, every reshard row again with REF's code.

Each run is its own process, measured through ``lib.procs``' launcher (wall time, CPU and the
peak RSS of that process and its descendants, not this one's). With
``--cache cold`` (root only) the page cache is written back and dropped before each run; with
``warm`` the source is read into the page cache before each run. Medians are reported, with
the ratios against ``cp + sync`` and the naive ways from the same rounds. Then:

- bytes read from storage by ``loader.open_stage(OUT, pp_rank=r).iter_weights()`` per stage,
  each tensor copied as ``load_weights`` does (read_bytes from /proc/self/io of a child process,
  page cache dropped first, so root only: the shim reads through a memory map, which rchar
  does not count) against the whole checkpoint.

Disk: a source and one output exist at a time (about twice the size); everything is under
``--workdir`` and deleted at the end (``--keep`` keeps the checkpoints).

    python -m benchmarks split                       # 2 GB and 6 GB, 5 rounds
    python -m benchmarks split --sizes 1e9 --rounds 1 --cache warm   # quick look
    python -m benchmarks split --before main --naive index --workers 2

The dry run's time is the ``plan`` benchmark's; block sharing on XFS and Btrfs ``sharing``'s.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.lib import checkpoints, pages, procs
from benchmarks.lib.report import gb, median
from benchmarks.lib.trees import ROOT, Tree

REPO = ROOT
NAIVE = Path(__file__).resolve().parent / "lib" / "naive_split.py"
DIRECT = Path(__file__).resolve().parent / "lib" / "direct_copy.py"
PY = procs.PY
QUICK = ["--sizes", "3e7", "--rounds", "1", "--cache", "warm", "--workers", "2", "--naive", "index"]
BEFORE = True
HERE = Tree("after", ROOT)
CACHE_NOTE = {
    "cold": "written back and dropped before every run",
    "warm": "source read into the page cache before every run",
}


@dataclass
class Run:
    size: str
    method: str
    round: int
    cache: str
    wall: float
    cpu: float
    maxrss_mb: float
    bytes_written: int
    extra: dict


# --------------------------------------------------------------------------- helpers


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def prepare_cache(mode: str, model: Path) -> None:
    """Cold: write back and drop the page cache. Warm: read the source into it."""
    if mode == "cold":
        if not pages.drop_all():
            raise SystemExit("cannot drop the page cache (needs root): use --cache warm")
    else:
        os.sync()
        pages.warm(shard_files(model))


shard_files = checkpoints.shard_files


# --------------------------------------------------------------------------- the measurements


def build(model: Path, target_bytes: int) -> None:
    t0 = time.perf_counter()
    checkpoints.scaled(model, target_bytes)
    print(f"  built {model} ({gb(dir_bytes(model))}) in {time.perf_counter() - t0:.0f} s", flush=True)


_KEEP_CACHE = (
    "import sys; import qwen35_reshard.transfer.pages as p; p.DROP_BEHIND = False; "
    "from qwen35_reshard.cli import main; sys.exit(main(sys.argv[1:]))"
)


def methods(model: Path, out: Path, args: argparse.Namespace, trees: list[Tree]) -> dict[str, tuple]:
    """Each method's name: its command and environment (the reshard rows once per tree)."""
    shards = " ".join(f"'{p}'" for p in shard_files(model))
    split = ["--pp", str(args.pp), str(model), str(out)]
    m: dict[str, list[str]] = {}
    envs: dict[str, dict[str, str]] = {}
    for tree in trees:
        tag = "" if tree.label == "after" else f" ({tree.label})"
        for w in args.workers:
            m[f"reshard --workers {w}{tag}"] = [PY, "-m", "qwen35_reshard", "--workers", str(w), *split]
            envs[f"reshard --workers {w}{tag}"] = tree.env()
        if args.ablation:
            # The same engine with the page cache kept (pages.DROP_BEHIND = False): what streaming
            # through the page cache, rather than filling it, is worth on this machine.
            w = max(args.workers)
            name = f"reshard --workers {w}, cache kept{tag}"
            m[name] = [PY, "-c", _KEEP_CACHE, "--workers", str(w), *split]
            envs[name] = tree.env()
    # The time of cp alone (its copies still in the page cache) is printed for the report too.
    m["cp + sync"] = [
        "sh",
        "-c",
        f"mkdir -p '{out}' && s=$(date +%s%N) && cp {shards} '{out}/' && e=$(date +%s%N) && "
        f'sync \'{out}\'/* && echo "{{\\"cp_only_seconds\\": $(( (e - s) / 1000000 ))e-3}}"',
    ]
    m["O_DIRECT copy"] = [PY, str(DIRECT), str(out), *map(str, shard_files(model))]
    for way in args.naive:
        m[f"naive, {way}"] = [PY, str(NAIVE), str(model), str(out), "--pp", str(args.pp), "--way", way]
    here = trees[0].env()
    return {name: (argv, envs.get(name, here)) for name, argv in m.items()}


def measure_size(
    label: str, model: Path, work: Path, args: argparse.Namespace, cache: str, trees: list[Tree]
) -> list[Run]:
    out = work / "out"
    todo = methods(model, out, args, trees)
    names = list(todo)
    runs = []
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]  # rotate: no method always first
        for name in order:
            shutil.rmtree(out, ignore_errors=True)
            prepare_cache(cache, model)
            argv, env = todo[name]
            m = procs.run(argv, env=env)
            last = (m.stdout.strip().splitlines() or [""])[-1]
            extra = json.loads(last) if last.startswith("{") else {}  # the copies' and naive's own times
            written = dir_bytes(out)
            run = Run(label, name, r, cache, m.wall, m.cpu, m.peak_rss / 2**20, written, extra)
            runs.append(run)
            print(
                f"  [{cache} round {r + 1}] {name:22s} {run.wall:7.2f} s  {gb(run.bytes_written)}  "
                f"peak RSS {run.maxrss_mb:6.0f} MiB  cpu {run.cpu:.2f} s",
                flush=True,
            )
    shutil.rmtree(out, ignore_errors=True)
    return runs


def check_output(model: Path, work: Path, pp: int) -> str:
    """One untimed split, checked by ``qwen35-reshard verify OUT --source MODEL``; left for the loader."""
    out = work / "verified"
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run(
        [PY, "-m", "qwen35_reshard", "--pp", str(pp), str(model), str(out)], check=True, capture_output=True,
        env=HERE.env(), cwd="/",
    )
    v = subprocess.run(
        [PY, "-m", "qwen35_reshard", "verify", str(out), "--source", str(model)],
        capture_output=True,
        text=True,
        env=HERE.env(),
        cwd="/",
    )
    if v.returncode != 0:
        raise SystemExit(f"verify failed:\n{v.stdout}\n{v.stderr}")
    return (v.stdout + v.stderr).strip().splitlines()[-1]


_LOADER_CHILD = """
import json, sys
from qwen35_reshard import loader
def io():
    d = dict(l.split(": ") for l in open("/proc/self/io").read().splitlines())
    return int(d["rchar"]), int(d["read_bytes"])
import torch  # imported before the first reading, so that its own files are not counted
c0, b0 = io()
stage = loader.open_stage(sys.argv[1], pp_rank=int(sys.argv[2]))
n = t = 0
for name, tensor in stage.iter_weights():
    n += tensor.clone().numel() * tensor.element_size()  # a copy, as load_weights makes
    t += 1
c1, b1 = io()
print(json.dumps({"tensors": t, "tensor_bytes": n, "rchar": c1 - c0, "read_bytes": b1 - b0}))
"""


def measure_loader(model: Path, work: Path, pp: int) -> list[dict]:
    out = work / "verified"
    whole = sum(p.stat().st_size for p in shard_files(model))
    rows = []
    for r in range(pp):
        pages.drop_all()  # when permitted, read_bytes then counts what came from storage
        res = subprocess.run(
            [PY, "-c", _LOADER_CHILD, str(out), str(r)], capture_output=True, text=True, check=True,
            env=HERE.env(), cwd="/",
        )
        d = json.loads(res.stdout.strip().splitlines()[-1])
        d["stage"] = f"pp{r}"
        d["stage_files_bytes"] = sum(p.stat().st_size for p in (out / f"pp{r}").glob("*.safetensors"))
        d["checkpoint_bytes"] = whole
        rows.append(d)
    return rows


# --------------------------------------------------------------------------- report


def summarize(runs: list[Run], cache: str, size: str) -> tuple[list[str], dict]:
    rows, med = [], {}
    for method in dict.fromkeys(r.method for r in runs if r.cache == cache and r.size == size):
        rs = [r for r in runs if r.cache == cache and r.size == size and r.method == method]
        wall = median([r.wall for r in rs])
        cpu = median([r.cpu for r in rs])
        rss = max(r.maxrss_mb for r in rs)
        written = rs[-1].bytes_written
        med[method] = (wall, rss, rs)
        rows.append(
            f"| {size} | {method} | {wall:.2f} | {min(r.wall for r in rs):.2f}–{max(r.wall for r in rs):.2f} "
            f"| {gb(written)} | {written / wall / 1e9:.2f} GB/s | {cpu:.2f} | {rss:.0f} MB |"
        )
    return rows, med


def report(runs, sizes, caches, args, loader_rows, verified, env) -> str:
    lines = [
        f"qwen35-reshard benchmark, {env['date']}",
        "",
        f"- machine: {env['machine']}",
        f"- command: `{env['command']}`",
        "- every run is a separate process; wall time from its start to its exit, CPU and peak RSS "
        "from os.wait4 (the process and its children, through a small launcher); all methods end "
        "with their output fsynced (reshard does it itself, cp is followed by sync of the copies, "
        "the naive script fsyncs each file); the package's bytecode is compiled first, as an install does",
        "",
    ]
    for cache in caches if sizes else []:
        lines += [
            f"### {cache} page cache ({CACHE_NOTE[cache]}); median of {args.rounds} rounds, interleaved",
            "",
            "| checkpoint | method | wall s (median) | min–max | bytes written | throughput | CPU s "
            "| peak RSS |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        notes = []
        for size in sizes:
            rows, med = summarize(runs, cache, size)
            lines += rows
            cp, cp_runs = med["cp + sync"][0], med["cp + sync"][2]
            cp_only = median([r.extra["cp_only_seconds"] for r in cp_runs])
            direct = med["O_DIRECT copy"][0]
            for w in args.workers:
                wall, rss, _ = med[f"reshard --workers {w}"]
                if f"reshard --workers {w} (before)" in med:
                    old, old_rss, _ = med[f"reshard --workers {w} (before)"]
                    notes.append(f"- {size}, --workers {w}: after/before time **{wall / old:.2f}x**, "
                                 f"peak RSS **{rss / old_rss:.2f}x**")  # fmt: skip
                notes.append(
                    f"- {size}, --workers {w}: reshard / (cp + sync) time **{wall / cp:.2f}x** "
                    f"(/ cp alone, before its sync: {wall / cp_only:.2f}x); reshard / O_DIRECT copy "
                    f"**{wall / direct:.2f}x**"
                )
                for way in args.naive:
                    naive, naive_rss, naive_runs = med[f"naive, {way}"]
                    naive_split = median([r.extra["split_seconds"] for r in naive_runs])
                    notes.append(
                        f"  - naive, {way} / reshard: time **{naive / wall:.1f}x** "
                        f"({naive_split / wall:.1f}x leaving out its {naive - naive_split:.1f} s of "
                        f"start-up and imports), peak RSS **{naive_rss / rss:.1f}x**"
                    )
            kept = [m for m in med if m.endswith("cache kept")]
            for m in kept:
                notes.append(f"- {size}, {m}: reshard / (cp + sync) time **{med[m][0] / cp:.2f}x**")
        for w in args.workers:
            peaks = [summarize(runs, cache, size)[1][f"reshard --workers {w}"][1] for size in sizes]
            notes.append(
                f"- reshard --workers {w} peak RSS by checkpoint size: "
                + ", ".join(f"{size}: {p:.0f} MiB" for size, p in zip(sizes, peaks, strict=True))
            )
        lines += ["", *notes, ""]
    if loader_rows:
        whole = loader_rows[0]["checkpoint_bytes"]
        lines += [
            f"### Loading one stage through the shim ({sizes[-1]} checkpoint, {gb(whole)} of shards)",
            "",
            "| stage | tensors | stage tensor bytes | read() calls (rchar) | from storage (read_bytes) "
            "| read_bytes / checkpoint |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for d in loader_rows:
            lines.append(
                f"| {d['stage']} | {d['tensors']} | {gb(d['tensor_bytes'])} | {gb(d['rchar'])} | "
                f"{gb(d['read_bytes'])} | {d['read_bytes'] / whole:.1%} |"
            )
        total = sum(d["read_bytes"] for d in loader_rows)
        lines += [
            "",
            f"All {len(loader_rows)} stages together read {gb(total)} "
            f"({total / whole:.1%} of the checkpoint; "
            "replicated tensors are read by each stage that holds them). A stock loader with pipeline "
            f"parallelism reads every shard on every rank: {gb(whole)} per stage.",
            "",
        ]
    if verified:
        lines += [f"Output checked with `qwen35-reshard verify OUT --source MODEL`: {verified}", ""]
    return "\n".join(lines)


def compile_bytecode(tree: Tree) -> None:
    """Compile the package's bytecode, as installing it does: with PYTHONDONTWRITEBYTECODE set
    (or a read-only source tree) every run would otherwise compile its modules again (~0.1 s),
    which a fresh interpreter running only json never pays."""
    subprocess.run([PY, "-m", "compileall", "-q", str(tree.path / "qwen35_reshard")], check=True,
                   stdout=subprocess.DEVNULL)


def environment(args: argparse.Namespace) -> dict:
    from importlib.metadata import version

    commit = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    dirty = subprocess.run(
        ["git", "-C", str(REPO), "status", "--porcelain", "--", "qwen35_reshard"],
        capture_output=True,
        text=True,
    )
    fs = (
        subprocess.run(["df", "-T", str(args.workdir)], capture_output=True, text=True)
        .stdout.splitlines()[-1]
        .split()
    )
    cpu = "?"
    try:
        cpu = next(x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if x.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": (
            f"{os.cpu_count()} cores ({cpu}), {mem / 2**30:.0f} GiB RAM, {fs[1]} on {fs[0]}, "
            f"Linux {platform.release()}, Python {platform.python_version()}, torch {version('torch')}, "
            f"safetensors {version('safetensors')}, qwen35-reshard at {commit.stdout.strip()}"
            f"{' (+ local changes)' if dirty.stdout.strip() else ''}"
        ),
        "command": "python -m benchmarks split " + " ".join(args.argv),
    }


def main(argv: list[str], trees: list[Tree]) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks split", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--sizes", default="2e9,6e9", help="checkpoint sizes in bytes, comma-separated (default: 2e9,6e9)"
    )
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--workers", default="1,2", help="--workers values to measure (default: 1,2)")
    p.add_argument(
        "--naive",
        default="every-shard,index,all-in-memory",
        help="naive_split.py --way values to measure (default: all three)",
    )
    p.add_argument(
        "--cache", default="auto", help="cold, warm, cold,warm or auto (cold when root may drop caches)"
    )
    p.add_argument("--workdir", type=Path, default=Path("/tmp/qwen35-reshard-bench"))
    p.add_argument(
        "--max-disk", type=float, default=15e9, help="refuse sizes whose source + one output exceed this"
    )
    p.add_argument(
        "--ablation", action="store_true", help="also run reshard with the page cache kept (DROP_BEHIND off)"
    )
    p.add_argument("--keep", action="store_true", help="keep the built checkpoints")
    p.add_argument("--output", type=Path, help="also write the report (markdown) and raw runs (.json) here")
    args = p.parse_args(argv)
    args.argv = argv
    sizes = [] if args.sizes == "none" else [int(float(s)) for s in args.sizes.split(",")]
    args.workers = [int(w) for w in args.workers.split(",")]
    args.naive = args.naive.split(",")
    caches = ["cold" if pages.drop_all() else "warm"] if args.cache == "auto" else args.cache.split(",")
    for s in sizes:
        if 2.2 * s > args.max_disk:
            raise SystemExit(
                f"size {gb(s)} needs about {gb(2.2 * s)} of disk at once, over --max-disk {gb(args.max_disk)}"
            )
    args.workdir.mkdir(parents=True, exist_ok=True)
    for tree in trees:
        compile_bytecode(tree)
    env = environment(args)
    print(env["machine"], flush=True)

    runs: list[Run] = []
    labels = []
    loader_rows: list[dict] = []
    verified = ""
    try:
        for s in sizes:
            label = f"{s / 1e9:g} GB"
            labels.append(label)
            model = args.workdir / f"q35b-{s}"
            print(f"checkpoint {label}:", flush=True)
            if not (args.keep and model.exists()):
                build(model, s)
            label = f"{gb(sum(p.stat().st_size for p in shard_files(model)))}"
            labels[-1] = label
            for cache in caches:
                runs += measure_size(label, model, args.workdir, args, cache, trees)
            verified = check_output(model, args.workdir, args.pp)
            print(f"  verify: {verified}", flush=True)
            if s == sizes[-1]:
                loader_rows = measure_loader(model, args.workdir, args.pp)
            shutil.rmtree(args.workdir / "verified", ignore_errors=True)
            if not args.keep:
                shutil.rmtree(model)
    finally:
        for name in ("out", "verified"):
            shutil.rmtree(args.workdir / name, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(args.workdir, ignore_errors=True)

    text = report(runs, labels, caches, args, loader_rows, verified, env)
    print("\n" + text)
    if args.output:
        args.output.write_text(text)
        args.output.with_suffix(".json").write_text(
            json.dumps(
                {
                    "env": env,
                    "runs": [asdict(r) for r in runs],
                    "loader": loader_rows,
                },
                indent=1,
            )
        )
    return 0

