"""qwen35-reshard: split a Qwen3.5 MoE checkpoint into one directory per pipeline stage.

The library mirrors the pipeline: ``source.read_checkpoint`` (index and headers into plain
data) -> ``plan.make_plan`` (pure placement) -> ``write.write_plan`` (byte-range copies) ->
``verify.verify``; ``stage.read_stage`` checks a stage directory for both ``verify`` and
``loader``, the server-side shim that reads what the writer wrote.
"""

from __future__ import annotations

import os

__version__ = "0.1.0"

from .errors import ReshardError  # noqa: E402
from .plan import DEFAULT_MAX_FILE_BYTES, Plan, make_plan  # noqa: E402
from .source import Checkpoint, read_checkpoint  # noqa: E402
from .write import Reporter, WriteResult, check_out_dir, write_plan  # noqa: E402

__all__ = [
    "Checkpoint",
    "Plan",
    "Reporter",
    "ReshardError",
    "WriteResult",
    "make_plan",
    "read_checkpoint",
    "reshard",
    "write_plan",
]


def reshard(
    model_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    pp: int,
    runtime: str = "sglang",
    partition: list[int] | None = None,
    ranks: list[int] | None = None,
    keep_mtp: bool = True,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    overwrite: bool = False,
    workers: int = 1,
    reporter: Reporter | None = None,
    reflink: str = "auto",
) -> tuple[Plan, WriteResult]:
    """Read, plan and write in one call: what ``qwen35-reshard --pp N MODEL OUT`` does."""
    from pathlib import Path

    check_out_dir(Path(model_dir), Path(out_dir))
    plan = make_plan(
        read_checkpoint(model_dir),
        pp=pp,
        runtime=runtime,
        partition=partition,
        ranks=ranks,
        keep_mtp=keep_mtp,
        max_file_bytes=max_file_bytes,
    )
    return plan, write_plan(
        plan, out_dir, overwrite=overwrite, workers=workers, reporter=reporter, reflink=reflink
    )
