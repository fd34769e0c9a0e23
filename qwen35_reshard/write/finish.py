"""Finishing stages: each stage's non-weight files, manifest and, last, its index, written
under temporary names and renamed behind barriers, so that a stage looks complete only when
everything in it is durable; then, under OUT's lock, OUT's own files and the run record."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..format.jsonio import dumps
from ..format.names import INDEX_NAME, JOURNAL, RUN_MANIFEST, RUN_MARKER, SIDE_FILE_CHUNK, STAGE_MANIFEST
from ..plan.planner import Plan, StagePlan
from ..transfer.pages import pwrite_all
from ..write.manifest import ManifestDraft, stage_index, stage_manifest
from .durability import FILE_MODE, Durability, partial_path, remove, write_tmp
from .journal import Digests


@dataclass
class Prepared:
    """What finishing stages writes before it knows any digest, under temporary names."""

    dirs: list[Path]
    first: list[tuple[Path, Path]]  # (temporary, final): side files, renamed before any index
    indexes: list[tuple[Path, Path]]
    manifests: list[ManifestDraft]
    side_sha256: dict[str, str]  # each non-weight file's digest, as written in every copy

    def of(self, dirs: list[Path]) -> Prepared:
        """What is prepared for the stages in ``dirs`` alone (a subset of ``self.dirs``, in order)."""
        keep = [i for i, d in enumerate(self.dirs) if d in dirs]
        return Prepared(
            [self.dirs[i] for i in keep],
            [(tmp, final) for tmp, final in self.first if final.parent in dirs],
            [self.indexes[i] for i in keep],
            [self.manifests[i] for i in keep],
            self.side_sha256,
        )


def prepare_stages(plan: Plan, out: Path, stages: list[StagePlan]) -> Prepared:
    """Write each of ``stages``' non-weight files and index under temporary names, and make
    their manifests but for the digests."""
    dirs = [out / s.dirname for s in stages]
    first: list[tuple[Path, Path]] = []
    indexes, manifests = [], []
    side_sha256 = {}
    for name in plan.checkpoint.extra_files:
        pairs, side_sha256[name] = _copy_side_file(plan.checkpoint.path(name), [d / name for d in dirs])
        first += pairs
    for stage, stage_dir in zip(stages, dirs, strict=True):
        index_bytes = dumps(stage_index(stage))
        indexes.append(write_tmp(stage_dir / INDEX_NAME, index_bytes))
        manifests.append(stage_manifest(plan, stage, index_bytes, side_sha256))
    return Prepared(dirs, first, indexes, manifests, side_sha256)


def finish_stages(
    out: Path,
    stages: list[StagePlan],
    digests: dict[int, Digests],
    durable: Durability,
    prepared: Prepared,
    *,
    data: list[tuple[Path, Path]] | None = None,
    before_complete: Callable[[], None] = lambda: None,
) -> None:
    """Give each of ``stages`` its non-weight files, manifest and, last, its index (all but
    the manifests ``prepared``). ``data``: (temporary, final) names of data files written but
    not yet made durable; the rest are finished. ``before_complete()`` runs just before the
    first of these files is put in place; what it raises leaves every stage unfinished.

    Everything is written under temporary names first, then made durable and renamed in two
    steps, each behind a barrier: data, side files and manifests (and the journals removed: a
    finished stage never holds one, and later runs skip finished stages); then the indexes,
    which make the stages complete. A last barrier makes those durable.
    """
    dirs, indexes = prepared.dirs, prepared.indexes
    first = [*(data or []), *prepared.first]  # (temporary, final) renamed before any index
    for stage, stage_dir, draft in zip(stages, dirs, prepared.manifests, strict=True):
        first.append(write_tmp(stage_dir / STAGE_MANIFEST, draft.encode(digests[stage.rank])))
    if not first:
        return
    # Barrier 1: every byte written so far (and, synced whole, the data files' final names).
    durable.files([tmp for tmp, _ in (*first, *indexes)])
    before_complete()  # may refuse: then nothing of the stages' own files is in place yet
    for stage_dir in dirs:
        remove(stage_dir / JOURNAL)
    for tmp, final in first:
        os.replace(tmp, final)
    durable.dirs(dirs)  # barrier 2: all of a stage but its index
    for tmp, final in indexes:
        os.replace(tmp, final)
    durable.dirs(dirs)  # barrier 3: the stages complete


def record_run(plan: Plan, out: Path, run_record: bytes, *, side_files: bool, remove_marker: bool) -> None:
    """Write OUT's own non-weight files (``side_files``), then ``run_record`` as reshard.json,
    and remove the run marker (``remove_marker``: no other run is writing OUT).

    Called under OUT's lock, after the stages are complete, with a record derived from the
    stage manifests OUT holds then: whichever of several runs writes it last records every
    stage any of them finished. Nothing trusts it alone (the next run and ``verify`` check
    every stage it records as complete), so a crash that kept it and lost an index costs a
    stage redone, not a wrong answer.
    """
    first: list[tuple[Path, Path]] = []
    for name in plan.checkpoint.extra_files if side_files else ():
        first += _copy_side_file(plan.checkpoint.path(name), [out / name])[0]
    last = write_tmp(out / RUN_MANIFEST, run_record)
    durable = Durability(out, whole_fs=False)
    durable.files([tmp for tmp, _ in (*first, last)])
    for tmp, final in first:
        os.replace(tmp, final)
    durable.dirs([out] if first else [])  # OUT's files before the record that says it is done
    os.replace(*last)
    if remove_marker:
        remove(out / RUN_MARKER)
    durable.dirs([out])


def _copy_side_file(src: Path, finals: list[Path]) -> tuple[list[tuple[Path, Path]], str]:
    """Copy the non-weight file ``src`` to the temporary names of ``finals``; returns the
    (temporary, final) pairs and the sha256 of the bytes written. The file is read once for
    all its copies, in chunks of at most SIDE_FILE_CHUNK."""
    pairs = [(partial_path(final), final) for final in finals]
    digest = hashlib.sha256()
    fds = [os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE) for tmp, _ in pairs]
    try:
        with open(src, "rb") as f:
            pos = 0
            while chunk := f.read(SIDE_FILE_CHUNK):
                digest.update(chunk)
                for fd in fds:
                    pwrite_all(fd, memoryview(chunk), pos)
                pos += len(chunk)
    finally:
        for fd in fds:
            os.close(fd)
    return pairs, digest.hexdigest()
