"""Server-side shim: open one stage directory and stream exactly its tensors.

    from qwen35_reshard import loader
    stage = loader.open_stage("OUT", pp_rank=2)            # or loader.open_stage("OUT/pp2")
    stage.check(pp_size=4, start_layer=30, end_layer=45)   # the server's own view of its rank
    model.load_weights(stage.iter_weights())               # Hugging Face names, no PP skip logic

Opening a stage checks, without reading tensor data, that the directory is a finished stage
(manifest and index present, the index being the one the manifest names), that it belongs to
the split recorded beside it, and that every data file's header lists exactly the manifest's
tensors with the same dtype, shape and size. ``iter_weights`` then reads only this stage's
files, one tensor at a time in file-offset order, straight into a fresh tensor; never pickle.

torch is imported only inside ``iter_weights``: the package stays importable without it.
"""

from __future__ import annotations

import ctypes
import hashlib
import io
import json
import math
import os
import re
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ReshardError
from .header import DTYPE_SIZES, read_header
from .manifest import RUN_MANIFEST, STAGE_FORMAT, STAGE_MANIFEST
from .source import CONFIG_NAME, INDEX_NAME
from .split import PARTITION_ENV, launch_env, layer_ranges
from .write import RUN_MARKER

# safetensors dtype name -> torch dtype attribute. Resolved lazily so torch is not imported.
TORCH_DTYPES: dict[str, str] = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "U16": "uint16",
    "I32": "int32",
    "U32": "uint32",
    "I64": "int64",
    "U64": "uint64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
}

_RERUN = "run the same qwen35-reshard command again to resume"
_REBUILD = "delete it and run the same qwen35-reshard command again (or copy the stage again)"


class StageError(ReshardError):
    """A stage directory that must not be loaded, with what to do about it in one line."""


@dataclass(frozen=True)
class StageTensor:
    """One tensor of a stage: where its bytes are and what they are."""

    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    offset: int  # absolute offset of the tensor's bytes in ``file``
    sha256: str


