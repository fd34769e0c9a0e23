"""The tensors a Qwen3.5 MoE checkpoint must hold, with their shapes, derived from config.json.

The model's structure is written down once, as data (``modules``): each module maps the names
of its tensors (relative to the module) to a shape in named sizes of the config.
``required_tensors`` walks it for one checkpoint and lists every tensor with its full name and
shape, in model order. What a config cannot say is read from the checkpoint's headers, never
assumed:

- the routed experts' layout, per MoE block: fused ``mlp.experts.gate_up_proj`` [E, 2I, H] and
  ``down_proj`` [E, H, I], or per-expert ``mlp.experts.{j}.{gate,up,down}_proj.weight``
  (releases mix them: the MTP layer's experts can be per-expert beside fused main layers);
- which Linear modules are quantized (releases differ): a Linear is either its BF16 ``.weight``
  (+ ``.bias``) or its method's complete set (``quant.schemes``: GPTQ, AWQ, compressed-tensors,
  ModelOpt, block FP8) with the shapes the config's bits and group size fix. The tensors on
  disk say which; a Linear missing altogether is expected in the form the config's lists give
  it (``quant.config``), so what counts as missing is then its packed weight. A module the
  config keeps unquantized holding a quantized set, or a set with a dtype its method does not
  write, is a contradiction (``Schema.problems``);
- whether the two optional parts ship at all: ``mtp.*`` and the vision tower ``model.visual.*``
  are whole or absent (transformers' own saves leave ``mtp.*`` out, text-only saves have no
  vision tower); a part that is present must be complete.

Naming follows the config: a multimodal config (``text_config`` inside) names the language
model ``model.language_model.*``, a text-only one ``model.*``. ``lm_head.weight`` is required
unless ``tie_word_embeddings``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from itertools import compress, repeat
from operator import add, attrgetter

from ..errors import BadInput, ReshardError
from ..format.names import CONFIG_NAME

# Re-exported: callers check a schema through this module.
from .completeness import check_complete as check_complete
from .completeness import compare as compare
from .completeness import compare_schema as compare_schema
from .completeness import others as others
from .modules import (
    DECODER_LAYER,
    EXPERT,
    FUSED_EXPERTS,
    LANGUAGE_MODEL_AFTER,
    LANGUAGE_MODEL_BEFORE,
    LM_HEAD,
    MTP_AFTER,
    MTP_BEFORE,
    TEXT_SIZES,
    VISION_AFTER,
    VISION_BEFORE,
    VISION_BLOCK,
    VISION_SIZES,
    Experts,
    Linear,
    Param,
)
from .quant import FLOAT_DTYPES, FP8_DTYPES, Quantization, Scheme, quantization

# A checkpoint's tensors reach the schema as name -> anything with these attributes (a
# source tensor, a stage manifest's entry): no name -> dtype mapping is built per tensor.
_DTYPE, _NAME = attrgetter("dtype"), attrgetter("name")
SCALE_SUFFIX = "_scale_inv"  # block FP8's fused experts: gate_up_proj -> gate_up_proj_scale_inv


@dataclass(frozen=True)
class Schema:
    """Every tensor one checkpoint must hold: name -> shape, in model order.

    ``mtp`` and ``vision`` say whether those optional parts ship (and so are required);
    ``unchecked`` names a quantization method whose Linear tensors the schema does not know
    (their names and shapes are then left unchecked), else None. ``problems``: (tensor, what is
    wrong) for each thing the tensors contradict of the config (a quantized set the config does
    not give that module, a dtype its method does not write), in model order. ``quant``: the
    checkpoint's quantization, to name a missing tensor's method.
    """

    names: list[str]  # in model order
    shapes: list[tuple[int, ...] | None]  # None: any shape (one the config cannot tell)
    mtp: bool
    vision: bool
    unchecked: str | None
    problems: list[tuple[str, str]] = field(default_factory=list)
    quant: Quantization | None = field(default=None, repr=False, compare=False)
    # What the walk found under each name in the tensors it was given (None: absent), and
    # those tensors: check_complete against the same ones looks nothing up again.
    found: list[object] = field(default_factory=list, repr=False, compare=False)
    looked_up_in: Mapping[str, object] | None = field(default=None, repr=False, compare=False)

    @cached_property
    def tensors(self) -> dict[str, tuple[int, ...] | None]:
        """name -> shape, in model order."""
        return dict(zip(self.names, self.shapes, strict=True))

    def method_of(self, name: str, tensors: Mapping[str, object]) -> str | None:
        """The quantization set the missing tensor ``name`` belongs to, described (``gptq (4-bit,
        group 128): qweight, qzeros, scales, g_idx``); None for a BF16 weight, or no set."""
        module, _, suffix = name.rpartition(".")
        for scheme in self.quant.schemes if self.quant else ():
            if suffix not in scheme.suffixes:
                continue
            if suffix != "weight" or any(f"{module}.{x}" in tensors for x in scheme.suffixes):
                return scheme.describe()
        return None


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
    quant_side: Mapping | None = None,
) -> Schema:
    """The schema of the checkpoint with ``config`` whose headers list ``tensors`` (name ->
    anything with a ``dtype`` and that ``name``, such as a source tensor).

    ``layers`` limits the decoder layers walked (a stage's range; the other parts are always
    listed); ``mtp`` and ``vision`` say whether those parts ship when ``tensors`` cannot tell
    (a stage holds only some of the checkpoint); by default their presence decides.
    ``quant_side``: the checkpoint's hf_quant_config.json, parsed (ModelOpt), if it has one.
    Raises BadInput for a config whose sizes are not those of a Qwen3.5 MoE model, and for
    quantized fused 3-D experts (no release ships them: not supported).
    """
    try:
        walk = _Walk(config, tensors, layers=layers, mtp=mtp, vision=vision, quant_side=quant_side)
        walk.model()
    except ReshardError:
        raise
    except ValueError as e:
        raise BadInput(f"{CONFIG_NAME}: {e}; is this a Qwen3.5 MoE config?") from e
    w, q = walk, walk.q
    return Schema(w.names, w.shapes, w.mtp, w.vision, q.unknown, w.problems, q, w.found, tensors)


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
        quant_side: Mapping | None,
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
        self.q = quantization(config, quant_side)
        self.cache: dict[object, list] = {}
        # Every required tensor, in model order, column by column (~190,000 for a 397B FP8).
        self.names: list[str] = []
        self.shapes: list[tuple[int, ...] | None] = []
        self.found: list[object] = []  # the tensor under each name, or None
        self.problems: list[tuple[str, str]] = []

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
        for rel, kind, shape, bias in self.resolved(table):
            name = prefix + rel
            if kind is Param:
                names(name)
                shapes(shape)
                found(get(name))
            elif kind is Linear:
                if self.q.unknown:
                    continue
                weight = get(name + ".weight")
                scheme = self.scheme(name, weight) if self.q.schemes else None
                if scheme is None:
                    names(name + ".weight")
                    shapes(shape)
                    found(weight)
                else:
                    self.quantized(name, scheme, shape)
                if bias is not None:
                    names(name + ".bias")
                    shapes(bias)
                    found(get(name + ".bias"))
            else:
                self.experts(name + ".")

    def scheme(self, module: str, weight: object) -> Scheme | None:
        """The quantization set ``module`` holds on disk; for a Linear missing altogether, the
        one its config gives it; None: its BF16 weight. A set the config does not give this
        module is a problem (only the first tensor is named)."""
        q, get = self.q, self.tensors.get
        chosen = q.choose(module) if q.strict or weight is None else None
        for s in (chosen, *q.schemes) if chosen is not None else q.schemes:
            marked = s.marks is not None and weight is not None and weight.dtype in s.marks
            if marked or any(get(f"{module}.{x}") is not None for x in s.suffixes if x != "weight"):
                if q.strict and s is not chosen:
                    given = f"gives it {chosen.method}" if chosen else "keeps it unquantized"
                    why = f"holds {s.method}'s tensors, but the quantization config {given}"
                    self.problems.append((f"{module}.{s.suffixes[0]}", why))
                return s
        return chosen if weight is None else None

    def quantized(self, module: str, scheme: Scheme, shape: tuple[int, int]) -> None:
        """Add ``module``'s set of ``scheme`` for a Linear of ``shape``; note a dtype the method
        does not write."""
        get = self.tensors.get
        for part, want in zip(scheme.parts, self.set_shapes(scheme, shape), strict=True):
            name = f"{module}.{part.suffix}"
            t = get(name)
            self.names.append(name)
            self.shapes.append(want)
            self.found.append(t)
            if t is not None and part.dtypes is not None and t.dtype not in part.dtypes:
                why = f"has dtype {t.dtype}, but {scheme.method} writes {'/'.join(sorted(part.dtypes))}"
                self.problems.append((name, why))

    def set_shapes(self, scheme: Scheme, shape: tuple[int, int]) -> list:
        key = (id(scheme), shape)
        if key not in self.cache:
            self.cache[key] = scheme.shapes(*shape)
        return self.cache[key]

    def experts(self, prefix: str) -> None:
        if prefix + "gate_up_proj" in self.tensors or prefix + "down_proj" in self.tensors:
            self.fused_experts(prefix)
            return
        if self.q.unknown:  # EXPERT holds Linear modules only
            return
        # Every expert's gate, up and down in one go (~3 x 512 per layer of a 397B FP8): when
        # all hold one scheme's complete set (or all their BF16 weight) with its dtypes, the
        # names are the block's prefix on the walk's expert columns, made column-wise.
        for scheme in self.expert_schemes(prefix):
            columns = self.expert_columns(scheme)
            cols = [list(map(add, repeat(prefix), names)) for names in columns[0]]
            found = [list(map(self.tensors.get, names)) for names in cols]
            if any(None in f for f in found) or not all(
                want is None or set(map(_DTYPE, f)) <= want for f, want in zip(found, columns[2], strict=True)
            ):
                continue
            if scheme is not None and self.q.strict and not self.q.uniform:
                modules = [name.rpartition(".")[0] for name in cols[0]]
                if any(self.q.choose(m) is not scheme for m in modules):
                    break  # one by one: the module the config keeps otherwise is named
            if scheme is None and self.q.schemes and not self.plain_experts(prefix):
                break
            # The tensors' own names (equal to ``cols``): the schema then holds no string of its
            # own per expert tensor, ~280,000 of them at the largest shapes.
            self.names += _interleave([list(map(_NAME, f)) for f in found])
            self.shapes += columns[1]
            self.found += _interleave(found)
            return
        _refuse_fused_quantized(self.tensors, prefix, self.q)
        for j in range(min(self.sizes["experts"], self.most)):  # mixed, or missing: one by one
            self.add(EXPERT, f"{prefix}{j}.")

    def expert_schemes(self, prefix: str) -> list[Scheme | None]:
        """The sets to try for a block's experts at once: the config's (None: BF16 weights)."""
        q = self.q
        if not q.schemes:
            return [None]
        first = q.choose(f"{prefix}0.gate_proj") if q.strict else q.schemes[0]
        return [first, None] if first is not None else [None, *q.schemes[:1]]

    def plain_experts(self, prefix: str) -> bool:
        """No expert of the block holds the packed tensor of one of the config's schemes."""
        modules = self.expert_columns(None)[0][0]  # "{j}.gate_proj.weight", ...
        for scheme in self.q.schemes:
            extra = next((x for x in scheme.suffixes if x != "weight"), None)
            names = (f"{prefix}{weight[:-6]}{extra}" for weight in modules)
            if extra and any(t is not None for t in map(self.tensors.get, names)):
                return False
        return True

    def expert_columns(self, scheme: Scheme | None) -> tuple[list[list[str]], list, list]:
        """For every routed expert's Linear, in order, relative to the block: the names of each
        tensor of ``scheme``'s set (of the BF16 weight for None), column by column; every
        name's shape, interleaved as the names will be; each column's dtypes on disk."""
        key = ("experts", id(scheme))
        if key not in self.cache:
            rows = self.resolved(EXPERT)
            count = min(self.sizes["experts"], self.most)
            modules = [f"{j}.{rel}" for j in range(count) for rel, *_ in rows]
            if scheme is None:
                parts, shapes = [("weight", None)], [[shape] for _, _, shape, _ in rows]
            else:
                parts = [(p.suffix, p.dtypes) for p in scheme.parts]
                shapes = [self.set_shapes(scheme, shape) for _, _, shape, _ in rows]
            names = [list(map(add, modules, repeat("." + suffix))) for suffix, _ in parts]
            flat = [s for row in shapes for s in row] * count
            dtypes = [d for _, d in parts] if scheme is not None else [None]
            if scheme is None and self.q.schemes:
                dtypes = [FLOAT_DTYPES]  # a BF16 expert beside quantized ones: its dtype says so
            self.cache[key] = (names, flat, dtypes)
        return self.cache[key]

    def fused_experts(self, prefix: str) -> None:
        """Fused 3-D experts: BF16, or block FP8 with a ``_scale_inv`` each; quantized fused
        experts of any other method are refused (no release ships them)."""
        fp8 = next((s for s in self.q.schemes if s.method == "fp8"), None)
        for rel, _, shape, _ in self.resolved(FUSED_EXPERTS):
            t = self.tensors.get(prefix + rel)
            self.names.append(prefix + rel)
            self.shapes.append(shape)
            self.found.append(t)
            if t is not None and t.dtype in FP8_DTYPES:
                block = fp8.parts[1].shape(*shape[1:]) if fp8 else None  # one scale per block
                scale = (shape[0], *block) if block else None
                self.names.append(prefix + rel + SCALE_SUFFIX)
                self.shapes.append(scale)
                self.found.append(self.tensors.get(prefix + rel + SCALE_SUFFIX))
            elif t is not None and t.dtype not in FLOAT_DTYPES:
                _refuse_fused_quantized(self.tensors, prefix, self.q, found=prefix + rel)
        _refuse_fused_quantized(self.tensors, prefix, self.q)

    def resolved(self, table: Mapping[str, object]) -> list[tuple]:
        """``table`` with its sizes looked up once: (name, kind, shape, bias shape)."""
        key = id(table)
        if key not in self.cache:
            rows = []
            for rel, spec in table.items():
                if isinstance(spec, Param):
                    rows.append((rel, Param, self.shape(spec.shape), None))
                elif isinstance(spec, Linear):
                    shape = (self.size(spec.out), self.size(spec.inp))
                    rows.append((rel, Linear, shape, shape[:1] if spec.bias else None))
                else:
                    rows.append((rel, Experts, None, None))
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


