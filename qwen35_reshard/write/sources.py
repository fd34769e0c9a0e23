"""The source files a run reads are the ones it planned from.

A local checkpoint's shards are stamped as their headers are read (``file_stamp``: device,
inode, size, modification and status-change times). A shard replaced while a run copies (a
rename over it keeps the mtime, not the inode or the ctime; a rewrite in place changes the
times) would put other bytes under digests computed from those very bytes, and nothing after
the run could tell. So each shard is checked against its stamp just before it is copied and
just after (the bytes read in between are then the planned file's: replacing it, or putting it
back, changes its ctime), and every shard once more before any stage is declared complete.
A Hub source is pinned to one commit: every byte fetched is named by it; a shard copied whole
from a cached blob (of a Hub source, or of a cache folder given as MODEL) is hashed as it
streams by and compared with the Hub's LFS sha256, the blob's name (:class:`BlobCheck`).

The run marker and ``reshard.json`` record each local shard's stamp (:func:`source_stamps`):
what a later run over the same OUT compares first (see :mod:`.provenance`).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import AGAIN, BadInput, RemoteError, advice, param
from ..plan.planner import Plan
from ..source.checkpoint import Checkpoint
from ..source.header import file_stamp
from ..source.remote.engine import RemoteSource
from ..transfer.segments import Segment

OpenSource = Callable[[str], str | RemoteSource]


@dataclass(frozen=True)
class SourceAccess:
    """How a run reads the source's data files.

    Attributes:
        open: ``open(name)`` gives a data file's local path or a remote source (it may download
            the file first).
        local: the files are on this machine, where OUT may share their blocks.
        remote: ``remote(name)``: the file as the fetch engine reads it, None for a local file
            (the copy queues every remote file's bytes before copying any).
        close: stops the fetch engine's reads; called before the copy closes its files.
    """

    open: OpenSource
    local: bool
    remote: Callable[[str], RemoteSource | None] = lambda name: None
    close: Callable[[], None] = lambda: None

    @classmethod
    def on_disk(cls, ckpt: Checkpoint) -> SourceAccess:
        """The checkpoint's own files: its directory, or its Hugging Face cache snapshot."""
        return cls(lambda name: str(ckpt.path(name)), local=True)

    @classmethod
    def fetched(
        cls, open_file: OpenSource, remote: Callable[[str], RemoteSource | None], close: Callable[[], None]
    ) -> SourceAccess:
        """Files fetched as they are needed (a Hub repo): read, never shared."""
        return cls(open_file, local=False, remote=remote, close=close)


# What each field of a stamp is, for the message naming what changed.
_STAMP_FIELDS = ("device", "inode", "size", "modification time", "status-change time")


def source_stamps(plan: Plan) -> dict:
    """What the run marker records of the source, for a later run to tell whether it changed:
    each shard's stamp as planned from, or a Hub source's commit."""
    ckpt = plan.checkpoint
    if ckpt.hub is not None:
        return {"commit": ckpt.hub.get("commit")}
    # Without the device: runs on other hosts sharing OUT and MODEL (NFS, Lustre) see the same
    # inode, size and times of a file, but each client numbers the mount's device its own way.
    return {f: list(stamp[1:]) for f, stamp in ckpt.stamps.items()}


def check_unchanged(plan: Plan, files: list[str] | tuple[str, ...]) -> None:
    """Raise ReshardError unless each local source file of ``files`` is still the one the run
    planned from (its stamp as its header was read); a Hub source's files are not stamped.

    Raises:
        ReshardError: A file changed or is gone: one line naming it and what changed.
    """
    ckpt = plan.checkpoint
    for name in files:
        planned = ckpt.stamps.get(name)
        if planned is None:
            continue
        path = ckpt.path(name)
        try:
            now = file_stamp(os.stat(path))
        except OSError as e:
            what = f"it is gone ({e.strerror})"
        else:
            if now == planned:
                continue
            what = ", ".join(f for f, a, b in zip(_STAMP_FIELDS, planned, now, strict=True) if a != b)
            what = f"its {what} changed: it was replaced or rewritten"
        again = advice("replace", f"run the same command again with {param('overwrite', True)}")
        raise BadInput(
            f"{path}: the source changed during the run ({what}); no stage was finished from it: once "
            f"{param('model_dir')} is stable, {again}"
        )


class BlobCheck:
    """The sha256 of a whole Hub shard, taken as its bytes stream by, against the Hub's LFS
    sha256 of it: huggingface_hub checks only a download's size, and the copy reads every byte
    of a shard it needs whole anyway."""

    def __init__(self, where: str, path: str, want: str, head: bytes, fix: str) -> None:
        self.where, self.path, self.want, self.fix = where, path, want, fix
        self.digest = hashlib.sha256(head)
        self.update = self.digest.update

    @classmethod
    def of(cls, plan: Plan, file: str, src: str | RemoteSource, segments: list[Segment]) -> BlobCheck | None:
        """The check of source ``file``, whose every tensor ``segments`` copies: read from the
        local path ``src`` when it is a Hugging Face cache blob, named by its sha256 (the Hub's
        LFS sha256), of a Hub source or of a cache folder given as MODEL; or fetched whole
        from the Hub straight into the stage (``src`` remote), against the Hub's LFS sha256."""
        ckpt = plan.checkpoint
        want = ckpt.blob_sha256.get(file)
        if want is None:
            return None
        data_start = ckpt.file_sizes[file] - sum(s.nbytes for s in segments)  # tensors tile the data
        if isinstance(src, RemoteSource):
            head = bytearray(data_start)
            src.readinto(memoryview(head), 0)  # the header planning kept
            return cls(src.display, "", want, bytes(head), AGAIN)
        with open(src, "rb") as f:
            head = f.read(data_start)
        # A Hub source fetches the file again; a cache folder given as MODEL is only read.
        fix = AGAIN if ckpt.hub else "download the file again"
        return cls(f"{ckpt.display}: {file}", os.path.realpath(src), want, bytes(head), fix)

    def check(self) -> None:
        """Raise ReshardError unless the bytes read are the Hub's (those the blob is named by)."""
        got = self.digest.hexdigest()
        if got != self.want and not self.path:
            raise RemoteError(
                f"{self.where}: the bytes fetched (sha256 {got[:12]}...) are not the Hub's (LFS sha256 "
                f"{self.want[:12]}...): the file changed on the server or the transfer was damaged; "
                f"{self.fix}"
            )
        if got != self.want:
            raise BadInput(
                f"{self.where}: the bytes read (sha256 {got[:12]}...) are not the Hub's (LFS sha256 "
                f"{self.want[:12]}..., the cached blob's name): the cached copy {self.path} is damaged or "
                f"was replaced; delete it and {self.fix}"
            )
