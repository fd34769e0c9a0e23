"""What the CLI shows people: the plan table, the closing summary, verify's report (the copy's
progress: :mod:`.progress`).

Sizes are decimal, through :func:`units.format_bytes` (the bar, the table, the summary and
verify alike); counts through :func:`units.plural`. Tables fit an 80-column terminal.
"""

from __future__ import annotations

import re
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from rich import box
from rich.console import Console
from rich.table import Table

from ..api import ReshardProgress, ReshardResult
from ..format.names import MTP_DROPPED, RUN_MANIFEST, stage_dirname
from ..model import names
from ..model.runtimes import runtime_of
from ..plan.balance import Choice, StageLoad
from ..plan.nodes import Node
from ..plan.planner import DEFAULT_MAX_FILE_BYTES, Plan, StagePlan
from ..stage.findings import Finding
from ..units import format_bytes, plural
from ..verify import VerifyReport
from ..write.writer import OutState, WriteResult
from .nodeview import experts_cell, node_launch_lines, title_layout
from .progress import LogReporter, RichReporter


class _Unpadded:
    """``sys.stdout`` or ``sys.stderr`` (looked up at each write: the command swaps stdout for
    its guard) without the spaces rich pads a table's lines with: a file is read and grepped."""

    def __init__(self, name: str) -> None:
        self.name = name

    def write(self, text: str) -> int:
        return getattr(sys, self.name).write(_TRAILING.sub("", text))

    def flush(self) -> None:
        getattr(sys, self.name).flush()

    def isatty(self) -> bool:
        return False

    def __getattr__(self, attr: str) -> object:  # encoding, fileno, ... as the stream's
        return getattr(getattr(sys, self.name), attr)


_TRAILING = re.compile(r" +(?=\n)")


def console(name: str) -> Console:
    """A console on ``sys.stdout`` or ``sys.stderr`` (``name``): in a terminal as rich draws it;
    elsewhere (a file, a pipe, a CI log) no line wrapped mid-sentence nor padded with spaces."""
    stream = getattr(sys, name)
    if stream is not None and stream.isatty():
        return Console(stderr=name == "stderr", soft_wrap=False)
    return Console(file=_Unpadded(name), soft_wrap=True)


def _table(title: str) -> Table:
    """The tables' one style: a rule under the heads, no outer border, one space between
    columns (every column counts at 80 characters)."""
    return Table(
        title=title,
        title_justify="left",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        padding=(0, 1, 0, 0),
        pad_edge=False,
    )


def plan_table(plan: Plan, node: Node | None = None) -> Table:
    """One row per stage: layers, tensors, size, output files, source shards read, extra roles
    and whether this run builds it (for ``node``, when the stages are a node's); within 80
    columns up to pp=16 (numbers never wrap)."""
    ckpt = plan.checkpoint
    table = _table(
        f"{ckpt.display}: {plural(ckpt.num_layers, 'layer')}, {plural(len(ckpt.tensors), 'tensor')}, "
        f"{plural(len(ckpt.files), 'shard')} -> pp={plan.pp}{title_layout(plan)} "
        f"({plan.runtime})"
    )
    # "shards": source shards read, of all; "also": roles besides decoder layers; "experts" (EP,
    cols = ("stage", "layers", "tensors", "size", "files", "shards", "also", "build")
    if plan.layout.expert_parallel:  # in place of files and shards): the node's EP ranks and experts
        cols = (*cols[:4], "also", "experts", "build")
    for col in cols:
        numeric = col in ("tensors", "size", "files", "shards")
        table.add_column(col, justify="right" if numeric else "left", no_wrap=col != "also")
    skipped = False
    for s in plan.stages:
        skipped |= s.rank not in plan.ranks
        row = {
            "stage": s.dirname,
            "layers": f"{s.start_layer}-{s.end_layer - 1} ({s.end_layer - s.start_layer})",
            "tensors": str(len(s.tensors)), "size": format_bytes(s.size), "files": str(len(s.files)),
            "shards": f"{len(s.source_files)}/{len(ckpt.files)}", "also": ", ".join(s.extras) or "-",
            "experts": experts_cell(s.node) if s.node is not None else "",
            "build": "yes" if s.rank in plan.ranks else "no",
        }  # fmt: skip
        table.add_row(*map(row.__getitem__, cols))
    if skipped:
        why = "--rank" if node is None else f"this node (rank {node.rank} of {node.nnodes}) does not run it"
        table.caption = f"build no: not selected by {why}" if node is None else f"build no: {why}"
        table.caption_justify = "left"
    return table


