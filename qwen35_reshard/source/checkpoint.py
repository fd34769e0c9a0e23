"""Read a source checkpoint (config, index, every shard's header) into plain data.

Only headers are read here, never tensor data. The index is treated as the exact list of
tensors: a tensor in a shard that the index does not list, or an index entry missing from
its shard, is an error rather than something to guess about. No path may lead out of the
model directory (or, for a Hugging Face cache snapshot, out of the repo's ``blobs/``).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from itertools import repeat
from operator import add, sub
from pathlib import Path
from typing import NamedTuple, NoReturn

from ..bulk import make_tuples
from ..errors import BadInput, param
from ..format.jsonio import is_sha256, load_index, parse_json_object
from ..format.names import (
    CACHE_REPO_PREFIX,
    COMMIT,
    CONFIG_NAME,
    INDEX_NAME,
    LOCAL_SOURCE,
    PICKLE_SUFFIXES,
    SINGLE_FILE_NAME,
)
from ..format.paths import allowed_roots, is_plain_name
from ..model import schema
from ..model.quant import QUANT_SIDE_FILE
from .header import Header, read_header


class SourceTensor(NamedTuple):
    """One tensor of the source: where its bytes are (absolute file offset) and what they are.

    A named tuple, not a dataclass: one is made per tensor (~190,000 for a 397B FP8
    checkpoint), column by column (see ``bulk.make_tuples``).
    """

    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Checkpoint:
    """Everything the plan needs to know about a source checkpoint, headers only."""

    root: Path
    config: dict
    config_sha256: str
    index_sha256: str | None  # None for a single model.safetensors without an index
    num_layers: int
    tied_embeddings: bool
    files: tuple[str, ...]  # data files, sorted
    file_sizes: dict[str, int]
    tensors: dict[str, SourceTensor]  # ordered by (file, offset)
    extra_files: tuple[str, ...]  # non-weight files for every stage, config.json included; sorted
    unlisted: tuple[str, ...] = ()  # *.safetensors the index does not list: ignored, as servers do
    hub: dict | None = None  # repo_id, revision, commit of a Hub source; None for a local one
    # sha256 of the shards known without reading them: in a Hugging Face cache snapshot each
    # file is a symlink to blobs/<its sha256>.
    blob_sha256: dict[str, str] = field(default_factory=dict)
    headers_sha256: str = ""  # of every shard's header, in file order: their tensors' layout
    # Each shard as its header was read (``file_stamp``): a run checks it still reads those files.
    stamps: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # hf_quant_config.json, parsed: a ModelOpt export's quantization when config.json has none.
    quant_side: dict | None = None

    def path(self, name: str) -> Path:
        return self.root / name

    @property
    def display(self) -> str:
        """The source for people: its directory, or ``org/name@commit`` for a Hub repo."""
        return f"{self.hub['repo_id']}@{self.hub['commit'][:12]}" if self.hub else str(self.root)


def source_name(ckpt: Checkpoint) -> str:
    """Where a split's bytes come from, as its run identity records it: ``repo_id@commit`` for a
    Hub source or a Hugging Face cache snapshot of one (the commit names every byte), LOCAL_SOURCE
    for another local directory (known by its fingerprint alone: see :func:`source_identity`)."""
    if ckpt.hub:
        return f"{ckpt.hub['repo_id']}@{ckpt.hub['commit']}"
    snapshot = ckpt.root.resolve()  # models--org--name/snapshots/<commit>
    repo, commit = snapshot.parent.parent.name, snapshot.name
    in_cache = snapshot.parent.name == "snapshots" and repo.startswith(CACHE_REPO_PREFIX)
    if in_cache and COMMIT.fullmatch(commit):
        return f"{repo.removeprefix(CACHE_REPO_PREFIX).replace('--', '/', 1)}@{commit}"
    return LOCAL_SOURCE


def source_fingerprint(ckpt: Checkpoint) -> str:
    """The source's fingerprint (a sha256 in hex), what a split records to tell its source.

    It covers config.json, the index, every shard's size and header (each tensor's name,
    dtype, shape and offsets), not the tensors' bytes: a local shard rewritten in place with
    other values of the same layout keeps it (a Hub source's commit names its bytes; a run
    checks each shard's inode, size and times, see ``write.sources``).
    """
    return hashlib.sha256(
        json.dumps(
            [ckpt.config_sha256, ckpt.index_sha256, sorted(ckpt.file_sizes.items()), ckpt.headers_sha256]
        ).encode()
    ).hexdigest()


def source_identity(ckpt: Checkpoint) -> dict:
    """What identifies the source, as a manifest records it (JSON): its path (or Hub repo id
    and commit) for people, digests, sizes and :func:`source_fingerprint` for the tool. A Hub
    source records no endpoint and no token.
    """
    fingerprint = source_fingerprint(ckpt)
    return {
        **(ckpt.hub or {}),
        "path": str(ckpt.root.resolve()),
        "index_sha256": ckpt.index_sha256,
        "config_sha256": ckpt.config_sha256,
        "headers_sha256": ckpt.headers_sha256,
        "fingerprint": fingerprint,
    }


def read_checkpoint(model_dir: str | os.PathLike[str]) -> Checkpoint:
    """Read config, index and shard headers of the checkpoint in ``model_dir``; no tensor data.

    Args:
        model_dir: the checkpoint's directory (``config.json``, the safetensors index and
            shards, or one ``model.safetensors``); a Hugging Face cache snapshot too.

    Returns:
        The :class:`Checkpoint`: its config, every tensor's file, dtype, shape and byte range,
        and the side files (tokenizer, ...) every stage gets.

    Raises:
        ReshardError: ``model_dir`` is no directory, or a file in it is missing, malformed,
            unsafe (a path out of the directory, a pickle) or disagrees with the others.

    Example:
        >>> from qwen35_reshard import read_checkpoint
        >>> ckpt = read_checkpoint(MODEL)
        >>> ckpt.num_layers, len(ckpt.files), len(ckpt.tensors)
        (8, 4, 203)
    """
    root = Path(model_dir)
    if not root.is_dir():
        raise BadInput(
            f"{root}: not a directory; pass the checkpoint's directory as {param('model_dir')}"
        )
    if not _utf8(str(root.resolve())):
        raise BadInput(
            f"{root}: the directory's path is not UTF-8, which the stages' manifests record as the "
            f"source; rename it, then pass it as {param('model_dir')}"
        )
    allowed = allowed_roots(root)
    config_bytes = _read_file(root, CONFIG_NAME, allowed)
    config = load_config(config_bytes, str(root / CONFIG_NAME))
    indexed = (root / INDEX_NAME).exists()
    if not indexed and not (root / SINGLE_FILE_NAME).exists():
        pickles = sorted(p.name for p in root.iterdir() if p.name.endswith(PICKLE_SUFFIXES))
        hint = (
            f"; found only pickled weights ({', '.join(pickles[:3])}), which this tool never "
            "loads: convert them to safetensors first"
            if pickles
            else ""
        )
        raise BadInput(f"{root}: no {INDEX_NAME} and no {SINGLE_FILE_NAME}{hint}")

    def read_headers(files: list[str]) -> Iterator[Header]:
        # Every name is checked before any header is read: a name leaving the model directory
        # is reported as such, whatever other damage a shard sorted before it has.
        paths = [_checked_path(root, file, allowed, what="shard") for file in files]
        return (read_header(path, display=str(path)) for path in paths)

    def other_files(files: list[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
        unlisted = [p.name for p in root.iterdir() if p.name.endswith(".safetensors") and p.name not in files]
        return _extra_files(root, allowed, skip={INDEX_NAME, *files}), tuple(sorted(unlisted))

    ckpt = assemble_checkpoint(
        root=root,
        display=str(root),
        config=config,
        config_bytes=config_bytes,
        # Not kept here: assemble_checkpoint drops it once parsed (~30 MB at the largest shapes).
        index_bytes=_read_file(root, INDEX_NAME, allowed) if indexed else None,
        read_headers=read_headers,
        other_files=other_files,
    )
    blobs = {f: d for f in ckpt.files if (d := _blob_sha256(root / f)) is not None}
    side = _read_file(root, QUANT_SIDE_FILE, allowed) if (root / QUANT_SIDE_FILE).exists() else None
    return replace(ckpt, blob_sha256=blobs, quant_side=load_quant_side(side, str(root / QUANT_SIDE_FILE)))


def _blob_sha256(path: Path) -> str | None:
    """The sha256 a Hugging Face cache names the blob behind ``path`` by, if it is one."""
    if not path.is_symlink():
        return None
    target = Path(os.readlink(path))
    if target.parent.name != "blobs" or not is_sha256(target.name):
        return None
    return target.name


# Where ``hf download --local-dir`` records what it downloaded: per file, the commit, the ETag
# (for an LFS file, its sha256) and when (huggingface_hub's _local_folder.py).
DOWNLOAD_RECORDS = Path(".cache", "huggingface", "download")


def downloaded_sha256(root: Path, file: str) -> str | None:
    """The sha256 ``hf download --local-dir`` recorded for ``file`` of the directory ``root``
    (its LFS ETag), where the file is unchanged since by huggingface_hub's own rule (modified
    at most 1 s after the record); None when there is no such record. Reads only.

    Args:
        root: a checkpoint directory.
        file: a shard's name in it.

    Returns:
        The recorded sha256, or None.

    Example:
        >>> downloaded_sha256(Path("/nonexistent"), "model.safetensors") is None
        True
    """
    try:
        lines = (root / DOWNLOAD_RECORDS / f"{file}.metadata").read_text().splitlines()
        recorded, when = lines[1].strip(), float(lines[2])
        modified = (root / file).stat().st_mtime
    except (OSError, ValueError, IndexError, UnicodeDecodeError):
        return None
    return recorded if is_sha256(recorded) and modified - 1 <= when else None


def assemble_checkpoint(
    *,
    root: Path,
    display: str,
    config: dict,
    config_bytes: bytes,
    index_bytes: bytes | None,
    read_headers: Callable[[list[str]], Iterable[Header]],
    other_files: Callable[[list[str]], tuple[tuple[str, ...], tuple[str, ...]]],
    hub: dict | None = None,
) -> Checkpoint:
    """Check a checkpoint's config, index and headers against each other and build it.

    Shared by local directories and Hub repos: ``display`` names the source in messages,
    ``config`` is ``config_bytes`` as :func:`load_config` read it, ``read_headers(files)``
    returns each data file's parsed header in the order of ``files`` (called once the index is
    known good; taken one at a time, each dropped once its tensors are made: a checkpoint's
    headers together hold more than its tensors do, ~290,000 of them at the largest shapes) and
    ``other_files(files)`` the non-weight files every stage gets and the ``*.safetensors``
    the index does not list.
    """
    num_layers = _num_layers(config, f"{display}/{CONFIG_NAME}")
    weight_map: dict[str, str] | None = None
    files = [SINGLE_FILE_NAME]
    index_sha256 = None
    if index_bytes is not None:
        where = f"{display}/{INDEX_NAME}"
        index_sha256 = hashlib.sha256(index_bytes).hexdigest()
        weight_map, files = _weight_map(parse_json_object(index_bytes, where, load_index), where)
    del index_bytes  # parsed: not held while the headers are read
    # Each tensor is in one shard: the index lists it in one file (without an index, there is
    # one shard), so all of them make one dict, in (file, offset) order.
    tensors: dict[str, SourceTensor] = {}
    sizes: dict[str, int] = {}
    digests: list[str] = []
    stamps: dict[str, tuple[int, ...]] = {}
    shapes: dict[tuple[int, ...], tuple[int, ...]] = {}
    for file, header in zip(files, read_headers(files), strict=True):
        names = header.columns.names
        if weight_map is not None and names and set(map(weight_map.get, names)) != {file}:
            _name_mismatch(display, file, header, tensors, weight_map)
        tensors.update(zip(names, _source_tensors(file, header, shapes), strict=True))
        sizes[file] = header.file_size
        digests.append(header.sha256)
        if header.stamp is not None:
            stamps[file] = header.stamp
    if weight_map is not None and len(tensors) != len(weight_map):  # all in it: is it all?
        missing = [n for n in weight_map if n not in tensors]
        if missing:
            raise BadInput(
                f"{INDEX_NAME} lists tensor {missing[0]!r} in {weight_map[missing[0]]} but that "
                f"shard does not hold it ({len(missing)} such tensors); the checkpoint is incomplete"
            )

    extra, unlisted = other_files(files)
    return Checkpoint(
        root=root,
        config=config,
        config_sha256=hashlib.sha256(config_bytes).hexdigest(),
        index_sha256=index_sha256,
        num_layers=num_layers,
        tied_embeddings=schema.tied_embeddings(config),
        files=tuple(files),
        file_sizes=sizes,
        headers_sha256=hashlib.sha256("".join(digests).encode()).hexdigest(),
        stamps=stamps,
        tensors=tensors,
        extra_files=extra,
        unlisted=unlisted,
        hub=hub,
    )


def _name_mismatch(
    display: str, file: str, header: Header, earlier: dict[str, SourceTensor], weight_map: dict[str, str]
) -> NoReturn:
    """Name the first tensor of ``file`` (its ``header``) that another shard (of those read
    before, whose tensors are ``earlier``) holds too or that the index does not list in ``file``,
    which the bulk check found."""
    for t in header.tensors:
        if t.name in earlier:
            raise BadInput(
                f"tensor {t.name!r} appears in both {earlier[t.name].file} and {file}; "
                "the checkpoint is inconsistent"
            )
        listed = weight_map.get(t.name)
        if listed != file:
            where = f"lists it in {listed}" if listed else "does not list it"
            raise BadInput(
                f"{display}/{file}: holds tensor {t.name!r} but {INDEX_NAME} {where}; "
                "the index and the shards do not match"
            )
    raise AssertionError(f"{file}: the bulk check found a tensor at fault, the exact one none")


def _source_tensors(
    file: str, header: Header, shared: dict[tuple[int, ...], tuple[int, ...]]
) -> Iterator[SourceTensor]:
    """The SourceTensor of each tensor of ``file`` (its ``header``), in offset order, each
    shape the one of ``shared`` equal to it (added there when new).

    Why shared shapes: they repeat (a per-expert checkpoint has a few dozen for ~290,000
    tensors), yet each header entry is parsed into a tuple of its own; one of each makes every
    tensor ~70 bytes smaller. ``dict.setdefault`` mapped over the column does it in C.
    """
    file_names, dtypes, shapes, begins, ends = header.columns
    columns = zip(
        file_names,
        repeat(file),
        dtypes,
        map(shared.setdefault, shapes, shapes),
        map(add, repeat(header.data_start), begins),
        map(sub, ends, begins),
        strict=False,  # repeat() is endless
    )
    return make_tuples(SourceTensor, columns)


def load_quant_side(raw: bytes | None, where: str) -> dict | None:
    """hf_quant_config.json's bytes (None: no such file) as a dict."""
    return None if raw is None else parse_json_object(raw, where)


