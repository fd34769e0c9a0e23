"""Deciding what a write does with an existing OUT, before anything is written: start anew,
nothing (complete), resume an unfinished run with the same settings, or replace a split made
with other settings or from other bytes (``write.sources``); or refuse (OUT is a file, holds
files this tool did not write, ...).

The one decision both a real run and a preview (``plan``, ``--dry-run``) take. Reads only.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ELSEWHERE, JSON_ERRORS, BadInput, advice, param
from ..format.identity import RunIdentity, describe_differences
from ..format.names import GONE_SUFFIX, LOCK, RUN_MANIFEST, RUN_MARKER, is_split_dirname, partial_base
from ..plan.planner import Plan, StagePlan
from ..stage.findings import Finding
from ..stage.manifest import damaged_side_files, parse_side_files, stage_is_complete
from ..stage.reader import read_manifest, read_run_record, stage_dirs
from ..transfer import reflink as reflinks
from ..write.manifest import run_identity
from .durability import write_error
from .journal import Digests, keepable
from .provenance import changed_files, source_difference
from .sources import check_unchanged

# What replaces a split OUT holds; a server operator's terms say it otherwise (servers.terms).
_REPLACE = advice("replace", f"pass {param('overwrite', True)} to replace that split")


@dataclass(frozen=True)
class OutState:
    """What a write of a plan does in OUT, decided before anything is written (:func:`assess_out`).

    ``action`` is "new" (OUT is absent or empty), "complete" (nothing to do), "resume" (an
    unfinished run with the same settings: its finished stages and data files are kept) or
    "replace" (a split made with other settings, or from other bytes, replaced as
    ``overwrite`` allows). ``restamp`` (with "complete"): the bytes of source files whose stamps
    changed were hashed and found the split's; the run record, as read then (its bytes), is to
    record their new stamps, so that the next run is cheap again.
    """

    action: str
    complete: tuple[int, ...] = ()  # stages of the split (selected or not) already complete
    kept: dict[int, dict[str, Digests]] = field(default_factory=dict)  # rank -> file -> digests
    differences: str = ""  # "replace": the settings that differ, old -> new
    restamp: bytes | None = None

    @property
    def files_kept(self) -> int:
        """How many finished data files of an earlier run the write keeps."""
        return sum(len(files) for files in self.kept.values())


def check_out_dir(model_dir: Path, out_dir: Path) -> None:
    """Refuse an OUT that is MODEL itself or lies inside it.

    Args:
        model_dir: The checkpoint's directory.
        out_dir: The output directory a split would be written to.

    Raises:
        ReshardError: ``out_dir`` is ``model_dir`` or inside it.
    """
    model, out = model_dir.resolve(), out_dir.resolve()
    if out == model or out.is_relative_to(model):
        raise BadInput(
            f"{param('out_dir')} {out_dir} is inside {param('model_dir')} {model_dir}; choose an output "
            "directory outside the checkpoint"
        )


def assess_out(plan: Plan, out_dir: str | os.PathLike[str], *, overwrite: bool = False) -> OutState:
    """What writing ``plan`` into ``out_dir`` would do there, without writing anything.

    The one decision both a real run (``write_plan``) and a preview (``plan``, ``--dry-run``)
    take.

    Args:
        plan: The plan to be written.
        out_dir: The output directory OUT (it need not exist).
        overwrite: Whether a split made with other settings may be replaced.

    Returns:
        The :class:`OutState`: the action, the stages complete and the files kept.

    Raises:
        ReshardError: Where a run refuses: OUT is MODEL or inside it, is a file, cannot be read,
            holds files this tool did not write, or a split made with other settings (or an
            interrupted one whose source changed) and not ``overwrite``.
    """
    out = Path(out_dir)
    check_out_dir(plan.checkpoint.root, out)
    try:
        return _assess_out(plan, out, overwrite)
    except OSError as e:  # e.g. OUT or a stage directory unreadable: as the real run says it
        raise write_error(e, out, 0) from e


def _assess_out(plan: Plan, out: Path, overwrite: bool) -> OutState:
    _check_creatable(out)
    # A run killed while writing its marker or run manifest, or while probing for sharing, leaves
    # only temporary files: ours, never worth keeping, and they must not make OUT look foreign.
    side = plan.checkpoint.extra_files
    entries = sorted(p for p in out.iterdir() if not run_temporary(p.name, side)) if out.is_dir() else []
    if not entries:
        return OutState("new")
    identity = run_identity(plan)
    record = read_run_record(out, str(out))
    if isinstance(record, Finding):
        raise BadInput(record.text)
    recorded = record.identity if record is not None else _stages_identity(out)
    if recorded != identity:
        return _other_split(plan, out, entries, recorded, identity, overwrite)
    name = record.name if record is not None else None
    record_bytes = _read_if_any(out / name) if name is not None else None
    changed = changed_files(plan, _recorded_stamps(record_bytes))
    complete = tuple(s.rank for s in plan.stages if stage_is_complete(out / s.dirname, identity))
    done = all(s.rank in complete for s in plan.selected) and _run_record_intact(out)
    kept = {} if done else _kept(plan, out, complete, plan.selected)
    if changed:
        # OUT's run record then takes the new stamps, which later runs trust for the files kept
        # in every stage, not only the selected ones: prove all of them now.
        proven = _kept(plan, out, complete, plan.stages)
        differs = source_difference(plan, out, complete, proven, changed)
        if differs is not None:
            return _source_changed(plan, out, differs, overwrite)
        check_unchanged(plan, changed)  # the bytes hashed were those of the files planned from
    if done:
        restamp = record_bytes if changed and name == RUN_MANIFEST else None
        return OutState("complete", complete, restamp=restamp)
    return OutState("resume", complete, kept)


def _kept(
    plan: Plan, out: Path, complete: tuple[int, ...], stages: Iterable[StagePlan]
) -> dict[int, dict[str, Digests]]:
    """The finished data files of ``stages`` not complete, by rank (see ``keepable``)."""
    kept = {
        s.rank: keepable(plan, out / s.dirname, s)
        for s in stages
        if s.rank not in complete and (out / s.dirname).is_dir()
    }
    return {rank: files for rank, files in kept.items() if files}


def _read_if_any(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def _recorded_stamps(record: bytes | None) -> object:
    """The ``source_files`` a run record (marker or ``reshard.json``) records, if any."""
    try:
        obj = json.loads(record) if record is not None else None
    except JSON_ERRORS:
        return None
    return obj.get("source_files") if isinstance(obj, dict) else None


def _stages_identity(out: Path) -> RunIdentity | None:
    """The split OUT's stage directories record when OUT lost its run record (``reshard.json``
    deleted): the identity all their manifests name, if they all name one."""
    dirs = stage_dirs(out)
    found = set()
    for path in dirs.values():
        m = read_manifest(path, str(path))
        found.add(None if isinstance(m, Finding) else m.identity)
    return found.pop() if len(found) == 1 else None


def _run_record_intact(out: Path) -> bool:
    """``reshard.json`` is there, and OUT's own non-weight files are the ones it records: else
    the run writes them again (with the run record), whatever else is complete."""
    try:
        record = json.loads((out / RUN_MANIFEST).read_bytes())
    except (OSError, *JSON_ERRORS):
        return False
    side_files = parse_side_files(record.get("side_files", {})) if isinstance(record, dict) else None
    return side_files is not None and not damaged_side_files(out, side_files)


def _check_creatable(out: Path) -> None:
    """Refuse an OUT that is a file, or cannot be made because a parent is one."""
    if out.exists() and not out.is_dir():
        raise BadInput(f"{param('out_dir')} {out} exists and is not a directory")
    if not out.exists():
        parent = next(p for p in out.absolute().parents if p.exists())
        if not parent.is_dir():
            raise BadInput(
                f"{param('out_dir')} {out} cannot be created: {parent} is not a directory; choose "
                "another path"
            )


def _other_split(
    plan: Plan,
    out: Path,
    entries: list[Path],
    recorded: RunIdentity | None,
    identity: RunIdentity,
    overwrite: bool,
) -> OutState:
    """OUT holds no split of these settings: "replace" a split of others where allowed."""
    foreign = [
        p.name
        for p in entries
        if not (is_split_dirname(p.name) and p.is_dir())
        and p.name not in (RUN_MARKER, RUN_MANIFEST, *plan.checkpoint.extra_files)
    ]
    if foreign or recorded is None:
        name = foreign[0] if foreign else entries[0].name
        raise BadInput(
            f"{param('out_dir')} {out} holds {name!r}, which qwen35-reshard did not write; it is "
            "never deleted for you: choose an empty or new directory"
        )
    differences = describe_differences(recorded, identity)
    if not overwrite:
        raise BadInput(
            f"{param('out_dir')} {out} holds a split made with other settings ({differences}); "
            f"{ELSEWHERE}, or {_REPLACE}"
        )
    return OutState("replace", differences=differences)


def _source_changed(plan: Plan, out: Path, tensor: str, overwrite: bool) -> OutState:
    """OUT holds a split of these settings, but ``tensor``'s bytes in the source are not the
    ones it holds: another split, "replace"d where allowed."""
    file = plan.checkpoint.tensors[tensor].file
    if not overwrite:
        raise BadInput(
            f"{param('out_dir')} {out} holds a split of other bytes than {plan.checkpoint.display}: "
            f"tensor {tensor!r} of {file} differs from the one it holds (another checkpoint of the "
            f"same layout, or a file rewritten since); {_REPLACE}, "
            f"or {ELSEWHERE}"
        )
    return OutState("replace", differences=f"tensor {tensor!r} of {file} differs from the one OUT holds")


def run_temporary(name: str, side_files: Iterable[str] = ()) -> bool:
    """A file a run keeps in OUT itself while it works (it may be running, or killed): OUT's
    lock, or the temporary file of the lock, the marker, the run manifest, the probe for
    sharing or one of OUT's ``side_files``."""
    ours = {RUN_MARKER, RUN_MANIFEST, LOCK, LOCK + GONE_SUFFIX, reflinks.PROBE_NAME, *side_files}
    return name == LOCK or partial_base(name) in ours
