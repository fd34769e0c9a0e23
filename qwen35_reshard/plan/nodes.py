"""Which pipeline stages a node builds: its index and the node count, given or read from a
scheduler's environment, and the node-to-stage mapping the servers use. Pure: the environment
is a mapping passed in.

The mapping is SGLang 0.5.23's (``_calculate_rank_ranges`` in
``sglang/srt/entrypoints/engine.py``): with ``k = max(pp // nnodes, 1)`` stages per node and
``m = max(nnodes // pp, 1)`` nodes per stage, node ``n`` runs the pipeline ranks
``range(k * (n // m), k * (n // m + 1))``. vLLM's multiprocessing executor (``--nnodes
--node-rank``) gives node ``n`` the global ranks from ``local_world_size * n``
(``vllm/v1/executor/multiproc_executor.py``), ordered pipeline-major over tensor-parallel
(``vllm/distributed/parallel_state.py``): the same stages wherever one count divides the other,
the only case this module accepts (elsewhere SGLang leaves stages unassigned and vLLM splits a
stage's tensor-parallel group across the boundary of two stages' nodes).

Where a scheduler tells a node its index (``--rank auto``), these variables are read, first
match first (the precedence); every other match must agree with it, or the node is refused:

=====================  =======================  ==========================================
scheduler              node index               node count
=====================  =======================  ==========================================
LeaderWorkerSet        LWS_WORKER_INDEX         LWS_GROUP_SIZE
Indexed Job            JOB_COMPLETION_INDEX     none: given, else one node per stage (pp)
Kubeflow trainer       PET_NODE_RANK            PET_NNODES
Slurm array task       SLURM_ARRAY_TASK_ID      SLURM_ARRAY_TASK_COUNT
Slurm job step (srun)  SLURM_NODEID             SLURM_NNODES
torchrun               GROUP_RANK               WORLD_SIZE / LOCAL_WORLD_SIZE
launch scripts         NODE_RANK                NNODES, else as for an Indexed Job
=====================  =======================  ==========================================

- In a Slurm array task SLURM_NODEID is 0 in every task (the node within the task's own
  allocation), so there it is not read. In a batch script (no SLURM_STEP_ID) of a job on
  several nodes it is 0 too, on the one node the script runs on: refused, as that is the
  ``srun`` missing from the script.
- torchrun documents GROUP_RANK ("the rank of the node" with one worker group per node),
  WORLD_SIZE and LOCAL_WORLD_SIZE, and only a LOCAL_WORLD_SIZE the same on every node
  (``torch/distributed/run.py``): its node count is WORLD_SIZE / LOCAL_WORLD_SIZE. The
  GROUP_WORLD_SIZE that torch's local elastic agent also sets, undocumented, must agree.
- Kubeflow's PET_NNODES may be an elastic range ("1:4"): refused, stages need a fixed count.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from ..errors import BadInput, ReshardError, param, spell
from ..model.parallelism import Parallelism


@dataclass(frozen=True)
class Node:
    """One node of a multi-node deployment and the pipeline stages it runs.

    Attributes:
        rank: the node's index, 0 to ``nnodes - 1`` (the servers' ``--node-rank``).
        nnodes: how many nodes the deployment has (the servers' ``--nnodes``).
        stages: the pipeline ranks the node runs.
        source: where rank and count came from, e.g. ``LWS_WORKER_INDEX, LWS_GROUP_SIZE``; a
            parameter in it is marked with :func:`errors.param`, spelt by :meth:`describe`.
    """

    rank: int
    nnodes: int
    stages: range
    source: str
    what: str = "stage"  # what ``stages`` numbers: pipeline stages, or a split's node directories
    def to_dict(self, flags: Mapping[str, str] | None = None) -> dict:
        """Plain JSON-ready data: rank, nnodes, stages (a list) and source (spelt as in
        :meth:`describe`)."""
        source = spell(self.source, flags or {})
        return {"rank": self.rank, "nnodes": self.nnodes, "stages": list(self.stages), "source": source}

    def describe(self, flags: Mapping[str, str] | None = None) -> str:
        """E.g. ``rank 2 of 4 from LWS_WORKER_INDEX, LWS_GROUP_SIZE: stage 2``; parameters
        named in ``source`` are spelt as ``flags`` maps them (see :func:`errors.spell`)."""
        stages = list(self.stages)
        which = f"{self.what} {stages[0]}" if len(stages) == 1 else f"stages {', '.join(map(str, stages))}"
        return f"rank {self.rank} of {self.nnodes} from {spell(self.source, flags or {})}: {which}"


@dataclass(frozen=True)
class Nodes:
    """The nodes the servers run on, for building one node's stages: ``node_rank`` of
    ``nnodes`` given, or (with ``ranks="auto"``) read from the scheduler's variables in ``env``
    (default: the process environment), ``nnodes`` then the count they must agree with.

    Example:
        >>> pick_node(None, Nodes(nnodes=2, node_rank=1), pp=4, environ={}).describe()
        'rank 1 of 2 from nnodes, node_rank: stages 2, 3'
    """

    nnodes: int | None = None
    node_rank: int | None = None
    env: Mapping[str, str] | None = field(default=None, repr=False)


def pick_node(
    ranks: Sequence[int] | str | None, nodes: Nodes | None, *, pp: int, environ: Mapping[str, str]
) -> Node | None:
    """The node whose stages a run builds (None: ``ranks``, or all stages), from the
    environment (``ranks="auto"``: ``nodes.env``, else ``environ``) or from ``nodes``.

    Raises:
        ReshardError: ``ranks`` and ``nodes`` that contradict each other, or as
            :func:`node_from_env` and :func:`given_node`.
    """
    nodes = nodes or Nodes()
    nnodes, node_rank = nodes.nnodes, nodes.node_rank
    if ranks == "auto":
        if node_rank is not None:
            raise BadInput(
                f"{param('ranks', 'auto')} reads the node rank from the environment: drop "
                f"{param('node_rank')}"
            )
        return node_from_env(environ if nodes.env is None else nodes.env, pp, nnodes)
    if isinstance(ranks, str):
        raise BadInput(f"{param('ranks', ranks)} must be stage numbers or 'auto'")
    if nnodes is None and node_rank is None:
        return None
    if ranks is not None:
        raise BadInput(
            f"{param('ranks')} picks the stages itself: drop {param('nnodes')} and {param('node_rank')}, "
            f"or {param('ranks')}"
        )
    if nnodes is None or node_rank is None:
        raise BadInput(
            f"{param('nnodes')} and {param('node_rank')} go together: pass both, or {param('ranks', 'auto')}"
        )
    return given_node(pp, nnodes, node_rank)


def pick_dirs(
    ranks: Sequence[int] | str | None, nodes: Nodes | None, layout: Parallelism, *, environ: Mapping[str, str]
) -> tuple[Node | None, list[int] | None]:
    """The node a run builds for (None: none picked) and the directories of the plan it builds
    (None: all): :func:`pick_node`'s stages; under expert parallelism, where every node has a
    directory, the node's own (``node_rank``, or from the scheduler with ``ranks="auto"``: the
    servers' node rank of ``pp * nodes`` nodes), or every node of the stages ``ranks``.

    Raises:
        ReshardError: as :func:`pick_node`, and a node count other than the layout's.
    """
    if not layout.expert_parallel:
        node = pick_node(ranks, nodes, pp=layout.pp, environ=environ)
        return node, list(node.stages) if node is not None else None if ranks is None else list(ranks)
    count, given = layout.nnodes, nodes or Nodes()
    if given.nnodes is not None and given.nnodes != count:
        raise BadInput(
            f"{param('nnodes', given.nnodes)}, but {param('pp', layout.pp)} x "
            f"{param('nodes', layout.nodes)} is {count} nodes: drop {param('nnodes')}"
        )
    if given.node_rank is not None and ranks is None:
        node = given_node(count, count, given.node_rank)
        return replace(node, source=param("node_rank"), what="node"), list(node.stages)
    node = pick_node(ranks, given, pp=count, environ=environ)
    if node is not None and node.nnodes != count:
        raise BadInput(
            f"the scheduler gives {node.nnodes} nodes ({spell(node.source, {})}), but "
            f"{param('pp', layout.pp)} x {param('nodes', layout.nodes)} is {count}: launch as many "
            f"nodes, or fix {param('nodes')}"
        )
    if node is not None or ranks is None:
        return (None, None) if node is None else (replace(node, what="node"), list(node.stages))
    for r in ranks:
        if not 0 <= r < layout.pp:
            raise BadInput(
                f"{param('ranks', r)} is out of range for {param('pp', layout.pp)} (0..{layout.pp - 1})"
            )
    return None, [r * layout.nodes + k for r in sorted(set(ranks)) for k in range(layout.nodes)]


def node_stages(pp: int, nnodes: int, node_rank: int) -> range:
    """The pipeline ranks node ``node_rank`` of ``nnodes`` runs, as SGLang and vLLM assign them.

    Args:
        pp: pipeline stages.
        nnodes: nodes of the deployment; ``pp`` must be a multiple of it or it of ``pp``.
        node_rank: the node, 0 to ``nnodes - 1``.

    Returns:
        The node's stages: several when ``nnodes < pp``, one shared with other nodes (a
        tensor-parallel group across nodes) when ``nnodes > pp``.

    Raises:
        ReshardError: counts below 1, counts that do not divide, a node rank out of range.
    """
    if pp < 1:
        raise BadInput(f"{param('pp')} must be at least 1, got {pp}")
    if nnodes < 1:
        raise BadInput(f"{param('nnodes')} must be at least 1, got {nnodes}")
    if pp % nnodes and nnodes % pp:
        raise BadInput(
            f"{param('nnodes', nnodes)} and {param('pp', pp)} do not divide: the servers give every "
            "node the same number of stages, so one must be a multiple of the other"
        )
    if not 0 <= node_rank < nnodes:
        raise BadInput(
            f"{param('node_rank', node_rank)} is not a node of {param('nnodes', nnodes)}: "
            f"use 0 to {nnodes - 1}"
        )
    per_node, per_stage = max(pp // nnodes, 1), max(nnodes // pp, 1)
    first = per_node * (node_rank // per_stage)
    return range(first, first + per_node)


def given_node(pp: int, nnodes: int, node_rank: int) -> Node:
    """Node ``node_rank`` of ``nnodes``, as passed by the caller (``source`` names the parameters).

    Raises:
        ReshardError: as :func:`node_stages`.
    """
    stages = node_stages(pp, nnodes, node_rank)
    return Node(node_rank, nnodes, stages, f"{param('nnodes')}, {param('node_rank')}")


@dataclass(frozen=True)
class _Reading:
    """One scheduler's answer: the node index, the count (None: none given) and the variables."""

    rank: int
    nnodes: int | None
    used: tuple[str, ...]


