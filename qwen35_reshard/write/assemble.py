"""Assembling the data files: every file of a run made under its temporary name (cloned,
or created with its header), filled by one worker per source shard, then finished (made
durable, renamed, journaled) in batches as the shards that complete them are copied. A stage
whose data files are all copied while later shards are still being copied is handed, with its
files not yet durable, to the caller to finish at once (``finish_stage``): its log says
``done ppN`` then, not at the end of the run."""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Generic, TypeVar

from ..format.names import ALIGNED, CLONE, JOURNAL
from ..plan.layout import OutputFile
from ..plan.planner import Plan, StagePlan
from ..transfer import pages
from ..transfer.copier import copy_segments, fetch_in_place
from ..transfer.pages import drop_pages
from ..transfer.segments import Segment
from .datafile import OpenFile, clone, create, header
from .durability import Durability, partial_path, remove
from .journal import Digests, append_journal
from .sources import BlobCheck, SourceAccess, check_unchanged

T = TypeVar("T")

# Copied bytes a run that syncs its filesystem whole may hold unfinished (lost to a crash).
PROGRESS_BYTES = 1 << 30


class Reporter:
    """Progress callbacks of a write; the default reports nothing. May be called from threads."""

    def start(self, total_bytes: int) -> None:
        """Called once before copying, with the bytes that will be copied or shared."""

    def advance(self, nbytes: int) -> None:
        """Called as ``nbytes`` more bytes are copied or shared."""

    def stage_copied(self, stage: StagePlan) -> None:
        """Called once every data file of ``stage`` this run writes is copied, as it happens;
        the stage is made complete after that, behind its barriers (``stage_done``)."""

    def stage_done(self, stage: StagePlan) -> None:
        """Called when ``stage`` is complete in OUT."""

    def waiting(self, message: str) -> None:
        """Called once as the run starts waiting for another run writing OUT (``message`` says which)."""


@dataclass
class _Copy:
    """The data files of one copy, open under their temporary names, and what each source
    shard gives them."""

    opened: list[OpenFile] = field(default_factory=list)
    segments: dict[str, dict[str, Segment]] = field(default_factory=dict)  # source file -> tensor -> run
    share_fds: dict[str, set[int]] = field(default_factory=dict)  # source file -> files sharing its blocks
    shared: int = 0  # bytes sharing the source's blocks
    lock: threading.Lock = field(default_factory=threading.Lock)
    copied_stages: set[int] = field(default_factory=set)  # stages reported to stage_copied
    finished_stages: set[int] = field(default_factory=set)  # stages handed to finish_stage

    def on_shared(self, n: int) -> None:
        with self.lock:
            self.shared += n

    def open(self, job: CopyJob, stage: StagePlan, f: OutputFile) -> Digests:
        """Make ``f`` under its temporary name; returns the digests it has already (a clone's)."""
        plan, share = job.plan, job.share
        final = job.out / stage.dirname / f.name
        tmp = partial_path(final)
        if share and f.layout == CLONE and clone(plan, f, tmp):
            self.opened.append(OpenFile(stage, f, tmp, final, os.open(tmp, os.O_RDONLY), set()))
            check_unchanged(plan, [f.source_file])  # the blocks shared were the planned file's
            self.on_shared(f.size)
            return dict.fromkeys(f.tensor_names)
        sharing = share and f.layout in (CLONE, ALIGNED)
        o = create(stage, f, tmp, final, header(f, job.source), preallocate=not sharing)
        self.opened.append(o)
        if sharing:
            self.share_fds.setdefault(f.source_file, set()).add(o.fd)
        for t in f.tensors:
            s = t.source
            seg = self.segments.setdefault(s.file, {}).setdefault(s.name, Segment(s.name, s.offset, s.nbytes))
            seg.dests.append((o.fd, f.data_start + t.out_offset))
        return {}

    def source_done(self, file: str, found: Digests, digests: dict[int, Digests]) -> list[OpenFile]:
        """Record the digests the source shard ``file`` gave; returns the files it completed."""
        completed = []
        for o in self.opened:
            if file in o.pending_sources:
                digests[o.stage.rank].update(
                    {t.name: found[t.name] for t in o.plan.tensors if t.source.file == file}
                )
                o.pending_sources.discard(file)
                if not o.pending_sources:
                    completed.append(o)
                    _write_back_now(o.fd)
        return completed

    def copy_order(self) -> list[str]:
        """The source shards in the order they are copied: every shard the first stage needs
        (the vision tower's too, which every SGLang stage holds), then those the next one needs,
        ...; by name within a stage (layer order). The first stages' data is then complete early,
        not all of it with the last shard."""
        first: dict[str, int] = {}  # shard -> the lowest stage whose files still need it
        for o in self.opened:
            for file in o.pending_sources:
                first[file] = min(first.get(file, o.stage.rank), o.stage.rank)
        return sorted(self.segments, key=lambda file: (first.get(file, -1), file))

    def report_copied(self, reporter: Reporter) -> None:
        """Tell ``reporter`` of each stage whose files are all copied now, once."""
        pending = {o.stage.rank for o in self.opened if o.pending_sources}
        for o in self.opened:
            rank = o.stage.rank
            if rank not in pending and rank not in self.copied_stages:
                self.copied_stages.add(rank)
                reporter.stage_copied(o.stage)

    def take_copied_stages(
        self, ready: list[OpenFile]
    ) -> tuple[list[tuple[StagePlan, list[OpenFile]]], list[OpenFile]]:
        """The stages whose files are all copied now and not taken before, each with its files
        of ``ready``; and the rest of ``ready``."""
        pending = {o.stage.rank for o in self.opened if o.pending_sources}
        stages = {o.stage.rank: o.stage for o in self.opened if o.stage.rank not in pending}
        taken = []
        for rank, stage in stages.items():
            if rank not in self.finished_stages:
                self.finished_stages.add(rank)
                taken.append((stage, [o for o in ready if o.stage.rank == rank]))
        return taken, [o for o in ready if o.stage.rank not in self.finished_stages]

    def close(self) -> None:
        """Close and delete the files not finished (a run stopped by an error or a signal)."""
        for o in self.opened:
            if o.fd >= 0:
                os.close(o.fd)
                remove(o.tmp)


