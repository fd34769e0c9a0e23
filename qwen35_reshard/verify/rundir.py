"""Run-level checks of OUT: its run record and marker, leftovers of an unfinished run, the
stage directories it should hold, and that they are of one split."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from types import MappingProxyType

from ..errors import JSON_ERRORS
from ..format.holder import left_by_gone_run
from ..format.identity import RunIdentity, describe_differences
from ..format.jsonio import is_uint
from ..format.names import (
    INDEX_NAME,
    JOURNAL,
    LOCK,
    PARTIAL_SUFFIX,
    RUN_MANIFEST,
    RUN_MARKER,
    STAGE_MANIFEST,
    is_split_dirname,
    node_dirname,
    partial_base,
    stage_dir_rank,
    stage_dirname,
)
from ..format.paths import checked_file
from ..stage.findings import CORRUPT, DIFFERENT, EXTRA, INCOMPLETE, REPAIR, RERUN, Finding
from ..stage.manifest import damaged_side_files, parse_side_files
from ..stage.nodes import node_dirs
from ..stage.reader import RunRecord, read_run_record, stage_dirs
from .report import SIDE_KIND, CheckedStage, StageSummary, VerifyReport, adder, side_file_message
from .selection import asked_ranks, report_missing, stages_identity


def is_run_dir(root: Path) -> bool:
    # A run killed before its marker was renamed into place leaves only the marker's temporary
    # (an older release's too), or OUT's lock.
    if any((root / name).exists() for name in (RUN_MANIFEST, RUN_MARKER, LOCK)):
        return True
    if any(partial_base(p.name) in (RUN_MARKER, RUN_MANIFEST, LOCK) for p in root.iterdir()):
        return True
    return any(_split_dir(p) for p in root.iterdir())


def _split_dir(p: Path) -> bool:
    return is_split_dirname(p.name) and p.is_dir()


def is_stage_dir(root: Path) -> bool:
    if is_split_dirname(root.name):
        return True
    names = (STAGE_MANIFEST, INDEX_NAME, JOURNAL)
    return any(p.name in names or p.name.endswith(".safetensors") for p in root.iterdir())


def check_run_dir(
    root: Path,
    display: str,
    report: VerifyReport,
    ranks: Sequence[int] | str | None = None,
    env: Mapping[str, str] = MappingProxyType({}),
    nnodes: int | None = None,
) -> list[CheckedStage]:
    """Run-level checks; returns the stage directories to check.

    A finished run has ``reshard.json`` and no run marker. Every stage of the split must be
    present, or every one of ``ranks`` (see :mod:`.selection`); stages not asked for are noted.
    Stage directories alone, with no trace of a run beside them (no run record, marker, lock,
    temporary or OUT's own files), are copied stages: not an unfinished run.
    """
    for p in sorted(root.iterdir()):
        if p.name.endswith(PARTIAL_SUFFIX):
            report.findings.append(
                Finding(
                    INCOMPLETE, f"{display}/{p.name} is left from an unfinished run; {RERUN}", file=p.name
                )
            )
    # A killed run's lock is no finding: what it left half done, the checks here find (its run
    # marker, temporaries, stages against their manifests). A live run's is: it may be changing OUT.
    if (root / LOCK).exists() and not left_by_gone_run(root / LOCK):
        report.findings.append(
            Finding(
                INCOMPLETE,
                f"{display}/{LOCK} is present: a qwen35-reshard run is changing {display}, or one "
                f"was killed while it did; {RERUN} (it waits for a live run, and removes what a "
                "killed one left)",
                file=LOCK,
            )
        )
    # Temporaries, OUT's lock or OUT's own files (config.json, ...): a run was here; else the
    # stage directories were copied here.
    only_stages = all(_split_dir(p) for p in root.iterdir())
    traces = bool(report.findings) or not only_stages
    marker = _read_json_finding(root / RUN_MARKER, display, report)
    run = _read_json_finding(root / RUN_MANIFEST, display, report)
    if (root / RUN_MARKER).exists():
        report.findings.append(
            Finding(
                INCOMPLETE,
                f"{display}/{RUN_MARKER} is present: a qwen35-reshard run into {display} is in progress "
                f"or was interrupted; {RERUN}",
                file=RUN_MARKER,
            )
        )
    elif not (root / RUN_MANIFEST).exists() and traces:
        report.findings.append(
            Finding(
                INCOMPLETE,
                f"{display} has no {RUN_MANIFEST}: the run that wrote it did not finish; {RERUN}",
                file=RUN_MANIFEST,
            )
        )
    record, record_name = (run, RUN_MANIFEST) if run is not None else (marker, RUN_MARKER)
    identity = RunIdentity.from_json(record.get("identity")) if isinstance(record, dict) else None
    if record is not None and identity is None:
        report.findings.append(
            Finding(
                CORRUPT, f"{display}/{record_name}: no valid identity; the file is damaged", file=record_name
            )
        )

    side_files = parse_side_files(run.get("side_files", {})) if run is not None else {}
    if side_files is None:
        report.findings.append(
            Finding(CORRUPT, f"{display}/{RUN_MANIFEST}: side_files is damaged; {REPAIR}", file=RUN_MANIFEST)
        )
    for name, why in damaged_side_files(root, side_files or {}):
        report.findings.append(Finding(SIDE_KIND[why], side_file_message(display, name, why), file=name))

    report.recorded_split |= identity is not None
    dirs = stage_dirs(root)
    report.copied = record is None and not traces
    if report.copied:  # the split the copied stages record, if one
        identity = stages_identity(dirs or node_dirs(root, 1 << 30))
    report.identity = identity
    nodes = identity.nodes if identity is not None and identity.ep > 1 else None
    if nodes is not None:  # an expert-parallel split: one directory per node
        dirs = node_dirs(root, nodes)
    pp = identity.pp * (nodes or 1) if identity else None  # the split's directories
    asked = asked_ranks(ranks, env, nnodes, pp, display)
    name_of = stage_dirname if nodes is None else partial(_node_name, identity.pp, nodes)
    report_missing(display, report, pp, set(dirs), asked, _recorded_complete(run, nodes), name_of)
    stages = []
    for rank, path in dirs.items():
        if asked is not None and rank not in asked:
            continue
        if pp is not None and not 0 <= rank < pp:
            report.findings.append(
                Finding(
                    EXTRA,
                    f"{display}/{path.name} is not a stage of this pp={pp} split; it is left over "
                    "from another split: delete it",
                    stage=path.name,
                )
            )
            continue
        run_record = RunRecord(record_name, identity) if identity is not None else None
        stages.append(new_stage(path, f"{display}/{path.name}", report, run_record))
    if pp is not None and asked is not None:
        report.not_built = [r for r in range(pp) if r not in asked]
    return stages


def check_same_split(stages: list[CheckedStage], report: VerifyReport) -> None:
    """Every stage records the identity of the first (by rank): the stages of one OUT are of
    one split, from one source, even where no run record says which (where one does, each
    stage is compared with it instead)."""
    if any(s.run is not None for s in stages):
        return  # each stage is compared with the run record (read_stage)
    known = [s for s in stages if s.manifest is not None and s.manifest.identity is not None]
    for stage in known[1:]:
        first, mine = known[0].manifest.identity, stage.manifest.identity
        if mine != first:
            adder(report, stage)(
                DIFFERENT,
                f"{stage.display} belongs to another split than {known[0].display} "
                f"({describe_differences(first, mine)}): delete the stage that is not of the split you "
                "want and run the qwen35-reshard command for that split again",
                file=STAGE_MANIFEST,
            )


def _recorded_complete(run: dict | None, nodes: int | None) -> set[int]:
    """The directories the run manifest records complete, by index (a node's: stage * nodes + node)."""
    stages = run.get("stages") if isinstance(run, dict) else None
    if not isinstance(stages, list):
        return set()
    done = [s for s in stages if isinstance(s, dict) and s.get("complete") and is_uint(s.get("stage"))]
    if nodes is None:
        return {s["stage"] for s in done}
    return {s["stage"] * nodes + s["node"] for s in done if is_uint(s.get("node"))}


def _node_name(pp: int, nodes: int, index: int) -> str:
    return node_dirname(index // nodes, index % nodes, pp)


def parent_record(root: Path, report: VerifyReport) -> RunRecord | None:
    """What the run directory beside a stage directory ppN records, if anything."""
    if stage_dir_rank(root) is None:
        return None
    record = read_run_record(root.parent, str(root.parent))
    if isinstance(record, Finding):
        report.findings.append(Finding(record.kind, record.text, file=record.file))
        return None
    return record


def new_stage(
    path: Path, display: str, report: VerifyReport, run: RunRecord | None
) -> CheckedStage:
    summary = StageSummary(stage=path.name, path=display)
    report.stages.append(summary)
    return CheckedStage(path, display, summary, run)


def _read_json_finding(path: Path, display: str, report: VerifyReport) -> dict | None:
    """The JSON object at ``path``; None (with a finding if it is damaged) otherwise."""
    try:
        obj = json.loads(checked_file(path.parent, path.name).read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, *JSON_ERRORS):
        obj = None
    if not isinstance(obj, dict):
        report.findings.append(
            Finding(
                CORRUPT,
                f"{display}/{path.name}: not a valid JSON object; the file is damaged",
                file=path.name,
            )
        )
        return None
    return obj
