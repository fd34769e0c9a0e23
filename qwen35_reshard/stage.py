"""Read a stage directory into plain data and check it against its manifest, without hashing.

One implementation for both readers of a stage: ``loader.open_stage`` refuses the stage with
the first problem found, ``verify`` reports them all and adds its own checks (tensor digests,
the writer's stricter header rules, layer coverage, the run directory, the source).

:func:`read_stage` checks, reading only JSON and safetensors headers: the manifest is a
structurally valid stage manifest; the directory's name ``ppN`` and the run directory beside
it agree with it; the index is the one it records and lists exactly its tensors; config.json
is the recorded one; every data file has its recorded size, a valid header, and exactly its
tensors with their dtypes and shapes. Every message is one line that says what to do.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

from . import names, schema
from .errors import ReshardError
from .header import DTYPE_SIZES, Header, read_header
from .layouts import ALIGNED, CLONE, GATHERED, LAYOUTS
from .manifest import RUN_MANIFEST, STAGE_DIR, STAGE_FORMAT, STAGE_MANIFEST
from .source import CONFIG_NAME, INDEX_NAME
from .split import RUNTIMES, layer_ranges, placement_rules
from .write import RUN_MARKER

# Kinds of problem.
MISSING = "missing"  # something that must be there is not
EXTRA = "extra"  # something is there that must not be
DIFFERENT = "different"  # present, but not what the manifest or the source says
CORRUPT = "corrupt"  # not a valid file of its kind
INCOMPLETE = "incomplete"  # a stage or run that was not finished
KINDS = (MISSING, EXTRA, DIFFERENT, CORRUPT, INCOMPLETE)

RERUN = "run the same qwen35-reshard command again to resume"
REBUILD = "delete it and run the same qwen35-reshard command again (or copy the stage again)"
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a stage directory: its kind, a one-line message, and where."""

    kind: str
    message: str
    file: str | None = None
    tensor: str | None = None


@dataclass(frozen=True)
class StageTensor:
    """One tensor of a stage: where its bytes are and what they are."""

    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    offset: int  # absolute offset of the tensor's bytes in ``file``; -1 until its header is read
    sha256: str | None  # None: the split shared the bytes with the source and never read them


@dataclass(frozen=True)
class StageManifest:
    """A structurally valid stage manifest, as plain data."""

    rank: int
    pp: int
    runtime: str
    partition: tuple[int, ...]
    start_layer: int
    end_layer: int  # exclusive
    mtp: str | None
    identity: dict | None  # the run identity of the split the stage belongs to
    source: dict  # what identifies the source checkpoint (config_sha256, fingerprint, ...)
    index_sha256: str | None
    files: dict[str, int]  # data file -> size in bytes
    layouts: dict[str, dict]  # data file -> {"layout", "source", "sha256" (a clone's, if known)}
    tensors: dict[str, StageTensor]  # in load order (file, then offset) once read by read_stage
    raw: dict = field(repr=False)  # the manifest as read


@dataclass(frozen=True)
class StageDir:
    """What :func:`read_stage` found: the manifest (None when unusable), headers and problems."""

    manifest: StageManifest | None
    headers: dict[str, Header]  # data files with their recorded size and a valid header
    problems: list[Problem]


