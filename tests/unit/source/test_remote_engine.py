"""The fetch engine (``source.remote.engine``) over every store's transport (``store``: the Hub's
HTTP transport against a real HTTP server speaking the Hub's protocol, the S3 transport through
boto3 against moto's S3 server), faults injected by the servers as a failing store or a broken
proxy makes them: many parts in flight, each chunk at its offset, a dropped part resumed where
it stopped, a stalled one asked again, fewer streams after a 429/503, Retry-After waited,
answers that are not the bytes asked for refused."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from qwen35_reshard.errors import BadInput, RemoteError
from qwen35_reshard.source.remote import engine
from qwen35_reshard.source.remote.parts import split
from qwen35_reshard.source.remote.settings import (
    DEFAULT_STREAMS,
    READ_TIMEOUT_ENV,
    STREAMS_ENV,
    streams_setting,
)
from qwen35_reshard.source.remote.store import RETRY_WAIT_ENV, retry_policy

from support.remote import SHARD

# Bytes a stalled read delivers before its silence: one chunk of either transport (botocore's
# read waits for a whole one before handing it on).
STALL_AFTER = 64 << 10


def fetch(e, store, parts):
    """Every part through the engine into a buffer at its offsets; the buffer when all landed."""
    buf = bytearray(len(store.data))
    lock = threading.Lock()

    def sink(pos, chunk):
        with lock:
            buf[pos : pos + len(chunk)] = chunk

    t = e.start(store.file, parts, sink)
    try:
        t.wait_landed(len(store.data))
    finally:
        e.close()
    return bytes(buf)


def test_parts_are_in_flight_together_and_land_at_their_offsets(store):
    data = store.data
    store.set_pacing(rate=2_000_000, latency=0.2)  # long enough for 6 to start together on a loaded machine
    parts = split(SHARD, [(0, len(data))], len(data) // 12 + 1)
    assert fetch(store.engine(streams=6), store, parts) == data
    log = store.log
    # Never more than the streams, and that many at once.
    assert max(in_flight(log, x.started) for x in log) == 6
    got = sorted(e.range for e in log)
    assert got == sorted(f"bytes={p.start}-{p.end - 1}" for p in parts)  # each part asked once


def test_a_part_dropped_mid_body_resumes_where_it_stopped(store):
    data = store.data
    parts = split(SHARD, [(0, len(data))], len(data) // 4 + 1)
    store.drop(after=10_000)
    assert fetch(store.engine(streams=4), store, parts) == data
    cdn = store.log
    dropped = next(e for e in cdn if e.sent == 10_000)
    start = int(dropped.range.split("=")[1].split("-")[0])
    end = dropped.range.split("-")[1]
    assert f"bytes={start + 10_000}-{end}" in [e.range for e in cdn]  # the rest only


@pytest.mark.parametrize("status", [429, 503])
def test_too_many_requests_means_fewer_streams_then_a_retry(store, caplog, status):
    data = store.data
    store.set_pacing(latency=0.02)
    parts = split(SHARD, [(0, len(data))], len(data) // 16 + 1)
    store.answer(status, times=3)
    e = store.engine(streams=8)
    with caplog.at_level(logging.WARNING):
        assert fetch(e, store, parts) == data
    cuts = [r.getMessage() for r in caplog.records if "streams from now on" in r.getMessage()]
    assert cuts and f"answered {status}" in cuts[0]
    assert int(cuts[0].split(": ")[-1].split()[0]) < 8  # halved: fewer in flight
    assert [x.status for x in store.log].count(status) == 3  # each retried, none fatal


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


@pytest.mark.parametrize("raw", ["soon", "0", "-1"])
def test_a_retry_wait_that_is_not_a_positive_number_is_one_line_naming_it(monkeypatch, raw):
    monkeypatch.setenv(RETRY_WAIT_ENV, raw)
    with pytest.raises(BadInput, match=f"{RETRY_WAIT_ENV}='{raw}': set it to a positive number of seconds"):
        retry_policy()
    monkeypatch.setenv(RETRY_WAIT_ENV, "0.25")
    assert retry_policy().wait == 0.25


def in_flight(log, at):
    """How many requests the server was answering at ``at``: an entry is in flight over
    [started, answered), ``answered`` stamped before the write of the answer's last byte, which the
    client needs before it sends its next request (``ended``, stamped after that write, may come
    after the next request on a busy machine: counting to it saw requests the client had finished)."""
    return sum(1 for y in log if y.started <= at < y.answered)


def test_a_stalled_part_is_asked_again_from_its_first_missing_byte(store, caplog, monkeypatch):
    data = store.data
    monkeypatch.setenv(READ_TIMEOUT_ENV, "1")
    parts = split(SHARD, [(0, len(data))], len(data) // 4 + 1)
    store.drop(after=STALL_AFTER, stall=5.0)  # 206, some bytes, silence
    got = []
    with caplog.at_level(logging.WARNING):
        t = threading.Thread(target=lambda: got.append(fetch(store.engine(), store, parts)))
        t.start()
        t.join(4)  # well before the server would end the stall itself
    assert got == [data]
    retries = [r.getMessage() for r in caplog.records if "retrying" in r.getMessage()]
    stalled = [
        f"bytes {p.start + STALL_AFTER}-{p.end - 1}: the connection failed (ReadTimeout" for p in parts
    ]
    assert any(s in r for r in retries for s in stalled)  # asked again for the rest only


def test_close_during_a_stalled_read_returns_at_once_and_nothing_lands_after(store):
    data = store.data
    store.drop(after=STALL_AFTER, stall=30.0)
    calls, first = [], threading.Event()
    e = store.engine(streams=1)  # the default read timeout: a minute

    def sink(pos, chunk):
        calls.append(pos)
        first.set()

    e.start(store.file, split(SHARD, [(0, len(data))], len(data)), sink)
    assert first.wait(5)
    time.sleep(0.3)  # the read is now waiting on the silent server
    closing = threading.Thread(target=e.close, daemon=True)
    closing.start()
    closing.join(2)
    assert not closing.is_alive()  # cleanup after Ctrl-C or another shard's failure is prompt
    seen = len(calls)
    store.end_stalls()  # the server drops the stalled connection: the read returns
    time.sleep(0.5)
    assert len(calls) == seen  # after close(), no sink is called again


def test_after_a_503_no_more_than_half_are_in_flight_until_parts_succeed(store, caplog):
    data = store.data
    parts = split(SHARD, [(0, len(data))], len(data) // 24 + 1)  # rounds enough to see streams come back
    # Every answer waits 0.2 s and its body takes ~0.2 s more: the 503 (the first read in,
    # answered with no body) reaches the client while the first round's others are still being
    # sent, so the client has cut before any of them ends.
    store.set_pacing(rate=parts[0].end / 0.2, latency=0.2)
    store.answer(503)
    with caplog.at_level(logging.WARNING):
        assert fetch(store.engine(streams=8), store, parts) == data
    cuts = [r.getMessage() for r in caplog.records if "streams from now on" in r.getMessage()]
    assert len(cuts) == 1
    cut = int(cuts[0].split(": ")[-1].split()[0])
    assert 1 <= cut <= 4
    log = store.log
    busy = next(x for x in log if x.status == 503)
    # Each stream's first read may have been asked for before the cut however late it comes in
    # (a thread that starts late on a busy machine): the first 8 in are not asked of the cut.
    after = [x for x in log[8:] if x.started >= busy.answered]
    first_round = [in_flight(log, x.started) for x in after[:cut]]
    assert max(first_round) <= cut  # the server asked for fewer: it got fewer, the 503's retry too
    assert max(in_flight(log, x.started) for x in after) > cut  # and more again once parts succeed


def test_a_retry_of_a_closed_generation_leaves_the_next_generations_count_alone(store):
    """A stream whose backoff ended just as close() reset the count (and a new start() cut
    it) is of the old generation: it gives up no place of the new one's on its way out."""
    e = store.engine(streams=8)
    e._active, e.limit = 5, 2  # the new generation's, after its cut
    stopped = threading.Event()
    stopped.set()  # the old generation's stop, set by close()
    with pytest.raises(engine._Cancelled):
        e._within_limit(stopped)
    assert (e._active, e.limit) == (5, 2)


