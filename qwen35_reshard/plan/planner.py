"""The plan: which source tensor goes to which stage, file and offset. Pure, no I/O.

Placement follows the target server's rules (see ``model.runtimes``): decoder layer i goes to the
stage whose layer range holds it; embed_tokens, norm, lm_head, mtp.* and model.visual.* go
where the runtime builds them, replicated on purpose where it builds them on several ranks.

A stage's files are laid out by :mod:`.layout`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain, groupby, repeat
from typing import NamedTuple

from ..bulk import field_getters
from ..errors import BadInput, param
from ..format.names import GATHERED, MTP_ABSENT, MTP_DROPPED, MTP_KEPT, stage_dirname
from ..model import names, schema
from ..model.parallelism import Parallelism, layout_of
from ..model.runtimes import check_pp, check_servable, launch_env, layer_ranges, placement_rules
from ..source.checkpoint import Checkpoint, SourceTensor
from .layout import OutputFile, PlacedTensor, check_file_limit, layout_files
from .nodedirs import NodeExperts, node_dirs

DEFAULT_MAX_FILE_BYTES = 5 * 1024**3
# The Hub reads remote headers only up to 25 MB; stay well below with room for long names.
DEFAULT_MAX_HEADER_BYTES = 16 * 1024**2

# Getters of a SourceTensor's file and of a PlacedTensor's source (see bulk.field_getters).
(_FILE,) = field_getters(SourceTensor, "file")
(_SOURCE,) = field_getters(PlacedTensor, "source")
# Non-layer roles, in the order reports list them.
_EXTRA_KINDS = (names.EMBED, names.VISUAL, names.VISUAL_POS_EMBED, names.NORM, names.LM_HEAD, names.MTP)


@dataclass(frozen=True)
class StagePlan:
    """What one directory of the split holds: a pipeline stage's, or (expert parallelism) one
    node's of a stage (``node``)."""

    rank: int  # its index in the plan: the pipeline rank, or the node's (stage * nodes + node)
    start_layer: int
    end_layer: int  # exclusive
    files: tuple[OutputFile, ...]
    extras: tuple[str, ...] = ()  # non-layer roles it holds (embed, visual, norm, lm_head, mtp)
    node: NodeExperts | None = None  # expert parallelism: the node, its EP ranks and experts

    @property
    def stage(self) -> int:
        """Its pipeline rank."""
        return self.rank if self.node is None else self.node.stage

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
        return stage_dirname(self.rank) if self.node is None else self.node.dirname


@dataclass(frozen=True)
class Plan:
    """The whole split: every stage's layout, and what was left out on purpose."""

    checkpoint: Checkpoint
    layout: Parallelism  # its partition the layers per stage planned (a tuple)
    mtp: str  # MTP_KEPT, MTP_DROPPED or MTP_ABSENT
    stages: tuple[StagePlan, ...]  # every directory (pp stages, or pp * nodes nodes), built now or not
    ranks: tuple[int, ...]  # the directories to build in this run
    dropped: tuple[str, ...]  # tensors left out on purpose (--no-mtp)
    max_file_bytes: int
    max_header_bytes: int
    # A quantization method the schema does not know: its Linear modules went unchecked.
    unchecked: str | None = None

    @property
    def pp(self) -> int:
        return self.layout.pp

    @property
    def runtime(self) -> str:
        return self.layout.runtime

    @property
    def partition(self) -> tuple[int, ...]:
        return self.layout.partition  # type: ignore[return-value]

    @property
    def launch_env(self) -> str:
        return launch_env(self.runtime, list(self.partition))

    @property
    def selected(self) -> list[StagePlan]:
        return [self.stages[r] for r in self.ranks]


