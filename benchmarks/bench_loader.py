"""Benchmark the loader shim against ``safetensors.safe_open(..., framework="pt")`` on the same files.

Run by hand, not as a test. It builds synthetic checkpoints (examples/tiny_checkpoint.py) of two
shapes (``--shapes``), splits each with qwen35-reshard, and then streams one stage's tensors, for
``--rounds`` rounds in interleaved order, three ways. The shapes:

- ``large``: the Qwen3.5-35B-A3B structure (preset qwen3.5-35b-a3b-scaled) at ``--size`` bytes:
  a few hundred large tensors a stage, where bytes dominate;
- ``many``: per-expert FP8 weights with a scale each, 512 experts x 32 layers, small dimensions:
  ~49,500 tensors in stage 0 of pp=2, as many as a stage of the 397B FP8 checkpoint at pp=4, so
  that the per-tensor cost dominates.

The three ways:

- ``safe_open``: what a stock loader does with the stage's files: ``safe_open(file,
  framework="pt")`` per file, ``get_tensor(name)`` for every name in it;
- ``shim unchecked``: ``loader.open_stage(OUT, pp_rank=R).iter_weights(verify=False)`` (opening
  and checking the stage included; what ``QWEN35_RESHARD_VERIFY_LOAD=0`` does);
- ``shim checked``: the same with every byte checked against its digest (xxh3-128) while it
  is loaded, hashed in threads beside the copy (the default), by the first loader of the node
  (an empty node record, ``stage.nodechecks``);
- ``checked, 2nd worker``: the same as another worker of the node loads it (tensor
  parallelism: every worker of a node loads the stage): the first worker's record of the
  files it checked is used, nothing is hashed again;
- ``checked, no spare core``: the first loader with a node budget of no hashing threads
  (``QWEN35_RESHARD_HASH_THREADS=0``): the copying thread hashes too, as on a node whose cores
  are all busy. What the check costs where it cannot hide behind the copy.

The cost of the check is printed as a ratio, checked over unchecked, from the same rounds
(issue 43's goal: checked >= 0.9x of ``safe_open``, warm), and then what it costs where it
cannot hide (few cores, a very fast disk), on this machine and for a GPU node. ``--digests``
first measures the digests considered (sha256, BLAKE3 on 1 and 2 threads, crc32c, xxh3-128)
on one buffer, against a copy of the same buffer in the same run.

Each tensor is copied into a tensor of its shape and dtype allocated before the timing starts,
as a model's ``load_weights`` copies into its parameters. With ``--cache cold`` (root only) the
page cache is written back and dropped before every run; with ``warm`` the stage's files are
read once before every run. Medians are reported, with each method's speed relative to
``safe_open`` measured in the same run: the ratio of the medians, and the median of each
round's own ratio (steadier on a machine whose speed drifts).

    python benchmarks/bench_loader.py                          # both shapes, 2 GB large, pp=2, 5 rounds
    python benchmarks/bench_loader.py --size 5e8 --rounds 3    # quick look
    python benchmarks/bench_loader.py --shapes many --cache warm --rounds 7
    python benchmarks/bench_loader.py --digests --size 1.1e9 --cache warm   # issue 43's run
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from qwen35_reshard import loader, make_plan, read_checkpoint, write_plan  # noqa: E402
from qwen35_reshard.format.digest import TENSOR_DIGEST, hexdigest  # noqa: E402
from qwen35_reshard.format.dtypes import DTYPES  # noqa: E402
from qwen35_reshard.stage.nodechecks import CHECKED_DIR_ENV, HASH_THREADS_ENV  # noqa: E402

BUILDER = REPO / "examples" / "tiny_checkpoint.py"


def read_safe_open(stage_dir: Path, files: list[str], dst: dict) -> int:
    n = 0
    for file in files:
        with safe_open(stage_dir / file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                dst[name].copy_(f.get_tensor(name))
                n += 1
    return n


def read_shim(out: Path, rank: int, dst: dict, verify: bool, env: dict[str, str] | None = None) -> int:
    """The shim's load, with ``env`` set meanwhile (the node record's directory, its budget)."""
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        n = 0
        for name, tensor in loader.open_stage(out, pp_rank=rank).iter_weights(verify=verify):
            dst[name].copy_(tensor)
            n += 1
        return n
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def first_on_node(work: Path, threads: int | None = None) -> dict[str, str]:
    """The environment of a node's first loader: an empty record (``threads``: the node's budget)."""
    env = {CHECKED_DIR_ENV: tempfile.mkdtemp(dir=work) + "/node"}
    return env if threads is None else {**env, HASH_THREADS_ENV: str(threads)}


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


BLKIO = Path("/sys/fs/cgroup/blkio")  # cgroup v1's block I/O controller


@contextmanager
def read_rate(work: Path, rate: int | None) -> Iterator[None]:
    """Within: this process reads the disk holding ``work`` at most ``rate`` bytes/s (a blkio
    cgroup of its own; root, cgroup v1), a disk slower than this machine's, for the cold
    rounds. Buffered reads and page faults are throttled where they wait for the disk."""
    if rate is None:
        yield
        return
    st = os.stat(work)
    group = BLKIO / f"bench-loader-{os.getpid()}"
    group.mkdir()
    try:
        device = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
        (group / "blkio.throttle.read_bps_device").write_text(f"{device} {rate}\n")
        (group / "cgroup.procs").write_text(f"{os.getpid()}\n")  # every thread of it
        yield
    finally:
        (BLKIO / "cgroup.procs").write_text(f"{os.getpid()}\n")
        group.rmdir()


def warm(paths: list[Path]) -> None:
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.read(1 << 24):
                pass


# The "many" shape: per-expert FP8 (a weight and its scale per Linear), small dimensions.
MANY_TENSORS = [
    "--layout", "per_expert_fp8", "--layers", "32", "--experts", "512", "--hidden", "64",
    "--moe-intermediate", "32", "--vocab", "256", "--no-vision", "--shard-bytes", "20000000",
]  # fmt: skip


def build(shape: str, model: Path, size: float) -> None:
    scaled = ["--preset", "qwen3.5-35b-a3b-scaled", "--target-bytes", str(int(size))]
    extra = MANY_TENSORS if shape == "many" else scaled
    subprocess.run([sys.executable, str(BUILDER), str(model), *extra], check=True, stdout=subprocess.DEVNULL)


def rounds(
    methods: dict, caches: list[str], files: list[Path], tensors: int, n: int, times: dict, cpu: dict
) -> None:
    """``n`` rounds of every method on every cache, in rotated order: wall and CPU seconds."""
    for r in range(n):
        for cache in caches:
            order = list(methods)
            order = order[r % len(order):] + order[: r % len(order)]  # rotate: no fixed first
            for name in order:
                if cache == "cold":
                    drop_caches()
                else:
                    warm(files)
                t0, c0 = time.perf_counter(), time.process_time()
                count = methods[name]()
                times.setdefault((cache, name), []).append(time.perf_counter() - t0)
                cpu.setdefault((cache, name), []).append(time.process_time() - c0)  # all threads
                assert count == tensors, (name, count, tensors)


def measure(shape: str, work: Path, args: argparse.Namespace, caches: list[str]) -> None:
    model, out = work / f"model-{shape}", work / f"out-{shape}"
    build(shape, model, args.size)
    write_plan(make_plan(read_checkpoint(model), pp=args.pp, runtime="vllm"), out)
    stage = loader.open_stage(out, pp_rank=args.rank)
    files = [stage.path / f for f in stage.files]
    nbytes = stage.nbytes
    dst = {
        name: torch.empty(t.shape, dtype=getattr(torch, DTYPES[t.dtype][1]))
        for name, t in stage.tensors.items()
    }
    for t in dst.values():
        t.fill_(0)  # fault the destination in once, as a built model's parameters are

    # The node whose first worker checked the stage already (untimed, here and now).
    second = {CHECKED_DIR_ENV: str(work / f"node-{shape}")}
    read_shim(out, args.rank, dst, verify=True, env=second)
    methods = {
        "safe_open": lambda: read_safe_open(stage.path, list(stage.files), dst),
        "shim unchecked": lambda: read_shim(out, args.rank, dst, verify=False),
        "shim checked": lambda: read_shim(out, args.rank, dst, verify=True, env=first_on_node(work)),
        "checked, 2nd worker": lambda: read_shim(out, args.rank, dst, verify=True, env=second),
        "checked, no spare core": lambda: read_shim(
            out, args.rank, dst, verify=True, env=first_on_node(work, threads=0)
        ),
        "open_stage": lambda: len(loader.open_stage(out, pp_rank=args.rank)),
    }
    times: dict[tuple[str, str], list[float]] = {}
    cpu: dict[tuple[str, str], list[float]] = {}
    with read_rate(work, args.read_rate):
        rounds(methods, caches, files, len(stage), args.rounds, times, cpu)
    disk = f", the disk read at most {args.read_rate / 1e6:.0f} MB/s" if args.read_rate else ""
    what = f"a {args.size / 1e9:.2f} GB checkpoint" if shape == "large" else "a per-expert FP8 checkpoint"
    print(
        f"### Shape {shape}: stage {args.rank} of a pp={args.pp} split of {what}: {len(stage)} tensors, "
        f"{nbytes / 1e9:.3f} GB in {len(files)} files{disk}; median of {args.rounds} interleaved rounds, "
        "each tensor copied into a preallocated tensor.\n"
    )
    print("| cache | method | median s | GB/s | speed vs safe_open (medians) | same, median of rounds |")
    print("|---|---|---:|---:|---:|---:|")
    for cache in caches:
        base = times[(cache, "safe_open")]
        for name in methods:
            ts = times[(cache, name)]
            med = statistics.median(ts)
            paired = statistics.median(b / t for b, t in zip(base, ts, strict=True))  # per round
            print(
                f"| {cache} | {name} | {med:.3f} | {nbytes / med / 1e9:.2f} | "
                f"{statistics.median(base) / med:.2f}x | {paired:.2f}x |"
            )
    print(
        "\n| cache | checked / unchecked (medians) | same, median of rounds | extra s (medians) "
        "| CPU s unchecked | CPU s checked |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for cache in caches:
        on, off = times[(cache, "shim checked")], times[(cache, "shim unchecked")]
        paired = statistics.median(a / b for a, b in zip(on, off, strict=True))
        on_s, off_s = statistics.median(on), statistics.median(off)
        ratio, extra = on_s / off_s, on_s - off_s
        cpu_off, cpu_on = (statistics.median(cpu[(cache, m)]) for m in ("shim unchecked", "shim checked"))
        print(f"| {cache} | {ratio:.2f}x | {paired:.2f}x | {extra:+.3f} | {cpu_off:.2f} | {cpu_on:.2f} |")
    check_cost(times, caches, nbytes, len(stage))
    print(
        "\n`open_stage` alone opens and checks the stage (manifest, index, config, schema and "
        "placement, headers; no tensor data), which the shim's time includes.\n"
    )
    for (cache, name), ts in times.items():
        print(f"{cache:5} {name:14} runs: {', '.join(f'{t:.3f}' for t in ts)}")
    print()


def check_cost(times: dict, caches: list[str], nbytes: int, tensors: int) -> None:
    """Where the check cannot hide behind the copy: its cost with no spare core, measured, and
    what follows for a GPU node, from this machine's digest speed."""
    rate = digest_rate()
    print(
        f"\nWhere the check costs more than the copy. It needs a core at {rate / 1e9:.0f} GB/s "
        f"({TENSOR_DIGEST}, one thread on this machine, ~{1e9 / rate * 1e3:.0f} ms of a core per GB) "
        "beside the copy; it is hidden while a core is free for it and the hashing outruns the reader."
    )
    for cache in caches:
        off = statistics.median(times[(cache, "shim unchecked")])
        busy = statistics.median(times[(cache, "checked, no spare core")])
        second = statistics.median(times[(cache, "checked, 2nd worker")])
        print(
            f"- {cache}, {nbytes / 1e9:.2f} GB, {tensors} tensors: with no spare core (the copying thread "
            f"hashes too) the check adds {busy - off:+.3f} s ({busy / off:.2f}x unchecked); a 2nd worker of "
            f"the node, whose bytes the 1st checked, {second / off:.2f}x unchecked."
        )
    per_gb = 1e9 / rate
    print(
        f"- A GPU node (64+ cores, 8 workers with TP=8, NVMe at ~7 GB/s or 25+ GB/s striped): each byte "
        f"is hashed once per node by whichever worker reaches it first, in at most 8 threads for the "
        f"node (QWEN35_RESHARD_HASH_THREADS), so a 100 GB stage costs ~{100 * per_gb:.1f} core-seconds "
        f"in all, against 4+ s for the disk to read it: hidden. It shows only where no core is free "
        f"(every core pinned to a worker's own threads): then up to {per_gb * 10:.2f} s per 10 GB on "
        "a worker's own thread, as in the no-spare-core row."
    )


