"""A node's routed-expert tensors under expert parallelism: fused 3-D experts exploded into
per-expert tensors named by global id, each a byte range of the source tensor, and per-expert
tensors kept or dropped by the node's experts. Pure: source tensors in, source tensors out.

Why per-expert, never a cut fused tensor: both servers read position ``i`` of a fused
``experts.gate_up_proj`` / ``experts.down_proj`` as global expert ``i``, and load per-expert
``experts.{e}.{gate,up,down}_proj.*`` by global id, skipping the experts that are not local
(../shared/docs/expert-parallel-facts.md, 0.1). A fused tensor is row-major, so expert ``e`` is one
contiguous run: ``gate_up_proj[e]`` ``[2I, H]`` holds gate (its first ``I`` rows, what both
loaders' ``chunk(2, dim=-2)`` takes first) then up; ``down_proj[e]`` is ``[H, I]``. The exploded
tensors are sub-ranges of the source's bytes, so the writer copies them unchanged.

What a node keeps of a MoE layer's experts: the weight-carrying tensor (``weight``,
``weight_packed``, ``qweight``: the packed weight, first of every set in model/quant/schemes.py)
of its own experts only; every other tensor (scales, zero points, ``g_idx``, global and input
scales) of every expert, because some servers reduce over all experts' scales (NVFP4's global
max over input scales, vLLM #37322) and they are small. vLLM's own EP weight filter keeps the
same ones.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from collections.abc import Set as AbstractSet
from itertools import chain

from ..errors import BadInput
from ..model.experts import EXPERTS, ExpertTensor, MoeLayer, expert_tensors
from ..model.modules import EXPERT, FUSED_EXPERTS
from ..model.schema import SCALE_SUFFIX
from ..source.checkpoint import SourceTensor

_GATE_UP, _DOWN = tuple(FUSED_EXPERTS)  # "gate_up_proj", "down_proj"
_GATE, _UP, _DOWN_PROJ = tuple(EXPERT)  # "gate_proj", "up_proj", "down_proj"


def node_expert_tensors(
    tensors: Iterable[SourceTensor],
    experts_of: Callable[[MoeLayer], AbstractSet[int]],
    *,
    scale_block: int | None = None,
) -> list[SourceTensor]:
    """The tensors a node writes for these (a stage's), in their order: fused experts exploded
    into per-expert tensors by global id; packed weights of experts not in ``experts_of(layer)``
    dropped; every other tensor as it is. For several nodes of one stage,
    :func:`nodes_expert_tensors` reads the names once.

    Args:
        tensors: source tensors (a stage's, or the whole checkpoint's).
        experts_of: the node's logical experts of a MoE layer, e.g.
            ``lambda layer: placement.node_experts(layer, node, nodes)``.
        scale_block: rows of one block FP8 scale block (``weight_block_size[0]`` of the
            quantization config); needed only for fused ``_scale_inv`` tensors.

    Returns:
        The node's tensors; an exploded one has the source's file and dtype, and ``offset`` /
        ``nbytes`` within the source tensor's bytes.

    Raises:
        BadInput: a fused tensor whose shape or bytes cannot be cut per expert.

    Example:
        >>> from qwen35_reshard.source.checkpoint import SourceTensor
        >>> fused = SourceTensor("model.layers.0.mlp.experts.down_proj", "a.safetensors", "BF16",
        ...                      (4, 8, 2), 1000, 4 * 8 * 2 * 2)
        >>> [(t.name, t.shape, t.offset) for t in node_expert_tensors([fused], lambda layer: {1, 3})]
        [('model.layers.0.mlp.experts.1.down_proj.weight', (8, 2), 1032), \
('model.layers.0.mlp.experts.3.down_proj.weight', (8, 2), 1096)]
    """
    return nodes_expert_tensors(tensors, [experts_of], scale_block=scale_block)[0]


def nodes_expert_tensors(
    tensors: Iterable[SourceTensor],
    experts_of_nodes: Sequence[Callable[[MoeLayer], AbstractSet[int]]],
    *,
    scale_block: int | None = None,
    parsed: Sequence[ExpertTensor | None] | None = None,
) -> list[list[SourceTensor]]:
    """:func:`node_expert_tensors` for each node of ``experts_of_nodes`` (one function per node),
    the names parsed and grouped once: a node then costs about its own tensors (~190,000
    names per stage of a 397B FP8 split, parsed once rather than per node).

    Args:
        tensors: source tensors (a stage's), in their order.
        experts_of_nodes: per node, its logical experts of a MoE layer.
        scale_block: as :func:`node_expert_tensors`.
        parsed: :func:`~qwen35_reshard.model.experts.expert_tensors` of ``tensors``' names, when
            the caller has them already (0.3 s for the 189,042 names of the 397B FP8 shape).

    Returns:
        Per node, in the order of ``experts_of_nodes``, its tensors as :func:`node_expert_tensors`.

    Raises:
        BadInput: as :func:`node_expert_tensors`.

    Example:
        >>> from qwen35_reshard.source.checkpoint import SourceTensor
        >>> fused = SourceTensor("model.layers.0.mlp.experts.down_proj", "a.safetensors", "BF16",
        ...                      (4, 8, 2), 1000, 4 * 8 * 2 * 2)
        >>> nodes = nodes_expert_tensors([fused], [lambda layer: {0, 1}, lambda layer: {2, 3}])
        >>> [[t.name.split("experts.")[1] for t in node] for node in nodes]
        [['0.down_proj.weight', '1.down_proj.weight'], ['2.down_proj.weight', '3.down_proj.weight']]
    """
    tensors = list(tensors)
    if parsed is None:
        parsed = expert_tensors([t.name for t in tensors])
    elif len(parsed) != len(tensors):
        raise ValueError(f"parsed has {len(parsed)} entries for {len(tensors)} tensors")
    always: list[int] = []  # every node's: other tensors, every expert's scales
    fused: list[int] = []
    own: dict[MoeLayer, dict[int, list[int]]] = {}  # packed weights by layer, then expert
    heavy: dict[str, bool] = {}  # by part, decided once
    for i, what in enumerate(parsed):
        if what is None:
            always.append(i)
        elif what.expert is None:
            fused.append(i)
        else:
            if what.part not in heavy:
                heavy[what.part] = what.heavy
            if heavy[what.part]:
                own.setdefault(what.layer, {}).setdefault(what.expert, []).append(i)
            else:
                always.append(i)
    names = {tensors[i].name: tensors[i] for i in fused}  # a fused scale's weight
    layers = {*own, *(parsed[i].layer for i in fused)}
    out = []
    for experts_of in experts_of_nodes:
        local = {layer: experts_of(layer) for layer in layers}
        keep = always + [i for layer, by in own.items() for e in local[layer] for i in by.get(e, ())]
        if not fused:
            keep.sort()
            out.append([tensors[i] for i in keep])
            continue
        cut = {}
        for i in fused:
            t, what = tensors[i], parsed[i]
            if what.part.endswith(SCALE_SUFFIX):
                weight = names.get(t.name.removesuffix(SCALE_SUFFIX))
                cut[i] = explode(
                    t, range(t.shape[0]) if t.shape else (), scale_block=scale_block, weight=weight
                )
            else:
                cut[i] = explode(t, sorted(local[what.layer]))
        order = sorted(keep + fused)
        out.append(list(chain.from_iterable(cut[i] if i in cut else (tensors[i],) for i in order)))
    return out


def explode(
    tensor: SourceTensor,
    experts: Iterable[int],
    *,
    scale_block: int | None = None,
    weight: SourceTensor | None = None,
) -> list[SourceTensor]:
    """Per-expert tensors of ``experts`` cut from fused ``tensor``, each a byte range of it.

    ``gate_up_proj`` ``[E, 2I, H]`` gives ``experts.{e}.gate_proj.weight`` ``[I, H]`` (rows
    ``:I`` of expert ``e``) and ``up_proj.weight`` (rows ``I:``); ``down_proj`` ``[E, H, I]``
    gives ``experts.{e}.down_proj.weight``. A block FP8 ``_scale_inv`` ``[E, S, T]`` gives
    ``weight_scale_inv`` tensors the same way, which needs its ``weight`` (the fused tensor it
    scales) and ``scale_block`` (rows per block) to dividing ``I``: a block straddling gate and
    up cannot be cut.

    Args:
        tensor: a fused ``experts.gate_up_proj`` / ``experts.down_proj`` (``_scale_inv``) tensor.
        experts: the global expert ids to cut, in the order wanted.
        scale_block: rows of one scale block; needed for a fused ``gate_up_proj_scale_inv``.
        weight: the fused weight a ``gate_up_proj_scale_inv`` scales.

    Returns:
        Per expert, its projections (gate then up, or down) as source tensors: the fused
        tensor's file and dtype, each a byte range of it.

    Raises:
        BadInput: a shape that is not ``[experts, rows, columns]``, an expert out of range, or
            gate and up halves that cannot be cut apart.

    Example:
        >>> from qwen35_reshard.source.checkpoint import SourceTensor
        >>> t = SourceTensor("model.layers.0.mlp.experts.gate_up_proj", "a.safetensors", "BF16",
        ...                  (2, 4, 3), 0, 2 * 4 * 3 * 2)
        >>> [(x.name.split("experts.")[1], x.shape, x.offset, x.nbytes) for x in explode(t, [1])]
        [('1.gate_proj.weight', (2, 3), 24, 12), ('1.up_proj.weight', (2, 3), 36, 12)]
    """
    prefix, _, part = tensor.name.rpartition(EXPERTS)
    base = part.removesuffix(SCALE_SUFFIX)
    suffix = "weight_scale_inv" if part != base else "weight"
    if len(tensor.shape) != 3 or tensor.shape[0] < 1 or tensor.nbytes % tensor.shape[0]:
        raise BadInput(
            f"tensor {tensor.name!r}: shape {list(tensor.shape)} with {tensor.nbytes} bytes is not "
            "[experts, rows, columns]; cannot cut it per expert"
        )
    num, rows = tensor.shape[0], tensor.shape[1]
    per = tensor.nbytes // num
    if base == _DOWN:
        pieces = [(_DOWN_PROJ, 0, rows)]
    else:
        half = rows // 2
        problem = "an odd number of rows" if rows % 2 else None
        if problem is None and part != base:
            problem = _scale_problem(tensor, weight, scale_block)
        if problem:
            raise BadInput(
                f"tensor {tensor.name!r}: {problem}, so its gate and up halves cannot be cut apart per expert"
            )
        pieces = [(_GATE, 0, half), (_UP, half, half)]
    row_bytes = per // rows if rows else 0
    out = []
    for e in experts:
        if not 0 <= e < num:
            raise BadInput(f"tensor {tensor.name!r}: expert {e} is not in its {num} experts")
        start = tensor.offset + e * per
        for proj, first, count in pieces:
            out.append(
                SourceTensor(
                    f"{prefix}{EXPERTS}{e}.{proj}.{suffix}",
                    tensor.file,
                    tensor.dtype,
                    (count, *tensor.shape[2:]),
                    start + first * row_bytes,
                    count * row_bytes,
                )
            )
    return out


def _scale_problem(scale: SourceTensor, weight: SourceTensor | None, block: int | None) -> str | None:
    """Why fused gate_up scale rows do not split into gate's and up's, or None: every block
    must lie in one half."""
    if weight is None or len(weight.shape) != 3 or weight.shape[1] % 2:
        return "the fused weight it scales is missing or not [experts, 2 x intermediate, hidden]"
    if block is None or block < 1:
        return "no scale_block (the quantization config's weight_block_size) was given"
    intermediate = weight.shape[1] // 2
    if intermediate % block:
        return f"a {block}-row scale block straddles gate and up (intermediate size {intermediate})"
    if scale.shape[1] != 2 * intermediate // block:
        return f"it has {scale.shape[1]} scale rows per expert, not {2 * intermediate // block}"
    return None
