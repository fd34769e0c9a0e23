"""The resume journal: each stage's record of the data files a run finished, with their
tensors' digests, so that the same command run again keeps them and redoes only the rest.

A stage being written holds ``JOURNAL``, one JSON line per finished file, appended after the
file's bytes and name are durable; a finished stage holds none. A line torn by a crash only
costs its file being redone.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import JSON_ERRORS
from ..format.names import CLONE, JOURNAL
from ..plan.planner import Plan, StagePlan
from .datafile import header, matches

Digests = dict[str, str | None]  # tensor name -> sha256 (None: shared, never read)


def read_journal(path: Path) -> dict[str, dict[str, str]]:
    """The journal ``path``'s entries, file name -> digests; none when it is missing."""
    entries: dict[str, dict[str, str]] = {}
    try:
        lines = path.read_bytes().splitlines()
    except FileNotFoundError:
        return entries
    for line in lines:
        try:
            rec = json.loads(line)
            entries[rec["file"]] = rec["digests"]
        except (*JSON_ERRORS, KeyError, TypeError):
            continue  # a line torn by a crash (bytes of any kind): that file is simply redone
    return entries


def append_journal(stage_dir: Path, finished: dict[str, Digests]) -> None:
    """Record the files ``finished`` (name -> digests) in ``stage_dir``'s journal."""
    records = [{"file": name, "digests": digests} for name, digests in finished.items()]
    with open(stage_dir / JOURNAL, "a") as j:
        j.write("".join(json.dumps(r) + "\n" for r in records))


def keepable(plan: Plan, stage_dir: Path, stage: StagePlan) -> dict[str, Digests]:
    """The data files of an unfinished stage that an earlier run finished (journaled, and they
    fit the plan), with their tensors' digests. Reads only."""
    journal = read_journal(stage_dir / JOURNAL)
    kept: dict[str, Digests] = {}
    for f in stage.files:
        entry = journal.get(f.name)
        if entry is None or set(entry) != {t.name for t in f.tensors}:
            continue
        # A CLONE's header is its source's own: from the Hub it is not read just to compare.
        head = b"" if f.layout == CLONE and plan.checkpoint.hub is not None else header(plan, f)
        if matches(stage_dir / f.name, f, head):
            kept[f.name] = entry
    return kept