@dataclass
class Stage:
    """A validated stage directory. Attributes are plain data; nothing is read until iterated."""

    path: Path
    display: str  # the path as the caller spelled it, for messages
    rank: int
    pp: int
    runtime: str
    partition: tuple[int, ...]
    start_layer: int
    end_layer: int  # exclusive
    mtp: str
    manifest: dict = field(repr=False)
    tensors: dict[str, StageTensor] = field(repr=False)  # in load order: file, then offset
    files: tuple[str, ...] = ()  # data files in load order
    _file_sizes: dict[str, int] = field(default_factory=dict, repr=False)

    @property
    def names(self) -> list[str]:
        """This stage's tensor names, in the order ``iter_weights`` yields them."""
        return list(self.tensors)

    @property
    def num_layers(self) -> int:
        return sum(self.partition)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def launch_env(self) -> str:
        """The variable the server must be launched with, e.g. SGLANG_PP_LAYER_PARTITION=..."""
        return launch_env(self.runtime, list(self.partition))

    def __len__(self) -> int:
        return len(self.tensors)

    def check(
        self,
        pp_size: int,
        start_layer: int,
        end_layer: int,
        *,
        pp_rank: int | None = None,
        runtime: str | None = None,
    ) -> None:
        """Raise StageError unless the server's view of its rank is the one this stage was built for.

        ``pp_size``, ``start_layer`` and ``end_layer`` (exclusive) are what the server computed
        for itself; ``pp_rank`` and ``runtime`` are checked when given.
        """
        mine = f"pp={self.pp} layers [{self.start_layer}, {self.end_layer})"
        theirs = f"pp={pp_size} layers [{start_layer}, {end_layer})"
        if pp_rank is not None and pp_rank != self.rank:
            raise StageError(
                f"{self.display} is stage {self.rank} ({mine}) but the server is rank {pp_rank} "
                f"({theirs}): give rank {pp_rank} its own directory (pp{pp_rank})"
            )
        if runtime is not None and runtime != self.runtime:
            raise StageError(
                f"{self.display} was split for {self.runtime} but the server is {runtime}; the two "
                f"place embed_tokens and the vision tower differently: re-split with "
                f"qwen35-reshard --runtime {runtime} --pp {pp_size}"
            )
        if (pp_size, start_layer, end_layer) == (self.pp, self.start_layer, self.end_layer):
            return
        if pp_size == self.pp:
            fix = f"launch the server with {self.launch_env}"
        else:
            flag = "--pp-size" if self.runtime == "sglang" else "--pipeline-parallel-size"
            fix = (
                f"launch the server with {flag} {self.pp} and {self.launch_env}, or re-split "
                f"with qwen35-reshard --pp {pp_size} --runtime {self.runtime}"
            )
        raise StageError(f"stage {self.display} was built for {mine} but the server expects {theirs}: {fix}")

    def iter_weights(self, device: str = "cpu", verify: bool = False) -> Iterator[tuple[str, object]]:
        """Yield ``(name, torch.Tensor)`` for exactly this stage's tensors, one at a time.

        Tensors come in file and offset order, each read straight from its file into a fresh
        tensor of its dtype and shape (then moved to ``device``). With ``verify=True`` each
        tensor's bytes are hashed and compared to the manifest's sha256 before it is yielded.
        """
        import torch

        if sys.byteorder != "little":
            raise StageError("safetensors data is little-endian; this loader needs a little-endian host")
        dtypes = {}
        for t in self.tensors.values():
            if t.dtype not in dtypes:
                dt = getattr(torch, TORCH_DTYPES[t.dtype], None)
                if dt is None:
                    raise StageError(
                        f"{self.display}: tensor {t.name!r} is {t.dtype}, which this torch "
                        f"({torch.__version__}) has no dtype for; upgrade torch"
                    )
                dtypes[t.dtype] = dt

        by_file: dict[str, list[StageTensor]] = {}
        for t in self.tensors.values():
            by_file.setdefault(t.file, []).append(t)
        for file in self.files:
            path = self.path / file
            where = f"{self.display}/{file}"
            with _open(path, where) as f:
                # The file must still be the one validated at open time.
                size = os.fstat(f.fileno()).st_size
                if size != self._file_sizes[file]:
                    raise StageError(
                        f"{where}: is {size} bytes, not the {self._file_sizes[file]} bytes it had "
                        f"when the stage was opened; the stage changed while loading: {_REBUILD}"
                    )
                for t in by_file[file]:
                    # Read straight into the tensor's own (uninitialised) storage.
                    raw = torch.empty(t.nbytes, dtype=torch.uint8)
                    buf = _writable_view(raw)
                    _read_exact(f, t.offset, buf, where)
                    if verify and hashlib.sha256(buf).hexdigest() != t.sha256:
                        raise StageError(
                            f"{where}: tensor {t.name!r} does not match its sha256 in "
                            f"{STAGE_MANIFEST}; the file is damaged: {_REBUILD}"
                        )
                    del buf
                    tensor = raw.view(dtypes[t.dtype]).reshape(t.shape)
                    del raw
                    if str(device) != "cpu":
                        tensor = tensor.to(device)
                    yield t.name, tensor


def _open(path: Path, where: str) -> io.RawIOBase:
    try:
        return open(path, "rb", buffering=0)
    except OSError as e:
        raise StageError(f"{where}: cannot open ({e.strerror}); {_REBUILD}") from None


def _writable_view(raw: object) -> memoryview:
    """A writable byte view of a contiguous CPU uint8 tensor's storage (no numpy needed)."""
    n = raw.numel()
    if n == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_ubyte * n).from_address(raw.data_ptr())).cast("B")


def _read_exact(f: io.RawIOBase, offset: int, buf: memoryview, where: str) -> None:
    view = memoryview(buf)
    f.seek(offset)
    got = 0
    while got < len(buf):
        n = f.readinto(view[got:])
        if not n:
            raise StageError(f"{where}: ends before the tensor at byte {offset + got}; {_REBUILD}")
        got += n


