"""The on-disk format, both ways: every file name and pattern the tool reads or writes, the
layouts of a stage's data files, and the stage and run manifests (built from a plan, parsed
back into plain data), with the run identity that ties a stage to its split.

Readers (``stage``, ``verify``, the loader) and the writer share this module; readers never
import the writer or the planner (a plan is only a type here).

A stage manifest lists every tensor with its file, dtype, shape, size, source file and
sha256, and every data file with its size, tensor count and layout (``clone``: the exact
bytes of source shard ``source``; ``aligned``: one run of ``source`` kept at its offsets
modulo 1 MiB; ``gathered``). A tensor's sha256 is ``null`` when the split shared its blocks
with the source instead of reading it (only in ``clone`` and ``aligned`` files); a ``clone``
then records the source file's sha256 as ``sha256`` when it is known without reading (the
blob name in a Hugging Face cache).

It is written after the stage's data is durable and just before the stage's index,
so a stage counts as complete only when both exist and the manifest names the index's digest.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import math
import os
import re
import stat
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import chain, repeat
from operator import itemgetter
from pathlib import Path
from typing import TYPE_CHECKING

from ._version import __version__
from .errors import JSON_ERRORS, ReshardError
from .model.runtimes import RUNTIMES, layer_ranges
from .source.header import DTYPE_SIZES

if TYPE_CHECKING:
    from .plan.planner import OutputFile, Plan, StagePlan
    from .source.checkpoint import Checkpoint

TOOL_NAME = "qwen35-reshard"
TOOL = {"name": TOOL_NAME, "version": __version__}

# A Hugging Face model directory, as read from the source and written for every stage.
INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
# Weight formats that can only be read by unpickling: refused, never opened.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")

# The split: OUT/reshard.json and one OUT/pp{rank} per stage, each with its manifest.
STAGE_MANIFEST = "reshard-stage.json"
RUN_MANIFEST = "reshard.json"
STAGE_FORMAT = "qwen35-reshard/stage-v1"
RUN_FORMAT = "qwen35-reshard/run-v1"
# A stage directory's name, pp{rank}; no leading zeros, so each rank has one spelling.
STAGE_DIR = re.compile(r"pp(0|[1-9][0-9]*)")
# Files of a run in progress: the marker (OUT, removed on success), the journal (a stage
# directory, removed with the stage complete) and every file before its atomic rename.
RUN_MARKER = ".reshard-run.json"  # identity of a run in progress; removed on success
JOURNAL = ".reshard-journal.jsonl"  # finished data files of an unfinished stage, with digests
PARTIAL_SUFFIX = ".partial"

# How a stage's data file is laid out:
# - CLONE: exactly the bytes of one source shard the stage needs whole, header included;
# - ALIGNED: one run of a shard needed in part, its bytes at their source offsets modulo
#   SHARE_ALIGN (the header's space padding makes up the difference), so that a filesystem
#   can share the run's blocks with the source;
# - GATHERED: short runs collected into an ordinary file.
CLONE, ALIGNED, GATHERED = "clone", "aligned", "gathered"
LAYOUTS = (CLONE, ALIGNED, GATHERED)
# A multiple of every block size a filesystem shares by (4 KiB pages, ZFS records up to 1 MiB).
SHARE_ALIGN = 1024 * 1024
# What a split did with the checkpoint's MTP head (mtp.*), as manifests record it.
MTP_KEPT, MTP_DROPPED, MTP_ABSENT = "kept", "dropped", "absent"

_SHA256 = re.compile(r"[0-9a-f]{64}")


def stage_dirname(rank: int) -> str:
    """The directory of stage ``rank`` inside OUT: ``pp{rank}``."""
    return f"pp{rank}"


def stage_dir_rank(path: Path) -> int | None:
    """N for a directory named ``ppN``; None for any other name."""
    m = STAGE_DIR.fullmatch(path.name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class RunIdentity:
    """The settings that decide every output byte of a split; a resumed run must match them.

    Recorded in the run marker, ``reshard.json`` and every stage manifest as ``identity``.
    """

    source_fingerprint: str
    pp: int
    runtime: str
    partition: tuple[int, ...]
    mtp: str
    max_file_bytes: int
    max_header_bytes: int
    tool_version: str

    @classmethod
    def of_plan(cls, plan: Plan) -> RunIdentity:
        """The identity of the split ``plan`` makes."""
        return cls(
            source_fingerprint=source_identity(plan.checkpoint)["fingerprint"],
            pp=plan.pp,
            runtime=plan.runtime,
            partition=tuple(plan.partition),
            mtp=plan.mtp,
            max_file_bytes=plan.max_file_bytes,
            max_header_bytes=plan.max_header_bytes,
            tool_version=__version__,
        )

    def to_json(self) -> dict:
        """The identity as its JSON object (``partition`` a list)."""
        return dataclasses.asdict(self) | {"partition": list(self.partition)}

    @classmethod
    def from_json(cls, obj: object) -> RunIdentity | None:
        """The identity recorded as ``obj``, or None when it is not a well-formed one."""
        if not isinstance(obj, dict) or set(obj) != {f.name for f in dataclasses.fields(cls)}:
            return None
        partition = obj["partition"]
        ints = ("pp", "max_file_bytes", "max_header_bytes")
        strs = ("source_fingerprint", "runtime", "mtp", "tool_version")
        if not (
            all(is_uint(obj[k]) for k in ints)
            and all(isinstance(obj[k], str) for k in strs)
            and isinstance(partition, list)
            and all(is_uint(n) for n in partition)
        ):
            return None
        return cls(**(obj | {"partition": tuple(partition)}))

    def differences(self, other: RunIdentity) -> list[tuple[str, object, object]]:
        """``(setting, self's value, other's value)`` for every setting where the two differ."""
        return [
            (f.name, getattr(self, f.name), getattr(other, f.name))
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]


def describe_differences(old: RunIdentity, new: RunIdentity) -> str:
    """``pp 4 -> 2, partition [4, 4] -> [3, 5]``: the settings where ``new`` differs from ``old``."""

    def show(v: object) -> object:
        return list(v) if isinstance(v, tuple) else v

    differ = old.differences(new)
    return ", ".join(f"{k} {show(a)} -> {show(b)}" for k, a, b in differ) or "no setting differs"


def source_identity(ckpt: Checkpoint) -> dict:
    """What identifies the source: its path (or Hub repo id and commit) for people, digests and
    sizes for the tool. A Hub source records no endpoint and no token."""
    fingerprint = hashlib.sha256(
        json.dumps([ckpt.config_sha256, ckpt.index_sha256, sorted(ckpt.file_sizes.items())]).encode()
    ).hexdigest()
    return {
        **(ckpt.hub or {}),
        "path": str(ckpt.root.resolve()),
        "index_sha256": ckpt.index_sha256,
        "config_sha256": ckpt.config_sha256,
        "fingerprint": fingerprint,
    }


def stage_index(stage: StagePlan) -> dict:
    """The stage's model.safetensors.index.json: exactly its tensors and its own files."""
    weight_map: dict[str, str] = {}
    for f in stage.files:
        weight_map.update(zip(f.tensor_names, repeat(f.name)))
    return {
        "metadata": {"total_size": stage.data_bytes},
        "weight_map": dict(sorted(weight_map.items())),
    }


