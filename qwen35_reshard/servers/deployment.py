"""What every rank of one deployment agrees on before any of them loads, and the one choice both
servers make: a split's stage, or the rank's stage of the unsplit model.

    stage = rank_stage(model, runtime="vllm", group=get_world_group(), pp_rank=pp.rank_in_group,
                       pp_size=pp.world_size, layers=36, pp_indices=get_pp_indices,
                       revision=None, token=None, log=log.info)

Each node reads its own environment and, started minutes apart from the others, its own view of
the Hub: its partition variable and the commit a branch points to may differ from another
node's. So before anything is read, every rank's view is exchanged over the deployment's process
group (the server's world group: every pipeline and tensor-parallel rank, so that shards of one
stage on two nodes cannot differ either), and every rank decides the same from the same views:

- the layers per rank: the one partition every rank computes (the server's ``get_pp_indices``,
  which reads ``VLLM_PP_LAYER_PARTITION`` or ``SGLANG_PP_LAYER_PARTITION``), else every rank
  stops naming each rank's view;
- for an unsplit Hub repo: the commit. Rank 0 alone resolves the revision, once for the whole
  deployment, and every rank builds its stage at that commit, so a branch that moves while the
  nodes start cannot give two ranks two commits. A rank given another revision (a commit other
  than the one rank 0 resolved, another branch) stops every rank with one line naming both.

A failure on one rank (its partition variable, rank 0's Hub lookup) is exchanged as data and
raised on every rank: a rank that raised alone would leave the others waiting in the server's
next collective.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from ..errors import ReshardError, StageError, param
from ..format.identity import location_sha256
from ..format.names import STAGE_MANIFEST, node_dirname
from ..loader import Stage, is_split, open_stage
from ..model.parallelism import Parallelism
from ..model.runtimes import runtime_of
from ..stage.reader import RunRecord, read_run_record
from .eprank import RankExperts, ep_nodes, rank_view
from .terms import for_operator, operator_terms

PpIndices = Callable[[int, int, int], tuple[int, int]]  # (layers, rank, pp size) -> [start, end)


def rank_stage(
    model: str,
    *,
    runtime: str,
    group: object,
    pp_rank: int,
    pp_size: int,
    layers: int,
    pp_indices: PpIndices,
    revision: str | None,
    token: str | None,
    log: Callable[[str], None],
    experts: RankExperts | None = None,
) -> Stage:
    """Pipeline rank ``pp_rank``'s stage of ``model``, once every rank of the deployment agreed
    on the partition and (an unsplit Hub repo) the commit: a split's stage (``model`` is a run
    directory or one of its stage directories) or the unsplit model's stage built or read by
    :func:`qwen35_reshard.servers.unsplit.for_server`. Checked against the server's view of the
    rank before it is returned.

    Args:
        model: the model path or repo id the server was given.
        runtime: ``"vllm"`` or ``"sglang"``.
        group: the deployment's process group (``world_size``, ``rank_in_group``, ``cpu_group``:
            a vLLM or SGLang ``GroupCoordinator``).
        pp_rank, pp_size: this rank's place in the pipeline.
        layers: the model's decoder layers.
        pp_indices: the server's ``get_pp_indices``.
        revision, token: as the server was given them.
        log: the server's log (info level).
        experts: the rank's expert-parallel group as the server built it (None: none). For
            an unsplit model the rank loads only its node's experts (:mod:`.eprank`).

    Returns:
        The :class:`~qwen35_reshard.loader.Stage` this rank loads.

    Raises:
        StageError: on every rank, for a disagreement or a failure on any one rank before the
            exchange; afterwards this rank's own failure (its stage).

    Example:
        >>> import types
        >>> from qwen35_reshard.servers.deployment import rank_stage
        >>> alone = types.SimpleNamespace(world_size=1, rank_in_group=0, cpu_group=None)
        >>> even = lambda layers, rank, size: (rank * layers // size, (rank + 1) * layers // size)
        >>> stage = rank_stage(MODEL, runtime="vllm", group=alone, pp_rank=1, pp_size=2, layers=8,
        ...                    pp_indices=even, revision=None, token=None, log=lambda line: None)
        >>> stage.start_layer, stage.end_layer
        (4, 8)
    """
    split = is_split(model)
    mine = own_view(model, runtime, group, pp_size, layers, pp_indices, revision, token, split=split)
    mine.update(rank_view(experts, pp_rank))
    partition, commit, views = agree(runtime, group, mine)
    nodes = ep_nodes(views, experts.ep) if experts is not None and not split else {}
    start = sum(partition[:pp_rank])
    end = start + partition[pp_rank]
    if split:
        # A stage directory is opened as itself, so that a wrong rank is told which directory is its own.
        given = None if (Path(model) / STAGE_MANIFEST).is_file() else pp_rank
        with operator_terms(split=True):
            stage = split_stage(model, pp_rank, experts) if given is not None else open_stage(model)
    else:
        from .unsplit import for_server  # the writer's side, only where a stage is built

        if commit is not None and commit != revision:
            log(f"qwen35-stages: {model}: every rank serves commit {commit} (resolved once, on rank 0)")
        layout = Parallelism(pp=pp_size, runtime=runtime, partition=tuple(partition))
        node = 0
        if experts is not None:
            try:
                layout = replace(
                    layout, ep=experts.ep, nodes=nodes[pp_rank], redundant_experts=experts.redundant,
                    init_expert_location=_location(experts.location),
                )
            except ReshardError as e:  # the server's own expert-parallel settings, which it accepted
                raise StageError(f"pipeline rank {pp_rank}: {for_operator(e)}") from e
            node = experts.ep_rank // layout.ranks_per_node
        stage = for_server(
            model, layout, rank=pp_rank, node=node, revision=commit or revision, token=token, log=log
        )
    stage.check(pp_size=pp_size, start_layer=start, end_layer=end, pp_rank=pp_rank, runtime=runtime)
    return stage


def split_stage(model: str, pp_rank: int, experts: RankExperts | None) -> Stage:
    """Pipeline rank ``pp_rank``'s directory of the split ``model``: its stage (``ppN``), or
    for an expert-parallel split the directory of the node that hosts the rank's EP rank
    (``pp{r}-node{k}``, ``node{k}``), the split's EP layout (its run record) checked against
    the server's: the EP size, redundant experts and initial expert location (by the digest the
    split's identity records), and the rank among the node's.

    Raises:
        ReshardError: the split's EP layout is not the server's, or its directory is damaged.
    """
    root = Path(model)
    run = read_run_record(root, model)
    split = run.identity if isinstance(run, RunRecord) else None
    if split is None or split.ep == 1:
        return open_stage(model, pp_rank=pp_rank)
    # The location decides which experts a node holds as much as the sizes do (SGLang places by
    # its rows): a trivial split opened under another location would serve the wrong experts.
    location = None if experts is None else location_sha256(_location(experts.location))
    if experts is None or (experts.ep, experts.redundant, location) != (
        split.ep, split.redundant_experts, split.expert_location
    ):
        served = "without expert parallelism" if experts is None else (
            f"with expert parallelism {experts.ep}, {experts.redundant} redundant experts and "
            f"{_placement(location)}"
        )
        raise StageError(
            f"{model} was split for expert parallelism {split.ep} over {split.nodes} node(s) per stage with "
            f"{split.redundant_experts} redundant experts and {_placement(split.expert_location)}, but the "
            f"server runs {served}: launch it with {split.ep} EP ranks per stage, {split.redundant_experts} "
            f"redundant experts and {_placement(split.expert_location)}, or split again"
        )
    node = experts.ep_rank // (split.ep // split.nodes)
    stage = open_stage(root / node_dirname(pp_rank, node, split.pp))
    record = stage.manifest.node
    if record is None or record.node != node or experts.ep_rank not in record.ep_ranks:
        raise StageError(
            f"{stage.display} is not the directory of node {node} of pipeline stage {pp_rank}, which hosts "
            f"EP rank {experts.ep_rank}; it was copied to the wrong place: split again"
        )
    return stage


def own_view(
    model: str,
    runtime: str,
    group: object,
    pp_size: int,
    layers: int,
    pp_indices: PpIndices,
    revision: str | None,
    token: str | None,
    *,
    split: bool,
) -> dict[str, object]:
    """This rank's view for the exchange, plain data: its layers per rank (or the error computing
    them), its raw partition variable, its revision, and on rank 0 of an unsplit Hub repo the
    commit the revision resolves to (or the error resolving it, whatever it is, in one line:
    every rank must reach the exchange, or the others wait until the group times out)."""
    var = os.environ.get(runtime_of(runtime).partition_env)
    try:
        ranges = [pp_indices(layers, r, pp_size) for r in range(pp_size)]
        partition: object = [end - start for start, end in ranges]
    except Exception as e:  # a bad variable on this node: said by every rank
        partition = f"{type(e).__name__}: {e}"
    view: dict[str, object] = {
        "partition": partition, "variable": var, "revision": revision, "commit": None, "error": None,
    }
    if group.rank_in_group == 0 and not split:
        from .unsplit import pinned_commit  # the Hub client, only for an unsplit model

        try:
            view["commit"] = pinned_commit(model, revision, token)
        except Exception as e:  # any failure (OSError, a missing package): raised alone, it hangs the others
            said = str(e) if isinstance(e, StageError) else f"{type(e).__name__}: {e}"
            view["error"] = " ".join(said.split())  # one line
    return view


def agree(
    runtime: str, group: object, mine: dict[str, object]
) -> tuple[list[int], str | None, list[dict[str, object]]]:
    """Exchange this rank's view (:func:`own_view`) with every rank of ``group`` and decide, as
    every rank does from the same views, the partition and the commit (None: not a Hub repo);
    and every rank's view, for what else all decide alike.

    Raises:
        StageError: on every rank alike (:func:`one_partition`, :func:`one_commit`).
    """
    views = [mine] * group.world_size
    if group.world_size > 1:
        import torch.distributed as dist

        dist.all_gather_object(views, mine, group=group.cpu_group)
    return one_partition(runtime, [(v["partition"], v["variable"]) for v in views]), one_commit(views), views


def one_partition(runtime: str, views: Sequence[tuple[object, str | None]]) -> list[int]:
    """The partition every rank's view (its layers per rank, or the error computing them, and
    its raw partition variable) names. Only the partitions are compared: a node with
    ``VLLM_PP_LAYER_PARTITION=4,4`` and one without it (vLLM's default, the same 4,4) agree;
    the variables are for the message.

    Raises:
        StageError: the partitions differ, or one is an error.

    Example:
        >>> one_partition("vllm", [([4, 4], "4,4"), ([4, 4], None)])
        [4, 4]
    """
    var = runtime_of(runtime).partition_env
    partitions = [p for p, _ in views]
    if any(not isinstance(p, list) or p != partitions[0] for p in partitions):
        seen = "; ".join(f"rank {r}: {_partition_view(p, v, var)}" for r, (p, v) in enumerate(views))
        raise StageError(
            f"the pipeline ranks' layers per rank ({seen}) are not one valid partition: launch every "
            f"node with the same valid {var} (or none)"
        )
    return list(partitions[0])


def one_commit(views: Sequence[dict[str, object]]) -> str | None:
    """The commit rank 0 resolved (None: a split or a local directory), once every rank's
    revision names it: the same revision as rank 0's, or that commit itself.

    Raises:
        StageError: rank 0 could not resolve the revision (its line), or a rank was given a
            revision that is not rank 0's commit, naming both commits.

    Example:
        >>> one_commit([{"revision": "main", "commit": "a" * 40, "error": None},
        ...             {"revision": "a" * 40, "commit": None, "error": None}]) == "a" * 40
        True
    """
    first = views[0]
    if first["error"] is not None:
        raise StageError(f"pipeline rank 0 resolves the model's revision for every rank: {first['error']}")
    commit = first["commit"]
    if commit is None:
        return None
    asked = first["revision"] or "main"
    for rank, view in enumerate(views[1:], start=1):
        theirs = view["revision"] or "main"
        if theirs not in (asked, commit):
            raise StageError(
                f"rank 0 serves revision {asked!r} at commit {commit}, rank {rank} was given revision "
                f"{theirs!r}: one deployment serves one commit: launch every node with --revision {commit}"
            )
    return str(commit)


def _location(given: str | None) -> tuple[tuple[int, ...], ...] | None:
    """SGLang's ``--init-expert-location`` as the layout's rows (None: ``trivial``)."""
    if given is None:
        return None
    from ..model.experts import read_expert_location

    rows = read_expert_location(given)
    return None if rows is None else tuple(tuple(row) for row in rows)


def _placement(digest: str | None) -> str:
    """An initial expert location as a message names it: trivial, or its digest's start."""
    where = "trivial" if digest is None else f"sha256 {digest[:12]}"
    return f"{param('init_expert_location')} {where}"


def _partition_view(partition: object, var: str | None, name: str) -> str:
    """One rank's view for a message: ``4,4 (VLLM_PP_LAYER_PARTITION unset)``."""
    shown = ",".join(map(str, partition)) if isinstance(partition, list) else partition
    return f"{shown} ({name}={var})" if var is not None else f"{shown} ({name} unset)"