def open_stage(path: str | os.PathLike[str], pp_rank: int | None = None) -> Stage:
    """Open and validate a stage directory.

    ``path`` is either a stage directory (``OUT/pp2``) or the run directory ``OUT`` together
    with ``pp_rank``. Raises StageError, with what to do, for a missing or interrupted stage,
    files that do not match the manifest, or a stage that belongs to another split.
    """
    given = os.fspath(path)
    root = Path(given)
    if pp_rank is not None:
        if isinstance(pp_rank, bool) or not isinstance(pp_rank, int) or pp_rank < 0:
            raise StageError(f"pp_rank must be a non-negative integer, got {pp_rank!r}")
        sub = root / f"pp{pp_rank}"
        if sub.is_dir():
            root, display = sub, os.path.join(given, f"pp{pp_rank}")
        elif (root / STAGE_MANIFEST).exists():
            display = given  # a stage directory passed together with its rank
        else:
            what = "is not a directory" if not root.is_dir() else f"has no pp{pp_rank}/"
            raise StageError(
                f"{given} {what}: run qwen35-reshard --rank {pp_rank} (or without --rank) to "
                f"build stage {pp_rank} there, or pass that stage's directory"
            )
    else:
        display = given
        if not root.is_dir():
            raise StageError(f"{given}: not a directory; pass a stage directory such as OUT/pp0")
        if not (root / STAGE_MANIFEST).exists() and not (root / INDEX_NAME).exists():
            stages = sorted(
                (p.name for p in root.iterdir() if re.fullmatch(r"pp\d+", p.name) and p.is_dir()),
                key=lambda n: int(n[2:]),
            )
            if stages or (root / RUN_MANIFEST).exists():
                listed = f" (it holds {', '.join(stages)})" if stages else ""
                raise StageError(
                    f"{given} is a run directory{listed}: pass pp_rank=... or open "
                    f"{os.path.join(given, 'pp<rank>')}"
                )

    manifest = _read_manifest(root, display)
    stage = _build_stage(root, display, manifest)
    if pp_rank is not None and stage.rank != pp_rank:
        raise StageError(
            f"{display} holds stage {stage.rank}, not stage {pp_rank}: it belongs to another "
            f"split or was copied to the wrong place; {_REBUILD}"
        )
    m = re.fullmatch(r"pp(\d+)", root.name)
    if m and int(m.group(1)) != stage.rank:
        raise StageError(
            f"{display} holds stage {stage.rank} of a pp={stage.pp} split, not stage "
            f"{m.group(1)}: it was moved or belongs to another split; {_REBUILD}"
        )
    _check_run(root, display, stage)
    _check_index(root, display, manifest, stage)
    _check_config(root, display, manifest)
    _check_files(root, display, stage)
    return stage


def _read_manifest(root: Path, display: str) -> dict:
    mpath = root / STAGE_MANIFEST
    if not mpath.exists():
        in_run = bool(re.fullmatch(r"pp\d+", root.name)) and any(
            (root.parent / n).exists() for n in (RUN_MANIFEST, RUN_MARKER)
        )
        if (root / INDEX_NAME).exists() and not in_run:
            raise StageError(
                f"{display} has a {INDEX_NAME} but no {STAGE_MANIFEST}: it is not a finished "
                "qwen35-reshard stage (a plain checkpoint?); split it with qwen35-reshard, or "
                f"if a split into it was interrupted, {_RERUN}"
            )
        raise StageError(
            f"{display} is incomplete (no {STAGE_MANIFEST}): the reshard run was interrupted; {_RERUN}"
        )
    try:
        obj = json.loads(mpath.read_bytes())
    except OSError as e:
        raise StageError(f"{display}/{STAGE_MANIFEST}: cannot read ({e.strerror})") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise StageError(f"{display}/{STAGE_MANIFEST} is damaged (not valid JSON); {_REBUILD}") from None
    if not isinstance(obj, dict):
        raise StageError(f"{display}/{STAGE_MANIFEST} is damaged (not a JSON object); {_REBUILD}")
    if obj.get("format") != STAGE_FORMAT:
        raise StageError(
            f"{display}/{STAGE_MANIFEST} has format {obj.get('format')!r}, not {STAGE_FORMAT!r}: "
            "it was written by another version of qwen35-reshard; use that version's loader or "
            "re-split with this one"
        )
    return obj


