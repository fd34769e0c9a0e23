"""What serving costs a stage besides its weights: KV cache and linear-attention state. Pure.

Every formula is per GPU of a stage's tensor-parallel group (size ``tp``) and is derived in
docs/partition.md from the servers' source:

- KV cache per token per full-attention layer: ``2 * max(1, kv_heads // tp) * head_dim * 2``
  (K and V, heads replicated when tp exceeds them, a BF16 cache: both servers' "auto" for a
  BF16 model, the FP8 releases included);
- Gated DeltaNet state per request per linear-attention layer: the conv window
  ``(2 * Hk * Dk + Hv * Dv) / tp * (kernel - 1) * 2`` (BF16) plus the recurrent state
  ``Hv / tp * Dk * Dv * b``, where b is the config's ``mamba_ssm_dtype`` when it names one,
  else float32 (4) for SGLang and the model's BF16 (2) for vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import BadInput, param
from ..model.runtimes import runtime_of

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_CACHE_BYTES = 2  # BF16 KV cache and conv state
# The share of GPU memory assumed when none is given: vLLM's --gpu-memory-utilization default.
DEFAULT_MEM_FRACTION = 0.9


@dataclass(frozen=True)
class Capacity:
    """How the server will run each stage: what capacity mode sizes the split for."""

    gpu_bytes: int  # memory of one GPU
    mem_fraction: float  # share of it the server uses for weights and cache
    tp: int  # tensor-parallel size of each stage
    context_length: int  # tokens per request

    def __post_init__(self) -> None:
        if not 0 < self.mem_fraction <= 1:
            raise BadInput(f"{param('mem_fraction')} must be in (0, 1], got {self.mem_fraction}")
        for name in ("tp", "context_length"):
            if getattr(self, name) < 1:
                raise BadInput(f"{param(name)} must be at least 1, got {getattr(self, name)}")


def capacity_from(
    partition: object,
    *,
    gpu_memory: int | None,
    context_length: int | None,
    tp: int | None,
    mem_fraction: float | None,
) -> Capacity | None:
    """Capacity mode's settings from its separate options (a command line's flags), or None
    without ``gpu_memory``; each of the others needs it, and it needs ``partition="balanced"``.

    Example:
        >>> capacity_from("balanced", gpu_memory=80 * 10**9, context_length=4096, tp=None, mem_fraction=None)
        Capacity(gpu_bytes=80000000000, mem_fraction=0.9, tp=1, context_length=4096)
    """
    options = (("tp", tp), ("context_length", context_length), ("mem_fraction", mem_fraction))
    given = [name for name, value in options if value is not None]
    if gpu_memory is None:
        if given:
            raise BadInput(f"{param(given[0])} sizes capacity mode: it needs {param('gpu_memory')}")
        return None
    if partition != "balanced":
        raise BadInput(
            f"{param('gpu_memory')} sizes {param('partition', 'balanced')} for serving: add "
            f"{param('partition', 'balanced')}"
        )
    if context_length is None:
        raise BadInput(
            f"{param('gpu_memory')} needs {param('context_length')}, the tokens each request may hold"
        )
    return Capacity(
        gpu_bytes=gpu_memory,
        mem_fraction=DEFAULT_MEM_FRACTION if mem_fraction is None else mem_fraction,
        tp=1 if tp is None else tp,
        context_length=context_length,
    )


@dataclass(frozen=True)
class Serving:
    """Per-GPU memory a stage can use and what one request costs it, for the optimiser."""

    budget_bytes: int  # GPU memory x the server's memory fraction
    tp: int  # the stage's weights are spread over tp GPUs
    context_length: int  # tokens of KV cache per request
    kv_bytes_per_token: int  # per full-attention layer
    linear_state_bytes: int  # per request per linear-attention layer (conv + recurrent)
    draft_layers: int  # full-attention MTP draft layers with KV on the last stage (0: none)


def serving_costs(text_config: dict, runtime: str, capacity: Capacity, *, draft_layers: int) -> Serving:
    """The per-GPU budget and per-request state of a stage, from the model's config."""
    tp = capacity.tp
    kv = 2 * max(1, _int(text_config, "num_key_value_heads") // tp) * _int(text_config, "head_dim")
    return Serving(
        budget_bytes=int(capacity.gpu_bytes * capacity.mem_fraction),
        tp=tp,
        context_length=capacity.context_length,
        kv_bytes_per_token=kv * _CACHE_BYTES,
        linear_state_bytes=linear_state_bytes(text_config, runtime, tp),
        draft_layers=draft_layers,
    )


def linear_state_bytes(text_config: dict, runtime: str, tp: int) -> int:
    """Conv window plus recurrent state of one request in one linear-attention layer."""
    hk, dk = _int(text_config, "linear_num_key_heads"), _int(text_config, "linear_key_head_dim")
    hv, dv = _int(text_config, "linear_num_value_heads"), _int(text_config, "linear_value_head_dim")
    kernel = _int(text_config, "linear_conv_kernel_dim")
    ssm = text_config.get("mamba_ssm_dtype") or runtime_of(runtime).state_dtype
    if not isinstance(ssm, str) or ssm not in _DTYPE_BYTES:  # a list is no name (nor hashable)
        raise BadInput(f"config.json: mamba_ssm_dtype {ssm!r} is not one of {', '.join(_DTYPE_BYTES)}")
    conv = _ceil(2 * hk * dk + hv * dv, tp) * (kernel - 1) * _CACHE_BYTES
    recurrent = _ceil(hv, tp) * dk * dv * _DTYPE_BYTES[ssm]
    return conv + recurrent


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _int(text_config: dict, key: str) -> int:
    value = text_config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise BadInput(
            f"config.json: no positive integer {key} in the text config; capacity mode needs "
            "it to size the KV cache and linear-attention state"
        )
    return value