def read_stage(root: Path, display: str, run: tuple[str, dict] | None = None) -> StageDir:
    """Check the stage directory ``root`` (``display`` in messages) against its manifest.

    ``run`` is ``(record name, identity)`` from the run directory beside the stage, if any
    (see :func:`read_run_record`). Problems come in the order a user should fix them.
    """
    m = read_manifest(root, display)
    if isinstance(m, Problem):
        return StageDir(None, {}, [m])
    problems: list[Problem] = []
    want = stage_dir_rank(root)
    if want is not None and want != m.rank:
        problems.append(
            Problem(
                DIFFERENT,
                f"{display} holds stage {m.rank} of a pp={m.pp} split, not stage {want}: it was "
                f"moved or belongs to another split; {REBUILD}",
                STAGE_MANIFEST,
            )
        )
    if run is not None and run[1] != m.identity:
        record, theirs = run
        problems.append(
            Problem(
                DIFFERENT,
                f"{display} belongs to another split (pp={m.pp} {m.runtime} partition "
                f"{list(m.partition)}) than the one {record} beside it records (pp={theirs.get('pp')} "
                f"{theirs.get('runtime')} partition {theirs.get('partition')}, or another source): "
                f"delete {display} and run the qwen35-reshard command for the split you want again",
            )
        )
    problems += _index_problems(root, display, m)
    problems += _config_problems(root, display, m)
    problems += _schema_problems(root, display, m)
    by_file: dict[str, dict[str, StageTensor]] = {f: {} for f in m.files}
    for t in m.tensors.values():
        by_file[t.file][t.name] = t
    headers: dict[str, Header] = {}
    for file in sorted(m.files):
        header, found = _read_data_file(root, display, file, m.files[file], by_file[file])
        problems += found
        if header is not None:
            headers[file] = header
    return StageDir(_with_offsets(m, headers), headers, problems)


def read_manifest(root: Path, display: str) -> StageManifest | Problem:
    """The stage manifest of ``root`` after checking its structure, or what is wrong with it."""
    try:
        raw = (root / STAGE_MANIFEST).read_bytes()
    except FileNotFoundError:
        in_run = stage_dir_rank(root) is not None and any(
            (root.parent / n).exists() for n in (RUN_MANIFEST, RUN_MARKER)
        )
        if (root / INDEX_NAME).exists() and not in_run:
            why = (
                f"{display} has a {INDEX_NAME} but no {STAGE_MANIFEST}: it is not a finished "
                "qwen35-reshard stage (a plain checkpoint?); split it with qwen35-reshard, or "
                f"if a split into it was interrupted, {RERUN}"
            )
        else:
            why = f"{display} is incomplete (no {STAGE_MANIFEST}): the reshard run was interrupted; {RERUN}"
        return Problem(INCOMPLETE, why, STAGE_MANIFEST)
    except OSError as e:
        return Problem(CORRUPT, f"{display}/{STAGE_MANIFEST}: cannot read ({e.strerror})", STAGE_MANIFEST)
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        obj = None
    if isinstance(obj, dict) and obj.get("format") != STAGE_FORMAT:
        return Problem(
            CORRUPT,
            f"{display}/{STAGE_MANIFEST} has format {obj.get('format')!r}, not {STAGE_FORMAT!r}: it "
            "was written by another version of qwen35-reshard; use that version or re-split with this one",
            STAGE_MANIFEST,
        )
    m = _parse_manifest(obj) if isinstance(obj, dict) else "not a valid JSON object"
    if isinstance(m, str):
        return Problem(CORRUPT, f"{display}/{STAGE_MANIFEST} is damaged ({m}); {REBUILD}", STAGE_MANIFEST)
    return m


def read_run_record(run_dir: Path, display: str) -> tuple[str, dict] | Problem | None:
    """``(record name, identity)`` of the split the run directory ``run_dir`` records, if any.

    The run marker records a run in progress or interrupted, ``reshard.json`` a finished one;
    the marker is newer when both are there. A stage copied on its own has neither.
    """
    for name in (RUN_MARKER, RUN_MANIFEST):
        try:
            obj = json.loads((run_dir / name).read_bytes())
        except FileNotFoundError:
            continue
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            obj = None
        if not isinstance(obj, dict) or not isinstance(obj.get("identity"), dict):
            what = "no identity" if isinstance(obj, dict) else "not a valid JSON object"
            return Problem(CORRUPT, f"{display}/{name} is damaged ({what}); {RERUN}", name)
        return name, obj["identity"]
    return None


def stage_dir_rank(path: Path) -> int | None:
    """N for a directory named ``ppN``; None for any other name."""
    m = STAGE_DIR.fullmatch(path.name)
    return int(m.group(1)) if m else None


