"""One deployment, one commit inside the servers' own process groups (issue 37): the two-node
run of tests/e2e/test_deployment.py (``main`` moved after rank 0's lookup, before rank 1's),
each rank a process that sets up the server's own distributed state over gloo (vLLM's world and
pipeline groups; SGLang's published context and groups) and gets its stage through the server
integration's own call (vLLM's ``own_stage``, what the load format runs before the model is
built; SGLang's ``target_stage``), with the server's ``get_pp_indices``."""

from __future__ import annotations

import pytest

from support.deployment import lookups, moving_hub_at, served, two_ranks

pytestmark = [pytest.mark.engine, pytest.mark.slow]


@pytest.mark.parametrize("server", ["vllm", "sglang"])
def test_main_moving_between_two_nodes_starts_leaves_both_on_one_commit(tmp_path, server, make_checkpoint):
    if server == "vllm":
        from test_vllm_engine import vllm_python as python_of
    else:
        from test_sglang_loading import require_sglang_python as python_of
    with moving_hub_at(make_checkpoint, tmp_path) as (hub, a, b):
        spec = {"server": server, "model": "Qwen/Tiny", "runtime": server}
        lines = two_ranks(tmp_path, hub, [spec, spec], python=str(python_of()),
                          between=lambda: hub.move("Qwen/Tiny", b))
        ranks = [served(line) for line in lines]
        print(f"{server}: main moved A={a} -> B={b} after rank 0's lookup: "
              + "; ".join(f"rank {r['rank']} served {r['commit']}" for r in ranks))
        assert [r["commit"] for r in ranks] == [a, a]
        assert lookups(hub, "pp0").count("main") == 1 and "main" not in lookups(hub, "pp1")