def stage_manifest(plan: Plan, stage: StagePlan, index_bytes: bytes) -> ManifestDraft:
    """The stage manifest for ``stage`` (given its index bytes), but for the tensors' sha256:
    a run learns them while it copies, and encodes the rest before (see :class:`ManifestDraft`)."""
    head = {
        "format": STAGE_FORMAT,
        "tool": TOOL,
        "source": source_identity(plan.checkpoint),
        "identity": RunIdentity.of_plan(plan).to_json(),
        "stage": stage.rank,
        "pp": plan.pp,
        "runtime": plan.runtime,
        "partition": list(plan.partition),
        "layers": {"start": stage.start_layer, "end": stage.end_layer},
        "mtp": plan.mtp,
        "launch_env": plan.launch_env,
        "index_sha256": hashlib.sha256(index_bytes).hexdigest(),
        "files": {f.name: _file_entry(plan, f) for f in stage.files},
    }
    return ManifestDraft(head, stage.files)


def _file_entry(plan: Plan, f: OutputFile) -> dict:
    entry: dict = {"bytes": f.size, "tensors": len(f.tensors), "layout": f.layout}
    if f.source_file is not None:
        entry["source"] = f.source_file
    if f.layout == CLONE and f.source_file in plan.checkpoint.blob_sha256:
        entry["sha256"] = plan.checkpoint.blob_sha256[f.source_file]
    return entry


