"""A real S3-protocol server on 127.0.0.1: moto's server (its S3, IAM and STS) with signature
checking turned on, wrapped to log, pace and spoil requests.

Why moto: Debian 12's ``radosgw`` (Ceph 16) needs the Ceph stack, and its standalone store is
experimental in that release; no MinIO or SeaweedFS server is packaged for Debian or PyPI.
moto 5.2's server speaks S3 over HTTP as the clients send it (SigV4 signatures, ``Range``,
``If-Match``, ``ListObjectsV2``, versioned buckets) and checks signatures once
``/moto-api/reset-auth`` turns authentication on (docs: /work/shared/docs/remote-reads-facts.md).

moto keeps its state per process: one server at a time (a new one starts empty). The server
starts with two IAM users: ``admin`` (allowed everything; its key is
``credentials``) and ``nobody`` (no policy: every request is AccessDenied; ``denied``).
Every request is logged (method, key, Range, If-Match, status, body bytes sent, User-Agent,
whether a session token came) so that tests assert exactly what was fetched. The server can be
paced like a wide-area link (``rate`` bytes/s per request (moto closes the connection after
every answer: one request, one connection), ``latency`` s before each answer), answer a status
to the next matching GETs, or call ``on_get(entry)`` as a ranged GET arrives (a test stops its
client there).
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlsplit

from .hub_server import pace_piece

REGION = "us-east-1"
_ALLOW_ALL = json.dumps(
    {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
)


@dataclass
class S3Log:
    method: str
    path: str  # /bucket/key (path-style) as requested, unquoted, no query
    query: str
    range: str | None
    if_match: str | None
    status: int = 0
    sent: int = 0  # body bytes written
    agent: str = ""
    session_token: bool = False
    started: float = 0.0  # when the request came in
    ended: float = 0.0  # when its answer's last byte went out: [started, ended) is in flight
    answered: float = 0.0  # just before its last piece was handed to the socket (hub_server.LogEntry)

    @property
    def key(self) -> str:
        """The object key ('' for bucket-level requests)."""
        parts = self.path.lstrip("/").split("/", 1)
        return parts[1] if len(parts) == 2 else ""


@dataclass
class Keys:
    access_key: str
    secret_key: str = field(repr=False)

    def env(self, endpoint: str) -> dict[str, str]:
        """The standard AWS variables for these keys at ``endpoint``."""
        return {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": REGION,
        }


@dataclass
class S3Fault:
    """Spoil the next ``times`` GETs of keys ending in ``suffix`` (ranged only when ``ranged``),
    as a failing store or a broken proxy in front of it would: answer ``status`` (with a
    ``Retry-After`` of ``retry_after`` s); or with ``after``, send that many body bytes, go
    silent ``stall`` s (or until the server stops) and drop the connection; or with ``shift``,
    say in Content-Range that the bytes are those one further on; or with ``ignore_range``,
    answer 200 without a Content-Range, as a proxy that drops ``Range`` does (the request is
    signed, Range included: a lie can only be told in the answer)."""

    suffix: str
    status: int | None = 503
    times: int = 1
    ranged: bool = True
    retry_after: int | None = None
    after: int | None = None
    stall: float = 0.0
    shift: bool = False
    ignore_range: bool = False


def _shifted(content_range: str) -> str:
    """``bytes a-b/n`` one byte further on."""
    span, size = content_range.split()[1].split("/")
    a, b = (int(x) for x in span.split("-"))
    return f"bytes {a + 1}-{b + 1}/{size}"


class _Paced:
    """A WSGI middleware around moto's app: log, pace, fault."""

    def __init__(self, app: Callable, owner: S3Server) -> None:
        self.app, self.owner = app, owner

    def __call__(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        o = self.owner
        entry = S3Log(
            method=environ["REQUEST_METHOD"],
            path=unquote(environ.get("PATH_INFO", "")),
            query=environ.get("QUERY_STRING", ""),
            range=environ.get("HTTP_RANGE"),
            if_match=environ.get("HTTP_IF_MATCH"),
            agent=environ.get("HTTP_USER_AGENT", ""),
            session_token="HTTP_X_AMZ_SECURITY_TOKEN" in environ,
            started=time.monotonic(),
        )
        if not entry.path.startswith("/moto-api"):
            with o.settled:
                o.entries.append(entry)
                o.in_flight += 1
                o.peak_in_flight = max(o.peak_in_flight, o.in_flight)
        if entry.method == "GET" and entry.range and o.on_get is not None:
            o.on_get(entry)
        if o.latency:
            time.sleep(o.latency)
        fault = o.take_fault(entry)
        if fault is not None and fault.status is not None:
            entry.status = fault.status
            headers = [("Content-Length", "0"), ("Connection", "close")]
            if fault.retry_after is not None:
                headers.append(("Retry-After", str(fault.retry_after)))
            start_response(f"{fault.status} Fault", headers)
            return self._paced([b""], entry, None, None)  # ended once the answer is out
        # A lie is told in the answer: the request is signed, Range included (SigV4).
        lie = fault if fault is not None and (fault.shift or fault.ignore_range) else None

        def recording(status: str, headers: list, exc_info: object = None) -> Callable:
            if lie is not None and lie.shift:
                headers = [(k, _shifted(v) if k.lower() == "content-range" else v) for k, v in headers]
            elif lie is not None:
                status, headers = "200 OK", [(k, v) for k, v in headers if k.lower() != "content-range"]
            entry.status = int(status.split()[0])
            return start_response(status, headers, exc_info)

        cut = fault if fault is not None and fault.after is not None else None
        return self._paced(self.app(environ, recording), entry, cut, environ.get("werkzeug.socket"))

    def _done(self, entry: S3Log) -> None:
        with self.owner.settled:
            entry.ended = time.monotonic()
            entry.answered = entry.answered or entry.ended
            if not entry.path.startswith("/moto-api"):
                self.owner.in_flight -= 1
            self.owner.settled.notify_all()

    def _paced(
        self, body: Iterable[bytes], entry: S3Log, cut: S3Fault | None, sock: object
    ) -> Iterable[bytes]:
        rate, started = self.owner.rate, time.monotonic()
        try:
            for chunk in body:
                step = pace_piece(rate)
                for i in range(0, len(chunk), step if rate else max(len(chunk), 1)):
                    piece = chunk[i : i + step] if rate else chunk
                    if cut is not None and entry.sent + len(piece) > cut.after:
                        entry.answered = time.monotonic()
                        yield piece[: cut.after - entry.sent]
                        entry.sent = cut.after
                        if cut.stall:
                            self.owner.stopped.wait(cut.stall)
                        sock.shutdown(socket.SHUT_RDWR)  # the client sees the body end early
                        return
                    if rate:  # the bytes sent so far may not have gone out faster than the rate
                        ahead = entry.sent / rate - (time.monotonic() - started)
                        if ahead > 0:
                            time.sleep(ahead)
                    entry.answered = time.monotonic()
                    yield piece
                    entry.sent += len(piece)
        finally:
            close = getattr(body, "close", None)
            if close is not None:
                close()
            self._done(entry)


class S3Server:
    """moto's S3 server on 127.0.0.1 with signature checking on; see the module docstring."""

    def __init__(self, *, rate: float | None = None, latency: float = 0.0) -> None:
        from moto.moto_server.werkzeug_app import (
            DomainDispatcherApplication,
            MotoRequestHandler,
            create_backend_app,
        )
        from werkzeug.serving import make_server

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self.rate, self.latency = rate, latency
        self.lock = threading.Lock()
        self.entries: list[S3Log] = []
        self.faults: list[S3Fault] = []
        self.settled = threading.Condition(self.lock)  # in_flight changes
        self.in_flight = self.peak_in_flight = 0
        self.stopped = threading.Event()  # ends stalls
        self.on_get: Callable[[S3Log], None] | None = None
        app = _Paced(DomainDispatcherApplication(create_backend_app), self)
        self._server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=MotoRequestHandler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self.credentials, self.denied = self._turn_auth_on()

    def _turn_auth_on(self) -> tuple[Keys, Keys]:
        import requests

        # moto's state is the process's: a server started earlier in it left users, buckets and
        # signature checking on. Off and empty first (moto-api requests are never checked).
        for path, body in (("reset-auth", b"inf"), ("reset", b"")):
            r = requests.post(
                f"{self.endpoint}/moto-api/{path}",
                data=body,
                headers={"Content-Type": "application/octet-stream"},
                timeout=10,
            )
            r.raise_for_status()
        iam = self.client("iam", Keys("bootstrap", "bootstrap"))
        keys = []
        for user, allowed in (("admin", True), ("nobody", False)):
            iam.create_user(UserName=user)
            if allowed:
                arn = iam.create_policy(PolicyName="all", PolicyDocument=_ALLOW_ALL)["Policy"]["Arn"]
                iam.attach_user_policy(UserName=user, PolicyArn=arn)
            k = iam.create_access_key(UserName=user)["AccessKey"]
            keys.append(Keys(k["AccessKeyId"], k["SecretAccessKey"]))
        r = requests.post(
            f"{self.endpoint}/moto-api/reset-auth",
            data=b"0",
            headers={"Content-Type": "application/octet-stream"},
            timeout=10,
        )
        r.raise_for_status()
        return keys[0], keys[1]

    def client(self, service: str = "s3", keys: Keys | None = None) -> object:
        """A boto3 client of this server (the admin's keys by default)."""
        import boto3

        k = keys or self.credentials
        return boto3.client(
            service,
            endpoint_url=self.endpoint,
            region_name=REGION,
            aws_access_key_id=k.access_key,
            aws_secret_access_key=k.secret_key,
        )

    def env(self, keys: Keys | None = None) -> dict[str, str]:
        """The standard AWS variables that reach this server as ``keys`` (the admin's)."""
        return (keys or self.credentials).env(self.endpoint)

    def upload(self, directory: Path, bucket: str, prefix: str, *, versioned: bool = False) -> str:
        """Every file of ``directory`` (top level) to ``s3://bucket/prefix/``; the URI."""
        s3 = self.client()
        existing = {b["Name"] for b in s3.list_buckets().get("Buckets", [])}
        if bucket not in existing:
            s3.create_bucket(Bucket=bucket)
            if versioned:
                s3.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
        for p in sorted(directory.iterdir()):
            if p.is_file():
                s3.upload_file(str(p), bucket, f"{prefix}/{p.name}")
        return f"s3://{bucket}/{prefix}"

    def gets(self, suffix: str = "") -> list[S3Log]:
        """The logged GETs of objects whose key ends in ``suffix``, in the order they came in,
        once none is still being answered."""
        with self.settled:
            self.settled.wait_for(lambda: self.in_flight == 0, timeout=10)
            return [e for e in self.entries if e.method == "GET" and e.key and e.key.endswith(suffix)]

    def sent(self, suffix: str = ".safetensors") -> int:
        """Body bytes sent for GETs of keys ending in ``suffix``."""
        return sum(e.sent for e in self.gets(suffix))

    def clear_log(self) -> None:
        with self.lock:
            self.entries.clear()

    def add_fault(self, fault: S3Fault) -> None:
        with self.lock:
            self.faults.append(fault)

    def take_fault(self, entry: S3Log) -> S3Fault | None:
        with self.lock:
            for f in self.faults:
                if (
                    f.times > 0
                    and entry.method == "GET"
                    and entry.key.endswith(f.suffix)
                    and (entry.range is not None or not f.ranged)
                ):
                    f.times -= 1
                    return f
        return None

    def stop(self) -> None:
        self.stopped.set()
        self._server.shutdown()
        self._thread.join()

    def __enter__(self) -> S3Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def bucket_key(uri: str) -> tuple[str, str]:
    """``s3://bucket/prefix`` -> (bucket, prefix)."""
    parts = urlsplit(uri)
    return parts.netloc, parts.path.strip("/")


def main() -> None:
    """Run a server in this process until killed; print its endpoint and keys as one JSON line
    (benchmarks start it apart from the client they measure: one GIL each)."""
    import argparse
    import sys

    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=None, help="bytes/s per request")
    ap.add_argument("--latency", type=float, default=0.0, help="seconds before each answer")
    a = ap.parse_args()
    server = S3Server(rate=a.rate, latency=a.latency)
    k = server.credentials
    print(json.dumps({"endpoint": server.endpoint, "access_key": k.access_key, "secret_key": k.secret_key}))
    sys.stdout.flush()
    threading.Event().wait()


if __name__ == "__main__":
    main()