def node_from_env(env: Mapping[str, str], pp: int, nnodes: int | None = None) -> Node:
    """This node, from the scheduler variables in ``env`` (see the module's table).

    Args:
        env: the process environment (``os.environ``) or any mapping of its variables.
        pp: pipeline stages; also the node count where the environment gives none.
        nnodes: the node count, if the caller knows it; must match the environment's.

    Returns:
        The node, its stages and the variables it was read from.

    Raises:
        ReshardError: no scheduler variable set, one that is no number, two that disagree,
            a count that disagrees with ``nnodes`` or does not divide ``pp``.
    """
    readings = [r for r in (_read(env, *source) for source in _SOURCES) if r is not None]
    if not readings:
        raise BadInput(
            f"{param('ranks', 'auto')} found no node index in the environment (none of "
            f"{', '.join(s[0] for s in _SOURCES)} is set): run it under the scheduler, or pass "
            f"{param('nnodes')} and {param('node_rank')}"
        )
    first = readings[0]
    counted = next((r for r in readings if r.nnodes is not None), None)
    for other in readings[1:]:
        if other.rank != first.rank:
            raise _disagree(env, first, other)
    for other in readings:
        if counted is not None and other.nnodes not in (None, counted.nnodes):
            raise _disagree(env, counted, other)
    used = tuple(name for r in readings for name in r.used)
    if counted is None:
        count = pp if nnodes is None else nnodes
        used += (param("nnodes") if nnodes is not None else f"one node per stage of {param('pp')}",)
    else:
        count = counted.nnodes
        if nnodes is not None and nnodes != count:
            raise BadInput(
                f"{param('nnodes', nnodes)} but {_shown(env, counted)}: drop {param('nnodes')} or fix it"
            )
    if first.rank >= count:
        raise BadInput(
            f"{_shown(env, first)}: node index {first.rank} is not below the node count {count} "
            f"({used[-1]}); number the nodes from 0"
        )
    return Node(first.rank, count, node_stages(pp, count, first.rank), ", ".join(used))


