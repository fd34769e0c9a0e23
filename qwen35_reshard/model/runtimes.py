"""Which decoder layers each pipeline stage owns, by each server's rules.

Both servers keep global layer numbers and derive the split from num_hidden_layers; they
differ in where the remainder goes. An explicit partition (the servers' *_PP_LAYER_PARTITION
variables) overrides the default, and the launch line always states it.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import BadInput, param
from ..units import plural
from . import names

RUNTIMES = ("sglang", "vllm")
PARTITION_ENV = {"sglang": "SGLANG_PP_LAYER_PARTITION", "vllm": "VLLM_PP_LAYER_PARTITION"}
FULL_ATTENTION = "full_attention"


def default_partition(num_layers: int, pp: int, runtime: str) -> list[int]:
    """Layers per stage as ``runtime`` splits ``num_layers`` over ``pp`` stages by default.

    SGLang gives the remainder to the last ranks; vLLM to the second-to-last, third-to-last,
    ... ranks, so its last rank (which also holds norm and lm_head) never gets an extra one.
    """
    check_pp(num_layers, pp)
    check_runtime(runtime)
    base, rem = divmod(num_layers, pp)
    sizes = [base] * pp
    extra = range(pp - rem, pp) if runtime == "sglang" else range(pp - 1 - rem, pp - 1)
    for i in extra:
        sizes[i] += 1
    return sizes


def check_runtime(runtime: str) -> None:
    """Refuse a runtime whose split and placement rules the tool does not know."""
    if runtime not in RUNTIMES:
        raise BadInput(f"{param('runtime', runtime)} is not one of {', '.join(RUNTIMES)}")


def check_pp(num_layers: int, pp: int) -> None:
    """Refuse a stage count that leaves a stage without a decoder layer."""
    if pp < 1:
        raise BadInput(f"{param('pp')} must be at least 1, got {pp}")
    if pp > num_layers:
        raise BadInput(
            f"{param('pp', pp)} is larger than the model's {num_layers} decoder layers; use at most "
            f"{param('pp', num_layers)}"
        )


def parse_partition(text: str, *, pp: int, num_layers: int) -> list[int]:
    """Parse ``--partition "15,15,15,15"``: ``pp`` positive ints summing to ``num_layers``."""
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError as e:
        raise BadInput(
            f"{param('partition', text)} must be comma-separated integers, e.g. "
            f"{','.join(map(str, default_partition(num_layers, pp, 'sglang')))}"
        ) from e
    check_partition(sizes, pp=pp, num_layers=num_layers)
    return sizes


def check_partition(sizes: list[int], *, pp: int, num_layers: int) -> None:
    """Refuse a partition that is not ``pp`` positive layer counts summing to ``num_layers``."""
    text = ",".join(map(str, sizes))
    if len(sizes) != pp:
        raise BadInput(
            f"{param('partition', text)} has {plural(len(sizes), 'entry', 'entries')} but "
            f"{param('pp')} is {pp}"
        )
    if any(s < 1 for s in sizes):
        raise BadInput(f"{param('partition', text)}: every stage needs at least one layer")
    if sum(sizes) != num_layers:
        raise BadInput(
            f"{param('partition', text)} sums to {sum(sizes)} but the model has {num_layers} decoder layers"
        )


def layer_ranges(partition: list[int]) -> list[tuple[int, int]]:
    """``[start, end)`` global layer ids of each stage."""
    ranges, start = [], 0
    for size in partition:
        ranges.append((start, start + size))
        start += size
    return ranges


def servable(runtime: str, layer_types: Sequence[str], partition: Sequence[int]) -> str | None:
    """Why ``runtime`` cannot serve this split of a model with these layer types, or None.

    vLLM cannot run a pipeline stage with only linear-attention layers: measured on its CPU
    build (0.32.0), the engine fails to start because such a rank reports other KV-cache layouts
    than the ranks with full attention; on GPUs, vLLM issue #54710 reports the same failure (and
    #51752 a related one). SGLang 0.5.23's source sizes such a stage's KV cache from the other
    stages' (its pool configurator's ``has_kv_on_another_pp_stage``), so no rule applies to it
    here; that is read, not run (its engine does not start on the machines this was checked on).
    ``balance`` asks it about one stage at a time (``layer_types`` of that stage only).
    """
    if runtime != "vllm":
        return None
    for rank, (start, end) in enumerate(layer_ranges(list(partition))):
        if FULL_ATTENTION not in layer_types[start:end]:
            layers = f"layer {start}" if end - start == 1 else f"layers {start}-{end - 1}"
            return (
                f"stage {rank} ({layers}) has only linear-attention layers, and vLLM needs a "
                "full-attention layer in every pipeline stage (measured on vLLM 0.32.0's CPU build: "
                'the engine fails to start with "Workers disagree on supported KV cache layouts"; '
                "vLLM issue #54710 reports the same on GPUs)"
            )
    return None


def check_servable(
    runtime: str, layer_types: Sequence[str], partition: Sequence[int], *, default: bool
) -> None:
    """Refuse a split ``runtime`` cannot serve, and say what to use instead.

    ``default``: ``partition`` is the runtime's own split (no partition was given).
    """
    problem = servable(runtime, layer_types, partition)
    if problem is None:
        return
    pp, sizes = len(partition), ",".join(map(str, partition))
    split = (
        f"its default split for {param('pp', pp)} (partition {sizes})"
        if default
        else f"{param('partition', sizes)}"
    )
    # The only rule is vLLM's one full-attention layer per stage, so they bound the stage count.
    full = list(layer_types).count(FULL_ATTENTION)
    if full >= pp:
        remedy = (
            f"give every stage one ({param('partition', 'balanced')} picks the lightest such split) "
            "or use fewer stages"
        )
    elif full:
        layers = f"{full} full-attention layer{'s' * (full != 1)}"
        remedy = f"the model has {layers}: use at most {param('pp', full)}"
    else:
        remedy = "the model has no full-attention layer, so no split of it can be served"
    raise BadInput(f"{param('runtime', runtime)} cannot serve {split}: {problem}; {remedy}")


def launch_env(runtime: str, partition: list[int]) -> str:
    """The environment assignment that makes the server use exactly this split."""
    return f"{PARTITION_ENV[runtime]}={','.join(map(str, partition))}"


def placement_rules(pp: int, runtime: str, tied: bool, mtp_kept: bool) -> dict[str, tuple[int, ...]]:
    """Ranks that hold each non-layer role, per the runtime's model construction.

    The plan places tensors by it, and the stage checks (loader, verify) derive from it what a
    stage must hold: one rule for both. SGLang's rules are those of SGLang 0.5.23's model code,
    checked by running it (tests/engine/test_sglang_loading.py).
    """
    first, last, every = (0,), (pp - 1,), tuple(range(pp))
    if runtime == "vllm":
        embed, pos_embed = every, every
    else:
        # SGLang builds embed_tokens on the last rank too when lm_head is tied to it (the
        # multimodal class copies it into lm_head there) or the MTP draft (which keeps its own
        # embedding copy there) is loaded; the vision tower on every rank, its pos_embed on the
        # first only.
        embed = tuple(sorted({0, pp - 1})) if tied or mtp_kept else first
        pos_embed = first
    return {
        names.EMBED: embed,
        names.VISUAL: every,
        names.VISUAL_POS_EMBED: pos_embed,
        names.NORM: last,
        names.LM_HEAD: last,
        names.MTP: last,
    }
