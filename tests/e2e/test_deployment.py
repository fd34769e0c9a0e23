"""One deployment, one commit (qwen35_reshard/servers/deployment.py, issue 37): two ranks, each its
own process as on its own node, joined in a real gloo group, each getting its stage of the
unsplit Hub repo the way the servers' loaders do, with ``main`` moved on the tests' Hub
(tests/support/hub_server.py) after rank 0's lookup and before rank 1's (a file barrier in
tests/support/deployment_rank.py: rank 1 waits for it once in the group; the test writes it once
the Hub logged rank 0's lookup and ``main`` moved).

Before this, each rank resolved ``main`` itself: rank 0 served commit A, rank 1 commit B. Now
rank 0 resolves once for the deployment and every rank serves A; a rank given another commit
stops every rank with one line naming both. The same exchange runs in vLLM's and SGLang's own
process groups in tests/engine/test_deployment_engines.py.
"""

from __future__ import annotations

import pytest

from support.deployment import lookups, moving_hub_at, served, two_ranks

pytestmark = pytest.mark.slow


@pytest.fixture
def moving_hub(make_checkpoint, tmp_path):
    with moving_hub_at(make_checkpoint, tmp_path) as hub:
        yield hub


@pytest.mark.parametrize("runtime", ["vllm", "sglang"])
def test_main_moving_between_two_nodes_lookups_leaves_every_rank_on_one_commit(tmp_path, moving_hub, runtime):
    hub, a, b = moving_hub
    spec = {"server": "none", "model": "Qwen/Tiny", "runtime": runtime}
    lines = two_ranks(tmp_path, hub, [spec, spec], between=lambda: hub.move("Qwen/Tiny", b))
    ranks = [served(line) for line in lines]
    print(f"main moved A={a} -> B={b} after rank 0's lookup: "
          + "; ".join(f"rank {r['rank']} served {r['commit']}" for r in ranks))
    assert [r["commit"] for r in ranks] == [a, a]
    assert [r["layers"] for r in ranks] == [[0, 4], [4, 8]]
    # rank 0 looked main up once for both; rank 1 never asked the Hub what main is
    assert lookups(hub, "pp0").count("main") == 1 and "main" not in lookups(hub, "pp1")


def test_a_rank_given_another_commit_stops_every_rank_naming_both(tmp_path, moving_hub):
    hub, a, b = moving_hub
    spec = {"server": "none", "model": "Qwen/Tiny", "runtime": "vllm"}
    lines = two_ranks(tmp_path, hub, [spec, {**spec, "revision": b}])
    for line in lines:
        assert line.startswith("REFUSED ") and "\n" not in line, line
        assert a in line and b in line and "--revision" in line, line
    assert lines[0] == lines[1]
    assert not list((tmp_path / "stages-node0").rglob("*.safetensors"))  # nothing fetched


def test_rank_0_failing_to_resolve_stops_every_rank_with_its_line(tmp_path, moving_hub):
    hub, _, _ = moving_hub
    spec = {"server": "none", "model": "Qwen/Tiny", "runtime": "vllm", "revision": "no-such-branch"}
    lines = two_ranks(tmp_path, hub, [spec, spec])
    assert lines[0] == lines[1] and lines[0].startswith("REFUSED ") and "no-such-branch" in lines[0], lines


def test_any_failure_of_rank_0s_lookup_stops_every_rank_with_its_line(tmp_path):
    """Not only a StageError: rank 0's node lacks huggingface_hub (ModuleNotFoundError). Raised
    on rank 0 alone, rank 1 waited in the exchange until the group timed out (30 min)."""
    from support.hub_server import HubServer

    spec = {"server": "none", "model": "Qwen/Tiny", "runtime": "vllm", "without": {"0": ["huggingface_hub"]}}
    with HubServer() as hub:
        lines = two_ranks(tmp_path, hub, [spec, spec], hold=False, timeout=90)
    assert lines[0] == lines[1] and lines[0].startswith("REFUSED ") and "\n" not in lines[0], lines
    assert "rank 0 resolves the model's revision" in lines[0] and "huggingface_hub" in lines[0], lines