def _disagree(env: Mapping[str, str], one: _Reading, other: _Reading) -> ReshardError:
    return BadInput(
        f"{_shown(env, one)} and {_shown(env, other)} disagree about this node: unset the variables "
        f"that do not apply, or pass {param('nnodes')} and {param('node_rank')}"
    )


def _shown(env: Mapping[str, str], reading: _Reading) -> str:
    return " ".join(f"{name}={env[name]}" for name in reading.used if name in env)


def _read(env: Mapping[str, str], index_var: str, count_var: str | None) -> _Reading | None:
    """One row of the table, or None where its index variable is unset or does not apply."""
    if index_var not in env:
        return None
    if index_var == "SLURM_NODEID":
        if "SLURM_ARRAY_TASK_ID" in env:
            return None  # 0 in every array task: the array index is this node's
        if "SLURM_STEP_ID" not in env and _number(env, "SLURM_NNODES", 1) > 1:
            raise BadInput(
                f"SLURM_NODEID is 0 in the batch script of a job on {env['SLURM_NNODES']} nodes: run "
                f"{param('ranks', 'auto')} in a job step, one task per node (srun --ntasks-per-node=1)"
            )
    rank = _number(env, index_var, 0)
    if count_var == "WORLD_SIZE":
        return _torchrun(env, rank)
    if count_var is None or count_var not in env:
        return _Reading(rank, None, (index_var,))
    if count_var == "PET_NNODES" and ":" in env[count_var]:
        raise BadInput(
            f"PET_NNODES={env[count_var]} is an elastic range: stages need a fixed node count, so "
            f"pass {param('nnodes')} and {param('node_rank')}"
        )
    return _Reading(rank, _number(env, count_var, 1), (index_var, count_var))