def is_uint(v: object) -> bool:
    """A JSON integer (not a bool) that is not negative."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _parse_manifest(m: dict) -> StageManifest | str:
    """The manifest as plain data, or what is structurally wrong with it."""
    rank, pp, runtime, partition = m.get("stage"), m.get("pp"), m.get("runtime"), m.get("partition")
    if not (is_uint(pp) and pp >= 1 and is_uint(rank) and rank < pp):
        return f"stage {rank!r} of pp {pp!r}"
    if runtime not in RUNTIMES:
        return f"unknown runtime {runtime!r}"
    if not (
        isinstance(partition, list) and len(partition) == pp and all(is_uint(n) and n >= 1 for n in partition)
    ):
        return f"partition {partition!r} is not {pp} positive layer counts"
    start, end = layer_ranges(partition)[rank]
    layers = m.get("layers")
    if not isinstance(layers, dict) or (layers.get("start"), layers.get("end")) != (start, end):
        return f"layers {layers!r} do not match partition {partition} at stage {rank}"
    files, tensors = m.get("files"), m.get("tensors")
    if not isinstance(files, dict) or not isinstance(tensors, dict) or not tensors:
        return "no files or tensors"
    for file, info in files.items():
        if not _plain_safetensors_name(file):
            return f"file name {file!r} is not a plain *.safetensors name"
        if not (isinstance(info, dict) and is_uint(info.get("bytes")) and is_uint(info.get("tensors"))):
            return f"entry of file {file!r}"
        layout, source, digest = info.get("layout", GATHERED), info.get("source"), info.get("sha256")
        if layout not in LAYOUTS or (source is None) != (layout == GATHERED):
            return f"layout of file {file!r}"
        if source is not None and not _plain_safetensors_name(source):
            return f"source of file {file!r}"
        if digest is not None and (layout != CLONE or not _SHA256.fullmatch(str(digest))):
            return f"sha256 of file {file!r}"
    entries: dict[str, StageTensor] = {}
    for name, info in tensors.items():
        t = _parse_tensor(name, info, files)
        if isinstance(t, str):
            return t
        entries[name] = t
    per_file = Counter(t.file for t in entries.values())
    for file, info in files.items():
        if info["tensors"] != per_file[file]:
            return f"file {file!r} should hold {per_file[file]} tensors, not {info['tensors']}"
    identity, source = m.get("identity"), m.get("source")
    return StageManifest(
        rank=rank,
        pp=pp,
        runtime=runtime,
        partition=tuple(partition),
        start_layer=start,
        end_layer=end,
        mtp=m.get("mtp"),
        identity=identity if isinstance(identity, dict) else None,
        source=source if isinstance(source, dict) else {},
        index_sha256=m.get("index_sha256"),
        files={f: info["bytes"] for f, info in files.items()},
        layouts={
            f: {k: info.get(k) for k in ("source", "sha256")} | {"layout": info.get("layout", GATHERED)}
            for f, info in files.items()
        },
        tensors=entries,
        raw=m,
    )


def _parse_tensor(name: str, info: object, files: dict) -> StageTensor | str:
    if not isinstance(info, dict) or not isinstance(info.get("file"), str) or info["file"] not in files:
        return f"tensor {name!r} is not in a listed file"
    dtype, shape, nbytes, digest = (
        info.get("dtype"),
        info.get("shape"),
        info.get("nbytes"),
        info.get("sha256"),
    )
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        return f"tensor {name!r} has unknown dtype {dtype!r}"
    if not (isinstance(shape, list) and all(is_uint(d) for d in shape)):
        return f"shape of tensor {name!r}"
    if not is_uint(nbytes) or nbytes != math.prod(shape) * DTYPE_SIZES[dtype]:
        return f"tensor {name!r} is {nbytes!r} bytes, not {dtype} x {shape}"
    shared = digest is None and files[info["file"]].get("layout") in (CLONE, ALIGNED)
    if not (shared or (isinstance(digest, str) and _SHA256.fullmatch(digest))):
        return f"sha256 of tensor {name!r}"
    return StageTensor(name, info["file"], dtype, tuple(shape), nbytes, -1, digest)


def _plain_safetensors_name(name: object) -> bool:
    return (
        isinstance(name, str)
        and name.endswith(".safetensors")
        and "/" not in name
        and "\\" not in name
        and not name.startswith(".")
    )


def _index_problems(root: Path, display: str, m: StageManifest) -> list[Problem]:
    """The index is present, lists exactly the manifest's tensors, and is the one it records."""
    where = f"{display}/{INDEX_NAME}"
    try:
        raw = (root / INDEX_NAME).read_bytes()
    except FileNotFoundError:
        why = f"{display} is incomplete (no {INDEX_NAME}): the reshard run was interrupted; {RERUN}"
        return [Problem(INCOMPLETE, why, INDEX_NAME)]
    except OSError as e:
        return [Problem(CORRUPT, f"{where}: cannot read ({e.strerror})", INDEX_NAME)]
    try:
        index = json.loads(raw)
        weight_map, total = index["weight_map"], index["metadata"]["total_size"]
        if not isinstance(weight_map, dict):
            raise TypeError
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
        why = f"{where} is damaged (not an index with weight_map and metadata.total_size); {REBUILD}"
        return [Problem(CORRUPT, why, INDEX_NAME)]
    listed = {n: t.file for n, t in m.tensors.items()}
    problems = [
        Problem(
            EXTRA, f"{where} lists tensor {n!r}, which {STAGE_MANIFEST} does not; {REBUILD}", INDEX_NAME, n
        )
        for n in sorted(set(weight_map) - set(listed))
    ]
    problems += [
        Problem(
            MISSING,
            f"{where} lacks tensor {n!r}, which {STAGE_MANIFEST} lists in {listed[n]}; {REBUILD}",
            INDEX_NAME,
            n,
        )
        for n in sorted(set(listed) - set(weight_map))
    ]
    problems += [
        Problem(
            DIFFERENT,
            f"{where} puts tensor {n!r} in {weight_map[n]!r}, but {STAGE_MANIFEST} lists it in "
            f"{listed[n]}; {REBUILD}",
            INDEX_NAME,
            n,
        )
        for n in sorted(set(listed) & set(weight_map))
        if listed[n] != weight_map[n]
    ]
    want_total = sum(t.nbytes for t in m.tensors.values())
    if total != want_total:
        why = f"{where}: total_size {total!r} is not the stage's {want_total} tensor bytes; {REBUILD}"
        problems.append(Problem(DIFFERENT, why, INDEX_NAME))
    if not problems and hashlib.sha256(raw).hexdigest() != m.index_sha256:
        why = (
            f"{where} is not the one {STAGE_MANIFEST} records: the stage is incomplete (an "
            f"interrupted run) or the index was edited; {RERUN}"
        )
        problems.append(Problem(DIFFERENT, why, INDEX_NAME))
    return problems


