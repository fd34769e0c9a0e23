"""Building a split's manifests from its plan: the stage index, the stage manifest (encoded
but for its tensors' digests, see :class:`ManifestDraft`), the run manifest and the run identity.

The format (file names, field names) is ``format``'s; reading a stage manifest back is the
stage reader's (``stage.manifest``).
"""

from __future__ import annotations

import hashlib
from itertools import chain, repeat

from .._version import __version__
from ..bulk import field_getters
from ..format.identity import RunIdentity, location_sha256
from ..format.jsonio import dumps_text, json_string
from ..format.manifest import RUN_FORMAT, STAGE_FORMAT, TENSOR_FIELDS
from ..format.names import CLONE, TOOL
from ..plan.layout import OutputFile, PlacedTensor
from ..plan.planner import Plan, StagePlan
from ..source.checkpoint import SourceTensor, source_fingerprint, source_identity, source_name
from .sources import source_stamps


def run_identity(plan: Plan) -> RunIdentity:
    """The identity of the split ``plan`` makes."""
    return RunIdentity(
        source_fingerprint=source_fingerprint(plan.checkpoint),
        source=source_name(plan.checkpoint),
        pp=plan.pp,
        runtime=plan.runtime,
        partition=tuple(plan.partition),
        mtp=plan.mtp,
        max_file_bytes=plan.max_file_bytes,
        max_header_bytes=plan.max_header_bytes,
        tool_version=__version__,
        ep=plan.layout.ep,
        nodes=plan.layout.nodes,
        redundant_experts=plan.layout.redundant_experts,
        expert_location=location_sha256(plan.layout.init_expert_location),
    )


def node_entry(plan: Plan, stage: StagePlan) -> dict:
    """A node directory's "node" entry (``format.manifest.NODE_FIELDS``)."""
    layout, node = plan.layout, stage.node
    rows = layout.init_expert_location
    return {
        "node": node.node,
        "nodes": layout.nodes,
        "ep": layout.ep,
        "ep_ranks": list(node.ep_ranks),
        "redundant_experts": layout.redundant_experts,
        "expert_location": None if rows is None else [list(r) for r in rows],
        "experts": {label: list(ids) for label, ids in node.experts},
    }


def stage_index(stage: StagePlan) -> dict:
    """The stage's model.safetensors.index.json: exactly its tensors and its own files."""
    weight_map: dict[str, str] = {}
    for f in stage.files:
        weight_map.update(zip(f.tensor_names, repeat(f.name)))
    return {
        "metadata": {"total_size": stage.data_bytes},
        "weight_map": dict(sorted(weight_map.items())),
    }


def stage_manifest(
    plan: Plan, stage: StagePlan, index_bytes: bytes, side_files: dict[str, str]
) -> ManifestDraft:
    """The stage manifest for ``stage`` (given its index bytes and the sha256 of each non-weight
    file it gets), but for the tensors' digests: a run learns them while it copies, and encodes
    the rest before (see :class:`ManifestDraft`)."""
    head = {
        "format": STAGE_FORMAT,
        "tool": TOOL,
        "source": source_identity(plan.checkpoint),
        "identity": run_identity(plan).to_json(),
        "stage": stage.stage,
        "pp": plan.pp,
        "runtime": plan.runtime,
        "partition": list(plan.partition),
        "layers": {"start": stage.start_layer, "end": stage.end_layer},
        "mtp": plan.mtp,
        "launch_env": plan.launch_env,
        **({"node": node_entry(plan, stage)} if stage.node is not None else {}),
        "index_sha256": hashlib.sha256(index_bytes).hexdigest(),
        "side_files": dict(sorted(side_files.items())),
        "files": {f.name: _file_entry(f) for f in stage.files},
    }
    blobs = plan.checkpoint.blob_sha256
    clones = {
        f.name: blobs[f.source_file] for f in stage.files if f.layout == CLONE and f.source_file in blobs
    }
    return ManifestDraft(head, stage.files, clones)


def _file_entry(f: OutputFile) -> dict:
    entry: dict = {"bytes": f.size, "tensors": len(f.tensors), "layout": f.layout}
    if f.source_file is not None:
        entry["source"] = f.source_file
    return entry


def run_manifest(plan: Plan, complete: list[int], side_files: dict[str, str] | None = None) -> dict:
    """The whole-run summary written as OUT/reshard.json after a successful run, with the sha256
    of each non-weight file OUT holds itself (``side_files``; none in a preview)."""
    return {
        "format": RUN_FORMAT,
        "tool": TOOL,
        "source": source_identity(plan.checkpoint),
        "identity": run_identity(plan).to_json(),
        "pp": plan.pp,
        "runtime": plan.runtime,
        "partition": list(plan.partition),
        "mtp": plan.mtp,
        "dropped": list(plan.dropped),
        "launch_env": plan.launch_env,
        # What identifies each source file's bytes, for a later run to tell them unchanged cheaply.
        **(
            {"side_files": dict(sorted(side_files.items())), "source_files": source_stamps(plan)}
            if side_files is not None
            else {}
        ),
        "stages": [
            {
                "stage": s.stage,
                **(s.node.to_dict() if s.node is not None else {}),
                "dir": s.dirname,
                "layers": {"start": s.start_layer, "end": s.end_layer},
                "tensors": len(s.tensors),
                "bytes": s.size,
                "shareable_bytes": s.shareable_bytes,
                "files": len(s.files),
                "source_files": s.source_files,
                "replicated": sorted(t.name for t in s.tensors if t.replicated),
                "complete": s.rank in complete,
            }
            for s in plan.stages
        ],
    }


