"""What each quantization method writes for one Linear of out features N and in features K.

Sources: the packers of compressed-tensors (``pack_to_int32``, the NVFP4 / MXFP4 compressors),
GPTQModel and AutoGPTQ (``QuantLinear.pack``), AutoAWQ (``WQLinear_GEMM``) and NVIDIA ModelOpt's
export, as ../shared/docs/quantized-checkpoint-facts.md section 3 sums them up. Every tensor of
the set sits under the Linear's own module path (``<module>.<suffix>``), so it carries the
layer id like ``.weight`` does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

FP8_DTYPES = frozenset({"F8_E4M3", "F8_E5M2"})
FLOAT_DTYPES = frozenset({"F16", "BF16", "F32"})  # scales follow the model's dtype, or F32
_I32, _I64, _U8, _F32 = frozenset({"I32"}), frozenset({"I64"}), frozenset({"U8"}), frozenset({"F32"})
_E4M3 = frozenset({"F8_E4M3"})

Shape = tuple[int, ...] | None  # None: any shape (one the config cannot tell)


@dataclass(frozen=True)
class Part:
    """One tensor of a quantized Linear: ``<module>.<suffix>``, its shape from (N, K), and the
    dtypes it may have on disk (None: any)."""

    suffix: str
    shape: Callable[[int, int], Shape]
    dtypes: frozenset[str] | None


@dataclass(frozen=True)
class Scheme:
    """One method's complete set of tensors for a quantized Linear.

    ``marks``: for methods that keep the packed weight under ``.weight`` (FP8, ModelOpt NVFP4),
    the dtypes that tell a quantized weight from a BF16 one on disk; None for methods whose
    packed weight has a name of its own (``qweight``, ``weight_packed``).
    """

    method: str  # for messages: "gptq (4-bit, group 128)"
    parts: tuple[Part, ...]  # the packed weight first
    marks: frozenset[str] | None = None

    @property
    def suffixes(self) -> tuple[str, ...]:
        return tuple(p.suffix for p in self.parts)

    def shapes(self, out: int, inp: int) -> list[Shape]:
        """Each part's shape for a Linear [out, in]."""
        return [p.shape(out, inp) for p in self.parts]

    def describe(self) -> str:
        """``gptq (4-bit, group 128): qweight, qzeros, scales, g_idx``, for messages."""
        return f"{self.method}: {', '.join(self.suffixes)}"


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _groups(k: int, group: int) -> int:
    """Scale rows of a [.., K] weight quantized in groups (-1 or 0: one group, per channel)."""
    return 1 if group <= 0 else _ceil(k, group)


def _any(n: int, k: int) -> Shape:
    return None


def gptq(bits: int, group: int, label: str = "gptq") -> Scheme:
    """GPTQ (GPTQModel, AutoGPTQ, AutoRound's ``auto_gptq`` packing): K packed along dim 0;
    ``qzeros`` and ``g_idx`` written even when symmetric or without act-order."""
    return Scheme(
        f"{label} ({bits}-bit, group {group})",
        (
            Part("qweight", lambda n, k: (_ceil(k * bits, 32), n), _I32),
            Part("qzeros", lambda n, k: (_groups(k, group), _ceil(n * bits, 32)), _I32),
            Part("scales", lambda n, k: (_groups(k, group), n), FLOAT_DTYPES),
            Part("g_idx", lambda n, k: (k,), _I32),
        ),
    )


def awq(bits: int, group: int) -> Scheme:
    """AWQ GEMM packing: N packed along dim 1; no g_idx."""
    return Scheme(
        f"awq ({bits}-bit, group {group})",
        (
            Part("qweight", lambda n, k: (k, _ceil(n * bits, 32)), _I32),
            Part("qzeros", lambda n, k: (_groups(k, group), _ceil(n * bits, 32)), _I32),
            Part("scales", lambda n, k: (_groups(k, group), n), FLOAT_DTYPES),
        ),
    )


def pack_quantized(bits: int, strategy: str, group: int, *, symmetric: bool, act_order: bool) -> Scheme:
    """compressed-tensors ``pack-quantized`` (W4A16, W8A16): int weights packed into int32 along
    K; a zero point only when asymmetric (packed along N, any shape here), ``weight_g_idx`` only
    with group act-order."""
    scale = _scale_shape(strategy, group)
    parts = [
        Part("weight_packed", lambda n, k: (n, _ceil(k * bits, 32)), _I32),
        Part("weight_scale", scale, FLOAT_DTYPES),
        Part("weight_shape", lambda n, k: (2,), _I64),
    ]
    if not symmetric:
        parts.append(Part("weight_zero_point", _any, None))
    if act_order:
        parts.append(Part("weight_g_idx", lambda n, k: (k,), _I32))
    kind = f"group {group}" if strategy == "group" else strategy
    return Scheme(f"compressed-tensors pack-quantized ({bits}-bit, {kind})", tuple(parts))


