"""What each pipeline rank of a real server reads and holds when it loads: the whole checkpoint
through the server's stock loader, against its own stage of a qwen35-reshard split.

Run by hand, as root (the page cache is dropped before every start), not as a test:

    python -m benchmarks server_load --quick     # 0.25 GB, pp=2, 1 round: a check (5-10 min)
    python -m benchmarks server_load             # 2.2 GB, pp=2 and pp=4, 3 rounds: the numbers
    python -m benchmarks server_load --report saved.json   # the tables of a --save file

This tree only (the servers' environments hold their own install); their workers run this file.

It builds a synthetic Qwen3.5 MoE checkpoint with the real tensor names (examples/tiny_checkpoint.py:
many layers, small dimensions, per-expert BF16 experts, MTP and a vision tower; linear-attention
head dims of 128 and bf16, as vLLM's CPU kernels need), splits it with qwen35-reshard for every
server and pp, and then, in interleaved rounds, starts:

- vLLM (``--vllm-python``, the environment .ci/vllm/build-venv.sh builds): one real engine per
  start, ``LLM(model, pipeline_parallel_size=pp, ...)`` on CPU, with the stock loader
  (``load_format="auto"``) on the whole checkpoint and with ``load_format="qwen35-stages"`` on
  the split. In every worker process a probe wraps the CPU model runner's ``load_model`` (model
  build plus weight load; both loaders run inside it) and records the worker's ``/proc/self/io``
  ``read_bytes`` and wall clock before and after, and its ``VmHWM`` after. Once every worker has
  loaded, the engine is stopped: what comes after (compilation, KV cache) is the same for both.
- SGLang (``--sglang-python``, .ci/sglang/build-venv.sh): SGLang's engine does not start on a
  CPU here, so one process per rank sets up SGLang's parallel context for that rank (as SGLang's
  own tests do) and runs SGLang's ``DefaultModelLoader.load_model`` on the whole checkpoint and
  on ``OUT/ppR`` (the stock loader on a stage directory), one rank at a time.

Bytes read from the checkpoint files are measured as page-cache residency (``mincore``) of every
checkpoint file after a load that started with none of them cached. That is per worker only if
the worker loads alone: vLLM's stock workers read the same files at the same time and share the
page cache, so ``read_bytes`` charges each page to whichever worker faults it first and says
little about what each worker reads. Each vLLM configuration is therefore started as it runs
in every round (times, peak RSS, ``read_bytes``, residency of the union) and, in the first
``--alone-rounds`` rounds, once more with the workers' ``load_model`` calls serialised by a
lock, the checkpoint's pages evicted before each (``posix_fadvise(DONTNEED)``, checked with
``mincore``), and residency measured before the lock is released: the bytes that worker brings
in by itself. SGLang's ranks run alone anyway (in the first ``--sglang-rounds`` rounds).
``read_bytes`` also counts what the process reads outside the checkpoint in that window (Python
modules imported while the model is built), so it is printed beside residency, not instead.

Medians over ``--rounds``, ratios split / stock from the same run. Disk: the checkpoint plus one
split per server and pp (about 5x ``--size``), under ``--workdir``, deleted unless ``--keep``.
"""

from __future__ import annotations

import argparse
import datetime
import fcntl
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# The servers' interpreters run this file as a script: benchmarks.lib's helpers (stdlib only) from here.
sys.path.insert(0, str(REPO))
from benchmarks.lib.pages import evict, resident_bytes  # noqa: E402
from benchmarks.lib.procs import io_read_bytes as read_bytes  # noqa: E402
from benchmarks.lib.procs import stop_session as stop  # noqa: E402
from benchmarks.lib.procs import vm_hwm as peak_rss  # noqa: E402

BUILDER = REPO / "examples" / "tiny_checkpoint.py"
PROBE_ENV = "QWEN35_BENCH_SERVER_PROBE"
# hidden 512 gives linear-attention head dims of 128 (examples/tiny_checkpoint.py's rules), the
# only size vLLM's CPU Gated DeltaNet kernel takes (docs: vllm-cpu-notes); experts grow to --size.
DIMS = {"hidden": 512, "moe_intermediate": 128, "vocab": 8192, "layout": "per_expert"}
ENGINE_TIMEOUT = 1200  # s, one engine start on a loaded 2-core machine


# --------------------------------------------------------------------------- vLLM side


