"""Time follows bytes: one node's stage and a whole split fetched from a Hub repo id, against
huggingface_hub's own download, over a server paced like a wide-area link. One run, ratios
against the baseline measured in the same run.

``tests/support/hub_server.py`` (a real HTTP server on 127.0.0.1 with a CDN origin) serves a
checkpoint with the Qwen3.5-35B-A3B structure (fused experts) scaled to ``--size`` and
``--layers``; each link setting paces every connection (a rate in bytes/s, a wait before each
answer). Every command runs in a fresh process with a fresh ``HF_HOME``:

- stock: ``huggingface_hub.snapshot_download(REPO)`` with its defaults (what vLLM and SGLang
  do on every node);
- one node's stage: ``qwen35-reshard --pp 4 --rank 1 REPO OUT``;
- a whole split from the repo id: ``qwen35-reshard --pp 4 REPO OUT``;
- each of ours also with ``--before PATH``: the same commands run from another checkout
  (``git worktree add /tmp/old-main <commit>``), the "before".

Bytes are the body bytes the server sent, requests the requests it answered; time is the
process's wall time; RSS its peak (``wait4``). The ratio is (time ours / time stock) / (bytes ours
/ bytes stock): 1.0 means time follows bytes. ``--serve`` adds the servers' in-server path
(``server_stage`` for rank 1): disk used by the node (HF cache + stage cache) after it.

    flock /tmp/heavy.lock python benchmarks/remote_fetch.py --before /tmp/old-main
    python benchmarks/remote_fetch.py --size 1e8 --links 10e6:0.03
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "examples")]

import tiny_checkpoint  # noqa: E402

from support.hub_server import HubServer  # noqa: E402

REPO = "Qwen/Scaled"
PP = 4

STOCK = """
import sys
from huggingface_hub import snapshot_download
snapshot_download(sys.argv[1])
"""

SERVE = """
import sys
try:
    from qwen35_reshard.servers.unsplit import server_stage
except ImportError:  # before the servers' folder
    from qwen35_reshard.serve import server_stage
partition = [int(x) for x in sys.argv[3].split(",")]
try:  # the layout object (issue 44), else the settings one by one
    from qwen35_reshard.model.parallelism import Parallelism
    given = ((Parallelism(pp=len(partition), partition=tuple(partition)),), {})
except ImportError:
    given = ((), {"runtime": "sglang", "partition": partition})
