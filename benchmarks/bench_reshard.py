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
- with ``--ablation``, also reshard with the page cache kept (``pages.DROP_BEHIND = False``).

Each run is its own process, started by a small launcher that reports its wall time and its
``os.wait4`` rusage (CPU and peak RSS of that process and its descendants only). With
``--cache cold`` (root only) the page cache is written back and dropped before each run; with
``warm`` the source is read into the page cache before each run. Medians are reported. Then:

- ``--dry-run`` time on a headers-only (sparse) Qwen3.5-397B-A17B-FP8-shaped checkpoint,
  interleaved with a fresh interpreter that only json-parses every shard's header (the
  ratio of the two medians is the planning overhead), and the bytes the plan can share;
- with ``--reflink-fs xfs,btrfs`` (root: loop-mounted image files), block sharing on each:
  reshard (``--reflink auto``) against ``cp --reflink=always`` and a plain ``cp
  --reflink=never`` of the shards, each followed by ``sync``: time and growth of the
  filesystem's used space (statvfs, as df shows it), on a ``--reflink-size`` checkpoint;
- bytes read from storage by ``loader.open_stage(OUT, pp_rank=r).iter_weights()`` per stage,
  each tensor copied as ``load_weights`` does (read_bytes from /proc/self/io of a child process,
  page cache dropped first, so root only: the shim reads through a memory map, which rchar
  does not count) against the whole checkpoint.

Disk: a source and one output exist at a time (about twice the size); everything is under
``--workdir`` and deleted at the end (``--keep`` keeps the checkpoints).

    python benchmarks/bench_reshard.py                       # 2 GB and 6 GB, 5 rounds
    python benchmarks/bench_reshard.py --sizes 1e9 --rounds 1 --cache warm   # quick look
    python benchmarks/bench_reshard.py --sizes none --reflink-fs xfs,btrfs    # sharing + dry run only
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BUILDER = REPO / "examples" / "tiny_checkpoint.py"
NAIVE = Path(__file__).resolve().parent / "naive_split.py"
DIRECT = Path(__file__).resolve().parent / "direct_copy.py"
PY = sys.executable
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
    user: float
    sys: float
    maxrss_mb: float
    bytes_written: int
    extra: dict


# --------------------------------------------------------------------------- helpers


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def shard_files(model: Path) -> list[Path]:
    index = json.loads((model / "model.safetensors.index.json").read_text())
    return [model / f for f in sorted(set(index["weight_map"].values()))]


