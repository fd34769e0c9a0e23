"""The resume journal: each stage's record of the data files a run finished, with their
tensors' digests, so that the same command run again keeps them and redoes only the rest.

A stage being written holds ``JOURNAL``, one JSON line per finished file, appended after the
file's bytes and name are durable; a finished stage holds none. A line torn by a crash only
costs its file being redone.

A file is kept only when its bytes are proven to be the ones the run that journaled it
finished: the file is still the one it renamed into place, unchanged since (its inode, size,
modification and change times as journaled; the change time moves with any write, to the
filesystem's timestamp granularity, and no call can set it back), or else its tensors hash to
the digests journaled. Anything else (a
file replaced or written to by another writer, copied, or journaled without digests because it
shares the source's blocks) is rewritten. Each line names its digest (``format.digest``); a line
of another (a stage-v1 split's sha256, set aside before) is not kept: its file is rewritten,
since the manifest the run writes records the current one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import JSON_ERRORS
from ..format.digest import TENSOR_DIGEST
from ..format.names import CLONE, JOURNAL
from ..plan.planner import Plan, StagePlan
from ..stage.findings import Finding
from ..stage.reader import read_manifest
from .datafile import Digests, file_digests, header, matches, stamp
from .durability import fsync_dir, remove
from .sources import SourceAccess


def read_journal(path: Path) -> dict[str, tuple[Digests, list[int] | None]]:
    """The journal ``path``'s entries, file name -> (digests, the file's stamp as journaled);
    none when it is missing."""
    entries: dict[str, tuple[Digests, list[int] | None]] = {}
    try:
        lines = path.read_bytes().splitlines()
    except FileNotFoundError:
        return entries
    for line in lines:
        try:
            rec = json.loads(line)
            if isinstance(rec["digests"], dict) and rec.get("digest") == TENSOR_DIGEST:
                entries[rec["file"]] = (rec["digests"], rec.get("stamp"))
        except (*JSON_ERRORS, KeyError, TypeError):
            continue  # a line torn by a crash (bytes of any kind): that file is simply redone
    return entries


def append_journal(stage_dir: Path, finished: dict[str, Digests]) -> None:
    """Record the files ``finished`` (name -> digests), renamed into ``stage_dir`` just now, in
    its journal, each with its stamp (see :func:`~.datafile.stamp`)."""
    records = [
        {"file": name, "digest": TENSOR_DIGEST, "digests": digests, "stamp": stamp(stage_dir / name)}
        for name, digests in finished.items()
    ]
    with open(stage_dir / JOURNAL, "a") as j:
        j.write("".join(json.dumps(r) + "\n" for r in records))


def keepable(plan: Plan, stage_dir: Path, stage: StagePlan) -> dict[str, Digests]:
    """The data files of an unfinished stage that an earlier run finished (journaled, and they
    fit the plan), with their tensors' digests. Reads only."""
    journal = read_journal(stage_dir / JOURNAL)
    kept: dict[str, Digests] = {}
    for f in stage.files:
        digests, journaled = journal.get(f.name, ({}, None))
        if set(digests) != {t.name for t in f.tensors}:
            continue
        path = stage_dir / f.name
        # A CLONE's header is its source's own: from the Hub it is not read just to compare.
        if f.layout == CLONE and plan.checkpoint.hub is not None:
            head = b""
        else:
            head = header(f, SourceAccess.on_disk(plan.checkpoint))
        if not matches(path, f, head):
            continue
        unchanged = journaled is not None and journaled == stamp(path)
        if unchanged or (None not in digests.values() and file_digests(path, f) == digests):
            kept[f.name] = digests
    return kept


def set_aside(stage_dir: Path, damaged: str) -> None:
    """Turn the finished stage in ``stage_dir`` into an unfinished one without its data file
    ``damaged`` (found damaged while loading), so that the same split run again rewrites that
    file alone.

    The stage's other data files are journaled with the digests its manifest records and no
    stamp: a run keeps each only once its bytes hash to them (:func:`keepable`); a file with
    tensors its manifest records no digest for is not journaled (rewritten). Then ``damaged``
    is deleted, which leaves the stage incomplete (a data file missing). Killed in between,
    the stage still holds the damaged file: the next load finds it again.

    Args:
        stage_dir: a finished stage directory (OUT/ppN) the caller owns, e.g. the stage cache's.
        damaged: the name of its data file to rewrite.

    Raises:
        OSError: the journal cannot be written or the file deleted (a read-only cache).

    Example:
        >>> import os
        >>> from pathlib import Path
        >>> from qwen35_reshard import reshard
        >>> from qwen35_reshard.write.journal import set_aside
        >>> from qwen35_reshard.write.options import WriteOptions
        >>> small = WriteOptions(max_file_bytes=200_000)  # several data files a stage
        >>> _ = reshard(MODEL, OUT, pp=2, write=small)
        >>> stage = os.path.join(OUT, "pp1")
        >>> data = sorted(f for f in os.listdir(stage) if f.endswith(".safetensors"))
        >>> set_aside(Path(stage), data[0])
        >>> reshard(MODEL, OUT, pp=2, write=small).written.files_kept == len(data) - 1
        True
    """
    m = read_manifest(stage_dir, str(stage_dir))
    if isinstance(m, Finding):
        remove(stage_dir / damaged)  # no manifest to journal from: the stage is rebuilt whole
        return
    digests: dict[str, Digests] = {}
    for t in m.tensors.values():
        digests.setdefault(t.file, {})[t.name] = t.digest
    kept = {f: d for f, d in digests.items() if f != damaged and None not in d.values()}
    records = [{"file": f, "digest": m.digest, "digests": d, "stamp": None} for f, d in sorted(kept.items())]
    with open(stage_dir / JOURNAL, "a") as j:
        j.write("".join(json.dumps(r) + "\n" for r in records))
        j.flush()
        os.fsync(j.fileno())
    remove(stage_dir / damaged)
    fsync_dir(stage_dir)