class QuietView(ReshardProgress):
    """What ``--quiet`` shows as a run goes, on stderr: its warnings, which node it builds for
    (parameters spelt as ``flags`` maps them), and that it waits for another run writing OUT."""

    def __init__(self, flags: Mapping[str, str]) -> None:
        self.flags = flags

    def warning(self, message: str) -> None:
        print(f"warning: {message}", file=sys.stderr)

    def located(self, node: Node) -> None:
        print(node.describe(self.flags), file=sys.stderr)

    def waiting(self, message: str) -> None:
        print(message, file=sys.stderr)


class SplitView(QuietView):
    """What ``split`` and ``plan`` show as a run goes: warnings and the node, the plan (and the
    balanced choice) on ``results`` once made, then the copy's progress through ``bar`` (a
    :class:`RichReporter` in a terminal, a :class:`LogReporter` in a log)."""

    def __init__(self, results: Console, bar: RichReporter | LogReporter, flags: Mapping[str, str]) -> None:
        super().__init__(flags)
        self.results = results
        self.bar = bar
        self.node: Node | None = None

    def located(self, node: Node) -> None:
        super().located(node)
        self.node = node

    # The copy's callbacks go to the bar.
    def expect_downloads(self, total_bytes: int) -> None:
        self.bar.expect_downloads(total_bytes)

    def start(self, total_bytes: int) -> None:
        self.bar.start(total_bytes)

    def advance(self, nbytes: int) -> None:
        self.bar.advance(nbytes)

    def fetched(self, nbytes: int) -> None:
        self.bar.fetched(nbytes)

    def stage_copied(self, stage: StagePlan) -> None:
        self.bar.stage_copied(stage)

    def stage_done(self, stage: StagePlan) -> None:
        self.bar.stage_done(stage)

    def close(self) -> None:
        self.bar.close()

    def planned(self, plan: Plan, choice: Choice | None) -> None:
        self.results.print(plan_table(plan, self.node))
        if choice is not None:
            self.results.print(balance_table(choice, plan.runtime))
            for line in balance_verdict(choice):
                self.results.print(line, highlight=False)


def dry_run_lines(result: ReshardResult) -> list[tuple[str, bool | None]]:
    """What a dry run says after its plan, each line with its ``soft_wrap``: the shareable
    bytes, what a split would fetch from the Hub, what it would do in OUT, the launch line."""
    plan = result.plan
    lines: list[tuple[str, bool | None]] = [(space_line(plan), True)]
    if result.fetch is not None:
        lines.append((fetch_line(result.fetch, planned=True), None))
    if result.out_state is not None:
        lines.append((out_line(plan, result.out_dir, result.out_state), True))
    lines.append((f"dry run: nothing written. Launch with [bold]{plan.launch_env}[/]", True))
    return lines


def launch_lines(plan: Plan, out: str, node: Node | None = None) -> list[tuple[str, str]]:
    """The commands that serve the split in ``out``, each after what it is for: on one machine,
    and on one node per stage (``$R``, the stage directory quoted around it: OUT may hold spaces,
    ``$``, quotes); for ``node``, that node's own command. docs/deploy.md states the same
    commands (tests/e2e/test_launch_lines.py compares them)."""
    runtime, env, pp = runtime_of(plan.runtime), plan.launch_env, plan.pp
    if plan.layout.expert_parallel:
        return node_launch_lines(plan, out)
    if node is not None:
        stages = list(node.stages)
        stage = str(stages[0]) if len(stages) == 1 else None
        label = f"this node runs {', '.join(map(stage_dirname, stages))}" + (
            f" from {out}, each pipeline rank's stage loaded by qwen35-reshard's plugin"
            if stage is None
            else ""
        )
        return [(f"{label}:", runtime.node_serve(env, pp, out, str(node.rank), node.nnodes, stage))]
    lines = [
        (
            "on one machine, every stage (qwen35-reshard installed beside the server):",
            runtime.serve(env, pp, out),
        )
    ]
    if pp == 1:
        return lines
    if runtime.head_apart:
        return [
            *lines,
            (
                f"on {pp} nodes, one stage each: the head node (HEAD_IP) runs",
                runtime.node_serve(env, pp, out, "0", pp, "0"),
            ),
            (f"and node R = {_ranks(1, pp)}:", runtime.node_serve(env, pp, out, "$R", pp, "$R")),
        ]
    return [
        *lines,
        (
            f"on {pp} nodes, one stage each, node R = {_ranks(0, pp)}:",
            runtime.node_serve(env, pp, out, "$R", pp, "$R"),
        ),
    ]


