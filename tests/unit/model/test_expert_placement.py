"""The servers' expert placement as data (model/experts.py): the rules of the facts doc, section
1.3 and 2.2, re-derived here slot by slot; what the servers refuse is refused, naming the flag.

tests/engine/test_expert_placement_servers.py compares the same placements with vLLM's and SGLang's own
functions."""

from __future__ import annotations

import doctest
import json

import pytest

from qwen35_reshard.errors import BadInput
from qwen35_reshard.model import experts as experts_module
from qwen35_reshard.model.experts import (
    MoeLayer,
    check_nodes,
    expert_placement,
    node_ranks,
    read_expert_location,
)

FLAGS = {
    "ep": "--ep",
    "nodes": "--nodes",
    "node": "--node",
    "redundant_experts": "--redundant-experts",
    "init_expert_location": "--init-expert-location",
}


def test_module_examples_run():
    assert doctest.testmod(experts_module).failed == 0


def vllm_reference(num_experts, ep, redundant, rank):
    """vLLM's linear rule written out: per-rank counts with the remainder on the first ranks,
    slot p holding logical p % E (the initial EPLB map)."""
    counts = [(num_experts + redundant) // ep + (r < (num_experts + redundant) % ep) for r in range(ep)]
    start = sum(counts[:rank])
    return tuple(p % num_experts for p in range(start, start + counts[rank]))


@pytest.mark.parametrize(("num_experts", "ep"), [(8, 1), (8, 3), (10, 4), (512, 48), (256, 7), (4, 8)])
def test_vllm_without_redundant_experts_covers_every_expert_once(num_experts, ep):
    p = expert_placement("vllm", num_experts=num_experts, ep=ep)
    per_rank = [p.experts(5, r) for r in range(ep)]
    assert [e for rank in per_rank for e in rank] == list(range(num_experts))
    assert per_rank == [vllm_reference(num_experts, ep, 0, r) for r in range(ep)]
    sizes = [len(r) for r in per_rank]
    assert sizes == sorted(sizes, reverse=True) and max(sizes) - min(sizes) <= 1  # first ranks get more


def test_vllm_remainder_goes_to_the_first_ranks():
    p = expert_placement("vllm", num_experts=10, ep=4)
    assert [p.experts(0, r) for r in range(4)] == [(0, 1, 2), (3, 4, 5), (6, 7), (8, 9)]


@pytest.mark.parametrize("runtime", ["vllm", "sglang"])
@pytest.mark.parametrize(("num_experts", "ep", "redundant"), [(8, 4, 4), (512, 32, 32), (6, 4, 2), (4, 2, 6)])
def test_redundant_slots_hold_the_first_experts_again(runtime, num_experts, ep, redundant):
    p = expert_placement(runtime, num_experts=num_experts, ep=ep, redundant=redundant)
    for r in range(ep):
        assert p.experts(0, r) == vllm_reference(num_experts, ep, redundant, r)
        assert len(p.experts(0, r)) == (num_experts + redundant) // ep
    slots = [e for r in range(ep) for e in p.experts(0, r)]
    assert slots == list(range(num_experts)) + [i % num_experts for i in range(redundant)]


def test_nodes_take_contiguous_ep_ranks_and_the_union_of_their_experts():
    assert [node_ranks(32, 4, k) for k in range(4)] == [
        range(0, 8),
        range(8, 16),
        range(16, 24),
        range(24, 32),
    ]
    p = expert_placement("sglang", num_experts=8, ep=4, redundant=4)
    assert p.node_experts(0, 1, 2) == {6, 7, 0, 1, 2, 3}
    assert p.node_experts(0, 0, 2) == {0, 1, 2, 3, 4, 5}
    assert p.node_experts(0, 0, 1) == set(range(8))


def test_sglang_mtp_draft_maps_logical_ids_straight_to_slots():
    """The draft's FusedMoE uses no expert location: slot p holds logical p, nothing past E."""
    p = expert_placement("sglang", num_experts=8, ep=4, redundant=4)
    assert [p.experts(MoeLayer(0, mtp=True), r) for r in range(4)] == [(0, 1, 2), (3, 4, 5), (6, 7), ()]
    v = expert_placement("vllm", num_experts=8, ep=4, redundant=4)
    assert v.experts(MoeLayer(0, mtp=True), 3) == v.experts(0, 3) == (1, 2, 3)


def test_a_location_file_places_each_layer_by_its_row(tmp_path):
    rows = [[3, 2, 1, 0, 0, 1], [0, 1, 2, 3, 3, 3]]
    path = tmp_path / "loc.json"
    path.write_text(json.dumps({"physical_to_logical_map": rows}))
    location = read_expert_location(str(path))
    assert location == rows
    p = expert_placement("sglang", num_experts=4, ep=2, redundant=2, location=location, num_layers=2)
    assert [p.experts(0, r) for r in range(2)] == [(3, 2, 1), (0, 0, 1)]
    assert [p.experts(1, r) for r in range(2)] == [(0, 1, 2), (3, 3, 3)]
    assert p.node_experts(1, 1, 2) == {3}
    assert p.experts(MoeLayer(0, mtp=True), 1) == (3,)  # the draft ignores the file
    assert read_expert_location(json.dumps({"physical_to_logical_map": rows})) == rows  # inline, as SGLang
    assert read_expert_location("trivial") is None
    assert p.describe()["location"] == rows


def refusal(call, *args, **kwargs) -> str:
    with pytest.raises(BadInput) as info:
        call(*args, **kwargs)
    line = info.value.render(FLAGS)
    assert "\n" not in line
    return line


@pytest.mark.parametrize(
    ("kwargs", "flag", "words"),
    [
        (dict(runtime="sglang", num_experts=10, ep=4), "change --ep", "set --redundant-experts to 2"),
        (dict(runtime="sglang", num_experts=8, ep=4, redundant=2), "--redundant-experts to 0", "evenly"),
        (dict(runtime="vllm", num_experts=10, ep=4, redundant=1), "change --ep", "EPLB"),
        (
            dict(runtime="vllm", num_experts=8, ep=1, redundant=2),
            "--redundant-experts 2",
            "more than one rank",
        ),
        (dict(runtime="vllm", num_experts=8, ep=0), "--ep 0", "at least 1"),
        (dict(runtime="vllm", num_experts=8, ep=2, redundant=-1), "--redundant-experts -1", "0 or more"),
        (
            dict(runtime="vllm", num_experts=8, ep=2, location=[[0] * 8], num_layers=1),
            "--init-expert-location",
            "vLLM",
        ),
    ],
)
def test_refused_layouts_name_the_flag(kwargs, flag, words):
    line = refusal(expert_placement, **kwargs)
    assert flag in line and words in line


def test_vllm_accepts_what_only_sglang_refuses():
    assert expert_placement("vllm", num_experts=10, ep=4).experts(0, 3) == (8, 9)
    assert expert_placement("vllm", num_experts=12, ep=4, redundant=4).experts(0, 3) == (0, 1, 2, 3)


@pytest.mark.parametrize(
    ("ep", "nodes", "node", "flag"),
    [(32, 3, 0, "--nodes 3"), (8, 0, 0, "--nodes 0"), (8, 2, 2, "--node 2"), (8, 2, -1, "--node -1")],
)
def test_node_counts_that_do_not_split_the_ep_group_are_refused(ep, nodes, node, flag):
    assert flag in refusal(node_ranks, ep, nodes, node)


def test_check_nodes_accepts_divisors():
    for nodes in (1, 2, 4, 8, 16, 32):
        check_nodes(32, nodes)


@pytest.mark.parametrize(
    ("rows", "words"),
    [
        ([[0, 1, 2, 3]], "one row per decoder layer (2)"),
        ([[0, 1, 2, 3], [0, 1, 2]], "row 1 must list 4"),
        ([[0, 1, 2, 3], [0, 1, 2, 4]], "no expert id"),
        ([[0, 1, 2, 3], [0, 1, 2, True]], "no expert id"),
        ([[0, 1, 2, 3], [0, 1, 2, 2]], "logical expert 3 no physical slot"),
    ],
)
def test_location_rows_sglang_would_misread_are_refused(rows, words):
    line = refusal(expert_placement, "sglang", num_experts=4, ep=2, location=rows, num_layers=2)
    assert "--init-expert-location" in line and words in line


def test_a_pt_location_is_refused_without_being_opened(tmp_path):
    path = tmp_path / "loc.pt"  # absent: opening it would give another error
    line = refusal(read_expert_location, str(path))
    assert "pickle" in line and "JSON" in line and "--init-expert-location" in line


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ('{"logical_count": [[[1, 2]]]}', "EPLB algorithm"),
        ('{"physical_to_logical_map": [[0]], "extra": 1}', "exactly the key"),
        ("[1, 2]", "JSON object"),
        ("{nope", "not JSON"),
        ("/nonexistent/loc.json", "cannot read"),
    ],
)
def test_location_values_sglang_would_not_take_are_refused(value, words):
    line = refusal(read_expert_location, value)
    assert words in line and "--init-expert-location" in line


def test_an_uneven_group_reads_as_a_sentence_on_the_command_line_and_to_an_operator():
    from qwen35_reshard.cli.flags import FLAGS
    from qwen35_reshard.servers.terms import for_operator

    with pytest.raises(BadInput) as e:
        expert_placement("sglang", num_experts=4, ep=3, redundant=0)
    assert e.value.render(FLAGS) == (
        "SGLang needs its 4 expert slots (4 experts plus 0 redundant) to divide evenly over "
        "3 expert-parallel ranks; set --redundant-experts to 2 (or that plus a multiple of 3), or change --ep"
    )
    assert for_operator(e.value).endswith(
        "set the redundant experts to 2 (or that plus a multiple of 3), or change the expert-parallel size"
    )
