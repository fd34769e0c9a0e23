"""The one layout object: what it refuses (one line, naming the caller's parameter), what it
holds, and that every entry point takes it (the library builds it from keywords, never both)."""

from __future__ import annotations

import doctest

import pytest

from qwen35_reshard import BadInput, Parallelism, make_plan, read_checkpoint, reshard
from qwen35_reshard.cli.flags import FLAGS
from qwen35_reshard.format.identity import RunIdentity
from qwen35_reshard.model import parallelism
from qwen35_reshard.model.parallelism import layout_of


def test_examples_run():
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in doctest.DocTestFinder().find(parallelism):
        runner.run(test)
    assert runner.summarize(verbose=False).attempted > 3 and runner.summarize(verbose=False).failed == 0


@pytest.mark.parametrize(
    ("kwargs", "library", "cli"),
    [
        ({"pp": 0}, "pp must be at least 1, got 0", "--pp must be"),
        ({"pp": True}, "pp must be at least 1, got True", "--pp must be"),
        ({"runtime": "trt"}, "runtime='trt' is not one of sglang, vllm", "--runtime trt is not one of"),
        ({"pp": 2, "partition": "4,x"}, "partition='4,x' must be comma-separated", "--partition 4,x"),
        ({"pp": 2, "partition": (8,)}, "partition='8' has 1 entry but pp is 2", "--partition 8 has 1 entry"),
        ({"pp": 2, "partition": [4, 0]}, "partition='4,0': every stage needs", "--partition 4,0"),
        ({"ep": 0}, "ep must be at least 1", "--ep must"),
        ({"ep": 8, "nodes": 3}, "ep=8 does not divide evenly over nodes=3", "--ep 8 does not divide evenly"),
        ({"nodes": 2}, "nodes spans an expert-parallel group: add ep", "--nodes spans an expert-parallel"),
        ({"redundant_experts": -1}, "redundant_experts must be 0 or more", "--redundant-experts must"),
        ({"redundant_experts": 4}, "redundant_experts are slots of an expert-parallel group", "add --ep"),
        (
            {"ep": 2, "runtime": "vllm", "init_expert_location": ((0, 1),)},
            "init_expert_location is SGLang's; drop it, or use runtime='sglang'",
            "--init-expert-location is SGLang's; drop it, or use --runtime sglang",
        ),
        ({"init_expert_location": ((0, 1),)}, "init_expert_location places experts", "add --ep"),
        ({"ep": 2, "init_expert_location": (3,)}, "must be rows of expert ids", "--init-expert-location"),
    ],
)
def test_refusals_name_the_parameter_in_one_line(kwargs, library, cli):
    with pytest.raises(BadInput) as e:
        Parallelism(**kwargs)
    assert library in str(e.value) and "\n" not in str(e.value)
    assert cli in e.value.render(FLAGS)


def test_holds_a_resolved_immutable_layout():
    layout = Parallelism(pp=2, partition="5, 3", runtime="vllm")
    assert layout.partition == (5, 3) and layout.sizes(8) == [5, 3]
    assert layout.launch_env(8) == "VLLM_PP_LAYER_PARTITION=5,3"
    with pytest.raises(BadInput, match="sums to 8 but the model has 9"):
        layout.sizes(9)
    assert Parallelism(pp=3).sizes(8) == [2, 3, 3]  # SGLang's own split
    with pytest.raises(AttributeError):
        layout.pp = 4  # type: ignore[misc]
    assert {layout, Parallelism(pp=2, partition=[5, 3], runtime="vllm")} == {layout}  # one key
    wide = Parallelism(pp=2, ep=16, nodes=4, redundant_experts=16)
    assert (wide.nnodes, wide.ranks_per_node, wide.node_ep_ranks(3)) == (8, 4, range(12, 16))
    with pytest.raises(BadInput, match=r"node=4 is not in 0..3 \(nodes=4\)"):
        wide.node_ep_ranks(4)
    with pytest.raises(BadInput, match="partition='balanced' is chosen from the checkpoint"):
        Parallelism(pp=2, partition="balanced").sizes(8)
    identity = RunIdentity("f", "local", 2, "vllm", (5, 3), "kept", 1, 1, "0")
    assert Parallelism.recorded(identity) == layout


def test_library_takes_the_object_or_its_keywords_never_both(make_checkpoint):
    ckpt = read_checkpoint(make_checkpoint())
    layout = Parallelism(pp=2, runtime="vllm", partition=(5, 3))
    plan = make_plan(ckpt, layout)
    assert plan.layout == layout and (plan.pp, plan.runtime, plan.partition) == (2, "vllm", (5, 3))
    assert make_plan(ckpt, pp=2, runtime="vllm", partition=[5, 3]).layout == layout
    # The runtime's own split is recorded resolved: the plan's layout says its layers.
    assert make_plan(ckpt, pp=2).layout == Parallelism(pp=2, partition=(4, 4))
    with pytest.raises(BadInput, match="layout already says the layout: drop pp"):
        make_plan(ckpt, layout, pp=2)
    with pytest.raises(BadInput, match="pp is needed"):
        reshard(ckpt.root, None, dry_run=True)
    with pytest.raises(BadInput, match="layout must be a Parallelism, got dict"):
            layout_of({"pp": 2})  # type: ignore[arg-type]
    assert reshard(ckpt.root, None, layout, dry_run=True).plan.layout == layout
