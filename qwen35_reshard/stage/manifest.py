"""A stage manifest read back: its structure checked, as plain data (see ``format.manifest``
for what it records)."""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections import Counter, deque
from dataclasses import dataclass
from itertools import compress, repeat
from operator import attrgetter, mul, not_
from pathlib import Path
from typing import Annotated, Literal

import msgspec
from msgspec.structs import force_setattr

from ..errors import JSON_ERRORS, ReshardError
from ..format.digest import HEX_LENGTH, SHA256, XXH128, is_hex_digest
from ..format.dtypes import DTYPE_SIZES
from ..format.identity import RunIdentity
from ..format.jsonio import is_sha256, is_uint, read_json
from ..format.manifest import NODE_FIELDS, STAGE_FIELDS, TENSOR_DIGESTS
from ..format.names import (
    ALIGNED,
    CLONE,
    GATHERED,
    INDEX_NAME,
    JOURNAL,
    LAYOUTS,
    MTP_ABSENT,
    MTP_DROPPED,
    MTP_KEPT,
    RUN_MANIFEST,
    RUN_MARKER,
    SIDE_FILE_CHUNK,
    STAGE_MANIFEST,
)
from ..format.paths import checked_file, is_plain_name, is_plain_safetensors_name
from ..model.parallelism import Parallelism
from ..model.runtimes import RUNTIMES, layer_ranges


@dataclass(frozen=True)
class FileLayout:
    """How a stage's data file was made, as its manifest records it."""

    layout: str  # CLONE, ALIGNED or GATHERED (format.names)
    source: str | None  # the source shard a CLONE or ALIGNED file was made from
    sha256: str | None  # the whole file's digest, where known (a clone of a Hub cache blob)


class StageTensor(msgspec.Struct, frozen=True, gc=False, kw_only=True):
    """One tensor of a stage: where its bytes are and what they are.

    Also the type a manifest's tensor entry is decoded into (:func:`decode_stage_manifest`),
    with the types it must have: a msgspec struct rather than a dataclass because one is made
    per tensor (~47,000 a stage of a 397B FP8 checkpoint) each time a stage is opened, and
    decoding makes them in C. gc=False: it holds only strings and ints, no cycle to collect.
    ``name`` and ``offset`` are not in the entry: set once known (:func:`set_once`). One of
    ``xxh128`` (``stage-v2``) and ``sha256`` (``stage-v1``) is recorded, as the manifest's
    format says (``StageManifest.digest``); :attr:`digest` is it.
    """

    name: str = ""
    file: str
    dtype: Literal[tuple(DTYPE_SIZES)]  # type: ignore[valid-type]
    shape: tuple[Annotated[int, msgspec.Meta(ge=0)], ...]
    nbytes: Annotated[int, msgspec.Meta(ge=0)]
    offset: int = -1  # absolute offset of the tensor's bytes in ``file``; -1 until its header is read
    sha256: str | None = None  # None: the split shared the bytes with the source and never read them
    xxh128: str | None = None  # the same, in a stage-v2 manifest

    @property
    def digest(self) -> str | None:
        """The recorded digest of the tensor's bytes (of the manifest's ``digest`` algorithm);
        None where the split shared them with the source and never read them."""
        return self.xxh128 if self.xxh128 is not None else self.sha256


def set_once(tensors: list[StageTensor], field: str, values: list[object]) -> None:
    """Set ``field`` of each of ``tensors`` (frozen) to its value, where it is still unknown:
    ``name`` after decoding, ``offset`` once the file's header is read.

    Why not ``msgspec.structs.replace``: that makes a new struct per tensor; this is one C call
    per tensor, mapped, with nothing made.

    Args:
        tensors: the stage tensors to complete.
        field: ``"name"`` or ``"offset"``.
        values: each tensor's value, in the order of ``tensors``.
    """
    deque(map(force_setattr, tensors, repeat(field), values), maxlen=0)


@dataclass(frozen=True)
class NodeRecord:
    """A node directory's "node" entry (expert parallelism, ``format.manifest.NODE_FIELDS``)."""

    node: int
    nodes: int
    ep: int
    ep_ranks: tuple[int, ...]
    redundant_experts: int
    expert_location: tuple[tuple[int, ...], ...] | None
    experts: dict[str, tuple[int, ...]]  # MoE layer ("layers.N", "mtp.layers.K") -> logical experts


