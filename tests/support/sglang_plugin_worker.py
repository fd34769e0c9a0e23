"""Runs inside an SGLang environment: SGLang's own loader, through the plugin, loads stages
(tests/engine/test_sglang_plugin.py).

One forked child per pipeline rank (``sglang_worker.run_forked``: SGLang's parallel context is
process-global). The child sets up the rank as ``sglang_worker`` does, then runs SGLang's plugin
discovery (``sglang.srt.plugins.load_plugins()``, which finds this package's entry point in the
environment's metadata and applies the hooks it registers) and, for every case, SGLang's own
loading path: ``ModelConfig(path)``, ``get_model_loader(LoadConfig(load_format="auto"), ...)``
and the loader's ``load_model(..., DeviceConfig("cpu"))``, for the target model and, on the last
rank, the MTP draft (in a single-rank pipeline group, as SGLang's ``draft_pp_context`` does).

The measuring is done through SGLang's HookRegistry too, registered next to the plugin: after
``_initialize_model`` every parameter is set to NaN, and before
``DefaultModelLoader.load_weights_and_postprocess`` the weights are wrapped to record each name
fed and whether it filled some parameter. The reference for each model is the same model loaded
by SGLang from the whole checkpoint (a path that is not a split, so SGLang's own loader).

A case with ``unsplit`` loads an unsplit checkpoint (a Hub repo id or a directory) through the
plugin, the job's environment opting in (QWEN35_RESHARD_SGLANG_UNSPLIT); its twin is loaded with
the opt-in removed, so by SGLang's own loader.

Usage: python sglang_plugin_worker.py JOBS.json  ({"parallel": N, "jobs": [{pp, rank, partition,
cases, result}, ...]}); each case is {id, source, split, kind} with kind "load" (target, and the
draft if ``draft``) or "refused" (a control: the error and whether anything was built or fed).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

from sglang_worker import differing, local_experts, main, nan_counts, pipeline_group, set_up_rank, tracked

HOOKED = "sglang.srt.model_loader.loader.get_model_loader"
probe: dict = {}  # what the measuring hooks saw during the current load


# With FP8, SGLang's attention layers get KV-cache scales no checkpoint carries: they keep their
# initial -1 until process_weights_after_loading sets them (kv_cache.py asserts they are not NaN).
KV_SCALES = (".k_scale", ".v_scale", ".q_scale", ".prob_scale")


def nan_fill(model, *args, **kwargs) -> None:
    """AFTER hook on _initialize_model: every parameter NaN, so any left unloaded shows."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith(KV_SCALES):
                p.fill_(float("nan"))
    probe["built"] += 1


def record_feed(model, weights, target_device):
    """BEFORE hook on load_weights_and_postprocess: record what load_weights is fed and takes
    (for a split only: a reference load is not measured, which would only cost time)."""
    if not probe["track"]:
        return None

    def names(stream):
        for name, tensor in stream:
            probe["fed"].append(name)
            yield name, tensor

    return (model, tracked(model, names(weights), probe["taken"]), target_device), {}