def _torchrun(env: Mapping[str, str], rank: int) -> _Reading:
    """GROUP_RANK with the node count WORLD_SIZE / LOCAL_WORLD_SIZE (module docstring)."""
    used = ("GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
    if any(name not in env for name in used[1:]):
        return _Reading(rank, None, used[:1])
    world, local = _number(env, "WORLD_SIZE", 1), _number(env, "LOCAL_WORLD_SIZE", 1)
    if world % local:
        raise BadInput(
            f"WORLD_SIZE={world} is no multiple of LOCAL_WORLD_SIZE={local}: torchrun's node count "
            f"is their ratio; pass {param('nnodes')} and {param('node_rank')}"
        )
    if "GROUP_WORLD_SIZE" in env and _number(env, "GROUP_WORLD_SIZE", 1) != world // local:
        raise BadInput(
            f"GROUP_WORLD_SIZE={env['GROUP_WORLD_SIZE']} disagrees with WORLD_SIZE={world} / "
            f"LOCAL_WORLD_SIZE={local}: pass {param('nnodes')} and {param('node_rank')}"
        )
    return _Reading(rank, world // local, used)


def _number(env: Mapping[str, str], name: str, least: int) -> int:
    """``env[name]`` as an integer of at least ``least`` (default ``least`` where unset)."""
    text = env.get(name)
    if text is None:
        return least
    if not (text.isascii() and text.isdigit()) or int(text) < least:
        what = "a node index (0, 1, ...)" if least == 0 else "a node count (1, 2, ...)"
        raise BadInput(f"{name}={text!r} is not {what}: fix the variable or unset it")
    return int(text)


# (node index, node count) variables, highest precedence first: the module docstring's table.
# torchrun's count is a ratio (_torchrun), named here by its first variable.
_SOURCES: tuple[tuple[str, str | None], ...] = (
    ("LWS_WORKER_INDEX", "LWS_GROUP_SIZE"),
    ("JOB_COMPLETION_INDEX", None),
    ("PET_NODE_RANK", "PET_NNODES"),
    ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT"),
    ("SLURM_NODEID", "SLURM_NNODES"),
    ("GROUP_RANK", "WORLD_SIZE"),
    ("NODE_RANK", "NNODES"),
)
