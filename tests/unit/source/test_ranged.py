"""The Hub's HTTP transport, read through the fetch engine, against a real HTTP server speaking
the Hub's file protocol.

Each test reads byte ranges of a shard through ``/resolve`` (a redirect to the CDN origin) and
checks the bytes against the file, or that a wrong answer is refused.
"""

from __future__ import annotations

import pytest

from qwen35_reshard.errors import RemoteError
from qwen35_reshard.source.ranged import RangeError
from qwen35_reshard.source.remote.engine import RemoteFile

from support.hub_server import Fault
from support.remote import SHARD, hub_engine


class Counter:
    def __init__(self):
        self.bytes = self.requests = 0

    def add(self, n):
        self.bytes += n

    def request(self):
        self.requests += 1


def test_one_request_per_range_and_the_cdn_address_is_kept(served):
    hub, commit, data = served
    counter = Counter()
    e = hub_engine(hub, commit, counter=counter, headers={"authorization": "Bearer hf_x"})
    f = RemoteFile(SHARD, len(data), commit)
    spans = [(100, 50_000), (60_000, 200_000), (200_000, 200_001)]
    assert [e.read(f, a, b) for a, b in spans] == [data[a:b] for a, b in spans]
    assert counter.bytes == sum(b - a for a, b in spans)
    assert counter.requests == 4  # the redirect counts: it is a request
    log = hub.log
    # The first range goes through /resolve (302), the others straight to the CDN.
    assert [(x.origin, x.status) for x in log] == [("hub", 302)] + [("cdn", 206)] * 3
    assert [x.range for x in log[1:]] == ["bytes=100-49999", "bytes=60000-199999", "bytes=200000-200000"]
    assert log[0].auth and not any(x.auth for x in log[1:])  # the token stays on the Hub


def test_transient_status_is_retried_and_an_expired_cdn_address_renewed(served):
    hub, commit, data = served
    e = hub_engine(hub, commit)
    f = RemoteFile(SHARD, len(data), commit)
    assert e.read(f, 0, 10) == data[:10]
    hub.add_fault(Fault(SHARD, status=503))
    hub.add_fault(Fault(SHARD, status=403))  # the signed address expired: ask /resolve again
    assert e.read(f, 1000, 90_000) == data[1000:90_000]
    statuses = [(x.origin, x.status) for x in hub.log][2:]
    assert statuses == [("cdn", 503), ("cdn", 403), ("hub", 302), ("cdn", 206)]


def test_dropped_connection_resumes_at_the_first_missing_byte(served):
    hub, commit, data = served
    hub.add_fault(Fault(SHARD, after=7000, ranged=True))
    e = hub_engine(hub, commit)
    assert e.read(RemoteFile(SHARD, len(data), commit), 500, 150_000) == data[500:150_000]
    ranges = [x.range for x in hub.log if x.origin == "cdn"]
    assert ranges == ["bytes=500-149999", "bytes=7500-149999"]


@pytest.mark.parametrize(
    "fault, error, message",
    [
        (Fault(SHARD, shift=True), RangeError, "refusing bytes that may not be the ones asked for"),
        (
            Fault(SHARD, after=0, times=100, ranged=True),
            RemoteError,
            "6 failures in a row, the last: the connection failed",
        ),
    ],
)
def test_wrong_or_missing_answers_are_refused(served, fault, error, message):
    hub, commit, data = served
    hub.add_fault(fault)
    with pytest.raises(error, match=message):
        hub_engine(hub, commit).read(RemoteFile(SHARD, len(data), commit), 100, 5000)


def test_a_server_ignoring_range_is_refused(served):
    hub, commit, data = served
    hub.set_ignore_range(True)
    with pytest.raises(RangeError, match="ignored the Range request"):
        hub_engine(hub, commit).read(RemoteFile(SHARD, len(data), commit), 0, 8)


def test_a_size_that_changed_is_refused(served):
    hub, commit, data = served
    with pytest.raises(RangeError, match="refusing"):
        hub_engine(hub, commit).read(RemoteFile(SHARD, len(data) + 1, commit), 0, 8)
