"""SGLang plugin: every pipeline rank loads its own stage of a split, from one model path.

    SGLANG_PP_LAYER_PARTITION=4,4 python -m sglang.launch_server --model-path OUT --pp-size 2 ...

OUT is a run directory written with ``--runtime sglang`` (or one of its stages, ``OUT/ppR``).
SGLang loads the entry point (group ``sglang.srt.plugins``, see pyproject.toml) in every
scheduler process; ``register`` wraps SGLang's ``get_model_loader``, so that for a model path
that is a split it returns ``Qwen35StagesLoader``, a ``DefaultModelLoader`` that:

- before the rank's model is built (so before any weight is read) agrees with every rank of
  the deployment on the layers per rank and, for a Hub repo, the commit
  (:mod:`qwen35_reshard.servers.deployment`), then opens ``OUT/pp{rank}``
  through the loader shim (manifest, index, headers and the split's placement rules) and
  checks it against the layers SGLang gives the rank (its own ``get_pp_indices``, which
  honours ``SGLANG_PP_LAYER_PARTITION``) and against SGLang's layer naming: a stage of another
  split, pp size, partition or runtime stops the start with the shim's one-line message;
- feeds the model's own ``load_weights`` exactly the stage (``mtp.*`` aside: those are the
  MTP draft's), after checking the built model's ``start_layer``/``end_layer`` once more;
- for the NEXTN/MTP draft (``--speculative-algorithm NEXTN`` builds it from the same model
  path, on the last rank only) feeds the draft ``mtp.*`` and its embed_tokens copy from the
  stage this process's target model loaded, and refuses a split made ``--no-mtp``.

With ``QWEN35_RESHARD_SGLANG_UNSPLIT=1`` (the opt-in, said in the log when the plugin loads), a
model path that is not a split but an unsplit Qwen3.5 MoE checkpoint (a Hub repo id or a local
directory) is loaded the same way, each rank's stage fetched into the stage cache or read in
place (:mod:`qwen35_reshard.servers.unsplit`):

    QWEN35_RESHARD_SGLANG_UNSPLIT=1 python -m sglang.launch_server --model-path Qwen/Qwen3.5-35B-A3B \
        --pp-size 4

Any other model path: SGLang's own loader, untouched (logged once at debug level). sglang is
imported only inside ``register`` and what it installs: this module, like the rest of the
package, imports without it.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Iterator

from ..loader import Stage, StageError, is_split, stage_dirname
from .deployment import rank_stage
from .eprank import RankExperts
from .terms import operator_weights

RUNTIME = "sglang"
# What the plugin wraps (sglang 0.5.23, srt/model_loader/loader.py): every model load of a
# scheduler process, the draft's included, asks it for a loader.
TARGET = "sglang.srt.model_loader.loader.get_model_loader"
MTP_PREFIX = "mtp."
# The names under which SGLang 0.5.23's Qwen3_5ForCausalLMMTP.load_weights (qwen3_5_mtp.py)
# takes the draft's own embed_tokens copy.
DRAFT_EMBED = ("model.language_model.embed_tokens.weight", "model.embed_tokens.weight")
# The load formats whose weights are the model path's safetensors files, which a stage replaces.
STAGE_LOAD_FORMATS = ("auto", "safetensors")
# The opt-in to serving an UNSPLIT Qwen3.5 MoE checkpoint (a Hub repo id or a directory) stage by
# stage: set to 1, the plugin loads each rank's stage of it (see ``serve``); unset, such a model
# path is SGLang's own, as any other.
UNSPLIT_ENV = "QWEN35_RESHARD_SGLANG_UNSPLIT"
# config.json model_type of a Qwen3.5 MoE checkpoint (source.remote.checkpoint.MODEL_TYPES; not imported: it
# would import the writer's side into every SGLang process)
QWEN35_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")

log = logging.getLogger(__name__)
_not_splits: set[str] = set()  # model paths already logged as not a split
_stages: dict[str, Stage] = {}  # model path -> the stage this process's target model loaded


def register() -> None:
    """Entry point: route a split's model path to ``Qwen35StagesLoader`` (via SGLang's HookRegistry)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, choose_loader, HookType.AROUND)
    if unsplit_opted_in():
        log.info(
            "qwen35-stages: %s is set: a Qwen3.5 MoE model path that is not a split (a Hub repo id or a "
            "directory) is loaded stage by stage, each pipeline rank fetching or reading only its own",
            UNSPLIT_ENV,
        )


