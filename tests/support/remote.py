"""Every store's server seen the same way by the fetch engine's tests: a shard of the tiny
checkpoint served by the tests' Hub server (its CDN origin) or by moto's S3 server, a fetch
engine over the store's own transport, pacing, faults as a failing server or a broken proxy
makes them, and the log of the shard's data reads. Real HTTP for both: no library is patched.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import get_session, hf_hub_url
from huggingface_hub.utils import hf_raise_for_status

from qwen35_reshard.source.ranged import HttpTransport
from qwen35_reshard.source.remote.engine import FetchEngine, RemoteFile, RetryPolicy, Transport

from support.hub_server import Fault, HubServer
from support.s3_server import S3Fault, S3Server

SHARD = "model-00002-of-00004.safetensors"  # a shard of the tests' tiny checkpoint
STORES = ("hub", "s3")


def hub_engine(hub, commit: str, *, streams: int = 4, counter=None, headers=None) -> FetchEngine:
    """An engine reading ``Qwen/Tiny`` at ``commit`` from ``hub``, retrying after 0.05 s."""
    transport = HttpTransport(
        lambda name: hf_hub_url("Qwen/Tiny", name, revision=commit, endpoint=hub.url),
        display="Qwen/Tiny",
        session=get_session(),
        headers=headers or {},
        raise_for_status=hf_raise_for_status,
        counter=counter,
    )
    return FetchEngine(transport, streams=streams, policy=RetryPolicy(wait=0.05))


@dataclass
class Read:
    """One data read of the shard as its server logged it."""

    range: str | None
    status: int
    sent: int
    started: float
    ended: float
    answered: float  # just before the server wrote the answer's last byte (hub_server.LogEntry)


class Served:
    """SHARD on one store's server (see the module docstring). ``kind`` is ``"hub"`` or ``"s3"``."""

    def __init__(
        self, kind: str, data: bytes, file: RemoteFile, transport: Callable[[], Transport], server: object
    ) -> None:
        self.kind, self.data, self.file, self.server = kind, data, file, server
        self._transport = transport

    def engine(self, streams: int = 4) -> FetchEngine:
        """An engine over a new transport of the store (its settings read now), retrying after 0.05 s."""
        return FetchEngine(self._transport(), streams=streams, policy=RetryPolicy(wait=0.05))

    def set_pacing(self, rate: float | None = None, latency: float = 0.0) -> None:
        if self.kind == "hub":
            self.server.set_pacing(rate=rate, latency=latency)
        else:
            self.server.rate, self.server.latency = rate, latency

    def answer(self, status: int, *, times: int = 1, retry_after: int | None = None) -> None:
        """The next ``times`` data reads answered ``status``."""
        if self.kind == "hub":
            fault = Fault(SHARD, status=status, times=times, ranged=True, retry_after=retry_after)
            self.server.add_fault(fault)
        else:
            self.server.add_fault(S3Fault(SHARD, status=status, times=times, retry_after=retry_after))

    def drop(self, after: int, *, times: int = 1, stall: float = 0.0) -> None:
        """The next ``times`` data reads cut after ``after`` body bytes (after ``stall`` s of silence)."""
        if self.kind == "hub":
            self.server.add_fault(Fault(SHARD, after=after, times=times, ranged=True, stall=stall))
        else:
            self.server.add_fault(S3Fault(SHARD, status=None, times=times, after=after, stall=stall))

    def shift(self) -> None:
        """The next data read answered with the bytes one further on, and says so: a broken proxy."""
        if self.kind == "hub":
            self.server.add_fault(Fault(SHARD, shift=True, ranged=True))
        else:
            self.server.add_fault(S3Fault(SHARD, status=None, shift=True))

    def ignore_range(self) -> None:
        """Data reads answered with the whole object (200): a proxy that drops ``Range``."""
        if self.kind == "hub":
            self.server.set_ignore_range(True)
        else:
            self.server.add_fault(S3Fault(SHARD, status=None, ignore_range=True, times=100))

    def end_stalls(self) -> None:
        (self.server.state.stopped if self.kind == "hub" else self.server.stopped).set()

    @property
    def log(self) -> list[Read]:
        """The shard's data reads, in the order they came in, once none is being answered."""
        if self.kind == "hub":
            entries = [e for e in self.server.log if e.origin == "cdn"]
        else:
            entries = sorted(self.server.gets(SHARD), key=lambda e: e.started)
        return [Read(e.range, e.status, e.sent, e.started, e.ended, e.answered) for e in entries]


def served_hub(model: Path):
    """SHARD of ``model`` as ``Qwen/Tiny`` on a fresh Hub server (a context manager's generator)."""
    with HubServer() as hub:
        commit = hub.add_repo("Qwen/Tiny", model)
        data = (model / SHARD).read_bytes()
        file = RemoteFile(SHARD, len(data), commit)
        yield Served("hub", data, file, lambda: hub_engine(hub, commit).transport, hub)


def served_s3(s3: S3Server, model: Path, monkeypatch) -> Served:
    """SHARD of ``model`` in a bucket of ``s3`` (faults, log and pacing reset), read through
    the S3 store as a run reaches it: boto3 with the standard AWS variables."""
    from qwen35_reshard.source.s3.store import open_s3

    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
    uri = s3.upload(model, "engine-tests", "tiny")
    s3.faults.clear()
    s3.clear_log()
    s3.rate, s3.latency, s3.peak_in_flight = None, 0.0, 0
    s3.stopped.clear()
    store = open_s3(uri)
    data = (model / SHARD).read_bytes()
    return Served("s3", data, store.remote(SHARD), lambda: open_s3(uri).transport(), s3)
