"""Servers paced like a real link (a rate per connection, a wait per request), and the
environment a process needs to use them: the Hub of ``tests/support/hub_server.py`` and the S3
of ``tests/support/s3_server.py`` (moto), both on 127.0.0.1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from benchmarks.lib.trees import ROOT

sys.path.insert(0, str(ROOT / "tests"))
from support.hub_server import HubServer, LogEntry  # noqa: E402

__all__ = ["HubServer", "LogEntry", "hub_env", "s3_server"]

# Settings of the tool or the Hub client a benchmark must not inherit from the shell.
_FOREIGN = ("HF_", "HUGGINGFACE_", "QWEN35_")


def hub_env(base: dict[str, str], hub: HubServer, node: Path) -> dict[str, str]:
    """``base`` as a fresh node that fetches from ``hub``: its own HF cache and stage cache."""
    env = {k: v for k, v in base.items() if not k.startswith(_FOREIGN)}
    env.update(
        HF_HOME=str(node / "hf"),
        HF_ENDPOINT=hub.url,
        HF_HUB_DISABLE_XET="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        QWEN35_RESHARD_STAGE_CACHE=str(node / "stages"),
    )
    return env


def link_name(rate: float | None, latency: float) -> str:
    if not rate:
        return "unpaced loopback"
    return f"{rate / 1e6:g} MB/s per connection, {latency * 1e3:g} ms per request"


@contextmanager
def s3_server(rate: float | None, latency: float) -> Iterator[dict]:
    """moto's S3 server in a process of its own (one GIL for it, one for the client measured),
    paced per request; yields its endpoint and credentials."""
    argv = [sys.executable, str(ROOT / "tests/support/s3_server.py"), "--latency", str(latency)]
    argv += ["--rate", str(rate)] if rate else []
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests")}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        yield json.loads(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait()
