"""The plan: which source tensor goes to which stage, file and offset. Pure, no I/O.

Placement follows the target server's rules (see ``model.runtimes``): decoder layer i goes to the
stage whose layer range holds it; embed_tokens, norm, lm_head, mtp.* and model.visual.* go
where the runtime builds them, replicated on purpose where it builds them on several ranks.

A stage's files are laid out so that a filesystem that shares blocks (XFS, Btrfs, ...) can
share them with the source, and the layout is the same on every filesystem:

- CLONE: a source shard the stage needs whole becomes a file with exactly the source file's
  bytes, its header included (cloned whole where the filesystem allows, copied elsewhere);
- ALIGNED: each run of at least ``MIN_SHARED_RUN`` source-adjacent bytes of a shard needed
  in part becomes a file of its own, whose header is padded with spaces so that every byte
  keeps its source offset modulo ``SHARE_ALIGN`` (1 MiB: a multiple of 4 KiB blocks and of
  ZFS records). The header padding is the one free offset of a safetensors file, hence one
  run per file. The block-aligned middle of the run can then be shared;
- GATHERED: the remaining short runs, in (alignment, source file, source offset) order as
  the reference writer groups them, so that adjacent source ranges stay one copy.

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
from itertools import chain, groupby, repeat
from operator import itemgetter, sub
from typing import NamedTuple

from ..bulk import field_getters, make_tuples
from ..errors import ReshardError, param
from ..format.dtypes import DTYPE_SIZES
from ..format.names import (
    ALIGNED,
    CLONE,
    GATHERED,
    MTP_ABSENT,
    MTP_DROPPED,
    MTP_KEPT,
    SHARE_ALIGN,
    stage_dirname,
)
from ..model import names, schema
from ..model.runtimes import (
    check_partition,
    check_pp,
    check_runtime,
    check_servable,
    default_partition,
    launch_env,
    layer_ranges,
    placement_rules,
)
from ..source.checkpoint import Checkpoint, SourceTensor
from ..source.header import DATA_ALIGN, encode_header

DEFAULT_MAX_FILE_BYTES = 5 * 1024**3
# The Hub reads remote headers only up to 25 MB; stay well below with room for long names.
DEFAULT_MAX_HEADER_BYTES = 16 * 1024**2
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
# Non-layer roles, in the order reports list them.
_EXTRA_KINDS = (names.EMBED, names.VISUAL, names.VISUAL_POS_EMBED, names.NORM, names.LM_HEAD, names.MTP)

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
    """One safetensors file of a stage: its layout, header bytes and tensors in data order.

    A CLONE's header is the source file's own (``header`` is empty: the plan reads no
    bytes); ``source_file`` is the shard a CLONE or ALIGNED file takes its bytes from.
    """

    name: str
    header: bytes
    tensors: tuple[PlacedTensor, ...]
    layout: str = GATHERED
    source_file: str | None = None

    @property
    def data_start(self) -> int:
        """Offset of the data buffer in the file."""
        if self.layout == CLONE:
            t = self.tensors[0]
            return t.source.offset - t.out_offset
        return len(self.header)

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


@dataclass(frozen=True)
class StagePlan:
    """What one pipeline stage's directory holds."""

    rank: int
    start_layer: int
    end_layer: int  # exclusive
    files: tuple[OutputFile, ...]
    extras: tuple[str, ...] = ()  # non-layer roles it holds (embed, visual, norm, lm_head, mtp)

    @property
    def tensors(self) -> list[PlacedTensor]:
        return list(chain.from_iterable(f.tensors for f in self.files))

    @property
    def data_bytes(self) -> int:
        return sum(f.data_bytes for f in self.files)

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def shareable_bytes(self) -> int:
        return sum(f.shareable_bytes for f in self.files)

    @property
    def source_files(self) -> list[str]:
        """The source shards its files read, sorted."""
        # A CLONE or ALIGNED file reads its source_file alone: only GATHERED files' tensors
        # are read one by one (most of a stage's ~50,000 tensors are in the others).
        shards = {f.source_file for f in self.files if f.layout != GATHERED}
        gathered = (map(_FILE, map(_SOURCE, f.tensors)) for f in self.files if f.layout == GATHERED)
        return sorted(shards.union(*gathered))

    @property
    def dirname(self) -> str:
        return stage_dirname(self.rank)


@dataclass(frozen=True)
class Plan:
    """The whole split: every stage's layout, and what was left out on purpose."""

    checkpoint: Checkpoint
    pp: int
    runtime: str
    partition: tuple[int, ...]
    mtp: str  # MTP_KEPT, MTP_DROPPED or MTP_ABSENT
    stages: tuple[StagePlan, ...]  # all pp stages, whether built in this run or not
    ranks: tuple[int, ...]  # stages to build in this run
    dropped: tuple[str, ...]  # tensors left out on purpose (--no-mtp)
    max_file_bytes: int
    max_header_bytes: int
    # A quantization method the schema does not know: its Linear modules went unchecked.
    unchecked: str | None = None

    @property
    def launch_env(self) -> str:
        return launch_env(self.runtime, list(self.partition))

    @property
    def selected(self) -> list[StagePlan]:
        return [self.stages[r] for r in self.ranks]


