"""Checking a split (see ``check``): ``verify(OUT)`` and its :class:`VerifyReport`."""

from .check import VerifyReport, verify

__all__ = ["VerifyReport", "verify"]
