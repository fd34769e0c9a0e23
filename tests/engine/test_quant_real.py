"""Quantized checkpoints written by the real producer, split and decompressed (issue 30).

llm-compressor's data-free ``model_free_ptq`` writes NVFP4A16, MXFP4A16 and W4A16
compressed-tensors checkpoints from one BF16 per-expert checkpoint of the tool's names (hidden
256, expert width 128; ``tests/support/quant_worker.py``), once per session. Each is split for pp=2 on
both runtimes; then, in the llm-compressor environment, every quantized module of every stage
is decompressed with compressed-tensors' own compressor and must equal the same module of the
unsplit checkpoint (a control checks that two different modules do differ), and every
quantized module of the source lands in some stage. ``verify --source`` accepts each split
(llm-compressor writes shards without safetensors ``__metadata__``). Last, transformers (with
compressed-tensors) loads each stage of the W4A16 split on CPU: what it reports missing must be
exactly the other stage's tensors.

The environment: ``bash .ci/quant/build-venv.sh .venv-quant`` (what CI does), or any Python
with llmcompressor installed, named by ``QWEN35_RESHARD_QUANT_PYTHON``. Without one the tests
are skipped, except under ``CI=true``, where they fail.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import qwen35_reshard
from qwen35_reshard.errors import ReshardError
from qwen35_reshard.verify import verify

from support.helpers import ROOT, SUPPORT, drop_tensor

WORKER = SUPPORT / "quant_worker.py"
PYTHON_ENV = "QWEN35_RESHARD_QUANT_PYTHON"
DEFAULT_PYTHON = ROOT / ".venv-quant" / "bin" / "python"
SCHEMES = ("NVFP4A16", "MXFP4A16", "W4A16", "FP8_DYNAMIC")
# scheme -> (a companion of a quantized Linear's set, the method as refusals name it)
COMPANION = {
    "NVFP4A16": ("weight_global_scale", "compressed-tensors nvfp4-pack-quantized (group 16)"),
    "MXFP4A16": ("weight_scale", "compressed-tensors mxfp4-pack-quantized (group 32)"),
    "W4A16": ("weight_shape", "compressed-tensors pack-quantized (4-bit, group 128)"),
    "FP8_DYNAMIC": ("weight_scale", "compressed-tensors float-quantized (channel)"),
}
EXPERT = "model.language_model.layers.1.mlp.experts.2"
RUNTIMES = ("sglang", "vllm")


def require_quant_python() -> Path:
    """The llm-compressor environment's Python; skipped without one, except under CI=true."""
    path = Path(os.environ.get(PYTHON_ENV) or DEFAULT_PYTHON)
    if not path.exists():
        message = (
            f"no llm-compressor environment: run `bash .ci/quant/build-venv.sh .venv-quant` "
            f"or set {PYTHON_ENV} to a Python with llmcompressor installed"
        )
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return path


def run_worker(python: Path, *args: object) -> dict | None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [str(python), str(WORKER), *map(str, args)], capture_output=True, text=True, env=env, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = (proc.stdout.strip().splitlines() or [""])[-1]
    return json.loads(last) if last.startswith("{") else None  # build prints progress only


@pytest.fixture(scope="session")
def produced(tmp_path_factory) -> tuple[Path, Path]:
    """The three checkpoints model_free_ptq wrote, and the llm-compressor Python."""
    python = require_quant_python()
    work = tmp_path_factory.mktemp("quant-real")
    run_worker(python, "build", work, *SCHEMES)
    return work, python


@pytest.fixture(scope="session")
def splits(produced) -> dict[tuple[str, str], Path]:
    work, _ = produced
    out = {}
    for scheme in SCHEMES:
        for runtime in RUNTIMES:
            target = work / f"split-{scheme}-{runtime}"
            qwen35_reshard.reshard(work / scheme, target, pp=2, runtime=runtime)
            out[scheme, runtime] = target
    return out


