"""Which stages of a split ``verify OUT`` checks: all of them, or the ones asked for (``ranks``,
a node's with ``"auto"``); every one of those that is absent is a finding naming it, with the
command that checks only the stages present."""

from __future__ import annotations

import shlex
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from ..errors import BadInput, param
from ..format.identity import RunIdentity
from ..format.names import RUN_MANIFEST, stage_dirname
from ..plan.nodes import node_from_env
from ..stage.findings import MISSING, RERUN, Finding
from ..stage.reader import read_manifest
from .report import VerifyReport


def stages_identity(dirs: dict[int, Path]) -> RunIdentity | None:
    """The identity the first stage manifest (by rank) records, if one does: the split of
    stage directories with no run record beside them."""
    for path in dirs.values():
        m = read_manifest(path, str(path))
        if not isinstance(m, Finding) and m.identity is not None:
            return m.identity
    return None


def asked_ranks(
    ranks: Sequence[int] | str | None,
    env: Mapping[str, str],
    nnodes: int | None,
    pp: int | None,
    display: str,
) -> set[int] | None:
    """The stages ``ranks`` asks for (None: all), those of this node for ``"auto"`` (read from
    ``env`` as a split reads it)."""
    if ranks is None:
        return None
    if pp is None:
        raise BadInput(
            f"{display} records no split (no readable {RUN_MANIFEST} or stage manifest): "
            f"{param('ranks')} cannot pick its stages; verify it without {param('ranks')}"
        )
    if isinstance(ranks, str):
        if ranks != "auto":
            raise BadInput(f"{param('ranks', ranks)} must be stage numbers or 'auto'")
        return set(node_from_env(env, pp, nnodes).stages)
    for r in ranks:
        if not 0 <= r < pp:
            raise BadInput(f"{param('ranks', r)} is not a stage of this pp={pp} split (0 to {pp - 1})")
    return set(ranks)


def report_missing(
    display: str,
    report: VerifyReport,
    pp: int | None,
    present: set[int],
    asked: set[int] | None,
    complete: set[int],
    name_of: Callable[[int], str] = stage_dirname,
) -> None:
    """A finding for each stage of the split (or of ``asked``) absent from the run directory,
    saying what leads on: the same command again where the run recorded it complete, else
    building it, or checking only the stages present."""
    ranks = asked if asked is not None else set(range(pp)) if pp is not None else complete
    report.missing_stages = sorted(ranks - present)
    report.unbuilt = [r for r in report.missing_stages if r not in complete]
    here = sorted(present & set(range(pp or 0)))
    names = ", ".join(map(name_of, here))
    nodes = name_of is not stage_dirname  # an expert-parallel split's: checked by index (--rank G)
    only = shlex.join(["qwen35-reshard", "verify", display, *(a for r in here for a in ("--rank", str(r)))])
    for rank in report.missing_stages:
        name = name_of(rank)
        if rank in complete:
            why = f"{RUN_MANIFEST} records it as complete; {RERUN} (it builds it again)"
        elif report.copied and here:
            why = (
                f"{display} holds copied stages ({names}) without the run's {RUN_MANIFEST}, each checked "
                f"on its own manifest; to check them as the stages of one split: {only}"
            )
        elif asked is None and here:
            why = f"build it, or check only the stages here ({names}): {only}"
        else:
            why = f"build it with the split's command ({'--node' if nodes else '--rank'} {rank})"
        split = f" of this pp={pp} split" if pp is not None else ""
        split = f" of this split's {pp} node directories" if nodes and pp is not None else split
        report.findings.append(Finding(MISSING, f"{display}/{name}{split} is missing: {why}", stage=name))
