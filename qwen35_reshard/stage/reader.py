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
from dataclasses import dataclass, replace
from itertools import repeat
from operator import add, attrgetter
from pathlib import Path

from ..errors import JSON_ERRORS, ReshardError
from ..format.identity import RunIdentity, describe_differences
from ..format.jsonio import load_index
from ..format.manifest import STAGE_FORMAT, TENSOR_DIGESTS
from ..format.names import (
    CONFIG_NAME,
    INDEX_NAME,
    MTP_KEPT,
    RUN_MANIFEST,
    RUN_MARKER,
    STAGE_MANIFEST,
    stage_dir_rank,
)
from ..format.paths import checked_file
from ..model import names, schema
from ..model.quant import QUANT_SIDE_FILE
from ..model.runtimes import placement_rules
from ..source.header import Header, read_header
from .findings import CORRUPT, DIFFERENT, EXTRA, INCOMPLETE, MISSING, REBUILD, RERUN, Finding
from .manifest import StageManifest, StageTensor, decode_stage_manifest, parse_stage_manifest, set_once
from .nodes import expert_problems, node_dir_problems


@dataclass(frozen=True)
class StageDir:
    """What :func:`read_stage` found: the manifest (None when unusable), headers and problems."""

    manifest: StageManifest | None
    headers: dict[str, Header]  # data files with their recorded size and a valid header
    problems: list[Finding]
    unchecked: str | None = None  # a quantization method whose Linear tensors went unchecked


def stage_dirs(run_dir: Path) -> dict[int, Path]:
    """The stage directories (``ppN``, directories or links to one) in ``run_dir``, by rank.

    Args:
        run_dir: A run directory OUT.

    Returns:
        Rank -> stage directory, in rank order.

    Raises:
        OSError: ``run_dir`` cannot be listed.
    """
    found = {rank: p for p in run_dir.iterdir() if (rank := stage_dir_rank(p)) is not None and p.is_dir()}
    return dict(sorted(found.items()))


def read_stage(root: Path, display: str, run: RunRecord | None = None) -> StageDir:
    """Check the stage directory ``root`` (``display`` in messages) against its manifest.

    ``run`` is ``(record name, identity)`` from the run directory beside the stage, if any
    (see :func:`read_run_record`). Problems come in the order a user should fix them.
    """
    m = read_manifest(root, display)
    if isinstance(m, Finding):
        return StageDir(None, {}, [m])
    problems = node_dir_problems(root, display, m)
    want = stage_dir_rank(root)
    if want is not None and (want != m.rank or m.node is not None):
        problems.append(
            Finding(
                DIFFERENT,
                f"{display} holds stage {m.rank} of a pp={m.pp} split, not stage {want}: it was "
                f"moved or belongs to another split; {REBUILD}",
                STAGE_MANIFEST,
            )
        )
    if run is not None and run.identity != m.identity:
        differ = describe_differences(run.identity, m.identity) if m.identity else "no recorded identity"
        problems.append(
            Finding(
                DIFFERENT,
                f"{display} belongs to another split than the one {run.name} beside it records "
                f"({differ}): delete {display} and run the qwen35-reshard command for the split "
                "you want again",
            )
        )
    problems += _index_problems(root, display, m)
    problems += _config_problems(root, display, m)
    found, unchecked = _schema_problems(root, display, m)
    problems += found
    headers: dict[str, Header] = {}
    in_order: dict[str, list[StageTensor] | None] = {}
    for file in sorted(m.files):
        header, in_order[file], found = _read_data_file(root, display, file, m)
        problems += found
        if header is not None:
            headers[file] = header
    return StageDir(_with_offsets(m, headers, in_order), headers, problems, unchecked)