def drop_caches() -> bool:
    """Write back dirty pages and drop the page cache; False when not permitted (not root)."""
    subprocess.run(["sync"], check=True)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def prepare_cache(mode: str, model: Path) -> None:
    """Cold: write back and drop the page cache. Warm: read the source into it."""
    if mode == "cold":
        if not drop_caches():
            raise SystemExit("cannot drop the page cache (needs root): use --cache warm")
    else:
        subprocess.run(["sync"], check=True)
        buf = bytearray(8 << 20)
        for p in shard_files(model):
            with open(p, "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass


# A fresh, small interpreter starts each measured command and reports that command's own
# wall time and rusage. Spawning straight from this process would not do: a spawned child
# shares its parent's memory until exec, and Linux carries that high-water mark into the
# child's ru_maxrss, so every peak would read at least this process's size. The launcher's
# own size (~10 MB) is the floor of the reported peaks.
_LAUNCHER = """
import json, os, sys, time
result, argv = sys.argv[1], sys.argv[2:]
t0 = time.perf_counter()
pid = os.posix_spawnp(argv[0], argv, os.environ)
_, status, ru = os.wait4(pid, 0)
wall = time.perf_counter() - t0
with open(result, "w") as f:
    json.dump({"wall": wall, "user": ru.ru_utime, "sys": ru.ru_stime, "maxrss_kb": ru.ru_maxrss,
               "code": os.waitstatus_to_exitcode(status)}, f)
"""


def run_child(argv: list[str], log: Path) -> tuple[dict, str]:
    """Run ``argv`` through the launcher; return its measurements and the command's stdout."""
    result = log.with_suffix(".json")
    with open(log, "w") as err:
        out = subprocess.run(
            [PY, "-S", "-c", _LAUNCHER, str(result), *argv], stdout=subprocess.PIPE, stderr=err, text=True
        ).stdout
    return json.loads(result.read_text()), out


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# --------------------------------------------------------------------------- the measurements


def build(model: Path, target_bytes: int) -> None:
    if model.exists():
        shutil.rmtree(model)
    t0 = time.perf_counter()
    subprocess.run(
        [
            PY,
            str(BUILDER),
            str(model),
            "--preset",
            "qwen3.5-35b-a3b-scaled",
            "--target-bytes",
            str(target_bytes),
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    print(f"  built {model} ({gb(dir_bytes(model))}) in {time.perf_counter() - t0:.0f} s", flush=True)


_KEEP_CACHE = (
    "import sys; import qwen35_reshard.transfer.pages as p; p.DROP_BEHIND = False; "
    "from qwen35_reshard.cli import main; sys.exit(main(sys.argv[1:]))"
)


def methods(model: Path, out: Path, args: argparse.Namespace) -> dict[str, list[str]]:
    shards = " ".join(f"'{p}'" for p in shard_files(model))
    split = ["--pp", str(args.pp), str(model), str(out)]
    m = {
        f"reshard --workers {w}": [PY, "-m", "qwen35_reshard", "--workers", str(w), *split]
        for w in args.workers
    }
    if args.ablation:
        # The same engine with the page cache kept (pages.DROP_BEHIND = False): what streaming
        # through the page cache, rather than filling it, is worth on this machine.
        w = max(args.workers)
        m[f"reshard --workers {w}, cache kept"] = [PY, "-c", _KEEP_CACHE, "--workers", str(w), *split]
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
    return m


def measure_size(label: str, model: Path, work: Path, args: argparse.Namespace, cache: str) -> list[Run]:
    out = work / "out"
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    todo = methods(model, out, args)
    names = list(todo)
    runs = []
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]  # rotate: no method always first
        for name in order:
            shutil.rmtree(out, ignore_errors=True)
            prepare_cache(cache, model)
            slug = "".join(c if c.isalnum() else "-" for c in name)
            log = logs / f"{label.replace(' ', '')}-{cache}-{r}-{slug}.log"
            m, stdout = run_child(todo[name], log)
            if m["code"] != 0:
                raise SystemExit(f"{name} failed (exit {m['code']}); see {log}:\n{log.read_text()[-2000:]}")
            extra = json.loads(stdout.strip().splitlines()[-1]) if stdout.strip() else {}
            written = dir_bytes(out)
            run = Run(
                label, name, r, cache, m["wall"], m["user"], m["sys"], m["maxrss_kb"] / 1024, written, extra
            )
            runs.append(run)
            print(
                f"  [{cache} round {r + 1}] {name:22s} {run.wall:7.2f} s  {gb(run.bytes_written)}  "
                f"peak RSS {run.maxrss_mb:6.0f} MB  cpu {run.user:.2f}u+{run.sys:.2f}s",
                flush=True,
            )
    shutil.rmtree(out, ignore_errors=True)
    return runs


def check_output(model: Path, work: Path, pp: int) -> str:
    """One untimed split, checked by ``qwen35-reshard verify OUT --source MODEL``; left for the loader."""
    out = work / "verified"
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run(
        [PY, "-m", "qwen35_reshard", "--pp", str(pp), str(model), str(out)], check=True, capture_output=True
    )
    v = subprocess.run(
        [PY, "-m", "qwen35_reshard", "verify", str(out), "--source", str(model)],
        capture_output=True,
        text=True,
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
        drop_caches()  # when permitted, read_bytes then counts what came from storage
        res = subprocess.run(
            [PY, "-c", _LOADER_CHILD, str(out), str(r)], capture_output=True, text=True, check=True
        )
        d = json.loads(res.stdout.strip().splitlines()[-1])
        d["stage"] = f"pp{r}"
        d["stage_files_bytes"] = sum(p.stat().st_size for p in (out / f"pp{r}").glob("*.safetensors"))
        d["checkpoint_bytes"] = whole
        rows.append(d)
    return rows


def measure_dry_run(work: Path, rounds: int) -> dict:
    model = work / "q397b-fp8-headers"
    if not model.exists():
        subprocess.run(
            [PY, str(BUILDER), str(model), "--preset", "qwen3.5-397b-a17b-fp8-headers"],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    index = json.loads((model / "model.safetensors.index.json").read_text())
    tensors = len(index["weight_map"])
    logical = sum(p.stat().st_size for p in shard_files(model))
    on_disk = sum(p.stat().st_blocks * 512 for p in model.iterdir())
    walls, parse_walls, cpus, parse_cpus, rss = [], [], [], [], []
    floors: dict[str, list[float]] = {name: [] for name in _FLOORS}
    for _ in range(rounds):
        m, _ = run_child([PY, "-c", _PARSE_HEADERS, str(model)], work / "parse.log")
        parse_walls.append(m["wall"])
        parse_cpus.append(m["user"] + m["sys"])
        for name, script in _FLOORS.items():
            m, _ = run_child([PY, "-c", script, str(model)], work / "floor.log")
            floors[name].append(m["wall"])
        m, _ = run_child(
            [PY, "-m", "qwen35_reshard", "--pp", "4", "--dry-run", str(model), str(work / "dry-out")],
            work / "dry-run.log",
        )
        if m["code"] != 0:
            raise SystemExit(f"dry run failed; see {work / 'dry-run.log'}")
        walls.append(m["wall"])
        cpus.append(m["user"] + m["sys"])
        rss.append(m["maxrss_kb"] / 1024)
    doc = json.loads(
        subprocess.run(
            [PY, "-m", "qwen35_reshard", "--pp", "4", "--dry-run", "--json", str(model), str(work / "dry")],
            capture_output=True,
            check=True,
            text=True,
        ).stdout
    )
    return {
        "tensors": tensors,
        "shards": len(shard_files(model)),
        "logical_bytes": logical,
        "on_disk_bytes": on_disk,
        "walls": walls,
        "median": median(walls),
        "parse_walls": parse_walls,
        "parse_median": median(parse_walls),
        "cpu_median": median(cpus),
        "parse_cpu_median": median(parse_cpus),
        "floor_walls": floors,
        "floor_medians": {name: median(w) for name, w in floors.items()},
        "maxrss_mb": max(rss),
        "stage_bytes": sum(st["bytes"] for st in doc["stages"]),
        "shareable_bytes": sum(st["shareable_bytes"] for st in doc["stages"]),
        "split_shards": sum(len(st["source_files"]) for st in doc["stages"]) - len(shard_files(model)),
    }


# What --dry-run is compared with: a fresh interpreter that json-parses every shard header.
_PARSE_HEADERS = """
import json, struct, sys
from pathlib import Path
for p in sorted(Path(sys.argv[1]).glob("*.safetensors")):
    with open(p, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        json.loads(f.read(n))
"""
# Floors: what any dry run of this tool does before checking or planning anything, in a fresh
# interpreter. "start-up": importing the CLI and what it shows a plan with; "start-up + JSON":
# that, then json-parsing the index (the exact list of tensors) and every shard header.
_IMPORT_CLI = "import sys; import qwen35_reshard.cli.app, qwen35_reshard.cli.report\n"
_FLOORS = {
    "start-up": _IMPORT_CLI,
    "start-up + JSON": _IMPORT_CLI
    + "import json; from pathlib import Path\n"
    + "json.loads((Path(sys.argv[1]) / 'model.safetensors.index.json').read_bytes())\n"
    + _PARSE_HEADERS,
}


def used_bytes(path: Path) -> int:
    """Bytes in use on the filesystem of ``path``, as df shows them, after a sync."""
    subprocess.run(["sync", "-f", str(path)], check=True)
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def mount_image(kind: str, work: Path, size: int) -> Path:
    """A fresh loop-mounted ``kind`` filesystem of ``size`` bytes under ``work``."""
    image, mnt = work / f"{kind}.img", work / kind
    with open(image, "wb") as f:
        f.truncate(size)
    mnt.mkdir(exist_ok=True)
    mkfs = {"xfs": ["mkfs.xfs", "-q", "-f"], "btrfs": ["mkfs.btrfs", "-q", "-f"]}[kind]
    subprocess.run([*mkfs, str(image)], check=True, capture_output=True)
    subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], check=True)
    return mnt


def measure_sharing(kind: str, size: int, args: argparse.Namespace, cache: str) -> list[dict]:
    """reshard against cp --reflink=always and a plain copy on a loop-mounted ``kind`` filesystem."""
    mnt = mount_image(kind, args.workdir, int(2.5 * size) + 2**30)
    try:
        model, out = mnt / "model", mnt / "out"
        build(model, size)
        checkpoint = sum(p.stat().st_size for p in shard_files(model))
        shards = " ".join(f"'{p}'" for p in shard_files(model))
        todo = {
            "reshard": [PY, "-m", "qwen35_reshard", "--pp", str(args.pp), "--json", str(model), str(out)],
            "reshard --dry-run": [
                PY, "-m", "qwen35_reshard", "--pp", str(args.pp), "--dry-run", str(model), str(out)
            ],
            "cp --reflink=always + sync": [
                "sh", "-c", f"mkdir -p '{out}' && cp --reflink=always {shards} '{out}/' && sync '{out}'/*"
            ],
            "cp --reflink=never + sync": [
                "sh", "-c", f"mkdir -p '{out}' && cp --reflink=never {shards} '{out}/' && sync '{out}'/*"
            ],
            _SHARING_FLOOR: ["sh", "-c", _sharing_floor(model, out, args.pp)],
        }  # fmt: skip
        rows = []
        for r in range(args.rounds):
            for name in list(todo)[r % len(todo) :] + list(todo)[: r % len(todo)]:
                shutil.rmtree(out, ignore_errors=True)
                prepare_cache(cache, model)
                before = used_bytes(mnt)
                m, stdout = run_child(todo[name], args.workdir / f"{kind}-{r}.log")
                if m["code"] != 0:
                    raise SystemExit(f"{kind}: {name} failed; see {args.workdir / f'{kind}-{r}.log'}")
                growth = used_bytes(mnt) - before
                result = json.loads(stdout)["result"] if name == "reshard" else {}
                shared = result and result["bytes_shared"] / (result["bytes_shared"] + result["bytes_copied"])
                rows.append(
                    {"fs": kind, "method": name, "round": r, "wall": m["wall"], "growth": growth,
                     "checkpoint": checkpoint, "shared": shared}
                )  # fmt: skip
                print(
                    f"  [{kind} round {r + 1}] {name:28s} {m['wall']:7.2f} s  disk +{growth / 1e6:.1f} MB",
                    flush=True,
                )
        shutil.rmtree(out, ignore_errors=True)
        subprocess.run([*todo["reshard"]], check=True, capture_output=True)
        v = subprocess.run(
            [PY, "-m", "qwen35_reshard", "verify", str(out), "--source", str(model)], capture_output=True
        )
        if v.returncode:
            raise SystemExit(f"{kind}: verify --source failed:\n{(v.stdout + v.stderr).decode()[-2000:]}")
        return rows
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
        (args.workdir / f"{kind}.img").unlink(missing_ok=True)


# The files a split that shares must create and the one barrier that makes them durable, with
# nothing else: every shard cloned whole, each stage's and OUT's non-weight files copied, one
# syncfs. A split also writes headers, indexes and manifests, copies what cannot be shared and
# checks what it wrote; this is less than any split does, not a way to split.
_SHARING_FLOOR = "floor: clones + side files + syncfs"


def _sharing_floor(model: Path, out: Path, pp: int) -> str:
    shards = " ".join(f"'{p}'" for p in shard_files(model))
    side = " ".join(
        f"'{p}'"
        for p in sorted(model.iterdir())
        if p.is_file() and p.suffix != ".safetensors" and p.name != "model.safetensors.index.json"
    )
    dirs = " ".join(f"'{out}/pp{r}'" for r in range(pp))
    return (
        f"mkdir -p {dirs} && cp --reflink=always {shards} '{out}/' && "
        f"for d in '{out}' {dirs}; do cp {side} \"$d/\"; done && sync -f '{out}'"
    )


def sharing_report(rows: list[dict], dry: dict) -> list[str]:
    lines = []
    for kind in dict.fromkeys(r["fs"] for r in rows):
        mine = [r for r in rows if r["fs"] == kind]
        checkpoint = mine[0]["checkpoint"]
        lines += [
            f"### Block sharing on {kind} (loop-mounted image), {gb(checkpoint)} checkpoint, "
            f"median of {max(r['round'] for r in mine) + 1} rounds, interleaved",
            "",
            "| method | wall s (median) | disk growth (df) | growth / checkpoint |",
            "|---|---:|---:|---:|",
        ]
        med = {}
        for method in dict.fromkeys(r["method"] for r in mine):
            runs = [r for r in mine if r["method"] == method]
            wall, growth = median([r["wall"] for r in runs]), median([r["growth"] for r in runs])
            med[method] = wall
            lines.append(f"| {method} | {wall:.2f} | {growth / 1e6:.1f} MB | {growth / checkpoint:.2%} |")
        shared = median([r["shared"] for r in mine if r["method"] == "reshard"])
        reflink, plain = med["cp --reflink=always + sync"], med["cp --reflink=never + sync"]
        split, planning = med["reshard"], med["reshard --dry-run"]
        lines += [
            "",
            f"- reshard / (cp --reflink=always + sync) time **{split / reflink:.1f}x**; reshard / "
            "(2 x cp --reflink=always + its own dry run, the issue's bound as read here) "
            f"**{split / (2 * reflink + planning):.2f}x** (read as 2 x (cp + dry run): "
            f"{split / (2 * (reflink + planning)):.2f}x); "
            f"reshard / plain copy **{split / plain:.2f}x**; {shared:.2%} of the output's data-file "
            "bytes shared with the source (the tool's count; verify --source passed)",
            f"- the bound gives the split's writing (reshard minus its dry run: "
            f"{(split - planning) * 1000:.0f} ms) 2 x cp --reflink=always = {2 * reflink * 1000:.0f} ms; "
            f"creating the files and one barrier alone ({_SHARING_FLOOR}) takes "
            f"{med[_SHARING_FLOOR] * 1000:.0f} ms",
            "",
        ]
    return ["", *lines] if lines else []


# --------------------------------------------------------------------------- report


def summarize(runs: list[Run], cache: str, size: str) -> tuple[list[str], dict]:
    rows, med = [], {}
    for method in dict.fromkeys(r.method for r in runs if r.cache == cache and r.size == size):
        rs = [r for r in runs if r.cache == cache and r.size == size and r.method == method]
        wall = median([r.wall for r in rs])
        cpu = median([r.user + r.sys for r in rs])
        rss = max(r.maxrss_mb for r in rs)
        written = rs[-1].bytes_written
        med[method] = (wall, rss, rs)
        rows.append(
            f"| {size} | {method} | {wall:.2f} | {min(r.wall for r in rs):.2f}–{max(r.wall for r in rs):.2f} "
            f"| {gb(written)} | {written / wall / 1e9:.2f} GB/s | {cpu:.2f} | {rss:.0f} MB |"
        )
    return rows, med


def report(runs, sizes, caches, args, dry, loader_rows, verified, env, sharing) -> str:
    lines = [
        f"qwen35-reshard benchmark, {env['date']}",
        "",
        f"- machine: {env['machine']}",
        f"- command: `{env['command']}`",
        "- every run is a separate process; wall time from its start to its exit, CPU and peak RSS "
        "from os.wait4 (the process and its children); all methods end with their output "
        "fsynced (reshard does it itself, cp is followed by sync of the copies, the naive script "
        "fsyncs each file); the package's bytecode is compiled first, as an install does",
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
                + ", ".join(f"{size}: {p:.0f} MB" for size, p in zip(sizes, peaks, strict=True))
            )
        lines += ["", *notes, ""]
    floor = dry["floor_medians"]["start-up + JSON"]
    lines += [
        "### --dry-run on a Qwen3.5-397B-A17B-FP8-shaped checkpoint (headers only, sparse)",
        "",
        f"{dry['tensors']:,} tensors in {dry['shards']} shards ({gb(dry['logical_bytes'])} logical, "
        f"{dry['on_disk_bytes'] / 1e6:.0f} MB on disk): `qwen35-reshard --pp 4 --dry-run` "
        f"median **{dry['median']:.2f} s** over {len(dry['walls'])} runs "
        f"({', '.join(f'{w:.2f}' for w in dry['walls'])}), peak RSS {dry['maxrss_mb']:.0f} MB",
        "",
        f"- a fresh interpreter json-parsing every shard header, interleaved: median "
        f"{dry['parse_median']:.2f} s; dry run / header parse **{dry['median'] / dry['parse_median']:.2f}x** "
        f"(CPU time, less moved by other load: {dry['cpu_median']:.2f} s / {dry['parse_cpu_median']:.2f} s = "
        f"**{dry['cpu_median'] / dry['parse_cpu_median']:.2f}x**)",
        *(
            f"- floor, {name} (what a dry run does before any check, see `_FLOORS`): median "
            f"{w:.2f} s = **{w / dry['parse_median']:.2f}x** the header parse"
            for name, w in dry["floor_medians"].items()
        ),
        f"- what the 3x bound leaves after the start-up + JSON floor, for every check, the "
        f"schema, the placement and the layout: {3 * dry['parse_median'] - floor:.2f} s, "
        f"{(3 * dry['parse_median'] - floor) / dry['tensors'] * 1e6:.1f} us per tensor "
        f"(this dry run spends {(dry['median'] - floor) / dry['tensors'] * 1e6:.1f} us per tensor on them)",
        f"- the plan shares {gb(dry['shareable_bytes'])} of the stages' {gb(dry['stage_bytes'])} "
        f"({dry['shareable_bytes'] / dry['stage_bytes']:.3%}) with the source on a filesystem that "
        f"shares 4 KiB blocks; {dry['split_shards']} source shard(s) are split between stages",
        "",
    ]
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
    lines += sharing_report(sharing, dry)
    if verified:
        lines += [f"Output checked with `qwen35-reshard verify OUT --source MODEL`: {verified}", ""]
    return "\n".join(lines)


def compile_bytecode() -> None:
    """Compile the package's bytecode, as installing it does: with PYTHONDONTWRITEBYTECODE set
    (or a read-only source tree) every run would otherwise compile its modules again (~0.1 s),
    which a fresh interpreter running only json never pays."""
    where = subprocess.run(
        [PY, "-c", "import os, qwen35_reshard; print(os.path.dirname(qwen35_reshard.__file__))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    subprocess.run([PY, "-m", "compileall", "-q", where], check=True, stdout=subprocess.DEVNULL)


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
        "command": "python benchmarks/bench_reshard.py " + " ".join(sys.argv[1:]),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    p.add_argument("--dry-run-rounds", type=int, default=5)
    p.add_argument(
        "--reflink-fs",
        default="",
        help="filesystems to measure block sharing on, e.g. xfs,btrfs (root: loop-mounted images)",
    )
    p.add_argument("--reflink-size", type=float, default=2e9, help="checkpoint size for --reflink-fs")
    p.add_argument(
        "--ablation", action="store_true", help="also run reshard with the page cache kept (DROP_BEHIND off)"
    )
    p.add_argument("--keep", action="store_true", help="keep the built checkpoints")
    p.add_argument("--output", type=Path, help="also write the report (markdown) and raw runs (.json) here")
    args = p.parse_args(argv)
    sizes = [] if args.sizes == "none" else [int(float(s)) for s in args.sizes.split(",")]
    args.workers = [int(w) for w in args.workers.split(",")]
    args.naive = args.naive.split(",")
    caches = ["cold" if drop_caches() else "warm"] if args.cache == "auto" else args.cache.split(",")
    for s in sizes:
        if 2.2 * s > args.max_disk:
            raise SystemExit(
                f"size {gb(s)} needs about {gb(2.2 * s)} of disk at once, over --max-disk {gb(args.max_disk)}"
            )
    args.workdir.mkdir(parents=True, exist_ok=True)
    compile_bytecode()
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
                runs += measure_size(label, model, args.workdir, args, cache)
            verified = check_output(model, args.workdir, args.pp)
            print(f"  verify: {verified}", flush=True)
            if s == sizes[-1]:
                loader_rows = measure_loader(model, args.workdir, args.pp)
            shutil.rmtree(args.workdir / "verified", ignore_errors=True)
            if not args.keep:
                shutil.rmtree(model)
        print("dry run on the 397B-FP8-shaped headers:", flush=True)
        dry = measure_dry_run(args.workdir, args.dry_run_rounds)
        sharing = []
        for kind in filter(None, args.reflink_fs.split(",")):
            print(f"block sharing on {kind}:", flush=True)
            sharing += measure_sharing(kind, int(args.reflink_size), args, caches[0])
    finally:
        for name in ("out", "verified", "dry-out", "dry"):
            shutil.rmtree(args.workdir / name, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(args.workdir, ignore_errors=True)

    text = report(runs, labels, caches, args, dry, loader_rows, verified, env, sharing)
    print("\n" + text)
    if args.output:
        args.output.write_text(text)
        args.output.with_suffix(".json").write_text(
            json.dumps(
                {
                    "env": env,
                    "runs": [asdict(r) for r in runs],
                    "dry_run": dry,
                    "loader": loader_rows,
                    "sharing": sharing,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