def make_plan(
    ckpt: Checkpoint,
    *,
    pp: int,
    runtime: str = "sglang",
    partition: list[int] | None = None,
    keep_mtp: bool = True,
    ranks: list[int] | None = None,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
) -> Plan:
    """Assign every tensor of ``ckpt`` to stages and lay out each stage's files. Pure: no I/O.

    Args:
        ckpt: the checkpoint, from :func:`read_checkpoint`.
        pp: number of pipeline stages.
        runtime: ``"sglang"`` or ``"vllm"``, the server whose split and placement rules apply.
        partition: decoder layers per stage (default: the runtime's own split).
        keep_mtp: False leaves the ``mtp.*`` tensors out (recorded in the manifests).
        ranks: the stages to write (default: all); the plan still describes every stage.
        max_file_bytes: largest output data file.
        max_header_bytes: largest safetensors header of an output file.

    Returns:
        The :class:`Plan`: every stage's files, each tensor's source and offset, and the
        ``launch_env`` that starts the servers with this split.

    Raises:
        ReshardError: a tensor no rule places, layer ids that are not exactly 0..num_layers-1,
            a tensor the config requires that is missing or has another shape (see ``schema``),
            a split that does not fit the model, or one the runtime cannot serve (any stage of
            it, selected by ``ranks`` or not: see ``model.runtimes.servable``).

    Example:
        >>> from qwen35_reshard import make_plan, read_checkpoint
        >>> plan = make_plan(read_checkpoint(MODEL), pp=2, runtime="vllm")
        >>> plan.partition, plan.launch_env
        ((4, 4), 'VLLM_PP_LAYER_PARTITION=4,4')
    """
    check_pp(ckpt.num_layers, pp)
    check_runtime(runtime)
    if partition is None:
        sizes = default_partition(ckpt.num_layers, pp, runtime)
    else:
        sizes = list(partition)
        check_partition(sizes, pp=pp, num_layers=ckpt.num_layers)
    ranges = layer_ranges(sizes)
    ranks = sorted(set(ranks)) if ranks is not None else list(range(pp))
    for r in ranks:
        if not 0 <= r < pp:
            raise ReshardError(
                f"{param('ranks', r)} is out of range for {param('pp', pp)} (0..{pp - 1})"
            )

    # What follows runs for every tensor (~190,000 for a 397B FP8 checkpoint): it works on
    # whole columns (map, slices, list equality), and per role key (the name prefix that
    # decides a role: a few hundred) or per run of one key, not per tensor.
    tensor_names, sources = list(ckpt.tensors), list(ckpt.tensors.values())
    keys, roles = names.classify_all(tensor_names)
    check_roles(tensor_names, keys, roles, ckpt.num_layers)
    required = schema.required_tensors(ckpt.config, ckpt.tensors, quant_side=ckpt.quant_side)
    schema.check_complete(required, ckpt.tensors, str(ckpt.root))
    # After the checks above, so that a config that does not match the weights is told as such.
    check_servable(runtime, schema.layer_types(ckpt.config), sizes, default=partition is None)
    kinds = {r.kind for r in roles.values()}
    mtp = MTP_ABSENT if names.MTP not in kinds else MTP_KEPT if keep_mtp else MTP_DROPPED
    place = placement_rules(pp, runtime, ckpt.tied_embeddings, mtp == MTP_KEPT)

    # Where each key's tensors go: its stage for a decoder layer's, else its role's kind.
    layer_stage = [r for r, (start, end) in enumerate(ranges) for _ in range(start, end)]
    goes = {k: layer_stage[r.layer] if r.kind == names.LAYER else r.kind for k, r in roles.items()}
    placed_kinds = kinds - {names.LAYER} - ({names.MTP} if mtp == MTP_DROPPED else set())
    replicated = dict.fromkeys(range(pp), False) | {k: len(place[k]) > 1 for k in placed_kinds}
    runs = _key_runs(keys)
    per_stage: list[tuple[list[SourceTensor], list[bool]]] = []
    for r in range(pp):
        here = {r, *(k for k in placed_kinds if r in place[k])}
        taken = [(start, end) for key, start, end in runs if goes[key] in here]
        reps = [replicated[goes[key]] for key, _, _ in runs if goes[key] in here]
        per_stage.append((_spans(sources, taken), _spans_repeated(reps, taken)))
    dropped = (
        _spans(tensor_names, [(start, end) for key, start, end in runs if goes[key] == names.MTP])
        if mtp == MTP_DROPPED
        else []
    )
    extras = [
        tuple(k for k in _EXTRA_KINDS if k in kinds and r in place[k] and not (k == names.MTP and dropped))
        for r in range(pp)
    ]

    _check_file_limit(tensor_names, sources, max_file_bytes)
    file_order = {f: i for i, f in enumerate(ckpt.files)}
    file_tensors = Counter(map(_FILE, sources))
    whole_fits = {f for f in file_tensors if ckpt.file_sizes[f] <= max_file_bytes}
    stages = tuple(
        StagePlan(
            rank=r,
            start_layer=ranges[r][0],
            end_layer=ranges[r][1],
            extras=extras[r],
            files=_layout_files(
                *per_stage[r],
                file_order,
                file_tensors,
                whole_fits,
                max_file_bytes=max_file_bytes,
                max_header_bytes=max_header_bytes,
            ),
        )
        for r in range(pp)
    )
    return Plan(
        ckpt,
        pp,
        runtime,
        tuple(sizes),
        mtp,
        stages,
        tuple(ranks),
        tuple(dropped),
        max_file_bytes,
        max_header_bytes,
        required.unchecked,
    )


