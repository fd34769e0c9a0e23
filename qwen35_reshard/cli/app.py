"""The ``qwen35-reshard`` command (typer): a thin layer over the library.

``qwen35-reshard split --pp 4 MODEL OUT`` is the main job, and ``qwen35-reshard --pp 4 MODEL
OUT`` (no command named) still runs it; ``plan`` and ``verify`` are commands beside it.
Results (the plan table, the summary, the launch line, verify's report) go to stdout, progress
and warnings to stderr; with ``--json`` stdout holds only JSON and the human output goes to
stderr. Bad input ends with one ``error: ...`` line on stderr and exit code 2, verify's findings
with 1, an interrupt with 130; a traceback only with ``--debug``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import enum
import json
import os
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn, TextIO

import typer

from .._version import __version__
from ..errors import ReshardError
from ..format.names import TOOL_NAME
from ..model.runtimes import RUNTIMES
from ..plan.planner import DEFAULT_MAX_FILE_BYTES
from ..units import parse_size
from ..write.writer import DEFAULT_WORKERS, REFLINK_MODES

if TYPE_CHECKING:
    from rich.console import Console

    from ..api import ReshardResult

# typer (0.26 to 0.28) runs on its own copy of click, typer._click (private; click itself is no
# dependency of typer, and click.exceptions' classes are others that catch none of these), and
# re-exports only BadParameter: its bases are the usage error and the error of every command line.
UsageError = typer.BadParameter.__mro__[1]
ClickException = UsageError.__mro__[1]

PROG = TOOL_NAME

# The library's parameters, as this command line spells them.
FLAGS = {
    "pp": "--pp",
    "runtime": "--runtime",
    "partition": "--partition",
    "gpu_memory": "--gpu-memory",
    "context_length": "--context-length",
    "tp": "--tp",
    "mem_fraction": "--mem-fraction",
    "ranks": "--rank",
    "nnodes": "--nnodes",
    "node_rank": "--node-rank",
    "max_file_bytes": "--max-file-size",
    "workers": "--workers",
    "overwrite": "--overwrite",
    "reflink": "--reflink",
    "dry_run": "--dry-run",
    "model_dir": "MODEL",
    "model": "MODEL",
    "revision": "--revision",
    "out_dir": "OUT",
}


# verify names the checkpoint with --source.
VERIFY_FLAGS = {
    **FLAGS,
    "model": "--source",
    "model_dir": "--source",
    "source": "--source",
    "repair": "--repair",
}


# What a run made (its plan, which holds the checkpoint) when this process is the command
# itself: kept to the end, where os._exit hands the memory back at once instead of freeing
# the ~190,000 tensors' objects of a 397B FP8 checkpoint one by one (0.1 s).
_kept: list[object] | None = None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); return the exit code.

    Without ``argv`` this process is the command itself (the console script, ``python -m``):
    it ends here, its output flushed, without the interpreter's teardown.

    stdout that cannot take the results (a full device) is one ``error:`` line, exit 2; a
    reader that went away (``| head``) ends the process as it ends ``git log``: by SIGPIPE,
    silently (in this process, ``argv`` given: the shell's status for it, 141).
    """
    global _kept
    program = argv is None
    argv = _with_command(list(sys.argv[1:] if argv is None else argv))
    command = typer.main.get_command(app)
    _kept = [] if program else None
    stdout = sys.stdout
    if stdout is not None:
        sys.stdout = _Results(stdout)
    try:
        try:
            code = command.main(args=argv, prog_name=PROG, standalone_mode=False) or 0
        except ClickException as e:  # click's usage errors: one line, no usage block
            _fail("--json" in argv, _usage_message(e))
            code = e.exit_code
        if stdout is not None:
            sys.stdout.flush()
    except _StdoutFailed as e:
        code = _reader_gone(program) if isinstance(e.cause, BrokenPipeError) else _unwritable(e.cause)
    except BrokenPipeError:  # stderr's reader went away
        code = _reader_gone(program)
    finally:
        sys.stdout = stdout
    if program:
        _exit(code)
    return code


class _StdoutFailed(Exception):
    """Writing the results to stdout failed with ``cause``: told apart from the library's OS errors."""

    def __init__(self, cause: OSError) -> None:
        super().__init__(str(cause))
        self.cause = cause


