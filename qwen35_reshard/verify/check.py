"""Check a split: every stage's data files, index, config and manifest, and optionally the source.

``verify(OUT)`` or ``verify(OUT/pp2)`` never trusts the manifest alone. Each stage directory
gets the loader's checks (``stage.reader.read_stage``: manifest, index, config.json, data file sizes
and headers) and more: headers must follow the writer's stricter rules (see
:func:`.stagedir._strict_extras`), no stray data file may lie beside them, every layer of the
stage must have tensors, and every tensor's bytes are hashed (in bounded chunks, by
``transfer.copier.copy_segments``) and compared with the manifest. With a
source checkpoint, the plan is rebuilt from the settings each stage's manifest records, and
every tensor's placement and bytes are compared with the source.

Files the split shared with the source (layouts: docs/format.md, "Data file layouts")
record no sha256 for the tensors whose blocks were shared: without the source, verify checks
their structure, a clone's whole-file sha256 where the manifest records one (the source's
Hugging Face blob name, recorded where the split copied the clone and checked its bytes), and
reports the bytes it could compare with nothing (``bytes_unrecorded``); ``--source`` compares
them with the source like every other tensor.
A clone's header is the source's own, so the writer's stricter header rules apply to the
files whose header the tool wrote, and a clone must equal its source byte for byte.

Problems are collected as findings rather than raised, so one run reports everything that is
wrong; a ReshardError is raised only for bad input (OUT is not a directory, a bad source).
A stage without its manifest or index is reported as incomplete, never accepted.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..errors import BadInput, param
from ..format.names import STAGE_MANIFEST
from ..source.hub.cache import HubSettings
from ..source.open import open_model
from ..transfer.copier import CHUNK_BYTES
from .report import VerifyReport
from .rundir import check_run_dir, check_same_split, is_run_dir, is_stage_dir, new_stage, parent_record
from .source import check_against_source
from .stagedir import check_stage


def verify(
    path: str | os.PathLike[str],
    source: str | os.PathLike[str] | None = None,
    *,
    ranks: Sequence[int] | str | None = None,
    env: Mapping[str, str] | None = None,
    nnodes: int | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    hub: HubSettings | None = None,
) -> VerifyReport:
    """Check the run directory or single stage directory ``path``; compare with ``source`` if given.

    A run directory is checked whole: a stage of its split that is absent is a finding, unless
    ``ranks`` asks for some stages only (a node's). Stage directories without a run record
    beside them (stages copied to a node) are each checked on their own manifest, and must be
    of one split.

    Args:
        path: the run directory OUT, or one stage directory OUT/ppN.
        source: the checkpoint the split was made from (a directory, cache folder or Hub repo
            id): then every tensor must be where the plan puts it, with identical bytes.
        ranks: check only these stages of the run directory ``path``; ``"auto"``: those of the
            node this runs on, read from the scheduler's variables in ``env`` (as a split's).
        env: the environment ``ranks="auto"`` reads (default: ``os.environ``).
        nnodes: with ``ranks="auto"``: the node count, where the environment gives none.
        chunk_bytes: read size for hashing.
        hub: revision, token and offline mode for a Hub repo id ``source`` (the group
            :func:`~qwen35_reshard.reshard` takes).

    Returns:
        A :class:`VerifyReport`: ``ok``, the findings (missing, extra, different, corrupt,
        incomplete), per-stage summaries and bytes hashed.

    Raises:
        ReshardError: only for bad input (``path`` is no split, a bad ``source``); everything
            wrong with the split is a finding.

    Example:
        >>> from qwen35_reshard import reshard
        >>> from qwen35_reshard.verify import verify
        >>> _ = reshard(MODEL, OUT, pp=2)
        >>> verify(OUT, source=MODEL).ok
        True
    """
    display = os.fspath(path)
    root = Path(display)
    if not root.is_dir():
        raise BadInput(f"{display}: not a directory; pass OUT or one of its stage directories (OUT/pp0)")
    ckpt, repo = (None, None)
    if source is not None:
        ckpt, repo = open_model(os.fspath(source), hub or HubSettings())
    report = VerifyReport(target=display, source=os.fspath(source) if source is not None else None)
    if is_run_dir(root):
        stages = check_run_dir(root, display, report, ranks, os.environ if env is None else env, nnodes)
    elif ranks is not None:
        raise BadInput(
            f"{param('ranks')} picks stages of a run directory; {display} is a stage directory: pass "
            f"{display} alone, or its run directory with {param('ranks')}"
        )
    elif is_stage_dir(root):
        stages = [new_stage(root, display, report, parent_record(root, report))]
    else:
        raise BadInput(
            f"{display}: holds no stage directories (pp0, pp1, ...) and no {STAGE_MANIFEST}; pass the "
            "OUT of a qwen35-reshard run or one of its stage directories"
        )
    for stage in stages:
        check_stage(stage, report, ckpt, chunk_bytes)
    check_same_split(stages, report)
    if ckpt is not None:
        check_against_source(ckpt, [s for s in stages if s.manifest is not None], report, chunk_bytes, repo)
    return report
