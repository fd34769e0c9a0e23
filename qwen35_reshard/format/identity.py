"""The run identity: the settings that decide every output byte of a split, as plain data."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from .jsonio import dumps_text, is_uint

_EP_FIELDS = frozenset({"ep", "nodes", "redundant_experts", "expert_location"})


@dataclass(frozen=True)
class RunIdentity:
    """The settings that decide every output byte of a split; a resumed run must match them.

    Recorded in the run marker, ``reshard.json`` and every stage manifest as ``identity``
    (``write.manifest.run_identity`` makes the one of a plan).
    """

    source_fingerprint: str
    source: str  # a Hub source's ``repo_id@commit``; ``names.LOCAL_SOURCE`` for a local directory
    pp: int
    runtime: str
    partition: tuple[int, ...]
    mtp: str
    max_file_bytes: int
    max_header_bytes: int
    tool_version: str
    # Expert parallelism (issue 42); recorded only for an expert-parallel split (ep > 1), so a
    # pipeline split's identity is what it was before. ``expert_location``: the sha256 of SGLang's
    # initial expert location (the stage manifests record its rows), or None for its trivial one.
    ep: int = 1
    nodes: int = 1
    redundant_experts: int = 0
    expert_location: str | None = None

    def to_json(self) -> dict:
        """The identity as its JSON object (``partition`` a list; the EP fields where ep > 1)."""
        doc = dataclasses.asdict(self) | {"partition": list(self.partition)}
        return doc if self.ep > 1 else {k: v for k, v in doc.items() if k not in _EP_FIELDS}

    @classmethod
    def from_json(cls, obj: object) -> RunIdentity | None:
        """The identity recorded as ``obj``, or None when it is not a well-formed one."""
        if isinstance(obj, dict) and "source" not in obj:
            obj = {**obj, "source": ""}  # recorded before the source was: another split than any now
        if isinstance(obj, dict) and not _EP_FIELDS.intersection(obj):
            obj = {**obj, "ep": 1, "nodes": 1, "redundant_experts": 0, "expert_location": None}
        if not isinstance(obj, dict) or set(obj) != {f.name for f in dataclasses.fields(cls)}:
            return None
        partition = obj["partition"]
        ints = ("pp", "max_file_bytes", "max_header_bytes", "ep", "nodes", "redundant_experts")
        strs = ("source_fingerprint", "source", "runtime", "mtp", "tool_version")
        if not (
            all(is_uint(obj[k]) for k in ints)
            and all(isinstance(obj[k], str) for k in strs)
            and isinstance(partition, list)
            and all(is_uint(n) for n in partition)
            and (obj["expert_location"] is None or isinstance(obj["expert_location"], str))
        ):
            return None
        return cls(**(obj | {"partition": tuple(partition)}))

    def differences(self, other: RunIdentity) -> list[tuple[str, object, object]]:
        """``(setting, self's value, other's value)`` for every setting where the two differ."""
        return [
            (f.name, getattr(self, f.name), getattr(other, f.name))
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]


def describe_differences(old: RunIdentity, new: RunIdentity) -> str:
    """``pp 4 -> 2, partition [4, 4] -> [3, 5]``: the settings where ``new`` differs from ``old``."""

    def show(k: str, v: object) -> object:
        if k == "source_fingerprint":
            return f"{v}"[:12] + "..."
        return list(v) if isinstance(v, tuple) else v or "(not recorded)"

    differ = old.differences(new)
    return ", ".join(f"{k} {show(k, a)} -> {show(k, b)}" for k, a, b in differ) or "no setting differs"


def location_sha256(rows: Sequence[Sequence[int]] | None) -> str | None:
    """What identifies SGLang's initial expert location in a run identity (``expert_location``):
    the sha256 of its rows as the stage manifests record them (None: the trivial location). The
    writer records it and a server compares its own ``--init-expert-location`` with it: one digest.

    Example:
        >>> location_sha256(None) is None, location_sha256([[1, 0]]) == location_sha256(((1, 0),))
        (True, True)
    """
    return None if rows is None else hashlib.sha256(dumps_text([list(r) for r in rows]).encode()).hexdigest()
