"""Whether OUT holds the source's bytes: a split's identity includes them, cheaply.

The next checkpoint of a training run has the same config, index and headers as the last and
other bytes: the run identity (settings, layout fingerprint) cannot tell the two splits apart.
The run marker and ``reshard.json`` record each local source shard's stamp (inode, size,
modification and status-change times; ``sources.source_stamps``). A run over an OUT holding a
split of its settings keeps what is there only for the shards whose stamp is unchanged
(:func:`changed_files`: no read), or whose tensors hash to what OUT holds
(:func:`source_difference`); else OUT holds another split. A Hub source's commit, which the
run identity names, names its bytes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

from ..errors import ReshardError
from ..format.digest import TENSOR_DIGEST
from ..plan.planner import Plan
from ..stage.findings import Finding
from ..stage.reader import read_manifest
from ..transfer.copier import copy_segments
from ..transfer.segments import Segment
from .datafile import Digests
from .sources import source_stamps


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
        # A stage-v1 manifest's sha256 is not what copy_segments computes: its bytes are hashed.
        usable = not isinstance(m, Finding) and m.digest == TENSOR_DIGEST
        recorded = {n: t.digest for n, t in m.tensors.items()} if usable else {}
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
