"""The stage and run manifests' format strings and field names.

A stage manifest (``names.STAGE_MANIFEST``) lists every tensor with its file, dtype, shape,
size, source file and sha256, and every data file with its size, tensor count and layout
(``clone``: the exact bytes of source shard ``source``; ``aligned``: one run of ``source``
kept at its offsets modulo ``names.SHARE_ALIGN``; ``gathered``). A tensor's sha256 is ``null``
when the split shared its blocks with the source instead of reading it (only in ``clone`` and
``aligned`` files); a ``clone`` then records the source file's sha256 as ``sha256`` when it is
known without reading (the blob name in a Hugging Face cache).

It is written after the stage's data is durable and just before the stage's index, so a stage
counts as complete only when both exist and the manifest names the index's digest. The run
manifest (``names.RUN_MANIFEST``) summarises a finished split.
"""

from __future__ import annotations

from .names import TOOL_NAME

STAGE_FORMAT = f"{TOOL_NAME}/stage-v1"
RUN_FORMAT = f"{TOOL_NAME}/run-v1"

# The top-level fields of a stage manifest, in the order they are written.
STAGE_FIELDS = (
    "format", "tool", "source", "identity", "stage", "pp", "runtime", "partition", "layers", "mtp",
    "launch_env", "index_sha256", "side_files", "files", "tensors",
)  # fmt: skip
# The fields of one "tensors" entry of a stage manifest, in the order they are written.
TENSOR_FIELDS = ("file", "dtype", "shape", "nbytes", "sha256", "source_file", "replicated")
