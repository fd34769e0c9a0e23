"""The range reader against a real HTTP server speaking the Hub's file protocol.

Each test reads byte ranges of a shard through ``/resolve`` (a redirect to the CDN origin) and
checks the bytes against the file, or that a wrong answer is refused.
"""

from __future__ import annotations

import pytest
from huggingface_hub import get_session, hf_hub_url
from huggingface_hub.utils import hf_raise_for_status

from qwen35_reshard.source.ranged import RangeError, RangeReader

from support.hub_server import Fault, HubServer

FILE = "model-00002-of-00004.safetensors"


@pytest.fixture
def served(make_checkpoint):
    model = make_checkpoint()
    with HubServer() as hub:
        commit = hub.add_repo("Qwen/Tiny", model)
        url = hf_hub_url("Qwen/Tiny", FILE, revision=commit, endpoint=hub.url)
        yield hub, url, (model / FILE).read_bytes()


class Counter:
    def __init__(self):
        self.bytes = 0

    def add(self, n):
        self.bytes += n


def reader(url, **kwargs):
    return RangeReader(
        url,
        display=FILE,
        session=get_session(),
        headers={"authorization": "Bearer hf_x"},
        raise_for_status=hf_raise_for_status,
        wait=0.01,
        **kwargs,
    )


def read_spans(r, spans, window=30_000):
    r.expect(spans)
    out = []
    for a, b in spans:
        buf = bytearray(b - a)
        for p in range(0, b - a, window):
            r.readinto(memoryview(buf)[p : p + window], a + p)
        out.append(bytes(buf))
    return out


def test_one_request_per_run_and_the_cdn_address_is_kept(served):
    hub, url, data = served
    counter = Counter()
    spans = [(100, 50_000), (60_000, 200_000), (200_000, 200_001)]
    got = read_spans(reader(url, size=len(data), counter=counter), spans)
    assert got == [data[a:b] for a, b in spans]
    assert counter.bytes == sum(b - a for a, b in spans)
    log = hub.log
    # The first range goes through /resolve (302), the others straight to the CDN.
    assert [(e.origin, e.status) for e in log] == [("hub", 302)] + [("cdn", 206)] * 3
    assert [e.range for e in log[1:]] == ["bytes=100-49999", "bytes=60000-199999", "bytes=200000-200000"]
    assert log[0].auth and not any(e.auth for e in log[1:])  # the token stays on the Hub


def test_transient_status_is_retried_and_an_expired_cdn_address_renewed(served):
    hub, url, data = served
    r = reader(url, size=len(data))
    assert r.read(0, 10) == data[:10]
    hub.add_fault(Fault(FILE, status=503))
    hub.add_fault(Fault(FILE, status=403))  # the signed address expired: ask /resolve again
    assert read_spans(r, [(1000, 90_000)]) == [data[1000:90_000]]
    statuses = [(e.origin, e.status) for e in hub.log][2:]
    assert statuses == [("cdn", 503), ("cdn", 403), ("hub", 302), ("cdn", 206)]


def test_dropped_connection_resumes_at_the_first_missing_byte(served):
    hub, url, data = served
    hub.add_fault(Fault(FILE, after=7000, ranged=True))
    assert read_spans(reader(url, size=len(data)), [(500, 150_000)]) == [data[500:150_000]]
    ranges = [e.range for e in hub.log if e.origin == "cdn"]
    assert ranges == ["bytes=500-149999", "bytes=7500-149999"]


@pytest.mark.parametrize(
    "fault, message",
    [
        (Fault(FILE, shift=True), "refusing bytes that may not be the ones asked for"),
        (Fault(FILE, after=0, times=100, ranged=True), "the connection failed 6 times in a row"),
    ],
)
def test_wrong_or_missing_answers_are_refused(served, fault, message):
    hub, url, data = served
    hub.add_fault(fault)
    with pytest.raises(RangeError, match=message):
        read_spans(reader(url, size=len(data)), [(100, 5000)])


def test_a_server_ignoring_range_is_refused(served):
    hub, url, data = served
    hub.set_ignore_range(True)
    with pytest.raises(RangeError, match="ignored the Range request"):
        reader(url).read(0, 8)


def test_a_size_that_changed_is_refused(served):
    _, url, data = served
    with pytest.raises(RangeError, match="refusing"):
        reader(url, size=len(data) + 1).read(0, 8)
