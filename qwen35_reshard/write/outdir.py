"""Making OUT ready for a run: creating it (and undoing that when the run cannot start),
checking its free space and whether it can share blocks with the source, clearing a split
made with other settings, and clearing what an unfinished stage will rewrite."""

from __future__ import annotations

import shutil
import stat
from pathlib import Path

from ..errors import ELSEWHERE, BadInput, OutError, param
from ..format.jsonio import dumps
from ..format.names import (
    ALIGNED,
    CLAIM,
    CLONE,
    CONFIG_NAME,
    GONE_SUFFIX,
    INDEX_NAME,
    JOURNAL,
    LOCK,
    PARTIAL_SUFFIX,
    RUN_MANIFEST,
    RUN_MARKER,
    STAGE_MANIFEST,
    partial_base,
)
from ..plan.layout import OutputFile
from ..plan.planner import Plan, StagePlan
from ..stage.nodes import split_dirs
from ..stage.reader import RunRecord, read_run_record
from ..transfer import reflink as reflinks
from ..units import format_bytes
from . import claims
from .assess import run_temporary
from .claims import is_mine
from .durability import partial_path, remove, remove_partials, write_atomic
from .journal import Digests

STAT_BLOCK_BYTES = 512  # the unit of ``st_blocks`` (POSIX), whatever the filesystem's block size


def clear_temporaries(out: Path, side_files: list[str], now: int) -> None:
    """Delete the temporary files of other runs in OUT itself. Called under OUT's lock, under
    which alone those are written: what is there is a killed run's. But for those of runs
    taking or breaking the lock, written beside it without it: the record of a run taking it,
    and a lock moved aside by a run breaking it (which may be ours, to be put back: see
    :func:`~.claims.try_take`), only when the run it records is gone (``now``: see
    :func:`~.claims.gone`)."""
    for p in list(out.iterdir()):
        if p.name == LOCK or not run_temporary(p.name, side_files) or is_mine(p.name):
            continue
        if partial_base(p.name) not in (LOCK, LOCK + GONE_SUFFIX) or claims.gone_file(p, now):
            remove(p)


def make_dirs(path: Path) -> list[Path]:
    """``mkdir -p path``, returning the directories it created, outermost first."""
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    created = []
    try:
        for d in reversed(missing):
            try:
                d.mkdir()
            except FileExistsError:
                if not d.is_dir():
                    raise
                continue  # made by another run starting at the same moment: not ours to undo
            created.append(d)
    except OSError:
        undo(created)
        raise
    return created


def undo(created: list[Path]) -> None:
    """Remove what a run that could not start created (files and empty directories), newest first."""
    for p in reversed(created):
        try:
            p.rmdir() if p.is_dir() and not p.is_symlink() else p.unlink()
        except OSError:
            pass  # not empty (another writer?) or already gone: leave it


def can_share(plan: Plan, out: Path, to_write: list[tuple[StagePlan, OutputFile]], reflink: str) -> bool:
    """Whether this run shares blocks; refuses ``reflink="always"`` where OUT cannot."""
    shareable = [f.source_file for _, f in to_write if f.layout in (CLONE, ALIGNED)]
    if reflink == "never" or not to_write or (not shareable and reflink == "auto"):
        return False
    src = plan.checkpoint.path(shareable[0] if shareable else plan.checkpoint.files[0])
    ok = reflinks.probe(src, partial_path(out / reflinks.PROBE_NAME))
    if not ok and reflink == "always":
        raise BadInput(
            f"{param('out_dir')} {out} cannot share blocks with {src} (another filesystem, or one "
            f"without reflinks such as ext4 or tmpfs) and {param('reflink', 'always')} forbids "
            f"copying; use {param('reflink', 'auto')} to copy where sharing is impossible, or an "
            "output directory on the checkpoint's XFS/Btrfs filesystem"
        )
    return ok and bool(shareable)


def side_file_bytes(plan: Plan) -> int:
    """Bytes of config.json and the other non-weight files that every stage gets a copy of."""
    root = plan.checkpoint.root
    return sum((root / name).stat().st_size for name in plan.checkpoint.extra_files)


def check_free_space(out: Path, needed: int, *, freed: int = 0) -> None:
    """Refuse a run that needs more than OUT's free space (plus ``freed``: what it deletes first)."""
    free = shutil.disk_usage(out).free + freed
    if needed > free:
        raise OutError(
            f"{param('out_dir')} {out} has {format_bytes(free)} free but this run writes "
            f"{format_bytes(needed)}; free {format_bytes(needed - free)} or {ELSEWHERE}"
        )