served = server_stage(sys.argv[1], *given[0], rank=int(sys.argv[2]), **given[1])
print(served.how)
"""


Measure = tuple[float, int, int, int]  # seconds, body bytes, requests, peak RSS (bytes)


def run(argv: list[str], *, hub: HubServer, node: Path, code: Path) -> Measure:
    """Seconds, body bytes, requests, peak RSS (bytes) of one command in a fresh process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "QWEN35_"))}
    env.update(
        PYTHONPATH=str(code), HF_HOME=str(node / "hf"), HF_ENDPOINT=hub.url, HF_HUB_DISABLE_XET="1",
        HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_PROGRESS_BARS="1",
        QWEN35_RESHARD_STAGE_CACHE=str(node / "stages"),
    )  # fmt: skip
    hub.clear_log()
    started = time.perf_counter()
    # In the node's directory: `python -m` puts the working directory first on the path.
    proc = subprocess.Popen(argv, env=env, cwd=node, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - started
    err = proc.stderr.read().decode()
    proc.stderr.close()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed:\n{err}")
    log = hub.log
    return seconds, sum(e.sent for e in log), len(log), usage.ru_maxrss * 1024


def du(path: Path) -> int:
    """Bytes of disk the files under ``path`` use (blocks, so a hard link or a hole counts once)."""
    seen, total = set(), 0
    for p in path.rglob("*"):
        st = p.lstat()
        if p.is_file() and not p.is_symlink() and (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total


def mb(n: float) -> str:
    return f"{n / 1e6:.0f} MB"


def link_name(rate: float, latency: float) -> str:
    if not rate:
        return "unpaced loopback"
    return f"{rate / 1e6:g} MB/s per connection + {latency * 1e3:g} ms per request"


def row(link: str, what: str, code: str, got: Measure, stock: Measure) -> None:
    """One line of the table: ``got`` against ``stock`` (seconds, bytes, requests, peak RSS)."""
    s, b, r, m = got
    cells = [link, what, code, mb(b), f"{s:.1f}", str(r), f"{r / b * 1e9:.0f}", mb(m), f"{s / stock[0]:.2f}",
             f"{(s / stock[0]) / (b / stock[1]):.2f}"]  # fmt: skip
    print(f"| {' | '.join(cells)} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=float, default=4.6e8, help="bytes of the checkpoint (default 4.6e8)")
    p.add_argument("--layers", type=int, default=16, help="decoder layers (default 16)")
    p.add_argument(
        "--links", default="10e6:0.03,50e6:0.005,0:0",
        help="link settings RATE:LATENCY (bytes/s per connection, seconds per request; 0:0 unpaced)",
    )  # fmt: skip
    p.add_argument("--before", type=Path, default=None, help="another checkout: the code before")
    p.add_argument("--serve", action="store_true", help="also the servers' in-server path: disk per node")
    p.add_argument("--work", type=Path, default=None, help="scratch directory (default: a new temp dir)")
    args = p.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="remote-fetch-"))
    kwargs = tiny_checkpoint.preset("qwen3.5-35b-a3b-scaled", target_bytes=int(args.size * 40 / args.layers))
    kwargs.update(layers=args.layers, shard_bytes=int(args.size) // 12)
    model = tiny_checkpoint.build_checkpoint(work / "model", **kwargs)
    total = sum(f.stat().st_size for f in model.iterdir())
    from qwen35_reshard import read_checkpoint
    from qwen35_reshard.model.runtimes import default_partition

    partition = ",".join(map(str, default_partition(read_checkpoint(model).num_layers, PP, "sglang")))
    codes = [("after", ROOT)] + ([("before", args.before.resolve())] if args.before else [])
    tool = [sys.executable, "-m", "qwen35_reshard"]
    print(f"# remote_fetch, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, scratch {work}")
    print(f"\n{mb(total)} checkpoint ({len(list(model.glob('*.safetensors')))} shards, {args.layers} layers, "
          f"fused experts); ratio = (time ours / time stock) / (bytes ours / bytes stock)\n")  # fmt: skip
    print("| link | what | code | bytes | s | requests | req/GB | peak RSS | time / stock | ratio |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    with HubServer() as hub:
        hub.add_repo(REPO, model)
        for link in args.links.split(","):
            rate, latency = (float(x) for x in link.split(":"))
            hub.set_pacing(rate or None, latency)
            name = link_name(rate, latency)

            def node() -> Path:
                return Path(tempfile.mkdtemp(dir=work))

            stock = run([sys.executable, "-c", STOCK, REPO], hub=hub, node=node(), code=ROOT)
            row(name, "snapshot_download", "stock", stock, stock)
            for what, extra in (("--pp 4 --rank 1", ["--rank", "1"]), ("--pp 4 (all stages)", [])):
                for label, code in codes:
                    n = node()
                    argv = [*tool, "--pp", str(PP), *extra, REPO, str(n / "out")]
                    row(name, what, label, run(argv, hub=hub, node=n, code=code), stock)
                    shutil.rmtree(n, ignore_errors=True)
            for label, code in codes if args.serve else ():
                n = node()
                got = run([sys.executable, "-c", SERVE, REPO, "1", partition], hub=hub, node=n, code=code)
                row(name, f"in-server rank 1, disk {mb(du(n))}", label, got, stock)
                shutil.rmtree(n, ignore_errors=True)


if __name__ == "__main__":
    main()
