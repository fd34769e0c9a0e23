"""Runs inside the vLLM or the SGLang environment: which logical expert each EP rank's physical
slots receive, by the server's own code (tests/engine/test_expert_placement_servers.py).

Usage: python expert_placement_worker.py vllm|sglang JOBS.json RESULT.json. JOBS.json holds
``{"cases": [{"id", "experts", "ep", "redundant", "config", "location", "layers", "draft",
"nodes"}]}`` (``nodes``: SGLang with DeepEP over that many nodes, else absent);
RESULT.json gets, per case id, ``{"ranks": [[logical id or null per local slot, ...] per EP
rank] per layer asked}`` or ``{"refused": "..."}`` when the server's own check refuses the layout.

- vLLM 0.32: ``determine_expert_map`` (linear, after ``determine_expert_placement_strategy``,
  which turns a requested round_robin into linear for a model without expert groups, as
  Qwen3.5 builds its MoE) gives each rank's physical slots; ``RoutedExperts.build_expert_params_mapping``
  (over ``EplbState.build_initial_global_physical_to_logical_map``) names the checkpoint expert
  each physical slot loads. Its EPLB check (``(E+R) % ep``) sits inside the MoE factory, which
  needs a full engine config: not run here.
- SGLang 0.5.23: per rank, its context is published as a server with ``--tp/--ep-size ep
  --ep-num-redundant-experts R [--init-expert-location ...]`` would publish it;
  ``compute_initial_expert_location_metadata`` builds the expert location from the model's
  config (trivial, or the file); a real ``FusedMoE`` of the layer is built on CPU and its
  ``weight_loader`` is fed every logical expert's ``down_proj`` filled with the expert's id; the
  local slots then show which logical expert each received. ``draft``: the MoE is built in
  ``draft_model_build_scope`` (the MTP draft, which uses no expert location). With ``nodes``,
  the context is DeepEP's (``--moe-a2a-backend deepep --enable-dp-attention --nnodes N``), under
  which the loader fills only the nearest slot of a logical expert a rank holds twice.
"""

from __future__ import annotations

import json
import sys
import time


def vllm_case(case: dict) -> dict:
    from vllm.distributed.eplb.eplb_state import EplbState
    from vllm.model_executor.layers.fused_moe.expert_map_manager import (
        determine_expert_map,
        determine_expert_placement_strategy,
    )
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    experts, ep, redundant = case["experts"], case["ep"], case["redundant"]
    # Qwen3.5's MoE has no expert groups (num_expert_group None): round_robin is not kept.
    strategy = determine_expert_placement_strategy("round_robin", None, None, redundant, redundant > 0)
    mapping = RoutedExperts.build_expert_params_mapping(
        "gate_proj",
        "down_proj",
        "up_proj",
        num_experts=experts,
        num_redundant_experts=redundant,
        routed_experts_prefix="",
    )
    # physical slot -> the checkpoint expert its down_proj entry names ("experts.{e}.down_proj.")
    loads = {eid: int(name.split(".")[1]) for _, name, eid, shard in mapping if shard == "w2"}
    initial = EplbState.build_initial_global_physical_to_logical_map(experts, redundant)
    assert [loads[p] for p in range(experts + redundant)] == list(initial)
    ranks = []
    for rank in range(ep):
        local, expert_map, _ = determine_expert_map(ep, rank, experts + redundant, strategy)
        if expert_map is None:  # an EP group of one holds every slot
            slots = list(range(experts + redundant))
        else:
            slots = sorted(
                (p for p in range(len(expert_map)) if expert_map[p] >= 0), key=lambda p: int(expert_map[p])
            )
            assert [int(expert_map[p]) for p in slots] == list(range(local))
        ranks.append([loads[p] for p in slots])
    return {"ranks": [ranks], "strategy": strategy}


def sglang_case(case: dict) -> dict:
    import torch
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.eplb import expert_location as el
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.layers.moe.utils import draft_model_build_scope
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, reset_context
    from sglang.srt.server_args import ServerArgs
    from sglang.test.parallel_groups import publish

    experts, ep, redundant = case["experts"], case["ep"], case["redundant"]
    location = case["location"] or "trivial"
    model_config = None
    per_layer: list[list] = [[] for _ in case["layers"]]
    for rank in range(ep):
        reset_context()
        args = ServerArgs(
            model_path="dummy",
            device="cpu",
            tp_size=ep,
            ep_size=ep,
            ep_num_redundant_experts=redundant,
            init_expert_location=location,
            # DeepEP (wide EP, with DP attention) over nodes: its loader fills the nearest slot only.
            **(
                {
                    "moe_a2a_backend": "deepep",
                    "enable_dp_attention": True,
                    "dp_size": ep,
                    "nnodes": case["nodes"],
                }
                if case.get("nodes")
                else {}
            ),
        )
        publish(args, role="test", ranks=SpawnRanks(world_rank=rank))
        assert get_parallel().moe_ep_rank == rank
        model_config = model_config or ModelConfig(case["config"])  # the model's, read once
        try:
            metadata = el.compute_initial_expert_location_metadata(model_config, moe_ep_rank=rank)
        except AssertionError as e:  # SGLang's own divisibility check
            return {"refused": f"AssertionError {e}"}
        el.set_global_expert_location_metadata(metadata, allow_overwrite=True)
        for i, layer in enumerate(case["layers"]):

            def build(layer=layer):
                return FusedMoE(
                    num_experts=experts + redundant,
                    top_k=2,
                    hidden_size=4,
                    intermediate_size=4,
                    layer_id=layer,
                    prefix=f"layers.{layer}.mlp.experts",
                )

            if case["draft"]:
                with draft_model_build_scope():
                    moe = build()
            else:
                moe = build()
            with torch.no_grad():
                moe.w2_weight.fill_(-1)
            for e in range(experts):
                moe.weight_loader(moe.w2_weight, torch.full((4, 4), float(e)), "experts.w2_weight", "w2", e)
            got = [int(moe.w2_weight[s, 0, 0]) for s in range(moe.w2_weight.shape[0])]
            per_layer[i].append([None if g < 0 else g for g in got])
    return {"ranks": per_layer}


def main() -> None:
    server, jobs, result = sys.argv[1:4]
    t = time.perf_counter()
    if server == "vllm":
        import vllm

        version, run = vllm.__version__, vllm_case
    else:
        import sglang

        version, run = sglang.__version__, sglang_case
    imported = time.perf_counter() - t
    cases = json.loads(open(jobs).read())["cases"]
    out = {"version": version, "cases": {c["id"]: run(c) for c in cases}}
    with open(result, "w") as f:
        json.dump(out, f)
    total = time.perf_counter() - t
    took = f"import {imported:.1f} s, total {total:.1f} s"
    print(f"{server} {version}: {len(cases)} cases, {took}", file=sys.stderr)


if __name__ == "__main__":
    main()