def _own_stage_dirs(out: Path) -> list[Path]:
    """The stage directories in OUT that are real directories: a link's target is not ours to
    delete from."""
    return [p for p in split_dirs(out) if not p.is_symlink()]


def split_bytes(out: Path) -> int:
    """Disk bytes of the split in OUT that a replacing run deletes (its stage directories)."""
    sizes = (f.lstat() for d in _own_stage_dirs(out) for f in d.iterdir())
    return sum(st.st_blocks * STAT_BLOCK_BYTES for st in sizes if stat.S_ISREG(st.st_mode))


def clear_split(out: Path) -> None:
    """Delete the split with other settings that OUT holds (``assess_out`` said "replace")."""
    entries = sorted(out.iterdir())
    # The old split stays recorded, by a run marker, until its last file is gone (the new run's
    # marker then replaces it): a run killed while deleting leaves what the next run still sees
    # as a split with other settings, not files "qwen35-reshard did not write".
    record = read_run_record(out, str(out))
    if isinstance(record, RunRecord) and not record.in_progress:
        write_atomic(out / RUN_MARKER, dumps({"identity": record.identity.to_json()}))
    # What makes a directory look complete goes first, so that a run killed while deleting
    # leaves no run manifest and no stage index beside half-deleted data.
    remove(out / RUN_MANIFEST)
    for p in _own_stage_dirs(out):
        remove(p / INDEX_NAME)
    for p in entries:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.name not in (RUN_MANIFEST, RUN_MARKER, LOCK):  # the lock: this run holds it
            p.unlink()


def resume_stage(stage_dir: Path, stage: StagePlan, kept: dict[str, Digests]) -> None:
    """Prepare an unfinished stage: keep the ``kept`` data files, clear what will be rewritten."""
    stage_dir.mkdir(exist_ok=True)
    # Index first: without it no server loads the directory. Without config.json neither
    # does one that globs *.safetensors, while files are being replaced.
    for name in (INDEX_NAME, STAGE_MANIFEST, CONFIG_NAME):
        remove(stage_dir / name)
    planned = {f.name for f in stage.files}
    for p in sorted(stage_dir.iterdir()):
        if p.name not in kept and (p.name.endswith(PARTIAL_SUFFIX) or p.name in planned):
            p.unlink()


def has_leftovers(out: Path, stages: list[StagePlan]) -> bool:
    """Whether OUT holds its lock, or a stage directory of ``stages`` a temporary file, a claim
    or a journal (a killed run's, or a live run's at work): then even a complete split is
    looked at under OUT's lock, where what a killed run left is removed."""
    if (out / LOCK).exists():
        return True
    for stage in stages:
        try:
            names = [p.name for p in (out / stage.dirname).iterdir()]
        except (FileNotFoundError, NotADirectoryError):
            continue
        if CLAIM in names or JOURNAL in names or any(partial_base(name) is not None for name in names):
            return True
    return False


def clear_stage_temporaries(out: Path, stages: list[StagePlan], now: int) -> None:
    """Under OUT's lock: delete the temporary files, and the claims of gone runs, in those of
    ``stages`` that no live run claims. Only a stage's claim holder writes temporaries there,
    and no claim is taken while this run holds the lock, so what is left is a killed run's
    (``now``: see :func:`~.claims.gone`)."""
    free = [s for s in stages if not claims.holder_of(out / s.dirname / CLAIM, now).held]
    remove_partials(out, free, own=False)
    for stage in free:
        if claims.gone_file(out / stage.dirname / CLAIM, now):
            remove(out / stage.dirname / CLAIM)


def clear_finished_journals(out: Path, stages: list[StagePlan]) -> None:
    """Delete the journal of each of ``stages``, complete: a finished stage holds none, but a
    repair killed as it rewrote files of one leaves it."""
    for stage in stages:
        remove(out / stage.dirname / JOURNAL)


def bytes_needed(
    plan: Plan, todo: list[StagePlan], to_write: list[tuple[StagePlan, OutputFile]], sharing: bool
) -> int:
    """Bytes the run writes: its data files but what they share, and the side files' copies."""
    shared = sum(f.shareable_bytes for _, f in to_write) if sharing else 0
    side_copies = len(todo) + 1  # each stage's, and OUT's own
    return sum(f.size for _, f in to_write) - shared + side_copies * side_file_bytes(plan)


def unfinished(out: Path, plan: Plan, complete: list[int]) -> bool:
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
