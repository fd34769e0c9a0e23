"""The benchmark suite: every measurement behind docs/performance.md and the benchmarks log.

    python -m benchmarks                              # list the benchmarks
    python -m benchmarks NAME [ARGS]                  # run one (NAME --help: its options)
    python -m benchmarks NAME --quick                 # its smallest mode: a check that it runs
    python -m benchmarks NAME --before REF [ARGS]     # also against commit REF, in the same run

Each benchmark is a module here with a docstring (its first line is the listing's), ``QUICK``
(the arguments of its smallest mode), ``BEFORE`` (whether it compares trees) and
``main(argv, trees) -> int``: ``trees`` is this checkout ("after") and, with ``--before REF``,
a git worktree of REF ("before"); the benchmark runs its measured commands once per tree,
interleaved, and prints every ratio against a baseline measured in the same run. What they share
lives in ``benchmarks/lib``.
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent


def names() -> list[str]:
    """Every benchmark of the suite: the modules of this package (``lib`` holds what they share)."""
    return sorted(
        m.name for m in pkgutil.iter_modules([str(HERE)]) if not m.ispkg and not m.name.startswith("_")
    )


def load(name: str) -> ModuleType:
    """The benchmark ``name``'s module."""
    return importlib.import_module(f"benchmarks.{name}")
