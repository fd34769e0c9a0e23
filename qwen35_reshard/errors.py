"""The one exception type the tool raises for bad input or a failed run.

Its message is a single line that names the file, tensor or flag at fault and what to do;
the CLI prints it as ``error: <message>`` and exits with code 2, without a traceback.
"""

from __future__ import annotations


class ReshardError(Exception):
    """Bad input or an unrecoverable condition, explained in one line for the user."""

    exit_code = 2


class SharingRefusedError(ReshardError):
    """Block sharing was required (``reflink="always"``) where the filesystem cannot share."""

    def __init__(self, out: str, source: str) -> None:
        self.out, self.source = out, source
        super().__init__(self.explain("reflink='always'"))

    def explain(self, what: str) -> str:
        """The message, naming what required sharing (a parameter, or the CLI's flag)."""
        return (
            f"OUT {self.out} cannot share blocks with {self.source} (another filesystem, or one "
            f"without reflinks such as ext4 or tmpfs) and {what} forbids copying; use auto to copy "
            "where sharing is impossible, or an OUT on the checkpoint's XFS/Btrfs filesystem"
        )