def load_config(raw: bytes, where: str) -> dict:
    """config.json's bytes as a dict, checked to name a positive number of layers."""
    config = parse_json_object(raw, where)
    _num_layers(config, where)
    return config


def _num_layers(config: dict, where: str) -> int:
    n = schema.text_config(config).get("num_hidden_layers")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise BadInput(
            f"{where}: no positive integer num_hidden_layers (in text_config or at the top "
            "level); is this a Qwen3.5 MoE config?"
        )
    return n


def _weight_map(index: object, where: str) -> tuple[dict[str, str], list[str]]:
    """The index's weight_map, checked, and the files it names, sorted."""
    wm = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wm, dict) or not wm:
        raise BadInput(f"{where}: no non-empty weight_map object")
    try:  # in bulk: a few distinct file names for ~190,000 tensors
        files = set(wm.values())
    except TypeError:  # an unhashable value: not a file name, named below
        files = None
    if files is not None and all(isinstance(f, str) and not f.endswith(PICKLE_SUFFIXES) for f in files):
        return wm, sorted(files)
    for name, file in wm.items():
        if not isinstance(file, str):
            raise BadInput(f"{where}: weight_map entry {name!r} is not a file name")
        if file.endswith(PICKLE_SUFFIXES):
            raise BadInput(
                f"{where}: tensor {name!r} is in pickled file {file!r}, which this tool never "
                "loads; convert the checkpoint to safetensors first"
            )
    return wm, sorted(set(wm.values()))


