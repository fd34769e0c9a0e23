"""Checking a split (see ``check``): ``verify(OUT)`` and its :class:`VerifyReport` (``report``);
the checks of the run directory (``rundir``), of each stage (``stagedir``) and against the source
(``source``)."""

from .check import verify
from .report import VerifyReport

__all__ = ["VerifyReport", "verify"]
