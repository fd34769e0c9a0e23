"""The ``qwen35-reshard`` command line: a thin layer over the library (``app``) and what it shows
people (``report``).

:func:`main` is where the console script and ``python -m qwen35_reshard`` start. This module
imports only the standard library, so that a Ctrl-C while typer, rich and the library load
(the first ~0.25 s) meets the handler installed here, not Python's raw traceback: before any
command runs there is nothing written, and the process says so in one line.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence

__all__ = ["main"]

INTERRUPTED_AT_START = "interrupted: nothing was written"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``, this process being the command);
    return the exit code. See :func:`qwen35_reshard.cli.app.main`."""
    if argv is None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _interrupted_at_start)
    from .app import main as run

    return run(argv)


def _interrupted_at_start(signum: int, frame: object) -> None:
    """Until a command installs its own handler: end at once, in the command's words (a JSON
    error beside ``--json``), exit 130. Only os.write and os._exit: the interrupted import may
    hold any lock."""
    said = [(2, INTERRUPTED_AT_START.encode() + b"\n")]
    if "--json" in sys.argv[1:]:
        said.append((1, b'{"status": "error", "error": "%s"}\n' % INTERRUPTED_AT_START.encode()))
    for fd, line in said:
        try:
            os.write(fd, line)
        except OSError:  # closed, full or a pipe nobody reads: the exit code still says it
            pass
    os._exit(130)
