"""The ``qwen35-reshard`` command (typer): a thin layer over the library.

``qwen35-reshard split --pp 4 MODEL OUT`` is the main job, and ``qwen35-reshard --pp 4 MODEL
OUT`` (no command named) still runs it; ``plan`` and ``verify`` are commands beside it.
Results (the plan table, the summary, the launch line, verify's report) go to stdout, progress
and warnings to stderr; with ``--json`` stdout holds only JSON and the human output goes to
stderr. Bad input ends with one ``error: ...`` line on stderr and exit code 2, verify's findings
with 1, an interrupt with 130; a traceback only with ``--debug``.
"""

from __future__ import annotations

import difflib
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from ..errors import BadInput, ReshardError
from ..plan.capacity import capacity_from
from ..source.hub.cache import HubSettings
from ..write.options import DEFAULT_WORKERS, WriteOptions
from . import cache, process
from .flags import (
    EP_FLAGS,
    FLAGS,
    MAX_FILE_DEFAULT,
    PROG,
    VERIFY_FLAGS,
    ContextLength,
    Debug,
    Ep,
    EpNodes,
    ExpertArgs,
    GpuMemory,
    HfCache,
    InitExpertLocation,
    Json,
    MaxFileSize,
    MemFraction,
    Model,
    Nnodes,
    NodeOpt,
    NodeRank,
    NoMtp,
    Offline,
    Partition,
    Pp,
    Quiet,
    Rank,
    RedundantExperts,
    Reflink,
    Revision,
    Runtime,
    RuntimeOpt,
    Streams,
    Token,
    Tp,
    VerifyNnodes,
    VerifyRank,
    Version,
    ranks_of,
)
from .process import Output, run_guarded

if TYPE_CHECKING:
    from rich.console import Console

    from ..api import ReshardResult
    from ..write.assemble import Reporter
    from .progress import LogReporter, RichReporter

# typer (0.26 to 0.28) runs on its own copy of click, typer._click (private; click itself is no
# dependency of typer, and click.exceptions' classes are others that catch none of these), and
# re-exports only BadParameter: its bases are the usage error and the error of every command line.
UsageError = typer.BadParameter.__mro__[1]
ClickException = UsageError.__mro__[1]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); return the exit code.

    Without ``argv`` this process is the command itself (the console script, ``python -m``):
    it ends here, its output flushed, without the interpreter's teardown (see :mod:`.process`).
    """
    program = argv is None
    argv = _with_command(list(sys.argv[1:] if argv is None else argv))
    return process.run(lambda: _invoke(argv), program=program)


def _invoke(argv: list[str]) -> int:
    """The command ``argv`` names, run by typer; click's usage errors in one line, no usage block."""
    try:
        return typer.main.get_command(app).main(args=argv, prog_name=PROG, standalone_mode=False) or 0
    except ClickException as e:
        process.fail("--json" in argv, _usage_message(e))
        return e.exit_code


_GROUP_OPTIONS = ("--help", "-h", "--version", "--install-completion", "--show-completion")


def _with_command(argv: list[str]) -> list[str]:
    """``argv`` naming its command: none named means ``split`` (the form CI scripts use)."""
    if not argv:
        return ["--help"]
    first = argv[0]
    if first in COMMANDS or first in _GROUP_OPTIONS:
        return argv
    # A word close to a command name that is no path nor repo id: a misspelt command, which the
    # command group answers with "did you mean".
    if (
        not first.startswith("-")
        and "/" not in first
        and not Path(first).exists()
        and difflib.get_close_matches(first, COMMANDS)
    ):
        return argv
    return ["split", *argv]


def _usage_message(e: ClickException) -> str:
    if hasattr(e, "possibilities"):  # NoSuchOption: click lists every close match; name the closest
        message = e.message + (f". Did you mean {e.possibilities[0]}?" if e.possibilities else "")
    else:
        message = e.format_message()
    ctx = e.ctx if isinstance(e, UsageError) else None
    return f"error: {message} (see {ctx.command_path if ctx else PROG} --help)"


@dataclass(frozen=True)
class VerifyArgs:
    """``verify``'s arguments."""

    out: Path
    source: str | None
    repair: bool
    hub: HubSettings
    ranks: list[int] | str | None = None
    nnodes: int | None = None


