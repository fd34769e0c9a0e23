"""The fetch engine (``source.remote.engine``) over the Hub's HTTP transport, against a real HTTP
server speaking the Hub's protocol: many parts in flight, each chunk at its offset, a dropped
part resumed where it stopped, fewer streams after a 429/503."""

from __future__ import annotations

import logging
import threading

import pytest

from qwen35_reshard.errors import BadInput
from qwen35_reshard.source.remote.engine import (
    DEFAULT_STREAMS,
    STREAMS_ENV,
    RemoteFile,
    streams_setting,
)
from qwen35_reshard.source.remote.parts import split

from support.hub_server import Fault
from support.remote import SHARD, hub_engine


def fetch(e, data, commit, parts):
    """Every part through the engine into a buffer at its offsets; the buffer when all landed."""
    buf = bytearray(len(data))
    lock = threading.Lock()

    def sink(pos, chunk):
        with lock:
            buf[pos : pos + len(chunk)] = chunk

    t = e.start(RemoteFile(SHARD, len(data), commit), parts, sink)
    try:
        t.wait_landed(len(data))
    finally:
        e.close()
    return bytes(buf)


def test_parts_are_in_flight_together_and_land_at_their_offsets(served):
    hub, commit, data = served
    hub.set_pacing(rate=2_000_000, latency=0.05)
    parts = split(SHARD, [(0, len(data))], len(data) // 12 + 1)
    assert fetch(hub_engine(hub, commit, streams=6), data, commit, parts) == data
    assert hub.peak_in_flight == 6  # never more than the streams, and that many at once
    got = sorted(e.range for e in hub.log if e.origin == "cdn")
    assert got == sorted(f"bytes={p.start}-{p.end - 1}" for p in parts)  # each part asked once


def test_a_part_dropped_mid_body_resumes_where_it_stopped(served):
    hub, commit, data = served
    parts = split(SHARD, [(0, len(data))], len(data) // 4 + 1)
    hub.add_fault(Fault(SHARD, after=10_000, ranged=True))
    assert fetch(hub_engine(hub, commit, streams=4), data, commit, parts) == data
    cdn = [e for e in hub.log if e.origin == "cdn"]
    dropped = next(e for e in cdn if e.sent == 10_000)
    start = int(dropped.range.split("=")[1].split("-")[0])
    end = dropped.range.split("-")[1]
    assert f"bytes={start + 10_000}-{end}" in [e.range for e in cdn]  # the rest only


@pytest.mark.parametrize("status", [429, 503])
def test_too_many_requests_means_fewer_streams_then_a_retry(served, caplog, status):
    hub, commit, data = served
    hub.set_pacing(latency=0.02)
    parts = split(SHARD, [(0, len(data))], len(data) // 16 + 1)
    hub.add_fault(Fault(SHARD, status=status, times=3))
    e = hub_engine(hub, commit, streams=8)
    with caplog.at_level(logging.WARNING):
        assert fetch(e, data, commit, parts) == data
    cuts = [r.getMessage() for r in caplog.records if "streams from now on" in r.getMessage()]
    assert cuts and f"answered {status}" in cuts[0]
    assert int(cuts[0].split(": ")[-1].split()[0]) < 8  # halved: fewer in flight
    assert [x.status for x in hub.log if x.origin == "cdn"].count(status) == 3  # each retried, none fatal


def test_the_streams_setting(monkeypatch):
    monkeypatch.delenv(STREAMS_ENV, raising=False)
    assert streams_setting(None) == DEFAULT_STREAMS >= 8  # huggingface_hub's snapshot_download: 8
    monkeypatch.setenv(STREAMS_ENV, "3")
    assert streams_setting(None) == 3
    assert streams_setting(5) == 5  # the caller's setting wins
    monkeypatch.setenv(STREAMS_ENV, "many")
    with pytest.raises(BadInput, match=f"{STREAMS_ENV}='many'"):
        streams_setting(None)
    with pytest.raises(BadInput, match="streams must be at least 1"):
        streams_setting(0)
