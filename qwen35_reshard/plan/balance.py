"""``--partition balanced``: the layer split whose fullest stage needs the least memory. Pure.

Both servers size every rank's cache to the smallest over the ranks, so the fullest stage
decides what fits. The inputs are what the checkpoint's headers say, placed by the plan's own
rules: the bytes of every decoder layer, and the bytes each stage holds whatever its layers
are (embed_tokens, norm, lm_head, mtp.*, the vision tower, where the runtime puts them).

The optimum is exact: a dynamic programme over contiguous splits (stage r takes layers
[i, j)), O(pp * L^2) stage evaluations per objective. Objectives apply in order, each one
restricting the next:

1. capacity mode only: the most requests the worst stage can hold;
2. the fewest bytes on the fullest stage;
3. among exact ties: the evenest layer counts (smallest sum of squares), then the runtime's
   default split when it is one of them, then the evenest stage bytes (sum of squares).

A stage the runtime cannot serve (``allowed``) is never part of the answer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate, groupby
from operator import itemgetter

from ..bulk import field_getters
from ..errors import BadInput
from ..format.names import MTP_ABSENT, MTP_DROPPED, MTP_KEPT
from ..model import names
from ..model.runtimes import (
    FULL_ATTENTION,
    check_pp,
    check_runtime,
    default_partition,
    placement_rules,
    servable,
)
from ..model.schema import layer_types, mtp_layers, text_config
from ..source.checkpoint import Checkpoint, SourceTensor
from .capacity import Capacity, Serving, serving_costs
from .planner import check_roles

(_NBYTES,) = field_getters(SourceTensor, "nbytes")
_FIRST, _SECOND = itemgetter(0), itemgetter(1)
# A function of one stage: (rank, first layer, end layer exclusive).
StageFn = Callable[[int, int, int], int]
StageTest = Callable[[int, int, int], bool]


@dataclass(frozen=True)
class Costs:
    """Bytes of everything a split distributes, as placed for one runtime and stage count."""

    layer_bytes: tuple[int, ...]  # decoder layer i
    full_attention: tuple[bool, ...]  # layer i is full attention (else linear attention)
    fixed: tuple[Mapping[str, int], ...]  # stage r: bytes of each non-layer part it holds


@dataclass(frozen=True)
class StageLoad:
    """What one stage of a split holds, and in capacity mode how many requests fit."""

    rank: int
    start: int
    end: int  # exclusive
    full_layers: int
    linear_layers: int
    layer_bytes: int
    parts: Mapping[str, int]  # non-layer bytes by part
    free_bytes: int | None = None  # per GPU after the weights (capacity mode)
    requests: int | None = None  # requests at full context that fit (capacity mode)

    @property
    def total_bytes(self) -> int:
        return self.layer_bytes + sum(self.parts.values())


class _Stages:
    """Any stage's bytes and capacity in O(1), from prefix sums over the layers."""

    def __init__(self, costs: Costs, serving: Serving | None) -> None:
        self.costs = costs
        self.serving = serving
        self.pp = len(costs.fixed)
        self.num_layers = len(costs.layer_bytes)
        self._bytes = [0, *accumulate(costs.layer_bytes)]
        self._full = [0, *accumulate(int(f) for f in costs.full_attention)]
        self._fixed = [sum(parts.values()) for parts in costs.fixed]

    def total(self, r: int, i: int, j: int) -> int:
        return self._bytes[j] - self._bytes[i] + self._fixed[r]

    def requests(self, r: int, i: int, j: int) -> int:
        return self._capacity(r, i, j)[1]

    def load(self, r: int, i: int, j: int) -> StageLoad:
        full = self._full[j] - self._full[i]
        free, requests = self._capacity(r, i, j) if self.serving is not None else (None, None)
        return StageLoad(
            r, i, j, full, j - i - full, self._bytes[j] - self._bytes[i], self.costs.fixed[r], free, requests
        )

    def _capacity(self, r: int, i: int, j: int) -> tuple[int, int]:
        """Free bytes per GPU after the weights, and the requests that fit in them."""
        s = self.serving
        full = self._full[j] - self._full[i]
        draft = s.draft_layers if r == self.pp - 1 else 0
        free = s.budget_bytes - -(-self.total(r, i, j) // s.tp)
        per_request = s.context_length * s.kv_bytes_per_token * (full + draft) + (
            (j - i - full) * s.linear_state_bytes
        )
        return free, max(0, free // per_request)


def evaluate(costs: Costs, partition: Sequence[int], serving: Serving | None = None) -> list[StageLoad]:
    """Every stage's load under ``partition`` (layers per stage)."""
    stages = _Stages(costs, serving)
    bounds = [0, *accumulate(partition)]
    return [stages.load(r, bounds[r], bounds[r + 1]) for r in range(len(partition))]


def balance(
    costs: Costs,
    *,
    default: Sequence[int],
    allowed: Callable[[int, int], bool] = lambda start, end: True,
    serving: Serving | None = None,
) -> list[int] | None:
    """The best split (layers per stage) by the objectives above; None if none is allowed.

    ``allowed(start, end)``: whether the runtime can serve a stage holding layers
    [start, end). ``default``: the runtime's own split, preferred among exact ties.
    ``serving``: capacity mode, the split first maximises the requests of the worst stage.
    """
    stages = _Stages(costs, serving)
    n, pp = stages.num_layers, stages.pp
    keys: list[StageFn] = [stages.total]
    if serving is not None:
        keys.insert(0, lambda r, i, j: -stages.requests(r, i, j))
    ok: StageTest = lambda r, i, j: allowed(i, j)
    for key in keys:
        best = _min_max(n, pp, key, ok)
        if best is None:
            return None
        ok = _at_most(ok, key, best)
    bounds = [0, *accumulate(default)]
    if len(default) == pp and bounds[-1] == n and all(ok(r, bounds[r], bounds[r + 1]) for r in range(pp)):
        return list(default)
    return _min_sum(n, pp, lambda r, i, j: ((j - i) ** 2, stages.total(r, i, j) ** 2), ok)


def _at_most(ok: StageTest, key: StageFn, best: int) -> StageTest:
    return lambda r, i, j: ok(r, i, j) and key(r, i, j) <= best


def _min_max(n: int, pp: int, key: StageFn, ok: StageTest) -> int | None:
    """Smallest possible max over stages of ``key``, over splits whose every stage is ``ok``."""
    prev: list[int | None] = [None] * (n + 1)  # prev[j]: best for layers [0, j), stages so far
    for r in range(pp):
        cur: list[int | None] = [None] * (n + 1)
        for j in range(r + 1, n - (pp - r - 1) + 1):
            for i in range(r, j) if r else (0,):
                if (r and prev[i] is None) or not ok(r, i, j):
                    continue
                v = key(r, i, j) if r == 0 else max(prev[i], key(r, i, j))
                if cur[j] is None or v < cur[j]:
                    cur[j] = v
        prev = cur
    return prev[n]


def _min_sum(
    n: int, pp: int, cost: Callable[[int, int, int], tuple[int, ...]], ok: StageTest
) -> list[int] | None:
    """The split whose stages' ``cost`` tuples sum to the least (lexicographically)."""
    prev: list[tuple[int, ...] | None] = [None] * (n + 1)
    back: list[list[int]] = []
    for r in range(pp):
        cur: list[tuple[int, ...] | None] = [None] * (n + 1)
        came_from = [0] * (n + 1)
        for j in range(r + 1, n - (pp - r - 1) + 1):
            for i in range(r, j) if r else (0,):
                if (r and prev[i] is None) or not ok(r, i, j):
                    continue
                c = cost(r, i, j)
                v = c if r == 0 else tuple(a + b for a, b in zip(prev[i], c, strict=True))
                if cur[j] is None or v < cur[j]:
                    cur[j], came_from[j] = v, i
        back.append(came_from)
        prev = cur
    if prev[n] is None:
        return None
    bounds = [n]
    for r in range(pp - 1, -1, -1):
        bounds.append(back[r][bounds[-1]])
    bounds.reverse()
    return [b - a for a, b in zip(bounds, bounds[1:], strict=False)]


# --------------------------------------------------------------------------- from a checkpoint


@dataclass(frozen=True)
class Choice:
    """The balanced split, and the runtime's default split beside it."""

    partition: tuple[int, ...]
    stages: tuple[StageLoad, ...]
    default: tuple[int, ...]
    default_stages: tuple[StageLoad, ...]
    default_problem: str | None  # why the runtime cannot serve its own default split, if so
    serving: Serving | None
    costs: Costs  # what the choice was made from

    @property
    def default_optimal(self) -> bool:
        """The default split is as good as any (it is then the one chosen)."""
        return self.partition == self.default

    def to_dict(self) -> dict:
        """Plain JSON-ready data: both splits, stage by stage, bytes in bytes."""
        return {
            "partition": list(self.partition),
            "default": list(self.default),
            "default_optimal": self.default_optimal,
            "default_problem": self.default_problem,
            "capacity": None if self.serving is None else dataclasses.asdict(self.serving),
            "stages": [_load_dict(s) for s in self.stages],
            "default_stages": [_load_dict(s) for s in self.default_stages],
        }


def _load_dict(load: StageLoad) -> dict:
    return {**dataclasses.asdict(load), "parts": dict(load.parts), "total_bytes": load.total_bytes}


def choose(
    ckpt: Checkpoint, *, pp: int, runtime: str, keep_mtp: bool = True, capacity: Capacity | None = None
) -> Choice:
    """The balanced split of ``ckpt`` over ``pp`` stages for ``runtime``.

    Stage bytes come from the headers, placed by the plan's own rules (``assign``); with
    ``capacity`` the split first maximises the requests the worst stage holds.

    Args:
        ckpt: the checkpoint, from :func:`read_checkpoint`.
        pp: number of pipeline stages.
        runtime: ``"sglang"`` or ``"vllm"``.
        keep_mtp: whether the ``mtp.*`` tensors (on the last stage) count.
        capacity: size the split for serving on these GPUs (KV cache, linear-attention state).

    Returns:
        The :class:`Choice`: the balanced ``partition`` (pass it to :func:`make_plan`) and the
        runtime's ``default`` split, each with its stages' loads.

    Raises:
        ReshardError: ``pp`` or ``runtime`` is invalid, the config lacks what ``capacity``
            needs, or no split over ``pp`` stages is one the runtime can serve.

    Example:
        >>> from qwen35_reshard import choose, read_checkpoint
        >>> choice = choose(read_checkpoint(MODEL), pp=3, runtime="sglang")
        >>> choice.partition, choice.default
        ((3, 3, 2), (2, 3, 3))
    """
    check_pp(ckpt.num_layers, pp)
    check_runtime(runtime)
    default = default_partition(ckpt.num_layers, pp, runtime)
    costs, mtp = stage_costs(ckpt, pp=pp, runtime=runtime, keep_mtp=keep_mtp)
    types = layer_types(ckpt.config)
    serving = None
    if capacity is not None:
        text = text_config(ckpt.config)
        draft = mtp_layers(ckpt.config) if mtp == MTP_KEPT else 0
        serving = serving_costs(text, runtime, capacity, draft_layers=draft)
    partition = balance(
        costs,
        default=default,
        allowed=lambda start, end: servable(runtime, types[start:end], [end - start]) is None,
        serving=serving,
    )
    problem = servable(runtime, types, default)
    if partition is None:
        raise BadInput(
            f"no split of the {ckpt.num_layers} decoder layers into {pp} stages can be served by "
            f"{runtime}: in its default split {','.join(map(str, default))}, {problem}; use fewer stages"
        )
    return Choice(
        tuple(partition),
        tuple(evaluate(costs, partition, serving)),
        tuple(default),
        tuple(evaluate(costs, default, serving)),
        problem,
        serving,
        costs,
    )


def stage_costs(ckpt: Checkpoint, *, pp: int, runtime: str, keep_mtp: bool) -> tuple[Costs, str]:
    """Per-layer bytes, each stage's non-layer bytes by the runtime's placement rules (the ones
    the plan places by), and the MTP state (kept, dropped or absent).

    A decoder layer's tensors all go to the stage that owns the layer; where every other
    tensor goes depends on the stage count, never on the layer counts.
    """
    # The plan's own checks first: one per-layer list below is num_hidden_layers long.
    tensor_names = list(ckpt.tensors)
    keys, key_roles = names.classify_all(tensor_names)
    check_roles(tensor_names, keys, key_roles, ckpt.num_layers)
    has_mtp = any(r.kind == names.MTP for r in key_roles.values())
    mtp = MTP_ABSENT if not has_mtp else MTP_KEPT if keep_mtp else MTP_DROPPED
    place = placement_rules(pp, runtime, ckpt.tied_embeddings, mtp == MTP_KEPT)
    layer_bytes = [0] * ckpt.num_layers
    fixed: list[dict[str, int]] = [{} for _ in range(pp)]
    for key, nbytes in _bytes_per_key(keys, ckpt.tensors.values()).items():
        role = key_roles[key]
        if role.kind == names.LAYER:
            layer_bytes[role.layer] += nbytes
        elif not (role.kind == names.MTP and mtp == MTP_DROPPED):
            for r in place[role.kind]:
                fixed[r][role.kind] = fixed[r].get(role.kind, 0) + nbytes
    full = tuple(t == FULL_ATTENTION for t in layer_types(ckpt.config))
    return Costs(tuple(layer_bytes), full, tuple(fixed)), mtp


def _bytes_per_key(keys: list[str], sources: Iterable[SourceTensor]) -> dict[str, int]:
    """The bytes of each role key's tensors (``keys``: each source's), keys in source order.

    Why by runs: a key's tensors are mostly adjacent in source order (a layer's fill a shard or
    two), so each run of one key is summed in C and Python steps once per run (a few hundred),
    not once per tensor (~190,000 for a 397B FP8 checkpoint).
    """
    totals: dict[str, int] = {}
    for key, run in groupby(zip(keys, map(_NBYTES, sources), strict=True), key=_FIRST):
        totals[key] = totals.get(key, 0) + sum(map(_SECOND, run))
    return totals
