"""qwen35-reshard: split a Qwen3.5 MoE checkpoint into one directory per pipeline stage.

The package follows the pipeline, one folder per step: ``source`` reads the checkpoint (index,
config, shard headers) into plain data; ``plan`` places every tensor (pure, no I/O); ``write``
executes a plan; ``verify`` and ``stage`` check what was written; ``loader`` hands a server
exactly its stage; ``api`` is the one orchestrator of them all (:func:`reshard`, :func:`repair`),
which the ``cli`` renders. ``model`` holds the model's names, schema and the servers' rules, ``format``
every file name and the manifest fields. Readers (``stage``, ``verify``, ``loader``) never
import the writer.

Names below are imported on first use, so ``import qwen35_reshard.loader`` in a server loads
no planner or writer.

Example::

    >>> import qwen35_reshard
    >>> result = qwen35_reshard.reshard("MODEL", "OUT", pp=4)  # doctest: +SKIP
    >>> result.launch_env  # doctest: +SKIP
    'SGLANG_PP_LAYER_PARTITION=10,10,10,10'
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ._version import __version__
from .errors import BadInput, HubError, OutBusy, OutError, ReshardError, StageError

if TYPE_CHECKING:
    from .api import RepairResult, ReshardProgress, ReshardResult, repair, reshard
    from .loader import open_stage
    from .model.parallelism import Parallelism
    from .plan.balance import Choice, choose
    from .plan.capacity import Capacity
    from .plan.nodes import Nodes
    from .plan.planner import Plan, make_plan
    from .source.checkpoint import Checkpoint, read_checkpoint
    from .source.hub.cache import HubSettings
    from .write.options import WriteOptions
    from .write.writer import Reporter, WriteResult, write_plan

_LAZY = {
    "reshard": ".api",
    "ReshardResult": ".api",
    "ReshardProgress": ".api",
    "repair": ".api",
    "RepairResult": ".api",
    "Capacity": ".plan.capacity",
    "Nodes": ".plan.nodes",
    "Parallelism": ".model.parallelism",
    "HubSettings": ".source.hub.cache",
    "WriteOptions": ".write.options",
    "Choice": ".plan.balance",
    "choose": ".plan.balance",
    "open_stage": ".loader",
    "Checkpoint": ".source.checkpoint",
    "read_checkpoint": ".source.checkpoint",
    "Plan": ".plan.planner",
    "make_plan": ".plan.planner",
    "Reporter": ".write.writer",
    "WriteResult": ".write.writer",
    "write_plan": ".write.writer",
}

__all__ = [
    "BadInput",
    "Capacity",
    "Checkpoint",
    "Choice",
    "HubError",
    "HubSettings",
    "Nodes",
    "OutBusy",
    "OutError",
    "Parallelism",
    "Plan",
    "RepairResult",
    "Reporter",
    "ReshardError",
    "ReshardProgress",
    "ReshardResult",
    "StageError",
    "WriteOptions",
    "WriteResult",
    "__version__",
    "choose",
    "make_plan",
    "open_stage",
    "read_checkpoint",
    "repair",
    "reshard",
    "write_plan",
]


def __getattr__(name: str) -> object:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name], __name__), name)