def parse_node_entry(entry: object) -> NodeRecord | str:
    """The "node" entry as plain data, or what is structurally wrong with it."""
    if not isinstance(entry, dict) or set(entry) != set(NODE_FIELDS):
        return "node entry"
    ints = [entry[k] for k in ("node", "nodes", "ep", "redundant_experts")]
    if not all(map(is_uint, ints)) or not entry["node"] < entry["nodes"] or entry["ep"] < 2:
        return f"node {entry['node']!r} of {entry['nodes']!r} nodes, ep {entry['ep']!r}"
    ranks, experts, location = entry["ep_ranks"], entry["experts"], entry["expert_location"]
    if not (isinstance(ranks, list) and ranks and all(is_uint(r) and r < entry["ep"] for r in ranks)):
        return f"ep_ranks {ranks!r}"
    if not (
        isinstance(experts, dict)
        and all(isinstance(ids, list) and all(map(is_uint, ids)) for ids in experts.values())
    ):
        return "experts is not a map of MoE layers to expert ids"
    if location is not None and not (
        isinstance(location, list) and all(isinstance(r, list) and all(map(is_uint, r)) for r in location)
    ):
        return "expert_location is not rows of expert ids"
    return NodeRecord(
        entry["node"], entry["nodes"], entry["ep"], tuple(ranks), entry["redundant_experts"],
        None if location is None else tuple(map(tuple, location)),
        {label: tuple(ids) for label, ids in experts.items()},
    )  # fmt: skip


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
    identity: RunIdentity | None  # of the split the stage belongs to; None if not recorded
    source: dict  # what identifies the source checkpoint (config_sha256, fingerprint, ...)
    index_sha256: str | None
    side_files: dict[str, str]  # non-weight file (config.json, tokenizer, ...) -> sha256
    files: dict[str, int]  # data file -> size in bytes
    file_tensors: dict[str, int]  # data file -> how many of ``tensors`` it holds
    layouts: dict[str, FileLayout]  # by data file
    tensors: dict[str, StageTensor]  # in load order (file, then offset) once read by read_stage
    digest: str = XXH128  # what each tensor's ``digest`` is (format.digest): sha256 in stage-v1
    node: NodeRecord | None = None  # a node directory of an expert-parallel split

    @property
    def index(self) -> int:
        """The directory's index in its split's plan: the stage, or (a node) ``stage * nodes + node``."""
        return self.rank if self.node is None else self.rank * self.node.nodes + self.node.node

    @property
    def layout(self) -> Parallelism:
        """The layout the stage was split for."""
        n = self.node
        if n is None:
            return Parallelism(pp=self.pp, runtime=self.runtime, partition=self.partition)
        return Parallelism(
            self.pp, self.runtime, self.partition, n.ep, n.nodes, n.redundant_experts, n.expert_location
        )


def parse_stage_manifest(m: dict) -> StageManifest | str:
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
    if m.get("mtp") not in (None, MTP_KEPT, MTP_DROPPED, MTP_ABSENT):
        return f"mtp {m.get('mtp')!r} is not {MTP_KEPT!r}, {MTP_DROPPED!r} or {MTP_ABSENT!r}"
    files, tensors = m.get("files"), m.get("tensors")
    if not isinstance(files, dict) or not isinstance(tensors, dict) or not tensors:
        return "no files or tensors"
    for file, info in files.items():
        if not is_plain_safetensors_name(file):
            return f"file name {file!r} is not a plain *.safetensors name"
        if not (isinstance(info, dict) and is_uint(info.get("bytes")) and is_uint(info.get("tensors"))):
            return f"entry of file {file!r}"
        layout, source, digest = info.get("layout", GATHERED), info.get("source"), info.get("sha256")
        if layout not in LAYOUTS or (source is None) != (layout == GATHERED):
            return f"layout of file {file!r}"
        if source is not None and not is_plain_safetensors_name(source):
            return f"source of file {file!r}"
        if digest is not None and (layout != CLONE or not is_sha256(digest)):
            return f"sha256 of file {file!r}"
    digest = TENSOR_DIGESTS.get(m.get("format"), SHA256)
    typed = StageTensor in map(type, tensors.values())  # decoded by decode_stage_manifest
    entries = (_record_entries if typed else _dict_entries)(tensors, files, digest)
    if isinstance(entries, str):
        return entries
    per_file = Counter(map(_FILE_OF_TENSOR, entries.values()))
    for file, info in files.items():
        if not per_file[file]:  # the writer makes a file only to hold tensors
            return f"file {file!r} holds no tensors"
        if info["tensors"] != per_file[file]:
            return f"file {file!r} should hold {per_file[file]} tensors, not {info['tensors']}"
    side_files = parse_side_files(m.get("side_files", {}))
    if side_files is None:
        return "side_files is not a map of plain file names to sha256 digests"
    node = None if "node" not in m else parse_node_entry(m["node"])
    if isinstance(node, str):
        return node
    identity, source = m.get("identity"), m.get("source")
    return StageManifest(
        rank=rank,
        pp=pp,
        runtime=runtime,
        partition=tuple(partition),
        start_layer=start,
        end_layer=end,
        mtp=m.get("mtp"),
        identity=RunIdentity.from_json(identity),
        source=source if isinstance(source, dict) else {},
        index_sha256=m.get("index_sha256"),
        side_files=side_files,
        files={f: info["bytes"] for f, info in files.items()},
        file_tensors={f: per_file[f] for f in files},
        layouts={
            f: FileLayout(info.get("layout", GATHERED), info.get("source"), info.get("sha256"))
            for f, info in files.items()
        },
        tensors=entries,
        digest=digest,
        node=node,
    )