def digest_rate() -> float:
    """Bytes per second one thread hashes with the tensors' digest (best of 3, 256 MB)."""
    buf = memoryview(os.urandom(1 << 20) * 256)
    best = min(_timed(lambda: hexdigest(TENSOR_DIGEST, buf)) for _ in range(3))
    return len(buf) / best


def _timed(fn: object) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def digest_speeds() -> None:
    """The digests considered for the loader's check, on one 512 MB buffer, against a copy of
    it in the same run (the server's work per byte); packages not installed are said so."""
    import hashlib
    import importlib

    buf = memoryview(os.urandom(1 << 20) * 512)
    dst = bytearray(len(buf))

    def copy() -> None:
        dst[:] = buf

    candidates = {"copy (memmove, the baseline)": copy, "sha256": lambda: hashlib.sha256(buf).digest()}
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
    base = speeds["copy (memmove, the baseline)"]
    print(f"### Digests on a {len(buf) >> 20} MB buffer, best of 3, one call each\n")
    print("| digest | GB/s | vs the copy |")
    print("|---|---:|---:|")
    for name, speed in speeds.items():
        print(f"| {name} | {speed / 1e9:.1f} | {speed / base:.2f}x |")
    missing = [n for n, ok in found.items() if not ok]
    if missing:
        print(f"\nnot installed, not measured: {', '.join(missing)} (pip install {' '.join(missing)})")
    print()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="large,many", help="large, many or both (see above)")
    ap.add_argument("--size", type=float, default=2e9, help="the large checkpoint's bytes (default 2e9)")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--rank", type=int, default=0, help="the stage that is loaded")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cache", default="warm,cold", help="warm, cold or both (cold needs root)")
    ap.add_argument(
        "--read-rate", type=float, default=None,
        help="bytes/s the disk is read at, at most (root, cgroup v1 blkio): a disk slower than hashing",
    )  # fmt: skip
    ap.add_argument("--workdir", type=Path, default=None, help="parent of the temporary work directory")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints and the splits")
    ap.add_argument("--digests", action="store_true", help="first measure the digests considered")
    args = ap.parse_args()
    args.read_rate = int(args.read_rate) if args.read_rate else None
    caches = [c for c in args.cache.split(",") if c]
    if "cold" in caches and os.geteuid() != 0:
        print("cold cache needs root (to drop the page cache): measuring warm only", file=sys.stderr)
        caches = [c for c in caches if c != "cold"]

    work = Path(tempfile.mkdtemp(prefix="bench-loader-", dir=args.workdir))
    try:
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        print(
            f"## Loader read speed, {stamp}, {platform.node()} ({os.cpu_count()} cores), "
            f"torch {torch.__version__}, load average {os.getloadavg()[0]:.1f} (the machine is shared: "
            "checked and unchecked rounds are interleaved, compared round by round)\n"
        )
        if args.digests:
            digest_speeds()
        for shape in args.shapes.split(","):
            measure(shape, work, args, caches)
    finally:
        if args.keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
