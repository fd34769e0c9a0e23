"""What a repair rewrites: the split's recorded settings, and the files a verify report names.

:func:`qwen35_reshard.api.repair` verifies, rebuilds the plan from :func:`recorded_identity`,
has the writer rewrite the :func:`damaged_files` from the source, and verifies again. Files
verify finds fine are never rewritten; what a rewrite cannot mend (stray files, a split from
another checkpoint, an unfinished run) is left for the second verify to report.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ReshardError
from ..ondisk import (
    INDEX_NAME,
    RUN_MANIFEST,
    RUN_MARKER,
    STAGE_MANIFEST,
    RunIdentity,
    stage_dir_rank,
)
from ..plan.planner import Plan
from ..stage import Finding, read_manifest, read_run_record
from ..verify import VerifyReport


def recorded_identity(out: Path, stage_dir: Path | None) -> RunIdentity:
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


def damaged_files(report: VerifyReport, plan: Plan) -> tuple[dict[int, set[str]], bool]:
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