def decode_stage_manifest(raw: bytes) -> dict | None:
    """``json.loads(raw)`` of a stage manifest, its "tensors" entries decoded straight into
    typed records (:class:`StageTensor`) that :func:`parse_stage_manifest` checks column by
    column; None when ``raw`` is not a JSON object of the fields a manifest has whose tensor
    entries all have those types (then ``json.loads`` and the checks one tensor at a time say
    what is wrong).

    Why: a stage's manifest has an entry per tensor (~47,000 a stage of a 397B FP8 checkpoint)
    and json builds a dict per entry, then the checks run once per tensor in Python; msgspec
    decodes into typed records and checks those types in C, several times faster, in one pass
    over the bytes. The other fields are few and small: parsed by json, as the exact path
    does, so they mean the same.

    Args:
        raw: the bytes of a ``reshard-stage.json``.

    Returns:
        The manifest as a dict for :func:`parse_stage_manifest`, or None.
    """
    try:
        parts = _MANIFEST_PARTS.decode(raw)
        obj = {
            key: json.loads(bytes(value))
            for key in STAGE_FIELDS[:-1]
            if (value := getattr(parts, key)) is not msgspec.UNSET
        }
    except JSON_ERRORS:  # not an object, another field, or an entry of another type
        return None
    return obj | {"tensors": parts.tensors}


# A manifest's fields as written (STAGE_FIELDS), the tensor entries typed, the others raw JSON.
_MANIFEST_PARTS = msgspec.json.Decoder(
    msgspec.defstruct(
        "_ManifestParts",
        [
            *((key, msgspec.Raw | msgspec.UnsetType, msgspec.UNSET) for key in STAGE_FIELDS[:-1]),
            ("tensors", dict[str, StageTensor]),
        ],
        kw_only=True,
        forbid_unknown_fields=True,
    )
)
_RECORD_COLUMNS = tuple(map(attrgetter, ("file", "dtype", "shape", "nbytes", "name", "offset")))
_FILE_OF_TENSOR = _RECORD_COLUMNS[0]
_DIGEST_COLUMNS = {SHA256: attrgetter(SHA256), XXH128: attrgetter(XXH128)}


def _lower_hex(text: str) -> bool:
    """Whether ``text`` is only the characters 0-9 and a-f, an even number of them.

    Why not the regex ``([0-9a-f]{2})*``: it steps through the ~3 MB of a stage's digests joined
    one character at a time; ``bytes.fromhex`` and ``bytes.hex`` go through them in C, and
    only such a text comes back unchanged (``fromhex`` also takes A-F and skips whitespace;
    ``hex`` writes neither). ``str.islower`` would look up every character's Unicode case.
    """
    try:
        return bytes.fromhex(text).hex() == text
    except ValueError:
        return False


def _record_entries(tensors: dict[str, object], files: dict, digest: str) -> dict[str, StageTensor] | str:
    """The checks of :func:`_parse_tensor` on decoded entries, made column by column in C
    (``map``, ``set``, list equality, ``bytes.fromhex`` over all digests) instead of once per
    tensor in Python; a generic message when one fails (the caller then parses again exactly).
    ``digest``: the algorithm the manifest's format records (the other one's key is absent)."""
    records = list(tensors.values())
    if set(map(type, records)) != {StageTensor}:
        return "tensor entries"
    file_col, dtypes, shapes, nbytes, names, offsets = (map(get, records) for get in _RECORD_COLUMNS)
    file_col, dtypes, shapes, nbytes = map(list, (file_col, dtypes, shapes, nbytes))
    other = XXH128 if digest == SHA256 else SHA256
    digests = list(map(_DIGEST_COLUMNS[digest], records))
    if set(map(_DIGEST_COLUMNS[other], records)) != {None}:
        return "tensor digests"
    if set(names) != {""} or set(offsets) != {-1}:  # keys the writer never writes; _parse_tensor ignores them
        return "tensor entries"
    if not set(file_col) <= files.keys():
        return "tensor files"
    if list(map(mul, map(math.prod, shapes), map(DTYPE_SIZES.__getitem__, dtypes))) != nbytes:
        return "tensor sizes"
    given = [d for d in digests if d is not None]
    if given and not (set(map(len, given)) == {HEX_LENGTH[digest]} and _lower_hex("".join(given))):
        return "tensor digests"
    if len(given) != len(digests):  # shared tensors: only in clone and aligned files
        shared = {f for f, info in files.items() if info.get("layout") in (CLONE, ALIGNED)}
        if not set(compress(file_col, map(not_, digests))) <= shared:
            return "tensor digests"
    set_once(records, "name", list(tensors))
    return tensors


