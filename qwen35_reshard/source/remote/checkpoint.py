"""The checkpoint in a store (:mod:`.store`) as plain data: its listing, config and index (small
files), each shard's safetensors header, checked and assembled as a local checkpoint is.

Small files and headers are kept in the store's folder (named by its ``commit``) once fetched,
so planning the same version again reads nothing but what the store needs to pin it (the Hub:
the revision; an object store: the listing). Where the store holds a complete local copy of an
object (the Hugging Face cache), it is read there. Everything is read through the fetch
engine: every request is retried the same way (a reset while the index downloads as one in the
middle of a shard), and no read takes a byte of tensor data.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from ...errors import RemoteError, ReshardError
from ...format.names import CONFIG_NAME, INDEX_NAME, PICKLE_SUFFIXES, SINGLE_FILE_NAME
from ...format.paths import is_plain_name
from ...model.quant import QUANT_SIDE_FILE
from ...units import plural
from ..header import Header, parse_header
from .engine import FetchEngine
from .store import HEADER_SUFFIX, Store, write_kept

if TYPE_CHECKING:
    from ..checkpoint import Checkpoint

# config.json model_type of a Qwen3.5 MoE checkpoint (multimodal save, text-only save).
MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
# A header's first read: its length prefix and the header itself where it is no longer (one
# request; a second, for the rest, only for a longer one). 64 KiB holds the header of a shard of
# ~500 tensors, and costs 6.5 ms at 10 MB/s: less than the round trip a second request waits.
# Never more than 1/HEADER_SHARE of the shard (small shards: the header read is not the data).
HEADER_GUESS = 64 << 10
HEADER_SHARE = 16


def header_read(size: int) -> int:
    """Bytes of a ``size``-byte shard read first for its header (see :data:`HEADER_GUESS`).

    Example:
        >>> header_read(5 << 30), header_read(160_000), header_read(4)
        (65536, 10000, 4)
    """
    return min(size, max(8, min(HEADER_GUESS, size // HEADER_SHARE)))
# Headers read at once while planning: each costs round trips, not bandwidth (a few KB), so every
# shard's at once (more than the data streams), up to this many (a 397B checkpoint has 94 shards).
HEADER_READS = 64


def read_remote_checkpoint(store: Store) -> Checkpoint:
    """The checkpoint in ``store`` as plain data: config and index whole, each shard's header by
    ranged reads (or kept, or from a local copy); nothing of the tensors' data.

    Args:
        store: a store pinned to one version (a Hub repo at a commit, a listed S3 prefix).

    Returns:
        The :class:`~qwen35_reshard.source.checkpoint.Checkpoint`: ``root`` is the store's folder
        (where its small files are kept), ``hub`` its identity.

    Raises:
        ReshardError: the store's refusal, or a checkpoint that is not a Qwen3.5 MoE one.

    Example:
        >>> ckpt = read_remote_checkpoint(open_s3("s3://acc-models/qwen/tiny"))  # doctest: +SKIP
    """
    from ..checkpoint import assemble_checkpoint, load_config, load_quant_side

    objects = store.objects
    engine = store.engine()
    # Everything planning reads goes out at once, once the listing is known: config, index, the
    # quantization side file, each listed shard's header and the small files every stage gets
    # (read beside the headers, not after the plan). A header the index does not ask for is read
    # for nothing (a stray shard), a small file that fails is fetched again (and refused) by the
    # run that needs it: planning itself does not wait on either.
    pool = ThreadPoolExecutor(max_workers=HEADER_READS)
    try:
        reads = _planning_reads(store, engine, pool)
        config_bytes = reads[CONFIG_NAME].result()
        config = load_config(config_bytes, f"{store.describe()}/{CONFIG_NAME}")
        _check_model_type(config, store)
        index_bytes = reads[INDEX_NAME].result() if INDEX_NAME in reads else None
        if index_bytes is None and SINGLE_FILE_NAME not in objects:
            raise RemoteError(
                f"{store.describe()}: no {INDEX_NAME} and no {SINGLE_FILE_NAME}; not a safetensors checkpoint"
            )

        def read_headers(files: list[str]) -> Iterator[Header]:
            _check_shard_names(store, files)
            _check_offline(store, files)
            heads = {
                f: reads.pop(f + HEADER_SUFFIX, None) or pool.submit(header_bytes, store, f, engine)
                for f in files
            }
            # Parsed as taken, each dropped once its tensors are made (see assemble_checkpoint).
            return (_parsed(store, f, heads.pop(f).result()) for f in files)

        ckpt = assemble_checkpoint(
            root=store.folder,
            display=store.describe(),
            config=config,
            config_bytes=config_bytes,
            index_bytes=index_bytes,
            read_headers=read_headers,
            other_files=lambda files: listed_other_files(objects, files),
            hub=store.identity(),
        )
        side = reads[QUANT_SIDE_FILE].result() if QUANT_SIDE_FILE in reads else None
        wait(reads.values())  # the small files, read beside the headers: a failure is the run's to see
    finally:
        pool.shutdown(wait=False, cancel_futures=True)  # after an error, start no more reads
        engine.close()
    published = {f: o.sha256 for f in ckpt.files if (o := objects[f]).sha256 is not None}
    quant_side = load_quant_side(side, f"{store.describe()}/{QUANT_SIDE_FILE}")
    return replace(ckpt, blob_sha256=published, quant_side=quant_side)


def listed_other_files(names: Iterable[str], files: list[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Of a remote listing's ``names`` (a repo's files, a prefix's objects), the top-level
    non-weight files every stage gets and the ``*.safetensors`` the index (``files``) does not
    list; hidden files neither. Pure.

    Example:
        >>> listed_other_files(["config.json", "a.safetensors", "b.safetensors", ".gitattributes"],
        ...                    ["a.safetensors"])
        (('config.json',), ('b.safetensors',))
    """
    top = [n for n in sorted(names) if "/" not in n and not n.startswith(".")]
    weights = (".safetensors", *PICKLE_SUFFIXES)
    extra = tuple(n for n in top if n not in (INDEX_NAME, *files) and not n.endswith(weights))
    return extra, tuple(n for n in top if n.endswith(".safetensors") and n not in files)


