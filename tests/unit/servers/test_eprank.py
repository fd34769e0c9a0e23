"""The nodes of a stage's expert-parallel group, as every rank decides them from the exchanged
views (servers/eprank.py): by host, or QWEN35_RESHARD_EP_NODES; refused alike on every rank."""

from __future__ import annotations

import pytest

from qwen35_reshard.errors import StageError
from qwen35_reshard.servers.eprank import EP_NODES_ENV, RankExperts, ep_nodes, rank_view


def views(hosts: list[str], *, stages: int = 1, given: str | None = None) -> list[dict]:
    """One view per rank: stage by stage, EP rank r of each on ``hosts[r]``."""
    return [{"pp_rank": s, "ep_rank": r, "host": f"{h}-{s}", "ep_nodes": given}
            for s in range(stages) for r, h in enumerate(hosts)]


def test_nodes_are_the_hosts_of_each_stage():
    assert ep_nodes(views(["a", "a", "b", "b"]), 4) == {0: 2}
    assert ep_nodes(views(["a"] * 8, stages=2), 8) == {0: 1, 1: 1}
    assert ep_nodes(views(["a", "b", "c", "d"]), 4) == {0: 4}


@pytest.mark.parametrize("hosts", [["a", "b", "a", "b"], ["a", "a", "a", "b"]], ids=["interleaved", "uneven"])
def test_hosts_that_are_not_contiguous_equal_blocks_are_refused(hosts):
    with pytest.raises(StageError, match=f"not 2 nodes of equal contiguous blocks .*{EP_NODES_ENV}"):
        ep_nodes(views(hosts), 4)


def test_the_variable_overrides_hosts_and_must_agree_and_divide():
    assert ep_nodes(views(["a"] * 4, given="2"), 4) == {0: 2}
    with pytest.raises(StageError, match="must be a number of nodes dividing the expert-parallel size 4"):
        ep_nodes(views(["a"] * 4, given="3"), 4)
    mixed = views(["a"] * 2, given="2") + [{"pp_rank": 0, "ep_rank": 2, "host": "b", "ep_nodes": None}]
    with pytest.raises(StageError, match=f"different {EP_NODES_ENV} .*set it alike on every node"):
        ep_nodes(mixed, 4)


def test_a_rank_says_its_stage_ep_rank_host_and_variable():
    view = rank_view(RankExperts(ep_rank=3, ep=4), 1, env={EP_NODES_ENV: "2"})
    assert view["pp_rank"] == 1 and view["ep_rank"] == 3 and view["ep_nodes"] == "2" and view["host"]
    assert rank_view(None, 0, env={})["ep_rank"] is None
