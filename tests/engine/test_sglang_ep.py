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
  rank's slots hold the placement's experts, in order.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_sglang_loading import require_sglang_python, run_worker, save_checkpoint

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


@pytest.fixture(scope="module")
def results(sources):
    python = require_sglang_python()
    root = sources["fused"].parents[1]
    jobs = []
    for ep in EP_SIZES:
        for ep_rank in range(ep):
            cases = [{"id": "per_expert-stock", "kind": "load", "stock": True, "source": str(sources["fused"]),
                      "split": str(sources["per_expert"]), "mtp_source": False, "mtp_kept": False}]
            jobs.append({"pp": 1, "rank": 0, "ep": ep, "ep_rank": ep_rank, "partition": None, "cases": cases,
                         "layout": f"ep{ep}-{ep_rank}", "result": str(root / f"result-ep{ep}-{ep_rank}.json")})
    return run_worker(python, WORKER, root, jobs, timeout=900)


@pytest.mark.parametrize("ep", EP_SIZES)
def test_per_expert_checkpoint_loads_each_ranks_experts_as_the_fused_one(results, ep):
    from qwen35_reshard.model.experts import expert_placement

    placement = expert_placement("sglang", num_experts=EXPERTS, ep=ep)
    for ep_rank in range(ep):
        got = results["per_expert-stock", f"ep{ep}-{ep_rank}", 0]
        assert got["loader"] == got["ref_loader"] == "DefaultModelLoader"  # SGLang's own, both
        assert got["nan"] == [] and got["nan_after_whole"] == []
        assert got["differs_from_whole"] == []
        experts = got["local_experts"]
        assert len(experts) == LAYERS
        want = list(placement.experts(0, ep_rank))
        assert all(slots == want for slots in experts.values()), (ep_rank, experts)
