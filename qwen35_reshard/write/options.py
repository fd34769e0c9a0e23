"""How a split is written: what OUT gets (``keep_mtp``, ``max_file_bytes``) and how the
writer goes about it (``overwrite``, ``workers``, ``reflink``). Plain data, one group the CLI's
flags fill and :func:`qwen35_reshard.reshard`, :func:`qwen35_reshard.repair` and
:func:`~.writer.write_plan` take."""

from __future__ import annotations

from dataclasses import dataclass

from ..plan.planner import DEFAULT_MAX_FILE_BYTES

REFLINK_MODES = ("auto", "always", "never")
DEFAULT_WORKERS = 2  # source shards copied at once: the library's default and the CLI's


@dataclass(frozen=True)
class WriteOptions:
    """How to write a split.

    Attributes:
        overwrite: replace an OUT that holds a split made with other settings, or from other
            bytes (a source of the same layout whose tensors differ from the ones OUT holds).
        workers: source shards copied at once, each read by exactly one worker.
        reflink: ``"auto"`` shares the source's blocks where the filesystem can, ``"always"``
            refuses where it cannot, ``"never"`` copies.
        keep_mtp: False leaves the ``mtp.*`` tensors out on purpose (recorded in the manifest).
        max_file_bytes: largest output data file.

    Example:
        >>> WriteOptions(workers=4).reflink
        'auto'
    """

    overwrite: bool = False
    workers: int = DEFAULT_WORKERS
    reflink: str = "auto"
    keep_mtp: bool = True
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES


DEFAULTS = WriteOptions()  # the defaults, as a parameter's default value