def run_job(job: dict) -> None:
    """Play one pipeline rank: discover the plugin, then load every case through SGLang's loader."""
    import sglang
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed.parallel_state import patch_pipeline_parallel_group
    from sglang.srt.model_loader import loader as sgl_loader
    from sglang.srt.model_loader.utils import get_model_architecture
    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from qwen35_reshard import loader
    from qwen35_reshard.servers import sglang as plugin

    pp, rank = set_up_rank(job)

    debug: list[str] = []  # the plugin's debug records
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: debug.append(record.getMessage())
    plugin_log = logging.getLogger("qwen35_reshard.servers.sglang")
    plugin_log.addHandler(handler)
    plugin_log.setLevel(logging.DEBUG)

    HookRegistry.register("sglang.srt.model_loader.loader._initialize_model", nan_fill, HookType.AFTER)
    HookRegistry.register("sglang.srt.model_loader.loader.DefaultModelLoader.load_weights_and_postprocess",
                          record_feed, HookType.BEFORE)
    load_plugins()  # SGLang's discovery: this package's entry point, from the environment's metadata
    sources = {src.plugin_name for _, _, src in HookRegistry._hooks[HOOKED] if src is not None}
    discovered = {"hooked_by": sorted(sources),
                  "wrapped": getattr(sgl_loader.get_model_loader, "__wrapped__", None) is not None}
    original = sgl_loader.get_model_loader.__wrapped__ if discovered["wrapped"] else None

    def load(path: str, *, draft: bool, track: bool = True) -> dict:
        """SGLang's own loading path for ``path``, with what the measuring hooks saw."""
        probe.update(built=0, fed=[], taken=[], track=track)
        config = ModelConfig(path, is_draft_model=draft)
        load_config = LoadConfig(load_format="auto")
        chosen = sgl_loader.get_model_loader(load_config, config)
        model = chosen.load_model(model_config=config, device_config=DeviceConfig("cpu"))
        return {
            "model": model,
            "loader": type(chosen).__name__,
            "sglang_own_loader": type(original(load_config, config)).__name__ if original else None,
            "arch": get_model_architecture(config)[1],
            "params": {n: p.numel() for n, p in model.named_parameters()},
            "fed": list(probe["fed"]),
            "taken": list(probe["taken"]),
            "nan": sorted(n for n, c in nan_counts(model).items() if c),
        }

    def refused(path: str, *, draft: bool) -> dict:
        """Load ``path``; it must fail with StageError. The message, and what was built or fed."""
        try:
            load(path, draft=draft)
        except loader.StageError as e:
            return {"error": str(e), "built": probe["built"], "fed": len(probe["fed"])}
        return {"error": None, "built": probe["built"], "fed": len(probe["fed"])}

    references: dict[tuple[str, bool], dict] = {}  # the rank's model from a whole checkpoint
    opt_in = os.environ.get(plugin.UNSPLIT_ENV)

    def loaded(case: dict, *, draft: bool) -> dict:
        """The model from the split (or, ``unsplit``, the unsplit checkpoint through the plugin,
        opted in) and its twin from the whole checkpoint by SGLang's own loader, compared."""
        def own(path: str, track: bool = True) -> dict:
            """``path`` loaded by SGLang's own loader, whatever the job's opt-in."""
            os.environ.pop(plugin.UNSPLIT_ENV, None)
            try:
                return load(path, draft=draft, track=track)
            finally:
                if opt_in is not None:
                    os.environ[plugin.UNSPLIT_ENV] = opt_in

        got = own(case["split"]) if case.get("stock") else load(case["split"], draft=draft)
        key = (case["source"], draft)
        if key not in references:
            references[key] = own(case["source"], track=False)  # the twin is SGLang's own
        ref = references[key]
        model, twin = got.pop("model"), ref["model"]
        if job.get("ep", 1) > 1:  # which experts each slot of the rank holds, by their bytes
            got["local_experts"] = local_experts(model, Path(case["source"]))
        return {**got, "nan_after_whole": ref["nan"], "differs_from_whole": differing(model, twin),
                "ref_loader": ref["loader"], "ref_sglang_own_loader": ref["sglang_own_loader"],
                "layers": [getattr(model, "start_layer", None), getattr(model, "end_layer", None)]}

    results = {"discovered": discovered, "sglang": sglang.__version__}
    for case in job["cases"]:
        t = time.perf_counter()
        if case["kind"] == "refused":
            out = refused(case["split"], draft=False)
        else:
            out = loaded(case, draft=False)
            # An unsplit checkpoint's stage is the one the plugin built or opened for this rank.
            if case.get("stock"):  # not a split: SGLang's own loader
                out["stage_names"] = None
            elif case.get("unsplit") or job.get("ep", 1) > 1:  # the stage the plugin chose
                out["stage_names"] = plugin._stages[case["split"]].names
            else:
                out["stage_names"] = loader.open_stage(case["split"], pp_rank=rank).names
            out["draft"] = out["draft_refused"] = None
            if rank == pp - 1 and case["mtp_source"]:
                with patch_pipeline_parallel_group(pipeline_group(0, 1)):  # SGLang's draft_pp_context
                    if case["mtp_kept"]:
                        out["draft"] = loaded(case, draft=True)
                    else:
                        out["draft_refused"] = refused(case["split"], draft=True)
        out["seconds"] = round(time.perf_counter() - t, 2)
        results[case["id"]] = out
    results["debug"] = debug
    Path(job["result"]).write_text(json.dumps(results))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], run_job))
