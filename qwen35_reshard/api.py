"""The one orchestrator: what the command line does, as library calls that return what it shows.

:func:`reshard` opens MODEL (a directory, a Hugging Face cache folder or a Hub repo id), picks
the balanced split if asked, plans, and writes the plan into OUT (or, as a dry run, says what a
run would do there); :func:`repair` verifies a split against its source, rewrites what is
damaged and verifies again. Checking alone is :func:`qwen35_reshard.verify.verify`. The CLI
parses its flags into these calls and renders their results; nothing here prints.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from .bulk import collector_paused
from .errors import BadInput, param
from .format.names import RUN_MANIFEST, node_dir_of, stage_dir_rank
from .model.parallelism import BALANCED, Parallelism, layout_of
from .model.quant import unchecked_message
from .plan.balance import Choice, choose
from .plan.capacity import Capacity
from .plan.fetch import fetch_report, needed_by
from .plan.nodes import Node, Nodes, pick_dirs
from .plan.planner import Plan, make_plan, recorded_plan
from .source.checkpoint import Checkpoint, read_checkpoint, source_fingerprint
from .source.hub.cache import HubSettings
from .source.open import open_model
from .source.remote.fetch import RemoteFetcher
from .source.remote.store import Store
from .verify.check import verify
from .verify.report import VerifyReport
from .write.manifest import run_manifest
from .write.options import DEFAULTS, WriteOptions
from .write.repair import (
    damaged_files,
    recorded_identity,
    recorded_location,
    remove_leftovers,
    repair_files,
    repair_lock,
    source_mismatch,
    without_lock,
)
from .write.sources import SourceAccess
from .write.writer import (
    OutState,
    Reporter,
    WriteResult,
    assess_out,
    check_out_dir,
    write_plan,
)

__all__ = [
    "Capacity",
    "HubSettings",
    "Nodes",
    "Parallelism",
    "RepairResult",
    "ReshardProgress",
    "ReshardResult",
    "WriteOptions",
    "repair",
    "reshard",
]


class ReshardProgress(Reporter):
    """What :func:`reshard` reports as it goes: the writer's :class:`Reporter` callbacks plus the
    orchestrator's own. Every method does nothing by default; override those you show.

    May be called from the writer's threads (``advance``).
    """

    def warning(self, message: str) -> None:
        """Something the run goes on despite (a shard file the index does not list)."""

    def located(self, node: Node) -> None:
        """The node this run builds for (``ranks="auto"``, or ``nnodes`` and ``node_rank``),
        found before the checkpoint is read."""

    def planned(self, plan: Plan, choice: Choice | None) -> None:
        """The plan is made (and the balanced ``choice``, if asked); nothing is written yet."""

    def expect_downloads(self, total_bytes: int) -> None:
        """Before writing: the bytes of the Hub shards this run downloads whole."""

    def fetched(self, nbytes: int) -> None:
        """Bytes of a whole-shard Hub download, as they arrive."""


@dataclass(frozen=True)
class ReshardResult:
    """What :func:`reshard` did, as the CLI shows it.

    ``plan`` is the split (its ``launch_env`` is the launch line's partition); ``choice`` the
    balanced split and the runtime's default beside it (``partition="balanced"`` only);
    ``unlisted`` the shard files beside the checkpoint its index does not list (ignored, as the
    servers ignore them). A dry run writes nothing: ``written`` is None and ``out_state`` says
    what a real run would do in OUT (None without OUT). A real run's ``written`` says what it
    did, in ``seconds``. ``fetch`` (a Hub repo id only) is what was fetched, or for a dry run
    what a split would fetch (:func:`qwen35_reshard.plan.fetch.fetch_report`). ``node`` is the
    node whose stages were built (``ranks="auto"``, or ``nnodes`` and ``node_rank``).
    """

    plan: Plan
    out_dir: Path | None
    choice: Choice | None = None
    unlisted: tuple[str, ...] = ()
    out_state: OutState | None = None
    written: WriteResult | None = None
    seconds: float = 0.0
    fetch: dict | None = None
    node: Node | None = None

    @property
    def dry_run(self) -> bool:
        return self.written is None

    @property
    def launch_env(self) -> str:
        """The environment assignment each stage's server is launched with."""
        return self.plan.launch_env

    @property
    def complete(self) -> list[int]:
        """The stages of the split complete in OUT (after the run; before it for a dry run)."""
        if self.written is not None:
            return list(self.written.complete)
        return list(self.out_state.complete) if self.out_state is not None else []

    @property
    def bytes_copied(self) -> int:
        return self.written.bytes_copied if self.written is not None else 0

    @property
    def bytes_shared(self) -> int:
        return self.written.bytes_shared if self.written is not None else 0

    def to_dict(self) -> dict:
        """Plain JSON-ready data (``--json``): OUT, the node, the run manifest's record of the
        split, the balanced choice, what the write did and what was fetched, where there is one."""
        doc = {"out": None if self.out_dir is None else str(self.out_dir)}
        if self.node is not None:
            doc["node"] = self.node.to_dict()
        doc.update(run_manifest(self.plan, complete=self.complete))
        if self.plan.layout.expert_parallel:  # what the printed launch line says beside the partition
            doc["server_flags"] = self.plan.layout.server_flags()
        if self.plan.unchecked:
            doc["unchecked_quantization"] = {
                "method": self.plan.unchecked,
                "warning": unchecked_message(self.plan.checkpoint.display, self.plan.unchecked),
            }
        if self.choice is not None:
            doc["balanced"] = self.choice.to_dict()
        if self.written is not None:
            w = self.written
            doc["result"] = {
                "built": w.built,
                "already_complete": w.already_complete,
                "files_kept": w.files_kept,
                "bytes_copied": w.bytes_copied,
                "bytes_shared": w.bytes_shared,
                "source_bytes": w.source_bytes,
                "seconds": round(self.seconds, 3),
            }
        if self.fetch is not None:
            doc["fetch"] = self.fetch
        return doc


def reshard(
    model: str | os.PathLike[str],
    out_dir: str | os.PathLike[str] | None,
    layout: Parallelism | None = None,
    *,
    pp: int | None = None,
    runtime: str | None = None,
    partition: Sequence[int] | str | None = None,
    ep: int | None = None,
    nodes: int | None = None,
    redundant_experts: int | None = None,
    init_expert_location: Sequence[Sequence[int]] | None = None,
    capacity: Capacity | None = None,
    ranks: Sequence[int] | str | None = None,
    node: Nodes | None = None,
    hub: HubSettings | None = None,
    write: WriteOptions = DEFAULTS,
    dry_run: bool = False,
    progress: Reporter | None = None,
) -> ReshardResult:
    """Split ``model`` into ``out_dir``/pp0, pp1, ...: what ``qwen35-reshard split`` does.

    Args:
        model: the checkpoint: its directory, a Hugging Face cache folder (``models--org--name``)
            or a Hub repo id (``Qwen/Qwen3.5-35B-A3B``), read from its index and headers only.
        out_dir: the output directory; None only with ``dry_run`` (the plan alone).
        layout: the layout to split for (:class:`Parallelism`: pipeline stages, runtime,
            partition, expert parallelism); or build it with the next seven (not both).
        pp: number of pipeline stages.
        runtime: ``"sglang"`` (default) or ``"vllm"``, the server whose split and placement rules apply.
        partition: decoder layers per stage (a list, or ``"15,15,15,15"``), ``"balanced"``
            (the split whose fullest stage holds the fewest bytes), or None for the runtime's
            own split.
        ep: expert-parallel ranks per stage: one directory per node (``OUT/pp{r}-node{k}``,
            ``OUT/node{k}`` without PP) holding its stage's other tensors and the experts its
            EP ranks start with, per expert by global id.
        nodes: with ``ep``: the nodes each stage's EP group spans.
        redundant_experts: with ``ep``: the server's redundant expert slots.
        init_expert_location: with ``ep``, SGLang: its ``--init-expert-location``'s
            ``physical_to_logical_map`` (default: its trivial location).
        capacity: with ``partition="balanced"``: size the split for serving (maximise the
            requests the worst stage holds) on these GPUs (:class:`Capacity`).
        ranks: build only these stages (default: all; with ``ep``, every node of them);
            ``"auto"``: the stages (with ``ep``: the directory) of the node this runs on, its
            index and the node count read from the scheduler's variables in ``node.env``
            (Slurm, Kubernetes, torchrun: :mod:`qwen35_reshard.plan.nodes` lists them).
        node: the node this run builds for (:class:`Nodes`): with ``nnodes`` and ``node_rank``,
            build the stages SGLang and vLLM run on that node (with ``ep``: ``node_rank`` alone,
            the servers' node rank of ``pp * nodes`` nodes, builds that node's directory); with
            ``ranks="auto"``, the count the environment must agree with, and the environment to
            read (default: ``os.environ``).
        hub: for a Hub repo id: revision, token, offline, ... (:class:`HubSettings`).
        write: what OUT gets and how it is written: ``keep_mtp``, ``max_file_bytes``,
            ``overwrite``, ``workers``, ``reflink`` (:class:`WriteOptions`).
        dry_run: plan and assess OUT only; write (and download) nothing.
        progress: progress callbacks: a :class:`Reporter`, or a :class:`ReshardProgress` to also
            hear warnings, the node, the plan before writing and Hub downloads.

    Returns:
        A :class:`ReshardResult`: the plan, the balanced choice, what was done to OUT (or would
        be, for a dry run), bytes copied and shared, and the launch line's ``launch_env``.

    Raises:
        ReshardError: in one line naming the parameter at fault; a ValueError, so ``except
            ValueError`` works. By kind (:mod:`qwen35_reshard.errors`): BadInput (a parameter,
            the checkpoint, what OUT holds), OutBusy (another live run is writing OUT:
            ``retryable``), OutError (the OS refused a write in OUT: the same call resumes),
            HubError (a Hub repo id).

    Example:
        >>> from qwen35_reshard import Nodes, Parallelism, WriteOptions, reshard
        >>> preview = reshard(MODEL, OUT, Parallelism(pp=3, partition="balanced"), dry_run=True)
        >>> preview.choice.partition, preview.out_state.action, preview.written
        ((3, 3, 2), 'new', None)
        >>> result = reshard(MODEL, OUT, pp=4, write=WriteOptions(workers=4))
        >>> result.launch_env, result.written.built, result.bytes_copied > 0
        ('SGLANG_PP_LAYER_PARTITION=2,2,2,2', [0, 1, 2, 3], True)
        >>> on_node = {"LWS_WORKER_INDEX": "1", "LWS_GROUP_SIZE": "2"}  # what LeaderWorkerSet sets
        >>> reshard(MODEL, OUT, pp=4, ranks="auto", node=Nodes(env=on_node), dry_run=True).node.describe()
        'rank 1 of 2 from LWS_WORKER_INDEX, LWS_GROUP_SIZE: stages 2, 3'
    """
    layout = layout_of(
        layout, pp=pp, runtime=runtime, partition=partition, ep=ep, nodes=nodes,
        redundant_experts=redundant_experts, init_expert_location=init_expert_location,
    )  # fmt: skip
    out = None if out_dir is None else Path(out_dir)
    _check_run(model, out, dry_run=dry_run, workers=write.workers)
    if capacity is not None and layout.partition != BALANCED:
        raise BadInput(
            f"{param('capacity')} sizes {param('partition', 'balanced')} for serving: add "
            f"{param('partition', 'balanced')}"
        )
    events = progress if isinstance(progress, ReshardProgress) else ReshardProgress()
    located, ranks = pick_dirs(ranks, node, layout, environ=os.environ)
    if located is not None:
        events.located(located)
    with collector_paused():
        ckpt, repo = _open(model, hub or HubSettings(), events)
        choice = None
        if layout.partition == BALANCED:
            choice = choose(
                ckpt, pp=layout.pp, runtime=layout.runtime, keep_mtp=write.keep_mtp, capacity=capacity
            )
            layout = layout.with_partition(choice.partition)
        plan = make_plan(
            ckpt,
            layout,
            ranks=ranks,
            keep_mtp=write.keep_mtp,
            max_file_bytes=write.max_file_bytes,
        )
    if plan.unchecked:
        events.warning(unchecked_message(ckpt.display, plan.unchecked))
    events.planned(plan, choice)
    planned = ReshardResult(plan, out, choice, tuple(ckpt.unlisted), node=located)
    if dry_run:
        return _preview(planned, repo, overwrite=write.overwrite)
    return _write(planned, repo, progress, events, write)


def _check_run(model: str | os.PathLike[str], out: Path | None, *, dry_run: bool, workers: int) -> None:
    """Refuse, before reading anything, a run with no OUT or one inside MODEL, or no workers."""
    if out is None and not dry_run:
        raise BadInput(f"{param('out_dir')} is needed to write the split; or pass {param('dry_run')}")
    if out is not None and Path(model).is_dir():
        check_out_dir(Path(model), out)
    if workers < 1:
        raise BadInput(f"{param('workers')} must be at least 1, got {workers}")


def _open(
    model: str | os.PathLike[str], settings: HubSettings, events: ReshardProgress
) -> tuple[Checkpoint, Store | None]:
    """MODEL's checkpoint (and its Hub repo, for a repo id), its unlisted shard files warned of."""
    ckpt, repo = open_model(os.fspath(model), settings)
    for name in ckpt.unlisted:
        events.warning(
            f"{ckpt.display}/{name} is not listed in the checkpoint's index: ignored, as the "
            "servers ignore it"
        )
    return ckpt, repo


def _preview(planned: ReshardResult, repo: Store | None, *, overwrite: bool) -> ReshardResult:
    """A dry run's result: what a split would fetch, and what it would do in OUT (the writer's
    own decision, refusals included)."""
    plan, out = planned.plan, planned.out_dir
    fetch = None
    if repo is not None:
        fetcher = RemoteFetcher(repo, plan.checkpoint, needed_by(plan))
        fetch = fetch_report(plan, fetcher)
        fetcher.close()
    state = assess_out(plan, out, overwrite=overwrite) if out is not None else None
    return replace(planned, out_state=state, fetch=fetch)


def _write(
    planned: ReshardResult,
    repo: Store | None,
    progress: Reporter | None,
    events: ReshardProgress,
    options: WriteOptions,
) -> ReshardResult:
    """A real run's result: the plan written into OUT, its Hub shards fetched as it goes."""
    plan = planned.plan
    started = time.monotonic()
    fetcher = None
    if repo is not None:
        fetcher = RemoteFetcher(repo, plan.checkpoint, needed_by(plan), on_fetched=events.fetched)
        events.expect_downloads(fetcher.download_bytes)
        fetcher.prepare()
    source = (
        SourceAccess.fetched(fetcher.open, fetcher.remote, fetcher.close) if fetcher is not None else None
    )
    written = write_plan(plan, planned.out_dir, options, reporter=progress, source=source)
    seconds = time.monotonic() - started
    fetch = fetch_report(plan, fetcher) if fetcher is not None else None
    return replace(planned, written=written, seconds=seconds, fetch=fetch)


# --------------------------------------------------------------------------- repair


def _refuse_other_bytes(target: Path, source: str | os.PathLike[str], tensor: str, where: str) -> None:
    raise BadInput(
        f"{param('source')} {source} is not the checkpoint {target} was split from: the bytes of "
        f"tensor {tensor!r} ({where}) differ from the ones the split records; nothing was written: "
        f"pass the checkpoint the split was made from as {param('source')}"
    )


@dataclass(frozen=True)
class RepairResult:
    """What a repair did: the first report, the paths of the files rewritten, the last report."""

    before: VerifyReport
    rewritten: list[str]
    after: VerifyReport


def repair(
    out_dir: str | os.PathLike[str],
    source: str | os.PathLike[str],
    *,
    write: WriteOptions = DEFAULTS,
    on_wait: Callable[[str], None] = lambda message: None,
    hub: HubSettings | None = None,
) -> RepairResult:
    """Verify the split in ``out_dir`` against ``source``, rewrite what is damaged, verify again.

    The plan is rebuilt from the settings the split records (as ``verify`` with a source does);
    only the files that fail their own manifest (damaged, missing or truncated) are rewritten, a
    stage's index and manifest only when among them; stray data files and temporaries verify
    names are deleted. Before anything is written, the source's bytes of the files to rewrite
    must hash to the digests their manifest records, and no intact file may hold other bytes
    than the source's: else the source is not the split's, and nothing is written.
    What a rewrite cannot mend (an unfinished run) is left for the second verify to report. In
    a run directory all of it holds OUT's lock: a split of the same OUT started meanwhile
    waits, and a split another live run is writing is refused, not mended under its feet.

    Args:
        out_dir: the run directory OUT, or one stage directory OUT/ppN.
        source: the local checkpoint directory the split was made from, its Hub repo id, or its
            ``s3://bucket/prefix`` (from a repo id or a URI only the byte ranges of the files to
            rewrite are fetched).
        write: how to write: its ``workers``, the source shards copied at once (the split's
            own settings are the ones its manifest records).
        on_wait: called with a message when the repair waits for another run changing OUT.
        hub: for a repo id ``source``: its revision (the commit the split records), token, ...

    Returns:
        A :class:`RepairResult`: the report before, the files rewritten, the report after.

    Raises:
        BadInput: ``source`` is no checkpoint (a directory, a repo id or an ``s3://`` URI), the
            split records no readable settings, or it was made from another checkpoint (another
            layout, or other bytes: one tensor named).
        OutBusy: another live run is writing it.
        OutError: a rewrite the OS refused.

    Example:
        >>> import os
        >>> from qwen35_reshard import repair, reshard
        >>> _ = reshard(MODEL, OUT, pp=2)
        >>> stage = os.path.join(OUT, "pp1")
        >>> data = sorted(f for f in os.listdir(stage) if f.endswith(".safetensors"))[0]
        >>> os.truncate(os.path.join(stage, data), 100)  # damaged: truncated
        >>> result = repair(OUT, MODEL)
        >>> result.before.ok, result.rewritten == [os.path.join(stage, data)], result.after.ok
        (False, True, True)
    """
    target = Path(out_dir)
    named = stage_dir_rank(target) is not None or node_dir_of(target) is not None
    single = named and not (target / RUN_MANIFEST).exists()
    out = target.parent if single else target
    with repair_lock(out, single, on_wait) as now:
        return _repair(target, out, single, source, write.workers, now, hub or HubSettings())


def _verify_locked(target: Path, source: str | os.PathLike[str], hub: HubSettings) -> VerifyReport:
    report = verify(target, source, hub=hub)
    report.findings = without_lock(report.findings)
    return report


def _repair(
    target: Path, out: Path, single: bool, source: str | os.PathLike[str], workers: int, now: int,
    hub: HubSettings,
) -> RepairResult:
    """:func:`repair` under OUT's lock, taken at ``now``."""
    before = _verify_locked(target, source, hub)
    if before.ok:
        return RepairResult(before, [], before)
    if before.not_from_source and before.not_from_source[0].tensor is not None:
        f = before.not_from_source[0]
        _refuse_other_bytes(target, source, f.tensor, f"{f.stage}/{f.file}")
    remote = not Path(source).is_dir()  # a repo id or an s3:// URI: open_model says which
    ckpt, repo = open_model(os.fspath(source), hub) if remote else (read_checkpoint(source), None)
    identity = recorded_identity(out, target if single else None)
    if identity.source_fingerprint != source_fingerprint(ckpt):
        raise BadInput(
            f"{target} was split from another checkpoint than {source} (or the source changed since); "
            "repair rewrites files from the checkpoint the split was made from: pass that one"
        )
    plan = recorded_plan(
        ckpt,
        Parallelism.recorded(identity, recorded_location(out, identity)),
        mtp=identity.mtp,
        max_file_bytes=identity.max_file_bytes,
        max_header_bytes=identity.max_header_bytes,
    )
    files, redo_run_manifest, out_side = damaged_files(before.findings, Path(before.target), plan)
    mismatch = source_mismatch(plan, out, files, before.source_digests)
    if mismatch is not None:
        _refuse_other_bytes(target, source, *mismatch)
    remove_leftovers(before.findings, plan, out, now)
    access = None
    if repo is not None:  # every tensor of the stages mended may be read: their shards' ranges
        needed: dict[str, set[str]] = {}
        for t in (t for rank in files for t in plan.stages[rank].tensors):
            needed.setdefault(t.source.file, set()).add(t.name)
        fetcher = RemoteFetcher(repo, ckpt, needed)
        access = SourceAccess.fetched(fetcher.open, fetcher.remote, fetcher.close)
    done = repair_files(
        plan, out, files, rewrite_run_manifest=redo_run_manifest, side_files_of_out=out_side, workers=workers,
        source=access,
    )
    return RepairResult(before, [str(out / p) for p in done], _verify_locked(target, source, hub))