def _ranks(first: int, pp: int) -> str:
    return str(first) if first == pp - 1 else f"{first}..{pp - 1}"


def space_line(plan: Plan) -> str:
    """The free space OUT needs for the selected stages: all of their bytes where the
    filesystem copies them; where it can share blocks with the source (XFS, Btrfs, ... on the
    source's own filesystem: ``--reflink``), only the bytes that cannot be shared. One line
    within 80 columns."""
    size = sum(s.size for s in plan.selected)
    share = sum(s.shareable_bytes for s in plan.selected)
    needed, unshared = format_bytes(size), format_bytes(size - share)
    return f"space: OUT needs {needed} free; {unshared} if it can share the source's blocks"


def out_line(plan: Plan, out: Path, state: OutState) -> str:
    """What a real run of ``plan`` would do in ``out``, as :func:`assess_out` decided."""
    todo = [s.dirname for s in plan.selected if s.rank not in state.complete]
    if state.action == "new":
        return f"{out}: new or empty: a real run writes {', '.join(todo)}"
    if state.action == "complete":
        return f"{out} already holds this split: a real run has nothing to do"
    if state.action == "replace":
        return (
            f"{out} holds a split made with other settings ({state.differences}): a real run with "
            f"--overwrite replaces it and writes {', '.join(todo)}"
        )
    done = [s.dirname for s in plan.selected if s.rank in state.complete]
    kept = [f"the complete {', '.join(done)}"] if done else []
    if state.files_kept:
        held = ", ".join(stage_dirname(r) for r in sorted(state.kept) if state.kept[r])
        kept.append(f"{plural(state.files_kept, 'finished data file')} of {held}")
    keeping = f"keeping {' and '.join(kept)}, " if kept else ""
    writes = f"writes {', '.join(todo)}" if todo else "writes the run manifest"
    return f"{out} holds an unfinished run of this split: a real run resumes it, {keeping}and {writes}"


def summary(
    console: Console, plan: Plan, result: WriteResult, out: str, seconds: float, node: Node | None = None
) -> None:
    """The closing summary: what was written, and how to launch each stage (``node``: this node)."""
    if result.nothing_to_do:
        console.print(f"[bold]{out} is already complete for this command: nothing to do.[/]")
        # Completeness is judged from sizes and manifests, not bytes: say who reads the bytes.
        source = shlex.quote(str(plan.checkpoint.root))
        console.print(
            f"Bytes are not re-read here; check them with: qwen35-reshard verify {shlex.quote(out)} "
            f"--source {source} (add --repair to rebuild damaged files)",
            soft_wrap=True,
        )
    else:
        # The source bytes, as the progress announced and counted them; the stage files hold
        # more (headers, and a tensor several stages need once in each).
        rate = result.source_bytes / seconds if seconds > 0 else 0.0
        kept = f", {plural(result.files_kept, 'file')} kept from an earlier run" if result.files_kept else ""
        shared = f", {format_bytes(result.bytes_shared)} shared with the source" if result.sharing else ""
        built = ", ".join(plan.stages[r].dirname for r in result.built)
        built = built or f"{out}'s own files and {RUN_MANIFEST} again"
        console.print(
            f"[bold green]wrote[/] {built} in {seconds:.1f} s: "
            f"{format_bytes(result.source_bytes)} of source bytes into "
            f"{format_bytes(result.bytes_copied + result.bytes_shared)} of stage files, "
            f"{format_bytes(rate)}/s{shared}{kept}"
        )
    if plan.dropped:
        console.print(f"left out on purpose (--no-mtp): {plural(len(plan.dropped), 'mtp.* tensor')}")
    if node is None:
        console.print("Launch with exactly this partition (every way to serve: docs/deploy.md):")
    else:
        console.print(f"Launch this node (rank {node.rank} of {node.nnodes}) with exactly this partition:")
    console.print(f"  [bold]{plan.launch_env}[/]", soft_wrap=True, highlight=False)
    for label, line in launch_lines(plan, out, node):
        console.print(label, soft_wrap=True, highlight=False)
        console.print(f"  {line}", soft_wrap=True, highlight=False, markup=False)


