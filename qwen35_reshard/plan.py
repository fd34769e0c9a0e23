"""The plan: which source tensor goes to which stage, file and offset. Pure, no I/O.

Placement follows the target server's rules (see the facts doc): decoder layer i goes to the
stage whose layer range holds it; embed_tokens, norm, lm_head, mtp.* and model.visual.* go
where the runtime builds them, replicated on purpose where it builds them on several ranks.
Inside a stage, tensors keep their source order (grouped by dtype alignment first, as the
reference writer does), so runs that are adjacent in a source shard stay one copy.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from . import names, schema
from .errors import ReshardError
from .header import DTYPE_SIZES, encode_header
from .source import Checkpoint, SourceTensor
from .split import (
    check_partition,
    check_pp,
    check_runtime,
    default_partition,
    launch_env,
    layer_ranges,
    placement_rules,
)

DEFAULT_MAX_FILE_BYTES = 5 * 1024**3
# The Hub reads remote headers only up to 25 MB; stay well below with room for long names.
DEFAULT_MAX_HEADER_BYTES = 16 * 1024**2

MTP_KEPT, MTP_DROPPED, MTP_ABSENT = "kept", "dropped", "absent"


@dataclass(frozen=True)
class PlacedTensor:
    """A source tensor as it lands in one output file, at ``out_offset`` of its data buffer."""

    source: SourceTensor
    out_offset: int
    replicated: bool  # also placed on other stages, on purpose

    @property
    def name(self) -> str:
        return self.source.name


@dataclass(frozen=True)
class OutputFile:
    """One safetensors file of a stage: its exact header bytes and tensors in data order."""

    name: str
    header: bytes
    tensors: tuple[PlacedTensor, ...]

    @property
    def data_bytes(self) -> int:
        return sum(t.source.nbytes for t in self.tensors)

    @property
    def size(self) -> int:
        return len(self.header) + self.data_bytes


@dataclass(frozen=True)
class StagePlan:
    """What one pipeline stage's directory holds."""

    rank: int
    start_layer: int
    end_layer: int  # exclusive
    files: tuple[OutputFile, ...]

    @property
    def tensors(self) -> list[PlacedTensor]:
        return [t for f in self.files for t in f.tensors]

    @property
    def data_bytes(self) -> int:
        return sum(f.data_bytes for f in self.files)

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def source_files(self) -> list[str]:
        return sorted({t.source.file for t in self.tensors})

    @property
    def dirname(self) -> str:
        return f"pp{self.rank}"


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
    """Assign every tensor of ``ckpt`` to stages and lay out each stage's files.

    Raises ReshardError for a tensor no rule places, layer ids that are not exactly
    0..num_layers-1, a tensor the config requires that is missing or has another shape (see
    ``schema``), or a split that does not fit the model.
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
            raise ReshardError(f"--rank {r} is out of range for --pp {pp} (0..{pp - 1})")

    roles = {n: _role(n, ckpt.num_layers) for n in ckpt.tensors}
    _check_layers_present(roles, ckpt.num_layers)
    required = schema.required_tensors(ckpt.config, {n: t.dtype for n, t in ckpt.tensors.items()})
    schema.check_complete(required.tensors, {n: t.shape for n, t in ckpt.tensors.items()}, str(ckpt.root))
    has_mtp = any(r.kind == names.MTP for r in roles.values())
    mtp = MTP_ABSENT if not has_mtp else MTP_KEPT if keep_mtp else MTP_DROPPED
    rank_of_layer = [r for r, (start, end) in enumerate(ranges) for _ in range(start, end)]
    place = placement_rules(pp, runtime, ckpt.tied_embeddings, mtp == MTP_KEPT)

    per_stage: list[list[tuple[SourceTensor, bool]]] = [[] for _ in range(pp)]
    dropped = []
    for name, src in ckpt.tensors.items():
        role = roles[name]
        if role.kind == names.MTP and mtp == MTP_DROPPED:
            dropped.append(name)
            continue
        owners = (rank_of_layer[role.layer],) if role.kind == names.LAYER else place[role.kind]
        for r in owners:
            per_stage[r].append((src, len(owners) > 1))

    file_order = {f: i for i, f in enumerate(ckpt.files)}
    stages = tuple(
        StagePlan(
            rank=r,
            start_layer=ranges[r][0],
            end_layer=ranges[r][1],
            files=_layout_files(
                per_stage[r],
                file_order,
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
    )


def _role(name: str, num_layers: int) -> names.Role:
    role = names.classify(name)
    if role is None:
        raise ReshardError(
            f"tensor {name!r}: no placement rule covers it (not a decoder layer, embed_tokens, "
            "norm, lm_head, mtp.* or model.visual.* tensor); refusing to drop or guess"
        )
    if role.kind == names.LAYER and role.layer >= num_layers:
        raise ReshardError(
            f"tensor {name!r}: layer {role.layer} is not below num_hidden_layers={num_layers} "
            "in config.json; the config and the weights do not match"
        )
    return role


def _check_layers_present(roles: dict[str, names.Role], num_layers: int) -> None:
    found = {r.layer for r in roles.values() if r.kind == names.LAYER}
    missing = [i for i in range(num_layers) if i not in found]
    if missing:
        raise ReshardError(
            f"decoder layer {missing[0]} has no tensors ({len(missing)} of {num_layers} layers "
            "missing); the checkpoint is incomplete or config.json's num_hidden_layers is wrong"
        )


def _layout_files(
    placed: list[tuple[SourceTensor, bool]],
    file_order: dict[str, int],
    *,
    max_file_bytes: int,
    max_header_bytes: int,
) -> tuple[OutputFile, ...]:
    """Cut a stage's tensors into files, in (alignment, source file, source offset) order.

    Larger element sizes first keeps every tensor aligned to its element size, as in the
    reference writer; within that, source order keeps adjacent source runs adjacent.
    """
    if not placed:
        return ()
    placed = sorted(placed, key=lambda p: (-DTYPE_SIZES[p[0].dtype], file_order[p[0].file], p[0].offset))
    groups: list[list[tuple[SourceTensor, bool]]] = [[]]
    data = header = 0
    for item in placed:
        src = item[0]
        entry = _header_entry_bytes(src)
        if groups[-1] and (data + src.nbytes > max_file_bytes or header + entry > max_header_bytes):
            groups.append([])
            data = header = 0
        groups[-1].append(item)
        data += src.nbytes
        header += entry
    count = len(groups)
    files = []
    for k, group in enumerate(groups, start=1):
        hdr = encode_header([(s.name, s.dtype, s.shape, s.nbytes) for s, _ in group])
        offsets, pos = [], 0
        for s, _ in group:
            offsets.append(pos)
            pos += s.nbytes
        files.append(
            OutputFile(
                name=f"model-{k:05d}-of-{count:05d}.safetensors",
                header=hdr,
                tensors=tuple(
                    PlacedTensor(s, off, rep) for (s, rep), off in zip(group, offsets, strict=True)
                ),
            )
        )
    return tuple(files)


def _header_entry_bytes(src: SourceTensor) -> int:
    """Upper bound of the bytes ``src`` adds to a header, for cutting files before the limit."""
    name = src.name
    # Same value as len(json.dumps(name)) + len(json.dumps(list(shape))), without json for
    # the common plain-ASCII name: this runs for every tensor.
    plain = name.isascii() and name.isprintable() and '"' not in name and "\\" not in name
    return (len(name) + 2 if plain else len(json.dumps(name))) + len(str(list(src.shape))) + 80