def make_plan(
    ckpt: Checkpoint,
    layout: Parallelism | None = None,
    *,
    pp: int | None = None,
    runtime: str | None = None,
    partition: Sequence[int] | str | None = None,
    keep_mtp: bool = True,
    ranks: list[int] | None = None,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
) -> Plan:
    """Assign every tensor of ``ckpt`` to stages and lay out each stage's files. Pure: no I/O.

    Args:
        ckpt: the checkpoint, from :func:`read_checkpoint`.
        layout: the :class:`~qwen35_reshard.model.parallelism.Parallelism` to split for; or
            build it from ``pp``, ``runtime`` and ``partition`` (not both).
        pp: number of pipeline stages.
        runtime: ``"sglang"`` (default) or ``"vllm"``, the server whose split and placement rules apply.
        partition: decoder layers per stage (default: the runtime's own split).
        keep_mtp: False leaves the ``mtp.*`` tensors out (recorded in the manifests).
        ranks: the stages to write (default: all); under expert parallelism the node
            directories, by the servers' node rank (``stage * nodes + node``). The plan still
            describes every directory.
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
    layout = layout_of(layout, pp=pp, runtime=runtime, partition=partition)
    wide = layout.expert_parallel
    placed = _place(
        ckpt, layout, keep_mtp=keep_mtp, ranks=None if wide else ranks, stages=range(layout.pp),
        max_file_bytes=max_file_bytes,
    )  # fmt: skip
    file_order = {f: i for i, f in enumerate(ckpt.files)}
    file_tensors = Counter(map(_FILE, ckpt.tensors.values()))
    whole_fits = {f for f in file_tensors if ckpt.file_sizes[f] <= max_file_bytes}
    if wide:
        dirs = node_dirs(ckpt, layout, {r: sources for r, (sources, _) in placed.tensors.items()})
        selected = _node_ranks(ranks, layout)
    else:
        dirs = [(None, *placed.tensors[r]) for r in range(layout.pp)]
        selected = placed.ranks
    stages = []
    for index, (node, sources, replicated) in enumerate(dirs):
        r = index if node is None else node.stage
        # A shard is cloned whole only where its tensors are the source's own, none cut per expert.
        cut = {t.file for t in sources if ckpt.tensors.get(t.name) is not t} if wide else set()
        whole = whole_fits - cut
        files = layout_files(
            sources, replicated, file_order, file_tensors, whole,
            max_file_bytes=max_file_bytes, max_header_bytes=max_header_bytes,
        )  # fmt: skip
        stages.append(StagePlan(index, *placed.ranges[r], files, placed.extras[r], node))
    return Plan(
        ckpt,
        layout.with_partition(placed.partition),
        placed.mtp,
        tuple(stages),
        selected,
        placed.dropped,
        max_file_bytes,
        max_header_bytes,
        placed.unchecked,
    )


def _node_ranks(ranks: list[int] | None, layout: Parallelism) -> tuple[int, ...]:
    """The node directories to build: ``ranks`` (by the servers' node rank), default all."""
    count = layout.nnodes
    for r in ranks or ():
        if not 0 <= r < count:
            raise BadInput(
                f"{param('node', r)} is not a node of {param('pp', layout.pp)} x "
                f"{param('nodes', layout.nodes)} ({count} nodes: 0 to {count - 1})"
            )
    return tuple(sorted(set(ranks))) if ranks is not None else tuple(range(count))


def stage_tensors(
    ckpt: Checkpoint,
    layout: Parallelism,
    *,
    rank: int,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
) -> StageTensors:
    """The source tensors of stage ``rank`` of the split :func:`make_plan` makes with these
    settings (MTP kept), in source order, after the same checks, without laying out any stage's
    files: what a server rank reading its stage in place from the source needs.

    Why apart from ``make_plan``: laying out every stage's files (their headers, a
    ``PlacedTensor`` per tensor) holds more than the checkpoint itself at the largest shapes
    (~290,000 tensors), and a rank reading in place uses none of it.

    Args:
        ckpt: the checkpoint, from :func:`read_checkpoint`.
        layout: the layout of the split (its pipeline stages, runtime and partition).
        rank: the stage.
        max_file_bytes: checked as :func:`make_plan` checks it (a split of these settings exists).

    Returns:
        A :class:`StageTensors`: the sources of ``make_plan(...).stages[rank].tensors`` in source
        order, and the plan's ``mtp``.

    Raises:
        ReshardError: as :func:`make_plan`.

    Example:
        >>> from qwen35_reshard import read_checkpoint
        >>> from qwen35_reshard.model.parallelism import Parallelism
        >>> from qwen35_reshard.plan.planner import stage_tensors
        >>> layout = Parallelism(pp=2, runtime="vllm", partition=(4, 4))
        >>> placed = stage_tensors(read_checkpoint(MODEL), layout, rank=1)
        >>> len(placed.tensors), placed.mtp
        (134, 'kept')
    """
    placed = _place(
        ckpt, layout, keep_mtp=True, ranks=[rank], stages=[rank], max_file_bytes=max_file_bytes
    )
    return StageTensors(placed.tensors[rank][0], placed.mtp)


class StageTensors(NamedTuple):
    """One stage's source tensors, in source order, and the split's ``mtp`` (see :func:`stage_tensors`)."""

    tensors: list[SourceTensor]
    mtp: str  # MTP_KEPT or MTP_ABSENT


class _Placed(NamedTuple):
    """Which tensors each stage holds, before any file is laid out (see :func:`_place`)."""

    partition: tuple[int, ...]
    ranges: list[tuple[int, int]]
    ranks: tuple[int, ...]
    mtp: str
    tensors: dict[int, tuple[list[SourceTensor], list[bool]]]  # of the stages asked for
    dropped: tuple[str, ...]
    extras: list[tuple[str, ...]]
    unchecked: str | None


def _place(
    ckpt: Checkpoint,
    layout: Parallelism,
    *,
    keep_mtp: bool,
    ranks: list[int] | None,
    stages: Sequence[int],
    max_file_bytes: int,
) -> _Placed:
    """Check the split and the checkpoint, and place every tensor: the tensors of each of
    ``stages`` in source order, each with whether it is replicated (see :func:`make_plan`)."""
    pp, runtime = layout.pp, layout.runtime
    check_pp(ckpt.num_layers, pp)
    sizes = layout.sizes(ckpt.num_layers)
    ranges = layer_ranges(sizes)
    ranks = sorted(set(ranks)) if ranks is not None else list(range(pp))
    for r in ranks:
        if not 0 <= r < pp:
            raise BadInput(f"{param('ranks', r)} is out of range for {param('pp', pp)} (0..{pp - 1})")

    # What follows runs for every tensor (~190,000 for a 397B FP8 checkpoint): it works on
    # whole columns (map, slices, list equality), and per role key (the name prefix that
    # decides a role: a few hundred) or per run of one key, not per tensor.
    tensor_names, sources = list(ckpt.tensors), list(ckpt.tensors.values())
    keys, roles = names.classify_all(tensor_names)
    check_roles(tensor_names, keys, roles, ckpt.num_layers)
    required = schema.required_tensors(ckpt.config, ckpt.tensors, quant_side=ckpt.quant_side)
    schema.check_complete(required, ckpt.tensors, str(ckpt.root))
    unchecked = required.unchecked
    del required  # lists as long as the checkpoint: not held while the stages are placed
    # After the checks above, so that a config that does not match the weights is told as such.
    check_servable(runtime, schema.layer_types(ckpt.config), sizes, default=layout.partition is None)
    kinds = {r.kind for r in roles.values()}
    mtp = MTP_ABSENT if names.MTP not in kinds else MTP_KEPT if keep_mtp else MTP_DROPPED
    place = placement_rules(pp, runtime, ckpt.tied_embeddings, mtp == MTP_KEPT)

    # Where each key's tensors go: its stage for a decoder layer's, else its role's kind.
    layer_stage = [r for r, (start, end) in enumerate(ranges) for _ in range(start, end)]
    goes = {k: layer_stage[r.layer] if r.kind == names.LAYER else r.kind for k, r in roles.items()}
    placed_kinds = kinds - {names.LAYER} - ({names.MTP} if mtp == MTP_DROPPED else set())
    replicated = dict.fromkeys(range(pp), False) | {k: len(place[k]) > 1 for k in placed_kinds}
    runs = _key_runs(keys)
    per_stage: dict[int, tuple[list[SourceTensor], list[bool]]] = {}
    for r in stages:
        here = {r, *(k for k in placed_kinds if r in place[k])}
        taken = [(start, end) for key, start, end in runs if goes[key] in here]
        reps = [replicated[goes[key]] for key, _, _ in runs if goes[key] in here]
        per_stage[r] = (_spans(sources, taken), _spans_repeated(reps, taken))
    dropped = (
        _spans(tensor_names, [(start, end) for key, start, end in runs if goes[key] == names.MTP])
        if mtp == MTP_DROPPED
        else []
    )
    extras = [
        tuple(k for k in _EXTRA_KINDS if k in kinds and r in place[k] and not (k == names.MTP and dropped))
        for r in range(pp)
    ]
    check_file_limit(tensor_names, sources, max_file_bytes)
    return _Placed(tuple(sizes), ranges, tuple(ranks), mtp, per_stage, tuple(dropped), extras, unchecked)


def recorded_plan(
    ckpt: Checkpoint,
    layout: Parallelism,
    *,
    mtp: str,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
) -> Plan:
    """The plan of ``ckpt`` that a split's recorded settings (its manifests' layout, ``mtp`` and
    file limits) give: what ``verify`` compares with, and what a repair
    rewrites from. Raises ReshardError when they do not fit ``ckpt``."""
    return make_plan(
        ckpt,
        layout,
        keep_mtp=mtp != MTP_DROPPED,
        max_file_bytes=max_file_bytes,
        max_header_bytes=max_header_bytes,
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
        raise BadInput(
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
        raise BadInput(
            f"tensor {name!r}: layer {role.layer} is not below num_hidden_layers={num_layers} "
            "in config.json; the config and the weights do not match"
        )
    if len(found) < num_layers:
        # The ids found are all below num_layers, so the first one missing is at most
        # len(found): never walk num_layers itself, which a config can make 10**15.
        first = next(i for i in range(len(found) + 1) if i not in found)
        raise BadInput(
            f"decoder layer {first} has no tensors ({num_layers - len(found)} of {num_layers} layers "
            "missing); the checkpoint is incomplete or config.json's num_hidden_layers is wrong"
        )
