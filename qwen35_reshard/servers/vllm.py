"""vLLM load format ``qwen35-stages``: every pipeline rank loads its own stage of a split.

    vllm serve OUT --load-format qwen35-stages --pipeline-parallel-size N

OUT is a run directory written with ``--runtime vllm``. Each worker asks vLLM for its pipeline
rank and for the layers vLLM gives that rank (``get_pp_indices``, which honours
``VLLM_PP_LAYER_PARTITION``), opens ``OUT/pp{rank}`` through the loader shim and checks the
stage against that view before the rank's model is even built, so a stage of another split
stops the engine start with the shim's one-line message and no weight read. It then feeds the
model's own ``load_weights`` exactly the stage's tensors, with no skip logic: a tensor for a
layer the rank does not build is an error, and so is a parameter of the rank that no tensor
reached.

OUT may also be the unsplit checkpoint, a Hub repo id (``--revision`` and ``--hf-token`` as vLLM
takes them) or a local directory:

    vllm serve Qwen/Qwen3.5-397B-A17B --load-format qwen35-stages --pipeline-parallel-size 4

Then each rank builds its own stage, fetching only its byte ranges, into the stage cache
(``QWEN35_RESHARD_STAGE_CACHE``, default ``$HF_HOME/qwen35-stages``; the next start fetches
nothing), or reads it in place from a local directory (``QWEN35_RESHARD_STAGE_COPY=1``: built in
the cache first), and loads it as a split's stage (:mod:`qwen35_reshard.servers.unsplit`). Every rank first
checks that all ranks compute the same layers per rank (``VLLM_PP_LAYER_PARTITION`` is read on
each node).

vLLM loads the entry point (group ``vllm.general_plugins``, see pyproject.toml) in every
process that may load weights. vllm is imported only inside ``register``: this module, like
the rest of the package, imports without it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from ..loader import StageError

LOAD_FORMAT = "qwen35-stages"
RUNTIME = "vllm"
PARTITION_VAR = "VLLM_PP_LAYER_PARTITION"  # read by vLLM's get_pp_indices on each node


def register() -> None:
    """Entry point: make ``load_format="qwen35-stages"`` known to vLLM."""
    from vllm.model_executor.model_loader import register_model_loader

    register_model_loader(LOAD_FORMAT)(_loader_class())


def _loader_class() -> type:
    """Build the loader class; its base class is vLLM's, so it exists only where vLLM does."""
    from vllm.distributed import get_pp_group
    from vllm.distributed.utils import get_pp_indices
    from vllm.logger import init_logger
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    from vllm.model_executor.models.utils import PPMissingLayer, StageMissingLayer

    from .. import loader
    from ..units import plural

    log = init_logger(f"vllm.{__name__}")  # vLLM configures loggers under "vllm." in every process

    def open_own_stage(model_config: object) -> loader.Stage:
        """This rank's stage, checked against the rank's view of the split, or StageError."""
        group = get_pp_group()
        rank, size = group.rank_in_group, group.world_size
        partition = agreed_partition(group, model_config.hf_text_config.num_hidden_layers, get_pp_indices)
        start = sum(partition[:rank])
        end = start + partition[rank]
        path = model_config.model
        if loader.is_split(path):
            stage = loader.open_stage(path, pp_rank=rank)
        else:
            from .unsplit import for_server  # the writer's side, only where a stage is built

            token = getattr(model_config, "hf_token", None)
            stage = for_server(
                path, runtime=RUNTIME, partition=partition, rank=rank,
                revision=getattr(model_config, "revision", None),
                token=token if isinstance(token, str) else None, log=log.info,
            )
        stage.check(pp_size=size, start_layer=start, end_layer=end, pp_rank=rank, runtime=RUNTIME)
        return stage

    def placeholder_on_path(model: object, name: str) -> type | None:
        """The placeholder type (PPMissingLayer, StageMissingLayer) on the way to the module
        that takes ``name`` (a vLLM name), or None where vLLM built the module."""
        module = model
        for part in name.split(".")[:-1]:
            module = module._modules.get(part)
            if module is None:
                return None  # not a module path (a fused parameter, ...): vLLM's own loader decides
            if isinstance(module, (PPMissingLayer, StageMissingLayer)):
                return type(module)
        return None

    class Qwen35StagesLoader(BaseModelLoader):
        """Loads ``OUT/pp{rank}`` on each pipeline rank; see the module docstring."""

        def download_model(self, model_config: object) -> None:
            """Nothing to download: the stages are directories every worker reads itself."""

        def load_model(self, vllm_config: object, model_config: object, prefix: str = "") -> object:
            self._stage = open_own_stage(model_config)  # before the model is built
            return super().load_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)

        def load_weights(self, model: object, model_config: object) -> None:
            stage = getattr(self, "_stage", None) or open_own_stage(model_config)
            mapper = getattr(model, "hf_to_vllm_mapper", None)
            take, unbuilt = set(), []
            for name in stage.names:
                mapped = mapper.map_name(name) if mapper is not None else name
                kind = placeholder_on_path(model, mapped or name)
                if kind is PPMissingLayer:
                    raise loader.StageError(
                        f"{stage.display}: tensor {name!r} is for a layer pipeline rank {stage.rank} "
                        f"does not build; the stage does not match the server's split"
                    )
                if kind is StageMissingLayer:
                    unbuilt.append(name)
                else:
                    take.add(name)
            log.info(
                "qwen35-stages: pipeline rank %d loads %s (%d tensors)", stage.rank, stage.display, len(take)
            )
            if unbuilt:
                parts = sorted({".".join(n.split(".")[:2]) for n in unbuilt})
                log.info(
                    "qwen35-stages: %d tensors of %s not loaded: the server was started without them",
                    len(unbuilt), ", ".join(parts),
                )
            loaded = model.load_weights((n, t) for n, t in stage.iter_weights() if n in take)
            if loaded is None:
                raise loader.StageError(
                    f"{type(model).__name__}.load_weights does not say which parameters it loaded, "
                    "so the stage cannot be checked complete"
                )
            missing = sorted({n for n, _ in model.named_parameters()} - set(loaded))
            if missing:
                raise loader.StageError(
                    f"{stage.display}: {plural(len(missing), 'parameter')} of pipeline rank {stage.rank} "
                    f"got no tensor from the stage, e.g. {', '.join(missing[:3])}"
                )

    return Qwen35StagesLoader


