"""The store protocol: what a kind of remote storage provides so that a checkpoint can be read
from it (:mod:`.checkpoint`) and its shards fetched (:mod:`.fetch`).

A store is one location pinned to one version of its objects: a Hub repo at a commit
(:mod:`..hub.store`), the objects under an S3 prefix as listed (:mod:`..s3.store`). Everything
else is written once, on top of this protocol: the small-file and header cache, the header
fetch, the checkpoint's assembly, the fetch engine, retries and the run's traffic.

A new store (GCS, Azure, a LAN cache in front of the Hub) is one module with a subclass of
:class:`Store` and its tests (the engine's fault tests run against every store: see
``tests/unit/source/test_remote_engine.py``). It must provide:

- ``repo_id``, ``revision``, ``commit`` and :meth:`Store.describe`: the location as a split
  records it (``commit`` names every byte read: the Hub's commit, a digest of a listing);
- :attr:`Store.objects`: the top-level objects, each with its size and the identity every
  read of it must match (:class:`RemoteObject`), listed once per run (or kept, by commit);
- :meth:`Store.transport`: the fetch engine's :class:`~.engine.Transport` (ranged reads that
  raise :class:`~.engine.Transient` for what is worth another try, and refuse an answer that
  is not the bytes asked for);
- :meth:`Store.error`: one ``error:`` line for a failure of its client library;
- :attr:`Store.folder`: where this version's small files and headers are kept (named by
  ``commit``: a kept file is never stale).

and may provide :meth:`Store.local` (a complete local copy of an object, such as the Hugging
Face cache's), :attr:`Store.offline`, and :attr:`Store.has_shared_cache` with
:meth:`Store.download` (whole files into a cache other tools share: small files always, shards
needed whole with :attr:`Store.shared_cache`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from ...errors import ReshardError
from ...format.names import partial_name, process_token
from ..header import MAX_HEADER_BYTES
from .engine import FetchEngine, RemoteFile, RetryPolicy, Transport
from .settings import seconds_setting, streams_setting

# First wait before retrying a failed request (doubled each time, up to MAX_RETRY_WAIT s).
RETRY_WAIT_ENV = "QWEN35_RESHARD_RETRY_WAIT"
DEFAULT_RETRY_WAIT = 0.5
MAX_RETRY_WAIT = 8.0
RETRIES = 5  # retries without progress of any request, before the run gives up in one line
HEADER_SUFFIX = ".header"  # a shard's kept length prefix and header: ``<shard>.header``


class RemoteObject(NamedTuple):
    """One object of a store as listed: its size, the identity every read names (a Hub commit,
    an S3 ETag) and, where the store publishes it, the sha256 of its whole content."""

    size: int
    identity: str
    sha256: str | None = None


@dataclass
class Traffic:
    """What this process fetched from a store: body bytes as they arrive and requests sent.
    Thread-safe."""

    bytes: int = 0
    requests: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, nbytes: int) -> None:
        with self.lock:
            self.bytes += nbytes

    def request(self) -> None:
        with self.lock:
            self.requests += 1


def retry_policy() -> RetryPolicy:
    """The retries of every remote read (``QWEN35_RESHARD_RETRY_WAIT`` sets the first wait).

    Raises:
        ReshardError: ``QWEN35_RESHARD_RETRY_WAIT`` is not a positive number of seconds.

    Example:
        >>> retry_policy().retries
        5
    """
    wait = seconds_setting(RETRY_WAIT_ENV, DEFAULT_RETRY_WAIT)
    return RetryPolicy(retries=RETRIES, wait=wait, max_wait=MAX_RETRY_WAIT)


class Store:
    """A remote location pinned to one version of its objects (see the module docstring for
    what a subclass provides). ``streams`` is the reads in flight (None: the setting's default);
    ``traffic`` counts what the run fetched."""

    repo_id: str
    revision: str
    commit: str
    streams: int
    traffic: Traffic

    def describe(self) -> str:
        """The location as messages name it: ``org/name@<commit>``, ``s3://bucket/prefix@<listing>``."""
        return f"{self.repo_id}@{self.commit[:12]}"

    def identity(self) -> dict:
        """What manifests record of the source: never a token, an endpoint or a secret."""
        return {"repo_id": self.repo_id, "revision": self.revision, "commit": self.commit}

    @property
    def objects(self) -> dict[str, RemoteObject]:
        raise NotImplementedError

    @property
    def folder(self) -> Path:
        raise NotImplementedError

    def transport(self) -> Transport:
        raise NotImplementedError

    def error(self, e: BaseException, what: str) -> ReshardError:
        """One line for ``e``, a failure while reading ``what``; ``e`` itself if it is one."""
        raise NotImplementedError

    kind = "repo"  # what messages call the location: "the repo", "the prefix"
    header_limit = MAX_HEADER_BYTES  # the longest shard header read
    offline = False  # only what is kept or local may be read

    def local(self, name: str) -> Path | None:
        """A complete local copy of object ``name`` (read instead of fetching it), or None."""
        return None

    # A cache other tools share (the Hugging Face cache): small files always go into it (where
    # transformers finds the tokenizer), and with ``shared_cache`` the shards needed whole too.
    has_shared_cache = False
    shared_cache = False

    def download(self, name: str, on_bytes: Callable[[int], None] = lambda n: None) -> str:
        """Object ``name`` downloaded whole into the shared cache, and its path (``on_bytes(n)``
        told its bytes as they arrive); only where ``has_shared_cache``."""
        raise NotImplementedError

    def remote(self, name: str) -> RemoteFile:
        """Object ``name`` as the fetch engine reads it: its size and identity as listed."""
        o = self.objects[name]
        return RemoteFile(name, o.size, o.identity)

    def engine(self) -> FetchEngine:
        """A fetch engine over this store's transport (its reads counted in ``traffic``)."""
        return FetchEngine(self.transport(), streams=streams_setting(self.streams), policy=retry_policy())


_kept_lock = threading.Lock()  # this process's threads share its temporary names


def write_kept(path: Path, data: bytes) -> None:
    """Keep a small file, header or listing: written under a temporary name of this process's (a
    cache may be shared by several processes and hosts) and renamed, so a killed run never
    leaves a torn one that a later (offline) plan would trust."""
    tmp = path.with_name(partial_name(path.name, process_token()))
    with _kept_lock:
        try:
            tmp.write_bytes(data)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)  # a full disk, Ctrl-C: no temporary left in the cache
            raise