def small_file(store: Store, name: str, engine: FetchEngine) -> bytes:
    """A config, index or tokenizer file, kept in the store's folder once read: from a local
    copy, else downloaded into the store's shared cache (if it has one), else fetched whole.

    Raises:
        ReshardError: offline and neither kept nor local; or the store's refusal.
    """
    kept = store.folder / name
    if kept.is_file():
        return kept.read_bytes()
    local = store.local(name)
    if local is not None:
        data = local.read_bytes()
    elif name not in store.objects:
        raise RemoteError(f"{store.describe()}: {name} is missing from the {store.kind}; not a checkpoint")
    elif store.offline:
        raise RemoteError(
            f"{store.describe()}: offline, and neither a local copy nor the kept files ({store.folder}) "
            f"hold {name}; run once with network access"
        )
    elif store.has_shared_cache:
        data = Path(store.download(name)).read_bytes()
    else:
        data = _read(store, name, 0, store.objects[name].size, engine)
    write_kept(kept, data)
    return data


def fetch_small_files(store: Store, names: Iterable[str], engine: FetchEngine) -> None:
    """Small files (tokenizer, configs, ...) into the store's folder, where the copy reads them:
    all at once (each costs a round trip, not bandwidth), as many as the engine's streams."""
    names = list(names)
    if names:
        with ThreadPoolExecutor(max_workers=min(engine.streams, len(names))) as pool:
            list(pool.map(lambda name: small_file(store, name, engine), names))


def missing_offline(store: Store, names: Iterable[str]) -> list[str]:
    """Of ``names``, those neither kept nor held locally: what an offline run cannot read."""
    return [n for n in names if not (store.folder / n).is_file() and store.local(n) is None]


def _planning_reads(store: Store, engine: FetchEngine, pool: ThreadPoolExecutor) -> dict[str, Future[bytes]]:
    """What planning reads, all submitted at once: config, index and quantization side file by
    name; offline nothing more (only what is kept or local may be read), else also each listed
    shard's header (by ``<shard>.header``) and the small files every stage gets."""
    objects = store.objects
    names = [CONFIG_NAME, *(n for n in (INDEX_NAME, QUANT_SIDE_FILE) if n in objects)]
    reads = {n: pool.submit(small_file, store, n, engine) for n in names}
    if store.offline:
        return reads
    shards = [n for n in objects if n.endswith(".safetensors") and is_plain_name(n)]
    reads.update({f + HEADER_SUFFIX: pool.submit(header_bytes, store, f, engine) for f in shards})
    extra, _ = listed_other_files(objects, shards)
    reads.update({n: pool.submit(small_file, store, n, engine) for n in extra if n not in reads})
    return reads