class _Results:
    """``sys.stdout`` while a command runs: a write or flush that fails raises _StdoutFailed."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as e:
            raise _StdoutFailed(e) from e

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as e:
            raise _StdoutFailed(e) from e

    def __getattr__(self, name: str) -> object:  # isatty, fileno, encoding, ... as the stream's
        return getattr(self._stream, name)


def _unwritable(e: OSError) -> int:
    """stdout cannot take the results: say so on stderr; the exit code of a refused run."""
    with contextlib.suppress(OSError):
        print(
            f"error: stdout: cannot write the results ({e.strerror or e}); make room where stdout goes "
            "or send it elsewhere",
            file=sys.stderr,
        )
    return ReshardError.exit_code


def _reader_gone(program: bool) -> int:
    """The reader of the output went away (``| head``): end silently as ``git log | head`` does,
    killed by SIGPIPE; in-process (``program`` false), return the shell's status for that."""
    if program:
        with contextlib.suppress(OSError):
            sys.stderr.flush()
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGPIPE)
    return 128 + signal.SIGPIPE


def _exit(code: int) -> NoReturn:
    """End the process with ``code`` once its output is out, skipping the interpreter's teardown."""
    # The command is over: an interrupt now just ends the process, with nothing left to say.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    for stream in (sys.stdout, sys.stderr):
        if stream is None:  # started with that descriptor closed: there was nowhere to write
            continue
        try:
            stream.flush()
        except BrokenPipeError:  # main flushed stdout: this is stderr's reader gone
            code = _reader_gone(True)
        except (OSError, ValueError):  # closed or unwritable: nothing more to say there
            pass
    os._exit(code)


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


def _fail(as_json: bool, message: str) -> None:
    """``message`` as one line on stderr; with ``--json`` also as a JSON error on stdout (when
    stdout takes it: the line on stderr is said either way)."""
    print(message, file=sys.stderr)
    if as_json:
        with contextlib.suppress(_StdoutFailed, OSError):
            print(json.dumps({"status": "error", "error": message.removeprefix("error: ")}))


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


@dataclass(frozen=True)
class Output:
    """How a command shows its results: ``--quiet``, ``--json``, ``--debug``."""

    quiet: bool
    json: bool
    debug: bool


@dataclass(frozen=True)
class PlanArgs:
    """``plan``'s arguments, named as :func:`qwen35_reshard.reshard`'s parameters."""

    model: str
    out_dir: Path | None
    pp: int
    runtime: str
    partition: str | None
    gpu_memory: int | None
    context_length: int | None
    tp: int | None
    mem_fraction: float | None
    ranks: list[int] | str | None
    nnodes: int | None
    node_rank: int | None
    keep_mtp: bool
    max_file_bytes: int
    revision: str | None
    token: str | None
    offline: bool


@dataclass(frozen=True)
class SplitArgs(PlanArgs):
    """``split``'s arguments: ``plan``'s and how to write."""

    dry_run: bool
    overwrite: bool
    workers: int
    reflink: str


@dataclass(frozen=True)
class VerifyArgs:
    """``verify``'s arguments."""

    out: Path
    source: str | None
    repair: bool
    revision: str | None
    token: str | None
    offline: bool
    ranks: list[int] | str | None = None
    nnodes: int | None = None


