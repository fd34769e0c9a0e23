"""A server rank's place in its expert-parallel (EP) group, and the node that hosts it.

Each server computes its own EP rank (read from its code, vLLM 0.32.0 and SGLang 0.5.23):

- vLLM: ``ep_size = dp * pcp * tp`` and ``ep_rank = dp_rank * pcp * tp + pcp_rank * tp + tp_rank``
  (``FusedMoEParallelConfig.make``, mirrored by ``DefaultModelLoader._init_ep_weight_filter``),
  with ``enable_expert_parallel`` and more than one rank; redundant experts only under EPLB
  (``eplb_config.num_redundant_experts``). PP is not part of it: each stage has its own group.
- SGLang: ``moe_ep_rank`` / ``moe_ep_size`` of its parallel context, ``--ep-num-redundant-experts``
  and ``--init-expert-location``.

Which node a rank is on is what the deployment is: every rank says its host in the exchange
before loading (:mod:`.deployment`), and the hosts of a stage's ranks are its EP group's nodes.
Node ``k`` of ``N`` must host EP ranks ``[k*ep/N, (k+1)*ep/N)``, which is how both servers number
their ranks across nodes (vLLM's data-parallel ranks, SGLang's ranks node by node), so that the
node's slice is one of the directories ``qwen35-reshard --ep --nodes`` writes. Where host names do
not tell the nodes apart (containers sharing one), ``QWEN35_RESHARD_EP_NODES`` says how many
nodes each stage's EP group spans.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..errors import StageError

EP_NODES_ENV = "QWEN35_RESHARD_EP_NODES"


@dataclass(frozen=True)
class RankExperts:
    """This rank's EP group as its server built it.

    Attributes:
        ep_rank: the rank in its stage's EP group.
        ep: the group's size.
        redundant: redundant expert slots (vLLM's EPLB, SGLang's ``--ep-num-redundant-experts``).
        location: SGLang's ``--init-expert-location`` as given (None: ``trivial``).
    """

    ep_rank: int
    ep: int
    redundant: int = 0
    location: str | None = None


def rank_view(
    experts: RankExperts | None, pp_rank: int, env: Mapping[str, str] | None = None
) -> dict[str, object]:
    """What this rank says of its EP group in the exchange: its stage, EP rank, host and
    ``QWEN35_RESHARD_EP_NODES``."""
    return {
        "pp_rank": pp_rank,
        "ep_rank": None if experts is None else experts.ep_rank,
        "host": socket.gethostname(),
        "ep_nodes": (os.environ if env is None else env).get(EP_NODES_ENV) or None,
    }


def ep_nodes(views: Sequence[Mapping[str, object]], ep: int) -> dict[int, int]:
    """How many nodes the EP group of each pipeline stage spans, by stage: ``QWEN35_RESHARD_EP_NODES``
    (the same on every rank), else the hosts its ranks said (:func:`rank_view`), each host's EP
    ranks checked to be one node's contiguous block. Every rank decides the same from the same
    views, every stage's included, so that a refusal stops every rank.

    Raises:
        StageError: the variable differs between ranks or does not divide ``ep``; hosts that are
            not contiguous equal blocks of EP ranks.

    Example:
        >>> views = [{"pp_rank": 0, "ep_rank": r, "host": f"n{r // 2}", "ep_nodes": None} for r in range(4)]
        >>> ep_nodes(views, 4)
        {0: 2}
    """
    given = {v["ep_nodes"] for v in views}
    if len(given) > 1:
        said = ", ".join(sorted(f"{EP_NODES_ENV}={g}" if g else f"{EP_NODES_ENV} unset" for g in given))
        raise StageError(
            f"the ranks were launched with different {EP_NODES_ENV} ({said}): set it alike on every node"
        )
    (value,) = given
    stages = sorted({int(v["pp_rank"]) for v in views})  # type: ignore[call-overload]
    if value is not None:
        text = str(value)
        if not text.isdigit() or int(text) < 1 or ep % int(text):
            raise StageError(
                f"{EP_NODES_ENV}={text} must be a number of nodes dividing the expert-parallel size {ep}"
            )
        return dict.fromkeys(stages, int(text))
    return {stage: _host_nodes(views, stage, ep) for stage in stages}


def _host_nodes(views: Sequence[Mapping[str, object]], pp_rank: int, ep: int) -> int:
    """The nodes of stage ``pp_rank``'s EP group, by its ranks' hosts (see :func:`ep_nodes`)."""
    hosts: dict[str, set[int]] = {}
    for view in views:
        if view["pp_rank"] == pp_rank and view["ep_rank"] is not None:
            hosts.setdefault(str(view["host"]), set()).add(int(view["ep_rank"]))  # type: ignore[call-overload]
    nodes = len(hosts)
    per = ep // nodes if nodes and ep % nodes == 0 else 0
    blocks = {h: sorted(r) for h, r in hosts.items()}
    if not per or any(r != list(range(r[0] - r[0] % per, r[0] - r[0] % per + per)) for r in blocks.values()):
        seen = "; ".join(f"{h}: EP ranks {','.join(map(str, r))}" for h, r in sorted(blocks.items()))
        raise StageError(
            f"the expert-parallel ranks of pipeline stage {pp_rank} are not {nodes} nodes of equal "
            f"contiguous blocks ({seen}): launch each node with consecutive ranks, or set "
            f"{EP_NODES_ENV} to the number of nodes"
        )
    return nodes
