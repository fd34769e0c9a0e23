"""The command line's flags: each as typer declares it, and the table that spells the library's
parameters as flags (``FLAGS``), for errors and for the node's source. What each command does
with them is in :mod:`.app`."""

from __future__ import annotations

import enum
from typing import Annotated

import typer

from .._version import __version__
from ..format.names import TOOL_NAME
from ..model.runtimes import RUNTIMES
from ..plan.planner import DEFAULT_MAX_FILE_BYTES
from ..source.remote.engine import DEFAULT_STREAMS, STREAMS_ENV
from ..units import parse_size
from ..write.options import REFLINK_MODES

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
    "ep": "--ep",
    "nodes": "--nodes",
    "node": "--node",
    "redundant_experts": "--redundant-experts",
    "expert_location": "--init-expert-location",
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
    "streams": "--streams",
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
        help="checkpoint directory (plain or a Hugging Face cache snapshot), Hub repo id or s3://bucket/prefix",
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


def ranks_of(values: list[str] | None) -> list[int] | str | None:
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
VerifyRank = Annotated[
    list[str] | None,
    typer.Option(
        "--rank",
        metavar="R",
        help="check only this stage of OUT (others may be absent); repeat for several; 'auto': "
        "the stages of the node this runs on, as split takes it  [default: every stage]",
    ),
]
VerifyNnodes = Annotated[
    int | None,
    typer.Option(
        "--nnodes", metavar="N", help="with --rank auto: the node count, where the environment gives none"
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
Streams = Annotated[
    int | None,
    typer.Option(
        "--streams",
        metavar="N",
        help="reads from a Hub repo in flight at once, across and within shards  "
        f"[default: {STREAMS_ENV}, else {DEFAULT_STREAMS}]",
    ),
]
HfCache = Annotated[
    bool,
    typer.Option(
        "--hf-cache",
        help="download the shards a stage needs whole into the Hugging Face cache (reused by other "
        "tools; twice the disk) instead of straight into the stage",
    ),
]
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
MAX_FILE_DEFAULT = f"{DEFAULT_MAX_FILE_BYTES // 2**30}GiB"