def _checked_path(root: Path, name: str, allowed: tuple[Path, ...], *, what: str) -> Path:
    """``root/name`` after checking that ``name`` is a plain file name that stays inside."""
    if not is_plain_name(name):
        raise BadInput(
            f"{root / INDEX_NAME}: {what} file name {name!r} is not a plain file name inside "
            "the model directory; refusing to follow it"
        )
    path = root / name
    try:
        st = os.stat(path)
        real = Path(os.path.realpath(path))
    except FileNotFoundError:
        raise BadInput(f"{path}: {what} listed by the checkpoint is missing") from None
    except OSError as e:
        if e.errno == errno.ENAMETOOLONG:
            raise BadInput(
                f"{root}: {what} file name {_shown(name)} is too long for the filesystem "
                f"({len(os.fsencode(name))} bytes); the checkpoint's file names are damaged"
            ) from e
        raise BadInput(f"{path}: cannot read ({e.strerror})") from e
    except ValueError as e:  # a lone surrogate (\ud800) no file name can hold
        raise BadInput(
            f"{root}: {what} file name {_shown(name)} is no file name this system can open; "
            "the checkpoint's file names are damaged"
        ) from e
    if not any(real.is_relative_to(a) for a in allowed):
        raise BadInput(
            f"{path}: is a symlink to {real}, outside the model directory; refusing to follow it"
        )
    if not stat.S_ISREG(st.st_mode):
        raise BadInput(f"{path}: not a regular file")
    if not _utf8(name):
        raise BadInput(
            f"{root}: file name {_shown(name)} is not UTF-8, which the stages' manifests cannot record; "
            "rename or remove the file"
        )
    return path


