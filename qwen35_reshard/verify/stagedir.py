"""The checks of one stage directory that need no source: the loader's checks, the writer's
stricter header rules, stray files, every layer's tensors and every tensor's bytes."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ..format.dtypes import DTYPE_SIZES
from ..format.holder import left_by_gone_run
from ..format.names import (
    CLAIM,
    CLONE,
    CONFIG_NAME,
    INDEX_NAME,
    JOURNAL,
    PARTIAL_SUFFIX,
    SINGLE_FILE_NAME,
    STAGE_MANIFEST,
)
from ..format.paths import checked_file
from ..model.names import LAYER, classify
from ..model.quant import unchecked_message
from ..source.checkpoint import Checkpoint
from ..source.header import Header
from ..stage.findings import CORRUPT, DIFFERENT, EXTRA, INCOMPLETE, MISSING, RERUN, tensor_digest_finding
from ..stage.manifest import StageManifest, damaged_side_files
from ..stage.reader import read_stage
from ..transfer.copier import CHUNK_BYTES, Segment, copy_segments
from .report import SIDE_KIND, Add, CheckedStage, VerifyReport, adder, side_file_message

# transformers refuses safetensors files whose metadata lacks one of these formats.
METADATA_FORMATS = ("pt", "tf", "flax", "mlx")


def check_stage(stage: CheckedStage, report: VerifyReport, ckpt: Checkpoint | None, chunk_bytes: int) -> None:
    """All checks of one stage directory that need no source; fills ``stage`` for the source checks."""
    add = adder(report, stage)
    entries = sorted(p.name for p in stage.path.iterdir())
    for name in entries:
        if name.endswith(PARTIAL_SUFFIX) or name == JOURNAL:
            add(INCOMPLETE, f"{stage.display}/{name} is left from an unfinished run; {RERUN}", file=name)
        elif name == CLAIM and not left_by_gone_run(stage.path / name):
            # A killed run's claim is no finding: a run rebuilding a stage removes its index
            # first, and the checks below find anything it left half done. A live run's is: it
            # may yet replace the stage.
            add(
                INCOMPLETE,
                f"{stage.display}/{name} is present: a qwen35-reshard run is building this stage, or "
                f"one was killed while it did; {RERUN} (it waits for a live run, and takes over from a "
                "killed one)",
                file=name,
            )
    found = read_stage(stage.path, stage.display, stage.run)
    for p in found.problems:
        add(p.kind, p.text, file=p.file, tensor=p.tensor)
    if found.unchecked:
        report.unchecked.append(unchecked_message(stage.display, found.unchecked))
    m = stage.manifest = found.manifest
    if m is None:
        return
    report.recorded_split |= m.identity is not None
    if report.recorded_source is None:
        report.recorded_source, report.recorded_revision = recorded_source(m.source)
    stage.summary.rank = m.rank
    stage.summary.complete = not any(p.file == INDEX_NAME for p in found.problems)
    # config.json has its own check (read_stage): it must be the source's.
    recorded = {n: d for n, d in m.side_files.items() if n != CONFIG_NAME}
    for name, why in damaged_side_files(stage.path, recorded):
        add(SIDE_KIND[why], side_file_message(stage.display, name, why), file=name)
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
    stage.summary.bytes = sum(m.files.values())
    stage.summary.tensors = len(m.tensors)


def compare_side_file(stage: CheckedStage, ckpt: Checkpoint, name: str, add: Add) -> None:
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
    stage: CheckedStage,
    m: StageManifest,
    file: str,
    header: Header,
    add: Add,
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
    problem = _strict_extras(path, header, where) if layout.layout != CLONE else None
    if problem is not None:
        add(CORRUPT, problem, file=file)
        return
    if layout.sha256 is not None:
        _check_file_digest(path, layout.sha256, where, add, file)
    recorded = {n: t.digest for n, t in m.tensors.items() if t.file == file}
    segments = []
    for t in header.tensors:
        if for_source or recorded.get(t.name) is not None:
            segments.append(Segment(t.name, header.data_start + t.begin, t.nbytes))
        elif t.name in recorded and layout.sha256 is None:
            stage.summary.bytes_unrecorded += t.nbytes
    digests = copy_segments(str(path), segments, chunk_bytes=chunk_bytes, digest=m.digest)
    stage.summary.bytes_hashed += sum(s.nbytes for s in segments)
    for name, digest in digests.items():
        stage.digests[name] = digest
        if recorded.get(name) is not None and recorded[name] != digest:
            found = tensor_digest_finding(where, file, name, m.digest)
            add(found.kind, found.text, file=found.file, tensor=found.tensor)


def _check_file_digest(path: Path, recorded: str, where: str, add: Add, file: str) -> None:
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


def _check_layers(stage: CheckedStage, m: StageManifest, add: Add) -> None:
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


def recorded_source(source: dict) -> tuple[str | None, str | None]:
    """``(source, revision)`` a repair can read the split's bytes from, as a stage manifest's
    ``source`` record names it: the directory it was read from, unless that is a Hugging Face
    cache snapshot that lacks shards (a split from a repo id fetches them straight into the
    stages, not the cache); then the repo id pinned to the recorded commit."""
    path = source.get("path") if isinstance(source.get("path"), str) else None
    repo, commit = source.get("repo_id"), source.get("commit")
    if isinstance(repo, str) and isinstance(commit, str) and (path is None or not _holds_shards(Path(path))):
        return repo, commit
    return path, None


def _holds_shards(snapshot: Path) -> bool:
    """Whether ``snapshot`` holds its index (or single file) and every shard the index lists."""
    try:
        index = json.loads((snapshot / INDEX_NAME).read_bytes())
        shards = set(index["weight_map"].values())
    except FileNotFoundError:
        shards = {SINGLE_FILE_NAME}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    return all(isinstance(s, str) and (snapshot / s).is_file() for s in shards)