def _run_guarded(
    command: Callable[[object, Output], int],
    args: object,
    output: Output,
    interrupted: str,
    flags: dict[str, str] = FLAGS,
) -> None:
    """Run ``command``; errors become one line and an exit code, ``interrupted`` is what an
    interrupt (Ctrl-C, SIGINT, SIGTERM) says.

    SIGINT is handled here rather than left to Python's default, which a process started
    with SIGINT ignored (a background job, some CI runners) never installs.
    """
    previous = {sig: signal.signal(sig, _raise_interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = command(args, output)
    except ReshardError as e:
        if output.debug:
            raise
        _fail(output.json, f"error: {e.render(flags)}")
        code = e.exit_code
    except KeyboardInterrupt:
        _fail(output.json, f"interrupted: {interrupted}")
        code = 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    raise typer.Exit(code)


# --------------------------------------------------------------------------- options

Runtime = enum.Enum("Runtime", {r: r for r in RUNTIMES}, type=str)
Reflink = enum.Enum("Reflink", {m: m for m in REFLINK_MODES}, type=str)


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e


def _version(value: bool) -> None:
    if value:
        print(f"{PROG} {__version__}")
        raise typer.Exit()


Model = Annotated[
    str,
    typer.Argument(
        metavar="MODEL",
        help="checkpoint directory (plain or a Hugging Face cache snapshot) or Hub repo id",
        show_default=False,
    ),
]
Pp = Annotated[int, typer.Option("--pp", metavar="N", help="number of pipeline stages", show_default=False)]
RuntimeOpt = Annotated[
    Runtime, typer.Option("--runtime", help="server whose split and placement rules apply")
]
Partition = Annotated[
    str | None,
    typer.Option(
        "--partition",
        metavar="SPEC",
        help="explicit layers per stage, e.g. 15,15,15,15, or 'balanced': the split whose fullest "
        "stage holds the fewest bytes  [default: the runtime's own split]",
        show_default=False,
    ),
]
GpuMemory = Annotated[
    int | None,
    typer.Option(
        "--gpu-memory",
        parser=_size,
        metavar="SIZE",
        help="with --partition balanced: size for serving on GPUs of this memory, e.g. 80GB "
        "(maximise the requests the worst stage holds)",
    ),
]
Tp = Annotated[
    int | None,
    typer.Option(
        "--tp", metavar="N", help="with --gpu-memory: tensor-parallel size of each stage  [default: 1]"
    ),
]
ContextLength = Annotated[
    int | None,
    typer.Option("--context-length", metavar="TOKENS", help="with --gpu-memory: tokens per request"),
]
MemFraction = Annotated[
    float | None,
    typer.Option(
        "--mem-fraction",
        metavar="FRACTION",
        help="with --gpu-memory: share of GPU memory the server uses for weights and cache  [default: 0.9]",
    ),
]


def _ranks(values: list[str] | None) -> list[int] | str | None:
    """``--rank``'s values as the library's ``ranks``: stage numbers, or ``"auto"`` alone."""
    if not values:
        return None
    if values == ["auto"]:
        return "auto"
    for value in values:
        if not (value.isascii() and value.isdigit()):
            raise typer.BadParameter(
                f"{value} is no stage number: pass 0, 1, ... or auto (alone)", param_hint="'--rank'"
            )
    return [int(v) for v in values]


Rank = Annotated[
    list[str] | None,
    typer.Option(
        "--rank",
        metavar="R",
        help="build only this stage; repeat for several; 'auto': the stages of the node this runs "
        "on, from the scheduler's environment (Slurm, Kubernetes, torchrun)  [default: all]",
    ),
]
Nnodes = Annotated[
    int | None,
    typer.Option("--nnodes", metavar="N", help="nodes the servers run on (with --node-rank or --rank auto)"),
]
NodeRank = Annotated[
    int | None,
    typer.Option("--node-rank", metavar="R", help="build the stages the servers run on node R of --nnodes"),
]
NoMtp = Annotated[
    bool, typer.Option("--no-mtp", help="leave mtp.* out on purpose (recorded in the manifest)")
]
MaxFileSize = Annotated[
    int,
    typer.Option(
        "--max-file-size", parser=_size, metavar="SIZE", help="largest output data file, e.g. 5GB or 500MB"
    ),
]
Revision = Annotated[
    str | None,
    typer.Option("--revision", metavar="REV", help="branch, tag or commit of a Hub repo  [default: main]"),
]
Token = Annotated[
    str | None,
    typer.Option(
        "--token", metavar="TOKEN", help="Hugging Face token  [default: HF_TOKEN or the saved login]"
    ),
]
Offline = Annotated[bool, typer.Option("--offline", help="use only the Hugging Face cache")]
Quiet = Annotated[bool, typer.Option("--quiet", "-q", help="print only the launch line")]
Json = Annotated[
    bool, typer.Option("--json", help="print a machine-readable summary on stdout (human output on stderr)")
]
Debug = Annotated[bool, typer.Option("--debug", help="show tracebacks")]
Version = Annotated[
    bool,
    typer.Option("--version", callback=_version, is_eager=True, help="print the version and exit"),
]

# 5GiB: the default said in the unit it was chosen in.
_MAX_FILE_DEFAULT = f"{DEFAULT_MAX_FILE_BYTES // 2**30}GiB"

_SPLIT_EXAMPLES = f"""Examples:

\b
  {PROG} split --pp 4 Qwen3.5-35B-A3B out
  {PROG} --pp 4 Qwen3.5-35B-A3B out        # the same: split is the default
  {PROG} split --pp 8 --runtime vllm --rank 3 Qwen/Qwen3.5-397B-A17B-FP8 out
  {PROG} split --pp 4 --partition balanced --dry-run Qwen3.5-35B-A3B out
  export $({PROG} split -q --pp 4 Qwen3.5-35B-A3B out)   # the partition"""

_PLAN_EXAMPLES = f"""Examples:

\b
  {PROG} plan --pp 4 Qwen3.5-35B-A3B
  {PROG} plan --pp 4 Qwen3.5-35B-A3B out   # and what a split would do in out
  {PROG} plan --pp 16 --partition balanced --gpu-memory 80GB --tp 8 \\
      --context-length 262144 Qwen/Qwen3.5-397B-A17B-FP8
  {PROG} plan --pp 4 Qwen3.5-35B-A3B > plan.txt
  export $({PROG} plan -q --pp 4 Qwen3.5-35B-A3B)   # the partition"""

_VERIFY_EXAMPLES = f"""Examples:

\b
  {PROG} verify out
  {PROG} verify out --source Qwen3.5-35B-A3B
  {PROG} verify out/pp2 --source Qwen3.5-35B-A3B --repair
  {PROG} verify out --rank 2 --rank 3
  {PROG} verify out --json > report.json"""

app = typer.Typer(
    name=PROG,
    epilog=f"""Examples:

\b
  {PROG} split --pp 4 Qwen3.5-35B-A3B out
  {PROG} --pp 4 Qwen3.5-35B-A3B out        # the same: split is the default
  {PROG} plan --pp 4 Qwen3.5-35B-A3B
  {PROG} verify out --source Qwen3.5-35B-A3B
  {PROG} --install-completion              # Tab completion in your shell""",
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
COMMANDS = ("split", "plan", "verify")


@app.callback()
def _group(version: Version = False) -> None:
    """Split a Qwen3.5 MoE checkpoint into one Hugging Face directory per pipeline stage
    (OUT/pp0, OUT/pp1, ...). With no command named, runs split: `qwen35-reshard --pp 4 MODEL OUT`."""


@app.command(epilog=_SPLIT_EXAMPLES)
def split(
    model: Model,
    out: Annotated[Path, typer.Argument(metavar="OUT", help="output directory", show_default=False)],
    pp: Pp,
    runtime: RuntimeOpt = Runtime.sglang,
    partition: Partition = None,
    gpu_memory: GpuMemory = None,
    tp: Tp = None,
    context_length: ContextLength = None,
    mem_fraction: MemFraction = None,
    rank: Rank = None,
    nnodes: Nnodes = None,
    node_rank: NodeRank = None,
    no_mtp: NoMtp = False,
    max_file_size: MaxFileSize = _MAX_FILE_DEFAULT,
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
    quiet: Quiet = False,
    json_: Json = False,
    debug: Debug = False,
    version: Version = False,
) -> None:
    """Split MODEL into OUT/pp0, OUT/pp1, ...: one Hugging Face directory per pipeline stage,
    byte for byte, resumable. Prints the launch line for the server."""
    args = SplitArgs(
        model, out, pp, runtime.value, partition, gpu_memory, context_length, tp, mem_fraction,
        _ranks(rank), nnodes, node_rank, not no_mtp, max_file_size, revision, token, offline, dry_run,
        overwrite, workers, reflink.value,
    )  # fmt: skip
    _run_guarded(
        _reshard,
        args,
        Output(quiet, json_, debug),
        "nothing was written"
        if dry_run
        else "unfinished files were removed; run the same command again to resume",
    )


@app.command(epilog=_PLAN_EXAMPLES)
def plan(
    model: Model,
    pp: Pp,
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
    no_mtp: NoMtp = False,
    max_file_size: MaxFileSize = _MAX_FILE_DEFAULT,
    revision: Revision = None,
    token: Token = None,
    offline: Offline = False,
    quiet: Quiet = False,
    json_: Json = False,
    debug: Debug = False,
    version: Version = False,
) -> None:
    """Show how MODEL splits into pipeline stages (from its index and headers); write nothing."""
    args = PlanArgs(
        model, out, pp, runtime.value, partition, gpu_memory, context_length, tp, mem_fraction,
        _ranks(rank), nnodes, node_rank, not no_mtp, max_file_size, revision, token, offline,
    )  # fmt: skip
    _run_guarded(_reshard, args, Output(quiet, json_, debug), "nothing was written")


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
            help="rewrite from --source exactly the files found damaged, missing or truncated, "
            "then verify again",
        ),
    ] = False,
    rank: Annotated[
        list[str] | None,
        typer.Option(
            "--rank",
            metavar="R",
            help="check only this stage of OUT (others may be absent); repeat for several; 'auto': "
            "the stages of the node this runs on, as split takes it  [default: every stage]",
        ),
    ] = None,
    nnodes: Nnodes = None,
    revision: Revision = None,
    token: Token = None,
    offline: Offline = False,
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
    args = VerifyArgs(out, source, repair, revision, token, offline, _ranks(rank), nnodes)
    _run_guarded(
        _verify,
        args,
        Output(quiet, json_, debug),
        "files rewritten so far are complete; run the same command again to finish the repair"
        if repair
        else "nothing was written",
        VERIFY_FLAGS,
    )


# --------------------------------------------------------------------------- split and plan


def _consoles(output: Output) -> tuple[Console, Console]:
    """(results, progress): results on stdout, or on stderr beside ``--json``; progress on stderr."""
    from rich.console import Console

    progress = Console(stderr=True)
    return (progress if output.json else Console(soft_wrap=False)), progress


def _reshard(args: PlanArgs, output: Output) -> int:
    """``split`` and ``plan``: the library's reshard, its plan shown once made, then its result."""
    from ..api import reshard
    from .report import QuietView, SplitView, dry_run_lines, fetch_line, summary

    results, progress = _consoles(output)
    view = QuietView(FLAGS) if output.quiet else SplitView(results, progress, FLAGS)
    # plan is a dry run of split.
    kwargs = {"dry_run": True, **{f.name: getattr(args, f.name) for f in dataclasses.fields(args)}}
    try:
        result = reshard(**kwargs, progress=view)
    finally:
        if isinstance(view, SplitView):
            view.close()
    if _kept is not None:
        _kept.append(result.plan)
    plan = result.plan
    if result.dry_run:
        if not output.quiet:
            for line, wrap in dry_run_lines(result):
                results.print(line, highlight=False, soft_wrap=wrap)
    elif not output.quiet:
        summary(results, plan, result.written, str(args.out_dir), result.seconds, result.node)
        if result.fetch is not None:
            results.print(fetch_line(result.fetch), highlight=False)
    if output.quiet:
        results.print(plan.launch_env, highlight=False, markup=False, soft_wrap=True)
    if output.json:
        print(json.dumps(_json_doc(result), indent=2))
    return 0


def _json_doc(result: ReshardResult) -> dict:
    """``--json``'s summary: the status, then the result's own record."""
    if result.dry_run:
        status = "dry_run"
    else:
        status = "nothing_to_do" if result.written.nothing_to_do else "ok"
    doc = {"status": status, **result.to_dict()}
    if result.node is not None:  # its source in this command line's flags
        doc["node"] = result.node.to_dict(FLAGS)
    return doc


# --------------------------------------------------------------------------- verify


def _verify(args: VerifyArgs, output: Output) -> int:
    """``verify``: the report on stdout (stderr beside ``--json``), the JSON report with ``--json``."""
    from ..source.hub.cache import HubSettings
    from ..verify import verify
    from .report import verify_lines

    out = sys.stderr if output.json else sys.stdout
    if args.repair:
        if args.source is None:
            raise ReshardError("--repair rewrites files from the checkpoint: pass --source MODEL")
        from ..api import repair

        if args.ranks is not None:
            raise ReshardError("--repair mends the stages found damaged: drop --rank")
        result = repair(args.out, args.source, on_wait=lambda message: print(message, file=sys.stderr))
        if not result.before.ok:
            for line in verify_lines(result.before, problems_only=output.quiet)[:-1]:
                print(line, file=out)
            for path in result.rewritten:
                print(f"repaired: {path}", file=out)
        report = result.after
    else:
        settings = HubSettings(revision=args.revision, token=args.token, offline=args.offline)
        report = verify(args.out, args.source, ranks=args.ranks, nnodes=args.nnodes, hub_settings=settings)
    for line in verify_lines(report, problems_only=output.quiet):
        print(line, file=out)
    if output.json:
        print(json.dumps(report.to_dict(), indent=2))
    return 0 if report.ok else 1