def _bad(display: str, what: str) -> StageError:
    return StageError(f"{display}/{STAGE_MANIFEST} is damaged ({what}); {_REBUILD}")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _build_stage(root: Path, display: str, m: dict) -> Stage:
    rank, pp, runtime, partition = m.get("stage"), m.get("pp"), m.get("runtime"), m.get("partition")
    if not (_is_int(pp) and pp >= 1 and _is_int(rank) and 0 <= rank < pp):
        raise _bad(display, f"stage {rank!r} of pp {pp!r}")
    if runtime not in PARTITION_ENV:
        raise _bad(display, f"unknown runtime {runtime!r}")
    if not (
        isinstance(partition, list) and len(partition) == pp and all(_is_int(n) and n >= 1 for n in partition)
    ):
        raise _bad(display, f"partition {partition!r} is not {pp} positive layer counts")
    layers = m.get("layers")
    start, end = layer_ranges(partition)[rank]
    if not isinstance(layers, dict) or (layers.get("start"), layers.get("end")) != (start, end):
        raise _bad(display, f"layers {layers!r} do not match partition {partition} at stage {rank}")

    files, tensors = m.get("files"), m.get("tensors")
    if not isinstance(files, dict) or not isinstance(tensors, dict) or not tensors:
        raise _bad(display, "no files or tensors")
    entries: list[tuple[str, StageTensor]] = []
    for name, info in tensors.items():
        if not isinstance(info, dict):
            raise _bad(display, f"entry of tensor {name!r}")
        file, dtype, shape = info.get("file"), info.get("dtype"), info.get("shape")
        nbytes, digest = info.get("nbytes"), info.get("sha256")
        if file not in files or not _plain_name(file):
            raise _bad(display, f"tensor {name!r} is in unlisted file {file!r}")
        if dtype not in TORCH_DTYPES or dtype not in DTYPE_SIZES:
            raise StageError(f"{display}: tensor {name!r} has dtype {dtype!r}, which this loader cannot load")
        if not (isinstance(shape, list) and all(_is_int(d) and d >= 0 for d in shape)):
            raise _bad(display, f"shape of tensor {name!r}")
        if nbytes != math.prod(shape) * DTYPE_SIZES[dtype]:
            raise _bad(display, f"tensor {name!r} is {nbytes!r} bytes, not {dtype} x {shape}")
        if not (isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest)):
            raise _bad(display, f"sha256 of tensor {name!r}")
        # The offset is filled in from the file's header by _check_files.
        entries.append((name, StageTensor(name, file, dtype, tuple(shape), nbytes, -1, digest)))
    per_file = Counter(t.file for _, t in entries)
    for file, info in files.items():
        count = per_file[file]
        if not isinstance(info, dict) or info.get("tensors") != count or not _is_int(info.get("bytes")):
            raise _bad(display, f"file {file!r} should hold {count} tensors")
    return Stage(
        path=root,
        display=display,
        rank=rank,
        pp=pp,
        runtime=runtime,
        partition=tuple(partition),
        start_layer=start,
        end_layer=end,
        mtp=m.get("mtp"),
        manifest=m,
        tensors=dict(entries),
        files=tuple(sorted(files)),
        _file_sizes={f: info["bytes"] for f, info in files.items()},
    )


def _plain_name(name: object) -> bool:
    return (
        isinstance(name, str)
        and bool(name)
        and "/" not in name
        and "\\" not in name
        and name not in (".", "..")
    )


def _check_run(root: Path, display: str, stage: Stage) -> None:
    """Refuse a stage left over from another split of the same output directory.

    The run directory records the split it holds: ``reshard.json`` after a finished run, the
    run marker while a run is in progress or after one was interrupted.
    """
    if not re.fullmatch(r"pp\d+", root.name):
        return
    for name in (RUN_MARKER, RUN_MANIFEST):
        rpath = root.parent / name
        try:
            run = json.loads(rpath.read_bytes())
        except FileNotFoundError:
            continue
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            raise StageError(f"{rpath} is damaged (not valid JSON); {_RERUN}") from None
        theirs = run.get("identity") if isinstance(run, dict) else None
        if not isinstance(theirs, dict):
            raise StageError(f"{rpath} is damaged (no identity); {_RERUN}")
        mine = stage.manifest.get("identity")
        if mine != theirs:
            run_view = f"pp={theirs.get('pp')} {theirs.get('runtime')} partition {theirs.get('partition')}"
            raise StageError(
                f"{display} belongs to another split (pp={stage.pp} {stage.runtime} partition "
                f"{list(stage.partition)}) than the one {rpath.name} beside it records "
                f"({run_view}, or another source): delete {display} and run the qwen35-reshard "
                "command for the split you want again"
            )
        return  # a stage copied on its own has only its manifest as the record


