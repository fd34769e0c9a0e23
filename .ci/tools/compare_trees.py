"""Run the CLI's commands in two source trees and compare what users see and get.

    python .ci/tools/compare_trees.py OLD_TREE NEW_TREE        # e.g. /tmp/old .

Each tree runs the same scenarios (split, plan, --dry-run, --json, -q, verify, verify --json,
a damaged split verified and repaired, balanced and capacity partitions, node ranks, and bad
input of every kind) as ``python -m qwen35_reshard`` with ``PYTHONPATH`` set to the tree, in the
same working directory (so paths in the output are the same), on one synthetic checkpoint.
Compared per command: the exit code, stdout, stderr (durations and rates masked: the machine is
noisy) and every file under OUT, byte for byte (sha256 of each path). Prints one line per
difference and a summary; exits 1 when anything differs.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# Scenarios: a name and its steps, run in order in a fresh working directory. A step is a
# command line ({MODEL}, {OUT} filled in) or a ("damage", stage) action between commands.
SCENARIOS: dict[str, list] = {
    "split": [
        "split --pp 4 {MODEL} {OUT}",
        "split --pp 4 {MODEL} {OUT}",  # nothing to do
        "verify {OUT}",
        "verify {OUT} --source {MODEL}",
        "verify --json {OUT} --source {MODEL}",
        "verify -q {OUT}/pp2",
        "split --pp 3 {MODEL} {OUT}",  # another split in OUT: refused
        "split --pp 2 --overwrite --runtime vllm {MODEL} {OUT}",
    ],
    "default_command": ["--pp 2 {MODEL} {OUT}", "--pp 2 -q {MODEL} {OUT}"],
    "json": ["split --json --pp 2 --runtime vllm {MODEL} {OUT}"] * 2,
    "plan": [
        "plan --pp 4 {MODEL}",
        "plan -q --pp 4 {MODEL}",
        "plan --json --pp 4 {MODEL} {OUT}",
        "plan --pp 3 --partition 4,2,2 --runtime vllm {MODEL}",
        "plan --pp 3 --partition balanced {MODEL}",
        "plan --json --pp 2 --partition balanced --gpu-memory 1GB --context-length 4096 --tp 2 {MODEL}",
        "plan --pp 4 --nnodes 2 --node-rank 1 {MODEL}",
        "plan --json --pp 4 --rank 1 --rank 3 {MODEL}",
    ],
    "dry_run": [
        "split --dry-run --pp 4 {MODEL} {OUT}",
        "split --dry-run --json --pp 4 {MODEL} {OUT}",
        "split --pp 4 --rank 0 {MODEL} {OUT}",
        "split --dry-run --pp 4 {MODEL} {OUT}",
        "split --dry-run --pp 2 {MODEL} {OUT}",
    ],
    "balanced": [
        "split --pp 3 --partition balanced --no-mtp --max-file-size 40KB {MODEL} {OUT}",
        "verify --json {OUT} --source {MODEL}",
    ],
    "nodes": [
        "split --pp 4 --nnodes 2 --node-rank 0 --workers 1 --reflink never {MODEL} {OUT}",
        "split --json --pp 4 --nnodes 2 --node-rank 1 --workers 3 {MODEL} {OUT}",
        "split --pp 4 --nnodes 4 --node-rank 2 {MODEL} {OUT}",
        "split --pp 2 --nnodes 2 --node-rank 1 --runtime vllm {MODEL} {OUT}/v",
        "split --pp 2 --nnodes 2 --node-rank 0 --runtime vllm {MODEL} {OUT}/v",
    ],
    "repair": [
        "split --pp 2 {MODEL} {OUT}",
        ("damage", "pp1"),
        "verify {OUT}",
        "verify --json {OUT} --source {MODEL}",
        "verify {OUT} --repair",
        "verify {OUT} --source {MODEL} --repair",
        "verify {OUT} --source {MODEL}",
        ("damage", "pp0"),
        "verify {OUT}/pp0 --source {MODEL} --repair --json",
    ],
    "errors": [
        "split --pp 0 {MODEL} {OUT}",
        "split --pp 4 --gpu-memory 80GB {MODEL} {OUT}",
        "split --pp 4 --tp 2 {MODEL} {OUT}",
        "split --pp 4 --partition balanced --gpu-memory 80GB {MODEL} {OUT}",
        "plan --pp 4 --partition balanced --gpu-memory 8GB --context-length 8 --mem-fraction 2 {MODEL}",
        "split --pp 4 --partition balanced --gpu-memory 80GB --context-length 0 {MODEL} {OUT}",
        "split --pp 4 --rank auto --node-rank 1 {MODEL} {OUT}",
        "split --pp 4 --rank auto {MODEL} {OUT}",
        "split --pp 4 --nnodes 2 {MODEL} {OUT}",
        "split --pp 4 --node-rank 1 {MODEL} {OUT}",
        "split --pp 4 --rank 1 --nnodes 2 {MODEL} {OUT}",
        "split --pp 4 --rank x {MODEL} {OUT}",
        "split --pp 4 --nnodes 3 --node-rank 5 {MODEL} {OUT}",
        "split --pp 4 --workers 0 {MODEL} {OUT}",
        "split --json --pp 4 --workers 0 {MODEL} {OUT}",
        "split --pp 4 {MODEL} {MODEL}/out",
        "split --pp 4 does-not-exist {OUT}",
        "split --pp 4 ./does-not-exist {OUT}",
        "split --pp 4 --partition 1,2 {MODEL} {OUT}",
        "split --pp 4 --partition x {MODEL} {OUT}",
        "split --pp 4 --reflink sometimes {MODEL} {OUT}",
        "split --pp 4 --max-file-size 12QB {MODEL} {OUT}",
        "split --pp 4 --runtime tgi {MODEL} {OUT}",
        "split --pp 4 --revision v1 {MODEL} {OUT}",
        "plan --pp 4 --offline Qwen/NotCached",
        "plann --pp 4 {MODEL}",
        "split --pp 4 --bogus {MODEL} {OUT}",
        "verify {OUT}",
        "verify --json {OUT}",
        "verify {MODEL}",
        "",
        "--help",
        "split --help",
        "plan --help",
        "verify --help",
    ],
}

# What differs from run to run on its own: durations, rates, process ids.
_MASKS = [
    (re.compile(r"\d+(\.\d+)? ?(s|ms|µs|min)\b"), "<time>"),
    (re.compile(r"\d+(\.\d+)? ?[KMGT]?i?B/s"), "<rate>"),
    (re.compile(r'"seconds": [0-9.e-]+'), '"seconds": <time>'),
    (re.compile(r"\bpid \d+"), "pid <pid>"),
    (re.compile(r"\d+:\d\d:\d\d (left|elapsed)"), r"<clock> \1"),
]


def _mask(text: str) -> str:
    for pattern, repl in _MASKS:
        text = pattern.sub(repl, text)
    return text


def _tree(root: Path) -> dict[str, str]:
    """Every file under ``root``: relative path -> sha256 of its bytes."""
    found = {}
    if root.is_dir():
        for path in sorted(root.rglob("*")):
            if path.is_file():
                found[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def _damage(out: Path, stage: str) -> None:
    """Truncate the first data file of ``stage`` and delete its config.json."""
    data = sorted((out / stage).glob("*.safetensors"))[0]
    os.truncate(data, 100)
    (out / stage / "config.json").unlink()


def run_tree(tree: Path, model: Path, work: Path) -> list[tuple[str, int, str, str, dict[str, str]]]:
    """Every scenario's steps in ``tree``: (label, exit code, stdout, stderr, OUT's files)."""
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("QWEN35_", "HF_", "SLURM_", "LWS_"))},
        "PYTHONPATH": str(tree),
        "COLUMNS": "120",
        "NO_COLOR": "1",
        "TERM": "dumb",
        "HF_HOME": str(work / "hf-home"),
        "HF_HUB_OFFLINE": "1",
    }
    results = []
    for name, steps in SCENARIOS.items():
        if work.exists():
            shutil.rmtree(work)
        work.mkdir(parents=True)
        out = work / "out"
        for i, step in enumerate(steps):
            label = f"{name}[{i}] {step if isinstance(step, str) else ' '.join(step)}"
            if isinstance(step, tuple):
                _damage(out, step[1])
                continue
            argv = step.format(MODEL=model, OUT=out).split()
            p = subprocess.run(
                [sys.executable, "-m", "qwen35_reshard", *argv],
                cwd=work,
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            results.append((label, p.returncode, _mask(p.stdout), _mask(p.stderr), _tree(out)))
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("--keep", action="store_true", help="keep the working directory")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="compare-trees-"))
    try:
        sys.path.insert(0, str(args.new.resolve() / "examples"))
        import tiny_checkpoint

        model = Path(tiny_checkpoint.build_checkpoint(base / "model", shard_bytes=60_000))
        before = _tree(model)
        runs = {}
        for side in ("old", "new"):
            runs[side] = run_tree(getattr(args, side).resolve(), model, base / "work")
        if _tree(model) != before:
            print("MODEL changed under the runs")
            return 1
        differ = 0
        for (label, *old), (_, *new) in zip(runs["old"], runs["new"], strict=True):
            for what, a, b in zip(("exit code", "stdout", "stderr", "OUT's files"), old, new, strict=True):
                if a != b:
                    differ += 1
                    print(f"DIFFERS {label}: {what}")
                    if isinstance(a, str):
                        sys.stdout.writelines(
                            __import__("difflib").unified_diff(
                                a.splitlines(True), b.splitlines(True), "old", "new", n=1
                            )
                        )
                    elif isinstance(a, dict):
                        for path in sorted(set(a) | set(b)):
                            if a.get(path) != b.get(path):
                                print(f"    {path}: {a.get(path, '-')[:12]} -> {b.get(path, '-')[:12]}")
                    else:
                        print(f"    {a} -> {b}")
        files = sum(len(r[4]) for r in runs["old"])
        print(
            f"{len(runs['old'])} commands in {len(SCENARIOS)} scenarios, {files} OUT files compared: "
            + ("identical" if not differ else f"{differ} differences")
        )
        return 1 if differ else 0
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