# The text of one "tensors" entry as dumps writes it: "    NAME: {"file": F, ..., "replicated": R}"
# and the separator after it, cut around its values (the name, then one per TENSOR_FIELDS).
_ENTRY_END = ",\n"
_ENTRY = (
    "    ",
    ': {"file": ',
    *(f", {json_string(k)}: " for k in TENSOR_FIELDS[1:]),
    "}" + _ENTRY_END,
)
_NULL = "null"
_JSON_BOOL = {True: "true", False: "false"}
_SOURCE_OF, _REPLICATED_OF = field_getters(PlacedTensor, "source", "replicated")
_FILE_OF, _DTYPE_OF, _SHAPE_OF, _NBYTES_OF = field_getters(SourceTensor, "file", "dtype", "shape", "nbytes")


class ManifestDraft:
    """A stage manifest encoded but for its tensors' digests: ``encode(digests)`` gives its bytes,
    those of ``dumps`` of the manifest with a "tensors" entry per tensor, sorted by name.

    One entry per tensor (~190,000 for a 397B FP8 checkpoint): the entries are encoded column
    by column, and joined from their pieces by :func:`_join_entries`, rather than as a dict
    each; the digests go in once they are known.
    """

    def __init__(
        self, head: dict, files: tuple[OutputFile, ...], clones: dict[str, str] | None = None
    ) -> None:
        placed = list(chain.from_iterable(f.tensors for f in files))
        file_keys = list(chain.from_iterable(repeat(json_string(f.name), len(f.tensors)) for f in files))
        names = list(chain.from_iterable(f.tensor_names for f in files))
        order = sorted(range(len(names)), key=names.__getitem__)
        sources = list(map(_SOURCE_OF, map(placed.__getitem__, order)))
        self._names = list(map(names.__getitem__, order))
        shapes, dtypes = list(map(_SHAPE_OF, sources)), list(map(_DTYPE_OF, sources))
        source_files = list(map(_FILE_OF, sources))
        # Few distinct shapes, dtypes and files: each encoded once (str of a list of ints is its JSON).
        shape_json = {shape: str(list(shape)) for shape in set(shapes)}
        key_json = {name: json_string(name) for name in {*dtypes, *source_files}}
        self._before = [  # the values before the digest, in _ENTRY's order
            list(map(json_string, self._names)),
            list(map(file_keys.__getitem__, order)),
            list(map(key_json.__getitem__, dtypes)),
            list(map(shape_json.__getitem__, shapes)),
            list(map(str, map(_NBYTES_OF, sources))),
        ]
        replicated = map(_REPLICATED_OF, map(placed.__getitem__, order))
        self._after = [
            list(map(key_json.__getitem__, source_files)),
            list(map(_JSON_BOOL.__getitem__, replicated)),
        ]
        self._head = head
        self._clones = {f.name: (clones[f.name], f.tensor_names) for f in files if f.name in (clones or {})}

    def encode(self, digests: dict[str, str | None]) -> bytes:
        """The manifest's bytes, with ``digests[name]`` (None: shared) for every tensor.

        A clone of a cache blob (``clones``: its name -> the blob's name, the Hub's LFS sha256)
        records that sha256 only where its tensors have digests: read, the blob's bytes were
        checked against its name as they streamed by; shared, they were never read, and a
        digest recorded unchecked would have verify fail a split that exited 0.
        """
        head = self._head
        checked = {
            name: sha256
            for name, (sha256, tensors) in self._clones.items()
            if all(digests[t] is not None for t in tensors)
        }
        if checked:
            files = {n: {**e, "sha256": checked[n]} if n in checked else e for n, e in head["files"].items()}
            head = {**head, "files": files}
        head_text = dumps_text(head)[: -len("\n}")]  # "tensors" goes last
        found = [_NULL if d is None else json_string(d) for d in map(digests.__getitem__, self._names)]
        tensors = f"{{\n{_join_entries([*self._before, found, *self._after])}\n  }}" if self._names else "{}"
        return f"{head_text},\n  {json_string('tensors')}: {tensors}\n}}\n".encode()


def _join_entries(columns: list[list[str]]) -> str:
    """The "tensors" entries from their encoded ``columns`` (one per value, in _ENTRY's order).

    Entry i is _ENTRY[0], columns[0][i], _ENTRY[1], ..., columns[-1][i], _ENTRY[-1]: made by
    ``zip`` over the columns interleaved with the constant parts (``repeat``) and one
    ``str.join``, all in C rather than a Python format per entry.
    """
    texts = [c for part, column in zip(_ENTRY, columns, strict=False) for c in (repeat(part), column)]
    pieces = chain.from_iterable(zip(*texts, repeat(_ENTRY[-1]), strict=False))  # repeat() never ends
    return "".join(pieces)[: -len(_ENTRY_END)]