def fetch_line(fetch: dict, *, planned: bool = False) -> str:
    """What this node fetched from the Hub (or, ``planned``, would fetch for the stages
    selected), against the whole checkpoint."""
    hows = list(fetch["shards"].values())
    counts = ", ".join(f"{plural(hows.count(h), 'shard')} {label}" for h, label in _HOWS if hows.count(h))
    total = format_bytes(fetch["checkpoint_bytes"])
    if planned:
        return f"a split would fetch {format_bytes(fetch['shard_bytes_to_fetch'])} of {total} ({counts})"
    requests = plural(fetch["requests"], "request")
    fetched = format_bytes(fetch["fetched_bytes"])
    return f"fetched {fetched} of {total} in {requests} ({counts or 'no shards'})"


_HOWS = (("whole", "downloaded whole"), ("ranges", "by byte ranges"), ("cache", "from the cache"))


def verify_lines(
    report: VerifyReport, *, per_stage: int = 20, problems_only: bool = False, verdict: bool = True
) -> list[str]:
    """One line per stage, up to ``per_stage`` findings each, and a closing verdict; with
    ``problems_only``, only the findings, their stages and the verdict of a failed check.
    Without ``verdict`` (what a repair found before mending it), a count of the problems in its
    place: the repair's own report then gives the verdict."""
    lines = []
    by_stage: dict[str | None, list[Finding]] = {}
    for f in report.findings:
        by_stage.setdefault(f.stage, []).append(f)
    for f in by_stage.pop(None, []):
        lines.append(f"  {f.kind}: {f.message}")
    for s in report.stages:
        found = by_stage.pop(s.stage, [])
        if problems_only and not found:
            continue
        state = "ok" if not found else plural(len(found), "problem")
        unrecorded = (
            f"; {format_bytes(s.bytes_unrecorded)} more shared with the source when split have no digest "
            "to compare with: add --source MODEL to compare them with the source"
            if s.bytes_unrecorded and report.source is None
            else ""
        )
        lines.append(
            f"{s.path}: {state} ({plural(s.tensors, 'tensor')} in {plural(s.files, 'file')}, "
            f"{format_bytes(s.bytes)}{unrecorded})"
        )
        lines += [f"  {f.kind}: {f.message}" for f in found[:per_stage]]
        if len(found) > per_stage:
            lines.append(f"  ... and {len(found) - per_stage} more (see --json)")
    for found in by_stage.values():  # stages recorded but absent
        lines += [f"  {f.kind}: {f.message}" for f in found]
    lines += [f"warning: {w}" for w in report.unchecked]
    if report.not_built and not problems_only:
        others = ", ".join(map(stage_dirname, report.not_built))
        lines.append(f"not checked (not asked for with --rank): {others}")
    against = f" against {report.source}" if report.source else ""
    counts = ", ".join(f"{n} {k}" for k, n in report.counts().items() if n)
    found = f"{plural(len(report.findings), 'problem')}: {counts}"
    if not verdict:
        return [*lines, f"found {found}"]
    if report.ok:
        if not problems_only:
            lines.append(f"verify OK: {report.target}{against}, {plural(len(report.stages), 'stage')}")
    else:
        lines.append(f"verify FAILED: {report.target}{against}: {found}")
        if report.repairable:
            lines.append(f"to rebuild the damaged files from the source: {repair_command(report)}")
        elif report.not_from_source and report.identity is not None and report.source:
            lines.append(
                f"the split holds other bytes than {report.source}: pass the checkpoint it was made from "
                f"as --source, or replace it with a split of {report.source}: {replace_command(report)}"
            )
    return lines


def replace_command(report: VerifyReport) -> str:
    """The split command that replaces the split ``report`` checked with one of its source, with
    the settings the split records (and the stages checked, where only some were asked for)."""
    identity = report.identity
    argv = ["qwen35-reshard", "split", report.source, report.target, "--pp", str(identity.pp)]
    argv += ["--runtime", identity.runtime, "--partition", ",".join(map(str, identity.partition))]
    if identity.mtp == MTP_DROPPED:
        argv.append("--no-mtp")
    if identity.max_file_bytes != DEFAULT_MAX_FILE_BYTES:
        argv += ["--max-file-size", str(identity.max_file_bytes)]
    for rank in report.checked if report.not_built else ():
        argv += ["--rank", str(rank)]
    return shlex.join([*argv, "--overwrite"])


