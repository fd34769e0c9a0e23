"""The ``qwen35-reshard`` command: a thin layer over the library.

``qwen35-reshard --pp 4 MODEL OUT`` is the main job; ``plan`` shows the plan without
writing. Human output goes to stderr, ``--json`` puts a machine-readable summary on stdout.
Bad input ends with one ``error: ...`` line and exit code 2 (a traceback only with --debug).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from . import __version__, manifest
from .balance import Choice, choose
from .capacity import Capacity
from .errors import ReshardError, SharingRefusedError
from .plan import DEFAULT_MAX_FILE_BYTES, Plan, make_plan
from .split import RUNTIMES, parse_partition
from .write import REFLINK_MODES, WriteResult, check_out_dir, write_plan


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv``; return the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "verify":
        return _run_guarded(_verify, _verify_parser().parse_args(argv[1:]))
    if argv and argv[0] == "plan":
        args = _parser(plan_only=True).parse_args(argv[1:])
        args.dry_run = True
    else:
        args = _parser(plan_only=False).parse_args(argv)
    return _run_guarded(_reshard, args)


def _run_guarded(command: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Turn errors into one line and an exit code; SIGTERM is handled like Ctrl-C."""
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        return command(args)
    except ReshardError as e:
        if args.debug:
            raise
        _fail(args, f"error: {e}")
        return e.exit_code
    except KeyboardInterrupt:
        _fail(args, "interrupted: unfinished files were removed; run the same command again to resume")
        return 130
    except BrokenPipeError:
        # The reader of our output went away (e.g. `| head`): nothing left to say to anyone.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


class _ArgumentParser(argparse.ArgumentParser):
    """argparse with the tool's one-line ``error: ...`` (exit 2) instead of usage + error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _fail(args: argparse.Namespace, message: str) -> None:
    print(message, file=sys.stderr)
    if getattr(args, "json", False):
        print(json.dumps({"status": "error", "error": message}))


def _parser(*, plan_only: bool) -> argparse.ArgumentParser:
    p = _ArgumentParser(
        prog="qwen35-reshard plan" if plan_only else "qwen35-reshard",
        description=(
            "Show how MODEL splits into pipeline stages."
            if plan_only
            else "Split a Qwen3.5 MoE checkpoint into one Hugging Face directory per pipeline stage "
            "(OUT/pp0, OUT/pp1, ...). Subcommands: plan, verify."
        ),
    )
    p.add_argument(
        "model", metavar="MODEL", help="checkpoint directory (plain or a HF cache snapshot) or Hub repo id"
    )
    p.add_argument("--revision", help="branch, tag or commit of a Hub repo (default: main)")
    p.add_argument("--token", help="Hugging Face token (default: HF_TOKEN or the saved login)")
    p.add_argument("--offline", action="store_true", help="use only the Hugging Face cache")
    p.add_argument("out", metavar="OUT", type=Path, nargs="?" if plan_only else None, help="output directory")
    p.add_argument("--pp", type=int, required=True, help="number of pipeline stages")
    p.add_argument(
        "--runtime",
        choices=RUNTIMES,
        default="sglang",
        help="server whose split and placement rules apply (default: sglang)",
    )
    p.add_argument(
        "--partition",
        help="explicit layers per stage, e.g. 15,15,15,15, or 'balanced': the split whose fullest "
        "stage holds the fewest bytes (default: the runtime's own split)",
    )
    p.add_argument(
        "--gpu-memory",
        type=_size,
        metavar="SIZE",
        help="with --partition balanced: size for serving on GPUs of this memory, e.g. 80GB "
        "(maximise the requests the worst stage holds)",
    )
    p.add_argument("--tp", type=int, help="with --gpu-memory: tensor-parallel size of each stage (default 1)")
    p.add_argument("--context-length", type=int, help="with --gpu-memory: tokens per request")
    p.add_argument(
        "--mem-fraction",
        type=float,
        help="with --gpu-memory: share of GPU memory the server uses for weights and cache (default 0.9)",
    )
    p.add_argument(
        "--rank", type=int, action="append", help="build only this stage; repeat for several (default: all)"
    )
    p.add_argument(
        "--no-mtp", action="store_true", help="leave mtp.* out on purpose (recorded in the manifest)"
    )
    p.add_argument(
        "--max-file-size",
        type=_size,
        default=DEFAULT_MAX_FILE_BYTES,
        metavar="SIZE",
        help="largest output data file, e.g. 5GB or 500MB (default: 5GiB)",
    )
    if not plan_only:
        p.add_argument(
            "--dry-run", action="store_true", help="plan from the index and headers only; write nothing"
        )
        p.add_argument(
            "--overwrite", action="store_true", help="replace a non-empty OUT that holds another split"
        )
        p.add_argument("--workers", type=int, default=2, help="source shards copied at once (default: 2)")
        p.add_argument(
            "--reflink",
            choices=REFLINK_MODES,
            default="auto",
            help="share the source's blocks (XFS, Btrfs, ...) instead of copying: auto where the "
            "filesystem can, always (refuse where it cannot), never (default: auto)",
        )
    p.add_argument("--json", action="store_true", help="print a machine-readable summary on stdout")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.add_argument("--version", action="version", version=f"qwen35-reshard {__version__}")
    return p


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


def _size(text: str) -> int:
    """Parse a byte size such as ``5GB``, ``500MB``, ``4GiB`` or ``1048576``."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 5GB, 500MB or 1048576")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def _capacity(args: argparse.Namespace) -> Capacity | None:
    """Capacity mode's settings, or None; each of its options needs --gpu-memory and balanced."""
    given = [
        f"--{k.replace('_', '-')}"
        for k in ("tp", "context_length", "mem_fraction")
        if getattr(args, k) is not None
    ]
    if args.gpu_memory is None:
        if given:
            raise ReshardError(f"{given[0]} sizes capacity mode: it needs --gpu-memory")
        return None
    if args.partition != "balanced":
        raise ReshardError("--gpu-memory sizes --partition balanced for serving: add --partition balanced")
    if args.context_length is None:
        raise ReshardError("--gpu-memory needs --context-length, the tokens each request may hold")
    if args.mem_fraction is not None and not 0 < args.mem_fraction <= 1:
        raise ReshardError(f"--mem-fraction must be in (0, 1], got {args.mem_fraction}")
    for flag, value in (("--tp", args.tp), ("--context-length", args.context_length)):
        if value is not None and value < 1:
            raise ReshardError(f"{flag} must be at least 1, got {value}")
    return Capacity(
        gpu_bytes=args.gpu_memory,
        mem_fraction=0.9 if args.mem_fraction is None else args.mem_fraction,
        tp=1 if args.tp is None else args.tp,
        context_length=args.context_length,
    )


