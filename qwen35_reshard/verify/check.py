"""Check a split: every stage's data files, index, config and manifest, and optionally the source.

``verify(OUT)`` or ``verify(OUT/pp2)`` never trusts the manifest alone. Each stage directory
gets the loader's checks (``stage.reader.read_stage``: manifest, index, config.json, data file sizes
and headers) and more: headers must follow the writer's stricter rules (see
:func:`_strict_extras`), no stray data file may lie beside them, every layer of the stage must
have tensors, and every tensor's bytes are hashed (in bounded chunks, by
``transfer.copier.copy_segments``) and compared with the manifest. With a
source checkpoint, the plan is rebuilt from the settings each stage's manifest records, and
every tensor's placement and bytes are compared with the source.

Files the split shared with the source (``clone``: a source shard's exact bytes; ``aligned``)
record no sha256 for the tensors whose blocks were shared: without the source, verify checks
their structure, a clone's whole-file sha256 where the manifest records one (the source's
Hugging Face blob name), and reports the bytes it could compare with nothing
(``bytes_unrecorded``); ``--source`` compares them with the source like every other tensor.
A clone's header is the source's own, so the writer's stricter header rules apply to the
files whose header the tool wrote, and a clone must equal its source byte for byte.

Problems are collected as findings rather than raised, so one run reports everything that is
wrong; a ReshardError is raised only for bad input (OUT is not a directory, a bad source).
A stage without its manifest or index is reported as incomplete, never accepted.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import JSON_ERRORS, ReshardError, param
from ..format.dtypes import DTYPE_SIZES
from ..format.identity import RunIdentity, describe_differences
from ..format.jsonio import is_uint
from ..format.names import (
    CLAIM,
    CLONE,
    CONFIG_NAME,
    INDEX_NAME,
    JOURNAL,
    LOCAL_SOURCE,
    LOCK,
    MTP_DROPPED,
    PARTIAL_SUFFIX,
    RUN_MANIFEST,
    RUN_MARKER,
    STAGE_DIR,
    STAGE_MANIFEST,
    partial_base,
    stage_dir_rank,
    stage_dirname,
)
from ..format.paths import checked_file
from ..model.names import LAYER, classify
from ..plan.nodes import node_from_env
from ..plan.planner import DEFAULT_MAX_FILE_BYTES, DEFAULT_MAX_HEADER_BYTES, Plan, make_plan
from ..source.checkpoint import Checkpoint, source_identity, source_name
from ..source.header import Header
from ..source.hub import HubFetcher, HubRepo, HubSettings, header_bytes, open_model
from ..stage.findings import CORRUPT, DIFFERENT, EXTRA, INCOMPLETE, KINDS, MISSING, REPAIR, RERUN, Finding
from ..stage.manifest import StageManifest, damaged_side_files, parse_side_files
from ..stage.reader import read_manifest, read_run_record, read_stage, stage_dirs
from ..transfer.copier import CHUNK_BYTES, Segment, copy_segments

# transformers refuses safetensors files whose metadata lacks one of these formats.
METADATA_FORMATS = ("pt", "tf", "flax", "mlx")

# How verify reports a damaged non-weight file, by what stage.manifest.damaged_side_files says of it.
_SIDE_KIND = collections.defaultdict(lambda: CORRUPT, {"missing": MISSING, "changed": DIFFERENT})

# add(kind, message, file=..., tensor=...): records a finding of one stage, and returns it.
_Add = Callable[..., Finding]


@dataclass
class StageSummary:
    """What was checked in one stage directory."""

    stage: str
    path: str
    rank: int | None = None
    complete: bool = False  # manifest and index present and consistent
    files: int = 0
    tensors: int = 0
    bytes_hashed: int = 0
    bytes_unrecorded: int = 0  # shared with the source at split time: no digest to compare them with


@dataclass
class VerifyReport:
    """Everything verify found. ``ok`` when there is no finding."""

    target: str
    source: str | None = None
    stages: list[StageSummary] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    not_built: list[int] = field(default_factory=list)  # stages of the split not asked for (``ranks``)
    missing_stages: list[int] = field(default_factory=list)  # stages asked for (all by default) absent
    copied: bool = False  # stage directories without a run record beside them: copied stages
    identity: RunIdentity | None = None  # the split's settings, as its run record or first stage records
    # Findings that the stages hold intact bytes that are not the source's (another checkpoint of the
    # same layout, or one changed since): no repair mends that.
    not_from_source: list[Finding] = field(default_factory=list)
    source_digests: dict[str, str] = field(default_factory=dict, repr=False)  # source tensor -> sha256
    source_bytes_hashed: int = 0
    recorded_source: str | None = None  # the checkpoint path the stage manifests record
    recorded_split: bool = False  # a run record or a stage manifest says which split this is

    @property
    def ok(self) -> bool:
        return not self.findings

    @property
    def repairable(self) -> bool:
        """Whether ``verify --source MODEL --repair`` mends everything found: not a run in
        progress or interrupted (the same command finishes it), a stage directory outside the
        split (deleted by hand), or a directory that records no split at all."""
        outside = [f for f in self.findings if f.kind == EXTRA and f.stage and not (f.file or f.tensor)]
        return (
            self.recorded_split
            and not outside
            and not self.not_from_source
            and not any(f.file == RUN_MARKER for f in self.findings)
        )

    @property
    def checked(self) -> list[int]:
        """The ranks of the stages checked."""
        return sorted(s.rank for s in self.stages if s.rank is not None)

    def findings_for(self, stage: str) -> list[Finding]:
        return [f for f in self.findings if f.stage == stage]

    def counts(self) -> dict[str, int]:
        return {k: sum(1 for f in self.findings if f.kind == k) for k in KINDS}

    def to_dict(self) -> dict:
        return {
            "status": "ok" if self.ok else "failed",
            "target": self.target,
            "source": self.source,
            "counts": self.counts(),
            "stages": [asdict(s) for s in self.stages],
            "checked": self.checked,
            "missing_stages": self.missing_stages,
            "not_built": self.not_built,
            "source_bytes_hashed": self.source_bytes_hashed,
            "recorded_source": self.recorded_source,
            "findings": [asdict(f) for f in self.findings],
        }


@dataclass
class _Stage:
    """A stage directory while it is being checked."""

    path: Path
    display: str  # path as shown in messages
    summary: StageSummary
    run: tuple[str, RunIdentity] | None  # (record name, identity) the run directory records, if any
    manifest: StageManifest | None = None
    digests: dict[str, str] = field(default_factory=dict)  # sha256 computed from the files


def verify(
    path: str | os.PathLike[str],
    source: str | os.PathLike[str] | None = None,
    *,
    ranks: Sequence[int] | str | None = None,
    env: Mapping[str, str] | None = None,
    nnodes: int | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    hub_settings: HubSettings | None = None,
) -> VerifyReport:
    """Check the run directory or single stage directory ``path``; compare with ``source`` if given.

    A run directory is checked whole: a stage of its split that is absent is a finding, unless
    ``ranks`` asks for some stages only (a node's). Stage directories without a run record
    beside them (stages copied to a node) are each checked on their own manifest, and must be
    of one split.

    Args:
        path: the run directory OUT, or one stage directory OUT/ppN.
        source: the checkpoint the split was made from (a directory, cache folder or Hub repo
            id): then every tensor must be where the plan puts it, with identical bytes.
        ranks: check only these stages of the run directory ``path``; ``"auto"``: those of the
            node this runs on, read from the scheduler's variables in ``env`` (as a split's).
        env: the environment ``ranks="auto"`` reads (default: ``os.environ``).
        nnodes: with ``ranks="auto"``: the node count, where the environment gives none.
        chunk_bytes: read size for hashing.
        hub_settings: revision, token and offline mode for a Hub repo id ``source``.

    Returns:
        A :class:`VerifyReport`: ``ok``, the findings (missing, extra, different, corrupt,
        incomplete), per-stage summaries and bytes hashed.

    Raises:
        ReshardError: only for bad input (``path`` is no split, a bad ``source``); everything
            wrong with the split is a finding.

    Example:
        >>> from qwen35_reshard import reshard
        >>> from qwen35_reshard.verify import verify
        >>> _ = reshard(MODEL, OUT, pp=2)
        >>> verify(OUT, source=MODEL).ok
        True
    """
    display = os.fspath(path)
    root = Path(display)
    if not root.is_dir():
        raise ReshardError(f"{display}: not a directory; pass OUT or one of its stage directories (OUT/pp0)")
    ckpt, repo = (None, None)
    if source is not None:
        ckpt, repo = open_model(os.fspath(source), hub_settings or HubSettings())
    report = VerifyReport(target=display, source=os.fspath(source) if source is not None else None)
    if _is_run_dir(root):
        wanted = (ranks, os.environ if env is None else env, nnodes)
        stages = _check_run_dir(root, display, report, wanted)
    elif ranks is not None:
        raise ReshardError(
            f"{param('ranks')} picks stages of a run directory; {display} is a stage directory: pass "
            f"{display} alone, or its run directory with {param('ranks')}"
        )
    elif _is_stage_dir(root):
        stages = [_new_stage(root, display, report, _parent_record(root, report))]
    else:
        raise ReshardError(
            f"{display}: holds no stage directories (pp0, pp1, ...) and no {STAGE_MANIFEST}; pass the "
            "OUT of a qwen35-reshard run or one of its stage directories"
        )
    for stage in stages:
        _check_stage(stage, report, ckpt, chunk_bytes)
    _check_same_split(stages, report)
    if ckpt is not None:
        _check_against_source(ckpt, [s for s in stages if s.manifest is not None], report, chunk_bytes, repo)
    return report


# --------------------------------------------------------------------------- run directory


def _is_run_dir(root: Path) -> bool:
    # A run killed before its marker was renamed into place leaves only the marker's temporary
    # (an older release's too), or OUT's lock.
    if any((root / name).exists() for name in (RUN_MANIFEST, RUN_MARKER, LOCK)):
        return True
    if any(partial_base(p.name) in (RUN_MARKER, RUN_MANIFEST, LOCK) for p in root.iterdir()):
        return True
    return any(STAGE_DIR.fullmatch(p.name) and p.is_dir() for p in root.iterdir())


def _is_stage_dir(root: Path) -> bool:
    if STAGE_DIR.fullmatch(root.name):
        return True
    names = (STAGE_MANIFEST, INDEX_NAME, JOURNAL)
    return any(p.name in names or p.name.endswith(".safetensors") for p in root.iterdir())


def _check_run_dir(root: Path, display: str, report: VerifyReport, wanted: tuple) -> list[_Stage]:
    """Run-level checks; returns the stage directories to check.

    A finished run has ``reshard.json`` and no run marker. Every stage of the split must be
    present, or every one of ``wanted`` (ranks, env, nnodes: a node's stages); stages not asked
    for are noted. Stage directories with no trace of a run beside them (no run record, marker,
    lock or temporary) are copied stages: not an unfinished run.
    """
    for p in sorted(root.iterdir()):
        if p.name.endswith(PARTIAL_SUFFIX):
            report.findings.append(
                Finding(
                    INCOMPLETE, f"{display}/{p.name} is left from an unfinished run; {RERUN}", file=p.name
                )
            )
    if (root / LOCK).exists():
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
    only_stages = all(STAGE_DIR.fullmatch(p.name) and p.is_dir() for p in root.iterdir())
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
        report.findings.append(Finding(_SIDE_KIND[why], _side_file_message(display, name, why), file=name))

    report.recorded_split |= identity is not None
    dirs = stage_dirs(root)
    report.copied = record is None and not traces
    if report.copied:  # the split the copied stages record, if one
        identity = _stages_identity(dirs)
    report.identity = identity
    pp = identity.pp if identity else None
    asked = _asked_ranks(wanted, pp, display)
    _missing_stages(display, report, pp, set(dirs), asked, _recorded_complete(run))
    stages = []
    for rank, path in dirs.items():
        if asked is not None and rank not in asked:
            continue
        if pp is not None and rank >= pp:
            report.findings.append(
                Finding(
                    EXTRA,
                    f"{display}/{path.name} is not a stage of this pp={pp} split; it is left over "
                    "from another split: delete it",
                    stage=path.name,
                )
            )
            continue
        run_record = (record_name, identity) if identity is not None else None
        stages.append(_new_stage(path, f"{display}/{path.name}", report, run_record))
    if pp is not None and asked is not None:
        report.not_built = [r for r in range(pp) if r not in asked]
    return stages


def _stages_identity(dirs: dict[int, Path]) -> RunIdentity | None:
    """The identity the first stage manifest (by rank) records, if one does."""
    for path in dirs.values():
        m = read_manifest(path, str(path))
        if not isinstance(m, Finding) and m.identity is not None:
            return m.identity
    return None


def _asked_ranks(wanted: tuple, pp: int | None, display: str) -> set[int] | None:
    """The stages ``ranks`` asks for (None: all), those of this node for ``"auto"``."""
    ranks, env, nnodes = wanted
    if ranks is None:
        return None
    if pp is None:
        raise ReshardError(
            f"{display} records no split (no readable {RUN_MANIFEST} or stage manifest): "
            f"{param('ranks')} cannot pick its stages; verify it without {param('ranks')}"
        )
    if isinstance(ranks, str):
        if ranks != "auto":
            raise ReshardError(f"{param('ranks', ranks)} must be stage numbers or 'auto'")
        return set(node_from_env(env, pp, nnodes).stages)
    for r in ranks:
        if not 0 <= r < pp:
            raise ReshardError(f"{param('ranks', r)} is not a stage of this pp={pp} split (0 to {pp - 1})")
    return set(ranks)


def _missing_stages(
    display: str,
    report: VerifyReport,
    pp: int | None,
    present: set[int],
    asked: set[int] | None,
    complete: set[int],
) -> None:
    """A finding for each stage of the split (or of ``asked``) absent from the run directory."""
    ranks = asked if asked is not None else set(range(pp)) if pp is not None else complete
    report.missing_stages = sorted(ranks - present)
    here = ", ".join(stage_dirname(r) for r in sorted(present & set(range(pp or 0))))
    only = f"qwen35-reshard verify {shlex.quote(display)} " + " ".join(f"--rank {r}" for r in sorted(present))
    for rank in report.missing_stages:
        name = stage_dirname(rank)
        if rank in complete:
            why = f"{RUN_MANIFEST} records it as complete; {RERUN} (it builds it again)"
        elif report.copied and here:
            why = (
                f"{display} holds copied stages ({here}) without the run's {RUN_MANIFEST}, each checked "
                f"on its own manifest; to check them as the stages of one split: {only}"
            )
        elif asked is None and here:
            why = f"build it, or check only the stages here ({here}): {only}"
        else:
            why = f"build it with the split's command (--rank {rank})"
        split = f" of this pp={pp} split" if pp is not None else ""
        report.findings.append(Finding(MISSING, f"{display}/{name}{split} is missing: {why}", stage=name))


def _check_same_split(stages: list[_Stage], report: VerifyReport) -> None:
    """Every stage records the identity of the first (by rank): the stages of one OUT are of
    one split, from one source, even where no run record says which (where one does, each
    stage is compared with it instead)."""
    if any(s.run is not None for s in stages):
        return  # each stage is compared with the run record (read_stage)
    known = [s for s in stages if s.manifest is not None and s.manifest.identity is not None]
    for stage in known[1:]:
        first, mine = known[0].manifest.identity, stage.manifest.identity
        if mine != first:
            _adder(report, stage)(
                DIFFERENT,
                f"{stage.display} belongs to another split than {known[0].display} "
                f"({describe_differences(first, mine)}): delete the stage that is not of the split you "
                "want and run the qwen35-reshard command for that split again",
                file=STAGE_MANIFEST,
            )


def _side_file_message(display: str, name: str, why: str) -> str:
    """What verify says of a recorded non-weight file of ``display`` that is damaged: ``why``
    as :func:`~..stage.manifest.damaged_side_files` gives it."""
    record = STAGE_MANIFEST if stage_dir_rank(Path(display)) is not None else RUN_MANIFEST
    if why == "changed":
        why = f"not the file the split recorded (its sha256 differs from {record}'s)"
    return f"{display}/{name} is {why}; servers read it: {REPAIR}"


def _recorded_complete(run: dict | None) -> set[int]:
    stages = run.get("stages") if isinstance(run, dict) else None
    if not isinstance(stages, list):
        return set()
    return {
        s["stage"] for s in stages if isinstance(s, dict) and s.get("complete") and is_uint(s.get("stage"))
    }


def _parent_record(root: Path, report: VerifyReport) -> tuple[str, RunIdentity] | None:
    """What the run directory beside a stage directory ppN records, if anything."""
    if stage_dir_rank(root) is None:
        return None
    record = read_run_record(root.parent, str(root.parent))
    if isinstance(record, Finding):
        report.findings.append(Finding(record.kind, record.message, file=record.file))
        return None
    return record


def _new_stage(path: Path, display: str, report: VerifyReport, run: tuple[str, RunIdentity] | None) -> _Stage:
    summary = StageSummary(stage=path.name, path=display)
    report.stages.append(summary)
    return _Stage(path, display, summary, run)


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


# --------------------------------------------------------------------------- one stage


def _check_stage(stage: _Stage, report: VerifyReport, ckpt: Checkpoint | None, chunk_bytes: int) -> None:
    """All checks of one stage directory that need no source; fills ``stage`` for the source checks."""
    add = _adder(report, stage)
    entries = sorted(p.name for p in stage.path.iterdir())
    for name in entries:
        if name.endswith(PARTIAL_SUFFIX) or name == JOURNAL:
            add(INCOMPLETE, f"{stage.display}/{name} is left from an unfinished run; {RERUN}", file=name)
        elif name == CLAIM:
            add(
                INCOMPLETE,
                f"{stage.display}/{name} is present: a qwen35-reshard run is building this stage, or "
                f"one was killed while it did; {RERUN} (it waits for a live run, and takes over from a "
                "killed one)",
                file=name,
            )
    found = read_stage(stage.path, stage.display, stage.run)
    for p in found.problems:
        add(p.kind, p.message, file=p.file, tensor=p.tensor)
    m = stage.manifest = found.manifest
    if m is None:
        return
    report.recorded_split |= m.identity is not None
    if report.recorded_source is None and isinstance(m.source.get("path"), str):
        report.recorded_source = m.source["path"]
    stage.summary.rank = m.rank
    stage.summary.complete = not any(p.file == INDEX_NAME for p in found.problems)
    # config.json has its own check (read_stage): it must be the source's.
    recorded = {n: d for n, d in m.side_files.items() if n != CONFIG_NAME}
    for name, why in damaged_side_files(stage.path, recorded):
        add(_SIDE_KIND[why], _side_file_message(stage.display, name, why), file=name)
    on_disk = {n for n in entries if n.endswith(".safetensors") and not n.startswith(".")}
    for name in sorted(on_disk - set(m.files)):
        add(
            EXTRA,
            f"{stage.display}/{name} is not listed in the stage's index: stale data that a loader "
            "globbing *.safetensors would read; delete it",
            file=name,
        )
    for file, header in found.headers.items():
        _check_data_file(stage, m, file, header, add, chunk_bytes, for_source=ckpt is not None)
    _check_layers(stage, m, add)
    stage.summary.files = len(m.files)
    stage.summary.tensors = len(m.tensors)


def _adder(report: VerifyReport, stage: _Stage) -> _Add:
    def add(kind: str, message: str, *, file: str | None = None, tensor: str | None = None) -> Finding:
        finding = Finding(kind, message, file, tensor, stage.summary.stage)
        report.findings.append(finding)
        return finding

    return add


def _compare_side_file(stage: _Stage, ckpt: Checkpoint, name: str, add: _Add) -> None:
    try:
        mine = checked_file(stage.path, name).read_bytes()
    except FileNotFoundError:
        if name != CONFIG_NAME:  # a missing config.json is already reported
            add(
                MISSING,
                f"{stage.display}/{name} is missing; the source has it and every stage needs it",
                file=name,
            )
        return
    except OSError as e:
        add(CORRUPT, f"{stage.display}/{name}: cannot read ({e.strerror})", file=name)
        return
    if mine != ckpt.path(name).read_bytes():
        add(DIFFERENT, f"{stage.display}/{name} differs from {ckpt.path(name)}", file=name)


def _check_data_file(
    stage: _Stage,
    m: StageManifest,
    file: str,
    header: Header,
    add: _Add,
    chunk_bytes: int,
    *,
    for_source: bool,
) -> None:
    """A data file of the recorded size with a valid header: the writer's stricter rules, its bytes.

    Tensors with no recorded digest (shared with the source at split time) are hashed only
    ``for_source``: without a source there is nothing to compare them with.
    """
    path = stage.path / file
    where = f"{stage.display}/{file}"
    layout = m.layouts[file]
    problem = _strict_extras(path, header, where) if layout["layout"] != CLONE else None
    if problem is not None:
        add(CORRUPT, problem, file=file)
        return
    if layout["sha256"] is not None:
        _check_file_digest(path, layout["sha256"], where, add, file)
    recorded = {n: t.sha256 for n, t in m.tensors.items() if t.file == file}
    segments = []
    for t in header.tensors:
        if for_source or recorded.get(t.name) is not None:
            segments.append(Segment(t.name, header.data_start + t.begin, t.nbytes))
        elif t.name in recorded and layout["sha256"] is None:
            stage.summary.bytes_unrecorded += t.nbytes
    digests = copy_segments(str(path), segments, chunk_bytes=chunk_bytes)
    stage.summary.bytes_hashed += sum(s.nbytes for s in segments)
    for name, digest in digests.items():
        stage.digests[name] = digest
        if recorded.get(name) is not None and recorded[name] != digest:
            add(
                DIFFERENT,
                f"{where}: the bytes of tensor {name!r} do not match its sha256 in {STAGE_MANIFEST}; "
                "the file is damaged",
                file=file,
                tensor=name,
            )


def _check_file_digest(path: Path, recorded: str, where: str, add: _Add, file: str) -> None:
    """A clone is its source shard byte for byte: its sha256 is the one the manifest records."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            h.update(chunk)
    if h.hexdigest() != recorded:
        add(
            DIFFERENT,
            f"{where}: sha256 {h.hexdigest()[:12]}... is not the {recorded[:12]}... of the source "
            f"shard it is a copy of ({STAGE_MANIFEST}); the file is damaged",
            file=file,
        )


def _strict_extras(path: Path, header: Header, where: str) -> str | None:
    """Rules beyond :func:`header.read_header` that every file qwen35-reshard writes obeys.

    The header is padded with spaces only, so that the data buffer starts at a multiple of 8;
    its metadata names a format transformers accepts; every tensor starts at a multiple of its
    element size. Returns what breaks the first rule broken, or None.
    """
    with open(path, "rb") as f:
        raw = os.pread(f.fileno(), header.data_start - 8, 8)
    if not raw.rstrip(b" ").endswith(b"}"):
        return f"{where}: header is padded with bytes other than spaces"
    if header.data_start % 8:
        return f"{where}: data buffer starts at byte {header.data_start}, not a multiple of 8"
    if header.metadata.get("format") not in METADATA_FORMATS:
        return (
            f"{where}: __metadata__ format is {header.metadata.get('format')!r}, not one of "
            f"{', '.join(METADATA_FORMATS)}; transformers refuses such files"
        )
    for t in header.tensors:
        if t.begin % DTYPE_SIZES[t.dtype]:
            return (
                f"{where}: tensor {t.name!r} starts at data offset {t.begin}, not a multiple of its "
                f"{DTYPE_SIZES[t.dtype]}-byte {t.dtype} elements"
            )
    return None


def _check_layers(stage: _Stage, m: StageManifest, add: _Add) -> None:
    """Decoder-layer tensors belong to the stage's layers, and each of its layers has some."""
    start, end = m.start_layer, m.end_layer
    seen = set()
    for name in sorted(m.tensors):
        role = classify(name)
        if role is None or role.kind != LAYER:
            continue
        seen.add(role.layer)
        if not start <= role.layer < end:
            add(
                EXTRA,
                f"{stage.display}: tensor {name!r} is in layer {role.layer}, outside this stage's "
                f"layers {start}-{end - 1}",
                tensor=name,
            )
    for layer in range(start, end):
        if layer not in seen:
            add(
                MISSING,
                f"{stage.display}: layer {layer} of this stage's layers {start}-{end - 1} has no tensors",
            )
    return None


# --------------------------------------------------------------------------- against the source


def _check_against_source(
    ckpt: Checkpoint, stages: list[_Stage], report: VerifyReport, chunk_bytes: int, repo: HubRepo | None
) -> None:
    """Placement and bytes of every tensor of ``stages`` (those with a valid manifest) against the source.

    The plan is rebuilt from each stage manifest's settings (pp, runtime, partition, mtp);
    each needed source tensor is hashed once, even when it is replicated on several stages.
    """
    if repo is not None:
        _prepare_hub(repo, ckpt, stages)
    fingerprint = source_identity(ckpt)["fingerprint"]
    plans: dict[tuple, Plan | None] = {}
    to_compare: list[tuple[_Stage, str]] = []
    for stage in stages:
        add = _adder(report, stage)
        m = stage.manifest
        # After the Hub's files are fetched (_prepare_hub); each damaged one reported once.
        reported = {f.file for f in report.findings_for(stage.summary.stage)}
        for name in ckpt.extra_files:
            if name not in reported:
                _compare_side_file(stage, ckpt, name, add)
        if m.source.get("fingerprint") != fingerprint:
            report.not_from_source.append(
                add(
                    DIFFERENT,
                    f"{stage.display} was split from another checkpoint than {ckpt.root} (or the "
                    "source changed since): config, index, shard sizes or headers differ",
                )
            )
        elif ckpt.hub and m.identity and m.identity.source not in (LOCAL_SOURCE, source_name(ckpt)):
            report.not_from_source.append(
                add(
                    DIFFERENT,
                    f"{stage.display} was split from {m.identity.source}, not {source_name(ckpt)}: the "
                    "same layout but other bytes; pass --source with the commit it was split from "
                    "(--revision) to compare it",
                )
            )
        plan = _plan_for(ckpt, m, plans, add, stage.display)
        if plan is None:
            continue
        to_compare += _compare_placement(ckpt, plan, stage, add)
        if _recorded_limits(m) is not None and not report.findings_for(stage.summary.stage):
            _compare_layout(plan, stage, add, repo)
    wanted = sorted({name for _, name in to_compare})
    source_digests = report.source_digests = _hash_source(ckpt, wanted, chunk_bytes, repo)
    report.source_bytes_hashed = sum(ckpt.tensors[n].nbytes for n in wanted)
    for stage, name in to_compare:
        mine = stage.digests.get(name)
        if mine is not None and mine != source_digests[name]:
            t = stage.manifest.tensors[name]
            intact = t.sha256 == mine  # the stage holds what it recorded: the source is not its
            why = ", and are the ones its manifest records: the split is of other bytes" if intact else ""
            finding = _adder(report, stage)(
                DIFFERENT,
                f"{stage.display}/{t.file}: the bytes of tensor {name!r} differ from the source's "
                f"({ckpt.tensors[name].file}){why}",
                file=t.file,
                tensor=name,
            )
            if intact:
                report.not_from_source.append(finding)


def _plan_for(ckpt: Checkpoint, m: StageManifest, plans: dict, add: _Add, display: str) -> Plan | None:
    """The plan the stage's recorded settings give for ``ckpt``; None (with a finding) if none.

    Output file limits are taken from the run identity when it records them (so the exact file
    layout can be compared); older manifests get the defaults, which decide stages alike.
    """
    limits = _recorded_limits(m) or {}
    key = (m.pp, m.runtime, m.partition, m.mtp, tuple(sorted(limits.items())))
    if key not in plans:
        try:
            plans[key] = recorded_plan(
                ckpt, pp=m.pp, runtime=m.runtime, partition=m.partition, mtp=m.mtp, **limits
            )
        except ReshardError as e:
            plans[key] = None
            add(
                DIFFERENT,
                f"{display}: its recorded split (pp={m.pp} {m.runtime} partition "
                f"{list(m.partition)}) does not fit the source: {e}",
            )
    return plans[key]


def recorded_plan(
    ckpt: Checkpoint,
    *,
    pp: int,
    runtime: str,
    partition: Sequence[int],
    mtp: str,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
) -> Plan:
    """The plan of ``ckpt`` that a split's recorded settings (its manifests' ``pp``, ``runtime``,
    ``partition``, ``mtp`` and file limits) give: what ``verify`` compares with, and what a repair
    rewrites from. Raises ReshardError when they do not fit ``ckpt``."""
    return make_plan(
        ckpt,
        pp=pp,
        runtime=runtime,
        partition=list(partition),
        keep_mtp=mtp != MTP_DROPPED,
        max_file_bytes=max_file_bytes,
        max_header_bytes=max_header_bytes,
    )


def _recorded_limits(m: StageManifest) -> dict[str, int] | None:
    """``max_file_bytes`` and ``max_header_bytes`` from the manifest's run identity, if recorded."""
    identity = m.identity
    if identity is None or not (identity.max_file_bytes > 0 and identity.max_header_bytes > 0):
        return None
    return {"max_file_bytes": identity.max_file_bytes, "max_header_bytes": identity.max_header_bytes}


def _compare_layout(plan: Plan, stage: _Stage, add: _Add, repo: HubRepo | None) -> None:
    """Each data file is the plan's: same name, and header bytes equal to the plan's header.

    With every tensor's bytes checked elsewhere, this makes every byte of every file the one
    the plan dictates. Only for stages that hold exactly the right tensors.
    """
    for f in plan.stages[stage.manifest.rank].files:
        path = stage.path / f.name
        where = f"{stage.display}/{f.name}"
        want = f.header
        if f.layout == CLONE:  # a clone's header is its source's own
            want = _source_head(plan.checkpoint, f.source_file, f.data_start, repo)
        try:
            with open(path, "rb") as fh:
                head = fh.read(len(want))
        except FileNotFoundError:
            add(MISSING, f"{where} is missing; the plan lays the stage out in it", file=f.name)
            continue
        if head != want:
            add(
                DIFFERENT,
                f"{where}: header differs from the plan's (other tensors, order or offsets in this file)",
                file=f.name,
            )


def _compare_placement(ckpt: Checkpoint, plan: Plan, stage: _Stage, add: _Add) -> list[tuple[_Stage, str]]:
    """Missing, extra and differently shaped tensors; returns the (stage, tensor) pairs to hash."""
    rank = stage.manifest.rank
    expected = {t.name for t in plan.stages[rank].tensors}
    actual = stage.manifest.tensors
    where = f"pp={plan.pp} {plan.runtime} partition {list(plan.partition)}"
    for name in sorted(expected - set(actual)):
        add(
            MISSING,
            f"{stage.display} lacks source tensor {name!r}, which the plan ({where}) puts on stage {rank}",
            tensor=name,
        )
    extra = sorted(set(actual) - expected)
    owners: dict[str, list[int]] = {}
    for s in plan.stages if extra else ():
        for t in s.tensors:
            owners.setdefault(t.name, []).append(s.rank)
    for name in extra:
        if name not in ckpt.tensors:
            why = f"the source {ckpt.root} has no such tensor"
        elif name in plan.dropped:
            why = "the split leaves mtp.* out (--no-mtp)"
        else:
            why = f"the plan ({where}) puts it on stage(s) {owners.get(name, [])} only"
        add(EXTRA, f"{stage.display} holds tensor {name!r} but {why}", file=actual[name].file, tensor=name)
    pairs = []
    for name in sorted(expected & set(actual)):
        src, t = ckpt.tensors[name], actual[name]
        if (src.dtype, tuple(src.shape)) != (t.dtype, t.shape):
            add(
                DIFFERENT,
                f"{stage.display}: tensor {name!r} is {t.dtype} {list(t.shape)} but the "
                f"source's is {src.dtype} {list(src.shape)}",
                file=t.file,
                tensor=name,
            )
        else:
            pairs.append((stage, name))
    return pairs


def _prepare_hub(repo: HubRepo, ckpt: Checkpoint, stages: list[_Stage]) -> None:
    """The repo's side files into the cache; offline, one line naming every file the cache
    lacks that comparing ``stages`` (each with a manifest) needs: their shards, the side files."""
    needed: dict[str, set[str]] = {}
    for stage in stages:
        for name in stage.manifest.tensors:
            if name in ckpt.tensors:
                needed.setdefault(ckpt.tensors[name].file, set()).add(name)
    HubFetcher(repo, ckpt, needed).prepare()


def _source_head(ckpt: Checkpoint, file: str, nbytes: int, repo: HubRepo | None) -> bytes:
    """The first ``nbytes`` (at most its header's) of source shard ``file``; from a Hub repo
    without the shard in the cache, the header planning kept or two ranged reads."""
    if repo is not None:
        return header_bytes(repo, file)[:nbytes]
    with open(ckpt.path(file), "rb") as fh:
        return fh.read(nbytes)


def _hash_source(
    ckpt: Checkpoint, names: list[str], chunk_bytes: int, repo: HubRepo | None
) -> dict[str, str]:
    """sha256 of each source tensor in ``names``, each shard read once in bounded chunks (from
    a Hub repo: only the shards and byte ranges of these tensors are fetched)."""
    by_file: dict[str, list[Segment]] = {}
    for name in names:
        t = ckpt.tensors[name]
        by_file.setdefault(t.file, []).append(Segment(name, t.offset, t.nbytes))
    fetcher = (
        HubFetcher(repo, ckpt, {f: {s.name for s in segs} for f, segs in by_file.items()})
        if repo is not None
        else None
    )
    digests: dict[str, str] = {}
    for file in sorted(by_file):
        src = fetcher.open(file) if fetcher is not None else str(ckpt.path(file))
        digests.update(copy_segments(src, by_file[file], chunk_bytes=chunk_bytes))
    return digests