def dumps(obj: object) -> bytes:
    """Deterministic JSON bytes: the same object always gives the same bytes.

    Objects are indented two levels deep, then one entry per line in compact form: a
    manifest or an index has one entry per tensor (~190,000 for a 397B FP8 checkpoint), and
    json's indenting encoder is pure Python (seconds), its compact one C.
    """
    return (_dumps(obj, "", 2) + "\n").encode("utf-8")


def _compact_encoder() -> Callable[[object, int], list[str]]:
    """json's C encoder for ``json.dumps(obj, ensure_ascii=False, separators=(", ", ": "))``,
    made once: called as ``encode(obj, 0)``, it returns the chunks of the text.

    json.dumps builds a new encoder on every call, which costs more than encoding one small
    manifest entry. Where the C module is missing, json's Python encoder does the same.
    """
    enc = json.JSONEncoder(ensure_ascii=False, separators=(", ", ": "))
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return lambda obj, _level: [enc.encode(obj)]
    return make(None, enc.default, json.encoder.encode_basestring, None, ": ", ", ", False, False, True)


_encode = _compact_encoder()
_key = json.encoder.encode_basestring  # json's (C) encoder of one string, as the encoder writes keys


def _compact(obj: object) -> str:
    return "".join(_encode(obj, 0))


def _dumps(obj: object, indent: str, depth: int) -> str:
    if not (depth and isinstance(obj, dict) and obj):
        return _compact(obj)
    inner = indent + "  "
    if depth == 1 and all(map(str.__instancecheck__, obj)):
        # One entry per tensor at this depth (an index's weight_map): encoded in C passes (map)
        # rather than a Python call per entry.
        values = obj.values()
        if all(map(str.__instancecheck__, values)):
            encoded = map(_key, values)
        else:
            encoded = map("".join, map(_encode, values, repeat(0)))
        entries = ",\n".join(map(f"{inner}{{}}: {{}}".format, map(_key, obj), encoded))
    else:
        entries = ",\n".join(f"{inner}{_compact(k)}: {_dumps(v, inner, depth - 1)}" for k, v in obj.items())
    return f"{{\n{entries}\n{indent}}}"


