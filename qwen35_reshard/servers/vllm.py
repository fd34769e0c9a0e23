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
takes them), an ``s3://bucket/prefix`` URI (vLLM fetches its config through Run:ai's streamer,
``pip install 'vllm[runai]'``; the weights come through this format) or a local directory:

    vllm serve Qwen/Qwen3.5-397B-A17B --load-format qwen35-stages --pipeline-parallel-size 4

Then each rank builds its own stage, fetching only its byte ranges, into the stage cache
(``QWEN35_RESHARD_STAGE_CACHE``, default ``$HF_HOME/qwen35-stages``; the next start fetches
nothing), or reads it in place from a local directory (``QWEN35_RESHARD_STAGE_COPY=1``: built in
the cache first), and loads it as a split's stage (:mod:`qwen35_reshard.servers.unsplit`). Every rank first
agrees with all the others (:mod:`qwen35_reshard.servers.deployment`) on the layers per rank
(``VLLM_PP_LAYER_PARTITION`` is read on each node) and, for a Hub repo, on the commit, which the
first rank resolves once for the deployment.

vLLM loads the entry point (group ``vllm.general_plugins``, see pyproject.toml) in every
process that may load weights. vllm is imported only inside ``register``: this module, like
the rest of the package, imports without it.
"""

from __future__ import annotations

from collections.abc import Callable

from ..loader import Stage
from .deployment import rank_stage
from .eprank import RankExperts
from .terms import operator_weights

LOAD_FORMAT = "qwen35-stages"
RUNTIME = "vllm"


def register() -> None:
    """Entry point: make ``load_format="qwen35-stages"`` known to vLLM."""
    from vllm.model_executor.model_loader import register_model_loader

    register_model_loader(LOAD_FORMAT)(_loader_class())
    _accept_object_storage()


# The load formats vLLM 0.32 allows for an object-storage model (VllmConfig.
# try_verify_and_update_config): its Run:ai streamer's. The check runs once per engine.
RUNAI_LOAD_FORMAT = "runai_streamer"


def _accept_object_storage() -> None:
    """Let an ``s3://`` model through vLLM's check of the load format with ours.

    vLLM 0.32 fetches an object-storage model's config and tokenizer into a local folder and
    then refuses any load format but its Run:ai streamer's, which would read every weight of
    the checkpoint on every rank; ours reads the URI (``model_weights``) itself, each rank only
    its stage. The check is run with the Run:ai name in place of ours, which is put back at once
    (nothing else of the check reads it). Installed once per process, before any config is made
    (vLLM loads general plugins first).
    """
    from vllm.config import VllmConfig

    check = VllmConfig.try_verify_and_update_config
    if getattr(check, "qwen35_stages", False):
        return

    def checked(self: object) -> None:
        load = getattr(self, "load_config", None)
        weights = getattr(getattr(self, "model_config", None), "model_weights", "") or ""
        ours = load is not None and load.load_format == LOAD_FORMAT and "://" in weights
        if ours:
            load.load_format = RUNAI_LOAD_FORMAT
        try:
            check(self)
        finally:
            if ours:
                load.load_format = LOAD_FORMAT

    checked.qwen35_stages = True
    VllmConfig.try_verify_and_update_config = checked


def own_stage(model_config: object, log: Callable[[str], None], parallel_config: object = None) -> Stage:
    """This rank's stage of ``model_config.model``, once every rank of the deployment (vLLM's
    world group) agreed on the partition and the commit, checked against the rank's view of the
    split (:func:`~qwen35_reshard.servers.deployment.rank_stage`); under expert parallelism
    (``parallel_config``, default vLLM's current one, if any) of an unsplit model, only the
    experts of the rank's node. Called before the model is built.

    Raises:
        StageError: on every rank for a disagreement; else this rank's stage cannot be loaded.
    """
    from vllm.distributed import get_pp_group, get_world_group
    from vllm.distributed.utils import get_pp_indices

    if parallel_config is None:
        from vllm.config import get_current_vllm_config_or_none

        parallel_config = getattr(get_current_vllm_config_or_none(), "parallel_config", None)
    pp = get_pp_group()
    token = getattr(model_config, "hf_token", None)
    # For an s3:// model vLLM fetches the config and tokenizer into a local folder
    # (ModelConfig.maybe_pull_model_tokenizer_for_runai, Run:ai's streamer) and keeps the URI as
    # ``model_weights``: the weights are read from there.
    model = getattr(model_config, "model_weights", "") or model_config.model
    return rank_stage(
        model, runtime=RUNTIME, group=get_world_group(), pp_rank=pp.rank_in_group,
        pp_size=pp.world_size, layers=model_config.hf_text_config.num_hidden_layers,
        pp_indices=get_pp_indices, revision=getattr(model_config, "revision", None),
        token=token if isinstance(token, str) else None, log=log, experts=rank_experts(parallel_config),
    )


def rank_experts(parallel_config: object) -> RankExperts | None:
    """This rank's EP group as vLLM 0.32 builds it (``FusedMoEParallelConfig.make``, mirrored
    by ``DefaultModelLoader._init_ep_weight_filter``): ``enable_expert_parallel`` over
    ``ep_size = dp * pcp * tp`` ranks, ``ep_rank = dp_rank * pcp * tp + pcp_rank * tp + tp_rank``;
    redundant experts under EPLB only. None without expert parallelism."""
    from vllm.distributed import get_dp_group, get_pcp_group, get_tensor_model_parallel_rank

    if not getattr(parallel_config, "enable_expert_parallel", False):
        return None
    dp, tp = parallel_config.data_parallel_size, parallel_config.tensor_parallel_size
    pcp = parallel_config.prefill_context_parallel_size
    ep = dp * pcp * tp
    if ep == 1:
        return None
    dp_rank = get_dp_group().rank_in_group if dp > 1 else 0
    tp_rank = get_tensor_model_parallel_rank() if tp > 1 else 0
    pcp_rank = get_pcp_group().rank_in_group if pcp > 1 else 0
    eplb = getattr(parallel_config, "enable_eplb", False)
    redundant = parallel_config.eplb_config.num_redundant_experts if eplb else 0
    return RankExperts(ep_rank=dp_rank * pcp * tp + pcp_rank * tp + tp_rank, ep=ep, redundant=redundant)


def _loader_class() -> type:
    """Build the loader class; its base class is vLLM's, so it exists only where vLLM does."""
    from vllm.logger import init_logger
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    from vllm.model_executor.models.utils import PPMissingLayer, StageMissingLayer

    from .. import loader
    from ..units import plural

    log = init_logger(f"vllm.{__name__}")  # vLLM configures loggers under "vllm." in every process

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
            # before the model is built
            self._stage = own_stage(model_config, log.info, vllm_config.parallel_config)
            return super().load_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)

        def load_weights(self, model: object, model_config: object) -> None:
            stage = getattr(self, "_stage", None) or own_stage(model_config, log.info)
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
            loaded = model.load_weights((n, t) for n, t in operator_weights(stage) if n in take)
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

