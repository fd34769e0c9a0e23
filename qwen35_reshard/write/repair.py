"""Mend a damaged split from its source: the files a verify's findings name, rewritten.

:func:`qwen35_reshard.api.repair` verifies with the source, rebuilds the plan from
:func:`recorded_identity`, has :func:`repair_files` rewrite the :func:`damaged_files` from the
source (a stage's index and manifest only when they are among them, OUT's own non-weight
files too), has :func:`remove_leftovers` delete stray data files and temporaries, and verifies
again. Files verify finds fine are never rewritten; what a rewrite cannot mend (a split from
another checkpoint; an unfinished run's marker, which only the same command removes, though
the stages it left are mended) is left for the second verify to report. All of that
under :func:`repair_lock`: a split of the same OUT meanwhile waits, and one being written is
not mended under its feet.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import BadInput, OutBusy, ReshardError
from ..format.identity import RunIdentity
from ..format.jsonio import dumps
from ..format.names import (
    CLAIM,
    GONE_SUFFIX,
    INDEX_NAME,
    JOURNAL,
    LOCK,
    PARTIAL_SUFFIX,
    RUN_MANIFEST,
    RUN_MARKER,
    STAGE_MANIFEST,
    node_dir_of,
    partial_base,
    stage_dir_rank,
)
from ..format.paths import is_plain_name
from ..plan.layout import OutputFile
from ..plan.planner import Plan, StagePlan
from ..stage.findings import EXTRA, INCOMPLETE, Finding
from ..stage.manifest import file_sha256, stage_is_complete
from ..stage.nodes import node_dirs
from ..stage.reader import RunRecord, read_manifest, read_run_record, stage_dirs
from ..transfer.copier import copy_segments
from ..transfer.segments import Segment
from ..write.manifest import run_identity, run_manifest
from . import claims
from .assemble import CopyJob, Reporter, copy_files
from .datafile import file_digests, header, matches
from .durability import Durability, fsync_dir, remove, remove_partials, write_atomic, write_error
from .finish import finish_stages, prepare_stages
from .journal import Digests
from .options import DEFAULT_WORKERS
from .outdir import check_free_space, side_file_bytes
from .sources import SourceAccess


def _dir_index(plan: Plan, dirname: str) -> int | None:
    """The plan's index of its directory ``dirname`` (``pp2``, ``pp1-node0``); None for none of its."""
    return next((s.rank for s in plan.stages if s.dirname == dirname), None)


def recorded_location(out: Path, identity: RunIdentity) -> tuple[tuple[int, ...], ...] | None:
    """SGLang's initial expert location a split records (its node manifests hold the rows, the
    identity their digest), or None for none."""
    if identity.expert_location is None:
        return None
    for path in node_dirs(out, identity.nodes).values():
        m = read_manifest(path, str(path))
        if not isinstance(m, Finding) and m.identity == identity and m.node is not None:
            return m.node.expert_location
    raise BadInput(f"{out}: no readable node manifest records the split's initial expert location")


def recorded_identity(out: Path, stage_dir: Path | None) -> RunIdentity:
    """The split's settings: from the run record beside the stages, else from a stage manifest."""
    record = read_run_record(out, str(out)) if stage_dir is None else None
    if isinstance(record, RunRecord):
        return record.identity
    candidates = [stage_dir] if stage_dir is not None else sorted(out.iterdir())
    candidates = [p for p in candidates if stage_dir_rank(p) is not None or node_dir_of(p) is not None]
    for path in candidates:
        m = read_manifest(path, str(path))
        if not isinstance(m, Finding) and m.identity is not None:
            return m.identity
    raise BadInput(
        f"{out}: no readable {RUN_MANIFEST} or stage manifest records the split's settings; it "
        "cannot be repaired: split again"
    )


@contextmanager
def repair_lock(out: Path, single: bool, on_wait: Callable[[str], None]) -> Iterator[int]:
    """Hold OUT's lock for a repair of ``out`` (``single``: of one stage directory in it),
    refusing while another live run builds a stage there (see :mod:`~.claims`). A stage
    directory with no run record beside it is on its own: nothing to lock. Yields the time the
    lock was taken (for :func:`~.claims.gone`; for a stage on its own, this host's clock: no
    other host's record is judged there); an OSError of the repair becomes one line.

    Raises:
        ReshardError: A live run claims a stage of OUT, OUT's lock cannot be written, or the
            repair failed to read or write a file.
    """
    try:
        if single and not any((out / name).exists() for name in (RUN_MANIFEST, RUN_MARKER)):
            yield time.time_ns()
            return
        with claims.locked(out, on_wait) as now:
            for stage_dir in stage_dirs(out).values():
                holder = claims.holder_of(stage_dir / CLAIM, now)
                if holder.held:
                    raise OutBusy(
                        f"{stage_dir} is being built by a qwen35-reshard run ({holder.describe()}): "
                        "run the repair again once it has finished"
                    )
            yield now
    except OSError as e:
        raise write_error(e, out, 0) from e