@dataclass(frozen=True)
class CopyJob:
    """The data files a run copies (or shares), and how: from ``source``, one worker per
    source shard up to ``workers``, sharing blocks where ``share``, made durable by ``durable``."""

    plan: Plan
    out: Path
    files: list[tuple[StagePlan, OutputFile]]
    source: SourceAccess
    share: bool
    durable: Durability
    workers: int
    reporter: Reporter


@dataclass
class Copied(Generic[T]):
    """What :func:`copy_files` did: bytes copied and shared, the source bytes they came from (a
    tensor several stages hold is read once: what the progress counts), the tensors' digests by
    stage, the files left for the stages' first barrier, what ``meanwhile()`` returned, and the
    stages handed to ``finish_stage`` (by rank)."""

    bytes_copied: int
    bytes_shared: int
    source_bytes: int
    digests: dict[int, Digests]
    deferred: list[tuple[Path, Path]]
    meanwhile: T
    finished: set[int] = field(default_factory=set)


# Finishes a stage whose data is copied: (meanwhile()'s result, the stage, its digests, the
# (temporary, final) names of its data files not yet durable).
FinishStage = Callable[[T, StagePlan, Digests, list[tuple[Path, Path]]], None]


def copy_files(
    job: CopyJob,
    meanwhile: Callable[[], T],
    *,
    defer_last: bool = False,
    finish_stage: FinishStage[T] | None = None,
) -> Copied[T]:
    """Copy (or share) the data of ``job.files``, one worker per source shard.

    When the filesystem is synced whole and ``defer_last``, the files finished last are left
    under their temporary names, closed, their (temporary, final) names in ``deferred``: the
    stages' first barrier makes them durable with everything else. ``meanwhile()`` runs in
    this thread while the workers copy.

    ``finish_stage``: called in this thread, as the workers go on copying, for each stage
    whose data files are all copied before the last shard is, with its files not yet durable
    (synced whole: left closed under their temporary names, as ``deferred``; else none, each
    finished and journaled as any other): it makes the stage complete. The stages completed
    by the last shard are left to the caller, which finishes them together behind shared
    barriers.
    """
    durable = job.durable
    digests: dict[int, Digests] = {stage.rank: {} for stage, _ in job.files}
    copy = _Copy()
    try:
        for stage, f in job.files:
            digests[stage.rank].update(copy.open(job, stage, f))
        source_bytes = sum(seg.nbytes for segs in copy.segments.values() for seg in segs.values())
        job.reporter.start(source_bytes)
        copy.report_copied(job.reporter)  # stages of clones alone
        # Clones are finished with the next files that are: redoing one costs nothing, so it
        # is not worth a barrier of its own. Synced file by file, they are finished now.
        ready = [o for o in copy.opened if not o.pending_sources]  # not yet durable
        if not durable.whole_fs:
            finish_files(ready, digests, durable)
            ready = []
        ready, meanwhile_result = _copy_sources(job, copy, digests, ready, meanwhile, finish_stage)
        deferred = []
        if defer_last:
            deferred = _finish_or_defer(ready, digests, durable)
        else:
            finish_files(ready, digests, durable)
        copied = sum(f.size for _, f in job.files) - copy.shared
        return Copied(
            copied, copy.shared, source_bytes, digests, deferred, meanwhile_result, copy.finished_stages
        )
    finally:
        copy.close()