def _reshard(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .report import (
        RichReporter,
        balance_table,
        balance_verdict,
        fetch_line,
        plan_table,
        shares_line,
        summary,
    )

    console = Console(stderr=True)
    from . import hub

    if args.out is not None and Path(args.model).is_dir():
        check_out_dir(Path(args.model), args.out)
    if getattr(args, "workers", 1) < 1:
        raise ReshardError(f"--workers must be at least 1, got {args.workers}")
    capacity = _capacity(args)
    # Reading and planning make a few small objects per tensor (~190,000 tensors for a
    # 397B FP8 checkpoint), none of them cyclic: the garbage collector would only slow this.
    gc.disable()
    try:
        traffic = hub.Traffic()
        settings = hub.HubSettings(revision=args.revision, token=args.token, offline=args.offline)
        ckpt, repo = hub.open_model(args.model, settings, traffic=traffic)
        for name in ckpt.unlisted:
            print(
                f"warning: {ckpt.display}/{name} is not listed in the checkpoint's index: ignored, as the "
                "servers ignore it",
                file=sys.stderr,
            )
        choice = None
        if args.partition == "balanced":
            choice = choose(
                ckpt, pp=args.pp, runtime=args.runtime, keep_mtp=not args.no_mtp, capacity=capacity
            )
            partition = list(choice.partition)
        elif args.partition is not None:
            partition = parse_partition(args.partition, pp=args.pp, num_layers=ckpt.num_layers)
        else:
            partition = None
        plan = make_plan(
            ckpt,
            pp=args.pp,
            runtime=args.runtime,
            partition=partition,
            ranks=args.rank,
            keep_mtp=not args.no_mtp,
            max_file_bytes=args.max_file_size,
        )
    finally:
        # What reading and planning made lives until the end: frozen, so that no collection
        # walks it again (the first one after enable() would take ~0.2 s at 190,000 tensors).
        gc.freeze()
        gc.enable()
    console.print(plan_table(plan))
    if choice is not None:
        console.print(balance_table(choice, plan.runtime))
        for line in balance_verdict(choice):
            console.print(line, highlight=False)
    if args.dry_run:
        console.print(shares_line(plan), highlight=False)
        fetch = None
        if repo is not None:
            fetch = hub.fetch_report(plan, hub.HubFetcher(repo, ckpt, hub.needed_by(plan), traffic=traffic))
            console.print(fetch_line(fetch, planned=True), highlight=False)
        console.print(f"dry run: nothing written. Launch with [bold]{plan.launch_env}[/]", highlight=False)
        _print_json(args, "dry_run", plan, None, 0.0, fetch=fetch, choice=choice)
        return 0
    reporter = RichReporter(console)
    started = time.monotonic()
    fetcher = None
    if repo is not None:
        needed = hub.needed_by(plan)
        fetcher = hub.HubFetcher(repo, ckpt, needed, traffic=traffic, on_fetched=reporter.fetched)
        reporter.expect_downloads(fetcher.download_bytes)
    try:
        if fetcher is not None:
            fetcher.prepare()
        try:
            result = write_plan(
                plan,
                args.out,
                overwrite=args.overwrite,
                workers=args.workers,
                reporter=reporter,
                open_source=fetcher.open if fetcher is not None else None,
                reflink=args.reflink,
            )
        except SharingRefusedError as e:
            raise ReshardError(e.explain("--reflink always")) from e
    finally:
        reporter.close()
    seconds = time.monotonic() - started
    summary(console, plan, result, str(args.out), seconds)
    fetch = hub.fetch_report(plan, fetcher) if fetcher is not None else None
    if fetch is not None:
        console.print(fetch_line(fetch), highlight=False)
    status = "nothing_to_do" if result.nothing_to_do else "ok"
    _print_json(args, status, plan, result, seconds, fetch=fetch, choice=choice)
    return 0


def _print_json(
    args: argparse.Namespace,
    status: str,
    plan: Plan,
    result: WriteResult | None,
    seconds: float,
    fetch: dict | None = None,
    choice: Choice | None = None,
) -> None:
    if not args.json:
        return
    identity = manifest.run_identity(plan)
    known = {*result.built, *result.already_complete} if result is not None else set()
    complete = [
        s.rank
        for s in plan.stages
        if s.rank in known
        or (args.out is not None and manifest.stage_is_complete(args.out / s.dirname, identity))
    ]
    doc = {"status": status, "out": str(args.out) if args.out else None}
    doc.update(manifest.run_manifest(plan, complete=complete))
    if choice is not None:
        doc["balanced"] = choice.to_dict()
    if result is not None:
        doc["result"] = {
            "built": result.built,
            "already_complete": result.already_complete,
            "files_kept": result.files_kept,
            "bytes_copied": result.bytes_copied,
            "bytes_shared": result.bytes_shared,
            "seconds": round(seconds, 3),
        }
    if fetch is not None:
        doc["fetch"] = fetch
    print(json.dumps(doc, indent=2))


def _verify_parser() -> argparse.ArgumentParser:
    """The ``qwen35-reshard verify`` command line."""
    p = _ArgumentParser(
        prog="qwen35-reshard verify",
        description=(
            "Check a split: every stage's files (strict safetensors), index, config.json and manifest, "
            "and every tensor's bytes. With --source, also that every source tensor is exactly where "
            "the plan puts it, with identical bytes. Exit 0 when all is well, 1 when something is "
            "missing, extra, different, corrupt or incomplete, 2 for bad input."
        ),
    )
    p.add_argument(
        "out", metavar="OUT", type=Path, help="the run directory, or one stage directory (OUT/pp2)"
    )
    p.add_argument("--source", metavar="MODEL", help="the checkpoint the split was made from")
    p.add_argument(
        "--repair",
        action="store_true",
        help="rewrite from --source exactly the files found damaged, missing or truncated, then verify again",
    )
    p.add_argument("--revision", help="branch, tag or commit of a Hub repo (default: main)")
    p.add_argument("--token", help="Hugging Face token (default: HF_TOKEN or the saved login)")
    p.add_argument("--offline", action="store_true", help="use only the Hugging Face cache")
    p.add_argument("--json", action="store_true", help="print the full report as JSON on stdout")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.add_argument("--version", action="version", version=f"qwen35-reshard {__version__}")
    return p


def _verify(args: argparse.Namespace) -> int:
    """Run ``verify`` for parsed ``args``: human report on stderr, ``--json`` on stdout."""
    from . import hub
    from .report import verify_lines
    from .verify import verify

    if args.repair:
        if args.source is None:
            raise ReshardError("--repair rewrites files from the checkpoint: pass --source MODEL")
        from .repair import repair

        result = repair(args.out, Path(args.source))
        if not result.before.ok:
            for line in verify_lines(result.before)[:-1]:
                print(line, file=sys.stderr)
            for path in result.rewritten:
                print(f"repaired: {path}", file=sys.stderr)
        report = result.after
    else:
        settings = hub.HubSettings(revision=args.revision, token=args.token, offline=args.offline)
        report = verify(args.out, args.source, hub_settings=settings)
    for line in verify_lines(report):
        print(line, file=sys.stderr)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    return 0 if report.ok else 1