def read_manifest(root: Path, display: str) -> StageManifest | Finding:
    """The stage manifest of ``root`` after checking its structure, or what is wrong with it."""
    try:
        raw = checked_file(root, STAGE_MANIFEST).read_bytes()
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
        return Finding(INCOMPLETE, why, STAGE_MANIFEST)
    except OSError as e:
        return Finding(CORRUPT, f"{display}/{STAGE_MANIFEST}: cannot read ({e.strerror})", STAGE_MANIFEST)
    fast = decode_stage_manifest(raw)  # None, or a manifest with a problem: read again below, exactly
    if fast is not None and fast.get("format") in TENSOR_DIGESTS:
        m = parse_stage_manifest(fast)
        if isinstance(m, StageManifest):
            return m
    try:
        obj = json.loads(raw)
    except JSON_ERRORS:
        obj = None
    if isinstance(obj, dict) and obj.get("format") not in TENSOR_DIGESTS:
        return Finding(
            CORRUPT,
            f"{display}/{STAGE_MANIFEST} has format {obj.get('format')!r}, not {STAGE_FORMAT!r}: it "
            "was written by another version of qwen35-reshard; use that version or re-split with this one",
            STAGE_MANIFEST,
        )
    m = parse_stage_manifest(obj) if isinstance(obj, dict) else "not a valid JSON object"
    if isinstance(m, str):
        return Finding(CORRUPT, f"{display}/{STAGE_MANIFEST} is damaged ({m}); {REBUILD}", STAGE_MANIFEST)
    return m


@dataclass(frozen=True)
class RunRecord:
    """What a run directory records of its split: the file it is in (``name``: the run marker
    of a run in progress or interrupted, or ``reshard.json`` of a finished one) and the
    split's identity."""

    name: str
    identity: RunIdentity

    @property
    def in_progress(self) -> bool:
        """Whether it is the run marker's: a run in progress, or interrupted."""
        return self.name == RUN_MARKER


def read_run_record(run_dir: Path, display: str) -> RunRecord | Finding | None:
    """The record of the split the run directory ``run_dir`` holds, if any; a Finding when the
    record is damaged.

    The run marker records a run in progress or interrupted, ``reshard.json`` a finished one;
    the marker is newer when both are there. A stage copied on its own has neither.
    """
    for name in (RUN_MARKER, RUN_MANIFEST):
        try:
            obj = json.loads(checked_file(run_dir, name).read_bytes())
        except FileNotFoundError:
            continue
        except (OSError, *JSON_ERRORS):
            obj = None
        identity = RunIdentity.from_json(obj.get("identity")) if isinstance(obj, dict) else None
        if identity is None:
            what = "no valid identity" if isinstance(obj, dict) else "not a valid JSON object"
            why = (
                f"{display}/{name} is damaged ({what}): the directory no longer records which split "
                f"it holds; delete {display} (or choose another directory) and split again"
            )
            return Finding(CORRUPT, why, name)
        return RunRecord(name, identity)
    return None


def _index_problems(root: Path, display: str, m: StageManifest) -> list[Finding]:
    """The index is present, lists exactly the manifest's tensors, and is the one it records."""
    where = f"{display}/{INDEX_NAME}"
    try:
        raw = checked_file(root, INDEX_NAME).read_bytes()
    except FileNotFoundError:
        why = f"{display} is incomplete (no {INDEX_NAME}): the reshard run was interrupted; {RERUN}"
        return [Finding(INCOMPLETE, why, INDEX_NAME)]
    except OSError as e:
        return [Finding(CORRUPT, f"{where}: cannot read ({e.strerror})", INDEX_NAME)]
    index = _parse_index(raw)
    if index is None:
        why = f"{where} is damaged (not an index with weight_map and metadata.total_size); {REBUILD}"
        return [Finding(CORRUPT, why, INDEX_NAME)]
    weight_map, total = index
    problems = [] if _lists_the_manifest(weight_map, m) else _listing_problems(where, weight_map, m)
    want_total = sum(map(_NBYTES, m.tensors.values()))
    if total != want_total:
        why = f"{where}: total_size {total!r} is not the stage's {want_total} tensor bytes; {REBUILD}"
        problems.append(Finding(DIFFERENT, why, INDEX_NAME))
    if not problems and hashlib.sha256(raw).hexdigest() != m.index_sha256:
        why = (
            f"{where} is not the one {STAGE_MANIFEST} records: the stage is incomplete (an "
            f"interrupted run) or the index was edited; {RERUN}"
        )
        problems.append(Finding(DIFFERENT, why, INDEX_NAME))
    return problems


