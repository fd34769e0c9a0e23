"""The checkpoint at a Hub repo's commit as plain data: config and index through
huggingface_hub, each shard's header through :mod:`.headers`."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from ...errors import HubError
from ...format.names import CONFIG_NAME, INDEX_NAME, PICKLE_SUFFIXES, SINGLE_FILE_NAME
from ...format.paths import is_plain_name
from ...model.quant import QUANT_SIDE_FILE
from ..header import Header
from .cache import HubRepo
from .headers import parsed_headers
from .http import Traffic, hf_download
from .listing import repo_lfs_sha256, repo_listing

if TYPE_CHECKING:
    from ..checkpoint import Checkpoint

# config.json model_type of a Qwen3.5 MoE checkpoint (multimodal save, text-only save).
MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")


def read_hub_checkpoint(repo: HubRepo, *, traffic: Traffic | None = None) -> Checkpoint:
    """The checkpoint at ``repo`` as plain data: config and index through huggingface_hub,
    each shard's header by ranged reads (or from the kept headers / the cache)."""
    from ..checkpoint import assemble_checkpoint, load_config, load_quant_side

    traffic = traffic if traffic is not None else Traffic()
    listing = repo_listing(repo)
    with ThreadPoolExecutor(max_workers=1) as pool:  # two files, two round trips each: at once
        index = None
        if INDEX_NAME in listing:
            index = pool.submit(_small_file, repo, INDEX_NAME, listing, traffic)
        config_bytes = _small_file(repo, CONFIG_NAME, listing, traffic)
        config = load_config(config_bytes, f"{repo.describe()}/{CONFIG_NAME}")
        _check_model_type(config, repo)
        index_bytes = index.result() if index is not None else None
    if index is None and SINGLE_FILE_NAME not in listing:
        raise HubError(
            f"{repo.describe()}: no {INDEX_NAME} and no {SINGLE_FILE_NAME} in the repo; not a "
            "safetensors checkpoint"
        )

    def read_headers(files: list[str]) -> Iterator[Header]:
        # As for a local index: the kept header and the cached copy of a shard are found by
        # its name, which must not lead out of (or below) the repo's top level.
        for f in files:
            if not is_plain_name(f):
                raise HubError(
                    f"{repo.describe()}/{INDEX_NAME}: shard file name {f!r} is not a plain file name "
                    "at the top of the repo; refusing to follow it"
                )
        absent = [f for f in files if f not in listing]
        if absent:
            raise HubError(
                f"{repo.describe()}: {absent[0]} is named by {INDEX_NAME} but missing from the repo"
                + (f" ({len(absent)} such files)" if len(absent) > 1 else "")
                + "; the repo is incomplete"
            )
        # Popped as taken: each is dropped once its tensors are made.
        return map(parsed_headers(repo, files, listing, traffic).pop, files)

    ckpt = assemble_checkpoint(
        root=repo.snapshot,
        display=repo.describe(),
        config=config,
        config_bytes=config_bytes,
        index_bytes=index_bytes,
        read_headers=read_headers,
        other_files=lambda files: listed_other_files(listing, files),
        hub=repo.identity(),
    )
    side = _small_file(repo, QUANT_SIDE_FILE, listing, traffic) if QUANT_SIDE_FILE in listing else None
    quant_side = load_quant_side(side, f"{repo.describe()}/{QUANT_SIDE_FILE}")
    return replace(ckpt, blob_sha256=repo_lfs_sha256(repo, ckpt.files), quant_side=quant_side)


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


def _small_file(repo: HubRepo, name: str, listing: dict[str, int], traffic: Traffic) -> bytes:
    """A config or index file, through huggingface_hub into the standard cache."""
    path = hf_download(repo, name, traffic, size=listing.get(name, 0))
    return Path(path).read_bytes()


def _check_model_type(config: dict, repo: HubRepo) -> None:
    found = config.get("model_type")
    if found not in MODEL_TYPES:
        raise HubError(
            f"{repo.describe()}: config.json has model_type {found!r}, not a Qwen3.5 MoE checkpoint "
            f"({' or '.join(MODEL_TYPES)}); this tool splits only those"
        )
