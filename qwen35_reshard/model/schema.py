"""The tensors a Qwen3.5 MoE checkpoint must hold, with their shapes, derived from config.json.

The model's structure is written down once, below, as data: each module maps the names of its
tensors (relative to the module) to a shape in named sizes of the config. ``required_tensors``
walks it for one checkpoint and lists every tensor with its full name and shape, in model
order. What a config cannot say is read from the checkpoint's headers, never assumed:

- the routed experts' layout, per MoE block: fused ``mlp.experts.gate_up_proj`` [E, 2I, H] and
  ``down_proj`` [E, H, I], or per-expert ``mlp.experts.{j}.{gate,up,down}_proj.weight``
  (releases mix them: the MTP layer's experts can be per-expert beside fused main layers);
- which Linear weights are FP8 (releases differ): an FP8 weight needs its ``weight_scale_inv``
  of the block shape ``weight_block_size`` gives; a weight missing altogether is taken as FP8
  unless ``modules_to_not_convert`` keeps it, so its scale counts as missing too;
- whether the two optional parts ship at all: ``mtp.*`` and the vision tower ``model.visual.*``
  are whole or absent (transformers' own saves leave ``mtp.*`` out, text-only saves have no
  vision tower); a part that is present must be complete.

Naming follows the config: a multimodal config (``text_config`` inside) names the language
model ``model.language_model.*``, a text-only one ``model.*``. ``lm_head.weight`` is required
unless ``tie_word_embeddings``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cache, cached_property
from itertools import compress, repeat
from operator import add, attrgetter
from typing import NamedTuple

from ..errors import BadInput
from ..format.names import CONFIG_NAME

# --------------------------------------------------------------------------- shapes as data
#
# A size is a named size of the config (TEXT_SIZES, VISION_SIZES and the few derived in
# _Walk), an int, or a tuple of those meaning their product.


@dataclass(frozen=True)
class Param:
    """One tensor with exactly this (relative) name."""

    shape: tuple


@dataclass(frozen=True)
class Linear:
    """A Linear module: ``.weight`` [out, in] (+ ``.bias`` [out]); FP8: + ``.weight_scale_inv``."""

    out: object
    inp: object
    bias: bool = False


@dataclass(frozen=True)
class Experts:
    """Routed experts: fused [E, 2I, H] + [E, H, I], or one gate/up/down Linear per expert."""


def P(*shape) -> Param:  # noqa: N802 - reads like a shape in the tables below
    return Param(shape)


LAYER_NORMS = {
    "input_layernorm.weight": P("hidden"),
    "post_attention_layernorm.weight": P("hidden"),
}
FULL_ATTENTION = {
    # q_proj is doubled: the second half is the output gate.
    "self_attn.q_proj": Linear(("heads", "head_dim", 2), "hidden"),
    "self_attn.k_proj": Linear(("kv_heads", "head_dim"), "hidden"),
    "self_attn.v_proj": Linear(("kv_heads", "head_dim"), "hidden"),
    "self_attn.o_proj": Linear("hidden", ("heads", "head_dim")),
    "self_attn.q_norm.weight": P("head_dim"),
    "self_attn.k_norm.weight": P("head_dim"),
}
LINEAR_ATTENTION = {  # Gated DeltaNet
    "linear_attn.in_proj_qkv": Linear("conv_dim", "hidden"),
    "linear_attn.in_proj_z": Linear("value_dim", "hidden"),
    "linear_attn.in_proj_b": Linear("linear_value_heads", "hidden"),
    "linear_attn.in_proj_a": Linear("linear_value_heads", "hidden"),
    "linear_attn.conv1d.weight": P("conv_dim", 1, "conv_kernel"),
    "linear_attn.dt_bias": P("linear_value_heads"),
    "linear_attn.A_log": P("linear_value_heads"),
    "linear_attn.norm.weight": P("linear_value_head_dim"),
    "linear_attn.out_proj": Linear("hidden", "value_dim"),
}
SPARSE_MOE = {
    "mlp.gate.weight": P("experts", "hidden"),  # the router
    "mlp.experts": Experts(),
    "mlp.shared_expert.gate_proj": Linear("shared_intermediate", "hidden"),
    "mlp.shared_expert.up_proj": Linear("shared_intermediate", "hidden"),
    "mlp.shared_expert.down_proj": Linear("hidden", "shared_intermediate"),
    "mlp.shared_expert_gate": Linear(1, "hidden"),
}
DECODER_LAYER = {
    "linear_attention": {**LINEAR_ATTENTION, **SPARSE_MOE, **LAYER_NORMS},
    "full_attention": {**FULL_ATTENTION, **SPARSE_MOE, **LAYER_NORMS},
}
EXPERT = {  # one routed expert of the per-expert layout
    "gate_proj": Linear("intermediate", "hidden"),
    "up_proj": Linear("intermediate", "hidden"),
    "down_proj": Linear("hidden", "intermediate"),
}
FUSED_EXPERTS = {
    "gate_up_proj": P("experts", ("intermediate", 2), "hidden"),
    "down_proj": P("experts", "hidden", "intermediate"),
}
# Around the decoder layers ("layers.{i}." of DECODER_LAYER[layer_types[i]]).
LANGUAGE_MODEL_BEFORE = {"embed_tokens.weight": P("vocab", "hidden")}
LANGUAGE_MODEL_AFTER = {"norm.weight": P("hidden")}
LM_HEAD = {"lm_head": Linear("vocab", "hidden")}  # absent when tied to embed_tokens
# Multi-token prediction: "mtp." + these, with "layers.{k}." full-attention decoder layers.
MTP_BEFORE = {
    "fc": Linear("hidden", ("hidden", 2)),
    "pre_fc_norm_embedding.weight": P("hidden"),
    "pre_fc_norm_hidden.weight": P("hidden"),
}
MTP_AFTER = {"norm.weight": P("hidden")}
# Vision tower: "model.visual." + these, with "blocks.{b}." VISION_BLOCKs between.
VISION_BEFORE = {
    "patch_embed.proj.weight": P("v_hidden", "v_in_channels", "v_temporal_patch", "v_patch", "v_patch"),
    "patch_embed.proj.bias": P("v_hidden"),
    "pos_embed.weight": P("v_positions", "v_hidden"),
}
VISION_BLOCK = {
    "norm1.weight": P("v_hidden"),
    "norm1.bias": P("v_hidden"),
    "norm2.weight": P("v_hidden"),
    "norm2.bias": P("v_hidden"),
    "attn.qkv": Linear(("v_hidden", 3), "v_hidden", bias=True),
    "attn.proj": Linear("v_hidden", "v_hidden", bias=True),
    "mlp.linear_fc1": Linear("v_intermediate", "v_hidden", bias=True),
    "mlp.linear_fc2": Linear("v_hidden", "v_intermediate", bias=True),
}
VISION_AFTER = {
    "merger.norm.weight": P("v_hidden"),
    "merger.norm.bias": P("v_hidden"),
    "merger.linear_fc1": Linear("v_merged", "v_merged", bias=True),
    "merger.linear_fc2": Linear("v_out_hidden", "v_merged", bias=True),
}

# Named sizes: config key and transformers' default (what the servers use when a key is absent).
TEXT_SIZES = {
    "hidden": ("hidden_size", 2048),
    "vocab": ("vocab_size", 248320),
    "experts": ("num_experts", 256),
    "intermediate": ("moe_intermediate_size", 512),
    "shared_intermediate": ("shared_expert_intermediate_size", 512),
    "heads": ("num_attention_heads", 16),
    "kv_heads": ("num_key_value_heads", 2),
    "head_dim": ("head_dim", 256),
    "linear_key_heads": ("linear_num_key_heads", 16),
    "linear_value_heads": ("linear_num_value_heads", 32),
    "linear_key_head_dim": ("linear_key_head_dim", 128),
    "linear_value_head_dim": ("linear_value_head_dim", 128),
    "conv_kernel": ("linear_conv_kernel_dim", 4),
}
VISION_SIZES = {
    "v_hidden": ("hidden_size", 1152),
    "v_intermediate": ("intermediate_size", 4304),
    "v_in_channels": ("in_channels", 3),
    "v_patch": ("patch_size", 16),
    "v_temporal_patch": ("temporal_patch_size", 2),
    "v_merge": ("spatial_merge_size", 2),
    "v_out_hidden": ("out_hidden_size", 3584),
    "v_positions": ("num_position_embeddings", 2304),
}
FP8_DTYPES = frozenset({"F8_E4M3", "F8_E5M2"})
# A checkpoint's tensors reach the schema as name -> anything with these attributes (a
# source tensor, a stage manifest's entry): no name -> dtype mapping is built per tensor.
_DTYPE, _SHAPE = attrgetter("dtype"), attrgetter("shape")
SCALE_SUFFIX = "_scale_inv"  # weight -> weight_scale_inv, gate_up_proj -> gate_up_proj_scale_inv


# --------------------------------------------------------------------------- walking it


@dataclass(frozen=True)
class Schema:
    """Every tensor one checkpoint must hold: name -> shape, in model order.

    ``mtp`` and ``vision`` say whether those optional parts ship (and so are required);
    ``unchecked`` names a quantization method whose Linear tensors the schema does not know
    (their names and shapes are then left unchecked), else None.
    """

    names: list[str]  # in model order
    shapes: list[tuple[int, ...] | None]  # None: any shape (one the config cannot tell)
    mtp: bool
    vision: bool
    unchecked: str | None
    # What the walk found under each name in the tensors it was given (None: absent), and
    # those tensors: check_complete against the same ones looks nothing up again.
    found: list[object] = field(default_factory=list, repr=False, compare=False)
    looked_up_in: Mapping[str, object] | None = field(default=None, repr=False, compare=False)

    @cached_property
    def tensors(self) -> dict[str, tuple[int, ...] | None]:
        """name -> shape, in model order."""
        return dict(zip(self.names, self.shapes, strict=True))


def text_config(config: Mapping) -> Mapping:
    """The language model's config: ``text_config`` of a multimodal config, else the config."""
    sub = config.get("text_config")
    return sub if isinstance(sub, dict) else config


