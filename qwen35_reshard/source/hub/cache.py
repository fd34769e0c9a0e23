"""How to reach the Hub (:class:`HubSettings`), and the Hugging Face cache's refs and links as
this tool reads them: never followed out of the cache's repo folder."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from ...errors import BadInput, param
from ...format.paths import is_plain_name


@dataclass(frozen=True)
class HubSettings:
    """How to reach the Hub. ``None`` means huggingface_hub's own default (``HF_ENDPOINT``,
    ``HF_HUB_CACHE``, ``HF_ASSETS_CACHE``, ``HF_TOKEN`` or the saved login)."""

    revision: str | None = None
    token: str | None = field(default=None, repr=False)
    endpoint: str | None = None
    cache_dir: str | None = None
    assets_dir: str | None = None
    offline: bool = False
    # Appended to every request's User-Agent (e.g. "qwen35-stages/pp1"): a server's logs and
    # a test tell the callers apart.
    user_agent: str | None = None
    # Reads in flight at once (None: QWEN35_RESHARD_STREAMS, else the engine's default).
    streams: int | None = None
    # Shards a stage needs whole go through huggingface_hub into its cache (reused by other
    # tools, at twice the disk), instead of straight into the stage.
    hf_cache: bool = False


def read_ref(repo_folder: Path, revision: str) -> str | None:
    """The commit that ``refs/<revision>`` of a Hugging Face cache repo folder names, or None
    when it has no such ref.

    A ref is one 40-hex commit id (huggingface_hub writes nothing else there); anything else
    is refused unread and unshown: the commit becomes a path under ``snapshots/``, and the
    message must not print what a damaged or planted file holds.

    Raises:
        ReshardError: ``revision`` is no ref name, the ref resolves out of the repo folder,
            or it holds anything but a commit id.
    """
    parts = Path(revision).parts
    if Path(revision).is_absolute() or not parts or ".." in parts or not is_plain_name(parts[-1]):
        raise BadInput(f"{param('revision', revision)} is not a branch, tag or commit of {repo_folder}")
    ref = repo_folder / "refs" / revision
    try:
        if not ref.is_file():
            return None
        if not inside(ref, repo_folder):
            raise BadInput(
                f"{ref}: a symlink out of the cache repo folder {repo_folder}; refusing to follow it"
            )
        with open(ref, "rb") as f:
            raw = f.read(_REF_READ)
    except OSError as e:
        raise BadInput(f"{ref}: cannot read ({e.strerror})") from e
    if not _REF.fullmatch(raw):
        raise BadInput(
            f"{ref}: not one 40-hex commit id, as a Hugging Face cache ref holds; the cache folder is "
            f"damaged: delete that file and download again, or pass a snapshot directory "
            f"{repo_folder / 'snapshots'}/<commit>"
        )
    return raw[:40].decode("ascii")


_REF = re.compile(rb"[0-9a-f]{40}\n?")
_REF_READ = 42  # one byte past the longest ref (40 hex digits and a newline): a longer file is none


def inside(path: Path, folder: Path) -> bool:
    """Whether ``path``, symlinks resolved, is inside ``folder`` (symlinks resolved too)."""
    return Path(os.path.realpath(path)).is_relative_to(os.path.realpath(folder))