def _dict_entries(tensors: dict[str, object], files: dict, digest: str) -> dict[str, StageTensor] | str:
    """The tensor entries as parsed by json, checked one by one; the first problem's message."""
    entries: dict[str, StageTensor] = {}
    for name, info in tensors.items():
        t = _parse_tensor(name, info, files, digest)
        if isinstance(t, str):
            return t
        entries[name] = t
    return entries
def parse_side_files(obj: object) -> dict[str, str] | None:
    """A manifest's ``side_files`` (name -> sha256 of each non-weight file), or None when it is
    not one: every name a plain file name that is no data file or record of the tool's."""
    if not isinstance(obj, dict):
        return None
    for name, digest in obj.items():
        if not (
            is_plain_name(name)
            and not name.endswith(".safetensors")
            and name not in (INDEX_NAME, STAGE_MANIFEST, RUN_MANIFEST, RUN_MARKER, JOURNAL)
            and is_sha256(digest)
        ):
            return None
    return dict(obj)


def damaged_side_files(directory: Path, side_files: dict[str, str]) -> list[tuple[str, str]]:
    """``(name, why)`` for each recorded non-weight file of ``directory`` (a stage or OUT) that is
    missing ("missing"), cannot be read ("cannot be read (...)") or is not the recorded bytes
    ("changed")."""
    damaged = []
    for name, recorded in sorted(side_files.items()):
        try:
            digest = file_sha256(checked_file(directory, name))
        except FileNotFoundError:
            damaged.append((name, "missing"))
            continue
        except OSError as e:
            damaged.append((name, f"cannot be read ({e.strerror or e})"))
            continue
        if digest != recorded:
            damaged.append((name, "changed"))
    return damaged


def file_sha256(path: Path) -> str:
    """The sha256 of the file at ``path``, read in chunks of SIDE_FILE_CHUNK."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(SIDE_FILE_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _parse_tensor(name: str, info: object, files: dict, algorithm: str) -> StageTensor | str:
    if not isinstance(info, dict) or not isinstance(info.get("file"), str) or info["file"] not in files:
        return f"tensor {name!r} is not in a listed file"
    dtype, shape, nbytes, digest = (
        info.get("dtype"),
        info.get("shape"),
        info.get("nbytes"),
        info.get(algorithm),
    )
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        return f"tensor {name!r} has unknown dtype {dtype!r}"
    if not (isinstance(shape, list) and all(is_uint(d) for d in shape)):
        return f"shape of tensor {name!r}"
    if not is_uint(nbytes) or nbytes != math.prod(shape) * DTYPE_SIZES[dtype]:
        return f"tensor {name!r} is {nbytes!r} bytes, not {dtype} x {shape}"
    shared = digest is None and files[info["file"]].get("layout") in (CLONE, ALIGNED)
    if not (shared or is_hex_digest(algorithm, digest)):
        return f"{algorithm} of tensor {name!r}"
    file = info["file"]
    recorded = {algorithm: digest}
    return StageTensor(name=name, file=file, dtype=dtype, shape=tuple(shape), nbytes=nbytes, **recorded)


def stage_is_complete(stage_dir: Path, identity: RunIdentity | None = None) -> bool:
    """True when ``stage_dir`` holds a finished stage (of the split ``identity``, when given).

    Cheap: manifest and index present, the index's digest as recorded, the non-weight files
    (config, tokenizer: small) with their recorded digests, every data file present with its
    recorded size. ``verify`` checks the data files' bytes.
    """
    try:
        manifest = read_json(stage_dir / STAGE_MANIFEST)
        index_bytes = (stage_dir / INDEX_NAME).read_bytes()
    except (OSError, ReshardError):  # missing, not a directory, unreadable, damaged
        return False
    if manifest is None or manifest.get("format") not in TENSOR_DIGESTS:
        return False
    if identity is not None and RunIdentity.from_json(manifest.get("identity")) != identity:
        return False
    if manifest.get("index_sha256") != hashlib.sha256(index_bytes).hexdigest():
        return False
    side_files = parse_side_files(manifest.get("side_files", {}))
    if side_files is None or damaged_side_files(stage_dir, side_files):
        return False
    for name, info in manifest.get("files", {}).items():
        try:
            if os.stat(stage_dir / name).st_size != info.get("bytes"):
                return False
        except OSError:
            return False
    return True
