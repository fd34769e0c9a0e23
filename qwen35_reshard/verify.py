"""Check a split: every stage's data files, index, config and manifest, and optionally the source.

``verify(OUT)`` or ``verify(OUT/pp2)`` never trusts the manifest alone. Each data file is
parsed with rules stricter than the reference reader (see :func:`_strict_extras`), the index
must list exactly the files and tensors present, config.json must be the recorded one, and
every tensor's bytes are hashed (in bounded chunks) and compared with the manifest. With a
source checkpoint, the plan is rebuilt from the settings each stage's manifest records, and
every tensor's placement and bytes are compared with the source.

Problems are collected as findings rather than raised, so one run reports everything that is
wrong; a ReshardError is raised only for bad input (OUT is not a directory, a bad source).
A stage without its manifest or index is reported as incomplete, never accepted.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .copy import CHUNK_BYTES
from .errors import ReshardError
from .header import DTYPE_SIZES, Header, read_header
from .manifest import RUN_MANIFEST, STAGE_FORMAT, STAGE_MANIFEST, source_identity
from .names import LAYER, classify
from .plan import MTP_DROPPED, Plan, make_plan
from .source import CONFIG_NAME, INDEX_NAME, Checkpoint, read_checkpoint
from .split import RUNTIMES, layer_ranges, parse_partition
from .write import JOURNAL, PARTIAL_SUFFIX, RUN_MARKER

# Kinds of finding.
MISSING = "missing"  # something that must be there is not
EXTRA = "extra"  # something is there that must not be
DIFFERENT = "different"  # present, but not what the manifest or the source says
CORRUPT = "corrupt"  # not a valid file of its kind
INCOMPLETE = "incomplete"  # a stage or run that was not finished
KINDS = (MISSING, EXTRA, DIFFERENT, CORRUPT, INCOMPLETE)

# transformers refuses safetensors files whose metadata lacks one of these formats.
METADATA_FORMATS = ("pt", "tf", "flax", "mlx")
_STAGE_DIR = re.compile(r"pp(0|[1-9][0-9]*)")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_RERUN = "run the same qwen35-reshard command again to resume"

# add(kind, message, file=..., tensor=...): records a finding of one stage.
_Add = Callable[..., None]


@dataclass(frozen=True)
class Finding:
    """One problem: what kind, where (stage directory, file, tensor) and a one-line message."""

    kind: str
    message: str
    stage: str | None = None  # stage directory name (pp0); None for the run directory
    file: str | None = None
    tensor: str | None = None


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


@dataclass
class VerifyReport:
    """Everything verify found. ``ok`` when there is no finding."""

    target: str
    source: str | None = None
    stages: list[StageSummary] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    not_built: list[int] = field(default_factory=list)  # stages of the split absent on purpose (--rank)
    source_bytes_hashed: int = 0

    @property
    def ok(self) -> bool:
        return not self.findings

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
            "not_built": self.not_built,
            "source_bytes_hashed": self.source_bytes_hashed,
            "findings": [asdict(f) for f in self.findings],
        }


@dataclass
class _Stage:
    """A stage directory while it is being checked."""

    path: Path
    display: str  # path as shown in messages
    summary: StageSummary
    expected_rank: int | None  # from the directory name ppN
    run_identity: dict | None  # identity recorded by the run directory, if any
    manifest: dict | None = None
    digests: dict[str, str] = field(default_factory=dict)  # sha256 computed from the files


def verify(
    path: str | os.PathLike[str],
    source: str | os.PathLike[str] | None = None,
    *,
    chunk_bytes: int = CHUNK_BYTES,
) -> VerifyReport:
    """Check the run directory or single stage directory ``path``; compare with ``source`` if given.

    Raises ReshardError only for bad input; everything wrong with the split is a finding.
    """
    display = os.fspath(path)
    root = Path(display)
    if not root.is_dir():
        raise ReshardError(f"{display}: not a directory; pass OUT or one of its stage directories (OUT/pp0)")
    ckpt = read_checkpoint(source) if source is not None else None
    report = VerifyReport(target=display, source=os.fspath(source) if source is not None else None)
    if _is_run_dir(root):
        stages = _check_run_dir(root, display, report)
    elif _is_stage_dir(root):
        stages = [_new_stage(root, display, report, _parent_identity(root, display, report))]
    else:
        raise ReshardError(
            f"{display}: holds no stage directories (pp0, pp1, ...) and no {STAGE_MANIFEST}; pass the "
            "OUT of a qwen35-reshard run or one of its stage directories"
        )
    for stage in stages:
        _check_stage(stage, report, ckpt, chunk_bytes)
    if ckpt is not None:
        _check_against_source(ckpt, [s for s in stages if s.manifest is not None], report, chunk_bytes)
    return report


# --------------------------------------------------------------------------- run directory


def _is_run_dir(root: Path) -> bool:
    # A run killed before its marker was renamed into place leaves only the marker's temporary.
    names = (RUN_MANIFEST, RUN_MARKER, f".{RUN_MARKER}{PARTIAL_SUFFIX}", f".{RUN_MANIFEST}{PARTIAL_SUFFIX}")
    if any((root / name).exists() for name in names):
        return True
    return any(_STAGE_DIR.fullmatch(p.name) and p.is_dir() for p in root.iterdir())


def _is_stage_dir(root: Path) -> bool:
    if _STAGE_DIR.fullmatch(root.name):
        return True
    names = (STAGE_MANIFEST, INDEX_NAME, JOURNAL)
    return any(p.name in names or p.name.endswith(".safetensors") for p in root.iterdir())


def _stage_dirs(root: Path) -> dict[int, Path]:
    found = {int(p.name[2:]): p for p in root.iterdir() if _STAGE_DIR.fullmatch(p.name) and p.is_dir()}
    return dict(sorted(found.items()))


def _check_run_dir(root: Path, display: str, report: VerifyReport) -> list[_Stage]:
    """Run-level checks; returns the stage directories to check.

    A finished run has ``reshard.json`` and no run marker. Stages the run manifest records as
    complete must be present; stages it never built (``--rank``) are noted, not failed.
    """
    for p in sorted(root.iterdir()):
        if p.name.endswith(PARTIAL_SUFFIX):
            report.findings.append(
                Finding(
                    INCOMPLETE, f"{display}/{p.name} is left from an unfinished run; {_RERUN}", file=p.name
                )
            )
    marker = _read_json_finding(root / RUN_MARKER, display, report)
    run = _read_json_finding(root / RUN_MANIFEST, display, report)
    if (root / RUN_MARKER).exists():
        report.findings.append(
            Finding(
                INCOMPLETE,
                f"{display}/{RUN_MARKER} is present: a qwen35-reshard run into {display} is in progress "
                f"or was interrupted; {_RERUN}",
                file=RUN_MARKER,
            )
        )
    elif not (root / RUN_MANIFEST).exists():
        report.findings.append(
            Finding(
                INCOMPLETE,
                f"{display} has no {RUN_MANIFEST}: the run that wrote it did not finish; {_RERUN}",
                file=RUN_MANIFEST,
            )
        )
    record, record_name = (run, RUN_MANIFEST) if run is not None else (marker, RUN_MARKER)
    identity = record.get("identity") if isinstance(record, dict) else None
    if record is not None and not isinstance(identity, dict):
        report.findings.append(
            Finding(CORRUPT, f"{display}/{record_name}: no identity; the file is damaged", file=record_name)
        )
        identity = None

    dirs = _stage_dirs(root)
    pp = identity.get("pp") if identity else None
    complete = _recorded_complete(run)
    for rank in sorted(complete - set(dirs)):
        report.findings.append(
            Finding(
                MISSING,
                f"{display}/pp{rank} is missing but {RUN_MANIFEST} records it as complete",
                stage=f"pp{rank}",
            )
        )
    stages = []
    for rank, path in dirs.items():
        if isinstance(pp, int) and rank >= pp:
            report.findings.append(
                Finding(
                    EXTRA,
                    f"{display}/pp{rank} is not a stage of this pp={pp} split; it is left over from "
                    "another split: delete it",
                    stage=f"pp{rank}",
                )
            )
            continue
        stages.append(_new_stage(path, f"{display}/pp{rank}", report, identity))
    if isinstance(pp, int):
        report.not_built = [r for r in range(pp) if r not in dirs and r not in complete]
    return stages


def _recorded_complete(run: dict | None) -> set[int]:
    stages = run.get("stages") if isinstance(run, dict) else None
    if not isinstance(stages, list):
        return set()
    return {
        s["stage"] for s in stages if isinstance(s, dict) and s.get("complete") and _is_uint(s.get("stage"))
    }


def _parent_identity(root: Path, display: str, report: VerifyReport) -> dict | None:
    """The identity a run directory records beside a stage directory ppN, if any."""
    if not _STAGE_DIR.fullmatch(root.name):
        return None
    for name in (RUN_MANIFEST, RUN_MARKER):
        rec = _read_json_finding(root.parent / name, str(root.parent), report)
        if rec is not None and isinstance(rec.get("identity"), dict):
            return rec["identity"]
    return None


def _new_stage(path: Path, display: str, report: VerifyReport, run_identity: dict | None) -> _Stage:
    summary = StageSummary(stage=path.name, path=display)
    report.stages.append(summary)
    m = _STAGE_DIR.fullmatch(path.name)
    return _Stage(path, display, summary, int(m.group(1)) if m else None, run_identity)


def _read_json_finding(path: Path, display: str, report: VerifyReport) -> dict | None:
    """The JSON object at ``path``; None (with a finding if it is damaged) otherwise."""
    try:
        obj = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
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
            add(INCOMPLETE, f"{stage.display}/{name} is left from an unfinished run; {_RERUN}", file=name)
    m = _load_manifest(stage, add)
    if m is None:
        return
    stage.manifest = m
    stage.summary.rank = m["stage"]
    if stage.expected_rank is not None and m["stage"] != stage.expected_rank:
        add(
            DIFFERENT,
            f"{stage.display}/{STAGE_MANIFEST} is stage {m['stage']} of a pp={m['pp']} split, not stage "
            f"{stage.expected_rank}: it was moved or belongs to another split",
            file=STAGE_MANIFEST,
        )
    if stage.run_identity is not None and m.get("identity") != stage.run_identity:
        add(
            DIFFERENT,
            f"{stage.display} belongs to another split (pp={m['pp']} {m['runtime']} partition "
            f"{m['partition']}) than the one recorded in its run directory; delete it and rerun",
        )
    index_ok = _check_index(stage, m, add)
    stage.summary.complete = index_ok
    _check_config(stage, m, ckpt, add)
    _check_file_set(stage, m, entries, add)
    for file in sorted(m["files"]):
        _check_data_file(stage, m, file, add, chunk_bytes)
    _check_layers(stage, m, add)
    stage.summary.files = len(m["files"])
    stage.summary.tensors = len(m["tensors"])


def _adder(report: VerifyReport, stage: _Stage) -> _Add:
    def add(kind: str, message: str, *, file: str | None = None, tensor: str | None = None) -> None:
        report.findings.append(Finding(kind, message, stage.summary.stage, file, tensor))

    return add


def _load_manifest(stage: _Stage, add: _Add) -> dict | None:
    """The stage manifest after checking its structure, or None (with a finding)."""
    path = stage.path / STAGE_MANIFEST
    if not path.exists():
        if (stage.path / INDEX_NAME).exists():
            add(
                INCOMPLETE,
                f"{stage.display} has a {INDEX_NAME} but no {STAGE_MANIFEST}: not a finished "
                f"qwen35-reshard stage (a plain checkpoint, or an interrupted run: {_RERUN})",
                file=STAGE_MANIFEST,
            )
        else:
            add(
                INCOMPLETE,
                f"{stage.display} is incomplete (no {STAGE_MANIFEST}); {_RERUN}",
                file=STAGE_MANIFEST,
            )
        return None
    try:
        m = json.loads(path.read_bytes())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        m = None
    problem = _manifest_problem(m)
    if problem:
        add(CORRUPT, f"{stage.display}/{STAGE_MANIFEST} is damaged ({problem})", file=STAGE_MANIFEST)
        return None
    return m


def _manifest_problem(m: object) -> str | None:
    """What is structurally wrong with a stage manifest, or None."""
    if not isinstance(m, dict):
        return "not a JSON object"
    if m.get("format") != STAGE_FORMAT:
        return f"format {m.get('format')!r} is not {STAGE_FORMAT!r}"
    rank, pp, runtime, partition = m.get("stage"), m.get("pp"), m.get("runtime"), m.get("partition")
    if not (_is_uint(pp) and pp >= 1 and _is_uint(rank) and rank < pp):
        return f"stage {rank!r} of pp {pp!r}"
    if runtime not in RUNTIMES:
        return f"unknown runtime {runtime!r}"
    if not (
        isinstance(partition, list)
        and len(partition) == pp
        and all(_is_uint(n) and n >= 1 for n in partition)
    ):
        return f"partition {partition!r} is not {pp} positive layer counts"
    start, end = layer_ranges(partition)[rank]
    layers = m.get("layers")
    if not isinstance(layers, dict) or (layers.get("start"), layers.get("end")) != (start, end):
        return f"layers {layers!r} do not match partition {partition} at stage {rank}"
    files, tensors = m.get("files"), m.get("tensors")
    if not isinstance(files, dict) or not isinstance(tensors, dict):
        return "no files or tensors"
    for file, info in files.items():
        if not _plain_safetensors_name(file):
            return f"file name {file!r} is not a plain *.safetensors name"
        if not (isinstance(info, dict) and _is_uint(info.get("bytes")) and _is_uint(info.get("tensors"))):
            return f"entry of file {file!r}"
    for name, info in tensors.items():
        problem = _tensor_entry_problem(name, info, files)
        if problem:
            return problem
    return None


def _tensor_entry_problem(name: str, info: object, files: dict) -> str | None:
    if not isinstance(info, dict) or info.get("file") not in files:
        return f"tensor {name!r} is not in a listed file"
    dtype, shape, nbytes = info.get("dtype"), info.get("shape"), info.get("nbytes")
    if dtype not in DTYPE_SIZES or not (isinstance(shape, list) and all(_is_uint(d) for d in shape)):
        return f"dtype or shape of tensor {name!r}"
    if nbytes != math.prod(shape) * DTYPE_SIZES[dtype]:
        return f"tensor {name!r} is {nbytes!r} bytes, not {dtype} x {shape}"
    if not (isinstance(info.get("sha256"), str) and _SHA256.fullmatch(info["sha256"])):
        return f"sha256 of tensor {name!r}"
    return None


def _check_index(stage: _Stage, m: dict, add: _Add) -> bool:
    """The index is present, is the one the manifest records, and lists exactly its tensors."""
    where = f"{stage.display}/{INDEX_NAME}"
    try:
        raw = (stage.path / INDEX_NAME).read_bytes()
    except FileNotFoundError:
        add(
            INCOMPLETE,
            f"{stage.display} is incomplete (no {INDEX_NAME}, which is written last); {_RERUN}",
            file=INDEX_NAME,
        )
        return False
    try:
        index = json.loads(raw)
        weight_map = index["weight_map"]
        total = index["metadata"]["total_size"]
        if not isinstance(weight_map, dict):
            raise TypeError
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
        add(CORRUPT, f"{where} is not a valid index (weight_map and metadata.total_size)", file=INDEX_NAME)
        return False
    listed = {n: t["file"] for n, t in m["tensors"].items()}
    found_problem = False
    for name in sorted(set(weight_map) - set(listed)):
        add(
            EXTRA,
            f"{where} lists tensor {name!r}, which the stage does not hold",
            file=INDEX_NAME,
            tensor=name,
        )
        found_problem = True
    for name in sorted(set(listed) - set(weight_map)):
        add(
            MISSING,
            f"{where} does not list tensor {name!r}, which the stage holds in {listed[name]}",
            file=INDEX_NAME,
            tensor=name,
        )
        found_problem = True
    for name in sorted(n for n in set(listed) & set(weight_map) if listed[n] != weight_map[n]):
        add(
            DIFFERENT,
            f"{where} puts tensor {name!r} in {weight_map[name]!r}, but it is in {listed[name]}",
            file=INDEX_NAME,
            tensor=name,
        )
        found_problem = True
    want_total = sum(t["nbytes"] for t in m["tensors"].values())
    if total != want_total:
        add(
            DIFFERENT,
            f"{where}: total_size {total!r} is not the stage's {want_total} tensor bytes",
            file=INDEX_NAME,
        )
        found_problem = True
    if not found_problem and hashlib.sha256(raw).hexdigest() != m.get("index_sha256"):
        add(
            DIFFERENT,
            f"{where} is not the one {STAGE_MANIFEST} records (edited, or from another run)",
            file=INDEX_NAME,
        )
        found_problem = True
    return not found_problem


def _check_config(stage: _Stage, m: dict, ckpt: Checkpoint | None, add: _Add) -> None:
    """config.json is the one the stage was split from (and the source's, when given)."""
    try:
        raw = (stage.path / CONFIG_NAME).read_bytes()
    except FileNotFoundError:
        add(
            MISSING,
            f"{stage.display}/{CONFIG_NAME} is missing; servers need the source's full config on every stage",
            file=CONFIG_NAME,
        )
        return
    digest = hashlib.sha256(raw).hexdigest()
    recorded = (m.get("source") or {}).get("config_sha256")
    if digest != recorded:
        add(
            DIFFERENT,
            f"{stage.display}/{CONFIG_NAME} is not the config.json the stage was split from "
            f"(sha256 {digest[:12]}..., {STAGE_MANIFEST} records {str(recorded)[:12]}...)",
            file=CONFIG_NAME,
        )
    if ckpt is None:
        return
    for name in ckpt.extra_files:
        _compare_side_file(stage, ckpt, name, add)


def _compare_side_file(stage: _Stage, ckpt: Checkpoint, name: str, add: _Add) -> None:
    try:
        mine = (stage.path / name).read_bytes()
    except FileNotFoundError:
        if name != CONFIG_NAME:  # a missing config.json is already reported
            add(
                MISSING,
                f"{stage.display}/{name} is missing; the source has it and every stage needs it",
                file=name,
            )
        return
    if mine != ckpt.path(name).read_bytes():
        add(DIFFERENT, f"{stage.display}/{name} differs from {ckpt.path(name)}", file=name)


def _check_file_set(stage: _Stage, m: dict, entries: list[str], add: _Add) -> None:
    """The data files on disk are exactly the manifest's (and so the index's) files."""
    on_disk = {n for n in entries if n.endswith(".safetensors") and not n.startswith(".")}
    for name in sorted(on_disk - set(m["files"])):
        add(
            EXTRA,
            f"{stage.display}/{name} is not listed in the stage's index: stale data that a loader "
            "globbing *.safetensors would read; delete it",
            file=name,
        )
    for name in sorted(set(m["files"]) - on_disk):
        add(MISSING, f"{stage.display}/{name} is missing; the stage's index lists it", file=name)


def _check_data_file(stage: _Stage, m: dict, file: str, add: _Add, chunk_bytes: int) -> None:
    """One data file: size, strict header, exactly the manifest's tensors, and their bytes."""
    path = stage.path / file
    where = f"{stage.display}/{file}"
    if not path.is_file():
        return  # reported by _check_file_set
    size, want = path.stat().st_size, m["files"][file]["bytes"]
    if size != want:
        add(
            CORRUPT,
            f"{where} is {size} bytes but {STAGE_MANIFEST} records {want}: truncated, extended or replaced",
            file=file,
        )
        return
    try:
        header = read_header(path, display=where)
        _strict_extras(path, header, where)
    except ReshardError as e:
        add(CORRUPT, str(e), file=file)
        return
    recorded = {n: t for n, t in m["tensors"].items() if t["file"] == file}
    found = {t.name: t for t in header.tensors}
    for name in sorted(set(found) - set(recorded)):
        add(
            EXTRA,
            f"{where} holds tensor {name!r}, which {STAGE_MANIFEST} does not list there",
            file=file,
            tensor=name,
        )
    for name in sorted(set(recorded) - set(found)):
        add(
            MISSING,
            f"{where} lacks tensor {name!r}, which {STAGE_MANIFEST} lists there",
            file=file,
            tensor=name,
        )
    for name in sorted(set(recorded) & set(found)):
        t, r = found[name], recorded[name]
        if (t.dtype, list(t.shape)) != (r["dtype"], r["shape"]):
            add(
                DIFFERENT,
                f"{where}: tensor {name!r} is {t.dtype} {list(t.shape)} but {STAGE_MANIFEST} "
                f"records {r['dtype']} {r['shape']}",
                file=file,
                tensor=name,
            )
    ranges = [(t.name, header.data_start + t.begin, t.nbytes) for t in header.tensors]
    digests = hash_ranges(path, ranges, chunk_bytes=chunk_bytes)
    stage.summary.bytes_hashed += sum(n for _, _, n in ranges)
    for name, digest in digests.items():
        stage.digests[name] = digest
        if name in recorded and recorded[name]["sha256"] != digest:
            add(
                DIFFERENT,
                f"{where}: the bytes of tensor {name!r} do not match its sha256 in {STAGE_MANIFEST}; "
                "the file is damaged",
                file=file,
                tensor=name,
            )


def _strict_extras(path: Path, header: Header, where: str) -> None:
    """Rules beyond :func:`header.read_header` that every file qwen35-reshard writes obeys.

    The header is padded with spaces only, so that the data buffer starts at a multiple of 8;
    its metadata names a format transformers accepts; every tensor starts at a multiple of its
    element size.
    """
    with open(path, "rb") as f:
        raw = os.pread(f.fileno(), header.data_start - 8, 8)
    if not raw.rstrip(b" ").endswith(b"}"):
        raise ReshardError(f"{where}: header is padded with bytes other than spaces")
    if header.data_start % 8:
        raise ReshardError(f"{where}: data buffer starts at byte {header.data_start}, not a multiple of 8")
    if header.metadata.get("format") not in METADATA_FORMATS:
        raise ReshardError(
            f"{where}: __metadata__ format is {header.metadata.get('format')!r}, not one of "
            f"{', '.join(METADATA_FORMATS)}; transformers refuses such files"
        )
    for t in header.tensors:
        if t.begin % DTYPE_SIZES[t.dtype]:
            raise ReshardError(
                f"{where}: tensor {t.name!r} starts at data offset {t.begin}, not a multiple of its "
                f"{DTYPE_SIZES[t.dtype]}-byte {t.dtype} elements"
            )


def _check_layers(stage: _Stage, m: dict, add: _Add) -> None:
    """Decoder-layer tensors belong to the stage's layers, and each of its layers has some."""
    start, end = m["layers"]["start"], m["layers"]["end"]
    seen = set()
    for name in sorted(m["tensors"]):
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


# --------------------------------------------------------------------------- against the source


def _check_against_source(
    ckpt: Checkpoint, stages: list[_Stage], report: VerifyReport, chunk_bytes: int
) -> None:
    """Placement and bytes of every tensor of ``stages`` (those with a valid manifest) against the source.

    The plan is rebuilt from each stage manifest's settings (pp, runtime, partition, mtp);
    each needed source tensor is hashed once, even when it is replicated on several stages.
    """
    fingerprint = source_identity(ckpt)["fingerprint"]
    plans: dict[tuple, Plan | None] = {}
    to_compare: list[tuple[_Stage, str]] = []
    for stage in stages:
        add = _adder(report, stage)
        m = stage.manifest
        if (m.get("source") or {}).get("fingerprint") != fingerprint:
            add(
                DIFFERENT,
                f"{stage.display} was split from another checkpoint than {ckpt.root} (or the "
                "source changed since): config, index or shard sizes differ",
            )
        plan = _plan_for(ckpt, m, plans, add, stage.display)
        if plan is None:
            continue
        to_compare += _compare_placement(ckpt, plan, stage, add)
        if _recorded_limits(m) is not None and not report.findings_for(stage.summary.stage):
            _compare_layout(plan, stage, add)
    wanted = sorted({name for _, name in to_compare})
    source_digests = _hash_source(ckpt, wanted, chunk_bytes)
    report.source_bytes_hashed = sum(ckpt.tensors[n].nbytes for n in wanted)
    for stage, name in to_compare:
        mine = stage.digests.get(name)
        if mine is not None and mine != source_digests[name]:
            file = stage.manifest["tensors"][name]["file"]
            _adder(report, stage)(
                DIFFERENT,
                f"{stage.display}/{file}: the bytes of tensor {name!r} differ from the source's "
                f"({ckpt.tensors[name].file})",
                file=file,
                tensor=name,
            )


def _plan_for(ckpt: Checkpoint, m: dict, plans: dict, add: _Add, display: str) -> Plan | None:
    """The plan the stage's recorded settings give for ``ckpt``; None (with a finding) if none.

    Output file limits are taken from the run identity when it records them (so the exact file
    layout can be compared); older manifests get the defaults, which decide stages alike.
    """
    limits = _recorded_limits(m) or {}
    key = (m["pp"], m["runtime"], tuple(m["partition"]), m.get("mtp"), tuple(sorted(limits.items())))
    if key not in plans:
        try:
            partition = parse_partition(
                ",".join(map(str, m["partition"])), pp=m["pp"], num_layers=ckpt.num_layers
            )
            plans[key] = make_plan(
                ckpt,
                pp=m["pp"],
                runtime=m["runtime"],
                partition=partition,
                keep_mtp=m.get("mtp") != MTP_DROPPED,
                **limits,
            )
        except ReshardError as e:
            plans[key] = None
            add(
                DIFFERENT,
                f"{display}: its recorded split (pp={m['pp']} {m['runtime']} partition "
                f"{m['partition']}) does not fit the source: {e}",
            )
    return plans[key]


def _recorded_limits(m: dict) -> dict[str, int] | None:
    """``max_file_bytes`` and ``max_header_bytes`` from the manifest's run identity, if recorded."""
    identity = m.get("identity")
    keys = ("max_file_bytes", "max_header_bytes")
    if not isinstance(identity, dict) or not all(_is_uint(identity.get(k)) and identity[k] > 0 for k in keys):
        return None
    return {k: identity[k] for k in keys}


def _compare_layout(plan: Plan, stage: _Stage, add: _Add) -> None:
    """Each data file is the plan's: same name, and header bytes equal to the plan's header.

    With every tensor's bytes checked elsewhere, this makes every byte of every file the one
    the plan dictates. Only for stages that hold exactly the right tensors.
    """
    for f in plan.stages[stage.manifest["stage"]].files:
        path = stage.path / f.name
        where = f"{stage.display}/{f.name}"
        try:
            with open(path, "rb") as fh:
                head = fh.read(len(f.header))
        except FileNotFoundError:
            add(MISSING, f"{where} is missing; the plan lays the stage out in it", file=f.name)
            continue
        if head != f.header:
            add(
                DIFFERENT,
                f"{where}: header differs from the plan's (other tensors, order or offsets in this file)",
                file=f.name,
            )


def _compare_placement(ckpt: Checkpoint, plan: Plan, stage: _Stage, add: _Add) -> list[tuple[_Stage, str]]:
    """Missing, extra and differently shaped tensors; returns the (stage, tensor) pairs to hash."""
    rank = stage.manifest["stage"]
    expected = {t.name for t in plan.stages[rank].tensors}
    actual = stage.manifest["tensors"]
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
        add(EXTRA, f"{stage.display} holds tensor {name!r} but {why}", file=actual[name]["file"], tensor=name)
    pairs = []
    for name in sorted(expected & set(actual)):
        src, info = ckpt.tensors[name], actual[name]
        if (src.dtype, list(src.shape)) != (info["dtype"], info["shape"]):
            add(
                DIFFERENT,
                f"{stage.display}: tensor {name!r} is {info['dtype']} {info['shape']} but the "
                f"source's is {src.dtype} {list(src.shape)}",
                file=info["file"],
                tensor=name,
            )
        else:
            pairs.append((stage, name))
    return pairs


def _hash_source(ckpt: Checkpoint, names: list[str], chunk_bytes: int) -> dict[str, str]:
    by_file: dict[str, list[tuple[str, int, int]]] = {}
    for name in names:
        t = ckpt.tensors[name]
        by_file.setdefault(t.file, []).append((name, t.offset, t.nbytes))
    digests: dict[str, str] = {}
    for file in sorted(by_file):
        digests.update(hash_ranges(ckpt.path(file), by_file[file], chunk_bytes=chunk_bytes))
    return digests


# --------------------------------------------------------------------------- hashing


def hash_ranges(
    path: str | os.PathLike[str], ranges: list[tuple[str, int, int]], *, chunk_bytes: int = CHUNK_BYTES
) -> dict[str, str]:
    """sha256 of each ``(key, offset, nbytes)`` byte range of the file at ``path``.

    Ranges are read in offset order, adjacent ones as one stream of ``chunk_bytes`` reads into
    one reused buffer, so memory stays bounded whatever the tensor sizes.
    """
    ranges = sorted(ranges, key=lambda r: r[1])
    digests: dict[str, str] = {}
    buf = memoryview(bytearray(chunk_bytes))
    fd = os.open(path, os.O_RDONLY)
    try:
        i = 0
        while i < len(ranges):
            j = i + 1
            while j < len(ranges) and ranges[j][1] == ranges[j - 1][1] + ranges[j - 1][2]:
                j += 1
            _hash_span(fd, os.fspath(path), ranges[i:j], buf, digests)
            i = j
    finally:
        os.close(fd)
    return digests


def _hash_span(fd: int, where: str, span: list[tuple[str, int, int]], buf: memoryview, digests: dict) -> None:
    hashers = {key: hashlib.sha256() for key, _, _ in span}
    k, pos, end = 0, span[0][1], span[-1][1] + span[-1][2]
    while k < len(span) and span[k][2] == 0:  # empty tensors at the start of the span
        digests[span[k][0]] = hashers[span[k][0]].hexdigest()
        k += 1
    while pos < end:
        n = min(len(buf), end - pos)
        got = os.preadv(fd, [buf[:n]], pos)
        if got != n:
            raise ReshardError(f"{where}: file ended at byte {pos + got} while reading up to byte {end}")
        chunk_end = pos + n
        while k < len(span) and span[k][1] < chunk_end:
            key, off, size = span[k]
            hashers[key].update(buf[max(off, pos) - pos : min(off + size, chunk_end) - pos])
            if off + size > chunk_end:
                break
            digests[key] = hashers[key].hexdigest()
            k += 1
        pos = chunk_end
    for key, _, _ in span[k:]:  # empty tensors at the end of the span
        digests[key] = hashers[key].hexdigest()


def _is_uint(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _plain_safetensors_name(name: object) -> bool:
    return (
        isinstance(name, str)
        and name.endswith(".safetensors")
        and "/" not in name
        and "\\" not in name
        and not name.startswith(".")
    )
