"""A rank's stage of an unsplit local checkpoint read in place: only its tensors, from the
source shards' own memory maps (no copy), each shard's header read again and checked.

Under expert parallelism a rank reads only its node's slice of the stage: every tensor that is
not a routed expert's, and its node's experts as per-expert tensors named by global id, each a
byte range of the source tensor (:mod:`qwen35_reshard.plan.nodedirs`), placed
as the server places them (:mod:`qwen35_reshard.model.experts`). The servers load per-expert
tensors by global id whatever the checkpoint's own layout (fused or per-expert).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from ..format.names import CLONE
from ..loader import Stage, StageError
from ..model.parallelism import Parallelism
from ..plan.nodedirs import node_dirs
from ..plan.planner import stage_tensors
from ..source.checkpoint import Checkpoint, SourceTensor, downloaded_sha256, source_identity
from ..source.header import read_header
from ..stage.manifest import FileLayout, StageManifest, StageTensor


def pipeline_only(layout: Parallelism) -> Parallelism:
    """``layout`` without expert parallelism: the pipeline stage a node's slice is cut from."""
    return replace(layout, ep=1, nodes=1, redundant_experts=0, init_expert_location=None)


def node_tensors(
    ckpt: Checkpoint, layout: Parallelism, stage: Sequence[SourceTensor], node: int
) -> list[SourceTensor]:
    """Of a pipeline stage's tensors ``stage``, node ``node``'s: what the split's node directory
    holds (:func:`qwen35_reshard.plan.nodedirs.node_dirs`).

    Raises:
        ReshardError: a layout the server would refuse for this model, a fused tensor that
            cannot be cut per expert.
    """
    dirs = node_dirs(ckpt, replace(layout, pp=1, partition=None), {0: list(stage)})
    return next(tensors for what, tensors, _ in dirs if what.node == node)


def stage_layers(partition: Sequence[int], rank: int) -> tuple[int, int]:
    start = sum(partition[:rank])
    return start, start + partition[rank]


def resolved(layout: Parallelism) -> tuple[int, ...]:
    """The layout's layers per stage, which the server computed (never left for a split to choose)."""
    if not isinstance(layout.partition, tuple):
        raise StageError(f"a server's stage needs the layers per stage it computed, not {layout.partition!r}")
    return layout.partition


def _shard_sha256(ckpt: Checkpoint, file: str) -> str | None:
    """The whole shard's recorded sha256: a Hugging Face cache blob's name, or the record of
    ``hf download --local-dir``; None where neither is known."""
    return ckpt.blob_sha256.get(file) or downloaded_sha256(ckpt.root, file)


def in_place_stage(ckpt: Checkpoint, layout: Parallelism, rank: int, node: int = 0) -> Stage:
    """Stage ``rank`` of the split of ``ckpt`` (under expert parallelism: node ``node`` of that
    stage) as a :class:`~qwen35_reshard.loader.Stage` whose tensors are read from the source
    shards themselves: the plan's tensors for the rank, at their offsets in the shards whose
    headers are read again here (what ``iter_weights`` checks each shard against before reading
    it). A node holds its experts as per-expert tensors by global id, byte ranges of the source's
    (:func:`node_tensors`).

    Raises:
        StageError: a shard changed since the checkpoint was read.
        ReshardError: the layout does not fit the checkpoint.
    """
    pp, runtime, partition = layout.pp, layout.runtime, resolved(layout)
    planned = stage_tensors(ckpt, pipeline_only(layout), rank=rank)
    sources = sorted(planned.tensors, key=lambda s: (s.file, s.offset))
    headers = {}
    for file in sorted({s.file for s in sources}):
        header = read_header(ckpt.path(file), display=f"{ckpt.display}/{file}")
        at = dict(zip(header.columns.names, header.columns.begins, strict=True))
        for s in (s for s in sources if s.file == file):
            begin = at.get(s.name)
            if begin is None or header.data_start + begin != s.offset:
                raise StageError(
                    f"{ckpt.display}/{file} changed while the server was starting (tensor {s.name!r} moved); "
                    "restart the server once the checkpoint is no longer being written"
                )
        headers[file] = header.raw
    if layout.expert_parallel:
        sources = sorted(node_tensors(ckpt, layout, sources, node), key=lambda s: (s.file, s.offset))
    tensors = {
        s.name: StageTensor(
            name=s.name, file=s.file, dtype=s.dtype, shape=s.shape, nbytes=s.nbytes, offset=s.offset
        )
        for s in sources
    }
    counts: dict[str, int] = {}
    for s in sources:
        counts[s.file] = counts.get(s.file, 0) + 1
    start, end = stage_layers(partition, rank)
    manifest = StageManifest(
        rank=rank,
        pp=pp,
        runtime=runtime,
        partition=partition,
        start_layer=start,
        end_layer=end,
        mtp=planned.mtp,
        identity=None,
        source=source_identity(ckpt),
        index_sha256=None,
        side_files={},
        files={f: ckpt.file_sizes[f] for f in counts},
        file_tensors=counts,
        # The whole shard's sha256, where known (a Hugging Face cache names its blobs by it;
        # hf download --local-dir records it): what a load checks the shard's bytes against.
        layouts={f: FileLayout(CLONE, f, digest) for f in counts if (digest := _shard_sha256(ckpt, f))},
        tensors=tensors,
    )
    where = f", node {node} of {layout.nodes}" if layout.expert_parallel else ""
    return Stage(
        path=ckpt.root,
        display=f"{ckpt.display} (stage {rank}{where}, read in place)",
        manifest=manifest,
        headers=headers,
        files_at=ckpt.display,
        on_damaged=lambda file: (
            f"it is the checkpoint's own file, read in place: restore {file} where the checkpoint came "
            "from (download or copy it again); nothing was loaded"
        ),
        unrecorded=(
            "a local directory records no sha256 of its shards, unless downloaded by hf download "
            "--local-dir and unchanged since; a Hugging Face cache folder does"
        ),
    )


