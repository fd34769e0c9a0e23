"""Manifests: the per-stage record of what a stage directory holds, and the whole-run summary.

A stage manifest lists every tensor with its file, dtype, shape, size, source file and
sha256, and every data file with its size, tensor count and layout (``clone``: the exact
bytes of source shard ``source``; ``aligned``: one run of ``source`` kept at its offsets
modulo 1 MiB; ``gathered``). A tensor's sha256 is ``null`` when the split shared its blocks
with the source instead of reading it (only in ``clone`` and ``aligned`` files); a ``clone``
then records the source file's sha256 as ``sha256`` when it is known without reading (the
blob name in a Hugging Face cache).

It is written after the stage's data is durable and just before the stage's index,
so a stage counts as complete only when both exist and the manifest names the index's digest.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable
from pathlib import Path

from . import __version__
from .errors import ReshardError
from .layouts import CLONE
from .plan import OutputFile, Plan, StagePlan
from .source import INDEX_NAME, Checkpoint

STAGE_MANIFEST = "reshard-stage.json"
# A stage directory's name, pp{rank}; no leading zeros, so each rank has one spelling.
STAGE_DIR = re.compile(r"pp(0|[1-9][0-9]*)")
RUN_MANIFEST = "reshard.json"
STAGE_FORMAT = "qwen35-reshard/stage-v1"
RUN_FORMAT = "qwen35-reshard/run-v1"
TOOL = {"name": "qwen35-reshard", "version": __version__}


def source_identity(ckpt: Checkpoint) -> dict:
    """What identifies the source: its path (or Hub repo id and commit) for people, digests and
    sizes for the tool. A Hub source records no endpoint and no token."""
    fingerprint = hashlib.sha256(
        json.dumps([ckpt.config_sha256, ckpt.index_sha256, sorted(ckpt.file_sizes.items())]).encode()
    ).hexdigest()
    return {
        **(ckpt.hub or {}),
        "path": str(ckpt.root.resolve()),
        "index_sha256": ckpt.index_sha256,
        "config_sha256": ckpt.config_sha256,
        "fingerprint": fingerprint,
    }


def run_identity(plan: Plan) -> dict:
    """The settings that decide every output byte; a resumed run must match them exactly."""
    return {
        "source_fingerprint": source_identity(plan.checkpoint)["fingerprint"],
        "pp": plan.pp,
        "runtime": plan.runtime,
        "partition": list(plan.partition),
        "mtp": plan.mtp,
        "max_file_bytes": plan.max_file_bytes,
        "max_header_bytes": plan.max_header_bytes,
        "tool_version": __version__,
    }


def stage_index(stage: StagePlan) -> dict:
    """The stage's model.safetensors.index.json: exactly its tensors and its own files."""
    weight_map = {t.name: f.name for f in stage.files for t in f.tensors}
    return {
        "metadata": {"total_size": stage.data_bytes},
        "weight_map": dict(sorted(weight_map.items())),
    }


def stage_manifest(
    plan: Plan, stage: StagePlan, digests: dict[str, str | None], index_bytes: bytes
) -> dict:
    """The stage manifest for ``stage``, given each tensor's sha256 (None: shared) and the index bytes."""
    tensors = {}
    for f in stage.files:
        for t in f.tensors:
            s = t.source
            tensors[t.name] = {
                "file": f.name,
                "dtype": s.dtype,
                "shape": list(s.shape),
                "nbytes": s.nbytes,
                "sha256": digests[t.name],
                "source_file": s.file,
                "replicated": t.replicated,
            }
    return {
        "format": STAGE_FORMAT,
        "tool": TOOL,
        "source": source_identity(plan.checkpoint),
        "identity": run_identity(plan),
        "stage": stage.rank,
        "pp": plan.pp,
        "runtime": plan.runtime,
        "partition": list(plan.partition),
        "layers": {"start": stage.start_layer, "end": stage.end_layer},
        "mtp": plan.mtp,
        "launch_env": plan.launch_env,
        "index_sha256": hashlib.sha256(index_bytes).hexdigest(),
        "files": {f.name: _file_entry(plan, f) for f in stage.files},
        "tensors": dict(sorted(tensors.items())),
    }


