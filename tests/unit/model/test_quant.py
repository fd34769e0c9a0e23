"""Quantized checkpoints by the facts doc's names (issue 30): GPTQ, AWQ, compressed-tensors
W4A16, ModelOpt NVFP4 (quantization in config.json, or in hf_quant_config.json alone) and
ModelOpt FP8, written by ``examples/quantized_checkpoint.py`` (once per session each).

Each splits on both runtimes and verifies against its source, every stage carrying the side
files unchanged; the loader opens a quantized stage and repair mends one. Then the damage the
issue lists is refused before anything is written, in one line naming the tensor and the
method: one tensor of a Linear's set missing, every tensor of one expert's ``down_proj``
missing, a set the config contradicts (a module it ignores, a dtype or bit width it does not
write), quantized fused 3-D experts. A method the schema does not know splits with a warning,
in ``--json`` too, and verify says the same. The real producer's checkpoints:
tests/engine/test_quant_real.py.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from qwen35_reshard import loader, read_checkpoint, repair, reshard
from qwen35_reshard.errors import ReshardError
from qwen35_reshard.plan.balance import stage_costs
from qwen35_reshard.verify import verify

from support.helpers import ROOT, drop_tensor

sys.path.insert(0, str(ROOT / "examples"))

import quantized_checkpoint as qc  # noqa: E402
import tiny_checkpoint as tc  # noqa: E402

INDEX = "model.safetensors.index.json"
# Every other layer full attention: each stage of a pp=2 split has one (vLLM needs it).
MODEL = {"layers": 4, "full_attention_interval": 2}
EXPERT = "model.language_model.layers.3.mlp.experts.1"
# method -> (a companion tensor of one expert's down_proj, the method's name in messages)
COMPANION = {
    "gptq": ("qzeros", "gptq (4-bit, group 32)"),
    "awq": ("scales", "awq (4-bit, group 32)"),
    "compressed-tensors": ("weight_scale", "compressed-tensors pack-quantized (4-bit, group 32)"),
    "modelopt-nvfp4": ("weight_scale_2", "modelopt NVFP4 (group 16)"),
    "modelopt-nvfp4-side": ("weight_scale", "modelopt NVFP4 (group 16)"),
    "modelopt-fp8": ("weight_scale", "modelopt FP8"),
    "modelopt-fp8-side": ("input_scale", "modelopt FP8"),
}
PACKED = {"gptq": "qweight", "awq": "qweight", "compressed-tensors": "weight_packed"}  # else .weight


@pytest.fixture(scope="session")
def built(tmp_path_factory) -> dict[str, Path]:
    work = tmp_path_factory.mktemp("quant")
    return {m: qc.build_quantized(work / m, m, **MODEL) for m in qc.METHODS}


def copy(model: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(model, tmp_path / "model"))


def refused(model: Path, out: Path) -> str:
    """The one-line refusal of a split of ``model``, which must leave nothing in ``out``."""
    with pytest.raises(ReshardError) as e:
        reshard(model, out, pp=2)
    assert not out.exists()
    message = str(e.value)
    assert "\n" not in message
    return message


def retype(model: Path, name: str, dtype: str) -> None:
    """Give tensor ``name`` another dtype of the same item size in its shard's header."""
    shard = model / json.loads((model / INDEX).read_text())["weight_map"][name]
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    assert tc.DTYPE_SIZE[header[name]["dtype"]] == tc.DTYPE_SIZE[dtype]
    header[name]["dtype"] = dtype
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    shard.write_bytes(raw[:8] + text + b" " * (n - len(text)) + raw[8 + n :])


def edit_config(model: Path, change) -> None:
    path = model / "config.json"
    config = json.loads(path.read_text())
    change(config)
    path.write_text(json.dumps(config))


# --------------------------------------------------------------------------- accepted


@pytest.mark.parametrize("method", qc.METHODS)
@pytest.mark.parametrize("runtime", ["sglang", "vllm"])
def test_split_is_exact_with_the_side_files_in_every_stage(built, tmp_path, method, runtime):
    model, out = built[method], tmp_path / "out"
    reshard(model, out, pp=2, runtime=runtime)
    report = verify(out, source=model)
    assert report.ok, [f.message for f in report.findings]
    side = {
        n
        for n in ("hf_quant_config.json", "quantize_config.json", "quant_config.json")
        if (model / n).exists()
    }
    assert side or method.startswith("compressed")
    held = set()
    for r in (0, 1):
        stage = out / f"pp{r}"
        for name in side:
            assert (stage / name).read_bytes() == (model / name).read_bytes()
        held |= set(json.loads((stage / INDEX).read_text())["weight_map"])
    # Every quantized tensor went somewhere, the layer's stage: the split is the whole model.
    assert held >= set(json.loads((model / INDEX).read_text())["weight_map"])


