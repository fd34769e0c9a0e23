"""The one exception type the tool raises for bad input or a failed run.

Its message is a single line that names the file, tensor or flag at fault and what to do;
the CLI prints it as ``error: <message>`` and exits with code 2, without a traceback.
"""

from __future__ import annotations


class ReshardError(Exception):
    """Bad input or an unrecoverable condition, explained in one line for the user."""

    exit_code = 2