def _utf8(name: str) -> bool:
    """Whether ``name`` (as os.listdir gives it: undecodable bytes as surrogates) is UTF-8 text."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _shown(name: str, limit: int = 60) -> str:
    """``name`` for a message: quoted and escaped, its middle elided past ``limit`` characters."""
    if len(name) > limit:
        name = f"{name[: limit // 2]}...{name[-limit // 2 :]}"
    return repr(name)


def _read_file(root: Path, name: str, allowed: tuple[Path, ...]) -> bytes:
    if not (root / name).exists():
        raise BadInput(
            f"{root / name}: missing; {param('model_dir')} must be a Hugging Face model directory"
        )
    path = _checked_path(root, name, allowed, what="")
    try:
        return path.read_bytes()
    except OSError as e:
        raise BadInput(f"{path}: cannot read ({e.strerror})") from e


def _extra_files(root: Path, allowed: tuple[Path, ...], *, skip: set[str]) -> tuple[str, ...]:
    """Non-weight top-level files (tokenizer, generation config, ...) that every stage needs.

    Weights outside the index are left behind: stray ``*.safetensors`` would be stale data,
    and pickled files are never touched. Subdirectories are not carried over.
    """
    out = []
    for p in sorted(root.iterdir()):
        name = p.name
        if name in skip or name.startswith(".") or name.endswith((".safetensors", *PICKLE_SUFFIXES)):
            continue
        if p.is_symlink() or p.is_file():
            _checked_path(root, name, allowed, what="file")
            out.append(name)
    return tuple(out)
