"""An expert-parallel plan: one directory per node, each its stage's other tensors and exactly
its EP ranks' experts, per expert by global id (never a fused name beside them)."""

from __future__ import annotations

import doctest

import pytest

from qwen35_reshard import BadInput, Parallelism, make_plan, read_checkpoint
from qwen35_reshard.model import experts as names_module
from qwen35_reshard.model.experts import expert_placement, expert_tensor
from qwen35_reshard.plan import experts as cutting
from qwen35_reshard.plan import nodedirs
from qwen35_reshard.plan.fetch import needed_by


@pytest.fixture(scope="module")
def ckpts(make_checkpoint):
    kinds = ("fused", "per_expert", "per_expert_fp8")
    return {kind: read_checkpoint(make_checkpoint(layout=kind)) for kind in kinds}


def routed(name: str):
    return expert_tensor(name)


@pytest.mark.parametrize("kind", ["fused", "per_expert", "per_expert_fp8"])
@pytest.mark.parametrize(("runtime", "pp", "ep", "nodes", "redundant"), [
    ("vllm", 2, 4, 2, 0), ("sglang", 1, 4, 4, 0), ("vllm", 2, 4, 2, 4), ("sglang", 2, 2, 1, 2),
])  # fmt: skip
def test_each_node_holds_its_stage_and_exactly_its_experts(ckpts, kind, runtime, pp, ep, nodes, redundant):
    ckpt = ckpts[kind]
    layout = Parallelism(pp=pp, runtime=runtime, ep=ep, nodes=nodes, redundant_experts=redundant)
    plan = make_plan(ckpt, layout)
    stages = make_plan(ckpt, pp=pp, runtime=runtime).stages
    place = expert_placement(runtime, num_experts=4, ep=ep, redundant=redundant)
    assert [s.dirname for s in plan.stages] == [
        f"node{k}" if pp == 1 else f"pp{r}-node{k}" for r in range(pp) for k in range(nodes)
    ]
    assert plan.ranks == tuple(range(pp * nodes))
    for s in plan.stages:
        r, k = divmod(s.rank, nodes)
        assert (s.stage, s.node.node, list(s.node.ep_ranks)) == (r, k, list(layout.node_ep_ranks(k)))
        names = [t.name for t in s.tensors]
        assert len(names) == len(set(names))
        others = {t.name for t in stages[r].tensors if routed(t.name) is None}
        assert {n for n in names if routed(n) is None} == others  # the stage's other tensors, all
        parsed = [routed(n) for n in names]
        assert all(w.expert is not None for w in parsed if w is not None)  # no fused name beside them
        held: dict = {}
        for w in parsed:
            if w is not None and w.heavy:
                held.setdefault(w.layer, set()).add(w.expert)
        assert held and all(held[m] == place.node_experts(m, k, nodes) for m in held)
        assert dict(s.node.experts) == {
            f"{'mtp.' if m.mtp else ''}layers.{m.index}": tuple(sorted(ids)) for m, ids in held.items()
        }
        for w, name in zip(parsed, names, strict=True):  # every expert's scales, every node
            if w is not None and not w.heavy:
                assert name in ckpt.tensors
        # A tensor is replicated when another directory holds it too.
        elsewhere = {t.name for o in plan.stages if o is not s for t in o.tensors}
        assert all(t.replicated == (t.name in elsewhere) for t in s.tensors)


def test_fused_experts_are_byte_ranges_of_the_source_and_fetched_as_such(ckpts):
    ckpt = ckpts["fused"]
    plan = make_plan(ckpt, Parallelism(pp=1, ep=4, nodes=2), ranks=[1])
    node = plan.stages[1]
    fused = {t.name: t for t in ckpt.tensors.values() if routed(t.name) and routed(t.name).expert is None}
    cut = [t.source for t in node.tensors if t.name not in ckpt.tensors]
    assert cut and all(
        any(f.file == c.file and f.offset <= c.offset and c.offset + c.nbytes <= f.offset + f.nbytes
            for f in fused.values())
        for c in cut
    )  # fmt: skip
    # No shard is cloned whole where an expert was cut out of it.
    assert all(f.layout != "clone" for f in node.files if f.source_file in {c.file for c in cut})
    needed = needed_by(plan)  # a shard is fetched whole only when all its tensors are needed whole
    assert all(name in ckpt.tensors for names in needed.values() for name in names)
    assert {c.file for c in cut} <= needed.keys() and not fused.keys() & set().union(*needed.values())
    assert sum(s.size for s in plan.stages) < 2 * make_plan(ckpt, pp=1).stages[0].size


def test_ranks_pick_node_directories(ckpts):
    ckpt = ckpts["per_expert"]
    layout = Parallelism(pp=2, ep=4, nodes=2)
    assert make_plan(ckpt, layout, ranks=[3, 0]).ranks == (0, 3)
    with pytest.raises(BadInput, match=r"node=4 is not a node of pp=2 x nodes=2 \(4 nodes: 0 to 3\)"):
        make_plan(ckpt, layout, ranks=[4])


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        (Parallelism(ep=3), "SGLang needs its 4 expert slots (4 experts plus 0 redundant) to divide"),
        (Parallelism(ep=4, runtime="vllm", redundant_experts=2), "vLLM's EPLB needs its 6 expert slots"),
        (Parallelism(ep=2, init_expert_location=((0, 1, 2, 3),)), "one row per decoder layer (8), got 1"),
    ],
)
def test_layouts_the_server_refuses_are_refused(ckpts, layout, message):
    with pytest.raises(BadInput, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_plan(ckpts["fused"], layout)


def test_each_stages_expert_names_are_parsed_once(ckpts, monkeypatch):
    # A parse of every name costs 0.3 s at the 397B shape: one per stage, however many nodes.
    parsed: list[int] = []

    def counting(tensor_names):
        tensor_names = list(tensor_names)
        parsed.append(len(tensor_names))
        return names_module.expert_tensors(tensor_names)

    monkeypatch.setattr(nodedirs, "expert_tensors", counting)
    monkeypatch.setattr(cutting, "expert_tensors", counting)
    layout = Parallelism(pp=2, runtime="vllm", ep=4, nodes=2)
    plan = make_plan(ckpts["fused"], layout)
    assert len(plan.stages) == 4 and len(parsed) == 2 and all(parsed)


def test_module_examples_run(make_checkpoint):
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in doctest.DocTestFinder().find(nodedirs, extraglobs={"MODEL": str(make_checkpoint())}):
        runner.run(test)
    assert runner.summarize(verbose=False).attempted >= 7 and runner.summarize(verbose=False).failed == 0