def _check_index(root: Path, display: str, m: dict, stage: Stage) -> None:
    ipath = root / INDEX_NAME
    try:
        raw = ipath.read_bytes()
    except FileNotFoundError:
        raise StageError(
            f"{display} is incomplete (no {INDEX_NAME}): the reshard run was interrupted; {_RERUN}"
        ) from None
    except OSError as e:
        raise StageError(f"{display}/{INDEX_NAME}: cannot read ({e.strerror})") from None
    if hashlib.sha256(raw).hexdigest() != m.get("index_sha256"):
        raise StageError(
            f"{display} is incomplete: its {INDEX_NAME} is not the one {STAGE_MANIFEST} records "
            f"(an interrupted run, or the index was edited); {_RERUN}"
        )
    try:
        index = json.loads(raw)
        weight_map = index["weight_map"]
        total = index["metadata"]["total_size"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
        raise StageError(f"{display}/{INDEX_NAME} is damaged; {_REBUILD}") from None
    listed = {n: t.file for n, t in stage.tensors.items()}
    if weight_map != listed:
        extra = sorted(set(weight_map) - set(listed))
        missing = sorted(set(listed) - set(weight_map))
        moved = sorted(n for n in set(listed) & set(weight_map) if listed[n] != weight_map[n])
        detail = (
            f"lists {extra[0]!r}, which the manifest does not"
            if extra
            else f"lacks {missing[0]!r}"
            if missing
            else f"puts {moved[0]!r} in another file"
        )
        raise StageError(f"{display}/{INDEX_NAME} {detail}; {_REBUILD}")
    if total != stage.nbytes:
        raise StageError(
            f"{display}/{INDEX_NAME}: total_size {total!r} is not the stage's {stage.nbytes} "
            f"tensor bytes; {_REBUILD}"
        )


def _check_config(root: Path, display: str, m: dict) -> None:
    want = (m.get("source") or {}).get("config_sha256")
    try:
        raw = (root / CONFIG_NAME).read_bytes()
    except FileNotFoundError:
        raise StageError(
            f"{display} has no {CONFIG_NAME}; servers need the source's full config on every "
            f"stage: {_REBUILD}"
        ) from None
    if want is not None and hashlib.sha256(raw).hexdigest() != want:
        raise StageError(
            f"{display}/{CONFIG_NAME} differs from the source's config.json it was split from; "
            f"servers derive the split from it, so it must be unchanged: {_REBUILD}"
        )


def _check_files(root: Path, display: str, stage: Stage) -> None:
    """Every data file exists, has the manifest's size, and its header lists exactly its tensors."""
    by_file: dict[str, list[str]] = {f: [] for f in stage.files}
    for t in stage.tensors.values():
        by_file[t.file].append(t.name)
    ordered: dict[str, StageTensor] = {}
    for file in stage.files:
        path = root / file
        where = f"{display}/{file}"
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            raise StageError(f"{where} is missing; {_REBUILD}") from None
        if size != stage._file_sizes[file]:
            raise StageError(
                f"{where} is {size} bytes but {STAGE_MANIFEST} records "
                f"{stage._file_sizes[file]}; the file is truncated or replaced: {_REBUILD}"
            )
        try:
            header = read_header(path, display=where)
        except StageError:
            raise
        except ReshardError as e:
            raise StageError(f"{e}; {_REBUILD}") from None
        found = {t.name: t for t in header.tensors}
        want = set(by_file[file])
        if set(found) != want:
            extra = sorted(set(found) - want)
            missing = sorted(want - set(found))
            detail = (
                f"holds {extra[0]!r}, which {STAGE_MANIFEST} does not list there"
                if extra
                else f"lacks {missing[0]!r}, which {STAGE_MANIFEST} lists there"
            )
            raise StageError(f"{where} {detail}; {_REBUILD}")
        for entry in header.tensors:  # file-offset order
            t = stage.tensors[entry.name]
            if (entry.dtype, entry.shape, entry.nbytes) != (t.dtype, t.shape, t.nbytes):
                raise StageError(
                    f"{where}: tensor {entry.name!r} is {entry.dtype} {list(entry.shape)} "
                    f"({entry.nbytes} bytes) but {STAGE_MANIFEST} records {t.dtype} "
                    f"{list(t.shape)} ({t.nbytes} bytes); {_REBUILD}"
                )
            ordered[t.name] = StageTensor(
                t.name, file, t.dtype, t.shape, t.nbytes, header.data_start + entry.begin, t.sha256
            )
    stage.tensors = ordered