def _config_problems(root: Path, display: str, m: StageManifest) -> list[Problem]:
    """config.json is the one the stage was split from."""
    try:
        raw = (root / CONFIG_NAME).read_bytes()
    except FileNotFoundError:
        why = (
            f"{display} has no {CONFIG_NAME}; servers need the source's full config on every stage: {REBUILD}"
        )
        return [Problem(MISSING, why, CONFIG_NAME)]
    digest, recorded = hashlib.sha256(raw).hexdigest(), m.source.get("config_sha256")
    if digest == recorded:
        return []
    why = (
        f"{display}/{CONFIG_NAME} differs from the source's config.json it was split from (sha256 "
        f"{digest[:12]}..., {STAGE_MANIFEST} records {str(recorded)[:12]}...); servers derive the "
        f"split from it, so it must be unchanged: {REBUILD}"
    )
    return [Problem(DIFFERENT, why, CONFIG_NAME)]


def _schema_problems(root: Path, display: str, m: StageManifest) -> list[Problem]:
    """The stage holds every tensor its layers and its role need, with the config's shapes.

    The model's schema (see ``schema``) limited to the stage's layers, and of the other
    parts to those the runtime's placement rules give this rank; the manifest's ``mtp``
    says whether the MTP head ships. Checked against what the manifest lists (the data
    files are checked against the manifest separately).
    """
    try:
        config = json.loads((root / CONFIG_NAME).read_bytes())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return []  # reported by _config_problems: config.json must be the source's
    if not isinstance(config, dict):
        return []
    dtypes = {n: t.dtype for n, t in m.tensors.items()}
    kept = m.mtp == "kept"
    try:
        required = schema.required_tensors(
            config, dtypes, layers=range(m.start_layer, m.end_layer), mtp=kept
        ).tensors
    except ReshardError as e:
        return [Problem(DIFFERENT, f"{display}/{e}", CONFIG_NAME)]
    owners = placement_rules(m.pp, m.runtime, schema.tied_embeddings(config), kept)
    need = {n: s for n, s in required.items() if _holds(m, owners, n)}
    missing, wrong = schema.compare(need, {n: t.shape for n, t in m.tensors.items()})
    problems = []
    if missing:
        why = (
            f"{display} lacks tensor {missing[0]!r} ({schema.others(len(missing) - 1)} missing), which "
            f"stage {m.rank} needs for its layers [{m.start_layer}, {m.end_layer}) and its role under "
            f"{m.runtime}'s placement; a server would leave it unloaded: {REBUILD}"
        )
        problems.append(Problem(MISSING, why, STAGE_MANIFEST, missing[0]))
    for name, want, found in wrong:
        why = (
            f"{display}: tensor {name!r} has shape {list(found)} but {CONFIG_NAME} implies {list(want)}; "
            f"{REBUILD}"
        )
        problems.append(Problem(DIFFERENT, why, STAGE_MANIFEST, name))
    return problems