def test_loader_and_repair_handle_a_quantized_stage(built, tmp_path):
    model, out = built["gptq"], tmp_path / "out"
    reshard(model, out, pp=2)
    stage = loader.open_stage(out / "pp1")
    names = [name for name, _ in stage.iter_weights()]
    assert f"{EXPERT}.down_proj.qzeros" in names and f"{EXPERT}.down_proj.g_idx" in names
    index = json.loads((out / "pp1" / INDEX).read_text())["weight_map"]
    victim = out / "pp1" / index[f"{EXPERT}.down_proj.qweight"]
    victim.write_bytes(victim.read_bytes()[:-64])  # truncated
    assert not verify(out, source=model).ok
    repair(out, model)
    assert verify(out, source=model).ok


def test_balanced_counts_the_packed_bytes(built):
    """--partition balanced and --gpu-memory weigh a stage by its bytes on disk: a quantized
    layer weighs what its packed tensors weigh."""
    ckpt = read_checkpoint(built["gptq"])
    costs, _ = stage_costs(ckpt, pp=2, runtime="sglang", keep_mtp=True)
    layers = [
        sum(t.nbytes for n, t in ckpt.tensors.items() if f".layers.{i}." in n and not n.startswith("mtp."))
        for i in range(4)
    ]
    assert list(costs.layer_bytes) == layers


# --------------------------------------------------------------------------- refused


@pytest.mark.parametrize("method", qc.METHODS)
def test_a_missing_companion_is_refused(built, tmp_path, method):
    model = copy(built[method], tmp_path)
    suffix, label = COMPANION[method]
    drop_tensor(model, f"{EXPERT}.down_proj.{suffix}")
    message = refused(model, tmp_path / "out")
    assert f"lacks tensor '{EXPERT}.down_proj.{suffix}', part of {label}" in message


@pytest.mark.parametrize("method", qc.METHODS)
def test_a_missing_linear_is_refused(built, tmp_path, method):
    model = copy(built[method], tmp_path)
    names = json.loads((model / INDEX).read_text())["weight_map"]
    for name in [n for n in names if n.startswith(f"{EXPERT}.down_proj.")]:
        drop_tensor(model, name)
    message = refused(model, tmp_path / "out")
    assert f"lacks tensor '{EXPERT}.down_proj.{PACKED.get(method, 'weight')}'" in message


def test_the_cli_refuses_in_one_line(built, tmp_path):
    model = copy(built["awq"], tmp_path)
    drop_tensor(model, f"{EXPERT}.gate_proj.qzeros")
    cmd = [sys.executable, "-m", "qwen35_reshard", "--pp", "2", str(model), str(tmp_path / "out")]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert "gate_proj.qzeros" in proc.stderr and "awq" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_a_quantized_module_the_config_ignores_is_refused(built, tmp_path):
    model = copy(built["compressed-tensors"], tmp_path)
    edit_config(model, lambda c: c["quantization_config"]["ignore"].append(f"{EXPERT}.up_proj"))
    message = refused(model, tmp_path / "out")
    assert f"'{EXPERT}.up_proj.weight_packed'" in message and "keeps it unquantized" in message


def test_a_dtype_the_method_does_not_write_is_refused(built, tmp_path):
    model = copy(built["gptq"], tmp_path)
    retype(model, f"{EXPERT}.up_proj.qzeros", "F32")
    message = refused(model, tmp_path / "out")
    assert f"'{EXPERT}.up_proj.qzeros' has dtype F32, but gptq (4-bit, group 32) writes I32" in message


def test_bits_the_tensors_contradict_are_refused(built, tmp_path):
    model = copy(built["gptq"], tmp_path)
    edit_config(model, lambda c: c["quantization_config"].update(bits=8))
    message = refused(model, tmp_path / "out")
    assert "qweight' has shape [8, 256] but config.json implies [16, 256]" in message


def test_modelopt_nvfp4_from_hf_quant_config_alone_needs_that_file(built, tmp_path):
    model = copy(built["modelopt-nvfp4-side"], tmp_path)
    (model / "hf_quant_config.json").unlink()
    assert "gate_proj.weight' has shape [32, 32] but config.json implies [32, 64]" in refused(
        model, tmp_path / "o"
    )


def test_gptq_dynamic_rules_give_modules_their_own_bits(built, tmp_path):
    model = copy(built["gptq"], tmp_path)
    expert = r".*mlp\.experts\..*"
    edit_config(model, lambda c: c["quantization_config"].update(dynamic={f"+:{expert}": {"bits": 8}}))
    message = refused(model, tmp_path / "out")  # the experts' tensors are 4-bit
    assert "experts.0.gate_proj.qweight' has shape [8, 32] but config.json implies [16, 32]" in message
    edit_config(model, lambda c: c["quantization_config"].update(dynamic={f"-:{expert}": {}}))
    assert "keeps it unquantized" in refused(model, tmp_path / "out")
    edit_config(model, lambda c: c["quantization_config"].update(dynamic={f"+:{expert}": {"bits": 4}}))
    reshard(model, tmp_path / "out", pp=2)
    assert verify(tmp_path / "out", source=model).ok