_SPLIT_EXAMPLES = f"""Examples:

\b
  {PROG} split --pp 4 Qwen/Qwen3.5-35B-A3B out
  {PROG} --pp 4 Qwen/Qwen3.5-35B-A3B out        # the same: split is the default
  {PROG} split --pp 8 --runtime vllm --rank 3 Qwen/Qwen3.5-397B-A17B-FP8 out
  {PROG} split --pp 4 --partition balanced --dry-run Qwen/Qwen3.5-35B-A3B out
  export $({PROG} split -q --pp 4 Qwen/Qwen3.5-35B-A3B out)   # the partition"""

_PLAN_EXAMPLES = f"""Examples:

\b
  {PROG} plan --pp 4 Qwen/Qwen3.5-35B-A3B
  {PROG} plan --pp 4 Qwen/Qwen3.5-35B-A3B out   # and what a split would do in out
  {PROG} plan --pp 16 --partition balanced --gpu-memory 80GB --tp 8 \\
      --context-length 262144 Qwen/Qwen3.5-397B-A17B-FP8
  {PROG} plan --pp 4 Qwen/Qwen3.5-35B-A3B > plan.txt
  export $({PROG} plan -q --pp 4 Qwen/Qwen3.5-35B-A3B)   # the partition"""

_VERIFY_EXAMPLES = f"""Examples:

\b
  {PROG} verify out
  {PROG} verify out --source Qwen/Qwen3.5-35B-A3B
  {PROG} verify out/pp2 --source Qwen/Qwen3.5-35B-A3B --repair
  {PROG} verify out --rank 2 --rank 3
  {PROG} verify out --json > report.json"""

app = typer.Typer(
    name=PROG,
    epilog=f"""Examples:

\b
  {PROG} split --pp 4 Qwen/Qwen3.5-35B-A3B out
  {PROG} --pp 4 Qwen/Qwen3.5-35B-A3B out        # the same: split is the default
  {PROG} plan --pp 4 Qwen/Qwen3.5-35B-A3B
  {PROG} verify out --source Qwen/Qwen3.5-35B-A3B
  {PROG} cache ls                          # the stages servers built from unsplit models
  {PROG} --install-completion              # Tab completion in your shell""",
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
COMMANDS = ("split", "plan", "verify", "cache")


app.add_typer(cache.app, name="cache")


@app.callback()
def _group(version: Version = False) -> None:
    """Split a Qwen3.5 MoE checkpoint into one Hugging Face directory per pipeline stage
    (OUT/pp0, OUT/pp1, ...). With no command named, runs split: `qwen35-reshard --pp 4 MODEL OUT`."""


@app.command(epilog=_SPLIT_EXAMPLES)
def split(
    model: Model,
    out: Annotated[Path, typer.Argument(metavar="OUT", help="output directory", show_default=False)],
    pp: Pp = None,
    runtime: RuntimeOpt = Runtime.sglang,
    partition: Partition = None,
    gpu_memory: GpuMemory = None,
    tp: Tp = None,
    context_length: ContextLength = None,
    mem_fraction: MemFraction = None,
    rank: Rank = None,
    nnodes: Nnodes = None,
    node_rank: NodeRank = None,
    ep: Ep = 1,
    nodes: EpNodes = 1,
    redundant_experts: RedundantExperts = 0,
    init_expert_location: InitExpertLocation = None,
    node: NodeOpt = None,
    no_mtp: NoMtp = False,
    max_file_size: MaxFileSize = MAX_FILE_DEFAULT,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="plan from the index and headers only; write nothing")
    ] = False,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="replace a non-empty OUT that holds another split")
    ] = False,
    workers: Annotated[
        int, typer.Option("--workers", metavar="N", help="source shards copied at once")
    ] = DEFAULT_WORKERS,
    reflink: Annotated[
        Reflink,
        typer.Option(
            "--reflink",
            help="share the source's blocks (XFS, Btrfs, ...) instead of copying: auto where the "
            "filesystem can, always (refuse where it cannot), never",
        ),
    ] = Reflink.auto,
    revision: Revision = None,
    token: Token = None,
    offline: Offline = False,
    streams: Streams = None,
    hf_cache: HfCache = False,
    quiet: Quiet = False,
    json_: Json = False,
    debug: Debug = False,
    version: Version = False,
) -> None:
    """Split MODEL into OUT/pp0, OUT/pp1, ...: one Hugging Face directory per pipeline stage
    (with --ep, per node: OUT/pp0-node0, ...), byte for byte, resumable. Prints the launch line
    for the server."""
    ranks = ranks_of(rank)
    expert = ExpertArgs(ep, nodes, redundant_experts, init_expert_location, node)

    # The one place the flags become the library's options (FLAGS spells them back in errors).
    def run(progress: Reporter) -> ReshardResult:
        from ..api import reshard

        picked, where = expert.node_pick(ranks, nnodes, node_rank)
        return reshard(
            model,
            out,
            expert.layout(pp, runtime.value, partition),
            capacity=capacity_from(
                partition,
                gpu_memory=gpu_memory,
                context_length=context_length,
                tp=tp,
                mem_fraction=mem_fraction,
            ),
            ranks=picked,
            node=where,
            hub=HubSettings(
                revision=revision, token=token, offline=offline, streams=streams, hf_cache=hf_cache
            ),
            write=WriteOptions(
                overwrite=overwrite,
                workers=workers,
                reflink=reflink.value,
                keep_mtp=not no_mtp,
                max_file_bytes=max_file_size,
            ),
            dry_run=dry_run,
            progress=progress,
        )

    output = Output(quiet, json_, debug)
    flags = EP_FLAGS if ep > 1 else FLAGS
    run_guarded(
        lambda: _reshard(run, out, output, flags),
        output,
        "nothing was written"
        if dry_run
        else "unfinished files were removed; run the same command again to resume",
        flags,
    )