def _file_entry(plan: Plan, f: OutputFile) -> dict:
    entry: dict = {"bytes": f.size, "tensors": len(f.tensors), "layout": f.layout}
    if f.source_file is not None:
        entry["source"] = f.source_file
    if f.layout == CLONE and f.source_file in plan.checkpoint.blob_sha256:
        entry["sha256"] = plan.checkpoint.blob_sha256[f.source_file]
    return entry


def dumps(obj: object) -> bytes:
    """Deterministic JSON bytes: the same object always gives the same bytes.

    Objects are indented two levels deep, then one entry per line in compact form: a
    manifest or an index has one entry per tensor (~190,000 for a 397B FP8 checkpoint), and
    json's indenting encoder is pure Python (seconds), its compact one C.
    """
    return (_dumps(obj, "", 2) + "\n").encode("utf-8")


def _compact_encoder() -> Callable[[object], str]:
    """``json.dumps(obj, ensure_ascii=False, separators=(", ", ": "))``, made once.

    json.dumps builds a new C encoder on every call, which costs more than encoding one small
    manifest entry; this keeps one (json's own, where the C module exists).
    """
    enc = json.JSONEncoder(ensure_ascii=False, separators=(", ", ": "))
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return enc.encode
    c_encode = make(
        None, enc.default, json.encoder.encode_basestring, None, ": ", ", ", False, False, True
    )
    return lambda obj: "".join(c_encode(obj, 0))


_compact = _compact_encoder()


def _dumps(obj: object, indent: str, depth: int) -> str:
    if not (depth and isinstance(obj, dict) and obj):
        return _compact(obj)
    inner = indent + "  "
    entries = ",\n".join(f"{inner}{_compact(k)}: {_dumps(v, inner, depth - 1)}" for k, v in obj.items())
    return f"{{\n{entries}\n{indent}}}"


def read_json(path: Path) -> dict | None:
    """The JSON object at ``path``, or None when the file is missing."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ReshardError(f"{path}: not valid JSON; the file is damaged") from None
    if not isinstance(obj, dict):
        raise ReshardError(f"{path}: expected a JSON object")
    return obj


def stage_is_complete(stage_dir: Path, identity: dict | None = None) -> bool:
    """True when ``stage_dir`` holds a finished stage (matching ``identity`` when given).

    Cheap: manifest and index present, the index's digest as recorded, every data file present
    with its recorded size. ``verify`` checks the bytes.
    """
    try:
        manifest = read_json(stage_dir / STAGE_MANIFEST)
        index_bytes = (stage_dir / INDEX_NAME).read_bytes()
    except (FileNotFoundError, ReshardError):
        return False
    if manifest is None or manifest.get("format") != STAGE_FORMAT:
        return False
    if identity is not None and manifest.get("identity") != identity:
        return False
    if manifest.get("index_sha256") != hashlib.sha256(index_bytes).hexdigest():
        return False
    for name, info in manifest.get("files", {}).items():
        try:
            if os.stat(stage_dir / name).st_size != info.get("bytes"):
                return False
        except OSError:
            return False
    return True


def run_manifest(plan: Plan, complete: list[int]) -> dict:
    """The whole-run summary written as OUT/reshard.json after a successful run."""
    return {
        "format": RUN_FORMAT,
        "tool": TOOL,
        "source": source_identity(plan.checkpoint),
        "identity": run_identity(plan),
        "pp": plan.pp,
        "runtime": plan.runtime,
        "partition": list(plan.partition),
        "mtp": plan.mtp,
        "dropped": list(plan.dropped),
        "launch_env": plan.launch_env,
        "stages": [
            {
                "stage": s.rank,
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
