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

Runs sharing OUT (see :mod:`~.claims`): any number of runs of the same split may write one
OUT at once, on one machine or on many sharing a filesystem. Each decides what to do, and
records what it did, under OUT's lock; it builds only the stages it claims, and waits for a
stage another live run is building, then finds it complete. A run with other settings is
refused while another run writes OUT, naming that run.

The rooms, in the order of a run: ``assess`` (what to do with OUT), ``outdir`` (making OUT
ready), ``assemble`` with ``datafile`` and ``journal`` (the data files), ``finish`` (the
stages' other files, manifests and indexes), all on ``durability``.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ReshardError, param
from ..format.identity import describe_differences
from ..format.jsonio import dumps
from ..format.names import CLAIM, LOCK, RUN_MANIFEST, RUN_MARKER
from ..plan.layout import OutputFile
from ..plan.planner import Plan, StagePlan
from ..stage.manifest import damaged_side_files, file_sha256, stage_is_complete
from ..stage.reader import read_run_record, stage_dirs
from ..write.manifest import run_identity, run_manifest
from . import claims
from .assemble import OpenSource, Reporter, copy_files
from .assess import OutState, assess_out, check_out_dir
from .durability import Durability, remove, remove_partials, write_atomic, write_error
from .finish import Prepared, finish_stages, prepare_stages, record_run
from .journal import Digests, keepable
from .outdir import (
    can_share,
    check_free_space,
    clear_finished_journals,
    clear_split,
    clear_stage_temporaries,
    clear_temporaries,
    has_leftovers,
    make_dirs,
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
    holding anything else unless ``overwrite``. Other runs of the same split may write
    ``out_dir`` at the same time (see :mod:`~.claims`): a stage one of them is building is
    waited for (``reporter.waiting``), not built twice.

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
        ReshardError: A bad ``reflink``; an OUT the run refuses (see :func:`assess_out`), or
            one another run with other settings is writing; too little free space; no block
            sharing with ``reflink="always"``; or a failed write (a full disk, no permission),
            after which the same command resumes.

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
    result = WriteResult()
    try:
        try:
            state = assess_out(plan, out, overwrite=overwrite)
        except ReshardError:
            if not _claimed(out):
                raise
            state = None  # decided under the lock, which can name the run writing OUT
        # A finished split is not written to (on a read-only filesystem, not even its lock),
        # but for what a killed run left there, when OUT's lock can be had at once.
        finished = state is not None and state.action == "complete" and not (out / RUN_MARKER).exists()
        leftovers = finished and has_leftovers(out, plan.stages)
        if finished and not ((leftovers or state.restamp is not None) and _lock_free(out)):
            result.complete = list(state.complete)
            result.already_complete = [s.rank for s in plan.selected]
            return result
        if finished and not leftovers:
            _restamp(plan, out, state, result, reporter)
            return result
        created = make_dirs(out)
    except OSError as e:  # OUT cannot be created or read: nothing was written
        raise write_error(e, out, 0) from e
    try:
        _write_rounds(plan, out, overwrite, result, workers, reporter, open_source, reflink)
    finally:
        undo(created)  # only what is still empty: a run that could not start, no other run beside
    result.already_complete = [s.rank for s in plan.selected if s.rank not in result.built]
    return result


def _write_rounds(
    plan: Plan,
    out: Path,
    overwrite: bool,
    result: WriteResult,
    workers: int,
    reporter: Reporter,
    open_source: OpenSource | None,
    reflink: str,
) -> None:
    """Build the selected stages not complete, in rounds: under OUT's lock, claim those no
    other live run is building and make OUT ready for them; build them; and again, waiting
    for the stages others are building, until every one is complete and the run recorded."""
    pending = list(plan.selected)
    told: set[int] = set()
    while True:
        needed = 0
        try:
            with claims.locked(out, reporter.waiting) as now:
                state = _assess_shared(plan, out, overwrite, now)
                clear_temporaries(out, plan.checkpoint.extra_files, now)
                result.complete = list(state.complete)
                pending = [s for s in pending if s.rank not in state.complete]
                if not pending:
                    clear_stage_temporaries(out, plan.stages, now)
                    clear_finished_journals(out, [s for s in plan.stages if s.rank in state.complete])
                    result.complete = _record(plan, out, now, result)
                    return
                marked = _mark(plan, out) if state.action != "replace" else False
                mine, busy = _claim(plan, out, pending, state)
                if mine:
                    with _given_up_on_failure(out, mine):  # a run that could not start
                        to_write, digests, needed = _start_run(
                            plan, out, mine, state, result, reflink, open_source, marked
                        )
                elif marked:
                    remove(out / RUN_MARKER)
            if mine:
                try:
                    _write_stages(plan, out, mine, to_write, digests, result, workers, reporter, open_source)
                finally:
                    # Whatever stopped the run (Ctrl-C, SIGTERM, a full disk), leave no temporary
                    # file of its own; other runs' are theirs.
                    remove_partials(out, mine)
                    _release(out, mine)
                continue
            for rank, holder in busy.items():
                if rank not in told:
                    told.add(rank)
                    reporter.waiting(
                        f"{out / plan.stages[rank].dirname} is being built by another qwen35-reshard run "
                        f"({claims.describe(holder)}): waiting for it"
                    )
            if busy:  # else the stages were finished as this run looked: the next round sees them
                claims.wait_for_change([out / plan.stages[rank].dirname / CLAIM for rank in busy])
        except OSError as e:  # a full disk, a file-size limit, ... while writing anything
            raise write_error(e, out, needed) from e


def _restamp(plan: Plan, out: Path, state: OutState, result: WriteResult, reporter: Reporter) -> None:
    """A finished split whose source files were stamped anew (a fresh download of the same
    bytes, a ``touch``), their bytes found the split's: record the new stamps, so that the next
    run needs no reads again. Only if OUT's run record is still the one assessed (no other run
    changed OUT meanwhile)."""
    with claims.locked(out, reporter.waiting) as now:
        current = (out / RUN_MANIFEST).read_bytes() if (out / RUN_MANIFEST).exists() else None
        if current == state.restamp and not (out / RUN_MARKER).exists():
            _record(plan, out, now, result)
    result.complete = list(state.complete)
    result.already_complete = [s.rank for s in plan.selected]


def _release(out: Path, stages: list[StagePlan]) -> None:
    """Give up this run's claims of ``stages``."""
    for stage in stages:
        claims.release(out / stage.dirname / CLAIM)


@contextmanager
def _given_up_on_failure(out: Path, stages: list[StagePlan]) -> Iterator[None]:
    """Give up the claims of ``stages`` (as the list is when it fails) if the block fails: its
    own heartbeat would keep them alive, and the run or a later one in this process would wait
    for itself. A failure to give them up never hides the one that stopped the run."""
    try:
        yield
    except BaseException:
        with suppress(OSError):
            _release(out, stages)
        raise


def _lock_free(out: Path) -> bool:
    """Whether OUT's lock can be taken now: not held by a live run, on a filesystem that takes
    writes. Taken and given back at once: a finished split with nothing to do never waits
    (a repair may hold the lock for long) or fails (a serving node's read-only volume) only
    to clear what a killed run left."""
    try:
        held = claims.try_take(out / LOCK)
    except OSError as e:
        if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            return False
        raise
    if held is None:
        claims.release(out / LOCK)
    return held is None


def _claimed(out: Path) -> bool:
    """Whether any stage directory in OUT holds a claim (of a live run or a killed one)."""
    try:
        return any((d / CLAIM).exists() for d in stage_dirs(out).values())
    except OSError:
        return False


def _assess_shared(plan: Plan, out: Path, overwrite: bool, now: int) -> OutState:
    """:func:`assess_out` under OUT's lock, refusing to replace or join a split that another
    live run is writing with other settings (even with ``overwrite``: that run would be harmed)."""
    record = read_run_record(out, str(out))
    identity = run_identity(plan)
    other = isinstance(record, tuple) and record[1] != identity
    state = None if other else assess_out(plan, out, overwrite=overwrite)
    if other or state.action == "replace":
        for stage_dir in stage_dirs(out).values():
            holder = claims.holder_of(stage_dir / CLAIM, now)
            if holder is False:
                continue
            why = (
                f"with other settings ({describe_differences(record[1], identity)})"
                if other
                else ("from a source that changed since")
            )
            raise ReshardError(
                f"{param('out_dir')} {out} is being written by another qwen35-reshard run "
                f"({claims.describe(holder)}) {why}; wait for it to finish, or choose another directory"
            )
    return state or assess_out(plan, out, overwrite=overwrite)


def _mark(plan: Plan, out: Path) -> bool:
    """Mark OUT as being written by a run of ``plan``'s split, before any stage directory is
    made: what a killed run leaves is then known as this tool's. Returns whether it is new."""
    new = not (out / RUN_MARKER).exists()
    marker = {"identity": run_identity(plan).to_json(), "source_files": source_stamps(plan)}
    write_atomic(out / RUN_MARKER, dumps(marker), sync_dir=False)
    return new


def _claim(
    plan: Plan, out: Path, pending: list[StagePlan], state: OutState
) -> tuple[list[StagePlan], dict[int, claims.Owner | None]]:
    """Claim the stages of ``pending`` that no other live run is building (breaking the claims
    of gone ones); returns those, and the holders of the others by rank. A split being replaced
    is cleared first: no live run writes it (see :func:`_assess_shared`)."""
    if state.action == "replace":
        return list(pending), {}
    mine: list[StagePlan] = []
    busy: dict[int, claims.Owner | None] = {}
    with _given_up_on_failure(out, mine):  # e.g. a stage directory that cannot be made
        for stage in pending:
            stage_dir = out / stage.dirname
            stage_dir.mkdir(exist_ok=True)
            held = claims.try_take(stage_dir / CLAIM)
            if held is not None:
                busy[stage.rank] = held.owner
            elif stage_is_complete(stage_dir, run_identity(plan)):  # finished as we looked
                claims.release(stage_dir / CLAIM)
            else:
                mine.append(stage)
    return mine, busy


def _bytes_needed(
    plan: Plan, todo: list[StagePlan], to_write: list[tuple[StagePlan, OutputFile]], sharing: bool
) -> int:
    """Bytes the run writes: its data files but what they share, and the side files' copies."""
    shared = sum(f.shareable_bytes for _, f in to_write) if sharing else 0
    side_copies = len(todo) + 1  # each stage's, and OUT's own
    return sum(f.size for _, f in to_write) - shared + side_copies * side_file_bytes(plan)


def _start_run(
    plan: Plan,
    out: Path,
    todo: list[StagePlan],
    state: OutState,
    result: WriteResult,
    reflink: str,
    open_source: OpenSource | None,
    marked: bool,
) -> tuple[list[tuple[StagePlan, OutputFile]], dict[int, Digests], int]:
    """Under OUT's lock, for the stages ``todo`` this run claimed: check that the run can start
    (sharing, free space), clear a split being replaced, mark the run as in progress and
    prepare the stages. Returns the files to write, the digests of the files kept by rank, and
    the bytes the run writes. A run that cannot start leaves OUT as it found it: every check
    comes before anything is removed, and its claims (and its marker, when ``marked`` new)
    are given up (its claims by the caller too, whatever else fails here)."""
    replaced = state.action == "replace"
    # What an earlier run finished, looked at now that this run holds the stages' claims.
    kept = {} if replaced else {s.rank: keepable(plan, out / s.dirname, s) for s in todo}
    to_write = [(s, f) for s in todo for f in s.files if f.name not in kept.get(s.rank, {})]
    try:
        # Sharing needs the source on this machine: not for a source read from the Hub.
        result.sharing = open_source is None and can_share(plan, out, to_write, reflink)
        needed = _bytes_needed(plan, todo, to_write, result.sharing)
        check_free_space(out, needed, freed=split_bytes(out) if replaced else 0)
    except BaseException:
        for stage in todo:
            claims.release(out / stage.dirname / CLAIM)
            undo([out / stage.dirname])
        if marked:
            remove(out / RUN_MARKER)
        raise
    if replaced:
        clear_split(out)
        _mark(plan, out)
        for stage in todo:  # no live run writes OUT (see _assess_shared): every claim is taken
            (out / stage.dirname).mkdir(exist_ok=True)
            claims.try_take(out / stage.dirname / CLAIM)
    digests: dict[int, Digests] = {}
    for stage in todo:
        resume_stage(out / stage.dirname, stage, kept.get(stage.rank, {}))
        digests[stage.rank] = {t: d for file in kept.get(stage.rank, {}).values() for t, d in file.items()}
    result.files_kept += sum(len(files) for files in kept.values())
    remove(out / RUN_MANIFEST)
    return to_write, digests, needed


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
    """Copy the data files and finish every stage of ``todo``, recording them in ``result``."""
    durable = Durability(out, whole_fs=result.sharing)
    # The marker must be in place before any data file is; when synced whole, the barrier
    # before the first data file gets its name covers it.
    durable.dirs([out], lazy=True)
    deferred: list[tuple[Path, Path]] = []
    prepared: list[Prepared] = []
    copied, shared = copy_files(
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
        meanwhile=lambda: prepared.append(prepare_stages(plan, out, todo)),
    )
    result.bytes_copied += copied
    result.bytes_shared += shared
    finish_stages(
        out,
        todo,
        digests,
        durable,
        prepared[0],
        data=deferred,
        before_complete=lambda: check_unchanged(plan, sorted({f for s in todo for f in s.source_files})),
    )
    for stage in todo:
        result.built.append(stage.rank)
        reporter.stage_done(stage)


def _record(plan: Plan, out: Path, now: int, result: WriteResult) -> list[int]:
    """Under OUT's lock, once this run's stages are complete: record the split as OUT holds it
    now (reshard.json from the stage manifests there, so that no run's stages are lost to
    another's record), with OUT's own files when this run built stages or they are not the
    source's (missing, damaged); the run marker goes when no other live run is writing OUT
    and no stage is left unfinished. Writes nothing when all that is so already; else sets
    ``result.wrote_run_files``. Returns the stages complete."""
    identity = run_identity(plan)
    complete = [s.rank for s in plan.stages if stage_is_complete(out / s.dirname, identity)]
    # OUT itself is the model path of `vllm serve OUT --load-format qwen35-stages`: vLLM reads
    # the config and the tokenizer there (and refuses a split for SGLang in the plugin, with
    # the shim's message), each rank's weights from OUT/pp{rank}.
    side_sha256 = {name: file_sha256(plan.checkpoint.path(name)) for name in plan.checkpoint.extra_files}
    record = dumps(run_manifest(plan, complete, side_sha256))
    # The marker stays while another live run writes OUT, or while a stage a killed run left
    # unfinished holds files: its source stamps are what a resume proves those files against.
    others = any(claims.holder_of(d / CLAIM, now) is not False for d in stage_dirs(out).values())
    marker = (out / RUN_MARKER).exists() and not others and not _unfinished(out, plan, complete)
    side_files = bool(result.built) or bool(damaged_side_files(out, side_sha256))
    try:
        current = (out / RUN_MANIFEST).read_bytes()
    except FileNotFoundError:
        current = None
    if current != record or marker or side_files:
        record_run(plan, out, record, side_files=side_files, remove_marker=marker)
        result.wrote_run_files = True
    return complete


def _unfinished(out: Path, plan: Plan, complete: list[int]) -> bool:
    """Whether a stage of the split that is not ``complete`` in OUT holds files (what a killed
    run left there)."""
    for stage in plan.stages:
        if stage.rank in complete:
            continue
        try:
            if any((out / stage.dirname).iterdir()):
                return True
        except (FileNotFoundError, NotADirectoryError):
            continue
    return False