@app.command(epilog=_PLAN_EXAMPLES)
def plan(
    model: Model,
    pp: Pp = None,
    out: Annotated[
        Path | None,
        typer.Argument(
            metavar="OUT",
            help="an output directory: also say what a split would do there",
            show_default=False,
        ),
    ] = None,
    runtime: RuntimeOpt = Runtime.sglang,
    partition: Partition = None,
    gpu_memory: GpuMemory = None,
    tp: Tp = None,
    context_length: ContextLength = None,
    mem_fraction: MemFraction = None,
    rank: Rank = None,
    nnodes: Nnodes = None,
    node_rank: NodeRank = None,
    ep: Ep = 1,
    nodes: EpNodes = 1,
    redundant_experts: RedundantExperts = 0,
    init_expert_location: InitExpertLocation = None,
    node: NodeOpt = None,
    no_mtp: NoMtp = False,
    max_file_size: MaxFileSize = MAX_FILE_DEFAULT,
    revision: Revision = None,
    token: Token = None,
    offline: Offline = False,
    streams: Streams = None,
    quiet: Quiet = False,
    json_: Json = False,
    debug: Debug = False,
    version: Version = False,
) -> None:
    """Show how MODEL splits into pipeline stages (from its index and headers); write nothing."""
    # plan is a dry run of split.
    split(
        model, out, pp, runtime, partition, gpu_memory, tp, context_length, mem_fraction, rank, nnodes,
        node_rank, ep, nodes, redundant_experts, init_expert_location, node, no_mtp, max_file_size,
        dry_run=True, revision=revision, token=token, offline=offline, streams=streams, quiet=quiet,
        json_=json_, debug=debug,
    )  # fmt: skip


@app.command(epilog=_VERIFY_EXAMPLES)
def verify(
    out: Annotated[
        Path,
        typer.Argument(
            metavar="OUT", help="the run directory, or one stage directory (OUT/pp2)", show_default=False
        ),
    ],
    source: Annotated[
        str | None,
        typer.Option("--source", metavar="MODEL", help="the checkpoint the split was made from"),
    ] = None,
    repair: Annotated[
        bool,
        typer.Option(
            "--repair",
            help="rewrite from --source exactly the files found damaged, missing or truncated "
            "(never an intact one; refused if --source's bytes are not the split's), then verify again",
        ),
    ] = False,
    rank: VerifyRank = None,
    nnodes: VerifyNnodes = None,
    revision: Revision = None,
    token: Token = None,
    offline: Offline = False,
    streams: Streams = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="print only the problems found")] = False,
    json_: Annotated[
        bool, typer.Option("--json", help="print the full report as JSON on stdout (human output on stderr)")
    ] = False,
    debug: Debug = False,
    version: Version = False,
) -> None:
    """Check a split: every stage's files (strict safetensors), index, config.json and manifest,
    and every tensor's bytes. With --source, also that every source tensor is exactly where the
    plan puts it, with identical bytes. Exit 0 when all is well, 1 when something is missing,
    extra, different, corrupt or incomplete, 2 for bad input."""
    hub = HubSettings(revision=revision, token=token, offline=offline, streams=streams)
    args = VerifyArgs(out, source, repair, hub, ranks_of(rank), nnodes)
    output = Output(quiet, json_, debug)
    run_guarded(
        lambda: _verify(args, output),
        output,
        "files rewritten so far are complete; run the same command again to finish the repair"
        if repair
        else "nothing was written",
        VERIFY_FLAGS,
    )