def repair_command(report: VerifyReport) -> str:
    """The command that mends what ``report`` found, with the source it names or the split records."""
    source = report.source or report.recorded_source or "MODEL"
    argv = ["qwen35-reshard", "verify", report.target, "--source", source]
    if not report.source and report.recorded_revision:
        argv += ["--revision", report.recorded_revision]
    return shlex.join([*argv, "--repair"])


def balance_table(choice: Choice, runtime: str) -> Table:
    """The balanced split per stage (resident GB by part; capacity columns in capacity mode),
    the bottleneck stage marked; narrow enough for an 80-column terminal up to pp=16."""
    capacity = choice.serving is not None
    table = _table(
        f"--partition balanced ({runtime}, by {'capacity' if capacity else 'weights'}): "
        f"{_csv(choice.partition)}"
    )
    # head: lm_head and the final norm. GB: the whole stage's weights (over its tp GPUs).
    cols = ["stage", "layers", "full/\nlin", "layers\nGB", "embed\nGB", "head\nGB", "mtp\nGB"]
    cols += ["vision\nGB", "total\nGB"]
    if capacity:
        cols += ["free\nGB", "requests"]
    for i, col in enumerate(cols):
        table.add_column(col, justify="left" if i < 2 else "right")
    worst = _bottleneck(choice.stages, capacity)
    for s in choice.stages:
        parts = s.parts
        row = [
            stage_dirname(s.rank) + ("*" if s.rank == worst else ""),
            f"{s.start}-{s.end - 1}",
            f"{s.full_layers}/{s.linear_layers}",
            _gb(s.layer_bytes),
            _gb(parts.get(names.EMBED, 0)),
            _gb(parts.get(names.LM_HEAD, 0) + parts.get(names.NORM, 0)),
            _gb(parts.get(names.MTP, 0)),
            # The tower and, where a runtime places it apart, its position embedding (visual.*).
            _gb(sum(n for kind, n in parts.items() if kind.split(".")[0] == names.VISUAL)),
            _gb(s.total_bytes),
        ]
        if capacity:
            row += [_gb(s.free_bytes), str(s.requests)]
        table.add_row(*row)
    return table


def balance_verdict(choice: Choice) -> list[str]:
    """What the table's marks mean, and the comparison with the runtime's default split."""
    chosen, default = choice.stages, choice.default_stages
    lines = []
    if choice.serving is not None:
        s = choice.serving
        lines += [
            f"capacity: tp={s.tp}, {s.context_length} tokens per request, {_gb(s.budget_bytes)} GB per "
            "GPU for weights + cache",
            "free: GB per GPU after the weights; * marks the stage that limits the requests",
        ]
        if min(x.requests for x in chosen) == 0:
            lines.append(
                "no split leaves room for one request of this context length on every stage: "
                "more GPU memory, a larger tp or more stages"
            )
    else:
        lines.append("* marks the fullest stage")
    if choice.default_optimal:
        lines.append(f"the default split ({_csv(choice.default)}) is already optimal")
        return lines
    before, after = _fullest(default), _fullest(chosen)
    lines += [
        f"default split {_csv(choice.default)}: fullest {_gb(before)} GB, max/mean {_max_mean(default):.3f}",
        f"balanced: fullest {_gb(after)} GB, max/mean {_max_mean(chosen):.3f}, "
        f"{_gb(before - after)} GB ({(before - after) / before:.1%}) less",
    ]
    if choice.serving is not None:
        lines.append(
            f"requests the limiting stage holds: {min(x.requests for x in default)} with the default, "
            f"{min(x.requests for x in chosen)} balanced"
        )
    if choice.default_problem:
        lines.append(f"the default split cannot be served: {choice.default_problem}")
    return lines


def _bottleneck(stages: Sequence[StageLoad], capacity: bool) -> int:
    if capacity:
        return min(stages, key=lambda s: (s.requests, -s.total_bytes)).rank
    return max(stages, key=lambda s: s.total_bytes).rank


def _fullest(stages: Sequence[StageLoad]) -> int:
    return max(s.total_bytes for s in stages)


def _max_mean(stages: Sequence[StageLoad]) -> float:
    return _fullest(stages) * len(stages) / sum(s.total_bytes for s in stages)


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f}" if n else "-"


def _csv(partition: Sequence[int]) -> str:
    return ",".join(map(str, partition))
