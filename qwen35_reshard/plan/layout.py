"""How a stage's tensors are laid out in files. Pure, no I/O.

A stage's files are laid out as CLONE, ALIGNED (runs of at least ``MIN_SHARED_RUN`` bytes)
and GATHERED files, the same on every filesystem, so that one that shares blocks can share
them with the source: docs/format.md, "Data file layouts", says what each is and why.

The file-size limit holds for every file: a shard needed whole but larger than the limit
is laid out as ALIGNED runs and GATHERED files instead of a CLONE (its blocks still shared
where a run is long enough). A limit below the file the largest tensor alone makes is
refused before anything is laid out. The header-size limit holds for ALIGNED and GATHERED
files (a CLONE's header is its source's own).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from functools import cached_property
from itertools import groupby, repeat
from operator import itemgetter, sub
from typing import NamedTuple

from ..bulk import field_getters, make_tuples
from ..errors import BadInput, param
from ..format.dtypes import DTYPE_SIZES
from ..format.names import ALIGNED, CLONE, GATHERED, SHARE_ALIGN
from ..source.checkpoint import SourceTensor
from ..source.header import DATA_ALIGN, encode_header, header_json, header_padding, padded_header

# What a header entry adds besides its name and shape, at most (shared/docs/safetensors-format.md,
# Header): ',' ':{"dtype":' ',"shape":' ',"data_offsets":[' ',' ']}' are 40 bytes, the longest
# dtype ("F8_E4M3") 9, two offsets of up to 15 digits (below 1 PB) 30: 79, rounded up.
HEADER_ENTRY_OVERHEAD = 80

# Getters of every tensor's SourceTensor fields (see bulk.field_getters), and of a
# (source, replicated) pair.
_NAME, _FILE, _SHAPE, _OFFSET, _NBYTES = field_getters(
    SourceTensor, "name", "file", "shape", "offset", "nbytes"
)
_FIRST, _SECOND = itemgetter(0), itemgetter(1)

# Shorter runs are gathered: an ALIGNED file costs up to SHARE_ALIGN of header padding.
MIN_SHARED_RUN = 4 * SHARE_ALIGN
# Bytes of a tool-written file beyond its tensors' header entries (``_header_entry_bytes``) and
# data, padding included: the length prefix, the metadata, the closing brace, up to 7 spaces.
_FILE_OVERHEAD = 8 + len('{"__metadata__":{"format":"pt"}}') + 7
# The block size assumed by estimates of what a filesystem will share (the real run measures).
SHARE_BLOCK = 4096


class PlacedTensor(NamedTuple):
    """A source tensor as it lands in one output file, at ``out_offset`` of its data buffer.

    A named tuple, not a dataclass: one is made per tensor placed, and a tuple is made fast.
    """

    source: SourceTensor
    out_offset: int
    replicated: bool  # also placed on other stages, on purpose

    @property
    def name(self) -> str:
        return self.source.name


(_SOURCE,) = field_getters(PlacedTensor, "source")


@dataclass(frozen=True)
class OutputFile:
    """One safetensors file of a stage: its layout, header and tensors in data order.

    A CLONE's header is the source file's own (``header`` is empty: the plan reads no
    bytes); ``source_file`` is the shard a CLONE or ALIGNED file takes its bytes from.
    The header is kept as its JSON and a count of padding spaces, the bytes made on use
    (``header``): an ALIGNED file's padding is up to SHARE_ALIGN (1 MiB), hundreds of MB over
    the ~700 files of a split of the largest checkpoints (~290,000 tensors).
    """

    name: str
    header_json: bytes  # empty for a CLONE
    tensors: tuple[PlacedTensor, ...]
    layout: str = GATHERED
    source_file: str | None = None
    padding: int = 0  # spaces after header_json (see source.header.encode_header)

    @property
    def header(self) -> bytes:
        """The bytes before the data buffer: length, JSON and padding (empty for a CLONE)."""
        return b"" if self.layout == CLONE else padded_header(self.header_json, self.padding)

    @property
    def data_start(self) -> int:
        """Offset of the data buffer in the file."""
        if self.layout == CLONE:
            t = self.tensors[0]
            return t.source.offset - t.out_offset
        return 8 + len(self.header_json) + self.padding

    @cached_property
    def data_bytes(self) -> int:
        return sum(map(_NBYTES, map(_SOURCE, self.tensors)))

    @property
    def tensor_names(self) -> list[str]:
        """Its tensors' names, in data order."""
        return list(map(_NAME, map(_SOURCE, self.tensors)))

    @property
    def size(self) -> int:
        return self.data_start + self.data_bytes

    @property
    def shareable_bytes(self) -> int:
        """Bytes a filesystem sharing ``SHARE_BLOCK``-sized blocks shares with the source."""
        if self.layout == CLONE:
            return self.size
        if self.layout == GATHERED:
            return 0
        start = self.tensors[0].source.offset
        end = start + self.data_bytes
        return max(0, end // SHARE_BLOCK * SHARE_BLOCK - -(-start // SHARE_BLOCK) * SHARE_BLOCK)


def check_file_limit(tensor_names: list[str], sources: list[SourceTensor], max_file_bytes: int) -> None:
    """Refuse a file-size limit that some tensor, in a file of its own, exceeds; name the
    tensor and the smallest limit every tensor fits."""
    if not sources:
        return
    largest = _single_file_bytes(max(sources, key=_NBYTES))
    # The exact size is computed only for tensors that may reach the largest tensor's: those
    # within the largest header any of them can need of its data size.
    reach = largest - _FILE_OVERHEAD - _longest_header_entry(tensor_names, sources)
    need, name = max((_single_file_bytes(s), s.name) for s in sources if s.nbytes >= reach)
    if max_file_bytes < need:
        raise BadInput(
            f"{param('max_file_bytes', max_file_bytes)} is smaller than tensor {name!r}, which needs a "
            f"file of {need} bytes on its own; pass {param('max_file_bytes', need)} or more"
        )


def _longest_header_entry(tensor_names: list[str], sources: list[SourceTensor]) -> int:
    """An upper bound of every tensor's ``_header_entry_bytes``, from the longest name and shape.

    Why a bound: the exact entry of each of ~190,000 tensors (a 397B FP8 checkpoint) costs a
    call per tensor; this is two passes in C. json.dumps writes a character as at most 12
    (a surrogate pair's two escapes), and shapes repeat.
    """
    longest_name = 12 * max(map(len, tensor_names)) + 2
    longest_shape = max(map(len, map(str, map(list, set(map(_SHAPE, sources))))))
    return longest_name + longest_shape + HEADER_ENTRY_OVERHEAD


def _single_file_bytes(src: SourceTensor) -> int:
    """The size of a GATHERED file holding ``src`` alone."""
    return len(encode_header([(src.name, src.dtype, src.shape, src.nbytes)])) + src.nbytes


def layout_files(
    sources: list[SourceTensor],
    replicated: list[bool],
    file_order: dict[str, int],
    file_tensors: Counter[str],
    whole_fits: set[str],
    *,
    max_file_bytes: int,
    max_header_bytes: int,
) -> tuple[OutputFile, ...]:
    """Lay out a stage's tensors (in source order; each replicated or not) as CLONE, ALIGNED,
    then GATHERED files; a shard is a CLONE only when it is needed whole and ``whole_fits``."""
    # (layout, source file, its tensors, whether each is replicated)
    shared: list[tuple[str, str, list[SourceTensor], list[bool]]] = []
    rest: list[tuple[SourceTensor, bool]] = []
    pos = 0
    for file, group in groupby(map(_FILE, sources)):  # runs of one source file
        end = pos + len(list(group))
        srcs, reps, pos = sources[pos:end], replicated[pos:end], end
        if len(srcs) == file_tensors[file] and file in whole_fits:
            shared.append((CLONE, file, srcs, reps))
            continue
        runs, short = _aligned_runs(
            list(zip(srcs, reps, strict=True)),
            max_file_bytes=max_file_bytes,
            max_header_bytes=max_header_bytes,
        )
        shared += [(ALIGNED, file, list(map(_FIRST, run)), list(map(_SECOND, run))) for run in runs]
        rest += short
    gathered = _gather(rest, file_order, max_file_bytes=max_file_bytes, max_header_bytes=max_header_bytes)
    count = len(shared) + len(gathered)
    names = [f"model-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1)]
    files = []
    for name, (layout, file, srcs, reps) in zip(names[: len(shared)], shared, strict=True):
        start = srcs[0].offset  # for a CLONE, the shard's data start (tensors tile it from 0)
        body = b"" if layout == CLONE else header_json([(s.name, s.dtype, s.shape, s.nbytes) for s in srcs])
        padding = 0 if layout == CLONE else header_padding(len(body), align=SHARE_ALIGN, offset=start)
        offsets = map(sub, map(_OFFSET, srcs), repeat(start))
        placed_tensors = tuple(make_tuples(PlacedTensor, zip(srcs, offsets, reps, strict=True)))
        files.append(OutputFile(name, body, placed_tensors, layout, file, padding))
    for name, group in zip(names[len(shared) :], gathered, strict=True):
        body = header_json([(s.name, s.dtype, s.shape, s.nbytes) for s, _ in group])
        padding = header_padding(len(body), align=DATA_ALIGN, offset=0)
        offsets, pos = [], 0
        for s, _ in group:
            offsets.append(pos)
            pos += s.nbytes
        tensors = tuple(PlacedTensor(s, off, rep) for (s, rep), off in zip(group, offsets, strict=True))
        files.append(OutputFile(name, body, tensors, padding=padding))
    return tuple(files)


def _aligned_runs(
    items: list[tuple[SourceTensor, bool]], *, max_file_bytes: int, max_header_bytes: int
) -> tuple[list[list[tuple[SourceTensor, bool]]], list[tuple[SourceTensor, bool]]]:
    """Cut one shard's tensors (in offset order) into ALIGNED runs; return them and the rest.

    A run is source-adjacent tensors starting at a multiple of 8 (the tool's files keep the
    data buffer 8-aligned), each at a multiple of its element size from the start, within
    the file limits (the whole file, header and SHARE_ALIGN of padding included). Runs shorter than
    MIN_SHARED_RUN go to the rest.
    """
    runs: list[list[tuple[SourceTensor, bool]]] = []
    rest: list[tuple[SourceTensor, bool]] = []
    header_budget = max_header_bytes - SHARE_ALIGN
    if header_budget <= 0:
        return runs, list(items)
    run: list[tuple[SourceTensor, bool]] = []
    data = header = end = 0

    def close() -> None:
        if data >= MIN_SHARED_RUN:
            runs.append(run)
        else:
            rest.extend(run)

    for item in items:
        s = item[0]
        entry = _header_entry_bytes(s)
        if (
            run
            and s.offset == end
            and (s.offset - run[0][0].offset) % DTYPE_SIZES[s.dtype] == 0
            and _aligned_bound(header + entry, data + s.nbytes) <= max_file_bytes
            and header + entry <= header_budget
        ):
            run.append(item)
            data += s.nbytes
            header += entry
            end += s.nbytes
            continue
        close()
        run, data, header, end = [], 0, 0, 0
        if s.offset % DATA_ALIGN or entry > header_budget or _aligned_bound(entry, s.nbytes) > max_file_bytes:
            rest.append(item)
            continue
        run, data, header, end = [item], s.nbytes, entry, s.offset + s.nbytes
    close()
    return runs, rest


def _aligned_bound(header: int, data: int) -> int:
    """Upper bound of an ALIGNED file's size: header entries, padding up to SHARE_ALIGN, data."""
    return _FILE_OVERHEAD + SHARE_ALIGN + header + data


def _gather(
    placed: list[tuple[SourceTensor, bool]],
    file_order: dict[str, int],
    *,
    max_file_bytes: int,
    max_header_bytes: int,
) -> list[list[tuple[SourceTensor, bool]]]:
    """Cut GATHERED tensors into files, in (alignment, source file, source offset) order.

    Larger element sizes first keeps every tensor aligned to its element size, as in the
    reference writer; within that, source order keeps adjacent source runs adjacent.
    """
    if not placed:
        return []
    placed = sorted(placed, key=lambda p: (-DTYPE_SIZES[p[0].dtype], file_order[p[0].file], p[0].offset))
    groups: list[list[tuple[SourceTensor, bool]]] = [[]]
    data = header = 0
    for item in placed:
        src = item[0]
        entry = _header_entry_bytes(src)
        too_big = _FILE_OVERHEAD + header + entry + data + src.nbytes > max_file_bytes
        if groups[-1] and (too_big or header + entry > max_header_bytes):
            groups.append([])
            data = header = 0
        groups[-1].append(item)
        data += src.nbytes
        header += entry
    return groups


def _header_entry_bytes(src: SourceTensor) -> int:
    """Upper bound of the bytes ``src`` adds to a header, for cutting files before the limit."""
    name = src.name
    # Same value as len(json.dumps(name)) + len(json.dumps(list(shape))), without json for
    # the common plain-ASCII name: this runs for every tensor.
    plain = name.isascii() and name.isprintable() and '"' not in name and "\\" not in name
    name_bytes = len(name) + 2 if plain else len(json.dumps(name))
    return name_bytes + len(str(list(src.shape))) + HEADER_ENTRY_OVERHEAD