class ManifestDraft:
    """A stage manifest encoded but for its tensors' sha256: ``encode(digests)`` gives its bytes,
    those of ``dumps`` of the manifest with a "tensors" entry per tensor, sorted by name.

    One entry per tensor (~190,000 for a 397B FP8 checkpoint): the entries are encoded column
    by column, and joined from their pieces in C (``map`` over json's string encoder, ``zip``
    and one ``str.join``), rather than as a dict each; the digests go in once they are known.
    """

    def __init__(self, head: dict, files: tuple[OutputFile, ...]) -> None:
        placed = list(chain.from_iterable(f.tensors for f in files))
        file_keys = list(chain.from_iterable(repeat(_key(f.name), len(f.tensors)) for f in files))
        names = list(chain.from_iterable(f.tensor_names for f in files))
        order = sorted(range(len(names)), key=names.__getitem__)
        sources = list(map(_SOURCE_OF, map(placed.__getitem__, order)))
        self._names = list(map(names.__getitem__, order))
        shapes, dtypes = list(map(_SHAPE_OF, sources)), list(map(_DTYPE_OF, sources))
        source_files = list(map(_FILE_OF, sources))
        # Few distinct shapes, dtypes and files: each encoded once (str of a list of ints is its JSON).
        shape_json = {shape: str(list(shape)) for shape in set(shapes)}
        key_json = {name: _key(name) for name in {*dtypes, *source_files}}
        self._before = [  # the values before the digest, in _ENTRY's order
            list(map(_key, self._names)),
            list(map(file_keys.__getitem__, order)),
            list(map(key_json.__getitem__, dtypes)),
            list(map(shape_json.__getitem__, shapes)),
            list(map(str, map(_NBYTES_OF, sources))),
        ]
        replicated = map(_REPLICATED_OF, map(placed.__getitem__, order))
        self._after = [
            list(map(key_json.__getitem__, source_files)),
            list(map(_JSON_BOOL.__getitem__, replicated)),
        ]
        self._head = _dumps(head, "", 2)[: -len("\n}")]  # "tensors" goes last

    def encode(self, digests: dict[str, str | None]) -> bytes:
        """The manifest's bytes, with ``digests[name]`` (None: shared) for every tensor."""
        found = [_NULL if d is None else _key(d) for d in map(digests.__getitem__, self._names)]
        columns = [*self._before, found, *self._after]
        # Each entry is _ENTRY[0], its first value, _ENTRY[1], ..., its last value, _ENTRY[-1].
        texts = [c for part, column in zip(_ENTRY, columns, strict=False) for c in (repeat(part), column)]
        pieces = chain.from_iterable(zip(*texts, repeat(_ENTRY[-1]), strict=False))  # repeat() never ends
        tensors = f"{{\n{''.join(pieces)[: -len(_ENTRY_END)]}\n  }}" if self._names else "{}"
        return f"{self._head},\n  {_key('tensors')}: {tensors}\n}}\n".encode()


# One "tensors" entry of a stage manifest as dumps writes it (and the separator after it):
# the text around its eight values (name, file, dtype, shape, nbytes, sha256, source_file,
# replicated).
_ENTRY_END = ",\n"
_ENTRY = (
    "    ", ': {"file": ', ', "dtype": ', ', "shape": ', ', "nbytes": ', ', "sha256": ',
    ', "source_file": ', ', "replicated": ', "}" + _ENTRY_END,
)  # fmt: skip
_NULL = "null"
_JSON_BOOL = {True: "true", False: "false"}
_SOURCE_OF = itemgetter(0)  # of a PlacedTensor; then of its SourceTensor:
_FILE_OF, _DTYPE_OF, _SHAPE_OF, _NBYTES_OF = (itemgetter(i) for i in (1, 2, 3, 5))
_REPLICATED_OF = itemgetter(2)