def tied_embeddings(config: Mapping) -> bool:
    """Whether lm_head shares embed_tokens' weight (then no ``lm_head.weight`` is saved)."""
    if "tie_word_embeddings" in config:
        return bool(config["tie_word_embeddings"])
    return bool(text_config(config).get("tie_word_embeddings", False))


def language_model_prefix(config: Mapping) -> str:
    """``model.language_model.`` for a multimodal config, ``model.`` for a text-only one."""
    return "model.language_model." if isinstance(config.get("text_config"), dict) else "model."


def layer_types(config: Mapping) -> list[str]:
    """Attention kind of each decoder layer (``full_attention`` or ``linear_attention``)."""
    try:
        return _layer_types(text_config(config))
    except ValueError as e:
        raise BadInput(f"{CONFIG_NAME}: {e}") from e


def mtp_layers(config: Mapping) -> int:
    """Decoder layers of the MTP draft (``mtp_num_hidden_layers``; absent or null: 1)."""
    try:
        return _size(text_config(config), "mtp_num_hidden_layers", 1)
    except ValueError as e:
        raise BadInput(f"{CONFIG_NAME}: {e}") from e


def required_tensors(
    config: Mapping,
    tensors: Mapping[str, object],
    *,
    layers: range | None = None,
    mtp: bool | None = None,
    vision: bool | None = None,
) -> Schema:
    """The schema of the checkpoint with ``config`` whose headers list ``tensors`` (name ->
    anything with a ``dtype``, such as a source tensor).

    ``layers`` limits the decoder layers walked (a stage's range; the other parts are always
    listed); ``mtp`` and ``vision`` say whether those parts ship when ``tensors`` cannot tell
    (a stage holds only some of the checkpoint); by default their presence decides.
    Raises ReshardError for a config whose sizes are not those of a Qwen3.5 MoE model.
    """
    try:
        walk = _Walk(config, tensors, layers=layers, mtp=mtp, vision=vision)
        walk.model()
        return Schema(walk.names, walk.shapes, walk.mtp, walk.vision, walk.unchecked, walk.found, tensors)
    except ValueError as e:
        raise BadInput(f"{CONFIG_NAME}: {e}; is this a Qwen3.5 MoE config?") from e


