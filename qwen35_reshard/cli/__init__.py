"""The ``qwen35-reshard`` command line: a thin layer over the library (``app``) and what it shows
people (``report``)."""

from .app import main

__all__ = ["main"]