def _lists_the_manifest(weight_map: dict, m: StageManifest) -> bool:
    """Whether the index's ``weight_map`` maps exactly the manifest's tensors to their files.

    Why in this order: the writer lists both by name, so two list comparisons in C usually
    answer without building a dict of every name; otherwise the dicts are compared.
    """
    files = list(map(_FILE, m.tensors.values()))
    if list(weight_map) == list(m.tensors) and list(weight_map.values()) == files:
        return True
    return weight_map == dict(zip(m.tensors, files, strict=True))


def _listing_problems(where: str, weight_map: dict, m: StageManifest) -> list[Finding]:
    """How the index's ``weight_map`` differs from the manifest's tensors and their files."""
    listed = {n: t.file for n, t in m.tensors.items()}
    problems = [
        Finding(
            EXTRA, f"{where} lists tensor {n!r}, which {STAGE_MANIFEST} does not; {REBUILD}", INDEX_NAME, n
        )
        for n in sorted(set(weight_map) - set(listed))
    ]
    problems += [
        Finding(
            MISSING,
            f"{where} lacks tensor {n!r}, which {STAGE_MANIFEST} lists in {listed[n]}; {REBUILD}",
            INDEX_NAME,
            n,
        )
        for n in sorted(set(listed) - set(weight_map))
    ]
    problems += [
        Finding(
            DIFFERENT,
            f"{where} puts tensor {n!r} in {weight_map[n]!r}, but {STAGE_MANIFEST} lists it in "
            f"{listed[n]}; {REBUILD}",
            INDEX_NAME,
            n,
        )
        for n in sorted(set(listed) & set(weight_map))
        if listed[n] != weight_map[n]
    ]
    return problems


def _parse_index(raw: bytes) -> tuple[dict, object] | None:
    """``(weight_map, metadata.total_size)`` of the index ``raw``, or None when it is not one."""
    try:
        index = load_index(raw)
    except JSON_ERRORS:
        return None
    metadata = index.get("metadata") if isinstance(index, dict) else None
    if not (
        isinstance(metadata, dict) and "total_size" in metadata and isinstance(index.get("weight_map"), dict)
    ):
        return None
    return index["weight_map"], metadata["total_size"]


def _config_problems(root: Path, display: str, m: StageManifest) -> list[Finding]:
    """config.json is the one the stage was split from."""
    try:
        raw = checked_file(root, CONFIG_NAME).read_bytes()
    except FileNotFoundError:
        why = (
            f"{display} has no {CONFIG_NAME}; servers need the source's full config on every stage: {REBUILD}"
        )
        return [Finding(MISSING, why, CONFIG_NAME)]
    except OSError as e:
        why = f"{display}/{CONFIG_NAME}: cannot read ({e.strerror}); {REBUILD}"
        return [Finding(CORRUPT, why, CONFIG_NAME)]
    digest, recorded = hashlib.sha256(raw).hexdigest(), m.source.get("config_sha256")
    if digest == recorded:
        return []
    why = (
        f"{display}/{CONFIG_NAME} differs from the source's config.json it was split from (sha256 "
        f"{digest[:12]}..., {STAGE_MANIFEST} records {str(recorded)[:12]}...); servers derive the "
        f"split from it, so it must be unchanged: {REBUILD}"
    )
    return [Finding(DIFFERENT, why, CONFIG_NAME)]


