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

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qwen35_reshard.servers.unsplit import STAGE_CACHE_ENV

from support.helpers import ROOT, SUPPORT

pytestmark = pytest.mark.slow

RANK = SUPPORT / "deployment_rank.py"


def lookups(hub, agent: str) -> list[str]:
    """The revisions the process whose User-Agent has ``agent`` looked up (``/revision/{rev}``)."""
    return [e.path.rsplit("/revision/", 1)[1] for e in hub.log if "/revision/" in e.path and agent in e.agent]


def two_ranks(
    tmp_path: Path, hub, specs: list[dict], *, python: str = sys.executable, between=None
) -> list[str]:
    """Run both ranks; rank 1 waits (in the group) until rank 0 looked up its revision on the Hub
    and ``between()`` ran. Returns each rank's SERVED/REFUSED line (else its output)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    go = tmp_path / "go"
    procs = []
    for rank, spec in enumerate(specs):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
        env.update(
            PYTHONPATH=str(ROOT), HF_HOME=str(tmp_path / f"hf-node{rank}"), HF_ENDPOINT=hub.url,
            HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_TELEMETRY="1", QWEN35_RESHARD_RETRY_WAIT="0.01",
            **{STAGE_CACHE_ENV: str(tmp_path / f"stages-node{rank}")},  # each node its own disk
        )
        spec = {**spec, "wait_for": str(go) if rank == 1 else None}
        procs.append(subprocess.Popen([python, str(RANK), address, str(rank), json.dumps(spec)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    deadline = time.monotonic() + 120
    while not lookups(hub, "pp0") and procs[0].poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if between is not None:
        between()
    go.touch()
    out = [p.communicate(timeout=300) for p in procs]
    found = [next((ln for ln in o.splitlines() if ln.startswith(("SERVED", "REFUSED"))), "") for o, _ in out]
    return [line or o + e for line, (o, e) in zip(found, out, strict=True)]


@pytest.fixture
def moving_hub(make_checkpoint, tmp_path):
    """``Qwen/Tiny`` at commits A and B (other weights), ``main`` at A."""
    from test_trust import other_weights

    from support.hub_server import HubServer

    model_a = make_checkpoint(shard_bytes=150_000)
    model_b = other_weights(model_a, tmp_path / "model-b")
    with HubServer() as server:
        b = server.add_repo("Qwen/Tiny", model_b)
        a = server.add_repo("Qwen/Tiny", model_a)
        yield server, a, b


def served(line: str) -> dict:
    assert line.startswith("SERVED "), line
    return json.loads(line[len("SERVED "):])


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
