"""A node directory's experts (stage/nodes.py ``expert_problems``): every MoE layer the stage
holds a router of is checked, whatever layers its manifest lists."""

from __future__ import annotations

import dataclasses
import json

import qwen35_reshard
from qwen35_reshard.stage.nodes import expert_problems
from qwen35_reshard.stage.reader import read_manifest


def test_an_mtp_layer_the_manifest_leaves_out_is_still_checked(make_checkpoint, tmp_path):
    model = make_checkpoint(layout="per_expert")
    qwen35_reshard.reshard(model, tmp_path / "out", pp=2, ep=2, nodes=2)
    node = tmp_path / "out" / "pp1-node0"
    m = read_manifest(node, "pp1-node0")
    assert "mtp.layers.0.mlp.gate.weight" in m.tensors and "mtp.layers.0" in m.node.experts
    config = json.loads((node / "config.json").read_text())
    gone = f"mtp.layers.0.mlp.experts.{m.node.experts['mtp.layers.0'][0]}.up_proj.weight"
    experts = {k: v for k, v in m.node.experts.items() if k != "mtp.layers.0"}
    damaged = dataclasses.replace(
        m, node=dataclasses.replace(m.node, experts=experts),
        tensors={k: v for k, v in m.tensors.items() if k != gone},
    )  # fmt: skip
    assert expert_problems("pp1-node0", m, config, [])[1] == []
    _, problems = expert_problems("pp1-node0", damaged, config, [])
    (lacking,) = [p for p in problems if p.tensor is not None]
    assert lacking.tensor == gone.removesuffix(".weight") and "of mtp.layers.0 (up_proj)" in lacking.message
    assert any("the experts it records for mtp.layers.0" in p.message for p in problems)
