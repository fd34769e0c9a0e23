"""Each shard's safetensors header: kept, read from the cached shard, or fetched by two ranged
reads (the length prefix, then exactly the header: never a byte of tensor data)."""

from __future__ import annotations

import struct
from concurrent.futures import ThreadPoolExecutor

from ...errors import HubError, ReshardError
from ...units import plural
from ..header import Header, parse_header
from ..remote.engine import FetchEngine, RemoteFile
from .cache import HEADER_SUFFIX, HubRepo, write_kept
from .http import Traffic, engine, hub_error
from .listing import repo_listing

HEADER_PROBE_BYTES = 8  # the length prefix; then exactly the header: not a byte of tensor data
# Headers read at once while planning: each costs round trips, not bandwidth (a few KB), so every
# shard's at once (more than the data streams), up to this many (a 397B checkpoint has 94 shards).
HEADER_READS = 64


def parsed_headers(
    repo: HubRepo, files: list[str], listing: dict[str, int], traffic: Traffic
) -> dict[str, Header]:
    """Each shard's parsed header: kept on disk, else from the cached shard, else fetched."""
    missing = [
        f for f in files if not (repo.assets / (f + HEADER_SUFFIX)).is_file() and repo.cached(f) is None
    ]
    if missing and repo.offline:
        raise HubError(
            f"{repo.describe()}: offline, and neither kept headers nor cached files exist for "
            f"{plural(len(missing), 'shard')} ({', '.join(missing[:3])}{', ...' * (len(missing) > 3)}); plan "
            "it once with network access"
        )

    fetcher = engine(repo, traffic)

    def one(f: str) -> Header:
        return parse_header(
            _header_bytes(repo, f, listing[f], fetcher)[8:],
            file_size=listing[f],
            where=f"{repo.describe()}: {f}",
        )

    pool = ThreadPoolExecutor(max_workers=max(1, min(len(files), HEADER_READS)))
    try:
        return dict(zip(files, pool.map(one, files), strict=True))
    finally:
        pool.shutdown(cancel_futures=True)  # on the first error, fetch no more headers


def _header_bytes(repo: HubRepo, f: str, size: int, fetcher: FetchEngine) -> bytes:
    """The shard's first 8 + n bytes (length prefix and header)."""
    kept = repo.assets / (f + HEADER_SUFFIX)
    if kept.is_file():
        return kept.read_bytes()
    local = repo.cached(f)
    if local is not None:
        with open(local, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8).ljust(8, b"\0"))
            _check_header_length(n, size, repo, f)
            return struct.pack("<Q", n) + fh.read(n)
    file = RemoteFile(f, size, repo.commit)
    try:
        raw = fetcher.read(file, 0, min(size, HEADER_PROBE_BYTES))
        if len(raw) < 8:
            raise HubError(f"{repo.describe()}: {f}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", raw[:8])
        _check_header_length(n, size, repo, f)
        if 8 + n > len(raw):
            raw += fetcher.read(file, len(raw), 8 + n)
        raw = raw[: 8 + n]
    except ReshardError:
        raise
    except Exception as e:
        raise hub_error(e, repo, what=f"the header of {f}") from e
    write_kept(kept, raw)
    return raw


def header_bytes(repo: HubRepo, file: str) -> bytes:
    """Shard ``file``'s length prefix and header, as planning read them: kept, from the cached
    shard, or fetched by two ranged reads (never the whole shard).

    Raises:
        ReshardError: the repo has no such file, or its header could not be fetched.
    """
    listing = repo_listing(repo)
    if file not in listing:
        raise HubError(f"{repo.describe()}: {file} is missing from the repo; the repo is incomplete")
    return _header_bytes(repo, file, listing[file], engine(repo, Traffic()))


def _check_header_length(n: int, size: int, repo: HubRepo, f: str) -> None:
    from huggingface_hub import constants as hf

    limit = hf.SAFETENSORS_MAX_HEADER_LENGTH
    if n > limit:
        raise HubError(
            f"{repo.describe()}: {f}: header length {n} exceeds the {limit}-byte limit of remote "
            "headers; the file is corrupt or not safetensors"
        )
    if 8 + n > size:
        raise HubError(
            f"{repo.describe()}: {f}: header length {n} runs past the end of the {size}-byte file; "
            "the file is truncated or not safetensors"
        )