class _ExpertColumns(NamedTuple):
    weights: list[str]
    weight_shapes: list[tuple[int, ...] | None]
    scales: list[str]  # each weight's scale
    with_scales_shapes: list[tuple[int, ...] | None]  # each weight's shape, then its scale's


class _Walk:
    """One pass over the tables for one config and one checkpoint's tensors."""

    def __init__(
        self,
        config: Mapping,
        tensors: Mapping[str, object],
        *,
        layers: range | None,
        mtp: bool | None,
        vision: bool | None,
    ):
        text = text_config(config)
        self.tensors = tensors
        self.sizes = _sizes(text, TEXT_SIZES)
        s = self.sizes
        s["value_dim"] = s["linear_value_heads"] * s["linear_value_head_dim"]
        s["conv_dim"] = 2 * s["linear_key_heads"] * s["linear_key_head_dim"] + s["value_dim"]
        # Each repeat of a module (a decoder layer, an expert, an MTP layer, a vision block)
        # needs a tensor of its own, so past this many some are missing whatever the count:
        # walk no further (a config, or a stage manifest's layer range, can name 10**15).
        self.most = len(tensors) + 1
        n = _size(text, "num_hidden_layers", 40)
        layers = range(n) if layers is None else layers
        if layers and layers[-1] >= n:
            raise ValueError(f"num_hidden_layers is {n}, yet layer {layers[-1]} is asked for")
        self.layers = layers[: self.most]
        self.layer_types = _layer_types(text, upto=self.layers.stop)
        self.lm = language_model_prefix(config)
        self.tied = tied_embeddings(config)
        vcfg = config.get("vision_config")
        if vision is None:
            vision = _ships(tensors, "model.visual.", "patch_embed.proj.weight")
        self.vision = isinstance(vcfg, dict) and vision
        if self.vision:
            v = _sizes(vcfg, VISION_SIZES)
            v["v_merged"] = v["v_hidden"] * v["v_merge"] ** 2
            self.sizes.update(v)
            self.vision_depth = _size(vcfg, "depth", 27)
        self.mtp = _ships(tensors, "mtp.", "fc.weight") if mtp is None else mtp
        self.mtp_layers = _size(text, "mtp_num_hidden_layers", 1)
        self.block, self.unchecked, self.not_converted = _quantization(config)
        self.cache: dict[int, list[tuple]] = {}
        # Every required tensor, in model order, column by column (~190,000 for a 397B FP8).
        self.names: list[str] = []
        self.shapes: list[tuple[int, ...] | None] = []
        self.found: list[object] = []  # the tensor under each name, or None

    def model(self) -> None:
        """Walk the whole model."""
        lm, add = self.lm, self.add
        add(LANGUAGE_MODEL_BEFORE, lm)
        for i in self.layers:
            add(DECODER_LAYER[self.layer_types[i]], f"{lm}layers.{i}.")
        add(LANGUAGE_MODEL_AFTER, lm)
        if not self.tied:
            add(LM_HEAD, "")
        if self.vision:
            add(VISION_BEFORE, "model.visual.")
            for b in range(min(self.vision_depth, self.most)):
                add(VISION_BLOCK, f"model.visual.blocks.{b}.")
            add(VISION_AFTER, "model.visual.")
        if self.mtp:
            add(MTP_BEFORE, "mtp.")
            for k in range(min(self.mtp_layers, self.most)):
                add(DECODER_LAYER["full_attention"], f"mtp.layers.{k}.")
            add(MTP_AFTER, "mtp.")

    def add(self, table: Mapping[str, object], prefix: str) -> None:
        """Add the tensors of module ``table`` under ``prefix``. Runs for every expert: kept lean."""
        names, shapes, found, get = self.names.append, self.shapes.append, self.found.append, self.tensors.get
        for rel, kind, shape, bias, scale in self.resolved(table):
            name = prefix + rel
            if kind is Param:
                names(name)
                shapes(shape)
                found(get(name))
            elif kind is Linear:
                if self.unchecked:
                    continue
                weight = name + ".weight"
                t = get(weight)
                names(weight)
                shapes(shape)
                found(t)
                if bias is not None:
                    names(name + ".bias")
                    shapes(bias)
                    found(get(name + ".bias"))
                if (t.dtype in FP8_DTYPES) if t is not None else self.missing_is_fp8(name):
                    names(weight + SCALE_SUFFIX)
                    shapes(scale)
                    found(get(weight + SCALE_SUFFIX))
            else:
                self.experts(name + ".")

    def experts(self, prefix: str) -> None:
        if prefix + "gate_up_proj" in self.tensors or prefix + "down_proj" in self.tensors:
            for rel, _, shape, _, scale in self.resolved(FUSED_EXPERTS):
                t = self.tensors.get(prefix + rel)
                self.names.append(prefix + rel)
                self.shapes.append(shape)
                self.found.append(t)
                if t is not None and t.dtype in FP8_DTYPES:
                    self.names.append(prefix + rel + SCALE_SUFFIX)
                    self.shapes.append(scale)
                    self.found.append(self.tensors.get(prefix + rel + SCALE_SUFFIX))
            return
        if self.unchecked:  # EXPERT holds Linear modules only
            return
        # Every expert's gate, up and down weight in one go (~3 x 512 per layer of a 397B FP8):
        # when none is missing and their dtypes are all FP8 (each needs its scale) or none is,
        # the names are the block's prefix on the walk's expert columns, made column-wise.
        columns = self.expert_columns
        weights = list(map(add, repeat(prefix), columns.weights))
        found = list(map(self.tensors.get, weights))
        dtypes = set(map(_DTYPE, found)) if None not in found else None
        if dtypes is not None and dtypes <= FP8_DTYPES:
            scales = list(map(add, repeat(prefix), columns.scales))
            self.names += _interleave(weights, scales)
            self.shapes += columns.with_scales_shapes
            self.found += _interleave(found, list(map(self.tensors.get, scales)))
        elif dtypes is not None and dtypes.isdisjoint(FP8_DTYPES):
            self.names += weights
            self.shapes += columns.weight_shapes
            self.found += found
        else:  # mixed, or missing weights: one by one, as every other module
            for j in range(min(self.sizes["experts"], self.most)):
                self.add(EXPERT, f"{prefix}{j}.")

    @cached_property
    def expert_columns(self) -> _ExpertColumns:
        """Every routed expert's weights, relative to the block, in order; and with their scales."""
        rows = self.resolved(EXPERT)
        count = min(self.sizes["experts"], self.most)
        weights = [f"{j}.{rel}.weight" for j in range(count) for rel, *_ in rows]
        shapes = [shape for _, _, shape, _, _ in rows] * count
        scales = list(map(add, weights, repeat(SCALE_SUFFIX)))
        both = _interleave(shapes, [scale for _, _, _, _, scale in rows] * count)
        return _ExpertColumns(weights, shapes, scales, both)

    def resolved(self, table: Mapping[str, object]) -> list[tuple]:
        """``table`` with its sizes looked up once: (name, kind, shape, bias shape, scale shape)."""
        key = id(table)
        if key not in self.cache:
            rows = []
            for rel, spec in table.items():
                if isinstance(spec, Param):
                    shape = self.shape(spec.shape)
                    rows.append((rel, Param, shape, None, self.scale_shape(shape)))
                elif isinstance(spec, Linear):
                    shape = (self.size(spec.out), self.size(spec.inp))
                    bias = shape[:1] if spec.bias else None
                    rows.append((rel, Linear, shape, bias, self.scale_shape(shape)))
                else:
                    rows.append((rel, Experts, None, None, None))
            self.cache[key] = rows
        return self.cache[key]

    def shape(self, dims: tuple) -> tuple[int, ...]:
        return tuple(self.size(d) for d in dims)

    def size(self, dim: object) -> int:
        if isinstance(dim, int):
            return dim
        if isinstance(dim, tuple):
            return math.prod(self.size(d) for d in dim)
        return self.sizes[dim]

    def missing_is_fp8(self, module: str) -> bool:
        """Whether a Linear whose weight is missing would be FP8: the config quantizes it."""
        return self.block is not None and not self.not_converted(module)

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...] | None:
        """``weight_scale_inv``: one scale per block of the last two dims (leading dims kept)."""
        if self.block is None or len(shape) < 2:
            return None  # no block size: an FP8 weight's scale is then required, any shape
        *lead, out, inp = shape
        return (*lead, -(-out // self.block[0]), -(-inp // self.block[1]))


def _interleave(firsts: list, seconds: list) -> list:
    """``[firsts[0], seconds[0], firsts[1], ...]`` (lists of one length), by slice assignment:
    in C, not a step per item (a layer's experts have ~1,500 weights)."""
    both: list = [None] * (2 * len(firsts))
    both[0::2], both[1::2] = firsts, seconds
    return both


def _size(config: Mapping, key: str, default: int) -> int:
    value = config.get(key, default)
    if value is None:
        value = default
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{key} must be a non-negative integer, got {value!r}")
    return value


def _sizes(config: Mapping, table: Mapping[str, tuple[str, int]]) -> dict[str, int]:
    return {name: _size(config, key, default) for name, (key, default) in table.items()}


def _layer_types(text: Mapping, *, upto: int | None = None) -> list[str]:
    """The attention kind of each layer; derived from the interval, only of the first ``upto``."""
    n = _size(text, "num_hidden_layers", 40)
    types = text.get("layer_types")
    if types is None:
        interval = _size(text, "full_attention_interval", 4) or 4
        count = n if upto is None else min(n, upto)
        return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(count)]
    if (
        not isinstance(types, list)
        or len(types) != n
        or not all(isinstance(t, str) and t in DECODER_LAYER for t in types)  # a list: unhashable
    ):
        raise ValueError(
            f"layer_types must list {n} entries (num_hidden_layers), each one of {', '.join(DECODER_LAYER)}"
        )
    return types


def _ships(names: Mapping[str, object], prefix: str, probe: str) -> bool:
    """Whether any tensor under ``prefix`` is present (``probe`` first: no scan when it is; the
    scan is one ``map`` in C, not a generator step per name)."""
    return prefix + probe in names or any(map(str.startswith, names, repeat(prefix)))


def _quantization(config: Mapping) -> tuple[tuple[int, int] | None, str | None, Callable[[str], bool]]:
    """(FP8 block shape or None, a quantization method the schema does not know or None,
    module name -> kept unquantized by modules_to_not_convert)."""
    q = config.get("quantization_config") or text_config(config).get("quantization_config")
    if not isinstance(q, dict):
        return None, None, _never
    method = q.get("quant_method")
    block = q.get("weight_block_size")
    if method != "fp8" or not (
        isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)
    ):
        return None, str(method) if method != "fp8" else "fp8 without weight_block_size", _never
    return tuple(block), None, _not_converted_matcher(q.get("modules_to_not_convert") or [])


