"""The checkpoint under ``s3://bucket/prefix`` as plain data, and how a run fetches its shards.

The prefix is listed once (``ListObjectsV2``, the top level only); config, index and the other
small files are fetched whole into a local folder keyed by the listing's identity (``commit``),
each shard's header by two ranged reads (the length prefix, then exactly the header), kept
there too: planning the same objects again needs no request but the listing. Data is never
cached: the fetch engine writes it straight into the stage files.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ...errors import ObjectStoreError
from ...format.names import CONFIG_NAME, INDEX_NAME, SINGLE_FILE_NAME, TOOL_NAME
from ...format.paths import is_plain_name
from ...model.quant import QUANT_SIDE_FILE
from ..header import MAX_HEADER_BYTES, Header, parse_header
from ..hub.cache import HEADER_SUFFIX, write_kept
from ..hub.checkpoint import MODEL_TYPES, listed_other_files
from ..hub.fetch import fetch_plan
from ..hub.http import DEFAULT_RETRY_WAIT, MAX_RETRY_WAIT, RETRIES, RETRY_WAIT_ENV
from ..remote.engine import FetchEngine, RemoteFile, RemoteSource, RetryPolicy, streams_setting
from .store import Clients, S3Location, S3Traffic, S3Transport, make_clients, store_error

if TYPE_CHECKING:
    from ..checkpoint import Checkpoint

CACHE_ENV = "QWEN35_RESHARD_S3_CACHE"  # where small files and headers are kept (default below)


@dataclass(frozen=True)
class S3Object:
    size: int
    etag: str  # as S3 sends it, quoted: what If-Match takes back


@dataclass
class S3Repo:
    """A listed location: its objects (top level of the prefix), pinned by their ETags.

    ``commit`` (the sha256 of every object's name, size and ETag) plays the part of a Hub
    commit: it names the bytes a split was made from, in the split's identity."""

    where: S3Location
    objects: dict[str, S3Object]
    clients: Clients = field(repr=False)
    streams: int
    traffic: S3Traffic = field(default_factory=S3Traffic, repr=False)

    @property
    def repo_id(self) -> str:
        return self.where.uri

    @property
    def commit(self) -> str:
        listed = sorted((n, o.size, o.etag) for n, o in self.objects.items())
        return hashlib.sha256(json.dumps(listed).encode()).hexdigest()

    def describe(self) -> str:
        return f"{self.where.uri}@{self.commit[:12]}"

    def identity(self) -> dict:
        """What manifests record of the source (no endpoint, no credential): the URI and the
        listing's identity, which covers every object's ETag."""
        return {"repo_id": self.where.uri, "revision": "", "commit": self.commit}

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

    def remote(self, name: str) -> RemoteFile:
        o = self.objects[name]
        return RemoteFile(name, o.size, o.etag)

    def engine(self) -> FetchEngine:
        """The fetch engine for this location's objects (their reads counted in ``traffic``)."""
        wait = float(os.environ.get(RETRY_WAIT_ENV, DEFAULT_RETRY_WAIT))
        policy = RetryPolicy(retries=RETRIES, wait=wait, max_wait=MAX_RETRY_WAIT)
        return FetchEngine(
            S3Transport(self.where, self.clients, self.traffic), streams=self.streams, policy=policy
        )


def open_s3(uri: str, *, streams: int | None = None, user_agent: str | None = None) -> S3Repo:
    """List ``s3://bucket/prefix`` (its top level): the objects and their ETags. ``user_agent``
    is appended to every request's User-Agent (a server's rank, in the store's logs).

    Args:
        uri: ``s3://bucket/prefix``.
        streams: ranged reads in flight (None: ``QWEN35_RESHARD_STREAMS``, else the default).
        user_agent: appended to the User-Agent.

    Returns:
        The listed location, pinned by its objects' ETags.

    Example:
        >>> repo = open_s3("s3://acc-models/qwen/tiny")  # doctest: +SKIP
        >>> repo.describe()  # doctest: +SKIP
        's3://acc-models/qwen/tiny@3f1c0a9e7b2d'

    Raises:
        ReshardError: boto3 missing, the bucket or prefix missing, access denied, the
            credentials refused, the endpoint not answering: one line naming the URI.
    """
    where = S3Location.parse(uri)
    n = streams_setting(streams)
    clients = make_clients(where, streams=n, user_agent=user_agent)
    objects: dict[str, S3Object] = {}
    start = where.key("")
    traffic = S3Traffic()
    try:
        pages = clients.listing.get_paginator("list_objects_v2").paginate(
            Bucket=where.bucket, Prefix=start, Delimiter="/"
        )
        for page in pages:
            traffic.request()
            for o in page.get("Contents", []):
                name = o["Key"][len(start) :]
                if name:
                    objects[name] = S3Object(int(o["Size"]), o["ETag"])
    except Exception as e:
        raise store_error(e, where, clients.endpoint, what="the object list") from e
    if not objects:
        raise ObjectStoreError(
            f"{where.uri}: no objects under this prefix in bucket {where.bucket!r}; check the prefix "
            "(the folder holding config.json and the shards)"
        )
    return S3Repo(where, objects, clients, n, traffic)


def read_s3_checkpoint(repo: S3Repo) -> Checkpoint:
    """The checkpoint at ``repo`` as plain data: small files whole, shard headers by ranges.

    Args:
        repo: the listed location (:func:`open_s3`).

    Returns:
        The :class:`~qwen35_reshard.source.checkpoint.Checkpoint`; ``hub`` holds the URI and
        the listing's identity (``commit``).

    Example:
        >>> ckpt = read_s3_checkpoint(open_s3("s3://acc-models/qwen/tiny"))  # doctest: +SKIP
        >>> ckpt.display  # doctest: +SKIP
        's3://acc-models/qwen/tiny@3f1c0a9e7b2d'

    Raises:
        ReshardError: the store's refusal, or a checkpoint that is not a Qwen3.5 MoE one.
    """
    from ..checkpoint import assemble_checkpoint, load_config, load_quant_side

    engine = repo.engine()
    try:
        config_bytes = small_file(repo, CONFIG_NAME, engine)
        config = load_config(config_bytes, f"{repo.where.uri}/{CONFIG_NAME}")
        if config.get("model_type") not in MODEL_TYPES:
            raise ObjectStoreError(
                f"{repo.where.uri}: config.json has model_type {config.get('model_type')!r}, not a Qwen3.5 "
                f"MoE checkpoint ({' or '.join(MODEL_TYPES)}); this tool splits only those"
            )
        index_bytes = small_file(repo, INDEX_NAME, engine) if INDEX_NAME in repo.objects else None
        if index_bytes is None and SINGLE_FILE_NAME not in repo.objects:
            raise ObjectStoreError(
                f"{repo.where.uri}: no {INDEX_NAME} and no {SINGLE_FILE_NAME} under the prefix; not a "
                "safetensors checkpoint"
            )

        def read_headers(files: list[str]) -> Iterator[Header]:
            for f in files:
                if not is_plain_name(f) or f not in repo.objects:
                    raise ObjectStoreError(
                        f"{repo.where.uri}/{INDEX_NAME}: shard {f!r} is not an object at the top of the "
                        "prefix; the upload is incomplete"
                    )
            with ThreadPoolExecutor(max_workers=engine.streams) as pool:
                raw = dict(zip(files, pool.map(lambda f: header_bytes(repo, f, engine), files), strict=True))
            # Parsed as taken, each dropped once its tensors are made (see assemble_checkpoint).
            return (
                parse_header(raw.pop(f)[8:], file_size=repo.objects[f].size, where=f"{repo.where.uri}/{f}")
                for f in files
            )

        ckpt = assemble_checkpoint(
            root=repo.folder,
            display=repo.describe(),
            config=config,
            config_bytes=config_bytes,
            index_bytes=index_bytes,
            read_headers=read_headers,
            other_files=lambda files: listed_other_files(repo.objects, files),
            hub=repo.identity(),
        )
        side = small_file(repo, QUANT_SIDE_FILE, engine) if QUANT_SIDE_FILE in repo.objects else None
        for name in ckpt.extra_files:  # the copy reads them from the folder
            small_file(repo, name, engine)
    finally:
        engine.close()
    return replace(ckpt, quant_side=load_quant_side(side, f"{repo.where.uri}/{QUANT_SIDE_FILE}"))


def small_file(repo: S3Repo, name: str, engine: FetchEngine) -> bytes:
    """A config, index or tokenizer file: kept in the listing's folder once fetched."""
    kept = repo.folder / name
    if kept.is_file():
        return kept.read_bytes()
    data = _read(repo, name, 0, repo.objects[name].size, engine)
    write_kept(kept, data)
    return data


def header_bytes(repo: S3Repo, name: str, engine: FetchEngine) -> bytes:
    """Shard ``name``'s length prefix and header: kept, or two ranged reads (not a byte of data)."""
    kept = repo.folder / (name + HEADER_SUFFIX)
    if kept.is_file():
        return kept.read_bytes()
    size = repo.objects[name].size
    raw = _read(repo, name, 0, min(size, 8), engine)
    if len(raw) < 8:
        raise ObjectStoreError(f"{repo.where.uri}/{name}: not a safetensors file (shorter than 8 bytes)")
    (n,) = struct.unpack("<Q", raw)
    if n > MAX_HEADER_BYTES or 8 + n > size:
        raise ObjectStoreError(
            f"{repo.where.uri}/{name}: header length {n} runs past the {size}-byte object or the "
            f"{MAX_HEADER_BYTES}-byte limit; the object is truncated or not safetensors"
        )
    raw += _read(repo, name, 8, 8 + n, engine)
    write_kept(kept, raw)
    return raw


def s3_header(repo: S3Repo, name: str) -> bytes:
    """Shard ``name``'s length prefix and header, as planning read them (kept, or two ranged
    reads).

    Raises:
        ReshardError: the shard is not at the location, or its header could not be read.
    """
    if name not in repo.objects:
        raise ObjectStoreError(f"{repo.where.uri}: {name} is missing from the bucket")
    engine = repo.engine()
    try:
        return header_bytes(repo, name, engine)
    finally:
        engine.close()


def _read(repo: S3Repo, name: str, start: int, end: int, engine: FetchEngine) -> bytes:
    try:
        return engine.read(repo.remote(name), start, end)
    except Exception as e:
        raise store_error(e, repo.where, repo.clients.endpoint, what=name) from e


class S3Fetcher:
    """Hands the copy each source shard as a remote source of one fetch engine: its parts (the
    stages' tensors, or the whole shard) written in place into the stage files. Nothing is
    cached: every shard is fetched (``how`` is ``whole`` or ``ranges``)."""

    def __init__(self, repo: S3Repo, ckpt: Checkpoint, needed: dict[str, set[str]]) -> None:
        self.repo = repo
        self.traffic = repo.traffic
        self.fetches = fetch_plan(ckpt, needed, set())
        self.engine = repo.engine()
        self._sources: dict[str, RemoteSource] = {}

    download_bytes = 0  # nothing goes through a cache
    checkpoint_bytes = property(lambda self: sum(o.size for o in self.repo.objects.values()))

    def prepare(self) -> None:
        """Nothing: the small files came with the checkpoint."""

    def remote(self, file: str) -> RemoteSource:
        """``file`` as the fetch engine reads it, its header as planning kept it."""
        src = self._sources.get(file)
        if src is None:
            head = header_bytes(self.repo, file, self.engine)
            src = self._sources[file] = RemoteSource(self.engine, self.repo.remote(file), head)
        return src

    open = remote

    def close(self) -> None:
        """Stop the engine's reads (none is left running after this returns)."""
        self.engine.close()