def read_json(path: Path) -> dict | None:
    """The JSON object at ``path``, or None when the file is missing."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    return parse_json_object(raw, str(path))


def allowed_roots(root: Path) -> tuple[Path, ...]:
    """Real directories a file of the model directory ``root`` may resolve into.

    A Hugging Face cache snapshot (``models--x/snapshots/<rev>/``) holds symlinks into the
    repo's ``blobs/``; anything else must stay inside the directory itself.
    """
    real = root.resolve()
    roots = [real]
    if real.parent.name == "snapshots":
        roots.append(real.parent.parent / "blobs")
    return tuple(roots)


def checked_file(root: Path, name: str) -> Path:
    """``root/name``, to be read: a regular file that resolves inside ``root`` (see
    :func:`allowed_roots`). Raises FileNotFoundError when it is absent, and OSError saying why
    otherwise: a symlink out of the directory is not followed, and a FIFO or a device is not
    opened (reading one may block or never end)."""
    path = root / name
    st = os.stat(path)
    real = Path(os.path.realpath(path))
    if not any(real.is_relative_to(a) for a in allowed_roots(root)):
        raise OSError(errno.EACCES, f"a symlink to {real}, outside the directory: not followed")
    if not stat.S_ISREG(st.st_mode):
        raise OSError(errno.EINVAL, "not a regular file")
    return path


def parse_json_object(raw: bytes, where: str) -> dict:
    """The JSON object in ``raw`` (the file ``where``); ReshardError if it is not one."""
    try:
        obj = json.loads(raw)
    except JSON_ERRORS as e:
        raise ReshardError(f"{where}: not valid JSON ({e}); the file is damaged") from e
    if not isinstance(obj, dict):
        raise ReshardError(f"{where}: expected a JSON object")
    return obj


def stage_is_complete(stage_dir: Path, identity: RunIdentity | None = None) -> bool:
    """True when ``stage_dir`` holds a finished stage (of the split ``identity``, when given).

    Cheap: manifest and index present, the index's digest as recorded, every data file present
    with its recorded size. ``verify`` checks the bytes.
    """
    try:
        manifest = read_json(stage_dir / STAGE_MANIFEST)
        index_bytes = (stage_dir / INDEX_NAME).read_bytes()
    except (OSError, ReshardError):  # missing, not a directory, unreadable, damaged
        return False
    if manifest is None or manifest.get("format") != STAGE_FORMAT:
        return False
    if identity is not None and RunIdentity.from_json(manifest.get("identity")) != identity:
        return False
    if manifest.get("index_sha256") != hashlib.sha256(index_bytes).hexdigest():
        return False
    for name, info in manifest.get("files", {}).items():
        try:
            if os.stat(stage_dir / name).st_size != info.get("bytes"):
                return False
        except OSError:
            return False
    return True


def run_manifest(plan: Plan, complete: list[int]) -> dict:
    """The whole-run summary written as OUT/reshard.json after a successful run."""
    return {
        "format": RUN_FORMAT,
        "tool": TOOL,
        "source": source_identity(plan.checkpoint),
        "identity": RunIdentity.of_plan(plan).to_json(),
        "pp": plan.pp,
        "runtime": plan.runtime,
        "partition": list(plan.partition),
        "mtp": plan.mtp,
        "dropped": list(plan.dropped),
        "launch_env": plan.launch_env,
        "stages": [
            {
                "stage": s.rank,
                "dir": s.dirname,
                "layers": {"start": s.start_layer, "end": s.end_layer},
                "tensors": len(s.tensors),
                "bytes": s.size,
                "shareable_bytes": s.shareable_bytes,
                "files": len(s.files),
                "source_files": s.source_files,
                "replicated": sorted(t.name for t in s.tensors if t.replicated),
                "complete": s.rank in complete,
            }
            for s in plan.stages
        ],
    }


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
    identity: RunIdentity | None  # of the split the stage belongs to; None if not recorded
    source: dict  # what identifies the source checkpoint (config_sha256, fingerprint, ...)
    index_sha256: str | None
    files: dict[str, int]  # data file -> size in bytes
    layouts: dict[str, dict]  # data file -> {"layout", "source", "sha256" (a clone's, if known)}
    tensors: dict[str, StageTensor]  # in load order (file, then offset) once read by read_stage
    raw: dict = field(repr=False)  # the manifest as read


def is_uint(v: object) -> bool:
    """A JSON integer (not a bool) that is not negative."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


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
        if not per_file[file]:  # the writer makes a file only to hold tensors
            return f"file {file!r} holds no tensors"
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
        identity=RunIdentity.from_json(identity),
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


def is_plain_name(name: str) -> bool:
    """Whether ``name`` names a file directly inside a directory (no path, no '..', no NUL,
    which os calls refuse with ValueError)."""
    return (
        bool(name) and "/" not in name and "\\" not in name and "\0" not in name and name not in (".", "..")
    )


def _plain_safetensors_name(name: object) -> bool:
    return (
        isinstance(name, str)
        and is_plain_name(name)
        and name.endswith(".safetensors")
        and not name.startswith(".")
    )