def nvfp4_pack_quantized(group: int, *, activations: bool) -> Scheme:
    """compressed-tensors ``nvfp4-pack-quantized``: two FP4 values a byte, an E4M3 scale per
    ``group`` (16) values, one global scale; ``input_global_scale`` only for W4A4."""
    parts = [
        Part("weight_packed", lambda n, k: (n, _ceil(k, 2)), _U8),
        Part("weight_scale", lambda n, k: (n, _ceil(k, group)), _E4M3),
        Part("weight_global_scale", lambda n, k: (1,), _F32),
    ]
    if activations:
        parts.append(Part("input_global_scale", lambda n, k: (1,), _F32))
    return Scheme(f"compressed-tensors nvfp4-pack-quantized (group {group})", tuple(parts))


def mxfp4_pack_quantized(group: int) -> Scheme:
    """compressed-tensors ``mxfp4-pack-quantized``: two FP4 values a byte, an E8M0 scale per
    ``group`` (32) values (llm-compressor stores it as U8)."""
    return Scheme(
        f"compressed-tensors mxfp4-pack-quantized (group {group})",
        (
            Part("weight_packed", lambda n, k: (n, _ceil(k, 2)), _U8),
            Part("weight_scale", lambda n, k: (n, _ceil(k, group)), _U8 | {"F8_E8M0"}),
        ),
    )


def float_quantized(
    strategy: str, group: int, block: tuple[int, int] | None, *, static_input: bool
) -> Scheme:
    """compressed-tensors ``float-quantized`` (FP8): the FP8 weight under ``.weight``, its scale
    per channel [N, 1], per block, or per tensor; ``input_scale`` only for static activations."""
    scale = (
        (lambda n, k: (_ceil(n, block[0]), _ceil(k, block[1]))) if block else _scale_shape(strategy, group)
    )
    parts = [Part("weight", lambda n, k: (n, k), FP8_DTYPES), Part("weight_scale", scale, None)]
    if static_input:
        parts.append(Part("input_scale", _any, None))
    return Scheme(f"compressed-tensors float-quantized ({strategy})", tuple(parts), marks=FP8_DTYPES)


def modelopt_nvfp4(group: int) -> Scheme:
    """ModelOpt NVFP4: packed FP4 under ``.weight``, E4M3 block scales, a 0-dim global
    ``weight_scale_2``. ``input_scale`` (absent for W4A16 exports) is not required."""
    return Scheme(
        f"modelopt NVFP4 (group {group})",
        (
            Part("weight", lambda n, k: (n, _ceil(k, 2)), _U8),
            Part("weight_scale", lambda n, k: (n, _ceil(k, group)), _E4M3),
            Part("weight_scale_2", lambda n, k: (), _F32),
        ),
        marks=_U8,
    )


def modelopt_fp8() -> Scheme:
    """ModelOpt FP8: the FP8 weight, its scale and the static input scale (per tensor)."""
    return Scheme(
        "modelopt FP8",
        (
            Part("weight", lambda n, k: (n, k), FP8_DTYPES),
            Part("weight_scale", _any, None),
            Part("input_scale", _any, None),
        ),
        marks=FP8_DTYPES,
    )


def block_fp8(block: tuple[int, int] | None) -> Scheme:
    """The official -FP8 releases: an FP8 weight and its ``weight_scale_inv``, one scale per
    block of ``weight_block_size`` (without one: any shape)."""
    scale = (lambda n, k: (_ceil(n, block[0]), _ceil(k, block[1]))) if block else _any
    return Scheme(
        "fp8",
        (Part("weight", lambda n, k: (n, k), None), Part("weight_scale_inv", scale, None)),
        marks=FP8_DTYPES,
    )


def _scale_shape(strategy: str, group: int) -> Callable[[int, int], Shape]:
    if strategy == "group":
        return lambda n, k: (n, _groups(k, group))
    if strategy == "channel":
        return lambda n, k: (n, 1)
    return _any  # tensor (or a strategy without a fixed shape)
