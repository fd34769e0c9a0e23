"""Strict reading and deterministic writing of safetensors headers.

The reference reader lets through duplicate names, misaligned or unpadded headers and more,
so the tool parses headers itself with stricter rules. Writing is ours too: the reference
writer's metadata order varies between runs, and byte-identical output needs a fixed order.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
from dataclasses import dataclass, field, replace
from functools import cached_property
from itertools import accumulate, chain
from operator import attrgetter, itemgetter, mul
from typing import Annotated, Literal, NamedTuple

import msgspec

from ..bulk import make_tuple, make_tuples
from ..errors import JSON_ERRORS, BadInput, ReshardError
from ..format.dtypes import DTYPE_SIZES

MAX_HEADER_BYTES = 100_000_000  # the reference reader's limit
# The reference writer pads the header so that the data buffer starts at a multiple of 8
# (shared/docs/safetensors-format.md, Layout); the tool's own headers keep to it.
DATA_ALIGN = 8
METADATA_KEY = "__metadata__"
# json's own string encoder (the C one when available): json.dumps(s, ensure_ascii=False).
_json_str = json.encoder.encode_basestring


class TensorEntry(NamedTuple):
    """One tensor of a safetensors file; begin/end are relative to the data buffer.

    A named tuple, not a dataclass: one is made per tensor (~190,000 for a 397B FP8
    checkpoint), and a tuple is made several times faster.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class Columns(NamedTuple):
    """A header's tensors sorted by begin, column by column (what bulk readers take)."""

    names: list[str]
    dtypes: list[str]
    shapes: list[tuple[int, ...]]
    begins: list[int]
    ends: list[int]


@dataclass(frozen=True)
class Header:
    """A parsed header: tensors sorted by begin, and where the data buffer starts."""

    path: str
    data_start: int
    file_size: int
    columns: Columns = field(repr=False)
    metadata: dict[str, str]
    raw: bytes = field(repr=False, compare=False)  # the JSON as read (the loader compares it later)
    stamp: tuple[int, ...] | None = None  # the file read, as file_stamp says (local files only)

    @cached_property
    def sha256(self) -> str:
        """The sha256 of the header's JSON bytes (what a source's fingerprint covers)."""
        return hashlib.sha256(self.raw).hexdigest()

    @cached_property
    def tensors(self) -> tuple[TensorEntry, ...]:
        """One entry per tensor, made on first use (a checkpoint reader takes the columns)."""
        return tuple(make_tuples(TensorEntry, zip(*self.columns, strict=True)))


def read_header(path: str | os.PathLike[str], *, display: str | None = None) -> Header:
    """Read and check the header of the safetensors file at ``path``.

    ``display`` is the name used in error messages (defaults to the path).
    """
    where = display or str(path)
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            file_size = st.st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise BadInput(f"{where}: not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", prefix)
            if n > MAX_HEADER_BYTES:
                raise BadInput(
                    f"{where}: header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit; "
                    "the file is corrupt or not safetensors"
                )
            if 8 + n > file_size:
                raise BadInput(
                    f"{where}: header length {n} runs past the end of the {file_size}-byte file; "
                    "the file is truncated or not safetensors"
                )
            raw = f.read(n)
    except OSError as e:
        raise BadInput(f"{where}: cannot read ({e.strerror})") from e
    return replace(parse_header(raw, file_size=file_size, where=where), stamp=file_stamp(st))


