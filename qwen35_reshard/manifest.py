"""Manifests: the per-stage record of what a stage directory holds, and the whole-run summary.

A stage manifest lists every tensor with its file, dtype, shape, size, source file and
sha256. It is written after the stage's data is durable and just before the stage's index,
so a stage counts as complete only when both exist and the manifest names the index's digest.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from . import __version__
from .errors import ReshardError
from .plan import Plan, StagePlan
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


def stage_manifest(plan: Plan, stage: StagePlan, digests: dict[str, str], index_bytes: bytes) -> dict:
    """The stage manifest for ``stage``, given each tensor's sha256 and the index bytes."""
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
        "files": {f.name: {"bytes": f.size, "tensors": len(f.tensors)} for f in stage.files},
        "tensors": dict(sorted(tensors.items())),
    }


def dumps(obj: object) -> bytes:
    """Deterministic JSON bytes: the same object always gives the same bytes."""
    return (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


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
                "files": len(s.files),
                "source_files": s.source_files,
                "replicated": sorted(t.name for t in s.tensors if t.replicated),
                "complete": s.rank in complete,
            }
            for s in plan.stages
        ],
    }