def _copy_sources(
    job: CopyJob,
    copy: _Copy,
    digests: dict[int, Digests],
    ready: list[OpenFile],
    meanwhile: Callable[[], T],
    finish_stage: FinishStage[T] | None,
) -> tuple[list[OpenFile], T]:
    """Copy every source shard's runs, finishing files in batches as shards complete them,
    and stages (``finish_stage``) as their last files are copied while others still are;
    returns the completed files not finished yet (``ready`` and those after it), and what
    ``meanwhile()`` returned."""
    plan, durable = job.plan, job.durable
    stop = threading.Event()
    # Tensors per shard, for telling a cache blob copied whole (its bytes checked as they stream).
    ckpt = plan.checkpoint
    per_file = Counter(t.file for t in ckpt.tensors.values()) if ckpt.blob_sha256 else Counter()

    def run(file: str) -> Digests:
        src = job.source.open(file)
        check_unchanged(plan, [file])  # the bytes about to be read are the planned file's ...
        segments = list(copy.segments[file].values())
        # A whole-file digest needs every byte read: none of it shared with an output unread.
        whole = len(segments) == per_file[file] and not copy.share_fds.get(file)
        blob = BlobCheck.of(plan, file, src, segments) if whole else None
        found = copy_segments(
            src,
            segments,
            on_progress=job.reporter.advance,
            should_stop=stop.is_set,
            share_fds=frozenset(copy.share_fds.get(file, ())),
            on_shared=copy.on_shared,
            on_read=blob.update if blob is not None else None,
        )
        check_unchanged(plan, [file])  # ... and were, all along: nothing replaced it meanwhile
        if blob is not None:
            blob.check()
        return found

    order = copy.copy_order()
    # Every remote shard's bytes queued at once, in copy order: the fetch engine keeps its
    # streams busy across shards while the workers hash what has landed.
    remote = [
        (src, list(copy.segments[f].values())) for f in order if (src := job.source.remote(f)) is not None
    ]
    with ThreadPoolExecutor(max_workers=max(1, job.workers)) as pool:
        futures: dict[Future[Digests], str] = {}
        try:
            fetch_in_place(remote)
            futures = {pool.submit(run, file): file for file in order}
            meanwhile_result = meanwhile()
            while futures:
                done, _ = wait(futures, return_when=FIRST_COMPLETED)
                for fut in done:
                    ready += copy.source_done(futures.pop(fut), fut.result(), digests)
                copy.report_copied(job.reporter)
                if futures and finish_stage is not None:
                    taken, ready = copy.take_copied_stages(ready)
                    for stage, files in taken:
                        finish_stage(
                            meanwhile_result,
                            stage,
                            digests[stage.rank],
                            _finish_or_defer(files, digests, durable),
                        )
                if futures and _batch_due(ready, durable):
                    finish_files(ready, digests, durable)
                    ready = []
        except BaseException:
            stop.set()
            for fut in futures:
                fut.cancel()
            raise
        finally:
            job.source.close()  # no fetch writes into the files after this: the caller closes them
    return ready, meanwhile_result


def _batch_due(ready: list[OpenFile], durable: Durability) -> bool:
    """Whether the completed files ``ready`` are to be finished now, before the copy ends."""
    if not durable.whole_fs:
        return True
    # A barrier of the whole filesystem costs the same for one file or many: then files are
    # finished once enough copied bytes would be lost to a crash.
    return sum(o.plan.size - o.plan.shareable_bytes for o in ready) >= PROGRESS_BYTES


def _write_back_now(fd: int) -> None:
    """Start writing a completed file back and drop its pages (``pages.DROP_BEHIND``): its
    dirty data then goes to disk as the copy goes, not all at the barrier."""
    if pages.DROP_BEHIND:
        drop_pages(fd, 0, 0)


def _finish_or_defer(
    files: list[OpenFile], digests: dict[int, Digests], durable: Durability
) -> list[tuple[Path, Path]]:
    """Leave ``files`` for their stages' first barrier when the filesystem is synced whole
    (returns their (temporary, final) names); else finish them now, journaled as every file
    copied is (returns none)."""
    if durable.whole_fs:
        return _close_for_barrier(files)
    finish_files(files, digests, durable)
    return []


def _close_for_barrier(files: list[OpenFile]) -> list[tuple[Path, Path]]:
    """Close ``files``, left under their temporary names for the stages' first barrier, which
    makes them durable with everything else; returns their (temporary, final) names."""
    for o in files:
        os.close(o.fd)
        o.fd = -1
    return [(o.tmp, o.final) for o in files]


def finish_files(files: list[OpenFile], digests: dict[int, Digests], durable: Durability) -> None:
    """Make finished data files durable, give them their final names, and journal them.

    Files finished together (the clones, made before any copying; the files a source shard
    completes) share one barrier, one directory sync and one journal write per stage. The
    journal may lag behind the renames (a file found without its entry is redone), never
    ahead of the bytes: each entry names a file whose bytes were durable before it was renamed.
    """
    if not files:
        return
    for o in files:
        os.close(o.fd)
        o.fd = -1
    durable.files([o.tmp for o in files])
    for o in files:
        os.replace(o.tmp, o.final)
    stage_dirs = list(dict.fromkeys(o.final.parent for o in files))
    durable.dirs(stage_dirs, lazy=True)
    for stage_dir in stage_dirs:
        finished = {
            o.plan.name: {t.name: digests[o.stage.rank][t.name] for t in o.plan.tensors}
            for o in files
            if o.final.parent == stage_dir
        }
        append_journal(stage_dir, finished)
    durable.files([d / JOURNAL for d in stage_dirs], lazy=True)
