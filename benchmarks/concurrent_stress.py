"""Concurrency stress: many processes building one OUT at once, each round checked against a
sequential build.

Each round starts ``--procs`` real ``qwen35-reshard`` processes together into a fresh OUT:

- ``ranks``: process i builds ``--rank i % pp`` (pp = ``--pp``, default the process count: one
  node per stage; more processes than stages means several build the same stage, as the nodes
  of one tensor-parallel group do);
- ``whole``: every process runs the whole split (the same command started twice or more).

With ``--hosts``, each process runs as its own "host": its own hostname and pid namespace
(``unshare --uts --pid``, as root), so that no run can see another's pid, as across machines
sharing a filesystem, and each judges the others by their claims' lease alone.

A round passes when every process exits 0, OUT is byte-identical to one sequential run's
(every file, hidden ones included, and so the same reshard.json), and ``verify --source``
passes. Prints one line per round and a JSON summary last.

    python -m benchmarks concurrent_stress --procs 4 8 16 --rounds 10 [--mode ranks whole]
        [--root DIR] [--model MODEL] [--hosts] [--before REF]

``--root`` puts the checkpoint and the OUTs there (an NFS mount, say). Each round's time is
printed against the sequential build's (the baseline, measured once per tree); ``--before REF``
runs every round with REF's code too.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.lib import checkpoints
from benchmarks.lib.trees import Tree

QUICK = ["--procs", "2", "--rounds", "1", "--pp", "2"]
BEFORE = True


def digests(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root``, hidden ones included."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def split(model: Path, out: Path, pp: int, *extra: str) -> list[str]:
    # As the commands are typed (not --quiet: the progress output is part of the timing).
    return [sys.executable, "-m", "qwen35_reshard", "--pp", str(pp), str(model), str(out), *extra]


def as_host(i: int, cmd: list[str]) -> list[str]:
    """``cmd`` run as host ``node{i}``: its own hostname and pid namespace."""
    script = 'hostname "$1"; shift; exec "$@"'
    return ["unshare", "--uts", "--pid", "--fork", "--mount-proc", "sh", "-c", script, "sh", f"node{i}", *cmd]


def round_once(
    model: Path, out: Path, procs: int, pp: int, mode: str, hosts: bool, tree: Tree
) -> tuple[list[int], list[str]]:
    """Start ``procs`` runs together into ``out``; returns their exit codes and stderr tails."""
    cmds = [
        split(model, out, pp, *(["--rank", str(i % pp)] if mode == "ranks" else [])) for i in range(procs)
    ]
    cmds = [as_host(i, c) for i, c in enumerate(cmds)] if hosts else cmds
    running = [
        subprocess.Popen(
            c, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=tree.env(), cwd="/"
        )
        for c in cmds
    ]
    results = [p.communicate(timeout=600) for p in running]
    return [p.returncode for p in running], [err.strip().splitlines()[-1:] for _, err in results]


def main(argv: list[str], trees: list[Tree]) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks concurrent_stress",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--procs", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pp", type=int, default=None, help="stages (default: the process count)")
    ap.add_argument("--mode", nargs="+", choices=["ranks", "whole"], default=["ranks"])
    ap.add_argument("--root", type=Path, default=None)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--no-verify", action="store_true", help="skip verify --source each round")
    ap.add_argument("--hosts", action="store_true", help="each process its own hostname and pid namespace")
    args = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="stress-", dir=args.root))
    model = args.model
    if model is None:
        # ~60 MB, 16 layers: the size of the checkpoint the races were first measured with.
        model = checkpoints.build(
            root / "model", layers=16, experts=32, hidden=256, moe_intermediate=64, vision=False
        )
    summary = []
    try:
        for procs in args.procs:
            pp = args.pp or procs
            for tree in trees:
                ref = root / f"ref-pp{pp}-{tree.label}"
                started = time.monotonic()
                subprocess.run(
                    split(model, ref, pp), check=True, env=tree.env(), cwd="/", capture_output=True
                )
                sequential = time.monotonic() - started
                want = digests(ref)
                for mode in args.mode:
                    ok, seconds = 0, []
                    for r in range(args.rounds):
                        out = root / f"out-{procs}-{mode}-{r}-{tree.label}"
                        started = time.monotonic()
                        codes, tails = round_once(model, out, procs, pp, mode, args.hosts, tree)
                        seconds.append(time.monotonic() - started)
                        same = digests(out) == want
                        verify = [
                            sys.executable,
                            "-m",
                            "qwen35_reshard",
                            "verify",
                            str(out),
                            "--source",
                            str(model),
                            "-q",
                        ]
                        verified = (
                            args.no_verify
                            or subprocess.run(verify, capture_output=True, env=tree.env(), cwd="/").returncode
                            == 0
                        )
                        good = all(c == 0 for c in codes) and same and verified
                        ok += good
                        bad = [t for c, t in zip(codes, tails, strict=True) if c != 0]
                        print(
                            f"{tree.label}: {procs} procs {mode} round {r}: exit {sorted(set(codes))}, "
                            f"{'byte-identical' if same else 'DIFFERENT'}, "
                            f"verify {'ok' if verified else 'FAILED'}, {seconds[-1]:.1f} s "
                            f"({seconds[-1] / sequential:.2f}x the sequential build)"
                            + (f"; e.g. {bad[0]}" if bad else ""),
                            flush=True,
                        )
                        if good:
                            shutil.rmtree(out)
                    summary.append(
                        {
                            "tree": tree.label,
                            "procs": procs,
                            "pp": pp,
                            "mode": mode,
                            "hosts": args.hosts,
                            "rounds": args.rounds,
                            "rounds_ok": ok,
                            "sequential_seconds": round(sequential, 2),
                            "median_round_seconds": round(sorted(seconds)[len(seconds) // 2], 2),
                        }
                    )
    finally:
        if all(s["rounds_ok"] == s["rounds"] for s in summary):
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"failed rounds kept in {root}", file=sys.stderr)
    print(json.dumps({"stress": summary}))
    return 0 if all(s["rounds_ok"] == s["rounds"] for s in summary) else 1
