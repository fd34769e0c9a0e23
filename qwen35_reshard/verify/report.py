"""What verify found: per-stage summaries and findings (:class:`VerifyReport`), and the stage
directory being checked, which the checks of a run directory, a stage and the source share."""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import Audience
from ..format.identity import RunIdentity
from ..format.names import RUN_MANIFEST, RUN_MARKER, STAGE_MANIFEST, stage_dir_rank
from ..stage.findings import CORRUPT, DIFFERENT, EXTRA, KINDS, MISSING, REPAIR, Finding
from ..stage.manifest import StageManifest
from ..stage.reader import RunRecord

# How verify reports a damaged non-weight file, by what stage.manifest.damaged_side_files says of it.
SIDE_KIND = collections.defaultdict(lambda: CORRUPT, {"missing": MISSING, "changed": DIFFERENT})

# add(kind, message, file=..., tensor=...): records a finding of one stage, and returns it.
Add = Callable[..., Finding]


@dataclass
class StageSummary:
    """What was checked in one stage directory."""

    stage: str
    path: str
    rank: int | None = None
    complete: bool = False  # manifest and index present and consistent
    files: int = 0
    tensors: int = 0
    bytes: int = 0  # the data files' recorded sizes: the size ``plan`` gives the stage
    bytes_hashed: int = 0
    bytes_unrecorded: int = 0  # shared with the source at split time: no digest to compare them with


@dataclass
class VerifyReport:
    """Everything verify found. ``ok`` when there is no finding."""

    target: str
    source: str | None = None
    stages: list[StageSummary] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    not_built: list[int] = field(default_factory=list)  # stages of the split not asked for (``ranks``)
    missing_stages: list[int] = field(default_factory=list)  # stages asked for (all by default) absent
    # Of those, the ones no run record says were complete: built by a split, not mended by a repair.
    unbuilt: list[int] = field(default_factory=list)
    copied: bool = False  # stage directories without a run record beside them: copied stages
    identity: RunIdentity | None = None  # the split's settings, as its run record or first stage records
    # Findings that the stages hold intact bytes that are not the source's (another checkpoint of the
    # same layout, or one changed since): no repair mends that.
    not_from_source: list[Finding] = field(default_factory=list)
    # digest (format.digest) -> source tensor -> its digest, for the digest each stage records
    source_digests: dict[str, dict[str, str]] = field(default_factory=dict, repr=False)
    source_bytes_hashed: int = 0
    recorded_source: str | None = None  # the source the stage manifests record (see stagedir.recorded_source)
    recorded_revision: str | None = None  # with a Hub repo id there: the commit the split was made from
    recorded_split: bool = False  # a run record or a stage manifest says which split this is
    # A quantization method the schema does not know: warnings, one per stage, not findings.
    unchecked: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.findings

    @property
    def repairable(self) -> bool:
        """Whether ``verify --source MODEL --repair`` mends everything found: not a run in
        progress or interrupted (the same command finishes it), a stage directory outside the
        split (deleted by hand), a stage never built here, other bytes than the source's, or a
        directory that records no split at all."""
        outside = [f for f in self.findings if f.kind == EXTRA and f.stage and not (f.file or f.tensor)]
        return (
            self.recorded_split
            and not outside
            and not self.not_from_source
            and not self.unbuilt
            and not any(f.file == RUN_MARKER for f in self.findings)
        )

    @property
    def checked(self) -> list[int]:
        """The ranks of the stages checked."""
        return sorted(s.rank for s in self.stages if s.rank is not None)

    def findings_for(self, stage: str) -> list[Finding]:
        return [f for f in self.findings if f.stage == stage]

    def counts(self) -> dict[str, int]:
        return {k: sum(1 for f in self.findings if f.kind == k) for k in KINDS}

    def to_dict(self, audience: Audience | None = None) -> dict:
        """The report as JSON-ready data, its findings' messages in ``audience``'s terms (else the
        library's)."""
        return {
            "status": "ok" if self.ok else "failed",
            "target": self.target,
            "source": self.source,
            "counts": self.counts(),
            "stages": [asdict(s) for s in self.stages],
            "checked": self.checked,
            "missing_stages": self.missing_stages,
            "not_built": self.not_built,
            "source_bytes_hashed": self.source_bytes_hashed,
            "recorded_source": self.recorded_source,
            "recorded_revision": self.recorded_revision,
            "unchecked_quantization": self.unchecked,
            "findings": [f.to_dict(audience) for f in self.findings],
        }


@dataclass
class CheckedStage:
    """A stage directory while it is being checked."""

    path: Path
    display: str  # path as shown in messages
    summary: StageSummary
    run: RunRecord | None  # what the run directory records, if anything
    manifest: StageManifest | None = None
    digests: dict[str, str] = field(default_factory=dict)  # digests computed from the files (manifest's)


def adder(report: VerifyReport, stage: CheckedStage) -> Add:
    def add(kind: str, message: str, *, file: str | None = None, tensor: str | None = None) -> Finding:
        finding = Finding(kind, message, file, tensor, stage.summary.stage)
        report.findings.append(finding)
        return finding

    return add


def side_file_message(display: str, name: str, why: str) -> str:
    """What verify says of a recorded non-weight file of ``display`` that is damaged: ``why``
    as :func:`~..stage.manifest.damaged_side_files` gives it."""
    record = STAGE_MANIFEST if stage_dir_rank(Path(display)) is not None else RUN_MANIFEST
    if why == "changed":
        why = f"not the file the split recorded (its sha256 differs from {record}'s)"
    return f"{display}/{name} is {why}; servers read it: {REPAIR}"