def without_lock(findings: list[Finding]) -> list[Finding]:
    """``findings`` of a verify run under :func:`repair_lock`, but for OUT's lock (the repair's own)."""
    return [f for f in findings if not (f.file == LOCK and f.stage is None)]


def damaged_files(
    findings: list[Finding], target: Path, plan: Plan
) -> tuple[dict[int, set[str]], bool, set[str]]:
    """Files to rewrite per stage rank, whether reshard.json is one of them, and OUT's own
    non-weight files to restore.

    A finding about a stage file names it; one about a tensor only (missing from the stage)
    names the data file the plan puts it in, and the manifest; a stage directory that is gone
    is rebuilt whole. Stray files, partial files and the journal are not the plan's: not rewritten.
    """
    files: dict[int, set[str]] = {}
    run_manifest = False
    out_side: set[str] = set()
    side = {*plan.checkpoint.extra_files, INDEX_NAME, STAGE_MANIFEST}
    for f in findings:
        if f.stage is None:
            run_manifest |= f.file == RUN_MANIFEST
            if f.file in plan.checkpoint.extra_files:
                out_side.add(f.file)
            continue
        rank = _dir_index(plan, f.stage)
        if rank is None:
            continue
        stage = plan.stages[rank]
        planned = {t.name: file.name for file in stage.files for t in file.tensors}
        names = files.setdefault(rank, set())
        if f.file in planned.values() or f.file in side:
            names.add(f.file)
        elif f.file is None and f.tensor in planned:
            names |= {planned[f.tensor], "reshard-stage.json"}
        elif f.file is None and f.tensor is None:
            names |= {*planned.values(), *side}
    if (target / RUN_MARKER).exists():
        run_manifest = False  # an unfinished run: the same command finishes it
    return {r: n for r, n in files.items() if n}, run_manifest, out_side


def source_mismatch(
    plan: Plan, out: Path, files: dict[int, set[str]], source_digests: dict[str, dict[str, str]]
) -> tuple[str, str] | None:
    """``(tensor, stage file)`` of the first tensor of the data ``files`` to rewrite whose
    source bytes (``source_digests``: digest -> tensor -> its digest, as verify hashed them)
    are not the ones its stage's manifest records; None when all are (or record none: a
    damaged manifest, shared blocks).
    Rewriting from a source that fails this would put another checkpoint's bytes in the split."""
    for rank in sorted(files):
        stage_dir = out / plan.stages[rank].dirname
        m = read_manifest(stage_dir, str(stage_dir))
        if isinstance(m, Finding):
            continue
        hashed = source_digests.get(m.digest, {})
        for name, t in sorted(m.tensors.items()):
            want = t.digest
            if t.file in files[rank] and want is not None and hashed.get(name, want) != want:
                return name, f"{plan.stages[rank].dirname}/{t.file}"
    return None


def remove_leftovers(findings: list[Finding], plan: Plan, out: Path, now: int) -> None:
    """Delete what verify found that no split holds: stray data files beside a stage's own (stale
    data a loader globbing ``*.safetensors`` would read), temporaries of an earlier run and the
    claims of gone runs. Under :func:`repair_lock` (``now``: when it was taken, see
    :func:`~.claims.gone`), where no live run claims a stage; but a run waiting for OUT's lock
    writes its record beside it meanwhile: that one stays."""
    for f in findings:
        if f.file is None or not is_plain_name(f.file):
            continue
        where = out / f.stage if f.stage is not None else out
        rank = _dir_index(plan, f.stage) if f.stage is not None else None
        in_plan = rank is not None
        planned = {file.name for file in plan.stages[rank].files} if in_plan else set()
        stray = f.kind == EXTRA and f.file.endswith(".safetensors") and f.file not in planned
        leftover = f.kind == INCOMPLETE and (f.file.endswith(PARTIAL_SUFFIX) or f.file in (JOURNAL, CLAIM))
        lock_record = partial_base(f.file) in (LOCK, LOCK + GONE_SUFFIX)
        if stray or (leftover and not (lock_record and not claims.gone_file(where / f.file, now))):
            remove(where / f.file)


