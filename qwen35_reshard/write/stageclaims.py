"""A run's claims of OUT's stages (:mod:`~.claims`), as the writer takes and gives them up:
given up whatever stops the run, and whether any stage directory holds one."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from ..format.names import CLAIM
from ..plan.planner import StagePlan
from ..stage.nodes import split_dirs
from . import claims


def release(out: Path, stages: list[StagePlan]) -> None:
    """Give up this run's claims of ``stages``."""
    for stage in stages:
        claims.release(out / stage.dirname / CLAIM)


@contextmanager
def given_up_on_failure(out: Path, stages: list[StagePlan]) -> Iterator[None]:
    """Give up the claims of ``stages`` (as the list is when it fails) if the block fails: its
    own heartbeat would keep them alive, and the run or a later one in this process would wait
    for itself. A failure to give them up never hides the one that stopped the run."""
    try:
        yield
    except BaseException:
        with suppress(OSError):
            release(out, stages)
        raise


def claimed(out: Path) -> bool:
    """Whether any stage directory in OUT holds a claim (of a live run or a killed one)."""
    try:
        return any((d / CLAIM).exists() for d in split_dirs(out))
    except OSError:
        return False
