"""An S3 prefix as a store (:mod:`..remote.store`), reached as every S3 tool reaches it: the URI,
boto3's clients (credentials and endpoint from the standard AWS variables, profile and files),
the listing that pins it (each object's ETag; the sha256 of them all is its ``commit``), one
line for every failure, and the transport the fetch engine reads objects through (ranged GETs
with ``If-Match``)."""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from ...errors import AGAIN, BadInput, ObjectStoreError, ReshardError, param
from ...format.names import TOOL_NAME
from ..ranged import describe, redact, retry_after
from ..remote.engine import RemoteFile, Transient
from ..remote.settings import read_timeout_setting, streams_setting
from ..remote.store import RemoteObject, Store, Traffic

SCHEME = "s3://"
# S3's bucket naming rules (docs.aws.amazon.com/AmazonS3/latest/userguide/bucketnamingrules.html):
# 3-63 lowercase letters, digits, dots and hyphens, a letter or digit at each end, no "..".
# The bucket is a folder name of the caches (header cache, stage cache): this also keeps it one.
BUCKET_NAME = re.compile(r"(?!.*\.\.)[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
# boto3 itself: qwen35-reshard is not on the package index, so 'qwen35-reshard[s3]' would not resolve.
INSTALL_HINT = "pip install boto3 (the s3 extra)"
# Answers worth another try, as the fetch engine retries them (the Hub's too).
RETRY_STATUS = (408, 429, 500, 502, 503, 504)
# The codes S3 answers to credentials it does not take (an unknown key, a wrong secret, a
# session token that expired or is not one).
BAD_CREDENTIALS = (
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
    "InvalidClientTokenId",
)
# A ranged read's body is handed on in chunks of this size (botocore's read waits for a whole
# one): a dropped or stalled read loses at most this much, asked again from its first byte.
CHUNK_BYTES = 64 << 10
# Listing and metadata requests: botocore's own retries (standard mode). Ranged reads: none in
# botocore, the fetch engine's (one policy and one log line for every remote read).
LIST_ATTEMPTS = 6
CONNECT_TIMEOUT = 10
CACHE_ENV = "QWEN35_RESHARD_S3_CACHE"  # where small files and headers are kept (default below)


def is_s3_uri(model: str) -> bool:
    """Whether MODEL names an object-storage location (``s3://bucket/prefix``).

    Args:
        model: MODEL as the user wrote it.

    Returns:
        True for an ``s3://`` URI.

    Example:
        >>> is_s3_uri("s3://acc-models/qwen/tiny"), is_s3_uri("Qwen/Tiny")
        (True, False)
    """
    return model.startswith(SCHEME)


@dataclass(frozen=True)
class S3Location:
    """``s3://bucket/prefix``: the prefix without slashes at either end ('' for a whole bucket)."""

    bucket: str
    prefix: str

    @classmethod
    def parse(cls, uri: str) -> S3Location:
        """``s3://bucket/prefix`` or ``s3://bucket/prefix/``.

        Args:
            uri: the URI as the user wrote it.

        Returns:
            The bucket and the prefix without slashes at either end.

        Example:
            >>> S3Location.parse("s3://acc-models/qwen/tiny/")
            S3Location(bucket='acc-models', prefix='qwen/tiny')

        Raises:
            ReshardError: not such a URI (no bucket, a query, ``.`` or ``..`` in the prefix), or
                the bucket is not an S3 bucket name (:data:`BUCKET_NAME`; it names cache folders).
        """
        parts = urlsplit(uri)
        prefix = parts.path.strip("/")
        if parts.netloc and "@" not in parts.netloc and not BUCKET_NAME.fullmatch(parts.netloc):
            raise BadInput(
                f"{redact(uri)}: {parts.netloc!r} is not an S3 bucket name (3-63 lowercase letters, "
                f"digits, dots and hyphens, a letter or digit at each end, no '..'); pass {param('model')} "
                "as s3://BUCKET/PREFIX"
            )
        if (
            not parts.netloc
            or parts.query
            or parts.fragment
            or "@" in parts.netloc
            or any(p in ("", ".", "..") for p in prefix.split("/") if prefix)
        ):
            raise BadInput(
                f"{redact(uri)}: not an object-storage URI; pass {param('model')} as s3://BUCKET/PREFIX "
                "(the folder holding config.json and the shards)"
            )
        return cls(parts.netloc, prefix)

    @property
    def uri(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.prefix}".rstrip("/")

    def key(self, name: str) -> str:
        """The object key of the checkpoint's file ``name``."""
        return f"{self.prefix}/{name}" if self.prefix else name


@dataclass
class Clients:
    """boto3's S3 clients for one location: ``listing`` retries by itself, ``reads`` never
    (the fetch engine does). Thread-safe, as botocore's clients are."""

    listing: object
    reads: object
    endpoint: str  # for messages: redacted


def make_clients(where: S3Location, *, streams: int, user_agent: str | None = None) -> Clients:
    """boto3's clients, configured the way the AWS CLI is: the standard variables, profile and
    files; path-style addressing for a custom endpoint (an S3-compatible server).

    Raises:
        ReshardError: boto3 is not installed, or the profile or configuration is unusable.
    """
    try:
        import boto3
        from botocore.config import Config
        from botocore.exceptions import BotoCoreError
    except ImportError as e:
        raise BadInput(
            f"{where.uri}: reading object storage needs boto3, which is not installed: {INSTALL_HINT}"
        ) from e
    try:
        session = boto3.session.Session()

        def client(attempts: int, addressing: str) -> object:
            config = Config(
                retries={"mode": "standard", "total_max_attempts": attempts},
                max_pool_connections=max(10, streams + 2),
                connect_timeout=CONNECT_TIMEOUT,
                read_timeout=read_timeout_setting(),
                s3={"addressing_style": addressing},
                user_agent_extra=" ".join(filter(None, (TOOL_NAME, user_agent))),
            )
            return session.client("s3", config=config)

        probe = client(LIST_ATTEMPTS, "auto")
        endpoint = probe.meta.endpoint_url
        # AWS's own endpoints take virtual-hosted addresses; S3-compatible servers (MinIO, Ceph's
        # RADOS Gateway, moto) are reached at one host: path-style.
        addressing = "auto" if (urlsplit(endpoint).hostname or "").endswith(".amazonaws.com") else "path"
        return Clients(client(LIST_ATTEMPTS, addressing), client(1, addressing), redact(endpoint))
    except BotoCoreError as e:
        raise ObjectStoreError(f"{where.uri}: the AWS configuration is unusable: {describe(e)}") from e


def store_error(e: BaseException, where: S3Location, endpoint: str, *, what: str) -> ReshardError:
    """One line for a failure of boto3 while reading ``what`` of ``where``; never a secret."""
    from botocore import exceptions as bx

    if isinstance(e, ReshardError):
        return e
    if isinstance(e, bx.NoCredentialsError):
        return ObjectStoreError(
            f"{where.uri}: no AWS credentials found; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
            "AWS_PROFILE (a profile of ~/.aws/credentials or ~/.aws/config)"
        )
    if isinstance(e, bx.ProfileNotFound):
        return ObjectStoreError(f"{where.uri}: {describe(e)}; set AWS_PROFILE to a profile of ~/.aws/config")
    if isinstance(e, (bx.EndpointConnectionError, bx.ConnectTimeoutError, bx.ReadTimeoutError)):
        return ObjectStoreError(
            f"{where.uri}: the endpoint {endpoint} does not answer ({type(e).__name__}) while reading "
            f"{what}; check AWS_ENDPOINT_URL and the network"
        )
    if isinstance(e, bx.ClientError):
        code = str(e.response.get("Error", {}).get("Code", ""))
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in BAD_CREDENTIALS:
            return ObjectStoreError(
                f"{where.uri}: the endpoint {endpoint} refused the credentials ({code}): the access key is "
                "unknown, the secret wrong or the session token expired; check AWS_ACCESS_KEY_ID, "
                "AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN or AWS_PROFILE"
            )
        if code == "NoSuchBucket":
            return ObjectStoreError(
                f"{where.uri}: no bucket {where.bucket!r} at {endpoint}; check the URI and AWS_ENDPOINT_URL"
            )
        if code in ("AccessDenied", "AllAccessDisabled") or status == 403:
            return ObjectStoreError(
                f"{where.uri}: access denied reading {what}: these credentials may not read the bucket; "
                "ask for s3:ListBucket and s3:GetObject on it, or use other credentials (AWS_PROFILE)"
            )
        if code in ("NoSuchKey", "404") or status == 404:
            return ObjectStoreError(f"{where.uri}: {what} is missing from the bucket")
        return ObjectStoreError(f"{where.uri}: {what}: the store answered {status} {code}")
    return ObjectStoreError(f"{where.uri}: {what}: {type(e).__name__}: {describe(e)}")


class S3Transport:
    """Objects of one location read by byte ranges for the fetch engine: each GET names the
    range and ``If-Match`` the ETag listed (the object as planned, or a 412); every answer is
    checked (206, the ``Content-Range`` asked for, the planned size) before a byte is used.
    ``traffic`` counts the requests and body bytes."""

    def __init__(self, where: S3Location, clients: Clients, traffic: Traffic) -> None:
        self.where = where
        self.clients = clients
        self.display = where.uri
        self._traffic = traffic

    def open(self, file: RemoteFile, start: int, end: int) -> Iterator[bytes]:
        """Bytes ``[start, end)`` of ``file``, as chunks as they arrive (see the engine's
        ``Transport``)."""
        from botocore import exceptions as bx

        asked = f"bytes {start}-{end - 1}"
        args = {
            "Bucket": self.where.bucket,
            "Key": self.where.key(file.name),
            "Range": f"bytes={start}-{end - 1}",
        }
        if file.identity:
            args["IfMatch"] = file.identity
        self._traffic.request()
        try:
            answer = self.clients.reads.get_object(**args)
        except bx.ClientError as e:
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status in RETRY_STATUS:
                headers = e.response.get("ResponseMetadata", {}).get("HTTPHeaders", {})
                raise Transient(f"the store answered {status}", status, retry_after(headers)) from e
            if status == 412:
                raise ObjectStoreError(
                    f"{self.display}: {file.name} was replaced while this run read it (its ETag is no "
                    f"longer {file.identity}); nothing was finished from it: {AGAIN} "
                    "once the upload is complete"
                ) from e
            raise store_error(e, self.where, self.clients.endpoint, what=f"{file.name} ({asked})") from e
        except (bx.ConnectionError, bx.HTTPClientError) as e:
            raise Transient(f"the connection failed ({type(e).__name__})") from e
        body = answer["Body"]
        try:
            self._check(answer, file, start, end)
            try:
                for chunk in body.iter_chunks(CHUNK_BYTES):
                    self._traffic.add(len(chunk))
                    yield chunk
            # A body cut short (IncompleteReadError: the connection closed early) is a transient
            # failure like a reset: the engine asks again from the first byte not yet received.
            except (
                bx.ResponseStreamingError,
                bx.IncompleteReadError,
                bx.ConnectionError,
                bx.HTTPClientError,
            ) as e:
                raise Transient(f"the connection failed ({type(e).__name__})") from e
        finally:
            body.close()

    def _check(self, answer: dict, file: RemoteFile, start: int, end: int) -> None:
        status = answer.get("ResponseMetadata", {}).get("HTTPStatusCode")
        got = answer.get("ContentRange", "")
        want = f"bytes {start}-{end - 1}/{file.size}"
        if status != 206 or got != want:
            raise ObjectStoreError(
                f"{self.display}: {file.name}: asked for bytes {start}-{end - 1} of {file.size} but the "
                f"store answered {status} {got or '(no Content-Range)'}; it does not serve ranged reads "
                "as S3 does, or the object changed"
            )


class S3Store(Store):
    """A listed location: its objects (top level of the prefix), pinned by their ETags.

    ``commit`` (the sha256 of every object's name, size and ETag) plays the part of a Hub
    commit: it names the bytes a split was made from, in the split's identity."""

    kind = "prefix"
    revision = ""

    def __init__(
        self,
        where: S3Location,
        objects: dict[str, RemoteObject],
        clients: Clients,
        streams: int,
        traffic: Traffic,
    ) -> None:
        self.where, self.clients, self.streams, self.traffic = where, clients, streams, traffic
        self._objects = objects
        self.repo_id = where.uri
        listed = sorted((n, o.size, o.identity) for n, o in objects.items())
        self.commit = hashlib.sha256(json.dumps(listed).encode()).hexdigest()

    def __repr__(self) -> str:
        return f"S3Store({self.describe()})"

    @property
    def objects(self) -> dict[str, RemoteObject]:
        return self._objects

    @property
    def folder(self) -> Path:
        """Where this listing's small files and headers are kept."""
        base = (
            os.environ.get(CACHE_ENV)
            or Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache") / TOOL_NAME / "s3"
        )
        path = Path(base).expanduser() / self.where.bucket / (self.where.prefix or "_") / self.commit
        path.mkdir(parents=True, exist_ok=True)
        return path

    def transport(self) -> S3Transport:
        return S3Transport(self.where, self.clients, self.traffic)

    def error(self, e: BaseException, what: str) -> ReshardError:
        return store_error(e, self.where, self.clients.endpoint, what=what)


def open_s3(uri: str, *, streams: int | None = None, user_agent: str | None = None) -> S3Store:
    """List ``s3://bucket/prefix`` (its top level): the objects and their ETags. ``user_agent``
    is appended to every request's User-Agent (a server's rank, in the store's logs).

    Args:
        uri: ``s3://bucket/prefix``.
        streams: ranged reads in flight (None: ``QWEN35_RESHARD_STREAMS``, else the default).
        user_agent: appended to the User-Agent.

    Returns:
        The listed location, pinned by its objects' ETags.

    Example:
        >>> store = open_s3("s3://acc-models/qwen/tiny")  # doctest: +SKIP
        >>> store.describe()  # doctest: +SKIP
        's3://acc-models/qwen/tiny@3f1c0a9e7b2d'

    Raises:
        ReshardError: boto3 missing, the bucket or prefix missing, access denied, the
            credentials refused, the endpoint not answering: one line naming the URI.
    """
    where = S3Location.parse(uri)
    n = streams_setting(streams)
    clients = make_clients(where, streams=n, user_agent=user_agent)
    objects: dict[str, RemoteObject] = {}
    start = where.key("")
    traffic = Traffic()
    try:
        pages = clients.listing.get_paginator("list_objects_v2").paginate(
            Bucket=where.bucket, Prefix=start, Delimiter="/"
        )
        for page in pages:
            traffic.request()
            for o in page.get("Contents", []):
                name = o["Key"][len(start) :]
                if name:
                    objects[name] = RemoteObject(int(o["Size"]), o["ETag"])
    except Exception as e:
        raise store_error(e, where, clients.endpoint, what="the object list") from e
    if not objects:
        raise ObjectStoreError(
            f"{where.uri}: no objects under this prefix in bucket {where.bucket!r}; check the prefix "
            "(the folder holding config.json and the shards)"
        )
    return S3Store(where, objects, clients, n, traffic)
