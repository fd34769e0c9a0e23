"""The command line's flags: each as typer declares it, and the table that spells the library's
parameters as flags (``FLAGS``), for errors and for the node's source. What each command does
with them is in :mod:`.app`."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Annotated

import typer

from .._version import __version__
from ..errors import BadInput
from ..format.names import TOOL_NAME
from ..model.parallelism import Parallelism
from ..model.runtimes import RUNTIMES
from ..plan.nodes import Nodes
from ..plan.planner import DEFAULT_MAX_FILE_BYTES
from ..source.remote.settings import DEFAULT_STREAMS, STREAMS_ENV
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
    "init_expert_location": "--init-expert-location",
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


# With --ep, a node is picked by --node: the library's node_rank and ranks="auto" are its.
EP_FLAGS = {**FLAGS, "node_rank": "--node", "ranks": "--node", "nnodes": "--pp x --nodes"}

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
Pp = Annotated[
    int | None,
    typer.Option(
        "--pp", metavar="N", help="number of pipeline stages (1 with --ep alone)", show_default=False
    ),
]
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
Ep = Annotated[
    int,
    typer.Option(
        "--ep", metavar="E", help="expert-parallel ranks per stage: one directory per node (with --nodes)"
    ),
]
EpNodes = Annotated[
    int,
    typer.Option(
        "--nodes",
        metavar="N",
        help="with --ep: nodes each stage's EP group spans; node k hosts EP ranks [k*E/N, (k+1)*E/N) "
        "(the deployment has --pp x --nodes nodes)",
    ),
]
RedundantExperts = Annotated[
    int,
    typer.Option(
        "--redundant-experts",
        metavar="R",
        help="with --ep: redundant expert slots (vLLM's EPLB num_redundant_experts, SGLang's "
        "--ep-num-redundant-experts)",
    ),
]
InitExpertLocation = Annotated[
    str | None,
    typer.Option(
        "--init-expert-location",
        metavar="FILE",
        help="with --ep and --runtime sglang: SGLang's --init-expert-location (a .json file or inline "
        "JSON with physical_to_logical_map)  [default: trivial]",
    ),
]
NodeOpt = Annotated[
    str | None,
    typer.Option(
        "--node",
        metavar="G",
        help="with --ep: build only node G of --pp x --nodes (the servers' --node-rank); 'auto': this "
        "node, from the scheduler's environment",
    ),
]
@dataclass(frozen=True)
class ExpertArgs:
    """``split``'s expert-parallel flags: the layout they make and the node ``--node`` picks.

    With ``--ep``, OUT holds one directory per node of ``--pp x --nodes`` and ``--node G``
    (``auto``: from the scheduler, as ``--rank auto``) picks one by the servers' node rank;
    ``--nnodes`` and ``--node-rank``, which pick pipeline stages, are refused beside it, and
    ``--node`` without ``--ep`` (there every node's stages are ``--node-rank``'s).
    """

    ep: int
    nodes: int
    redundant_experts: int
    init_expert_location: str | None
    node: str | None

    def layout(self, pp: int | None, runtime: str, partition: str | None) -> Parallelism:
        from ..model.experts import read_expert_location

        if pp is None:  # expert parallelism alone is one stage; a pipeline split names its size
            if self.ep == 1:
                raise BadInput("--pp is needed: the number of pipeline stages, e.g. --pp 4")
            pp = 1

        rows = None if self.init_expert_location is None else read_expert_location(self.init_expert_location)
        return Parallelism(pp, runtime, partition, self.ep, self.nodes, self.redundant_experts, rows)

    def node_pick(
        self, ranks: list[int] | str | None, nnodes: int | None, node_rank: int | None
    ) -> tuple[list[int] | str | None, Nodes | None]:
        """``ranks`` and ``node`` for :func:`~qwen35_reshard.api.reshard`; one line for a mix
        of flags that pick nodes two ways."""
        if self.ep == 1:
            if self.node is not None:
                raise BadInput(
                    "--node picks a node directory of an expert-parallel split: add --ep, or pick "
                    "pipeline stages with --rank or --nnodes and --node-rank"
                )
            return ranks, None if nnodes is None and node_rank is None else Nodes(nnodes, node_rank)
        if nnodes is not None or node_rank is not None:
            raise BadInput(
                "with --ep, OUT has one directory per node of --pp x --nodes: pick one with --node G "
                "(the servers' --node-rank) or --node auto, not --nnodes/--node-rank"
            )
        if self.node is None:
            return ranks, None
        if ranks is not None:
            raise BadInput("--node picks one node's directory: drop --rank (it picks every node of a stage)")
        if self.node == "auto":
            return "auto", None
        if not (self.node.isascii() and self.node.isdigit()):
            raise BadInput(f"--node {self.node} is no node number: pass 0, 1, ... or auto")
        return None, Nodes(node_rank=int(self.node))  # the servers' node rank: --node's (EP_FLAGS)


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
