"""Proof in SGLang's own model code for expert parallelism (issue 42): each rank of an EP group
loads exactly its experts, byte for byte what SGLang's stock loader gives it from the whole
checkpoint, and they are the ones :mod:`qwen35_reshard.model.experts` places there.

SGLang's engine does not start on these CPU machines (tests/engine/test_sglang_plugin.py says why):
as there, SGLang 0.5.23's own loading path (plugin discovery, ``get_model_loader``,
``load_model``) runs one process per rank, with SGLang's parallel context published for
``--tp N --ep N`` and the process's world rank, so its MoE layers hold ``E / N`` experts
(``moe_ep_rank``) and its linear layers the rank's TP shard; only the process groups are
stand-ins, as no collective runs while loading (tests/support/sglang_worker.py ``set_up_rank``).
Every parameter is NaN before loading and none after; each local expert slot is identified by
its bytes in the source checkpoint.

- the per-expert save (``experts.{e}.gate_proj`` ... by global id; what a node's directory holds),
  SGLang's own loader: every rank's parameters equal the fused save's, byte for byte, and each
  rank's slots hold the placement's experts, in order;
- the unsplit fused save through the plugin (``QWEN35_RESHARD_SGLANG_UNSPLIT``), each EP group
  over two nodes: each rank reads in place only its node's experts and loads the same.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_sglang_loading import require_sglang_python, run_worker, save_checkpoint

import qwen35_reshard
from qwen35_reshard.servers.eprank import EP_NODES_ENV
from qwen35_reshard.servers.sglang import UNSPLIT_ENV

from support.helpers import SUPPORT

# Real model code in SGLang's environment, seconds a rank.
pytestmark = [pytest.mark.engine, pytest.mark.slow]

WORKER = SUPPORT / "sglang_plugin_worker.py"
EP_SIZES = (2, 4)  # of the 8 experts: 4 and 2 a rank
EXPERTS = 8
LAYERS = 8


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sglang-ep")
    found = {}
    for layout in ("per_expert", "fused"):
        torch.manual_seed(0)  # the same weights in both layouts
        found[layout] = root / "src" / layout
        save_checkpoint(found[layout], "vision", layout, False, False)
    return found


NODES = 2  # each EP group spread over two nodes (QWEN35_RESHARD_EP_NODES: one host here)


@pytest.fixture(scope="module")
def results(sources):
    python = require_sglang_python()
    root = sources["fused"].parents[1]
    common = {"kind": "load", "source": str(sources["fused"]), "mtp_source": False, "mtp_kept": False}
    split = root / "out"  # an expert-parallel split: one directory per node
    qwen35_reshard.reshard(sources["fused"], split, pp=1, runtime="sglang", ep=4, nodes=NODES)
    cases = [{**common, "id": "per_expert-stock", "stock": True, "split": str(sources["per_expert"])},
             {**common, "id": "unsplit-node", "unsplit": True, "split": str(sources["fused"])}]
    split_cases = [{**common, "id": "split-node", "split": str(split)}]
    jobs = [{"pp": 1, "rank": 0, "ep": ep, "ep_rank": r, "partition": None,
             "cases": cases + (split_cases if ep == 4 else []),
             "layout": f"ep{ep}-{r}", "result": str(root / f"result-ep{ep}-{r}.json")}
            for ep in EP_SIZES for r in range(ep)]
    env = {UNSPLIT_ENV: "1", EP_NODES_ENV: str(NODES)}
    return run_worker(python, WORKER, root, jobs, timeout=900, env=env)


def placement(ep: int):
    from qwen35_reshard.model.experts import expert_placement

    return expert_placement("sglang", num_experts=EXPERTS, ep=ep)


def assert_loaded_as_whole(got: dict, ep: int, ep_rank: int) -> None:
    """Every parameter loaded (none left NaN), byte for byte the stock whole-checkpoint load's,
    and every MoE layer's slots holding the placement's experts of the rank, in order."""
    assert got["nan"] == [] and got["nan_after_whole"] == []
    assert got["differs_from_whole"] == []
    experts = got["local_experts"]
    assert len(experts) == LAYERS
    want = list(placement(ep).experts(0, ep_rank))
    assert all(slots == want for slots in experts.values()), (ep_rank, experts)


@pytest.mark.parametrize("ep", EP_SIZES)
def test_per_expert_checkpoint_loads_each_ranks_experts_as_the_fused_one(results, ep):
    for ep_rank in range(ep):
        got = results["per_expert-stock", f"ep{ep}-{ep_rank}", 0]
        assert got["loader"] == got["ref_loader"] == "DefaultModelLoader"  # SGLang's own, both
        assert_loaded_as_whole(got, ep, ep_rank)


@pytest.mark.parametrize("ep", EP_SIZES)
def test_unsplit_checkpoint_each_rank_reads_only_its_nodes_experts(results, ep):
    """Through the plugin (opted in), each rank reads in place only its node's slice of the
    unsplit fused checkpoint: the node's experts, per expert by global id, and loads exactly
    what SGLang's own loader gives it from the whole checkpoint."""
    per_node = ep // NODES
    for ep_rank in range(ep):
        got = results["unsplit-node", f"ep{ep}-{ep_rank}", 0]
        assert got["loader"] == "Qwen35StagesLoader" and got["ref_loader"] == "DefaultModelLoader"
        assert_loaded_as_whole(got, ep, ep_rank)
        node = ep_rank // per_node
        names = [n for n in got["stage_names"] if ".mlp.experts." in n]
        held = {int(n.split(".experts.")[1].split(".")[0]) for n in names}
        assert held == placement(ep).node_experts(0, node, NODES)  # its node's experts, no others
        assert not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in got["stage_names"])


def test_split_each_rank_loads_its_nodes_directory(results, sources):
    """A split made with ``ep=4, nodes=2`` (``OUT/node0``, ``OUT/node1``) given to SGLang as the
    model path: each rank opens the directory of the node that hosts its EP rank and loads
    exactly what SGLang's own loader gives it from the whole checkpoint."""
    ep, per_node = 4, 4 // NODES
    for ep_rank in range(ep):
        got = results["split-node", f"ep{ep}-{ep_rank}", 0]
        assert got["loader"] == "Qwen35StagesLoader"
        assert_loaded_as_whole(got, ep, ep_rank)
        node = ep_rank // per_node
        names = [n for n in got["stage_names"] if ".mlp.experts." in n]
        assert {int(n.split(".experts.")[1].split(".")[0]) for n in names} == placement(ep).node_experts(
            0, node, NODES
        )