def _parsed(store: Store, name: str, raw: bytes) -> Header:
    return parse_header(raw[8:], file_size=store.objects[name].size, where=f"{store.describe()}: {name}")


def _check_offline(store: Store, files: list[str]) -> None:
    """Offline, every shard's header must be kept or in a local copy."""
    if not store.offline:
        return
    missing = [
        f for f in files if not (store.folder / (f + HEADER_SUFFIX)).is_file() and store.local(f) is None
    ]
    if missing:
        raise RemoteError(
            f"{store.describe()}: offline, and neither kept headers nor local copies exist for "
            f"{plural(len(missing), 'shard')} ({', '.join(missing[:3])}{', ...' * (len(missing) > 3)}); plan "
            "it once with network access"
        )


def header_bytes(store: Store, name: str, engine: FetchEngine) -> bytes:
    """Shard ``name``'s length prefix and header (its first 8 + n bytes): kept, read from a
    local copy, or fetched: its first :func:`header_read` bytes, and the rest of a longer header.

    Raises:
        ReshardError: the shard is not in the store, or its header could not be read.
    """
    if name not in store.objects:
        raise RemoteError(f"{store.describe()}: {name} is missing; the checkpoint is incomplete")
    kept = store.folder / (name + HEADER_SUFFIX)
    if kept.is_file():
        return kept.read_bytes()
    size = store.objects[name].size
    local = store.local(name)
    if local is not None:
        with open(local, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8).ljust(8, b"\0"))
            _check_header_length(store, name, n, size)
            return struct.pack("<Q", n) + fh.read(n)
    raw = _read(store, name, 0, header_read(size), engine)
    if len(raw) < 8:
        raise RemoteError(f"{store.describe()}: {name}: not a safetensors file (shorter than 8 bytes)")
    (n,) = struct.unpack("<Q", raw[:8])
    _check_header_length(store, name, n, size)
    if 8 + n > len(raw):
        raw += _read(store, name, len(raw), 8 + n, engine)
    raw = raw[: 8 + n]
    write_kept(kept, raw)
    return raw


def remote_header(store: Store, name: str) -> bytes:
    """Shard ``name``'s length prefix and header, as planning read them (see :func:`header_bytes`),
    on an engine of its own.

    Raises:
        ReshardError: the shard is not in the store, or its header could not be read.
    """
    engine = store.engine()
    try:
        return header_bytes(store, name, engine)
    finally:
        engine.close()


def _read(store: Store, name: str, start: int, end: int, engine: FetchEngine) -> bytes:
    try:
        return engine.read(store.remote(name), start, end)
    except ReshardError:
        raise
    except Exception as e:
        raise store.error(e, name) from e


def _check_header_length(store: Store, name: str, n: int, size: int) -> None:
    limit = store.header_limit
    if n > limit:
        raise RemoteError(
            f"{store.describe()}: {name}: header length {n} exceeds the {limit}-byte limit of remote "
            "headers; the file is corrupt or not safetensors"
        )
    if 8 + n > size:
        raise RemoteError(
            f"{store.describe()}: {name}: header length {n} runs past the end of the {size}-byte file; "
            "the file is truncated or not safetensors"
        )


def _check_shard_names(store: Store, files: list[str]) -> None:
    """The index's shards are plain names at the top of the store, every one listed: a kept
    header and a local copy are found by that name, which must not lead out of the folder."""
    for f in files:
        if not is_plain_name(f):
            raise RemoteError(
                f"{store.describe()}/{INDEX_NAME}: shard file name {f!r} is not a plain file name at the "
                "top of the checkpoint; refusing to follow it"
            )
    absent = [f for f in files if f not in store.objects]
    if absent:
        raise RemoteError(
            f"{store.describe()}: {absent[0]} is named by {INDEX_NAME} but missing from the {store.kind}"
            + (f" ({len(absent)} such files)" if len(absent) > 1 else "")
            + "; the checkpoint is incomplete"
        )


def _check_model_type(config: dict, store: Store) -> None:
    found = config.get("model_type")
    if found not in MODEL_TYPES:
        raise RemoteError(
            f"{store.describe()}: config.json has model_type {found!r}, not a Qwen3.5 MoE checkpoint "
            f"({' or '.join(MODEL_TYPES)}); this tool splits only those"
        )
