"""The stage and run manifests' format strings and field names.

A stage manifest (``names.STAGE_MANIFEST``) lists every tensor with its file, dtype, shape,
size, source file and digest (``stage-v2``: its xxh3-128, ``xxh128``; ``stage-v1``, still
read: its ``sha256``; see ``format.digest``), and every data file with its size, tensor count and layout
(``names.LAYOUTS``, with the shard ``source`` a ``clone`` or ``aligned`` file takes its bytes
from). The layouts, and when a sha256 is ``null`` (blocks shared, not read): docs/format.md,
"Data file layouts".

It is written after the stage's data is durable and just before the stage's index, so a stage
counts as complete only when both exist and the manifest names the index's digest. The run
manifest (``names.RUN_MANIFEST``) summarises a finished split.
"""

from __future__ import annotations

from .digest import SHA256, XXH128
from .names import TOOL_NAME

STAGE_FORMAT = f"{TOOL_NAME}/stage-v2"
STAGE_FORMAT_V1 = f"{TOOL_NAME}/stage-v1"  # tensors' sha256: read (loaded, verified), not written
# Each stage format read, with the digest its tensor entries record (the entry's key).
TENSOR_DIGESTS = {STAGE_FORMAT: XXH128, STAGE_FORMAT_V1: SHA256}
RUN_FORMAT = f"{TOOL_NAME}/run-v1"

# The top-level fields of a stage manifest, in the order they are written.
STAGE_FIELDS = (
    "format", "tool", "source", "identity", "stage", "pp", "runtime", "partition", "layers", "mtp",
    "launch_env", "node", "index_sha256", "side_files", "files", "tensors",
)  # fmt: skip
# The fields of a node directory's "node" entry (expert parallelism): which node of its stage it
# is, its EP group's layout, and the logical experts it holds per MoE layer ("layers.N",
# "mtp.layers.K"), every one of which verify and the loader require.
NODE_FIELDS = ("node", "nodes", "ep", "ep_ranks", "redundant_experts", "expert_location", "experts")
# The fields of one "tensors" entry of a stage manifest, in the order they are written.
TENSOR_FIELDS = ("file", "dtype", "shape", "nbytes", XXH128, "source_file", "replicated")