def test_retry_after_is_waited_and_a_read_in_the_callers_thread_keeps_the_streams(store):
    data = store.data
    e = store.engine(streams=8)
    store.answer(429, retry_after=1)
    assert e.read(store.file, 0, 1000) == data[:1000]
    busy, retry = store.log[-2:]
    assert busy.status == 429 and retry.status == 206
    assert retry.started - busy.answered >= 0.9  # Retry-After: 1, not the policy's 0.05 s
    assert e.limit == 8  # one header read backing off says nothing of the parallel streams


@pytest.mark.parametrize("lie", ["shift", "ignore_range"])
def test_an_answer_that_is_not_the_bytes_asked_for_is_refused(store, lie):
    """A broken proxy's lies: the bytes one further on (and a Content-Range saying so), or the
    whole object for a ranged read. Refused outright, never used, never retried into success."""
    getattr(store, lie)()
    with pytest.raises(RemoteError) as refused:
        store.engine().read(store.file, 100, 5000)
    if lie == "shift":
        assert f"asked for bytes 100-4999 of {len(store.data)} but" in str(refused.value)
    else:
        assert ("ignored the Range request" if store.kind == "hub" else "answered 200") in str(refused.value)
    assert len(store.log) == 1  # asked once: another try cannot mend a lie


def test_a_read_that_never_delivers_ends_in_one_line_after_the_retries(store):
    store.drop(after=0, times=100)
    with pytest.raises(RemoteError, match="6 failures in a row, the last: the connection failed"):
        store.engine().read(store.file, 100, 5000)
    # 6 tries (one might not reach a server loaded by the other tests: a connection refused)
    assert 1 <= len(store.log) <= 6