def unsplit_opted_in() -> bool:
    """Whether ``UNSPLIT_ENV`` is set to a true value."""
    return os.environ.get(UNSPLIT_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def choose_loader(original: Callable, load_config: object, model_config: object = None) -> object:
    """The AROUND hook on ``get_model_loader``: ours for a split, SGLang's own otherwise.

    Raises:
        StageError: a split with a load format that reads the model path's files another way.
    """
    path = getattr(model_config, "model_path", None)
    if path is None or not (is_split(path) or is_unsplit_asked(model_config)):
        if path not in _not_splits:
            _not_splits.add(path)
            log.debug("qwen35-stages: %s is not a qwen35-reshard split; SGLang loads it itself", path)
        return original(load_config, model_config)
    fmt = getattr(load_config.load_format, "value", load_config.load_format)
    if fmt == "dummy" or isinstance(fmt, type):  # random weights, or a loader class chosen in Python
        return original(load_config, model_config)
    if fmt not in STAGE_LOAD_FORMATS:
        raise StageError(
            f"--load-format {fmt} cannot load the qwen35-reshard split {path}: leave --load-format at auto"
        )
    return loader_class()(load_config)


def is_unsplit_asked(model_config: object) -> bool:
    """Whether ``UNSPLIT_ENV`` asks for this model (a Qwen3.5 MoE, the target model; the MTP
    draft loads from the stage the target loaded) to be loaded stage by stage: logged once."""
    if not unsplit_opted_in():
        return False
    path = model_config.model_path
    kind = getattr(getattr(model_config, "hf_config", None), "model_type", None)
    if kind not in QWEN35_MODEL_TYPES:
        if path not in _not_splits:
            log.info("qwen35-stages: %s is a %s model, not Qwen3.5 MoE: SGLang loads it itself", path, kind)
        return False
    return True


def target_stage(
    model_config: object,
    group: object,
    pp_rank: int,
    pp_size: int,
    pp_indices: Callable,
    experts: RankExperts | None = None,
) -> Stage:
    """The stage pipeline rank ``pp_rank`` must load, once every rank agreed on the partition
    (SGLang's ``pp_indices``, which reads SGLANG_PP_LAYER_PARTITION on each node) and the commit,
    checked against the layers SGLang gives the rank (:func:`~.deployment.rank_stage`): a split's,
    or for a model path that is not a split (``UNSPLIT_ENV``) the rank's stage of the unsplit
    checkpoint (under expert parallelism, ``experts``: its node's experts only); only headers
    are read.

    Raises:
        StageError: the stage is damaged, incomplete, or not the one this rank needs.
    """
    path = model_config.model_path
    stage = rank_stage(
        path, runtime=RUNTIME, group=group, pp_rank=pp_rank, pp_size=pp_size,
        layers=model_config.hf_text_config.num_hidden_layers, pp_indices=pp_indices,
        revision=getattr(model_config, "revision", None), token=None, log=log.info, experts=experts,
    )
    _stages[path] = stage
    return stage


def rank_experts(parallel: object) -> RankExperts | None:
    """This rank's EP group as SGLang 0.5.23 builds it: ``moe_ep_rank`` of ``moe_ep_size`` in its
    parallel context, ``--ep-num-redundant-experts`` and ``--init-expert-location``; None
    without expert parallelism."""
    from sglang.srt.runtime_context import get_exec

    if parallel.moe_ep_size <= 1:
        return None
    moe = get_exec().moe
    location = moe.init_expert_location
    return RankExperts(
        ep_rank=parallel.moe_ep_rank, ep=parallel.moe_ep_size, redundant=moe.ep_num_redundant_experts,
        location=None if location in (None, "trivial") else str(location),
    )


def check_layer_names(stage: Stage, layer_of: Callable[[str], int | None]) -> None:
    """Every stage tensor of a decoder layer is for a layer of the stage, as SGLang's
    ``layer_of`` (its ``get_layer_id``) reads the name: SGLang would skip any other one.

    Raises:
        StageError: naming the first tensor of a layer outside the stage.
    """
    for name in stage.names:
        layer = None if name.startswith(MTP_PREFIX) else layer_of(name)
        if layer is not None and not stage.start_layer <= layer < stage.end_layer:
            raise StageError(
                f"{stage.display}: tensor {name!r} is for layer {layer}, outside the stage's layers "
                f"[{stage.start_layer}, {stage.end_layer}) that SGLang's pipeline rank {stage.rank} builds; "
                f"the stage was altered: split again with qwen35-reshard --runtime {RUNTIME} --pp {stage.pp}"
            )


def draft_stage(model_config: object) -> Stage:
    """The stage the MTP draft of this process loads from: the last one, which this process's
    target model loaded (SGLang builds the draft only on the last pipeline rank).

    Raises:
        StageError: no stage loaded here, not the last stage, or a stage without ``mtp.*``.
    """
    path = model_config.model_path
    stage = _stages.get(path)
    if stage is None:
        raise StageError(
            f"the MTP draft's model path {path} is a qwen35-reshard split, but this process's "
            f"model was not loaded from it: pass the split as --model-path too (the draft's path "
            f"defaults to it)"
        )
    if stage.rank != stage.pp - 1:
        raise StageError(
            f"{stage.display} is stage {stage.rank} of {stage.pp}, but the MTP draft loads on the last "
            f"pipeline rank only: serve it from {stage_dirname(stage.pp - 1)}"
        )
    if not any(n.startswith(MTP_PREFIX) for n in stage.names):
        why = "was split with --no-mtp" if stage.mtp == "dropped" else "has no MTP head"
        raise StageError(
            f"{stage.display} {why}: it has no mtp.* tensors for the speculative draft; launch without "
            f"--speculative-algorithm, or split again without --no-mtp"
        )
    return stage


def is_draft_tensor(name: str) -> bool:
    """What the MTP draft takes from the last stage: ``mtp.*`` and its embed_tokens copy."""
    return name.startswith(MTP_PREFIX) or name in DRAFT_EMBED


@functools.cache
def loader_class() -> type:
    """Build the loader class; its base class is SGLang's, so it exists only where SGLang does."""
    from sglang.srt.distributed.utils import get_pp_indices
    from sglang.srt.layers.utils import get_layer_id
    from sglang.srt.model_loader.loader import DefaultModelLoader
    from sglang.srt.runtime_context import get_parallel

    class Qwen35StagesLoader(DefaultModelLoader):
        """Loads ``OUT/pp{rank}`` on each pipeline rank (and the MTP draft); see the module docstring."""

        def download_model(self, model_config: object) -> None:
            """Nothing to download: every rank reads its stage directory itself."""

        def load_model(self, *, model_config: object, device_config: object) -> object:
            """Open and check the stage, then let SGLang build the model and load it from the stage."""
            if model_config.is_draft_model:
                self._stage, self._takes = draft_stage(model_config), is_draft_tensor
            else:
                parallel = get_parallel()
                self._stage = target_stage(
                    model_config, parallel.world_group, parallel.pp_rank, parallel.pp_size, get_pp_indices,
                    rank_experts(parallel),
                )
                check_layer_names(self._stage, get_layer_id)
                self._takes = lambda name: not name.startswith(MTP_PREFIX)  # those are the draft's
            return super().load_model(model_config=model_config, device_config=device_config)

        def resolve_model_weights(self, model_config: object, model: object) -> tuple:
            """SGLang's startup-overlap path reads the model path's files itself: refused."""
            raise StageError(
                f"--startup-weight-load-mode overlap cannot load the qwen35-reshard split "
                f"{model_config.model_path}: leave it at its default"
            )

        def _get_all_weights(self, model_config: object, model: object) -> Iterator[tuple[str, object]]:
            """Exactly the stage's tensors this model takes, one at a time."""
            stage = self._stage
            if not model_config.is_draft_model:
                # SGLang's own model: the layers it built must be the stage's.
                built = (getattr(model, "start_layer", None), getattr(model, "end_layer", None))
                if built != (None, None):
                    stage.check(stage.pp, *built, pp_rank=stage.rank)
            names = [n for n in stage.names if self._takes(n)]
            log.info(
                "qwen35-stages: pipeline rank %d loads %d tensors of %s into %s",
                stage.rank, len(names), stage.display, type(model).__name__,
            )
            for name, tensor in operator_weights(stage):
                if self._takes(name):
                    yield name, tensor

    return Qwen35StagesLoader
