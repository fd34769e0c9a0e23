"""Which Linear modules a checkpoint's quantization config quantizes, and with which scheme.

Read from ``quantization_config`` in config.json (top level or in ``text_config``), or, for a
ModelOpt export whose config.json has none, from ``hf_quant_config.json`` (what vLLM reads
then). Which modules stay unquantized is the config's own lists, never a per-release table:
compressed-tensors' ``ignore`` and each config group's ``targets``, ModelOpt's
``exclude_modules`` (fnmatch) or ``ignore``, GPTQ's ``dynamic`` (``-:`` regex: not quantized)
and ``modules_in_block_to_quantize``, AWQ's ``modules_to_not_convert`` (substrings), block
FP8's ``modules_to_not_convert``. The tensors on disk decide the rest (see ``schema``).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache

from . import schemes
from .schemes import Scheme

QUANT_SIDE_FILE = "hf_quant_config.json"  # ModelOpt's export; vLLM reads it without quantization_config
# The side files a quantized release may ship: every stage gets them unchanged.
SIDE_FILES = (QUANT_SIDE_FILE, "quantize_config.json", "quantization_config.json")

Choose = Callable[[str], "Scheme | None"]


@dataclass(frozen=True)
class Quantization:
    """A checkpoint's quantization as the schema needs it.

    ``choose(module)``: the scheme the config gives a Linear module, or None when the config
    keeps it unquantized. ``schemes``: every scheme the config names (a module the config keeps
    unquantized is probed for each, to catch a contradiction). ``uniform``: no list of the
    config singles out a module of a decoder layer, so every routed expert gets ``schemes[0]``.
    ``strict``: a module the config keeps unquantized must not hold a quantized set (block FP8
    releases list modules loosely: there the dtype on disk decides). ``unknown``: a method the
    schema does not know (its Linear modules go unchecked).
    """

    method: str | None
    schemes: tuple[Scheme, ...] = ()
    choose: Choose = lambda module: None  # noqa: E731 - the default of a frozen field
    uniform: bool = True
    strict: bool = True
    unknown: str | None = None


NONE = Quantization(None)


def quantization(config: Mapping, side: Mapping | None = None) -> Quantization:
    """The quantization of a checkpoint with ``config`` (config.json) and ``side`` (the parsed
    hf_quant_config.json, or None).

    Raises ValueError for a config entry of the wrong type (the caller names the file).
    """
    text = config.get("text_config")
    q = config.get("quantization_config") or (
        text.get("quantization_config") if isinstance(text, dict) else None
    )
    if not isinstance(q, dict):
        if isinstance(side, dict) and isinstance(side.get("quantization"), dict):
            return _modelopt(side["quantization"], "hf_quant_config.json")
        return NONE
    method = q.get("quant_method")
    if method == "fp8":
        return _block_fp8(q)
    if method == "gptq":
        return _gptq(q)
    if method == "awq":
        return _awq(q)
    if method in ("auto-round", "intel/auto-round"):
        return _auto_round(q)
    if method == "compressed-tensors":
        return _compressed_tensors(q)
    if method == "modelopt":
        return _modelopt(
            q.get("quantization") if isinstance(q.get("quantization"), dict) else q, "config.json"
        )
    return Quantization(str(method), unknown=str(method))


def _int(q: Mapping, *keys: str, default: int | None = None) -> int:
    for key in keys:
        value = q.get(key)
        if value is not None:
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"quantization_config {key} must be an integer, got {value!r}")
            return value
    if default is None:
        raise ValueError(f"quantization_config has no {' or '.join(keys)}")
    return default


def _strings(value: object, key: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"quantization_config {key} must be a list of strings")
    return value


def _block_fp8(q: Mapping) -> Quantization:
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        return Quantization("fp8", unknown="fp8 without weight_block_size")
    scheme = schemes.block_fp8((block[0], block[1]))
    kept = not_converted_matcher(_strings(q.get("modules_to_not_convert"), "modules_to_not_convert"))
    return Quantization("fp8", (scheme,), lambda m: None if kept(m) else scheme, uniform=False, strict=False)


def _gptq(q: Mapping) -> Quantization:
    """GPTQModel's rules: ``dynamic`` ``-:regex`` keeps matching modules unquantized, another
    regex (``+:`` optional) gives them its own bits and group size; with
    ``modules_in_block_to_quantize`` only the modules it lists (relative to a decoder layer) are
    quantized; ``lm_head`` only when ``lm_head`` is true."""
    fmt = q.get("checkpoint_format")
    if fmt not in (None, "gptq", "gptq_v2"):  # gptq_v2 differs in zero points' values, not shapes
        return Quantization("gptq", unknown=f"gptq with checkpoint_format {fmt}")
    bits, group = _int(q, "bits"), _int(q, "group_size", default=128)
    scheme = schemes.gptq(bits, group)
    dynamic = q.get("dynamic") or {}
    if not isinstance(dynamic, dict) or not all(isinstance(k, str) for k in dynamic):
        raise ValueError("quantization_config dynamic must map regexes to objects")
    skipped = [re.compile(k[2:]) for k in dynamic if k.startswith("-:")]
    overrides = []
    for key, over in dynamic.items():
        if not key.startswith("-:") and isinstance(over, dict):
            b, g = _int(over, "bits", default=bits), _int(over, "group_size", default=group)
            overrides.append(
                (
                    re.compile(key.removeprefix("+:")),
                    schemes.gptq(b, g) if (b, g) != (bits, group) else scheme,
                )
            )
    per_block = q.get("modules_in_block_to_quantize")
    listed = (
        {m for names in per_block if isinstance(names, list) for m in names}
        if isinstance(per_block, list)
        else None
    )
    lm_head = bool(q.get("lm_head", False))

    def choose(module: str) -> Scheme | None:
        if module == "lm_head":
            return scheme if lm_head else None
        if any(p.match(module) for p in skipped) or (listed is not None and _in_block(module) not in listed):
            return None
        return next((s for p, s in overrides if p.match(module)), scheme)

    found = tuple(dict.fromkeys((scheme, *(s for _, s in overrides))))
    return Quantization("gptq", found, choose, uniform=not skipped and not overrides and listed is None)


def _auto_round(q: Mapping) -> Quantization:
    """AutoRound exports with GPTQ packing (``packing_format: auto_round:auto_gptq``): GPTQ's
    tensors; ``extra_config`` overrides a module's bits and group size (16 bits or more: kept
    unquantized)."""
    packing = str(q.get("packing_format") or q.get("backend") or "")
    if "gptq" not in packing:
        return Quantization("auto-round", unknown=f"auto-round with packing {packing or 'unnamed'}")
    bits, group = _int(q, "bits"), _int(q, "group_size", default=128)
    scheme = schemes.gptq(bits, group, "auto-round")
    extra = q.get("extra_config") or {}
    if not isinstance(extra, dict) or not all(isinstance(v, dict) for v in extra.values()):
        raise ValueError("quantization_config extra_config must map module names to objects")
    overrides: dict[str, Scheme | None] = {}
    for module, over in extra.items():
        b, g = _int(over, "bits", default=bits), _int(over, "group_size", default=group)
        overrides[module] = (
            None if b >= 16 else scheme if (b, g) == (bits, group) else schemes.gptq(b, g, "auto-round")
        )
    found = tuple(dict.fromkeys(s for s in (scheme, *overrides.values()) if s is not None))

    def choose(module: str) -> Scheme | None:
        return overrides.get(module, scheme) if module != "lm_head" else overrides.get(module)

    return Quantization("auto-round", found, choose, uniform=not overrides)


def _in_block(module: str) -> str | None:
    """``mlp.experts.3.up_proj`` of ``model.language_model.layers.7.mlp.experts.3.up_proj``."""
    head, sep, rest = module.partition("layers.")
    if not sep:
        return None
    _, dot, rel = rest.partition(".")
    return rel if dot else None


def _awq(q: Mapping) -> Quantization:
    version = str(q.get("version", "gemm")).lower()
    if version != "gemm":
        return Quantization("awq", unknown=f"awq version {version}")
    scheme = schemes.awq(_int(q, "bits", "w_bit"), _int(q, "group_size", "q_group_size", default=128))
    kept = tuple(_strings(q.get("modules_to_not_convert"), "modules_to_not_convert"))

    def choose(module: str) -> Scheme | None:
        return None if module == "lm_head" or any(k in module for k in kept) else scheme

    return Quantization("awq", (scheme,), choose, uniform=not kept)


def _compressed_tensors(q: Mapping) -> Quantization:
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError("quantization_config of compressed-tensors has no config_groups")
    top = q.get("format")
    chosen: list[tuple[Callable[[str], bool], Scheme]] = []
    for name, group in groups.items():
        if not isinstance(group, dict):
            raise ValueError(f"quantization_config config_groups {name} must be an object")
        fmt = group.get("format") or top
        scheme = _ct_scheme(str(fmt), group)
        if scheme is None:
            return Quantization("compressed-tensors", unknown=f"compressed-tensors format {fmt}")
        chosen.append((_ct_matcher(_strings(group.get("targets"), "targets")), scheme))
    ignored = _ct_matcher(_strings(q.get("ignore"), "ignore"))

    def choose(module: str) -> Scheme | None:
        if ignored(module):
            return None
        return next((s for targets, s in chosen if targets(module)), None)

    return Quantization("compressed-tensors", tuple(s for _, s in chosen), choose, uniform=False)


def _ct_scheme(fmt: str, group: Mapping) -> Scheme | None:
    w = group.get("weights")
    if not isinstance(w, dict):
        return None
    bits, size = _int(w, "num_bits"), _int(w, "group_size", default=0)
    strategy = str(w.get("strategy") or "tensor")
    activations = isinstance(group.get("input_activations"), dict)
    if fmt == "pack-quantized":
        return schemes.pack_quantized(
            bits,
            strategy,
            size,
            symmetric=w.get("symmetric", True) is not False,
            act_order=w.get("actorder") == "group",
        )
    if fmt == "nvfp4-pack-quantized":
        return schemes.nvfp4_pack_quantized(size or 16, activations=activations)
    if fmt == "mxfp4-pack-quantized":
        return schemes.mxfp4_pack_quantized(size or 32)
    if fmt == "float-quantized":
        block = w.get("block_structure")
        block = (block[0], block[1]) if isinstance(block, list) and len(block) == 2 else None
        static = activations and group["input_activations"].get("dynamic") is False
        return schemes.float_quantized(strategy, size, block, static_input=static)
    return None


def _ct_matcher(patterns: list[str]) -> Callable[[str], bool]:
    """compressed-tensors' rule: ``re:`` patterns match from the start, other names exactly; a
    class name (``Linear``) matches every Linear module."""
    if any(p == "Linear" or (not p.startswith("re:") and "." not in p and p[:1].isupper()) for p in patterns):
        return lambda module: True
    exact = {p for p in patterns if not p.startswith("re:")}
    regexes = [p[3:] for p in patterns if p.startswith("re:")]
    rx = re.compile("|".join(f"(?:{r})" for r in regexes)) if regexes else None
    return lambda module: module in exact or (rx is not None and rx.match(module) is not None)


def _modelopt(q: Mapping, where: str) -> Quantization:
    algo = str(q.get("quant_algo") or "").upper()
    if algo in ("NVFP4", "W4A16_NVFP4", "NVFP4_AWQ"):
        scheme = schemes.modelopt_nvfp4(_int(q, "group_size", default=16))
    elif algo == "FP8":
        scheme = schemes.modelopt_fp8()
    else:
        return Quantization("modelopt", unknown=f"modelopt {algo or 'without quant_algo'} ({where})")
    patterns = _strings(q.get("exclude_modules"), "exclude_modules") + _strings(q.get("ignore"), "ignore")
    rx = re.compile("|".join(fnmatch.translate(p) for p in patterns)) if patterns else None

    def choose(module: str) -> Scheme | None:
        return None if rx is not None and rx.match(module) else scheme

    return Quantization("modelopt", (scheme,), choose, uniform=not patterns)


def _never(module: str) -> bool:
    return False


def not_converted_matcher(patterns: list[str]) -> Callable[[str], bool]:
    """transformers' rule for modules_to_not_convert: a pattern matches a module name from the
    start up to a module boundary (also as a regex), or as a suffix."""
    patterns = [p for p in patterns if isinstance(p, str) and p]
    if not patterns:
        return _never
    suffixes = tuple(patterns)

    @cache
    def start() -> re.Pattern:  # compiled on first use: only a missing weight asks (0.1 s when long)
        boundary = r"(?:(?<=\.)|(?=\.|$))"
        try:
            return re.compile("(?:" + "|".join(f"(?:{p})" for p in patterns) + ")" + boundary)
        except re.error:  # not all valid regexes: take them as plain names
            return re.compile("(?:" + "|".join(map(re.escape, patterns)) + ")" + boundary)

    def not_converted(module: str) -> bool:
        return bool(start().match(module)) or module.endswith(suffixes)

    return not_converted


def unchecked_message(where: str, method: str) -> str:
    """The one-line warning for a quantization method the schema does not know."""
    return (
        f"{where}: quantization method {method!r} is not one this tool knows: the tensors of its Linear "
        "modules were not checked (a stage missing one would go unnoticed); every other tensor was"
    )
