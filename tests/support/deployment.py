"""Two ranks of one deployment as two processes, as on two nodes (issue 37), with a branch moved
on the tests' Hub between their lookups; used by tests/e2e/test_deployment.py and
tests/engine/test_deployment_engines.py. Each rank runs tests/support/deployment_rank.py."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from qwen35_reshard.servers.unsplit import STAGE_CACHE_ENV

from .helpers import ROOT, SUPPORT, other_weights

RANK = SUPPORT / "deployment_rank.py"


def lookups(hub, agent: str) -> list[str]:
    """The revisions the process whose User-Agent has ``agent`` looked up (``/revision/{rev}``)."""
    return [e.path.rsplit("/revision/", 1)[1] for e in hub.log if "/revision/" in e.path and agent in e.agent]


def two_ranks(
    tmp_path: Path, hub, specs: list[dict], *, python: str = sys.executable, between=None,
    hold: bool = True, timeout: float = 300,
) -> list[str]:
    """Run both ranks; rank 1 waits (in the group) until rank 0 looked up its revision on the Hub
    and ``between()`` ran (``hold=False``: it does not wait). Returns each rank's SERVED/REFUSED
    line (else its output); both ranks are killed if they run past ``timeout`` seconds."""
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
        spec = {**spec, "wait_for": str(go) if rank == 1 and hold else None}
        procs.append(subprocess.Popen([python, str(RANK), address, str(rank), json.dumps(spec)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        deadline = time.monotonic() + 120
        while hold and not lookups(hub, "pp0") and procs[0].poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if between is not None:
            between()
        go.touch()
        ends = time.monotonic() + timeout
        out = [p.communicate(timeout=max(0.1, ends - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    found = [next((ln for ln in o.splitlines() if ln.startswith(("SERVED", "REFUSED"))), "") for o, _ in out]
    return [line or o + e for line, (o, e) in zip(found, out, strict=True)]


@contextlib.contextmanager
def moving_hub_at(make_checkpoint, tmp_path: Path):
    """The tests' Hub with ``Qwen/Tiny`` at commits A and B (other weights), ``main`` at A:
    yields (server, A, B)."""
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
