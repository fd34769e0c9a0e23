"""Execute a plan: write each selected stage's directory, crash-safe and resumable.

Every file is written under a temporary name, flushed and renamed. A stage's manifest and
then its index are written last, after its data is durable, so a run killed at any point
leaves no stage that looks complete. Finished data files are journaled with their digests,
so running the same command again keeps them and redoes only the rest.

Block sharing (``reflink``: "auto", "always" or "never", as ``cp --reflink``): when OUT can
share blocks with the source (probed once per run by sharing one block), a CLONE file is
made with ``FICLONE`` and the aligned middle of each ALIGNED run with ``FICLONERANGE``:
nothing is read or written for those bytes. The split then does not read them at all, so the
manifest records no sha256 for the tensors of CLONE and ALIGNED files (``null``; a CLONE of a
Hugging Face cache blob records the blob's sha256 as the file's); ``verify --source`` proves
their bytes against the source. Where OUT cannot share, everything is copied and hashed as
usual, the same bytes land in the same files, and every tensor has its digest.

Durability (see :class:`~.durability.Durability`): a run that copies fsyncs each file it
finished; a run that shares blocks writes mostly metadata and makes a whole batch durable with
one ``syncfs`` of OUT's filesystem instead. Either way the order is the same: a file's bytes
are durable before its final name is; a stage's data files, journal removal, side files and
manifest are durable before its index is; every index before the run manifest.

The rooms, in the order of a run: ``assess`` (what to do with OUT), ``outdir`` (making OUT
ready), ``assemble`` with ``datafile`` and ``journal`` (the data files), ``finish`` (the
stages' other files, manifests and indexes), all on ``durability``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ReshardError
from ..format.jsonio import dumps
from ..format.names import RUN_MANIFEST, RUN_MARKER
from ..plan.planner import OutputFile, Plan, StagePlan
from ..write.manifest import run_identity, run_manifest
from .assemble import OpenSource, Reporter, copy_files
from .assess import OutState, assess_out, check_out_dir
from .durability import Durability, remove, remove_partials, write_atomic, write_error
from .finish import Prepared, finish_stages, prepare_stages
from .journal import Digests
from .outdir import (
    can_share,
    check_free_space,
    clear_split,
    make_out,
    resume_stage,
    side_file_bytes,
    split_bytes,
    undo,
)
from .sources import check_unchanged, source_stamps

__all__ = [
    "DEFAULT_WORKERS",
    "REFLINK_MODES",
    "OutState",
    "Reporter",
    "WriteResult",
    "assess_out",
    "check_out_dir",
    "write_plan",
]

REFLINK_MODES = ("auto", "always", "never")
DEFAULT_WORKERS = 2  # source shards copied at once: the library's default and the CLI's


@dataclass
class WriteResult:
    """What a write did: stages built now, stages already complete, bytes copied and shared."""

    built: list[int] = field(default_factory=list)
    already_complete: list[int] = field(default_factory=list)
    files_kept: int = 0
    bytes_copied: int = 0  # bytes of the data files written by copying
    bytes_shared: int = 0  # bytes of the data files sharing the source's blocks (never read)
    sharing: bool = False  # OUT could share blocks with the source
    complete: list[int] = field(default_factory=list)  # every stage of the split complete in OUT now
    # OUT's run record and non-weight files written (with the stages built, or alone: they
    # were missing or damaged while every stage was complete)
    wrote_run_files: bool = False

    @property
    def nothing_to_do(self) -> bool:
        """Whether the write wrote nothing (every stage and OUT's own files were complete already)."""
        return not self.built and not self.wrote_run_files


def write_plan(
    plan: Plan,
    out_dir: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    workers: int = DEFAULT_WORKERS,
    reporter: Reporter | None = None,
    open_source: OpenSource | None = None,
    reflink: str = "auto",
) -> WriteResult:
    """Write the stages ``plan.ranks`` of ``plan`` under ``out_dir``.

    Resumes an interrupted run with the same settings; refuses a non-empty ``out_dir``
    holding anything else unless ``overwrite``.

    Args:
        plan: The plan to write (``make_plan``); its selected stages are written.
        out_dir: The output directory OUT; created if missing.
        overwrite: Replace a split made with other settings that OUT holds.
        workers: Source shards copied at once, each read by exactly one worker.
        reporter: Progress callbacks; none by default.
        open_source: ``open_source(file)`` gives the source of a data file that still has bytes
            to copy (a local path or a range source; it may download the file first); by
            default each file is read from the checkpoint's directory.
        reflink: "auto" (share the source's blocks where the filesystem can), "always"
            (refuse to run where it cannot) or "never" (copy).

    Returns:
        A :class:`WriteResult`: the stages built and already complete, bytes copied and shared.

    Raises:
        ReshardError: A bad ``reflink``; an OUT the run refuses (see :func:`assess_out`); too
            little free space; no block sharing with ``reflink="always"``; or a failed write
            (a full disk, no permission), after which the same command resumes.

    Example:
        >>> from qwen35_reshard import make_plan, read_checkpoint, write_plan
        >>> plan = make_plan(read_checkpoint(MODEL), pp=2)
        >>> result = write_plan(plan, OUT)
        >>> result.built, write_plan(plan, OUT).nothing_to_do
        ([0, 1], True)
    """
    if reflink not in REFLINK_MODES:
        raise ReshardError(f"reflink must be one of {', '.join(REFLINK_MODES)}, not {reflink!r}")
    reporter = reporter or Reporter()
    out = Path(out_dir)
    state, created = _open_out(plan, out, overwrite)
    result = WriteResult(complete=list(state.complete))
    result.already_complete = [s.rank for s in plan.selected if s.rank in state.complete]
    todo = [s for s in plan.selected if s.rank not in state.complete]
    if state.action == "complete":
        return result
    to_write = [(s, f) for s in todo for f in s.files if f.name not in state.kept.get(s.rank, {})]
    # What this run adds before its first data file, so that a run that cannot start (a
    # read-only or full OUT, no permission, no sharing where it is required) leaves OUT as it
    # found it: every check comes before anything is removed, the old run record last of all.
    created += [out / name for name in (RUN_MARKER, *(s.dirname for s in todo)) if not (out / name).exists()]
    needed = 0
    try:
        # Sharing needs the source on this machine: not for a source read from the Hub.
        result.sharing = open_source is None and can_share(plan, out, to_write, reflink)
        needed = _bytes_needed(plan, todo, to_write, result.sharing)
        digests = _start_run(plan, out, todo, state, needed, created)
        result.files_kept = state.files_kept
        _write_stages(plan, out, todo, to_write, digests, result, workers, reporter, open_source)
    except OSError as e:  # a full disk, a file-size limit, ... while writing anything
        raise write_error(e, out, needed) from e
    finally:
        # Whatever stopped the run (Ctrl-C, SIGTERM, a full disk), leave no temporary file.
        remove_partials(out, todo)
        undo(created)
    return result


def _open_out(plan: Plan, out: Path, overwrite: bool) -> tuple[OutState, list[Path]]:
    """Decide what the run does in OUT and create OUT; returns that and the directories created."""
    try:
        state = assess_out(plan, out, overwrite=overwrite)
        created = make_out(out)
        # Left if a run was killed between its last two steps. Only then is a finished split
        # written to: on a read-only filesystem, unlinking even a missing file fails.
        if state.action == "complete" and (out / RUN_MARKER).exists():
            remove(out / RUN_MARKER)
        if state.action == "complete":  # temporaries of a run killed before, which verify reports
            remove_partials(out, plan.selected)
    except OSError as e:  # OUT cannot be created or read: nothing was written
        raise write_error(e, out, 0) from e
    return state, created


def _bytes_needed(
    plan: Plan, todo: list[StagePlan], to_write: list[tuple[StagePlan, OutputFile]], sharing: bool
) -> int:
    """Bytes the run writes: its data files but what they share, and the side files' copies."""
    shared = sum(f.shareable_bytes for _, f in to_write) if sharing else 0
    side_copies = len(todo) + 1  # each stage's, and OUT's own
    return sum(f.size for _, f in to_write) - shared + side_copies * side_file_bytes(plan)


def _start_run(
    plan: Plan, out: Path, todo: list[StagePlan], state: OutState, needed: int, created: list[Path]
) -> dict[int, Digests]:
    """Check the free space, clear a split being replaced, mark the run as in progress and
    prepare its stages; returns the digests of the files kept, by rank. Empties ``created``
    once the run has begun: from then on, finished files are kept for the next run to resume."""
    replaced = state.action == "replace"
    check_free_space(out, needed, freed=split_bytes(out) if replaced else 0)
    if replaced:
        created[:] = [p for p in created if p != out / RUN_MARKER]  # the old split's record, until replaced
        clear_split(out)
    marker = {"identity": run_identity(plan).to_json(), "source_files": source_stamps(plan)}
    write_atomic(out / RUN_MARKER, dumps(marker), sync_dir=False)
    digests: dict[int, Digests] = {}
    for stage in todo:
        kept = state.kept.get(stage.rank, {})
        resume_stage(out / stage.dirname, stage, kept)
        digests[stage.rank] = {t: d for file in kept.values() for t, d in file.items()}
    created.clear()
    remove(out / RUN_MANIFEST)
    return digests


def _write_stages(
    plan: Plan,
    out: Path,
    todo: list[StagePlan],
    to_write: list[tuple[StagePlan, OutputFile]],
    digests: dict[int, Digests],
    result: WriteResult,
    workers: int,
    reporter: Reporter,
    open_source: OpenSource | None,
) -> None:
    """Copy the data files, finish every stage of ``todo`` and record the run in ``result``."""
    durable = Durability(out, whole_fs=result.sharing)
    # The marker must be in place before any data file is; when synced whole, the barrier
    # before the first data file gets its name covers it.
    durable.dirs([out], lazy=True)
    deferred: list[tuple[Path, Path]] = []
    prepared: list[Prepared] = []
    result.bytes_copied, result.bytes_shared = copy_files(
        plan,
        out,
        to_write,
        digests,
        workers,
        reporter,
        open_source,
        share=result.sharing,
        durable=durable,
        deferred=deferred,
        # What needs no digest is written while the workers copy.
        meanwhile=lambda: prepared.append(prepare_stages(plan, out, todo, side_files_of_out=True)),
    )
    result.complete = sorted({*result.complete, *(s.rank for s in todo)})
    # OUT itself is the model path of `vllm serve OUT --load-format qwen35-stages`: vLLM reads
    # the config and the tokenizer there (and refuses a split for SGLang in the plugin, with
    # the shim's message), each rank's weights from OUT/pp{rank}.
    run_record = dumps(run_manifest(plan, result.complete, prepared[0].side_sha256))
    finish_stages(
        out,
        todo,
        digests,
        durable,
        prepared[0],
        run_record=run_record,
        data=deferred,
        before_complete=lambda: check_unchanged(plan, sorted({f for s in todo for f in s.source_files})),
    )
    result.wrote_run_files = True
    for stage in todo:
        result.built.append(stage.rank)
        reporter.stage_done(stage)