def agreed_partition(
    group: object, layers: int, pp_indices: Callable[[int, int, int], tuple[int, int]]
) -> list[int]:
    """The layers per rank as this rank computes them (``pp_indices``: vLLM's ``get_pp_indices``,
    which reads VLLM_PP_LAYER_PARTITION), once every rank of the pipeline computed the same.

    Why: each node reads its own environment, and ranks that differ would build a pipeline with
    layers missing or twice (each rank loading what its own view says). Exchanged over the
    pipeline group (``group``: ``world_size``, ``cpu_group``) before anything can fail on one
    rank alone, which the others would wait for.

    Raises:
        StageError: on every rank, naming each rank's partition and variable.
    """
    import torch.distributed as dist

    var = os.environ.get(PARTITION_VAR)
    try:
        ranges = [pp_indices(layers, r, group.world_size) for r in range(group.world_size)]
        mine: tuple[object, str | None] = ([end - start for start, end in ranges], var)
    except Exception as e:  # a bad variable on this node: said by every rank below
        mine = (f"{type(e).__name__}: {e}", var)
    views: list[tuple[object, str | None]] = [mine] * group.world_size
    if group.world_size > 1:
        dist.all_gather_object(views, mine, group=group.cpu_group)
    return one_partition(views)


def one_partition(views: Sequence[tuple[object, str | None]]) -> list[int]:
    """The partition every rank's view (its layers per rank, or the error computing them, and
    its raw partition variable) names. Only the partitions are compared: a node with
    ``VLLM_PP_LAYER_PARTITION=4,4`` and one without it (vLLM's default, the same 4,4) agree;
    the variables are for the message.

    Raises:
        StageError: the partitions differ, or one is an error.

    Example:
        >>> one_partition([([4, 4], "4,4"), ([4, 4], None)])
        [4, 4]
    """
    partitions = [p for p, _ in views]
    if any(not isinstance(p, list) or p != partitions[0] for p in partitions):
        seen = "; ".join(f"rank {r}: {_partition_view(p, v)}" for r, (p, v) in enumerate(views))
        raise StageError(
            f"the pipeline ranks' layers per rank ({seen}) are not one valid partition: launch every "
            f"node with the same valid {PARTITION_VAR} (or none)"
        )
    return list(partitions[0])


def _partition_view(partition: object, var: str | None) -> str:
    """One rank's view for a message: ``4,4 (VLLM_PP_LAYER_PARTITION unset)``."""
    shown = ",".join(map(str, partition)) if isinstance(partition, list) else partition
    return f"{shown} ({PARTITION_VAR}={var})" if var is not None else f"{shown} ({PARTITION_VAR} unset)"