def _schema_problems(root: Path, display: str, m: StageManifest) -> tuple[list[Finding], str | None]:
    """The stage holds every tensor its layers and its role need, with the config's shapes.

    The model's schema (see ``schema``) limited to the stage's layers, and of the other
    parts to those the runtime's placement rules give this rank; the manifest's ``mtp``
    says whether the MTP head ships. Checked against what the manifest lists (the data
    files are checked against the manifest separately).
    """
    try:
        config = json.loads(checked_file(root, CONFIG_NAME).read_bytes())
    except (OSError, *JSON_ERRORS):
        return [], None  # reported by _config_problems: config.json must be the source's
    if not isinstance(config, dict):
        return [], None
    try:
        side = json.loads(checked_file(root, QUANT_SIDE_FILE).read_bytes())
    except FileNotFoundError:
        side = None
    except (OSError, *JSON_ERRORS):
        why = f"{display}/{QUANT_SIDE_FILE}: unreadable, yet servers read the quantization from it: {REBUILD}"
        return [Finding(CORRUPT, why, QUANT_SIDE_FILE)], None
    kept = m.mtp == MTP_KEPT
    try:
        required = schema.required_tensors(
            config, m.tensors, layers=range(m.start_layer, m.end_layer), mtp=kept, quant_side=side
        )
    except ReshardError as e:
        return [Finding(DIFFERENT, f"{display}/{e}", CONFIG_NAME)], None
    owners = placement_rules(m.pp, m.runtime, schema.tied_embeddings(config), kept)
    held = _held(m, owners, required.names, f"{schema.language_model_prefix(config)}layers.")
    missing, wrong = schema.compare_schema(required, m.tensors, held)
    missing, problems = (missing, []) if m.node is None else expert_problems(display, m, config, missing)
    if missing:
        method = required.method_of(missing[0], m.tensors)
        part = f", part of {method}," if method else ""
        why = (
            f"{display} lacks tensor {missing[0]!r}{part} ({schema.others(len(missing) - 1)} missing), which "
            f"stage {m.rank} needs for its layers [{m.start_layer}, {m.end_layer}) and its role under "
            f"{m.runtime}'s placement; a server would leave it unloaded: {REBUILD}"
        )
        problems.append(Finding(MISSING, why, STAGE_MANIFEST, missing[0]))
    for name, want, found in wrong:
        why = (
            f"{display}: tensor {name!r} has shape {list(found)} but {CONFIG_NAME} implies {list(want)}; "
            f"{REBUILD}"
        )
        problems.append(Finding(DIFFERENT, why, STAGE_MANIFEST, name))
    for name, what in required.problems:
        why = f"{display}: tensor {name!r} {what}; {REBUILD}"
        problems.append(Finding(DIFFERENT, why, STAGE_MANIFEST, name))
    return problems, required.unchecked


def _held(
    m: StageManifest, owners: dict[str, tuple[int, ...]], required: list[str], layers: str
) -> list[bool]:
    """Which names of ``required`` (the schema of the stage's layers and of the other parts)
    this stage holds, a flag each: all under ``layers`` (the decoder layers' prefix), and of
    the other parts those that ``owners`` gives its rank.

    Why not ``_holds`` per name: the other names are classified in one regex pass
    (``names.classify_all``) and decided once per distinct key, and the layers' names (almost
    all of a stage's ~47,000) not at all: the schema lists only the stage's own layers.
    """
    in_layer = list(map(str.startswith, required, repeat(layers)))
    others = [i for i, inside in enumerate(in_layer) if not inside]
    keys, roles = names.classify_all(list(map(required.__getitem__, others)))
    keep = {key: _holds(m, owners, role) for key, role in roles.items()}
    for i, key in zip(others, keys, strict=True):
        in_layer[i] = keep[key]
    return in_layer


def _holds(m: StageManifest, owners: dict[str, tuple[int, ...]], role: names.Role) -> bool:
    if role.kind == names.LAYER:
        return m.start_layer <= role.layer < m.end_layer
    return m.rank in owners[role.kind]


