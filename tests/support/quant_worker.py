"""Runs in the llm-compressor environment (.ci/quant/build-venv.sh), for tests/engine/test_quant_real.py.

    python quant_worker.py build WORK SCHEME...     # WORK/bf16, then WORK/SCHEME by model_free_ptq
    python quant_worker.py decompress MODEL STAGE... [+ MODEL STAGE...]   # every quantized module
    python quant_worker.py load DIR...              # transformers + compressed-tensors, CPU

``build`` writes a BF16 per-expert checkpoint of ``examples/tiny_checkpoint.py``'s names with
hidden 256 and expert width 128 (normal random values, so that quantizing means something),
then quantizes it with llm-compressor's data-free ``model_free_ptq`` on CPU, ignoring what the
facts doc's run ignored (and, for W4A16, every Linear whose in features are not a multiple of
its group size 128). ``decompress`` decompresses every module of each stage that holds a
quantization set (``weight_scale``) with compressed-tensors' own compressor for its config
group's format, and the same module of MODEL, and prints JSON: how many modules each stage held and which ones
differ. ``load`` prints JSON of what ``from_pretrained`` did with each directory.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples"))

import tiny_checkpoint as tc  # noqa: E402

# Every other layer full attention: each stage of a pp=2 split has one, as vLLM needs.
MODEL = {
    "layers": 4,
    "experts": 4,
    "hidden": 256,
    "moe_intermediate": 128,
    "vocab": 512,
    "layout": "per_expert",
    "full_attention_interval": 2,
}
IGNORE = [
    "re:.*mlp.gate$",
    "re:.*shared_expert_gate$",
    "lm_head",
    "re:.*embed_tokens$",
    "re:model.visual.*",
    "re:mtp.*",
    "re:.*linear_attn.*",
]
GROUP = 128  # W4A16's group size


def build(work: Path, schemes: list[str]) -> None:
    from llmcompressor.entrypoints.model_free import model_free_ptq

    bf16 = work / "bf16"
    config, specs = tc.describe_model(**MODEL)
    gen = torch.Generator().manual_seed(0)
    tensors = {s.name: (torch.randn(s.shape, generator=gen) * 0.02).to(torch.bfloat16) for s in specs}
    bf16.mkdir(parents=True)
    shards = tc._split_shards(specs, 600_000)
    weight_map = {}
    for k, shard in enumerate(shards, 1):
        name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file({s.name: tensors[s.name] for s in shard}, str(bf16 / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys((s.name for s in shard), name))
    index = {
        "metadata": {"total_size": sum(t.numel() * 2 for t in tensors.values())},
        "weight_map": weight_map,
    }
    (bf16 / tc.INDEX_NAME).write_text(json.dumps(index, indent=2))
    for name, data in tc._side_files(config).items():
        (bf16 / name).write_bytes(data)
    for scheme in schemes:
        ignore = list(IGNORE)
        if scheme == "W4A16":  # group 128 along the in features
            ignore += [
                s.name.removesuffix(".weight") for s in specs if len(s.shape) == 2 and s.shape[1] % GROUP
            ]
        model_free_ptq(str(bf16), str(work / scheme), scheme=scheme, ignore=ignore, device="cpu")


def _tensors(model: Path) -> dict[str, Path]:
    index = model / tc.INDEX_NAME
    if index.exists():
        return {n: model / f for n, f in json.loads(index.read_text())["weight_map"].items()}
    return dict.fromkeys(_names(model / "model.safetensors"), model / "model.safetensors")


def _names(path: Path) -> list[str]:
    with safe_open(str(path), "pt") as f:
        return list(f.keys())


def _read(files: dict[str, Path], names: list[str]) -> dict[str, torch.Tensor]:
    out = {}
    for name in names:
        with safe_open(str(files[name]), "pt") as f:
            out[name] = f.get_tensor(name)
    return out


def _schemes(model: Path):
    from compressed_tensors.quantization import QuantizationConfig

    q = json.loads((model / "config.json").read_text())["quantization_config"]
    config = QuantizationConfig.model_validate(q)
    return config, [(group.targets, group) for group in config.config_groups.values()]


def _scheme_of(module: str, config, groups):
    if any(_matches(module, p) for p in config.ignore or []):
        return None
    return next((g for targets, g in groups if any(_matches(module, t) for t in targets)), None)


def _matches(module: str, pattern: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return pattern == "Linear" or pattern == module


def _decompress(files: dict[str, Path], module: str, scheme, fmt: str) -> torch.Tensor:
    from compressed_tensors.compressors import BaseCompressor

    local = {
        n[len(module) + 1 :]: t
        for n, t in _read(files, [n for n in files if n.rpartition(".")[0] == module]).items()
    }
    compressor = BaseCompressor.get_value_from_registry(fmt)
    return compressor.decompress(local, scheme)["weight"]


def _quantized_modules(files: dict[str, Path]) -> list[str]:
    """Modules with a quantization set: every format here writes ``weight_scale``."""
    return sorted(n.removesuffix(".weight_scale") for n in files if n.endswith(".weight_scale"))


def decompress(model: Path, stages: list[Path]) -> dict:
    config, groups = _schemes(model)
    fmt = json.loads((model / "config.json").read_text())["quantization_config"].get("format")
    source = _tensors(model)
    quantized = _quantized_modules(source)
    report = {"source_modules": len(quantized), "stages": {}, "different": [], "unplaced": []}
    # The control: a module compared with another one must differ, or the comparison is blind.
    a, b = quantized[0], quantized[-1]
    first, last = (_decompress(source, m, _scheme_of(m, config, groups), fmt) for m in (a, b))
    report["control_differs"] = a != b and not torch.equal(first, last)
    seen = set()
    for stage in stages:
        files = _tensors(stage)
        modules = _quantized_modules(files)
        for module in modules:
            scheme = _scheme_of(module, config, groups)
            group_fmt = getattr(scheme, "format", None) or fmt
            mine = _decompress(files, module, scheme, group_fmt)
            theirs = _decompress(source, module, scheme, group_fmt)
            if not torch.equal(mine, theirs):
                report["different"].append(f"{stage.name}:{module}")
        report["stages"][stage.name] = len(modules)
        seen.update(modules)
    report["unplaced"] = sorted(set(quantized) - seen)
    return report


def load(stage: Path) -> dict:
    import transformers

    report = {"transformers": transformers.__version__}
    try:
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            str(stage), dtype=torch.bfloat16, device_map="cpu", output_loading_info=True
        )
        report["loaded"] = type(model).__name__
        report["missing"] = sorted(info.get("missing_keys", []))
        report["unexpected"] = sorted(info.get("unexpected_keys", []))
        report["quantized_modules"] = sum(hasattr(m, "quantization_scheme") for m in model.modules())
    except Exception as e:  # noqa: BLE001 - what happened is the result
        report["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:400] if str(e) else ''}"
    return report


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "build":
        build(Path(args[0]), args[1:])
    elif command == "decompress":
        runs = " ".join(args).split(" + ")
        reports = {}
        for run in runs:
            model, *stages = map(Path, run.split())
            reports[str(stages[0].parent)] = decompress(model, stages)
        print(json.dumps(reports))
    elif command == "load":
        print(json.dumps({a: load(Path(a)) for a in args}))
    else:
        raise SystemExit(f"unknown command {command}")