def _key_runs(keys: list[str]) -> list[tuple[str, int, int]]:
    """Each run of adjacent tensors of one role key: ``(key, start, end)``, in order.

    Why: a key's tensors are mostly adjacent in source order (a decoder layer's fill a shard
    or two), so runs number a few hundred where tensors number ~190,000 (a 397B FP8
    checkpoint): placing a stage's tensors run by run (``_spans``) copies slices in C, with a
    Python step per run, not per tensor.
    """
    runs: list[tuple[str, int, int]] = []
    start = 0
    for key, group in groupby(keys):
        end = start + len(list(group))
        runs.append((key, start, end))
        start = end
    return runs


def _spans(column: list, spans: list[tuple[int, int]]) -> list:
    """The items of ``column`` in each ``(start, end)`` of ``spans``, in order."""
    return list(chain.from_iterable(column[start:end] for start, end in spans))


def _spans_repeated(values: list, spans: list[tuple[int, int]]) -> list:
    """Each of ``values`` repeated over its span of ``spans``: a column of the spans' items."""
    return list(chain.from_iterable(map(repeat, values, (end - start for start, end in spans))))


def check_roles(
    tensor_names: list[str], keys: list[str], roles: dict[str, names.Role | None], num_layers: int
) -> None:
    """Every tensor has a role, and the decoder layers are exactly 0..num_layers-1.

    ``keys`` and ``roles`` are what ``names.classify_all`` says of ``tensor_names`` (checked
    per key; the tensors are searched only for the name to report).
    """
    unplaced = [k for k, r in roles.items() if r is None]
    if unplaced:
        name = tensor_names[keys.index(unplaced[0])]
        raise ReshardError(
            f"tensor {name!r}: no placement rule covers it (not a decoder layer, embed_tokens, "
            "norm, lm_head, mtp.* or model.visual.* tensor); refusing to drop or guess"
        )
    found = {r.layer for r in roles.values() if r.kind == names.LAYER}
    if found and max(found) >= num_layers:
        name, role = next(
            (n, roles[k])
            for n, k in zip(tensor_names, keys, strict=True)
            if (roles[k].layer or 0) >= num_layers
        )
        raise ReshardError(
            f"tensor {name!r}: layer {role.layer} is not below num_hidden_layers={num_layers} "
            "in config.json; the config and the weights do not match"
        )
    if len(found) < num_layers:
        # The ids found are all below num_layers, so the first one missing is at most
        # len(found): never walk num_layers itself, which a config can make 10**15.
        first = next(i for i in range(len(found) + 1) if i not in found)
        raise ReshardError(
            f"decoder layer {first} has no tensors ({num_layers - len(found)} of {num_layers} layers "
            "missing); the checkpoint is incomplete or config.json's num_hidden_layers is wrong"
        )


def _check_file_limit(tensor_names: list[str], sources: list[SourceTensor], max_file_bytes: int) -> None:
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
        raise ReshardError(
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


def _layout_files(
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
        header = (
            b""
            if layout == CLONE
            else encode_header(
                [(s.name, s.dtype, s.shape, s.nbytes) for s in srcs], align=SHARE_ALIGN, offset=start
            )
        )
        offsets = map(sub, map(_OFFSET, srcs), repeat(start))
        placed_tensors = tuple(make_tuples(PlacedTensor, zip(srcs, offsets, reps, strict=True)))
        files.append(OutputFile(name, header, placed_tensors, layout, file))
    for name, group in zip(names[len(shared) :], gathered, strict=True):
        hdr = encode_header([(s.name, s.dtype, s.shape, s.nbytes) for s, _ in group])
        offsets, pos = [], 0
        for s, _ in group:
            offsets.append(pos)
            pos += s.nbytes
        tensors = tuple(PlacedTensor(s, off, rep) for (s, rep), off in zip(group, offsets, strict=True))
        files.append(OutputFile(name, hdr, tensors))
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
