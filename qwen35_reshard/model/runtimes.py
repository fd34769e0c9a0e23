"""The servers the tool splits for, one :class:`Runtime` record each, and which decoder layers
each pipeline stage owns by their rules.

Both servers keep global layer numbers and derive the split from num_hidden_layers; they
differ in where the remainder goes. An explicit partition (the servers' *_PP_LAYER_PARTITION
variables) overrides the default, and the launch line always states it. Adding a server is
adding its record here.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import BadInput, param
from ..units import plural
from . import names

FULL_ATTENTION = "full_attention"


@dataclass(frozen=True)
class Runtime:
    """What the tool knows of one server.

    Attributes:
        name: as ``runtime=`` and ``--runtime`` spell it.
        partition_env: the variable that sets the layers of each stage.
        pp_flag: the launch flag of the pipeline size.
        remainder_last: the default split gives the layers left over to the last ranks
            (SGLang); else to the ranks before the last (vLLM), whose last rank also holds norm
            and lm_head.
        state_dtype: the dtype of linear attention's recurrent state when the config's
            ``mamba_ssm_dtype`` names none (SGLang float32, vLLM the model's bfloat16).
        embed_on_every_rank: ``embed_tokens`` and the vision tower's ``pos_embed`` built on every
            rank (vLLM); else on the first (and the last, for a tied lm_head or MTP: SGLang).
        full_attention_per_stage: every stage needs a full-attention layer for the engine to
            start (vLLM: see :func:`servable`).
        serve: ``(env, pp, model)``: the command that serves every stage of ``model`` (a split's
            OUT, or the unsplit model) on one machine, through the installed plugin.
        node_serve: ``(env, pp, out, rank, nnodes, stage)``: the command node ``rank`` (a
            number, or ``$R`` for any node but the head, 0) of ``nnodes`` runs to serve the
            split ``out`` with the others; ``stage``: the node's one stage (a number or ``$R``),
            None when it runs several.
        head_apart: the head node's ``node_serve`` differs from the other nodes' (vLLM's
            serves the API; the others run its workers, ``--headless``).

    docs/deploy.md states each launch command once; tests/e2e/test_launch_lines.py holds the
    commands printed after a split to it.
    """

    name: str
    partition_env: str
    pp_flag: str
    remainder_last: bool
    state_dtype: str
    embed_on_every_rank: bool
    full_attention_per_stage: bool
    serve: Callable[[str, int, str], str]
    node_serve: Callable[[str, int, str, str, int, str | None], str]
    head_apart: bool


def _stage_path(out: str, rank: str) -> str:
    """``OUT/pp{rank}`` as one shell word; ``rank`` a number or ``$R`` (left outside the quotes)."""
    return shlex.quote(f"{out}/pp{rank}") if rank.isdigit() else f"{shlex.quote(f'{out}/pp')}{rank}"


def _sglang_serve(env: str, pp: int, model: str) -> str:
    return f"{env} python -m sglang.launch_server --model-path {shlex.quote(model)} --pp-size {pp}"


def _sglang_node_serve(env: str, pp: int, out: str, rank: str, nnodes: int, stage: str | None) -> str:
    # One stage on the node: the stock loader on its stage directory. Several: OUT itself, where
    # the plugin gives each pipeline rank its stage.
    model = shlex.quote(out) if stage is None else _stage_path(out, stage)
    return (
        f"{env} python -m sglang.launch_server --model-path {model} --pp-size {pp} "
        f"--nnodes {nnodes} --node-rank {rank} --dist-init-addr HEAD_IP:PORT"
    )


def _vllm_serve(env: str, pp: int, model: str) -> str:
    return f"{env} vllm serve {shlex.quote(model)} --load-format qwen35-stages --pipeline-parallel-size {pp}"


def _vllm_node_serve(env: str, pp: int, out: str, rank: str, nnodes: int, stage: str | None) -> str:
    # vLLM's multiprocessing executor across nodes: node 0 serves, the others run headless;
    # qwen35-stages opens OUT/pp{rank} for each of the node's pipeline ranks.
    headless = "" if rank == "0" else " --headless"
    return (
        f"{_vllm_serve(env, pp, out)} --distributed-executor-backend mp --nnodes {nnodes} "
        f"--node-rank {rank} --master-addr HEAD_IP{headless}"
    )


SGLANG = Runtime(
    name="sglang",
    partition_env="SGLANG_PP_LAYER_PARTITION",
    pp_flag="--pp-size",
    remainder_last=True,
    state_dtype="float32",
    embed_on_every_rank=False,
    full_attention_per_stage=False,
    serve=_sglang_serve,
    node_serve=_sglang_node_serve,
    head_apart=False,
)
VLLM = Runtime(
    name="vllm",
    partition_env="VLLM_PP_LAYER_PARTITION",
    pp_flag="--pipeline-parallel-size",
    remainder_last=False,
    state_dtype="bfloat16",
    embed_on_every_rank=True,
    full_attention_per_stage=True,
    serve=_vllm_serve,
    node_serve=_vllm_node_serve,
    head_apart=True,
)
_BY_NAME = {r.name: r for r in (SGLANG, VLLM)}
RUNTIMES = tuple(_BY_NAME)


def runtime_of(name: str) -> Runtime:
    """The record of the server ``name``; refuses one the tool does not know."""
    check_runtime(name)
    return _BY_NAME[name]


def default_partition(num_layers: int, pp: int, runtime: str) -> list[int]:
    """Layers per stage as ``runtime`` splits ``num_layers`` over ``pp`` stages by default.

    SGLang gives the remainder to the last ranks; vLLM to the second-to-last, third-to-last,
    ... ranks, so its last rank (which also holds norm and lm_head) never gets an extra one.
    """
    check_pp(num_layers, pp)
    check_runtime(runtime)
    base, rem = divmod(num_layers, pp)
    sizes = [base] * pp
    extra = range(pp - rem, pp) if runtime_of(runtime).remainder_last else range(pp - 1 - rem, pp - 1)
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


def parse_partition(text: str, *, pp: int, num_layers: int | None = None) -> list[int]:
    """Parse ``--partition "15,15,15,15"``: ``pp`` positive ints (summing to ``num_layers``, given)."""
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError as e:
        example = default_partition(num_layers, pp, "sglang") if num_layers else [10] * pp
        raise BadInput(
            f"{param('partition', text)} must be comma-separated integers, e.g. {','.join(map(str, example))}"
        ) from e
    check_partition(sizes, pp=pp, num_layers=num_layers)
    return sizes


def check_partition(sizes: list[int], *, pp: int, num_layers: int | None = None) -> None:
    """Refuse a partition that is not ``pp`` positive layer counts (summing to ``num_layers``,
    where the model is known)."""
    text = ",".join(map(str, sizes))
    if len(sizes) != pp:
        raise BadInput(
            f"{param('partition', text)} has {plural(len(sizes), 'entry', 'entries')} but "
            f"{param('pp')} is {pp}"
        )
    if any(s < 1 for s in sizes):
        raise BadInput(f"{param('partition', text)}: every stage needs at least one layer")
    if num_layers is not None and sum(sizes) != num_layers:
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
    if not runtime_of(runtime).full_attention_per_stage:
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
    return f"{runtime_of(runtime).partition_env}={','.join(map(str, partition))}"


def placement_rules(pp: int, runtime: str, tied: bool, mtp_kept: bool) -> dict[str, tuple[int, ...]]:
    """Ranks that hold each non-layer role, per the runtime's model construction.

    The plan places tensors by it, and the stage checks (loader, verify) derive from it what a
    stage must hold: one rule for both. SGLang's rules are those of SGLang 0.5.23's model code,
    checked by running it (tests/engine/test_sglang_loading.py).
    """
    first, last, every = (0,), (pp - 1,), tuple(range(pp))
    if runtime_of(runtime).embed_on_every_rank:
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
