"""Mend a damaged split from its source: verify, rewrite exactly what is wrong, verify again.

``verify`` (with the source) says which files are damaged, missing or truncated; the plan is
rebuilt from the settings the split records (as ``verify --source`` does), and the writer
rewrites those files from the source, and a stage's index and manifest only when they are
among them. Files verify finds fine are never rewritten. What a rewrite cannot mend (stray
files, a split from another checkpoint, an unfinished run) is left for the second verify to
report.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import ReshardError
from ..format.identity import RunIdentity
from ..format.names import INDEX_NAME, MTP_DROPPED, RUN_MANIFEST, RUN_MARKER, STAGE_MANIFEST, stage_dir_rank
from ..plan.planner import Plan, make_plan
from ..source.checkpoint import Checkpoint, read_checkpoint, source_identity
from ..stage.findings import Finding
from ..stage.reader import read_manifest, read_run_record
from ..verify import VerifyReport, verify
from .writer import DEFAULT_WORKERS, repair_files


@dataclass(frozen=True)
class RepairResult:
    """What a repair did: the first report, the paths of the files rewritten, the last report."""

    before: VerifyReport
    rewritten: list[str]
    after: VerifyReport


def repair(
    out_dir: str | os.PathLike[str], source: str | os.PathLike[str], *, workers: int = DEFAULT_WORKERS
) -> RepairResult:
    """Verify the split in ``out_dir`` against ``source``, rewrite what is damaged, verify again.

    ``out_dir`` is the run directory OUT or one stage directory OUT/ppN. Raises ReshardError
    when the split's settings cannot be read or it was made from another checkpoint.
    """
    target = Path(out_dir)
    before = verify(target, source)
    if before.ok:
        return RepairResult(before, [], before)
    single = stage_dir_rank(target) is not None and not (target / RUN_MANIFEST).exists()
    out = target.parent if single else target
    ckpt = read_checkpoint(source)
    identity = _recorded_identity(out, target if single else None)
    if identity.source_fingerprint != source_identity(ckpt)["fingerprint"]:
        raise ReshardError(
            f"{target} was split from another checkpoint than {source} (or the source changed since); "
            "repair rewrites files from the checkpoint the split was made from: pass that one"
        )
    plan = _plan(ckpt, identity)
    files, redo_run_manifest = _damaged(before, plan)
    done = repair_files(plan, out, files, rewrite_run_manifest=redo_run_manifest, workers=workers)
    rewritten = [str(out / p) for p in done]
    return RepairResult(before, rewritten, verify(target, source))


def _recorded_identity(out: Path, stage_dir: Path | None) -> RunIdentity:
    """The split's settings: from the run record beside the stages, else from a stage manifest."""
    record = read_run_record(out, str(out)) if stage_dir is None else None
    if isinstance(record, tuple):
        return record[1]
    candidates = [stage_dir] if stage_dir is not None else sorted(out.iterdir())
    candidates = [p for p in candidates if stage_dir_rank(p) is not None]
    for path in candidates:
        m = read_manifest(path, str(path))
        if not isinstance(m, Finding) and m.identity is not None:
            return m.identity
    raise ReshardError(
        f"{out}: no readable {RUN_MANIFEST} or stage manifest records the split's settings; it "
        "cannot be repaired: split again"
    )


def _plan(ckpt: Checkpoint, identity: RunIdentity) -> Plan:
    return make_plan(
        ckpt,
        pp=identity.pp,
        runtime=identity.runtime,
        partition=list(identity.partition),
        keep_mtp=identity.mtp != MTP_DROPPED,
        max_file_bytes=identity.max_file_bytes,
        max_header_bytes=identity.max_header_bytes,
    )


def _damaged(report: VerifyReport, plan: Plan) -> tuple[dict[int, set[str]], bool]:
    """Files to rewrite per stage rank, and whether reshard.json is one of them.

    A finding about a stage file names it; one about a tensor only (missing from the stage)
    names the data file the plan puts it in, and the manifest; a stage directory that is gone
    is rebuilt whole. Stray files, partial files and the journal are not the plan's: not rewritten.
    """
    files: dict[int, set[str]] = {}
    run_manifest = False
    side = {*plan.checkpoint.extra_files, INDEX_NAME, STAGE_MANIFEST}
    for f in report.findings:
        if f.stage is None:
            run_manifest |= f.file == RUN_MANIFEST
            continue
        rank = stage_dir_rank(Path(f.stage))
        if rank is None or rank >= plan.pp:
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
    if (Path(report.target) / RUN_MARKER).exists():
        run_manifest = False  # an unfinished run: the same command finishes it
    return {r: n for r, n in files.items() if n}, run_manifest
