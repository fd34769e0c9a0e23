"""The source files a run reads are the ones it planned from.

A local checkpoint's shards are stamped as their headers are read (``file_stamp``: device,
inode, size, modification and status-change times). A shard replaced while a run copies (a
rename over it keeps the mtime, not the inode or the ctime; a rewrite in place changes the
times) would put other bytes under digests computed from those very bytes, and nothing after
the run could tell. So each shard is checked against its stamp just before it is copied and
just after (the bytes read in between are then the planned file's: replacing it, or putting it
back, changes its ctime), and every shard once more before any stage is declared complete.
A Hub source is pinned to one commit: every byte fetched is named by it; a shard copied whole
from a cached blob is hashed as it streams by and compared with the Hub's LFS sha256
(:class:`BlobCheck`).

A split's source is part of its identity, bytes included: the run marker and ``reshard.json``
record each local shard's stamp (:func:`source_stamps`). A later run over the same OUT keeps
what is there only for the shards whose stamp is unchanged (:func:`changed_files`: no read),
or whose tensors hash to what OUT holds (:func:`source_difference`); else OUT holds another
split (the next checkpoint of a training run has the same layout and other bytes).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from ..errors import ReshardError, param
from ..plan.planner import Plan
from ..source.header import file_stamp
from ..stage.findings import Finding
from ..stage.reader import read_manifest
from ..transfer.copier import RangeSource, copy_segments
from ..transfer.segments import Segment
from .datafile import Digests

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


def changed_files(plan: Plan, recorded: object) -> list[str]:
    """The local source files whose stamp is not the one ``recorded`` (a run record's
    ``source_files``; every file when it records none); none for a Hub source, whose commit
    the run identity names. Stat calls only: the stamps were taken as the headers were read."""
    if plan.checkpoint.hub is not None:
        return []
    now = source_stamps(plan)
    if not isinstance(recorded, dict):
        return sorted(now)
    return [name for name in sorted({*recorded, *now}) if recorded.get(name) != now.get(name)]


def source_difference(
    plan: Plan,
    out: Path,
    ranks: Iterable[int],
    kept: Mapping[int, Mapping[str, Digests]],
    files: Iterable[str],
) -> str | None:
    """The first tensor of the source ``files`` whose bytes are not the ones OUT holds for it:
    the digest the manifest of a complete stage of ``ranks`` records, or a kept file's journal
    (``kept``: rank -> file -> digests); where the split shared blocks and recorded none, the
    stage file's own bytes. None when every one matches: then the stages hold the source's bytes.

    Reads the tensors of ``files`` (once each) and, for shared blocks, the stages' copies.
    """
    ckpt = plan.checkpoint
    files = set(files)
    want: dict[str, str] = {}
    unrecorded: dict[Path, list[Segment]] = {}
    for rank in ranks:
        stage = plan.stages[rank]
        m = read_manifest(out / stage.dirname, str(out / stage.dirname))
        recorded = {} if isinstance(m, Finding) else {n: t.sha256 for n, t in m.tensors.items()}
        for f in stage.files:
            for t in f.tensors:
                if t.source.file not in files:
                    continue
                if recorded.get(t.name) is not None:
                    want[t.name] = recorded[t.name]
                else:
                    segment = Segment(t.name, f.data_start + t.out_offset, t.source.nbytes)
                    unrecorded.setdefault(out / stage.dirname / f.name, []).append(segment)
    for digests in (d for files_kept in kept.values() for d in files_kept.values()):
        want.update({n: d for n, d in digests.items() if d is not None and ckpt.tensors[n].file in files})
    for path, segments in unrecorded.items():
        try:
            held = copy_segments(str(path), sorted(segments, key=lambda s: s.offset))
        except (OSError, ReshardError):  # a damaged stage: not this source's bytes
            return segments[0].name
        want.update({n: d for n, d in held.items() if n not in want and d is not None})
    by_file: dict[str, list[Segment]] = {}
    for name in want:
        t = ckpt.tensors[name]
        by_file.setdefault(t.file, []).append(Segment(name, t.offset, t.nbytes))
    for file in sorted(by_file):
        got = copy_segments(str(ckpt.path(file)), sorted(by_file[file], key=lambda s: s.offset))
        differ = sorted(n for n, d in got.items() if d != want[n])
        if differ:
            return differ[0]
    return None


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
        raise ReshardError(
            f"{path}: the source changed during the run ({what}); no stage was finished from it: once "
            f"{param('model_dir')} is stable, run the same command again with {param('overwrite', True)}"
        )


class BlobCheck:
    """The sha256 of a whole Hub shard, taken as its bytes stream by, against the Hub's LFS
    sha256 of it: huggingface_hub checks only a download's size, and the copy reads every byte
    of a shard it needs whole anyway."""

    def __init__(self, where: str, path: str, want: str, head: bytes) -> None:
        self.where, self.path, self.want = where, path, want
        self.digest = hashlib.sha256(head)
        self.update = self.digest.update

    @classmethod
    def of(cls, plan: Plan, file: str, src: str | RangeSource, segments: list[Segment]) -> BlobCheck | None:
        """The check of source ``file``, whose every tensor ``segments`` copies, read from the
        local path ``src`` (a cached blob): when it is a Hub shard with a known LFS sha256."""
        ckpt = plan.checkpoint
        want = ckpt.blob_sha256.get(file)
        if ckpt.hub is None or want is None or not isinstance(src, str | os.PathLike):
            return None
        data_start = ckpt.file_sizes[file] - sum(s.nbytes for s in segments)  # tensors tile the data
        with open(src, "rb") as f:
            head = f.read(data_start)
        return cls(f"{ckpt.display}: {file}", os.path.realpath(src), want, head)

    def check(self) -> None:
        """Raise ReshardError unless the bytes read are the Hub's."""
        got = self.digest.hexdigest()
        if got != self.want:
            raise ReshardError(
                f"{self.where}: the bytes read (sha256 {got[:12]}...) are not the Hub's (LFS sha256 "
                f"{self.want[:12]}...): the cached copy {self.path} is damaged or was replaced; delete it "
                "and run the same command again"
            )