def install_vllm_probe(spec: dict) -> None:
    """Wrap vLLM's CPU model runner ``load_model`` (in every process: forked workers inherit it)
    to append one JSON line per worker to ``spec["records"]``; with ``spec["alone"]`` the calls
    are serialised and each starts with the checkpoint evicted from the page cache."""
    from vllm.v1.worker import cpu_model_runner

    original = cpu_model_runner.CPUModelRunner.load_model

    def load_model(self, *args, **kwargs):
        from vllm.distributed import get_pp_group

        with open(spec["lock"], "a") as lock:
            if spec["alone"]:
                fcntl.flock(lock, fcntl.LOCK_EX)
                evict(spec["files"])
            io0, t0 = read_bytes(), time.time()
            result = original(self, *args, **kwargs)
            t1, io1 = time.time(), read_bytes()
            record = {
                "pid": os.getpid(),
                "rank": get_pp_group().rank_in_group,
                "t_enter": t0,
                "t_exit": t1,
                "read_bytes": io1 - io0,
                "peak_rss": peak_rss(),
                "resident": resident_bytes(spec["files"]) if spec["alone"] else None,
            }
            with open(spec["records"], "a") as out:
                out.write(json.dumps(record) + "\n")
        return result

    cpu_model_runner.CPUModelRunner.load_model = load_model


def vllm_child(spec: dict) -> None:
    """One engine start (the probe is already installed); it is stopped from outside."""
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # one NUMA node here
    from vllm import LLM

    sys.path.insert(0, str(REPO / "tests"))
    from support.vllm_generate import CPU_ENGINE  # the engine tests' settings, not a copy

    LLM(
        model=spec["model"],
        load_format=spec["load_format"],
        pipeline_parallel_size=spec["pp"],
        **CPU_ENGINE,
    )


# --------------------------------------------------------------------------- SGLang side


def sglang_child(spec: dict) -> None:
    """Load one rank with SGLang's stock loader and print one ``RESULT`` JSON line."""
    from types import SimpleNamespace

    import torch
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import get_model_loader
    from sglang.srt.runtime_context import SpawnRanks, get_parallel
    from sglang.srt.server_args import ServerArgs
    from sglang.test.parallel_groups import publish

    pp, rank = spec["pp"], spec["rank"]
    # The context SGLang's own tests set up for one rank; the pipeline group is the stand-in
    # they install (SGLang's model code reads these four fields).
    args = ServerArgs(model_path=spec["model"], pp_size=pp, device="cpu", disable_radix_cache=True)
    publish(args, role="test", ranks=SpawnRanks(world_rank=rank))
    group = SimpleNamespace(
        rank_in_group=rank, world_size=pp, is_first_rank=rank == 0, is_last_rank=rank == pp - 1
    )
    get_parallel().override_permanently(pp_group=group)
    config = ModelConfig(spec["model"])
    model_loader = get_model_loader(LoadConfig(load_format="auto"), config)
    io0, t0 = read_bytes(), time.time()
    model = model_loader.load_model(model_config=config, device_config=DeviceConfig("cpu"))
    t1, io1 = time.time(), read_bytes()
    record = {
        "pid": os.getpid(),
        "rank": rank,
        "t_enter": t0,
        "t_exit": t1,
        "read_bytes": io1 - io0,
        "peak_rss": peak_rss(),
        "resident": resident_bytes(spec["files"]),
        "loader": type(model_loader).__name__,
        "layers": [model.start_layer, model.end_layer],
        "params": sum(p.numel() for p in model.parameters()),
        "torch_threads": torch.get_num_threads(),
    }
    print("RESULT " + json.dumps(record), flush=True)


# --------------------------------------------------------------------------- driver


def drop_caches(files: list[str], how: str) -> None:
    """Before a start: write back and drop the whole page cache, or evict only the checkpoint."""
    if how == "drop":
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    evict(files)  # after a drop too: it checks that nothing of the checkpoint is left


def run_vllm(
    python: str,
    model: Path,
    pp: int,
    load_format: str,
    files: list[str],
    alone: bool,
    work: Path,
    cache: str,
    tag: str,
) -> dict:
    """One engine start; per-worker records, union residency, and the log on failure."""
    records, lock, log = work / f"{tag}.jsonl", work / f"{tag}.lock", work / f"{tag}.log"
    spec = {
        "model": str(model),
        "pp": pp,
        "load_format": load_format,
        "files": files,
        "alone": alone,
        "records": str(records),
        "lock": str(lock),
    }
    records.unlink(missing_ok=True)
    drop_caches(files, cache)
    env = {**os.environ, PROBE_ENV: json.dumps(spec)}
    env.pop("VLLM_PP_LAYER_PARTITION", None)  # vLLM's own split, the one the splits were made for
    t_start = time.time()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [python, __file__, "--vllm-child"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=work,
            start_new_session=True,
        )
    try:
        while True:
            done = records.read_text().splitlines() if records.exists() else []
            if len(done) == pp:
                break
            if proc.poll() is not None or time.time() - t_start > ENGINE_TIMEOUT:
                tail = "\n".join(log.read_text().splitlines()[-30:])
                raise RuntimeError(
                    f"vLLM start {tag} ended before every worker loaded (exit {proc.returncode}):\n{tail}"
                )
            time.sleep(0.2)
        union = resident_bytes(files)
    finally:
        stop(proc)
    workers = sorted((json.loads(line) for line in done), key=lambda r: r["rank"])
    for w in workers:
        w["since_start"] = w["t_exit"] - t_start
        w["load_s"] = w["t_exit"] - w["t_enter"]
    return {"workers": workers, "union": union}