def test_auto_round_with_gptq_packing_and_per_module_overrides(built, tmp_path):
    model = copy(built["gptq"], tmp_path)
    kept = "model.language_model.layers.0.linear_attn.in_proj_qkv"

    def auto_round(config: dict) -> None:
        q = config["quantization_config"]
        q.update(quant_method="auto-round", packing_format="auto_round:auto_gptq")
        q["extra_config"] = {kept: {"bits": 16}}

    edit_config(model, auto_round)
    message = refused(model, tmp_path / "out")  # that module holds GPTQ tensors, the config keeps it BF16
    assert (
        f"'{kept}.qweight' holds auto-round (4-bit, group 32)'s tensors, but the quantization config"
        in message
    )
    edit_config(model, lambda c: c["quantization_config"]["extra_config"][kept].update(bits=4))
    reshard(model, tmp_path / "out", pp=2)
    assert verify(tmp_path / "out", source=model).ok


def mixed_precision(bits_of_the_rest: int):
    """compressed-tensors ``mixed-precision``: the experts' group first, every other Linear in a
    second group of ``bits_of_the_rest``."""

    def change(config: dict) -> None:
        q = config["quantization_config"]
        group = q["config_groups"].get("group_0") or q["config_groups"]["experts"]
        rest = {**json.loads(json.dumps(group)), "targets": ["Linear"]}
        rest["weights"]["num_bits"] = bits_of_the_rest
        experts = {**group, "targets": [r"re:.*mlp\.experts\.\d+\..*"]}
        q.update(format="mixed-precision", config_groups={"experts": experts, "rest": rest})

    return change


def test_mixed_precision_groups_each_give_their_modules_a_scheme(built, tmp_path):
    model = copy(built["compressed-tensors"], tmp_path)
    edit_config(model, mixed_precision(4))
    reshard(model, tmp_path / "out", pp=2)
    assert verify(tmp_path / "out", source=model).ok
    shutil.rmtree(tmp_path / "out")
    edit_config(model, mixed_precision(8))  # the tensors of the other Linear modules are 4-bit
    message = refused(model, tmp_path / "out")
    assert "in_proj_qkv.weight_packed' has shape [256, 8] but config.json implies [256, 16]" in message
    assert "(32 others with a wrong shape)" in message  # none of the 4-bit group's experts


def test_quantized_fused_experts_are_refused(tmp_path):
    config, tensors = tc.describe_model(**MODEL)  # fused experts
    fused = "model.language_model.layers.1.mlp.experts.gate_up_proj"
    tensors = [t._replace(dtype="U8") if t.name == fused else t for t in tensors]
    tensors.append(tc.TensorSpec(fused + "_scale", "F8_E4M3", (4, 64, 4)))
    config["quantization_config"], _ = qc.quantization_config("modelopt-nvfp4", bits=4, group=16)
    model = tmp_path / "model"
    model.mkdir()
    tc._write_weights(
        model, tensors, shard_bytes=tc.DEFAULT_SHARD_BYTES, single_file=False, seed=0, sparse=True
    )
    (model / "config.json").write_text(json.dumps(config))
    message = refused(model, tmp_path / "out")
    assert (
        f"tensor '{fused}" in message
        and "quantized fused 3-D experts (modelopt) are not supported" in message
    )


# --------------------------------------------------------------------------- not known


def test_an_unknown_method_splits_with_a_warning_and_verify_says_so(built, tmp_path):
    model = copy(built["gptq"], tmp_path)
    edit_config(model, lambda c: c["quantization_config"].update(quant_method="hqq"))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "qwen35_reshard", "--pp", "2", "--json", str(model), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "'hqq'" in warnings[0] and "were not checked" in warnings[0], proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["unchecked_quantization"]["method"] == "hqq"
    report = verify(out)
    assert report.ok and len(report.unchecked) == 2 and all("'hqq'" in w for w in report.unchecked)
    proc = subprocess.run(
        [sys.executable, "-m", "qwen35_reshard", "verify", str(out)], capture_output=True, text=True
    )
    assert proc.returncode == 0 and proc.stdout.count("warning: ") == 2, proc.stdout


def test_modelopt_from_the_hub_reads_hf_quant_config(built, tmp_path):
    """A ModelOpt export whose quantization is only in hf_quant_config.json, planned from a Hub
    repo (tests/hub_server.py): the side file is fetched with config.json, as vLLM reads it."""
    from e2e.test_hub import run

    from support.hub_server import HubServer

    hf_home = tmp_path / "hf-home"
    hf_home.mkdir()
    with HubServer() as hub:
        hub.add_repo("nvidia/Tiny-NVFP4", built["modelopt-nvfp4-side"])
        proc = run(["plan", "--pp", "2", "nvidia/Tiny-NVFP4"], hub=hub, hf_home=hf_home)
    assert "SGLANG_PP_LAYER_PARTITION=2,2" in proc.stdout + proc.stderr