def _holds(m: StageManifest, owners: dict[str, tuple[int, ...]], name: str) -> bool:
    role = names.classify(name)
    if role.kind == names.LAYER:
        return m.start_layer <= role.layer < m.end_layer
    return m.rank in owners[role.kind]


def _read_data_file(
    root: Path, display: str, file: str, nbytes: int, recorded: dict[str, StageTensor]
) -> tuple[Header | None, list[Problem]]:
    """The header of data file ``file`` (None unless it has its recorded ``nbytes`` and a valid
    header), and its problems: missing or damaged, or not holding exactly the ``recorded`` tensors.
    """
    where = f"{display}/{file}"
    try:
        size = os.stat(root / file).st_size
    except FileNotFoundError:
        return None, [Problem(MISSING, f"{where} is missing; the stage's index lists it: {REBUILD}", file)]
    if size != nbytes:
        why = (
            f"{where} is {size} bytes but {STAGE_MANIFEST} records {nbytes}: the file is "
            f"truncated, extended or replaced; {REBUILD}"
        )
        return None, [Problem(CORRUPT, why, file)]
    try:
        header = read_header(root / file, display=where)
    except ReshardError as e:
        return None, [Problem(CORRUPT, f"{e}; {REBUILD}", file)]
    found = {t.name: t for t in header.tensors}
    problems = []
    for name in sorted(set(found) - set(recorded)):
        why = f"{where} holds tensor {name!r}, which {STAGE_MANIFEST} does not list there; {REBUILD}"
        problems.append(Problem(EXTRA, why, file, name))
    for name in sorted(set(recorded) - set(found)):
        why = f"{where} lacks tensor {name!r}, which {STAGE_MANIFEST} lists there; {REBUILD}"
        problems.append(Problem(MISSING, why, file, name))
    for name in sorted(set(recorded) & set(found)):
        t, r = found[name], recorded[name]
        if (t.dtype, t.shape) != (r.dtype, r.shape):
            why = (
                f"{where}: tensor {name!r} is {t.dtype} {list(t.shape)} but {STAGE_MANIFEST} "
                f"records {r.dtype} {list(r.shape)}; {REBUILD}"
            )
            problems.append(Problem(DIFFERENT, why, file, name))
    return header, problems


def _with_offsets(m: StageManifest, headers: dict[str, Header]) -> StageManifest:
    """``m`` with each tensor's offset from its file's header, in load order: file, then offset."""
    ordered: dict[str, StageTensor] = {}
    for file in sorted(headers):
        header = headers[file]
        for entry in header.tensors:  # file-offset order
            t = m.tensors.get(entry.name)
            if t is not None and t.file == file:
                ordered[t.name] = replace(t, offset=header.data_start + entry.begin)
    for name, t in m.tensors.items():
        ordered.setdefault(name, t)
    return replace(m, tensors=ordered)