# --------------------------------------------------------------------------- split and plan


def _consoles(output: Output) -> tuple[Console, Console]:
    """(results, progress): results on stdout, or on stderr beside ``--json``; progress on stderr."""
    from .report import console

    progress = console("stderr")
    return (progress if output.json else console("stdout")), progress


def _progress_bar(console: Console) -> RichReporter | LogReporter:
    """The rich bar in a terminal; in a log, plain lines at a steady interval."""
    from .progress import LOG_INTERVAL, LOG_INTERVAL_ENV, LogReporter, RichReporter

    if console.is_terminal:
        return RichReporter(console)
    return LogReporter(sys.stderr, float(os.environ.get(LOG_INTERVAL_ENV) or LOG_INTERVAL))


def _reshard(
    run: Callable[[Reporter], ReshardResult], out: Path | None, output: Output, flags: dict[str, str]
) -> int:
    """``split`` and ``plan``: ``run``, the library's reshard, its plan shown once made, then
    its result."""
    from .report import QuietView, SplitView, dry_run_lines, fetch_line, summary

    results, progress = _consoles(output)
    view = process.collector_off_until_planned(
        QuietView(flags) if output.quiet else SplitView(results, _progress_bar(progress), flags)
    )
    try:
        result = run(view)
    finally:
        if isinstance(view, SplitView):
            view.close()
    process.keep_to_the_end(result.plan)
    plan = result.plan
    if result.dry_run:
        if not output.quiet:
            for line, wrap in dry_run_lines(result):
                results.print(line, highlight=False, soft_wrap=wrap)
    elif not output.quiet:
        summary(results, plan, result.written, str(out), result.seconds, result.node)
        if result.fetch is not None:
            results.print(fetch_line(result.fetch), highlight=False)
    if output.quiet:
        results.print(plan.launch_env, highlight=False, markup=False, soft_wrap=True)
    if output.json:
        print(json.dumps(_json_doc(result, flags), indent=2))
    return 0


def _json_doc(result: ReshardResult, flags: dict[str, str]) -> dict:
    """``--json``'s summary: the status, then the result's own record."""
    if result.dry_run:
        status = "dry_run"
    else:
        status = "nothing_to_do" if result.written.nothing_to_do else "ok"
    doc = {"status": status, **result.to_dict()}
    if result.node is not None:  # its source in this command line's flags
        doc["node"] = result.node.to_dict(flags)
    return doc


# --------------------------------------------------------------------------- verify


def _verify(args: VerifyArgs, output: Output) -> int:
    """``verify``: the report on stdout (stderr beside ``--json``), the JSON report with ``--json``."""
    from ..verify import verify
    from .report import verify_lines

    out = sys.stderr if output.json else sys.stdout
    if args.repair:
        if args.source is None:
            raise BadInput("--repair rewrites files from the checkpoint: pass --source MODEL")
        from ..api import repair

        if args.ranks is not None:
            raise ReshardError("--repair mends the stages found damaged: drop --rank")
        result = repair(
            args.out, args.source, on_wait=lambda message: print(message, file=sys.stderr), hub=args.hub
        )
        if not result.before.ok:
            for line in verify_lines(result.before, problems_only=output.quiet, verdict=False):
                print(line, file=out)
            for path in result.rewritten:
                print(f"repaired: {path}", file=out)
        report = result.after
    else:
        report = verify(args.out, args.source, ranks=args.ranks, nnodes=args.nnodes, hub=args.hub)
    for line in verify_lines(report, problems_only=output.quiet):
        print(line, file=out)
    if output.json:
        print(json.dumps(report.to_dict(), indent=2))
    return 0 if report.ok else 1
