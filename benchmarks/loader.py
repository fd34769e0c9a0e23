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
  (every byte checked, what a server gets), as the node's first loader (an empty node record;
  with ``--workers`` the N share one, as a node's workers do);
- ``2nd worker checked``: the same as another worker of the node loads it (tensor parallelism:
  every worker of a node loads the stage; the first one's check, made untimed before, is used);
- ``checked no spare core``: the first loader with a node budget of no hashing threads
  (``QWEN35_RESHARD_HASH_THREADS=0``): the copying thread hashes too, as where every core is
  busy: what the check costs where it cannot hide behind the copy;
- ``shim unchecked``: the same with ``QWEN35_RESHARD_VERIFY_LOAD=0``;
- ``open_stage``: opening and checking the stage alone (manifest, index, config, headers).
- ``bare copy``: every tensor copied from views made before the timing (their maps' page
  tables filled): the copy alone, nothing opened, no page faults;
- ``bare copy + hash``: the same, each tensor's bytes hashed (xxh3-128) in the copying thread
  just before its copy: what reading every byte once more costs beside a copy on this machine
  (memory bandwidth, not the hash's speed, is the limit when the copy has every core), the
  least any check that reads the bytes adds; printed as the best a checked load can reach here.

With ``--workers N`` each method runs in N processes at once on the same stage, as the N
tensor-parallel workers of a node load it (the cache prepared once, the N started together): the
time is the slowest worker's, the CPU seconds the sum over the workers.

Prints medians, GB/s, speed against ``safe_open`` (ratio of medians, and median of the rounds'
own ratios: steadier on a machine whose speed drifts), checked / unchecked, and each method's
CPU seconds: where the check costs more CPU than the copy, a node with fewer free cores per
loading worker (or a faster disk) pays it in time; then that cost on this machine and in words
for a GPU node. ``--digests`` first measures the digests considered for the check (sha256,
BLAKE3 on 1 and 2 threads, crc32c, xxh3-128; those installed) against a copy of one buffer.

    python -m benchmarks loader                        # 0.56 GB stage and 49,5xx-tensor stage, warm
    python -m benchmarks loader --before main --rounds 7
    python -m benchmarks loader --shapes many --cache warm,cold
    python -m benchmarks loader --digests --before 020519d     # issue 43: sha256 before, xxh3-128 after
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.lib import checkpoints, pages, procs
from benchmarks.lib.report import median, stamp, table
from benchmarks.lib.trees import Tree, check_imports, order

QUICK = ["--shapes", "tiny", "--rounds", "1"]
BEFORE = True
METHODS = (
    "safe_open", "shim checked", "shim unchecked", "2nd worker checked", "checked no spare core",
    "open_stage", "bare copy", "bare copy + hash",
)  # fmt: skip

# One round of every method in one tree: warms (or drops) the cache before each, times it.
_CHILD = r"""
import json, os, sys, time
import torch
from safetensors import safe_open
import qwen35_reshard
from qwen35_reshard import loader
out, rank, cache, barrier = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[5]
order = sys.argv[4].split(",")
node = sys.argv[6]  # where the node's records of checked files go: shared by the workers started together
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
def shim(checked, record="first", threads=None):
    if checked:
        os.environ.pop("QWEN35_RESHARD_VERIFY_LOAD", None)
    else:
        os.environ["QWEN35_RESHARD_VERIFY_LOAD"] = "0"
    # The node's record of checked files (a tree before issue 43 ignores both variables), empty
    # but for "second", and the node's budget of hashing threads.
    os.environ["QWEN35_RESHARD_CHECKED_DIR"] = os.path.join(node, record)
    os.environ.pop("QWEN35_RESHARD_HASH_THREADS", None)
    if threads is not None:
        os.environ["QWEN35_RESHARD_HASH_THREADS"] = str(threads)
    n = 0
    for name, tensor in loader.open_stage(out, pp_rank=rank).iter_weights():
        dst[name].copy_(tensor); n += 1
    return n
shim(True, record="second")  # the node whose first worker checked the stage, untimed
import ctypes, xxhash
views = {}  # every tensor viewed once, its map's page table filled: the bare copy's bytes
for f in files:
    with safe_open(f, framework="pt") as h:
        views.update((name, h.get_tensor(name)) for name in h.keys())
        [dst[name].copy_(views[name]) for name in h.keys()]
def bare(hashing):
    for name, t in views.items():
        if hashing:  # each byte read once more, in the copying thread, just before it is copied
            xxhash.xxh3_128_hexdigest((ctypes.c_char * t.nbytes).from_address(t.data_ptr()))
        dst[name].copy_(t)
    return len(views)
methods = {"safe_open": safe, "shim checked": lambda: shim(True), "shim unchecked": lambda: shim(False),
           "2nd worker checked": lambda: shim(True, record="second"),
           "checked no spare core": lambda: shim(True, record="busy", threads=0),
           "open_stage": lambda: len(loader.open_stage(out, pp_rank=rank)),
           "bare copy": lambda: bare(False), "bare copy + hash": lambda: bare(True)}
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
if barrier != "-":  # start with the other workers of the node: ready, then wait for "go"
    open(os.path.join(barrier, f"ready.{os.getpid()}"), "w").close()
    while not os.path.exists(os.path.join(barrier, "go")):
        time.sleep(0.001)
for name in order:
    if barrier == "-":
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


def together(child: list[str], method: str, cache: str, tree: Tree, workers: int, work: Path) -> list[dict]:
    """``method`` in ``workers`` processes started together on one stage, the cache prepared once."""
    barrier, node = Path(tempfile.mkdtemp(dir=work)), Path(tempfile.mkdtemp(dir=work))
    if cache == "cold":
        pages.drop_all()
    else:
        pages.warm(Path(child[3]).glob(f"pp{child[4]}/*.safetensors"))
    with ThreadPoolExecutor(workers) as pool:
        running = [
            pool.submit(procs.run, [*child, method, str(barrier), str(node)], env=tree.env())
            for _ in range(workers)
        ]
        while len(list(barrier.glob("ready.*"))) < workers and not any(f.done() for f in running):
            time.sleep(0.01)
        (barrier / "go").touch()
        done = [json.loads(f.result().stdout) for f in running]
    shutil.rmtree(barrier)
    return done


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
                rotated = METHODS[k:] + METHODS[:k]  # no method always first
                child = [procs.PY, "-c", _CHILD, str(outs[t.label]), str(args.rank), cache]
                if args.workers == 1:
                    node = tempfile.mkdtemp(dir=work)
                    run = procs.run([*child, ",".join(rotated), "-", node], env=t.env())
                    results = [[json.loads(run.stdout)]]
                else:
                    results = [together(child, name, cache, t, args.workers, work) for name in rotated]
                for got in results:
                    for one in got:
                        check_imports(t, one.pop("file"))
                        info = one
                    for name in got[0]["times"]:
                        times.setdefault((cache, t.label, name), []).append(
                            max(g["times"][name][0] for g in got)
                        )
                        cpu.setdefault((cache, t.label, name), []).append(
                            sum(g["times"][name][1] for g in got)
                        )
    size = info["bytes"]
    print(
        f"\n### {shape}: stage {args.rank} of a pp={args.pp} split: {info['tensors']:,} tensors, "
        f"{size / 1e9:.3f} GB in {info['files']} files; {args.workers} worker(s); "
        f"medians of {args.rounds} rounds\n"
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
    _check_cost(times, cpu, caches, trees[0].label, size, info["tensors"])


def _check_cost(times: dict, cpu: dict, caches: list[str], label: str, size: int, tensors: int) -> None:
    """Where the check cannot hide behind the copy: its cost with no spare core, measured, and
    what follows for a GPU node from the check's CPU per GB measured here."""
    from qwen35_reshard.format.digest import TENSOR_DIGEST

    rate = _digest_rate()
    print(
        f"\nWhere the check costs more than the copy: {TENSOR_DIGEST} hashes {rate / 1e9:.0f} GB/s on one "
        "thread here from memory, and getting a warm file's bytes to it costs little more (--digests: "
        "the ways measured). The CPU below is what the check adds to the whole load, the copy's own "
        "threads (torch copies on every core) waiting for the core the hashing takes included. It "
        "hides behind the copy while a core is free for it."
    )
    per_gb = 0.0
    for cache in caches:
        off = median(times[(cache, label, "shim unchecked")])
        busy = median(times[(cache, label, "checked no spare core")])
        second = median(times[(cache, label, "2nd worker checked")])
        first = median(times[(cache, label, "shim checked")])
        extra = median(cpu[(cache, label, "shim checked")]) - median(cpu[(cache, label, "shim unchecked")])
        per_gb = max(per_gb, extra / size * 1e9)
        safe = median(times[(cache, label, "safe_open")])
        bare_off, bare_on = (median(times[(cache, label, m)]) for m in ("bare copy", "bare copy + hash"))
        least = bare_on - bare_off
        print(
            f"- {cache}: reading each byte once more beside the copy costs {least:+.3f} s here (bare copy "
            f"{bare_off:.3f} s, with the hash {bare_on:.3f} s: {bare_off / bare_on:.2f}x): at best a checked "
            f"load runs at {off / (off + least):.2f}x of an unchecked one, {safe / (off + least):.2f}x of "
            f"safe_open; measured {off / first:.2f}x and {safe / first:.2f}x."
        )
        print(
            f"- this machine ({os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}), {cache}, "
            f"{size / 1e9:.2f} GB, {tensors:,} tensors: the check's CPU {extra:+.2f} s "
            f"({extra / size * 1e9:.2f} s per GB); the node's first worker {first / off:.2f}x unchecked, "
            f"with no spare core (the copying thread hashes too) {busy / off:.2f}x ({busy - off:+.3f} s), a "
            f"2nd worker of the node, whose bytes the 1st checked, {second / off:.2f}x."
        )
    print(
        f"- a GPU node (64+ cores, 8 workers with TP=8, NVMe at ~7 GB/s, or 25+ GB/s striped): each byte "
        f"is hashed once per node, by whichever worker reaches its file first, in at most 8 threads for "
        f"the node (QWEN35_RESHARD_HASH_THREADS): at {per_gb:.2f} s per GB a 100 GB stage costs "
        f"~{100 * per_gb:.0f} core-seconds in all, ~{100 * per_gb / 8:.1f} s over those threads, while "
        f"its disk needs 4-15 s to read it: {'hidden' if 100 * per_gb / 8 < 4 else 'not hidden'}. It "
        "shows where no core is free beside the "
        f"copies (every core pinned to a worker's own threads), or from a warm page cache on a node "
        f"with one or two cores a worker: then up to ~{10 * per_gb:.1f} s per 10 GB on the worker's "
        "copying thread, as in the no-spare-core row; QWEN35_RESHARD_VERIFY_LOAD=0 if the files are "
        "checked elsewhere."
    )


def _digest_rate() -> float:
    """Bytes per second one thread hashes with the tensors' digest (best of 3, 256 MB)."""
    from qwen35_reshard.format.digest import TENSOR_DIGEST, hexdigest

    buf = memoryview(os.urandom(1 << 20) * 256)
    return len(buf) / min(_timed(lambda: hexdigest(TENSOR_DIGEST, buf)) for _ in range(3))


def _timed(fn: object) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def digest_speeds() -> None:
    """The digests considered for the loader's check, on one 512 MB buffer, against a copy of
    it in the same run (the server's work per byte); those not installed are said so."""
    import hashlib
    import importlib.util

    buf = memoryview(os.urandom(1 << 20) * 512)
    dst = bytearray(len(buf))

    def copy() -> None:
        dst[:] = buf

    candidates = {"copy (memmove): the baseline": copy, "sha256": lambda: hashlib.sha256(buf).digest()}
    found = {name: importlib.util.find_spec(name) is not None for name in ("blake3", "crc32c", "xxhash")}
    if found["blake3"]:
        import blake3

        candidates["BLAKE3, 1 thread"] = lambda: blake3.blake3(buf).digest()
        candidates["BLAKE3, 2 threads"] = lambda: blake3.blake3(buf, max_threads=2).digest()
    if found["crc32c"]:
        import crc32c

        candidates["crc32c"] = lambda: crc32c.crc32c(buf)
    if found["xxhash"]:
        import xxhash

        candidates["xxh3-128"] = lambda: xxhash.xxh3_128(buf).digest()
    speeds = {name: len(buf) / min(_timed(fn) for _ in range(3)) for name, fn in candidates.items()}
    base = speeds["copy (memmove): the baseline"]
    print(f"\n### Digests on a {len(buf) >> 20} MB buffer, best of 3\n")
    rows = [[name, f"{speed / 1e9:.1f}", f"{speed / base:.2f}x"] for name, speed in speeds.items()]
    print(table(["digest", "GB/s", "vs the copy"], rows))
    missing = [n for n, ok in found.items() if not ok]
    if missing:
        print(f"\nnot installed, not measured: {', '.join(missing)} (pip install {' '.join(missing)})")


def delivery_costs(work: Path) -> None:
    """The ways considered of getting a page-cached file's bytes to the hasher, in 16 MB jobs as
    ``stage.digestpool`` hashes them: CPU seconds per GB of one thread (median of 7, the ways
    interleaved), the file warm; the hash alone (the file mapped and faulted in before) is the floor."""
    import mmap

    from qwen35_reshard.format.digest import TENSOR_DIGEST, hexdigest

    path, job = work / "delivery.bin", 16 << 20
    path.write_bytes(os.urandom(1 << 20) * 512)
    fd = os.open(path, os.O_RDONLY)
    size = os.fstat(fd).st_size
    buf = memoryview(bytearray(4 << 20))
    whole = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    mapped = memoryview(whole)

    def faulted() -> None:  # what DigestPool did: its own mapping, MADV_WILLNEED per job
        with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as m, memoryview(m) as v:
            for at in range(0, size, job):
                m.madvise(mmap.MADV_WILLNEED, at, min(job, size - at))
                hexdigest(TENSOR_DIGEST, v[at : at + job])

    def advised() -> None:  # the same, MADV_POPULATE_READ per job: its page table filled in one call
        with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as m, memoryview(m) as v:
            for at in range(0, size, job):
                m.madvise(22, at, min(job, size - at))
                hexdigest(TENSOR_DIGEST, v[at : at + job])

    def populated() -> None:  # one mapping per job, MAP_POPULATE
        flags = mmap.MAP_SHARED | mmap.MAP_POPULATE
        for at in range(0, size, job):
            n = min(job, size - at)
            with mmap.mmap(fd, n, flags, mmap.PROT_READ, offset=at) as m, memoryview(m) as v:
                hexdigest(TENSOR_DIGEST, v)

    def read() -> None:  # preadv into one reused 4 MiB buffer: a memcpy, no page table
        for at in range(0, size, len(buf)):
            hexdigest(TENSOR_DIGEST, buf[: os.preadv(fd, [buf], at)])

    def hash_only() -> None:
        for at in range(0, size, job):
            hexdigest(TENSOR_DIGEST, mapped[at : at + job])

    ways = {
        "own mapping, faulted page by page (MADV_WILLNEED per job): before": faulted,
        "own mapping, MADV_POPULATE_READ per job: DigestPool": advised,
        "a mapping per job, MAP_POPULATE": populated,
        "os.preadv into a 4 MiB buffer": read,
        "the hash alone (bytes mapped before)": hash_only,
    }
    try:
        pages.warm([path])
        hash_only()
        cpu: dict[str, list[float]] = {name: [] for name in ways}
        for r in range(7):
            for name in list(ways)[r % len(ways) :] + list(ways)[: r % len(ways)]:
                c0 = time.thread_time()
                ways[name]()
                cpu[name].append(time.thread_time() - c0)
    finally:
        mapped.release()
        whole.close()
        os.close(fd)
        path.unlink()
    print(f"\n### Getting a warm file's bytes to {TENSOR_DIGEST}, {size >> 20} MB, one thread, median of 7\n")
    rows = [[way, f"{median(c) / size * 1e9:.3f}", f"{size / median(c) / 1e9:.1f}"] for way, c in cpu.items()]
    print(table(["way", "CPU s per GB", "GB/s"], rows))


def main(argv: list[str], trees: list[Tree]) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks loader", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="large,many", help="large, many (see above) or tiny (a check)")
    ap.add_argument(
        "--size", type=float, default=1.12e9, help="the large checkpoint's bytes (default 1.12e9)"
    )
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--rank", type=int, default=0, help="the stage that is loaded")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--workers", type=int, default=1, help="processes loading the stage at once (a node's TP)"
    )
    ap.add_argument("--cache", default="warm", help="warm, cold or both (cold needs root)")
    ap.add_argument("--workdir", type=Path, default=None, help="parent of the temporary work directory")
    ap.add_argument("--digests", action="store_true", help="first measure the digests considered")
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
        if args.digests:
            digest_speeds()
            delivery_costs(work)
        for shape in args.shapes.split(","):
            measure(shape, work, args, trees, caches)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0