def run_sglang(
    python: str, model: Path, pp: int, rank: int, files: list[str], work: Path, cache: str
) -> dict:
    """One rank in one process, alone."""
    spec = {"model": str(model), "pp": pp, "rank": rank, "files": files}
    drop_caches(files, cache)
    t_start = time.time()
    proc = subprocess.run(
        [python, __file__, "--sglang-child", json.dumps(spec)],
        capture_output=True,
        text=True,
        cwd=work,
        timeout=ENGINE_TIMEOUT,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
        raise RuntimeError(
            f"SGLang rank {rank} of pp={pp} on {model} failed (exit {proc.returncode}):\n{tail}"
        )
    record = json.loads(lines[-1][len("RESULT ") :])
    record["since_start"] = record["t_exit"] - t_start
    record["load_s"] = record["t_exit"] - record["t_enter"]
    return record


def weight_files(directory: Path) -> list[str]:
    return sorted(str(p) for p in directory.rglob("*.safetensors"))


def build(work: Path, size: float, layers: int) -> tuple[Path, dict]:
    """The checkpoint: DIMS, ``layers`` layers, as many experts as it takes to reach ``size``."""
    sys.path.insert(0, str(BUILDER.parent))
    from tiny_checkpoint import describe_model, nbytes

    def total(experts: int) -> int:
        return sum(map(nbytes, describe_model(layers=layers, experts=experts, **DIMS)[1]))

    experts = 2
    while total(experts) < size:
        experts += 2
    kwargs = {**DIMS, "layers": layers, "experts": experts, "shard_bytes": max(int(size) // 16, 16 << 20)}
    model = work / "model"
    cmd = [sys.executable, str(BUILDER), str(model)]
    for key, value in kwargs.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return model, kwargs


def split(model: Path, out: Path, pp: int, runtime: str) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "qwen35_reshard",
            "split",
            "--pp",
            str(pp),
            "--runtime",
            runtime,
            "-q",
            str(model),
            str(out),
        ],
        check=True,
        stdout=subprocess.DEVNULL,
        cwd=REPO,
    )


def default_python(env: str, venv: str) -> str:
    for candidate in (
        os.environ.get(env),
        REPO / venv / "bin" / "python",
        Path("/work/main") / venv / "bin" / "python",
    ):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    return ""


QUICK = ["--quick"]
BEFORE = False


def main(argv: list[str] | None = None, trees: object = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks server_load",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--quick", action="store_true", help="a check: --size 2.5e8 --layers 16 --pp 2 --rounds 1"
    )
    ap.add_argument("--size", type=float, default=2.2e9, help="checkpoint bytes (default 2.2e9)")
    ap.add_argument("--layers", type=int, default=64, help="decoder layers (default 64)")
    ap.add_argument("--pp", default="2,4", help="pipeline sizes (default 2,4)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument(
        "--alone-rounds",
        type=int,
        default=1,
        help="of the rounds, how many also start each vLLM engine with its workers loading alone, "
        "for the bytes (default 1: they do not vary)",
    )
    ap.add_argument(
        "--sglang-rounds", type=int, default=1, help="of the rounds, how many run SGLang (default 1)"
    )
    ap.add_argument("--servers", default="vllm,sglang", help="vllm, sglang or both (default)")
    ap.add_argument(
        "--cache",
        choices=("drop", "evict"),
        default="drop",
        help="before every start: drop the whole page cache (root; default) or evict only the "
        "checkpoint's files (posix_fadvise DONTNEED)",
    )
    ap.add_argument(
        "--vllm-python",
        default=default_python("QWEN35_RESHARD_VLLM_PYTHON", ".venv-vllm"),
        help="python of the vLLM CPU environment (default: $QWEN35_RESHARD_VLLM_PYTHON or .venv-vllm)",
    )
    ap.add_argument(
        "--sglang-python",
        default=default_python("QWEN35_RESHARD_SGLANG_PYTHON", ".venv-sglang"),
        help="python of the SGLang environment (default: $QWEN35_RESHARD_SGLANG_PYTHON or .venv-sglang)",
    )
    ap.add_argument("--workdir", type=Path, default=None, help="parent of the temporary work directory")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint, the splits and the logs")
    ap.add_argument("--save", type=Path, help="write every measurement to this JSON file as it is made")
    ap.add_argument(
        "--report", type=Path, metavar="SAVED", help="print the report of a --save file, run nothing"
    )
    ap.add_argument("--vllm-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--sglang-child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.vllm_child:
        vllm_child(json.loads(os.environ[PROBE_ENV]))
        return 0
    if args.sglang_child:
        sglang_child(json.loads(args.sglang_child))
        return 0
    from benchmarks.lib.server_tables import gb, report

    if args.report:
        report(json.loads(args.report.read_text()))
        return 0
    if args.quick:
        args.size, args.layers, args.pp, args.rounds = 2.5e8, 16, "2", 1
    pps = [int(p) for p in args.pp.split(",")]
    servers = [s for s in args.servers.split(",") if s]
    pythons = {"vllm": args.vllm_python, "sglang": args.sglang_python}
    for server in servers:
        if not pythons[server]:
            ap.error(f"no python for {server}: pass --{server}-python (see its .ci/{server}/build-venv.sh)")
    if args.cache == "drop" and os.geteuid() != 0:
        ap.error("--cache drop needs root (it writes /proc/sys/vm/drop_caches); use --cache evict")

    t_begin = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="bench-server-load-", dir=args.workdir))
    try:
        model, kwargs = build(work, args.size, args.layers)
        outs = {}
        for server in servers:
            for pp in pps:
                outs[(server, pp)] = work / f"{server}-pp{pp}"
                split(model, outs[(server, pp)], pp, server)
        whole = weight_files(model)
        results: dict = {
            "meta": {
                "stamp": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                "host": f"{platform.node()} ({os.cpu_count()} cores)",
                "kwargs": kwargs,
                "files": len(whole),
                "checkpoint_bytes": sum(
                    os.path.getsize(f) for f in whole
                ),  # headers too, as residency counts
                "stage_bytes": {
                    f"{server}/{pp}": [
                        sum(os.path.getsize(f) for f in weight_files(out / f"pp{k}")) for k in range(pp)
                    ]
                    for (server, pp), out in outs.items()
                },
                "rounds": args.rounds,
                "cache": args.cache,
                "pp": pps,
                "servers": servers,
            },
            "vllm": {},
            "sglang": {},
        }

        def keep(server: str, key: str, value: dict) -> None:
            results[server].setdefault(key, []).append(value)
            results["meta"]["seconds"] = time.monotonic() - t_begin
            if args.save:
                args.save.write_text(json.dumps(results))

        for r in range(args.rounds):
            for server in servers:
                for pp in pps:
                    methods = ["stock", "split"] if (r + pp) % 2 == 0 else ["split", "stock"]
                    for method in methods:
                        out = outs[(server, pp)]
                        src = model if method == "stock" else out
                        files = weight_files(src)
                        if server == "vllm":
                            fmt = "auto" if method == "stock" else "qwen35-stages"
                            for alone in (False, True) if r < args.alone_rounds else (False,):
                                tag = f"vllm-pp{pp}-{method}-{'alone' if alone else 'run'}-r{r}"
                                run = run_vllm(
                                    pythons["vllm"], src, pp, fmt, files, alone, work, args.cache, tag
                                )
                                keep("vllm", f"{pp}/{method}/{'alone' if alone else 'run'}", run)
                                print(
                                    f"  {tag}: "
                                    + ", ".join(
                                        f"PP{w['rank']} {w['since_start']:.1f} s, {gb(w['read_bytes'])} GB"
                                        + (f" {gb(w['resident'])} GB resident" if alone else "")
                                        for w in run["workers"]
                                    ),
                                    file=sys.stderr,
                                    flush=True,
                                )
                        elif r < args.sglang_rounds:
                            for rank in range(pp):
                                path = src if method == "stock" else out / f"pp{rank}"
                                rank_files = files if method == "stock" else weight_files(path)
                                rec = run_sglang(
                                    pythons["sglang"], path, pp, rank, rank_files, work, args.cache
                                )
                                keep("sglang", f"{pp}/{method}/{rank}", rec)
                                print(
                                    f"  sglang-pp{pp}-{method}-rank{rank}-r{r}: {rec['load_s']:.2f} s, "
                                    f"{gb(rec['resident'])} GB resident",
                                    file=sys.stderr,
                                    flush=True,
                                )
        report(results)
    finally:
        if args.keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if os.environ.get(PROBE_ENV) and __name__ in ("__main__", "__mp_main__"):
    install_vllm_probe(json.loads(os.environ[PROBE_ENV]))

if __name__ == "__main__":
    sys.exit(main())
