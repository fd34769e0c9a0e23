"""The source files a run reads are the ones it planned from.

A local checkpoint's shards are stamped as their headers are read (``file_stamp``: device,
inode, size, modification and status-change times). A shard replaced while a run copies (a
rename over it keeps the mtime, not the inode or the ctime; a rewrite in place changes the
times) would put other bytes under digests computed from those very bytes, and nothing after
the run could tell. So each shard is checked against its stamp just before it is copied and
just after (the bytes read in between are then the planned file's: replacing it, or putting it
back, changes its ctime), and every shard once more before any stage is declared complete.
A Hub source is pinned to one commit: every byte fetched is named by it.
"""

from __future__ import annotations

import os

from ..errors import ReshardError, param
from ..plan.planner import Plan
from ..source.header import file_stamp

# What each field of a stamp is, for the message naming what changed.
_STAMP_FIELDS = ("device", "inode", "size", "modification time", "status-change time")


def source_stamps(plan: Plan) -> dict:
    """What the run marker records of the source, for a later run to tell whether it changed:
    each shard's stamp as planned from, or a Hub source's commit."""
    ckpt = plan.checkpoint
    if ckpt.hub is not None:
        return {"commit": ckpt.hub.get("commit")}
    return {f: list(stamp) for f, stamp in ckpt.stamps.items()}


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
