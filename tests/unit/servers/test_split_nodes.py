"""A server rank given an expert-parallel split (servers/deployment.py ``split_stage``): the
directory of the node hosting its EP rank, the split's EP layout checked against the server's."""

from __future__ import annotations

import json

import pytest

import qwen35_reshard
from qwen35_reshard.errors import StageError
from qwen35_reshard.servers.deployment import split_stage
from qwen35_reshard.servers.eprank import RankExperts
from qwen35_reshard.servers.terms import for_operator


@pytest.fixture(scope="module")
def split(make_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("ep-split") / "out"
    qwen35_reshard.reshard(make_checkpoint(), out, pp=2, runtime="vllm", ep=4, nodes=2)
    return out


@pytest.mark.parametrize("ep_rank, node", [(0, 0), (1, 0), (2, 1), (3, 1)])
def test_each_rank_opens_its_nodes_directory(split, ep_rank, node):
    stage = split_stage(str(split), 1, RankExperts(ep_rank=ep_rank, ep=4))
    assert stage.path == split / f"pp1-node{node}" and stage.rank == 1
    assert ep_rank in stage.manifest.node.ep_ranks


@pytest.mark.parametrize(
    "experts, said",
    [(None, "but the server runs without expert parallelism"),
     (RankExperts(ep_rank=1, ep=2), "but the server runs with expert parallelism 2, 0 redundant experts"),
     (RankExperts(ep_rank=1, ep=4, redundant=4), "with expert parallelism 4, 4 redundant experts")],
    ids=["no-ep", "other-ep", "other-redundant"],
)
def test_a_split_for_another_ep_layout_is_refused(split, experts, said):
    with pytest.raises(StageError, match="was split for expert parallelism 4 over 2 node") as e:
        split_stage(str(split), 0, experts)
    assert said in str(e.value) and "\n" not in str(e.value)


def test_a_pipeline_split_opens_its_stage(make_checkpoint, tmp_path):
    qwen35_reshard.reshard(make_checkpoint(), tmp_path / "out", pp=2, runtime="vllm")
    stage = split_stage(str(tmp_path / "out"), 1, RankExperts(ep_rank=3, ep=4))  # every expert
    assert stage.path == tmp_path / "out" / "pp1"


@pytest.mark.parametrize("runtime", ["vllm", "sglang"])
def test_a_node_read_in_place_is_the_splits_node_directory(make_checkpoint, tmp_path, runtime):
    """An unsplit local checkpoint read in place for node k of stage r: the same tensors, byte
    for byte, as the split's ``pp{r}-node{k}``."""
    import torch

    from qwen35_reshard.model.parallelism import Parallelism
    from qwen35_reshard.servers.inplace import in_place_stage

    model = make_checkpoint()
    qwen35_reshard.reshard(model, tmp_path / "out", pp=2, runtime=runtime, ep=4, nodes=2)
    ckpt = qwen35_reshard.read_checkpoint(model)
    partition = qwen35_reshard.open_stage(tmp_path / "out" / "pp0-node0").partition  # the runtime's split
    layout = Parallelism(pp=2, runtime=runtime, partition=tuple(partition), ep=4, nodes=2)

    def raw(stage):
        return {n: t.contiguous().view(-1).view(torch.uint8).tolist() for n, t in stage.iter_weights()}

    for rank in range(2):
        for node in range(2):
            read = raw(in_place_stage(ckpt, layout, rank, node))
            assert read == raw(qwen35_reshard.open_stage(tmp_path / "out" / f"pp{rank}-node{node}"))


@pytest.fixture(scope="module")
def located(make_checkpoint, tmp_path_factory):
    """SGLang splits of 4 experts over EP 2 (one node each): trivially placed, and placed by
    loc.json (every layer's slots [3, 2, 1, 0]: node 0 holds experts 3 and 2, not 0 and 1)."""
    root = tmp_path_factory.mktemp("ep-located")
    loc = root / "loc.json"
    loc.write_text(json.dumps({"physical_to_logical_map": [[3, 2, 1, 0]] * 8}))
    model = make_checkpoint()
    layout = dict(pp=1, runtime="sglang", ep=2, nodes=2)
    qwen35_reshard.reshard(model, root / "trivial", **layout)
    rows = tuple((3, 2, 1, 0) for _ in range(8))
    qwen35_reshard.reshard(model, root / "loc", **layout, init_expert_location=rows)
    return root, str(loc)


@pytest.mark.parametrize("split_as, server_as", [("trivial", "loc"), ("loc", "trivial")])
def test_a_split_for_another_initial_expert_location_is_refused(located, split_as, server_as):
    root, loc = located
    experts = RankExperts(ep_rank=0, ep=2, location=loc if server_as == "loc" else "trivial")
    with pytest.raises(StageError) as e:
        split_stage(str(root / split_as), 0, experts)
    said = for_operator(e.value, split=True)
    assert "the initial expert placement" in said and "\n" not in said, said
    assert "launch it with 2 EP ranks per stage, 0 redundant experts and the initial expert placement" in said


@pytest.mark.parametrize("split_as, location", [("trivial", None), ("trivial", "trivial"), ("loc", "loc")])
def test_a_split_for_the_servers_initial_expert_location_opens(located, split_as, location):
    root, loc = located
    experts = RankExperts(ep_rank=0, ep=2, location=loc if location == "loc" else location)
    stage = split_stage(str(root / split_as), 0, experts)
    assert stage.path == root / split_as / "node0"


def test_the_stage_cache_key_carries_the_initial_expert_location():
    from qwen35_reshard.format.identity import location_sha256
    from qwen35_reshard.model.parallelism import Parallelism
    from qwen35_reshard.servers.unsplit import cache_key

    rows = tuple((3, 2, 1, 0) for _ in range(8))
    trivial = Parallelism(pp=1, runtime="sglang", partition=(8,), ep=2, nodes=2)
    placed = Parallelism(pp=1, runtime="sglang", partition=(8,), ep=2, nodes=2, init_expert_location=rows)
    assert cache_key(placed) == cache_key(trivial) + f"-loc{location_sha256(rows)[:16]}"


def test_a_node_read_in_place_under_a_location_holds_the_locations_experts(make_checkpoint, located):
    """The unsplit path places by the server's location too: node 0 of loc.json holds experts 3
    and 2 of every layer, as the split made with it does."""
    import torch

    from qwen35_reshard.model.parallelism import Parallelism
    from qwen35_reshard.servers.inplace import in_place_stage

    root, _ = located
    split = qwen35_reshard.open_stage(root / "loc" / "node0")
    rows = split.manifest.node.expert_location
    layout = Parallelism(pp=1, runtime="sglang", partition=tuple(split.partition), ep=2, nodes=2,
                         init_expert_location=rows)  # fmt: skip
    ckpt = qwen35_reshard.read_checkpoint(make_checkpoint())
    read = dict(in_place_stage(ckpt, layout, 0, 0).iter_weights())
    assert split.manifest.node.experts["layers.0"] == (2, 3)
    layer0 = "language_model.layers.0.mlp.experts."
    held = {n.split(layer0)[1].split(".")[0] for n in read if layer0 in n}
    assert held == {"2", "3"}, held
    def raw(t):
        return t.contiguous().view(-1).view(torch.uint8).tolist()

    assert {n: raw(t) for n, t in read.items()} == {n: raw(t) for n, t in split.iter_weights()}