def _refuse_fused_quantized(
    tensors: Mapping[str, object], prefix: str, q: Quantization, found: str = ""
) -> None:
    """Refuse a fused 3-D expert key that carries quantization (a quantized dtype, or a name
    beyond ``gate_up_proj``/``down_proj`` and block FP8's ``_scale_inv``): not supported."""
    if not found:
        fused = (prefix + "gate_up_proj", prefix + "down_proj")
        plain = {*fused, *(f + SCALE_SUFFIX for f in fused)}
        under = compress(tensors, map(str.startswith, tensors, repeat(fused)))  # in C: one pass
        found = next((n for n in under if n not in plain), "")
    if found:
        method = q.method or "a quantization method"
        raise BadInput(
            f"tensor {found!r}: quantized fused 3-D experts ({method}) are not supported (no release ships "
            "them); quantize a checkpoint with per-expert experts (mlp.experts.{j}.gate_proj...)"
        )


def _interleave(columns: list[list]) -> list:
    """``[columns[0][0], columns[1][0], ..., columns[0][1], ...]`` (lists of one length), by
    slice assignment: in C, not a step per item (a layer's experts have ~1,500 weights)."""
    if len(columns) == 1:
        return columns[0]
    k = len(columns)
    both: list = [None] * (k * len(columns[0]))
    for i, column in enumerate(columns):
        both[i::k] = column
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