def _never(module: str) -> bool:
    return False


def _not_converted_matcher(patterns: list[str]) -> Callable[[str], bool]:
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


def compare(
    required: Mapping[str, tuple[int, ...] | None], tensors: Mapping[str, object]
) -> tuple[list[str], list[tuple[str, tuple[int, ...], tuple[int, ...]]]]:
    """What of ``required`` is not in ``tensors`` (name -> anything with a ``shape``), in model
    order, and which present tensors have another shape: ``(missing, [(name, expected, found), ...])``."""
    return _compare(list(required), list(required.values()), tensors)


def compare_schema(
    required: Schema, tensors: Mapping[str, object], keep: list[bool] | None = None
) -> tuple[list[str], list[tuple[str, tuple[int, ...], tuple[int, ...]]]]:
    """:func:`compare` for a :class:`Schema`, using what its walk found when it looked in
    ``tensors`` (nothing looked up twice); ``keep``: a flag per name, to compare only the
    names flagged (a stage's share of the other parts)."""
    names, shapes = required.names, required.shapes
    found = required.found if required.looked_up_in is tensors else None
    if keep is not None:
        names, shapes = list(compress(names, keep)), list(compress(shapes, keep))
        found = list(compress(found, keep)) if found is not None else None
    return _compare(names, shapes, tensors, found)


