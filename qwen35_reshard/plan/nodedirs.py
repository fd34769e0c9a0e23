"""An expert-parallel split's directories: one per node (issue 42). Pure, no I/O.

Node ``k`` of pipeline stage ``r`` (``OUT/pp{r}-node{k}``, ``OUT/node{k}`` without PP) holds
every tensor of its stage that is no routed expert (as a pipeline stage does), every expert's
scales (small; some servers reduce over all of them), and for each MoE layer of the stage, MTP's
included, exactly the logical experts its EP ranks start with under the server's placement
(:mod:`qwen35_reshard.model.experts`), as per-expert tensors by global id whose bytes are
ranges of the source's (:mod:`.experts`). Directories are numbered as the servers number nodes:
``r * nodes + k`` (the servers' ``--node-rank`` with ``--nnodes pp * nodes``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import BadInput, param
from ..format.names import node_dirname
from ..model import schema
from ..model.experts import ExpertPlacement, MoeLayer, expert_placement, expert_tensors
from ..model.parallelism import Parallelism
from ..source.checkpoint import Checkpoint, SourceTensor
from .experts import nodes_expert_tensors


@dataclass(frozen=True)
class NodeExperts:
    """What makes a directory a node's: its stage, its place in the stage's EP group, its experts.

    Attributes:
        stage: the pipeline rank of the node's stage.
        node: the node within the stage, 0 to ``nodes - 1``.
        dirname: ``pp{stage}-node{node}``, or ``node{node}`` without pipeline parallelism.
        ep_ranks: the EP ranks it hosts.
        experts: per MoE layer of the stage, in layer order, the logical experts it holds:
            ``(label, ids)``, the label ``layers.N`` or ``mtp.layers.K``.
    """

    stage: int
    node: int
    dirname: str
    ep_ranks: range
    experts: tuple[tuple[str, tuple[int, ...]], ...]

    def to_dict(self) -> dict:
        """Plain JSON-ready data: node, EP ranks and experts by layer."""
        return {
            "node": self.node,
            "ep_ranks": list(self.ep_ranks),
            "experts": {label: list(ids) for label, ids in self.experts},
        }


def layer_label(layer: MoeLayer) -> str:
    """``layers.N`` for decoder layer N, ``mtp.layers.K`` for MTP layer K (as a manifest records them).

    Args:
        layer: a MoE layer.

    Returns:
        Its label.

    Example:
        >>> layer_label(MoeLayer(0, mtp=True))
        'mtp.layers.0'
    """
    return f"mtp.layers.{layer.index}" if layer.mtp else f"layers.{layer.index}"


def placement_of(ckpt: Checkpoint, layout: Parallelism) -> ExpertPlacement:
    """The server's placement of ``layout``'s EP group over ``ckpt``'s routed experts.

    Args:
        ckpt: the checkpoint (its config gives ``num_experts`` and the layer count).
        layout: the layout (runtime, ``ep``, redundant experts, SGLang's expert location).

    Returns:
        The :class:`~qwen35_reshard.model.experts.ExpertPlacement`.

    Raises:
        BadInput: a model without routed experts, or a layout the server refuses (naming
            ``ep``, ``redundant_experts`` or ``init_expert_location``).
    """
    experts = schema.text_config(ckpt.config).get("num_experts")
    if not isinstance(experts, int) or isinstance(experts, bool) or experts < 1:
        raise BadInput(
            f"{param('ep', layout.ep)}: {ckpt.display}/config.json gives no routed experts (num_experts); "
            f"expert parallelism needs a MoE model: drop {param('ep')}"
        )
    return expert_placement(
        layout.runtime,
        num_experts=experts,
        ep=layout.ep,
        redundant=layout.redundant_experts,
        location=layout.init_expert_location,
        num_layers=ckpt.num_layers,
    )


def node_dirs(
    ckpt: Checkpoint, layout: Parallelism, stage_tensors: Mapping[int, list[SourceTensor]]
) -> list[tuple[NodeExperts, list[SourceTensor], list[bool]]]:
    """Every node directory of the split, in the servers' node order: what it is, its tensors in
    source order, and whether each is also in another directory (replicated on purpose).

    Args:
        ckpt: the checkpoint.
        layout: an expert-parallel layout.
        stage_tensors: every pipeline stage's tensors, in source order (the planner's placement).

    Returns:
        Per node directory: its :class:`NodeExperts`, its tensors (fused experts cut per
        expert), and for each tensor whether another directory holds it too.

    Raises:
        BadInput: as :func:`placement_of`, and a fused expert tensor that cannot be cut per expert.

    Example:
        >>> from qwen35_reshard import Parallelism, read_checkpoint
        >>> from qwen35_reshard.plan.planner import stage_tensors
        >>> ckpt = read_checkpoint(MODEL)
        >>> layout = Parallelism(pp=1, ep=4, nodes=2)
        >>> dirs = node_dirs(ckpt, layout, {0: stage_tensors(ckpt, Parallelism(pp=1), rank=0).tensors})
        >>> [(what.dirname, list(what.ep_ranks), dict(what.experts)["layers.0"]) for what, _, _ in dirs]
        [('node0', [0, 1], (0, 1)), ('node1', [2, 3], (2, 3))]
    """
    placement = placement_of(ckpt, layout)
    block = _scale_block(ckpt.config)
    dirs = []
    for stage in range(layout.pp):
        sources = stage_tensors[stage]
        parsed = expert_tensors([t.name for t in sources])  # once per stage, for all its nodes
        found = {w.layer for w in parsed if w is not None}
        layers = sorted(found, key=lambda m: (m.mtp, m.index))  # decoder layers, then MTP's
        held = [
            {m: placement.node_experts(m, node, layout.nodes) for m in layers} for node in range(layout.nodes)
        ]
        experts_of = [experts.__getitem__ for experts in held]
        cut = nodes_expert_tensors(sources, experts_of, scale_block=block, parsed=parsed)
        for node, (experts, tensors) in enumerate(zip(held, cut, strict=True)):
            what = NodeExperts(
                stage,
                node,
                node_dirname(stage, node, layout.pp),
                layout.node_ep_ranks(node),
                tuple((layer_label(m), tuple(sorted(experts[m]))) for m in layers),
            )
            dirs.append((what, tensors))
    copies = Counter(t.name for _, tensors in dirs for t in tensors)
    return [(what, tensors, [copies[t.name] > 1 for t in tensors]) for what, tensors in dirs]


def _scale_block(config: Mapping) -> int | None:
    """Rows of one block FP8 scale block (``weight_block_size[0]``), to cut fused scales per expert."""
    q = config.get("quantization_config") or schema.text_config(config).get("quantization_config")
    block = q.get("weight_block_size") if isinstance(q, dict) else None
    return block[0] if isinstance(block, list) and block and isinstance(block[0], int) else None
