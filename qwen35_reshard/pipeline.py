"""The whole job in one call: read the source, plan the split, write it."""

from __future__ import annotations

import os
from pathlib import Path

from .plan.planner import DEFAULT_MAX_FILE_BYTES, Plan, make_plan
from .source.checkpoint import read_checkpoint
from .write.writer import DEFAULT_WORKERS, Reporter, WriteResult, check_out_dir, write_plan


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
    workers: int = DEFAULT_WORKERS,
    reporter: Reporter | None = None,
    reflink: str = "auto",
) -> tuple[Plan, WriteResult]:
    """Read, plan and write in one call: what ``qwen35-reshard --pp N MODEL OUT`` does.

    Example::

        >>> from qwen35_reshard import reshard
        >>> plan, result = reshard("Qwen3.5-35B-A3B", "out", pp=4)  # doctest: +SKIP
        >>> plan.launch_env  # doctest: +SKIP
        'SGLANG_PP_LAYER_PARTITION=10,10,10,10'
    """
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