def _compare(
    names: list[str],
    wants: list[tuple[int, ...] | None],
    tensors: Mapping[str, object],
    found: list[object] | None = None,
) -> tuple[list[str], list[tuple[str, tuple[int, ...], tuple[int, ...]]]]:
    """``found``: the tensor under each name, when already looked up in ``tensors``."""
    if found is None:
        found = list(map(tensors.get, names))
    if None not in found:  # the common case, one comparison: every tensor, as tuples of the same ints
        shapes = list(map(_SHAPE, found))
        if None in wants:  # a shape the config cannot tell: whatever is found
            wants = [s if w is None else w for w, s in zip(wants, shapes, strict=True)]
        if shapes == wants:
            return [], []
    missing = [n for n, t in zip(names, found, strict=True) if t is None]
    wrong = [
        (n, want, t.shape)
        for n, want, t in zip(names, wants, found, strict=True)
        if want is not None and t is not None and tuple(t.shape) != want
    ]
    return missing, wrong


def check_complete(required: Schema, tensors: Mapping[str, object], where: str) -> None:
    """Refuse, in one line, tensors ``required`` that ``tensors`` (name -> anything with a
    ``shape``) lacks or has in another shape.

    ``where`` names the checkpoint (or stage) in the message.
    """
    missing, wrong = compare_schema(required, tensors)
    if missing:
        raise BadInput(
            f"{where}: lacks tensor {missing[0]!r}, which {CONFIG_NAME} requires ({others(len(missing) - 1)} "
            "missing); a server would leave it unloaded: the checkpoint is incomplete, download or "
            "convert it again"
        )
    if wrong:
        name, want, found = wrong[0]
        raise BadInput(
            f"{where}: tensor {name!r} has shape {list(found)} but {CONFIG_NAME} implies {list(want)} "
            f"({others(len(wrong) - 1)} with a wrong shape); the config and the weights do not match"
        )


def others(n: int) -> str:
    """'1 other' or 'N others', for messages that name the first of several."""
    return f"{n} other" if n == 1 else f"{n} others"
