"""Execute a plan: write each selected stage's directory, crash-safe and resumable.

Every file is written under a temporary name, flushed and renamed. A stage's manifest and
then its index are written last, after its data is durable, so a run killed at any point
leaves no stage that looks complete. Finished data files are journaled with their digests,
so running the same command again keeps them and redoes only the rest.

Block sharing (``reflink``: "auto", "always" or "never", as ``cp --reflink``): when OUT can
share blocks with the source (probed once per run by sharing one block), a CLONE file is
made with ``FICLONE`` and the aligned middle of each ALIGNED run with ``FICLONERANGE``:
nothing is read or written for those bytes, so their tensors have no digest (docs/format.md,
"Data file layouts"). Where OUT cannot share, everything is copied and hashed as usual, the
same bytes land in the same files, and every tensor has its digest.

Durability (see :class:`~.durability.Durability`): a run that copies fsyncs each file it
finished; a run that shares blocks writes mostly metadata and makes a whole batch durable with
one ``syncfs`` of OUT's filesystem instead. Either way the order is the same: a file's bytes
are durable before its final name is; a stage's data files, journal removal, side files and
manifest are durable before its index is; every index before the run manifest. A stage is
finished, behind barriers of its own, as soon as its data files are all copied while later
stages' are still being copied (its ``done ppN`` then comes while the run goes on); those
completed by the last source shard are finished together, behind shared barriers. OUT looks
complete only with the run manifest, written once every stage is.

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

import os
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ELSEWHERE, BadInput, OutBusy, ReshardError, param
from ..format.identity import describe_differences
from ..format.jsonio import dumps
from ..format.names import CLAIM, RUN_MANIFEST, RUN_MARKER
from ..plan.layout import OutputFile
from ..plan.planner import Plan, StagePlan
from ..stage.manifest import damaged_side_files, file_sha256, stage_is_complete
from ..stage.nodes import split_dirs
from ..stage.reader import RunRecord, read_run_record
from ..write.manifest import run_identity, run_manifest
from . import claims
from .assemble import CopyJob, Reporter, copy_files
from .assess import OutState, assess_out, check_out_dir
from .durability import Durability, remove, remove_partials, write_atomic, write_error
from .finish import Prepared, finish_stages, prepare_stages, record_run
from .journal import Digests, keepable
from .options import DEFAULT_WORKERS, DEFAULTS, REFLINK_MODES, WriteOptions
from .outdir import (
    bytes_needed,
    can_share,
    check_free_space,
    clear_finished_journals,
    clear_split,
    clear_stage_temporaries,
    clear_temporaries,
    has_leftovers,
    make_dirs,
    resume_stage,
    split_bytes,
    undo,
    unfinished,
)
from .sources import SourceAccess, check_unchanged, source_stamps
from .stageclaims import claimed, given_up_on_failure, release

__all__ = [
    "DEFAULT_WORKERS",
    "REFLINK_MODES",
    "OutState",
    "Reporter",
    "WriteOptions",
    "WriteResult",
    "assess_out",
    "check_out_dir",
    "write_plan",
]


@dataclass
class WriteResult:
    """What a write did: stages built now, stages already complete, bytes copied and shared."""

    built: list[int] = field(default_factory=list)
    already_complete: list[int] = field(default_factory=list)
    files_kept: int = 0
    bytes_copied: int = 0  # bytes of the data files written by copying
    bytes_shared: int = 0  # bytes of the data files sharing the source's blocks (never read)
    source_bytes: int = 0  # source bytes those came from, each once (what the progress counts)
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
    options: WriteOptions = DEFAULTS,
    *,
    reporter: Reporter | None = None,
    source: SourceAccess | None = None,
) -> WriteResult:
    """Write the stages ``plan.ranks`` of ``plan`` under ``out_dir``.

    Resumes an interrupted run with the same settings; refuses a non-empty ``out_dir``
    holding anything else unless ``overwrite``. Other runs of the same split may write
    ``out_dir`` at the same time (see :mod:`~.claims`): a stage one of them is building is
    waited for (``reporter.waiting``), not built twice.

    Args:
        plan: The plan to write (``make_plan``); its selected stages are written.
        out_dir: The output directory OUT; created if missing.
        options: How to write (:class:`WriteOptions`): ``overwrite`` a split made with other
            settings that OUT holds, ``workers``, ``reflink``; its ``keep_mtp`` and
            ``max_file_bytes`` are the plan's business (``make_plan``), not read here.
        reporter: Progress callbacks; none by default.
        source: How to read the source's data files (:class:`~.sources.SourceAccess`); by
            default the checkpoint's own files, whose blocks OUT may share.

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
    if options.reflink not in REFLINK_MODES:
        raise BadInput(f"reflink must be one of {', '.join(REFLINK_MODES)}, not {options.reflink!r}")
    access = SourceAccess.on_disk(plan.checkpoint) if source is None else source
    return _Run(plan, Path(out_dir), options, access, reporter or Reporter()).execute()