def test_producer_writes_what_the_facts_say(produced):
    """The real files: no safetensors __metadata__, the method's suffixes, no MTP quantized."""
    work, _ = produced
    for scheme in SCHEMES:
        config = json.loads((work / scheme / "config.json").read_text())
        assert config["quantization_config"]["quant_method"] == "compressed-tensors"
        names = json.loads((work / scheme / "model.safetensors.index.json").read_text())["weight_map"]
        assert any(n.endswith(".mlp.experts.3.down_proj.weight_scale") for n in names)
        raw = next((work / scheme).glob("*.safetensors")).read_bytes()
        assert b"__metadata__" not in raw[: 8 + int.from_bytes(raw[:8], "little")]


def test_splits_are_exact_and_verified(produced, splits):
    work, _ = produced
    for (scheme, _runtime), out in splits.items():
        report = verify(out, source=work / scheme)
        assert report.ok, [f.message for f in report.findings]
        assert len(report.stages) == 2


def test_every_module_decompresses_equal_to_the_unsplit(produced, splits):
    work, python = produced
    runs = []
    for (scheme, _), out in splits.items():
        runs += ["+", work / scheme, out / "pp0", out / "pp1"]
    reports = run_worker(python, "decompress", *runs[1:])
    assert set(reports) == {str(out) for out in splits.values()}
    for where, report in reports.items():
        assert report["control_differs"], where
        assert report["different"] == [], where
        assert report["unplaced"] == [], where
        assert report["source_modules"] > 0
        assert sum(report["stages"].values()) == report["source_modules"], where  # each exactly once


def test_transformers_loads_each_w4a16_stage_missing_only_the_other_stages_tensors(produced, splits):
    """What a stage cannot hold is all that is missing: no parameter of its own layers, its
    embeddings (pp0) or its final norm and lm_head (pp1); every quantized module loads."""
    work, python = produced
    out = splits["W4A16", "sglang"]
    reports = run_worker(python, "load", work / "W4A16", out / "pp0", out / "pp1")
    whole, stages = reports[str(work / "W4A16")], [reports[str(out / f"pp{r}")] for r in (0, 1)]
    assert whole.get("missing") == [] and whole["quantized_modules"] > 0, whole
    own = {
        0: ("layers.0.", "layers.1.", "embed_tokens."),
        1: ("layers.2.", "layers.3.", "model.norm.", "lm_head."),
    }
    for rank, report in enumerate(stages):
        assert "error" not in report, report
        assert report["quantized_modules"] == whole["quantized_modules"], report
        assert report["missing"], report  # a stage is not the whole model
        assert not [k for k in report["missing"] if any(p in k for p in own[rank])], report["missing"]
        assert not [k for k in report["missing"] if not any(p in k for p in own[1 - rank])], report["missing"]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_real_partial_sets_and_a_missing_linear_are_refused(produced, tmp_path, scheme):
    """One companion of one expert's down_proj dropped, then that Linear's whole set: refused,
    naming the tensor (and the method), nothing written."""
    work, _ = produced
    model = Path(shutil.copytree(work / scheme, tmp_path / "model"))
    suffix, label = COMPANION[scheme]
    drop_tensor(model, f"{EXPERT}.down_proj.{suffix}")
    with pytest.raises(
        ReshardError, match=re.escape(f"lacks tensor '{EXPERT}.down_proj.{suffix}', part of {label}")
    ):
        qwen35_reshard.reshard(model, tmp_path / "out", pp=2)
    names = json.loads((model / "model.safetensors.index.json").read_text())["weight_map"]
    for name in [n for n in names if n.startswith(f"{EXPERT}.down_proj.")]:
        drop_tensor(model, name)
    packed = "weight" if scheme == "FP8_DYNAMIC" else "weight_packed"
    with pytest.raises(ReshardError, match=re.escape(f"lacks tensor '{EXPERT}.down_proj.{packed}'")):
        qwen35_reshard.reshard(model, tmp_path / "out", pp=2)
    assert not (tmp_path / "out").exists()