def parse_header(raw: bytes, *, file_size: int, where: str) -> Header:
    """Check header bytes ``raw`` of a file of ``file_size`` bytes; see :func:`read_header`."""
    if not raw.startswith(b"{"):
        raise BadInput(f"{where}: header does not start with '{{'; not a safetensors file")
    fast = None if b"-" in raw and _NEGATIVE_ZERO.search(raw) else _typed_header(raw, file_size, where)
    if fast is not None:
        return fast
    try:
        text = raw.decode("utf-8")
        obj = json.loads(text, parse_int=_parse_int)
        if not _no_key_dropped(raw, obj):
            # json keeps the last of repeated keys silently: parse again, naming the first one.
            obj = json.loads(text, parse_int=_parse_int, object_pairs_hook=_no_duplicate_keys(where))
    except UnicodeDecodeError as e:
        raise BadInput(f"{where}: header is not valid UTF-8") from e
    except json.JSONDecodeError as e:
        raise BadInput(f"{where}: header is not valid JSON ({e.msg} at byte {e.pos})") from e
    except ReshardError:  # a repeated key, already named: a ValueError, but no JSON error
        raise
    except JSON_ERRORS as e:
        why = "nested too deep or a number too long"
        raise BadInput(f"{where}: header is not JSON this tool reads ({why})") from e
    if not isinstance(obj, dict):
        raise BadInput(f"{where}: header is not a JSON object")
    if b"\\" in raw and not _encodable(obj):
        # Only an escape can spell a lone surrogate (\ud800): no character, so no UTF-8 header
        # can hold it. The reference reader refuses it too.
        raise BadInput(
            f"{where}: header holds a lone surrogate escape (\\ud800-\\udfff); not valid JSON text"
        )
    metadata = obj.pop(METADATA_KEY, None)
    if metadata is None:  # absent or null, as the reference reader allows; not [], 0, "" or false
        metadata = {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise BadInput(f"{where}: __metadata__ must map strings to strings")
    data_start = 8 + len(raw)
    data_size = file_size - data_start
    columns = _checked_columns(obj, data_size)
    if columns is None:  # something is wrong: the checks one tensor at a time name it
        tensors = sorted([_tensor_entry(name, info, where) for name, info in obj.items()], key=_BEGIN_END)
        _check_tiling(tensors, data_size=data_size, where=where)
        columns = (
            Columns(*(list(c) for c in zip(*tensors, strict=True)))
            if tensors
            else Columns([], [], [], [], [])
        )
    return Header(str(where), data_start, file_size, columns, dict(metadata), raw)


class _NegativeZero(int):
    """An integer written ``-0``: 0 to json and msgspec, but a float to the reference reader
    (serde_json keeps a negative zero's sign as an f64), which then refuses the header. Not an
    ``int`` by ``type()``, so every check of offsets and dims refuses it, showing it as written."""

    def __repr__(self) -> str:
        return "-0"


# Where a header may write a number -0 (or a string holds those bytes): parsed by json then. Sought
# only where a "-" is (``in`` of one byte is a memchr: ~3 us for a ~300 KB header, the pattern ~75).
_NEGATIVE_ZERO = re.compile(rb"-0(?![0-9.eE])")


def _parse_int(digits: str) -> int:
    """json's ``parse_int``: ``int``, but ``-0`` kept apart (see :class:`_NegativeZero`)."""
    return _NegativeZero(0) if digits == "-0" else int(digits)


def file_stamp(st: os.stat_result) -> tuple[int, ...]:
    """What tells one file from another at a path, and a changed file from itself: device,
    inode, size, modification and status-change times (a rename keeps the mtime, not the inode)."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _typed_header(raw: bytes, file_size: int, where: str) -> Header | None:
    """:func:`parse_header` of a header in the usual form, or None (then the exact checks run).

    Why: json builds a dict per tensor and the checks then take ~20 passes over them (a 397B
    FP8 checkpoint has ~190,000 tensors); msgspec decodes the entries straight into typed
    records, checking keys and types in C. The usual form, which both the reference writer and
    this tool write: ``__metadata__`` first or absent, no backslash escape, and a colon count
    that shows no repeated key (msgspec, like json, keeps the last of repeated keys silently).
    """
    if b"\\" in raw:
        return None
    try:
        text = raw.decode("utf-8")
        metadata, tensors = _metadata_first(raw, text)
        entries = _HEADER_ENTRIES.decode(tensors)
    except JSON_ERRORS:  # msgspec.DecodeError and UnicodeDecodeError are ValueErrors
        return None
    has_metadata = tensors is not raw
    metadata = {} if metadata is None else metadata
    if type(metadata) is not dict or not set(map(type, chain(metadata, metadata.values()))) <= {str}:
        return None
    strings = chain(entries, metadata, metadata.values())
    if raw.count(b":") != 4 * len(entries) + has_metadata + len(metadata) + "".join(strings).count(":"):
        return None
    infos = list(entries.values())
    offsets = list(map(_ENTRY_OFFSETS, infos))
    dtypes, shapes = list(map(_ENTRY_DTYPE, infos)), list(map(_ENTRY_SHAPE, infos))
    data_size = file_size - 8 - len(raw)
    begins, ends = list(map(_FIRST, offsets)), list(map(_SECOND, offsets))
    columns = _tiled_columns(list(entries), dtypes, shapes, begins, ends, data_size)
    return None if columns is None else Header(str(where), 8 + len(raw), file_size, columns, metadata, raw)


def _metadata_first(raw: bytes, text: str) -> tuple[object, bytes]:
    """A header (``raw``, decoded as ``text``) split into its ``__metadata__`` value, when that
    comes first (else None), and the JSON of the object of its other entries (``raw`` itself
    without one).

    Why joined from a view of ``raw``: the rest is nearly the whole header (~300 KB a shard of
    a 397B FP8 checkpoint); one copy, not a slice and then a concatenation (fresh pages twice).
    """
    if not text.startswith(_METADATA_FIRST):
        return None, raw
    metadata, end = _METADATA.raw_decode(text, len(_METADATA_FIRST))
    if text.startswith(",", end):
        end += 1
    rest = len(text[:end].encode("utf-8"))  # where the other entries begin in raw
    return metadata, b"".join((b"{", memoryview(raw)[rest:]))


class _HeaderEntry(msgspec.Struct, forbid_unknown_fields=True, frozen=True, gc=False):
    """A header's tensor entry with the keys and types :func:`_tensor_entry` requires."""

    dtype: Literal[tuple(DTYPE_SIZES)]  # type: ignore[valid-type]
    shape: tuple[Annotated[int, msgspec.Meta(ge=0)], ...]
    data_offsets: tuple[Annotated[int, msgspec.Meta(ge=0)], Annotated[int, msgspec.Meta(ge=0)]]


_METADATA_FIRST = '{"__metadata__":'
_METADATA = json.JSONDecoder()
_HEADER_ENTRIES = msgspec.json.Decoder(dict[str, _HeaderEntry])
_ENTRY_DTYPE, _ENTRY_SHAPE, _ENTRY_OFFSETS = map(attrgetter, ("dtype", "shape", "data_offsets"))


def _encodable(obj: object) -> bool:
    """Whether every string of ``obj`` (parsed JSON) can be written as UTF-8."""
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _no_key_dropped(raw: bytes, obj: object) -> bool:
    """Whether ``obj``, parsed from ``raw`` by ``json``, kept every key (False: not sure).

    In JSON without backslash escapes, every ':' of ``raw`` is either one key's separator or a
    character of a string, and the parsed strings are the raw ones. So the colons of ``obj``
    (one per key of every object, plus those inside its strings) number exactly those of
    ``raw`` unless a repeated key was dropped, taking its own ':' with it. This counts a part
    of them (the keys of the top object and of its values; then, only if short, the colons in
    the top keys and in ``__metadata__``): reaching the count of ``raw`` proves that nothing
    was dropped, and falling short, rare, sends the caller to the exact check.
    """
    if type(obj) is not dict or b"\\" in raw:
        return False
    values = obj.values()
    if not set(map(type, values)) <= {dict}:
        return False
    colons = raw.count(b":")
    counted = len(obj) + sum(map(len, values))
    if counted == colons:  # the common case: no colon in any string
        return True
    counted += "".join(obj).count(":")
    metadata = obj.get(METADATA_KEY)
    if metadata:
        strings = [v for v in metadata.values() if type(v) is str]
        counted += "".join(metadata).count(":") + "".join(strings).count(":")
    return counted == colons


def _no_duplicate_keys(where: str):
    def hook(pairs: list[tuple[str, object]]) -> dict[str, object]:
        out = dict(pairs)
        if len(out) != len(pairs):  # rare: find the first repeated key for the message
            seen: set[str] = set()
            for k, _ in pairs:
                if k in seen:
                    raise BadInput(f"{where}: tensor {k!r} appears twice in the header")
                seen.add(k)
        return out

    return hook


_ENTRY_KEYS = {"dtype", "shape", "data_offsets"}
_DTYPE, _SHAPE, _OFFSETS = (itemgetter(k) for k in ("dtype", "shape", "data_offsets"))
_FIRST, _SECOND = itemgetter(0), itemgetter(1)


def _checked_columns(obj: dict[str, object], data_size: int) -> Columns | None:
    """The tensors of a header (``obj`` without metadata), sorted by offsets; None when any
    check of :func:`_tensor_entry` or :func:`_check_tiling` fails.

    The same checks, made column by column in C (``map``, ``set``, list equality) instead of
    once per tensor in Python: a 397B FP8 checkpoint has ~190,000 tensors.
    """
    names, infos = list(obj), list(obj.values())
    n = len(infos)
    if not set(map(type, infos)) <= {dict} or sum(map(len, infos)) != 3 * n:
        return None
    try:  # each entry has 3 keys: with these three, exactly these
        dtypes, shapes, offsets = (list(map(key, infos)) for key in (_DTYPE, _SHAPE, _OFFSETS))
        if not set(map(type, dtypes)) <= {str} or not set(dtypes) <= DTYPE_SIZES.keys():
            return None
    except (KeyError, TypeError):  # a key missing; an unhashable dtype
        return None
    if not set(map(type, shapes)) <= {list} or not set(map(type, offsets)) <= {list}:
        return None
    dims = list(chain.from_iterable(shapes))
    if dims and (not set(map(type, dims)) <= {int} or min(dims) < 0):  # type() is int: no bools
        return None
    if set(map(len, offsets)) - {2}:
        return None
    begins, ends = list(map(_FIRST, offsets)), list(map(_SECOND, offsets))
    if not set(map(type, begins)) | set(map(type, ends)) <= {int}:
        return None
    return _tiled_columns(names, dtypes, list(map(tuple, shapes)), begins, ends, data_size)


def _tiled_columns(
    names: list[str],
    dtypes: list[str],
    shapes: list[tuple[int, ...]],
    begins: list[int],
    ends: list[int],
    data_size: int,
) -> Columns | None:
    """The columns of well-typed entries (known dtypes, non-negative ints) sorted by offsets,
    or None unless they tile the data buffer and no shape overflows, the checks of
    :func:`_tensor_entry` and :func:`_check_tiling` that are not about types."""
    sizes = list(map(mul, map(math.prod, shapes), map(DTYPE_SIZES.__getitem__, dtypes)))
    # Only a zero dim hides an overflow; a size is 0 exactly when its shape has one.
    if 0 in sizes and any(map(_count_overflows, shapes)):
        return None
    columns = Columns(names, dtypes, shapes, begins, ends)
    if not _tiles(columns, sizes, data_size):
        # Writers list tensors in offset order, mostly; sorting by begin alone (stable) can only
        # misplace an empty tensor sharing its begin with another, which the exact path sorts.
        order = sorted(range(len(names)), key=begins.__getitem__)
        columns = Columns(*(list(map(c.__getitem__, order)) for c in columns))
        if not _tiles(columns, list(map(sizes.__getitem__, order)), data_size):
            return None
    return columns


def _tiles(c: Columns, sizes: list[int], data_size: int) -> bool:
    """The tensors, in this order, fill the data buffer back to back, each ``sizes`` long
    (what its dtype and shape need): their begins and ends are the running sums of the sizes
    (so none is negative, sizes being so)."""
    bounds = list(accumulate(sizes, initial=0))
    return bounds[-1] == data_size and c.begins == bounds[:-1] and c.ends == bounds[1:]


def _tensor_entry(name: str, info: object, where: str) -> TensorEntry:
    # Called once per tensor (~190,000 for a 397B FP8 checkpoint): checks are written for
    # speed. json only yields int or bool for integers, so ``type(x) is int`` excludes bools.
    if type(info) is not dict or info.keys() != _ENTRY_KEYS:
        raise BadInput(f"{where}: tensor {name!r} must have exactly dtype, shape and data_offsets")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if type(dtype) is not str or dtype not in DTYPE_SIZES:
        raise BadInput(f"{where}: tensor {name!r} has unsupported dtype {dtype!r}")
    if type(shape) is not list or not all([type(d) is int and d >= 0 for d in shape]):
        hint = _negative_zero_hint(shape)
        raise BadInput(f"{where}: tensor {name!r} has an invalid shape {shape!r}{hint}")
    if _count_overflows(shape):
        raise BadInput(
            f"{where}: tensor {name!r} has shape {shape!r}, whose element count overflows 64 bits; "
            "the reference reader refuses it"
        )
    if (
        type(offsets) is not list
        or len(offsets) != 2
        or not all([type(o) is int and o >= 0 for o in offsets])
    ):
        raise BadInput(
            f"{where}: tensor {name!r} has invalid data_offsets {offsets!r}{_negative_zero_hint(offsets)}"
        )
    begin, end = offsets
    expected = math.prod(shape) * DTYPE_SIZES[dtype]
    if end - begin != expected:
        raise BadInput(
            f"{where}: tensor {name!r} is {end - begin} bytes but {dtype} x {shape} needs {expected}"
        )
    return make_tuple(TensorEntry, (name, dtype, tuple(shape), begin, end))


def _negative_zero_hint(values: object) -> str:
    """Why a -0 among ``values`` (a shape or offsets) is refused, if one is there."""
    if isinstance(values, list) and any(isinstance(v, _NegativeZero) for v in values):
        return " (-0 is a float to the safetensors reference reader, which refuses the file)"
    return ""


def _count_overflows(shape: list[int]) -> bool:
    """Whether the reference reader overflows 64 bits multiplying ``shape`` out, dim by dim (it
    refuses such a header). A tensor with elements never does: its size is within the file."""
    count = 1
    for d in shape:
        count *= d
        if d > _U64_MAX or count > _U64_MAX:
            return True
    return False


_U64_MAX = 2**64 - 1
_BEGIN_END = attrgetter("begin", "end")


def _check_tiling(tensors: list[TensorEntry], *, data_size: int, where: str) -> None:
    pos = 0
    for t in tensors:
        if t.begin < pos:
            raise BadInput(f"{where}: tensor {t.name!r} overlaps the tensor before it")
        if t.begin > pos:
            raise BadInput(
                f"{where}: {t.begin - pos}-byte hole before tensor {t.name!r} in the data buffer"
            )
        pos = t.end
    if pos > data_size:
        last = tensors[-1].name
        raise BadInput(
            f"{where}: tensor {last!r} runs {pos - data_size} bytes past the end of the file; "
            "the file is truncated"
        )
    if pos < data_size:
        raise BadInput(
            f"{where}: {data_size - pos} trailing bytes after the last tensor; not a valid safetensors file"
        )


def encode_header(
    tensors: list[tuple[str, str, tuple[int, ...], int]], *, align: int = DATA_ALIGN, offset: int = 0
) -> bytes:
    """Encode a header for ``(name, dtype, shape, nbytes)`` laid out back to back, in order.

    Returns the full prefix: the 8-byte length followed by the JSON, padded with spaces so
    that the data buffer starts at ``offset`` modulo ``align`` (a multiple of 8; ``offset``
    too): at a multiple of 8 by default. Fixed key order, compact separators and
    ``{"format": "pt"}`` metadata make the bytes a function of the input alone.
    """
    body = header_json(tensors)
    return padded_header(body, header_padding(len(body), align=align, offset=offset))


def header_json(tensors: list[tuple[str, str, tuple[int, ...], int]]) -> bytes:
    """The JSON of :func:`encode_header`'s header, without its length prefix and padding."""
    # The same bytes as json.dumps(..., separators=(",", ":"), ensure_ascii=False) of
    # {"__metadata__": {"format": "pt"}, name: {"dtype", "shape", "data_offsets"}, ...},
    # built as strings because this runs for every tensor of every output file.
    parts = ['{"__metadata__":{"format":"pt"}']
    pos = 0
    for name, dtype, shape, nbytes in tensors:
        parts.append(
            f',{_json_str(name)}:{{"dtype":{_json_str(dtype)},"shape":[{",".join(map(str, shape))}],'
            f'"data_offsets":[{pos},{pos + nbytes}]}}'
        )
        pos += nbytes
    parts.append("}")
    return "".join(parts).encode("utf-8")


def header_padding(json_bytes: int, *, align: int, offset: int) -> int:
    """The spaces after a header's JSON of ``json_bytes`` bytes that start the data buffer at
    ``offset`` modulo ``align`` (see :func:`encode_header`)."""
    return (offset - 8 - json_bytes) % align


def padded_header(body: bytes, padding: int) -> bytes:
    """The full prefix of a file whose header is the JSON ``body`` and ``padding`` spaces."""
    return struct.pack("<Q", len(body) + padding) + body + b" " * padding
