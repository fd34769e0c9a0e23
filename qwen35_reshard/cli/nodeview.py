"""What the command line shows of an expert-parallel split (issue 42): each node directory's EP
ranks and experts in the plan table, and how each node is served."""

from __future__ import annotations

from ..plan.nodedirs import NodeExperts
from ..plan.planner import Plan


def experts_cell(node: NodeExperts) -> str:
    """The plan table's "experts" cell: the node's EP ranks and its experts per MoE layer
    (a range where they are one, else a count), e.g. ``ranks 2-3: 4-7``."""
    ranks = node.ep_ranks
    first = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"
    kinds = {ids for _, ids in node.experts}
    if len(kinds) != 1:
        held = f"{min(map(len, kinds))}-{max(map(len, kinds))} per layer"
    else:
        (ids,) = kinds
        contiguous = ids and list(ids) == list(range(ids[0], ids[0] + len(ids)))
        held = f"{ids[0]}-{ids[-1]}" if contiguous and len(ids) > 1 else f"{len(ids)} per layer"
    return f"{first}: {held}"


def title_layout(plan: Plan) -> str:
    """``ep=16 over 4 nodes per stage`` for the plan table's title ('' without expert parallelism)."""
    layout = plan.layout
    if not layout.expert_parallel:
        return ""
    spare = f", {layout.redundant_experts} redundant" if layout.redundant_experts else ""
    return f" ep={layout.ep} over {layout.nodes} node{'s' * (layout.nodes > 1)} per stage{spare}"


def node_launch_lines(plan: Plan, out: str) -> list[tuple[str, str]]:
    """Where each node's server finds its weights: its own directory, read by the stock loader
    (it lists exactly the node's tensors), and the EP flags the directories were cut for (a
    server started with others places experts its directory does not hold)."""
    layout, per = plan.layout, plan.layout.nodes
    nodes = layout.nnodes
    where = f"{out}/pp$((G / {per}))-node$((G % {per}))" if layout.pp > 1 else f"{out}/node$G"
    given = layout.init_expert_location is not None
    loc = " (LOC: the --init-expert-location file this split was given)" if given else ""
    return [
        (
            f"node G = 0..{nodes - 1} (the servers' --node-rank of --nnodes {nodes}) serves its own "
            "directory with the server's stock loader, expert parallel over its stage's nodes:",
            where,
        ),
        (f"with exactly these expert-parallel flags{loc}:", layout.server_flags()),
    ]
