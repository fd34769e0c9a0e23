"""The fetch engine (``source.remote.engine``) over the Hub's HTTP transport, against a real HTTP
server speaking the Hub's protocol: many parts in flight, each chunk at its offset, a dropped
part resumed where it stopped, a stalled one asked again, fewer streams after a 429/503."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from qwen35_reshard.errors import BadInput
from qwen35_reshard.source.remote.engine import (
    DEFAULT_STREAMS,
    READ_TIMEOUT_ENV,
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


def in_flight(log, at):
    """How many requests the server was answering at ``at`` (an entry is in flight over
    [started, ended): the client cannot send its next request before the answer's last byte)."""
    return sum(1 for y in log if y.started <= at < y.ended)


def test_a_stalled_part_is_asked_again_from_its_first_missing_byte(served, caplog, monkeypatch):
    hub, commit, data = served
    monkeypatch.setenv(READ_TIMEOUT_ENV, "1")
    parts = split(SHARD, [(0, len(data))], len(data) // 4 + 1)
    hub.add_fault(Fault(SHARD, after=10_000, ranged=True, stall=5.0))  # 206, some bytes, silence
    got = []
    with caplog.at_level(logging.WARNING):
        t = threading.Thread(target=lambda: got.append(fetch(hub_engine(hub, commit), data, commit, parts)))
        t.start()
        t.join(4)  # well before the server would end the stall itself
    assert got == [data]
    retries = [r.getMessage() for r in caplog.records if "retrying" in r.getMessage()]
    stalled = [f"bytes {p.start + 10_000}-{p.end - 1}: the connection failed (ReadTimeout)" for p in parts]
    assert any(s in r for r in retries for s in stalled)  # asked again for the rest only


def test_close_during_a_stalled_read_returns_at_once_and_nothing_lands_after(served):
    hub, commit, data = served
    hub.add_fault(Fault(SHARD, after=10_000, ranged=True, stall=30.0))
    calls, first = [], threading.Event()
    e = hub_engine(hub, commit, streams=1)  # the default read timeout: a minute

    def sink(pos, chunk):
        calls.append(pos)
        first.set()

    e.start(RemoteFile(SHARD, len(data), commit), split(SHARD, [(0, len(data))], len(data)), sink)
    assert first.wait(5)
    time.sleep(0.3)  # the read is now waiting on the silent server
    closing = threading.Thread(target=e.close, daemon=True)
    closing.start()
    closing.join(2)
    assert not closing.is_alive()  # cleanup after Ctrl-C or another shard's failure is prompt
    seen = len(calls)
    hub.state.stopped.set()  # the server drops the stalled connection: the read returns
    time.sleep(0.5)
    assert len(calls) == seen  # after close(), no sink is called again


def test_after_a_503_no_more_than_half_are_in_flight_until_parts_succeed(served, caplog):
    hub, commit, data = served
    hub.set_pacing(latency=0.1)
    parts = split(SHARD, [(0, len(data))], len(data) // 48 + 1)
    hub.add_fault(Fault(SHARD, status=503, ranged=True))
    with caplog.at_level(logging.WARNING):
        assert fetch(hub_engine(hub, commit, streams=8), data, commit, parts) == data
    cuts = [r.getMessage() for r in caplog.records if "streams from now on" in r.getMessage()]
    assert len(cuts) == 1
    cut = int(cuts[0].split(": ")[-1].split()[0])
    assert 1 <= cut <= 4
    log = hub.log
    busy = next(x for x in log if x.status == 503)
    after = sorted((x for x in log if x.started >= busy.ended), key=lambda x: x.started)
    first_round = [in_flight(log, x.started) for x in after[:cut]]
    assert max(first_round) <= cut  # the server asked for fewer: it got fewer
    assert max(in_flight(log, x.started) for x in after) > cut  # and more again once parts succeed


def test_retry_after_is_waited_and_a_read_in_the_callers_thread_keeps_the_streams(served):
    hub, commit, data = served
    e = hub_engine(hub, commit, streams=8)
    hub.add_fault(Fault(SHARD, status=429, ranged=True, retry_after=1))
    assert e.read(RemoteFile(SHARD, len(data), commit), 0, 1000) == data[:1000]
    busy, retry = [x for x in hub.log if x.range is not None][-2:]
    assert busy.status == 429 and retry.status == 206
    assert retry.started - busy.ended >= 0.9  # Retry-After: 1, not the policy's 0.05 s
    assert e.limit == 8  # one header read backing off says nothing of the parallel streams