def _read_data_file(
    root: Path, display: str, file: str, m: StageManifest
) -> tuple[Header | None, list[StageTensor] | None, list[Finding]]:
    """The header of data file ``file`` (None unless it has the size ``m`` records and a valid
    header); the tensors ``m`` lists there in the header's order when the header lists exactly
    those (see :func:`_in_header_order`), else None; and the file's problems: missing or
    damaged, or not holding exactly the tensors ``m`` lists there.
    """
    where, nbytes = f"{display}/{file}", m.files[file]
    try:
        size = checked_file(root, file).stat().st_size
    except FileNotFoundError:
        return (
            None,
            None,
            [Finding(MISSING, f"{where} is missing; the stage's index lists it: {REBUILD}", file)],
        )
    except OSError as e:
        return None, None, [Finding(CORRUPT, f"{where}: cannot read ({e.strerror}); {REBUILD}", file)]
    if size != nbytes:
        why = (
            f"{where} is {size} bytes but {STAGE_MANIFEST} records {nbytes}: the file is "
            f"truncated, extended or replaced; {REBUILD}"
        )
        return None, None, [Finding(CORRUPT, why, file)]
    try:
        header = read_header(root / file, display=where)
    except ReshardError as e:
        return None, None, [Finding(CORRUPT, f"{e}; {REBUILD}", file)]
    in_order = _in_header_order(header, m, file)
    if in_order is not None:
        return header, in_order, []
    recorded = {name: t for name, t in m.tensors.items() if t.file == file}
    found = {t.name: t for t in header.tensors}
    problems = []
    for name in sorted(set(found) - set(recorded)):
        why = f"{where} holds tensor {name!r}, which {STAGE_MANIFEST} does not list there; {REBUILD}"
        problems.append(Finding(EXTRA, why, file, name))
    for name in sorted(set(recorded) - set(found)):
        why = f"{where} lacks tensor {name!r}, which {STAGE_MANIFEST} lists there; {REBUILD}"
        problems.append(Finding(MISSING, why, file, name))
    for name in sorted(set(recorded) & set(found)):
        t, r = found[name], recorded[name]
        if (t.dtype, t.shape) != (r.dtype, r.shape):
            why = (
                f"{where}: tensor {name!r} is {t.dtype} {list(t.shape)} but {STAGE_MANIFEST} "
                f"records {r.dtype} {list(r.shape)}; {REBUILD}"
            )
            problems.append(Finding(DIFFERENT, why, file, name))
    return header, None, problems


def _in_header_order(header: Header, m: StageManifest, file: str) -> list[StageTensor] | None:
    """The tensors ``m`` lists in ``file``, in ``header``'s order, when the header lists exactly
    those, with their dtypes and shapes; else None.

    Why: the common case of the checks after it, answered in C passes (``map``, list equality)
    over the header's columns, rather than sets and a loop over every tensor of the file; the
    tensors found are then placed without being looked up again (:func:`_placed`). Header
    names are distinct (``parse_header`` checks): as many, all of ``file``, are the same.
    """
    c = header.columns
    found = list(map(m.tensors.get, c.names))
    exact = (
        len(found) == m.file_tensors[file]
        and None not in found
        and set(map(_FILE, found)) == {file}
        and list(map(_DTYPE, found)) == c.dtypes
        and list(map(_SHAPE, found)) == c.shapes
    )
    return found if exact else None


def _with_offsets(
    m: StageManifest, headers: dict[str, Header], in_order: dict[str, list[StageTensor] | None]
) -> StageManifest:
    """``m`` with each tensor's offset from its file's header, in load order: file, then offset
    (``in_order``: each file's tensors in its header's order, where that header lists exactly them)."""
    placed: list[StageTensor] = []
    for file in sorted(headers):
        placed += _placed(m, file, headers[file], in_order[file])
    ordered = dict(zip(map(_NAME, placed), placed, strict=True))
    if len(ordered) < len(m.tensors):  # tensors of files without a valid header: no offset
        for name, t in m.tensors.items():
            ordered.setdefault(name, t)
    return replace(m, tensors=ordered)


def _placed(
    m: StageManifest, file: str, header: Header, found: list[StageTensor] | None
) -> list[StageTensor]:
    """The manifest's tensors of ``file`` that its header lists there, in its offset order,
    their offsets set; ``found``: those tensors in the header's order, when it lists exactly them.

    Why columns: a stage has a tensor per entry (~47,000 for a 397B FP8 stage); when the
    header lists exactly the manifest's tensors of the file (the common case, checked in C),
    ``map`` and ``zip`` place them rather than a loop over the header's entries.
    """
    c = header.columns
    if found is None:
        entries = zip(header.tensors, map(m.tensors.get, c.names), strict=True)
        kept = [(t, header.data_start + e.begin) for e, t in entries if t is not None and t.file == file]
        found, offsets = [t for t, _ in kept], [o for _, o in kept]
    else:
        offsets = list(map(add, repeat(header.data_start), c.begins))
    set_once(found, "offset", offsets)
    return found


_NAME, _FILE, _NBYTES = attrgetter("name"), attrgetter("file"), attrgetter("nbytes")
_DTYPE, _SHAPE = attrgetter("dtype"), attrgetter("shape")