@dataclass
class _Batch:
    """The stages one round of a run claimed and starts, and what it writes for them."""

    stages: list[StagePlan]
    to_write: list[tuple[StagePlan, OutputFile]]  # the data files not kept from an earlier run
    kept: dict[int, Digests]  # the digests of the files kept, by rank
    files_kept: int
    sharing: bool  # OUT shares blocks with the source
    needed: int  # bytes the batch writes


@dataclass
class _Run:
    """One :func:`write_plan` call: the plan, OUT, how to write and to read the source, and
    what the run has done so far (``result``, which it returns)."""

    plan: Plan
    out: Path
    options: WriteOptions
    source: SourceAccess
    reporter: Reporter
    result: WriteResult = field(default_factory=WriteResult)

    def execute(self) -> WriteResult:
        """Make OUT and build the selected stages not complete; nothing to do for a finished split."""
        plan, out = self.plan, self.out
        try:
            if self._finished():
                return self.result
            created = make_dirs(out)
        except OSError as e:  # OUT cannot be created or read: nothing was written
            raise write_error(e, out, 0) from e
        try:
            self._rounds()
        finally:
            undo(created)  # only what is still empty: a run that could not start, no other run beside
        self.result.already_complete = [s.rank for s in plan.selected if s.rank not in self.result.built]
        return self.result

    def _finished(self) -> bool:
        """Whether OUT holds the split finished, with nothing to clear: then it is not written
        to (on a read-only filesystem, not even its lock), but for what a killed run left there,
        when OUT's lock can be had at once."""
        plan, out = self.plan, self.out
        try:
            state = assess_out(plan, out, overwrite=self.options.overwrite)
        except ReshardError:
            if not claimed(out):
                raise
            return False  # decided under the lock, which can name the run writing OUT
        if state.action != "complete" or (out / RUN_MARKER).exists():
            return False
        leftovers = has_leftovers(out, plan.stages)
        if (leftovers or state.restamp is not None) and claims.lock_free(out):
            if leftovers:
                return False
            self._restamp(state.restamp)
        self.result.complete = list(state.complete)
        self.result.already_complete = [s.rank for s in plan.selected]
        return True

    def _rounds(self) -> None:
        """Build the selected stages not complete, in rounds: under OUT's lock, claim those no
        other live run is building and make OUT ready for them; build them; and again, waiting
        for the stages others are building, until every one is complete and the run recorded."""
        pending = list(self.plan.selected)
        told: set[int] = set()
        while True:
            batch = None
            try:
                with claims.locked(self.out, self.reporter.waiting) as now:
                    state = self._assess(now)
                    pending = [s for s in pending if s.rank not in state.complete]
                    if not pending:
                        self._close(now, state)
                        return
                    batch, busy = self._claim_and_start(pending, state)
                if batch is not None:
                    self._write(batch)
                else:
                    self._wait(busy, told)
            except OSError as e:  # a full disk, a file-size limit, ... while writing anything
                raise write_error(e, self.out, 0 if batch is None else batch.needed) from e

    def _assess(self, now: int) -> OutState:
        """Under OUT's lock: what to do with OUT, and the temporaries of gone runs cleared."""
        state = self._assess_shared(now)
        clear_temporaries(self.out, self.plan.checkpoint.extra_files, now)
        self.result.complete = list(state.complete)
        return state

    def _close(self, now: int, state: OutState) -> None:
        """Under OUT's lock, every selected stage complete: what gone runs left cleared, the
        run recorded."""
        plan, out = self.plan, self.out
        clear_stage_temporaries(out, plan.stages, now)
        clear_finished_journals(out, [s for s in plan.stages if s.rank in state.complete])
        self.result.complete = self._record(now)

    def _claim_and_start(
        self, pending: list[StagePlan], state: OutState
    ) -> tuple[_Batch | None, dict[int, claims.Owner | None]]:
        """Under OUT's lock: the run marked, the stages of ``pending`` no other live run builds
        claimed and started (None: none), and the holders of the others by rank."""
        marked = self._mark() if state.action != "replace" else False
        mine, busy = self._claim(pending, state)
        if mine:
            with given_up_on_failure(self.out, mine):  # a run that could not start
                return self._start(mine, state, marked), busy
        if marked:
            remove(self.out / RUN_MARKER)
        return None, busy

    def _write(self, batch: _Batch) -> None:
        """Build the stages of ``batch``, then give up their claims."""
        try:
            self._write_stages(batch)
        finally:
            # Whatever stopped the run (Ctrl-C, SIGTERM, a full disk), leave no temporary
            # file of its own; other runs' are theirs.
            remove_partials(self.out, batch.stages)
            release(self.out, batch.stages)

    def _wait(self, busy: dict[int, claims.Owner | None], told: set[int]) -> None:
        """Wait for the stages other live runs are building (``told``: those said already)."""
        for rank, holder in busy.items():
            if rank not in told:
                told.add(rank)
                self.reporter.waiting(
                    f"{self.out / self.plan.stages[rank].dirname} is being built by another "
                    f"qwen35-reshard run ({claims.describe(holder)}): waiting for it"
                )
        if busy:  # else the stages were finished as this run looked: the next round sees them
            claims.wait_for_change([self.out / self.plan.stages[rank].dirname / CLAIM for rank in busy])

    def _assess_shared(self, now: int) -> OutState:
        """:func:`assess_out` under OUT's lock, refusing to replace or join a split that another
        live run is writing with other settings (even with ``overwrite``: that run would be harmed)."""
        plan, out, overwrite = self.plan, self.out, self.options.overwrite
        record = read_run_record(out, str(out))
        identity = run_identity(plan)
        other = isinstance(record, RunRecord) and record.identity != identity
        state = None if other else assess_out(plan, out, overwrite=overwrite)
        if other or state.action == "replace":
            for stage_dir in split_dirs(out):
                holder = claims.holder_of(stage_dir / CLAIM, now)
                if not holder.held:
                    continue
                why = (
                    f"with other settings ({describe_differences(record.identity, identity)})"
                    if other
                    else ("from a source that changed since")
                )
                raise OutBusy(
                    f"{param('out_dir')} {out} is being written by another qwen35-reshard run "
                    f"({holder.describe()}) {why}; wait for it to finish, or {ELSEWHERE}"
                )
        return state or assess_out(plan, out, overwrite=overwrite)

    def _mark(self) -> bool:
        """Mark OUT as being written by a run of the plan's split, before any stage directory
        is made: what a killed run leaves is then known as this tool's. Returns whether it is new."""
        new = not (self.out / RUN_MARKER).exists()
        _write_marker(self.plan, self.out)
        return new

    def _claim(
        self, pending: list[StagePlan], state: OutState
    ) -> tuple[list[StagePlan], dict[int, claims.Owner | None]]:
        """Claim the stages of ``pending`` that no other live run is building (breaking the claims
        of gone ones); returns those, and the holders of the others by rank. A split being replaced
        is cleared first: no live run writes it (see :meth:`_assess_shared`)."""
        if state.action == "replace":
            return list(pending), {}
        mine: list[StagePlan] = []
        busy: dict[int, claims.Owner | None] = {}
        with given_up_on_failure(self.out, mine):  # e.g. a stage directory that cannot be made
            for stage in pending:
                stage_dir = self.out / stage.dirname
                stage_dir.mkdir(exist_ok=True)
                held = claims.try_take(stage_dir / CLAIM)
                if held is not None:
                    busy[stage.rank] = held.owner
                elif stage_is_complete(stage_dir, run_identity(self.plan)):  # finished as we looked
                    claims.release(stage_dir / CLAIM)
                else:
                    mine.append(stage)
        return mine, busy

    def _start(self, todo: list[StagePlan], state: OutState, marked: bool) -> _Batch:
        """Under OUT's lock, for the stages ``todo`` this run claimed: check that the run can
        start (sharing, free space), clear a split being replaced, mark the run as in progress
        and prepare the stages. A run that cannot start leaves OUT as it found it: every check
        comes before anything is removed, and its claims (and its marker, when ``marked`` new)
        are given up (its claims by the caller too, whatever else fails here)."""
        plan, out = self.plan, self.out
        replaced = state.action == "replace"
        # What an earlier run finished, looked at now that this run holds the stages' claims.
        kept = {} if replaced else {s.rank: keepable(plan, out / s.dirname, s) for s in todo}
        to_write = [(s, f) for s in todo for f in s.files if f.name not in kept.get(s.rank, {})]
        try:
            # Sharing needs the source on this machine: not for a source read from the Hub.
            sharing = self.source.local and can_share(plan, out, to_write, self.options.reflink)
            needed = bytes_needed(plan, todo, to_write, sharing)
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
            _write_marker(plan, out)
            for stage in todo:  # no live run writes OUT (see _assess_shared): every claim is taken
                (out / stage.dirname).mkdir(exist_ok=True)
                claims.try_take(out / stage.dirname / CLAIM)
        digests: dict[int, Digests] = {}
        for stage in todo:
            resume_stage(out / stage.dirname, stage, kept.get(stage.rank, {}))
            digests[stage.rank] = {
                t: d for file in kept.get(stage.rank, {}).values() for t, d in file.items()
            }
        remove(out / RUN_MANIFEST)
        files_kept = sum(len(files) for files in kept.values())
        return _Batch(todo, to_write, digests, files_kept, sharing, needed)

    def _write_stages(self, batch: _Batch) -> None:
        """Copy the data files and finish every stage of ``batch``, recording them in the result."""
        plan, out = self.plan, self.out
        durable = Durability(out, whole_fs=batch.sharing)
        # The marker must be in place before any data file is; when synced whole, the barrier
        # before the first data file gets its name covers it.
        durable.dirs([out], lazy=True)
        job = CopyJob(
            plan,
            out,
            batch.to_write,
            self.source,
            batch.sharing,
            durable,
            self.options.workers,
            self.reporter,
        )

        def finish(
            prepared: Prepared,
            stages: list[StagePlan],
            digests: dict[int, Digests],
            data: list[tuple[Path, Path]],
        ) -> None:
            finish_stages(
                out,
                stages,
                {s.rank: {**batch.kept[s.rank], **digests.get(s.rank, {})} for s in stages},
                durable,
                prepared.of([out / s.dirname for s in stages]),
                data=data,
                before_complete=lambda: check_unchanged(
                    plan, sorted({f for s in stages for f in s.source_files})
                ),
            )

        def finish_early(
            prepared: Prepared, stage: StagePlan, found: Digests, data: list[tuple[Path, Path]]
        ) -> None:
            finish(prepared, [stage], {stage.rank: found}, data)
            self.reporter.stage_done(stage)

        # What needs no digest is written while the workers copy.
        copied = copy_files(
            job,
            meanwhile=lambda: prepare_stages(plan, out, batch.stages),
            defer_last=True,
            finish_stage=finish_early,
        )
        rest = [s for s in batch.stages if s.rank not in copied.finished]
        finish(copied.meanwhile, rest, copied.digests, copied.deferred)
        result = self.result
        result.sharing = batch.sharing
        result.files_kept += batch.files_kept
        result.bytes_copied += copied.bytes_copied
        result.bytes_shared += copied.bytes_shared
        result.source_bytes += copied.source_bytes
        result.built += [s.rank for s in batch.stages]
        for stage in rest:
            self.reporter.stage_done(stage)

    def _restamp(self, assessed: bytes) -> None:
        """A finished split whose source files were stamped anew (a fresh download of the same
        bytes, a ``touch``), their bytes found the split's: record the new stamps, so that the
        next run needs no reads again. Only if OUT's run record is still the one ``assessed`` (no
        other run changed OUT meanwhile)."""
        with claims.locked(self.out, self.reporter.waiting) as now:
            try:
                current = (self.out / RUN_MANIFEST).read_bytes()
            except FileNotFoundError:
                return
            if current == assessed and not (self.out / RUN_MARKER).exists():
                self._record(now)

    def _record(self, now: int) -> list[int]:
        """Under OUT's lock, once this run's stages are complete: record the split as OUT holds it
        now (reshard.json from the stage manifests there, so that no run's stages are lost to
        another's record), with OUT's own files when this run built stages or they are not the
        source's (missing, damaged); the run marker goes when no other live run is writing OUT
        and no stage is left unfinished. Writes nothing when all that is so already; else sets
        ``result.wrote_run_files``. Returns the stages complete."""
        plan, out = self.plan, self.out
        identity = run_identity(plan)
        complete = [s.rank for s in plan.stages if stage_is_complete(out / s.dirname, identity)]
        # OUT itself is the model path of `vllm serve OUT --load-format qwen35-stages`: vLLM reads
        # the config and the tokenizer there (and refuses a split for SGLang in the plugin, with
        # the shim's message), each rank's weights from OUT/pp{rank}.
        side_sha256 = {name: file_sha256(plan.checkpoint.path(name)) for name in plan.checkpoint.extra_files}
        record = dumps(run_manifest(plan, complete, side_sha256))
        # The marker stays while another live run writes OUT, or while a stage a killed run left
        # unfinished holds files: its source stamps are what a resume proves those files against.
        others = any(claims.holder_of(d / CLAIM, now).held for d in split_dirs(out))
        marker = (out / RUN_MARKER).exists() and not others and not unfinished(out, plan, complete)
        side_files = bool(self.result.built) or bool(damaged_side_files(out, side_sha256))
        try:
            current = (out / RUN_MANIFEST).read_bytes()
        except FileNotFoundError:
            current = None
        if current != record or marker or side_files:
            record_run(plan, out, record, side_files=side_files, remove_marker=marker)
            self.result.wrote_run_files = True
        return complete


def _write_marker(plan: Plan, out: Path) -> None:
    """OUT's run marker for a run of ``plan``'s split: its identity and the source's stamps."""
    marker = {"identity": run_identity(plan).to_json(), "source_files": source_stamps(plan)}
    write_atomic(out / RUN_MARKER, dumps(marker), sync_dir=False)
