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
shares the source's blocks) is rewritten.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import JSON_ERRORS
from ..format.names import CLONE, JOURNAL
from ..plan.planner import Plan, StagePlan
from .datafile import Digests, file_digests, header, matches, stamp
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
            if isinstance(rec["digests"], dict):
                entries[rec["file"]] = (rec["digests"], rec.get("stamp"))
        except (*JSON_ERRORS, KeyError, TypeError):
            continue  # a line torn by a crash (bytes of any kind): that file is simply redone
    return entries


def append_journal(stage_dir: Path, finished: dict[str, Digests]) -> None:
    """Record the files ``finished`` (name -> digests), renamed into ``stage_dir`` just now, in
    its journal, each with its stamp (see :func:`~.datafile.stamp`)."""
    records = [
        {"file": name, "digests": digests, "stamp": stamp(stage_dir / name)}
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
