"""Which decoder layers each pipeline stage owns, by each server's rules.

Both servers keep global layer numbers and derive the split from num_hidden_layers; they
differ in where the remainder goes. An explicit partition (the servers' *_PP_LAYER_PARTITION
variables) overrides the default, and the launch line always states it.
"""

from __future__ import annotations

from ..errors import ReshardError, param
from . import names

RUNTIMES = ("sglang", "vllm")
PARTITION_ENV = {"sglang": "SGLANG_PP_LAYER_PARTITION", "vllm": "VLLM_PP_LAYER_PARTITION"}


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
        raise ReshardError(f"{param('runtime', runtime)} is not one of {', '.join(RUNTIMES)}")


def check_pp(num_layers: int, pp: int) -> None:
    """Refuse a stage count that leaves a stage without a decoder layer."""
    if pp < 1:
        raise ReshardError(f"{param('pp')} must be at least 1, got {pp}")
    if pp > num_layers:
        raise ReshardError(
            f"{param('pp', pp)} is larger than the model's {num_layers} decoder layers; use at most "
            f"{param('pp', num_layers)}"
        )


def parse_partition(text: str, *, pp: int, num_layers: int) -> list[int]:
    """Parse ``--partition "15,15,15,15"``: ``pp`` positive ints summing to ``num_layers``."""
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError as e:
        raise ReshardError(
            f"{param('partition', text)} must be comma-separated integers, e.g. "
            f"{','.join(map(str, default_partition(num_layers, pp, 'sglang')))}"
        ) from e
    check_partition(sizes, pp=pp, num_layers=num_layers)
    return sizes


def check_partition(sizes: list[int], *, pp: int, num_layers: int) -> None:
    """Refuse a partition that is not ``pp`` positive layer counts summing to ``num_layers``."""
    text = ",".join(map(str, sizes))
    if len(sizes) != pp:
        raise ReshardError(
            f"{param('partition', text)} has {len(sizes)} entries but {param('pp')} is {pp}"
        )
    if any(s < 1 for s in sizes):
        raise ReshardError(f"{param('partition', text)}: every stage needs at least one layer")
    if sum(sizes) != num_layers:
        raise ReshardError(
            f"{param('partition', text)} sums to {sum(sizes)} but the model has {num_layers} decoder layers"
        )


def layer_ranges(partition: list[int]) -> list[tuple[int, int]]:
    """``[start, end)`` global layer ids of each stage."""
    ranges, start = [], 0
    for size in partition:
        ranges.append((start, start + size))
        start += size
    return ranges


def launch_env(runtime: str, partition: list[int]) -> str:
    """The environment assignment that makes the server use exactly this split."""
    return f"{PARTITION_ENV[runtime]}={','.join(map(str, partition))}"


def placement_rules(pp: int, runtime: str, tied: bool, mtp_kept: bool) -> dict[str, tuple[int, ...]]:
    """Ranks that hold each non-layer role, per the runtime's model construction.

    The plan places tensors by it, and the stage checks (loader, verify) derive from it what a
    stage must hold: one rule for both. SGLang's rules are those of SGLang 0.5.23's model code,
    checked by running it (tests/test_sglang_loading.py).
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