def repair_files(
    plan: Plan,
    out_dir: str | os.PathLike[str],
    files: dict[int, set[str]],
    *,
    rewrite_run_manifest: bool = False,
    side_files_of_out: set[str] | frozenset[str] = frozenset(),
    workers: int = DEFAULT_WORKERS,
    reporter: Reporter | None = None,
    source: SourceAccess | None = None,
) -> list[str]:
    """Rewrite from the source exactly ``files`` of a finished split in ``out_dir``.

    Every other file is left untouched; each rewritten one is replaced atomically, so a stage
    whose manifest and index are intact stays consistent throughout. The caller holds
    :func:`repair_lock`: no live run claims a stage of ``files``.

    Args:
        plan: The plan the split was made with (rebuilt from the settings it records).
        out_dir: The run directory OUT.
        files: Stage rank -> names in its directory: its data files (rewritten from the plan),
            or its index, manifest, config.json or another side file (then the stage's
            non-weight files, manifest and index are written again, the manifest's digests
            taken from the data files, and those that are not the source's rewritten too).
        rewrite_run_manifest: Rewrite ``reshard.json`` too.
        side_files_of_out: OUT's own non-weight files to restore from the source.
        workers: Source shards copied at once.
        reporter: Progress callbacks; none by default.
        source: How the source's data files are read: the checkpoint's own files (default), or
            fetched from an object store (``SourceAccess.fetched``).

    Returns:
        The paths rewritten, relative to OUT.

    Raises:
        ReshardError: A write failed (a full disk, no permission).
    """
    reporter = reporter or Reporter()
    out = Path(out_dir)
    source = source or SourceAccess.on_disk(plan.checkpoint)
    stages = [plan.stages[r] for r in sorted(files)]
    digests: dict[int, Digests] = {s.rank: {} for s in stages}
    try:
        # Temporaries left by a killed run are removed, never written through (one may be a
        # symlink out of OUT): under the repair's lock no live run writes these stages.
        remove_partials(out, stages, own=False)
        to_write, redo_meta = _files_to_rewrite(plan, out, files, stages, digests, source)
        # What the rewritten files take before the old ones go, checked before anything changes.
        side = side_file_bytes(plan) * (len(redo_meta) + bool(side_files_of_out))
        check_free_space(out, sum(f.size for _, f in to_write) + side)
        for stage in redo_meta:
            remove(out / stage.dirname / INDEX_NAME)  # not a complete-looking stage while it is mended
        # Mended files are copied, not shared: their bytes are read and get their digests.
        durable = Durability(out, whole_fs=False)
        job = CopyJob(plan, out, to_write, source, False, durable, workers, reporter)  # copied, not shared
        copied = copy_files(job, meanwhile=lambda: None)
        for rank, found in copied.digests.items():
            digests[rank].update(found)
        for stage in stages:
            if stage not in redo_meta:
                remove(out / stage.dirname / JOURNAL)  # a finished stage holds none
        finish_stages(out, redo_meta, digests, durable, prepare_stages(plan, out, redo_meta))
        meta = (*plan.checkpoint.extra_files, STAGE_MANIFEST, INDEX_NAME)
        done = [f"{s.dirname}/{f.name}" for s, f in to_write]
        done += [f"{s.dirname}/{name}" for s in redo_meta for name in meta]
        for name in sorted(side_files_of_out):
            write_atomic(out / name, plan.checkpoint.path(name).read_bytes())
            done.append(name)
        if rewrite_run_manifest:
            identity = run_identity(plan)
            complete = [s.rank for s in plan.stages if stage_is_complete(out / s.dirname, identity)]
            side_files = {n: file_sha256(plan.checkpoint.path(n)) for n in plan.checkpoint.extra_files}
            write_atomic(out / RUN_MANIFEST, dumps(run_manifest(plan, complete, side_files)))
            done.append(RUN_MANIFEST)
        fsync_dir(out)
    except OSError as e:
        raise write_error(e, out, 0) from e
    finally:
        remove_partials(out, stages)
    return done


def _files_to_rewrite(
    plan: Plan,
    out: Path,
    files: dict[int, set[str]],
    stages: list[StagePlan],
    digests: dict[int, Digests],
    source: SourceAccess,
) -> tuple[list[tuple[StagePlan, OutputFile]], list[StagePlan]]:
    """The data files to rewrite, and the stages whose side files, manifest and index are
    written again; fills ``digests`` with those of the files kept. Changes nothing but a
    missing stage directory, made again."""
    to_write: list[tuple[StagePlan, OutputFile]] = []
    redo_meta: list[StagePlan] = []
    for stage in stages:
        stage_dir = out / stage.dirname
        names = files[stage.rank]
        data = [f for f in stage.files if f.name in names]
        stage_dir.mkdir(exist_ok=True)
        if names - {f.name for f in stage.files}:
            redo_meta.append(stage)
            # The new manifest records the digests of the data files kept, which nothing
            # vouched for (a damaged manifest is no measure): a file is kept only if its
            # header and tensors are the plan's and the source's, else it is rewritten too.
            for f in stage.files:
                if f.name not in names:
                    found = _source_digests(stage_dir / f.name, f, source)
                    data += [f] if found is None else []
                    digests[stage.rank].update(found or {})
        to_write += [(stage, f) for f in data]
    return to_write, redo_meta


def _source_digests(path: Path, f: OutputFile, source: SourceAccess) -> Digests | None:
    """The digest of each tensor of the stage's data file ``path`` when the file is ``f`` exactly:
    its size and header the plan's, each tensor's bytes its source's. None otherwise (also
    when it is missing or short)."""
    if not matches(path, f, header(f, source)):
        return None
    by_source: dict[str, list[Segment]] = {}
    for t in f.tensors:
        by_source.setdefault(t.source.file, []).append(Segment(t.name, t.source.offset, t.source.nbytes))
    found = file_digests(path, f)
    try:
        want = {}
        for file, of_source in by_source.items():
            want.update(copy_segments(source.open(file), of_source))
    except (OSError, ReshardError):  # changed since it was measured: rewritten all the same
        return None
    return found if found == want else None
