"""Runs inside an SGLang environment, one pipeline rank per process (tests/test_sglang_loading.py).

SGLang's parallel context is process-global, so each process plays exactly one rank of one
pipeline layout and runs every case of that layout. For each case it builds the model the way
SGLang's own loader does (``ModelConfig`` from the stage's ``config.json``, the class from
SGLang's model registry, ``_initialize_model``), sets every parameter to NaN, and feeds
``load_weights``:

- exactly the stage, through ``qwen35_reshard.loader``, recording which tensors filled some
  parameter (a tensor that fills nothing is one SGLang drops);
- the whole source checkpoint, into a second model built the same way (SGLang skips what
  belongs to other ranks), as the reference the stage-fed model must equal.

On the last rank of a case with MTP kept it does the same with SGLang's MTP draft model
(``ModelConfig(..., is_draft_model=True)``, built in SGLang's single-rank draft pipeline
group). It writes one JSON result per case; the test makes the assertions.

Usage: python sglang_worker.py JOB.json  (JOB: pp, rank, partition, cases, result path).
Nothing is faked except the pipeline group object, whose four fields SGLang's model code
reads (the same stand-in SGLang's own tests install); no process group is created.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace


def pipeline_group(rank: int, size: int) -> SimpleNamespace:
    """What SGLang's model code reads from its pipeline group."""
    return SimpleNamespace(
        rank_in_group=rank, world_size=size, is_first_rank=rank == 0, is_last_rank=rank == size - 1
    )


def main(job_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    pp, rank = job["pp"], job["rank"]
    if job["partition"] is None:
        os.environ.pop("SGLANG_PP_LAYER_PARTITION", None)
    else:
        os.environ["SGLANG_PP_LAYER_PARTITION"] = job["partition"]

    t0 = time.perf_counter()
    import sglang
    import torch
    from safetensors import safe_open
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed.parallel_state import patch_pipeline_parallel_group
    from sglang.srt.model_loader.loader import _initialize_model
    from sglang.srt.model_loader.utils import get_model_architecture, set_default_torch_dtype
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.runtime_context import SpawnRanks, get_parallel
    from sglang.srt.server_args import ServerArgs
    from sglang.test.parallel_groups import publish

    from qwen35_reshard import loader

    # The server-args context for this rank (model_path "dummy" as SGLang's own tests do: the
    # model is built below from the stage's config, outside server-argument resolution).
    publish(ServerArgs(model_path="dummy", device="cpu", pp_size=pp), role="test",
            ranks=SpawnRanks(world_rank=rank))
    get_parallel().override_permanently(pp_group=pipeline_group(rank, pp))
    ModelRegistry.get_supported_archs()  # imports every model module once, up front
    import_s = time.perf_counter() - t0

    def build(path: Path, *, draft: bool):
        config = ModelConfig(str(path), is_draft_model=draft)
        cls, arch = get_model_architecture(config)
        if draft:  # SGLang's draft_pp_context: the draft never spans stages
            with patch_pipeline_parallel_group(pipeline_group(0, 1)), set_default_torch_dtype(config.dtype):
                model = _initialize_model(config, LoadConfig())
        else:
            with set_default_torch_dtype(config.dtype):
                model = _initialize_model(config, LoadConfig())
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))
        return model, f"{cls.__module__}.{cls.__qualname__}", arch

    def nan_counts(model) -> dict[str, int]:
        return {n: int(torch.isnan(p).sum()) for n, p in model.named_parameters()}

    def feed(model, weights) -> list[str]:
        """Run load_weights; return the names of the tensors that filled some parameter."""
        taken: list[str] = []
        params = dict(model.named_parameters())
        unfilled = nan_counts(model)  # only parameters still holding NaN can change the count

        def stream():
            for name, tensor in weights:
                yield name, tensor
                # load_weights asks for the next tensor once it is done with this one
                now = {n: int(torch.isnan(params[n]).sum()) for n in unfilled}
                if now != unfilled:
                    taken.append(name)
                unfilled.clear()
                unfilled.update((n, c) for n, c in now.items() if c)

        model.load_weights(stream())
        return taken

    def whole_checkpoint(source: Path):
        index = json.loads((source / "model.safetensors.index.json").read_text())["weight_map"]
        for file in sorted(set(index.values())):
            with safe_open(source / file, "pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    yield name, f.get_tensor(name)

    def differing(a, b) -> list[str]:
        """Parameters whose bytes differ (NaN left in both counts as equal)."""
        pb = dict(b.named_parameters())
        return sorted(n for n, p in a.named_parameters() if not torch.equal(raw(p), raw(pb[n])))

    def raw(p):
        return p.detach().flatten().view(torch.uint8)

    def run(case: dict) -> dict:
        t = time.perf_counter()
        stage = loader.open_stage(case["split"], pp_rank=rank)
        model, cls, arch = build(stage.path, draft=False)
        # The server's own view of its layers against the stage's: SGLang's split must be the one
        # the stage was cut for (this is what the launch line's partition variable guarantees).
        stage.check(pp_size=pp, start_layer=model.start_layer, end_layer=model.end_layer, pp_rank=rank)
        fed = [(n, w) for n, w in stage.iter_weights(verify=True) if not n.startswith(tuple(case["drop"]))]
        if case["extra"]:
            fed += [(n, w) for n, w in whole_checkpoint(Path(case["source"])) if n in case["extra"]]
        taken = feed(model, iter(fed))
        ref, _, _ = build(stage.path, draft=False)
        feed(ref, whole_checkpoint(Path(case["source"])))
        out = {
            "sglang": sglang.__version__,
            "class": cls,
            "arch": arch,
            "layers": [model.start_layer, model.end_layer],
            "stage_names": sorted(stage.names),
            "fed": [n for n, _ in fed],
            "params": {n: p.numel() for n, p in model.named_parameters()},
            "nan_after_stage": sorted(n for n, c in nan_counts(model).items() if c),
            "taken": taken,
            "nan_after_whole": sorted(n for n, c in nan_counts(ref).items() if c),
            "differs_from_whole": differing(model, ref),
            "draft": None,
        }
        if case["draft"]:
            draft, dcls, darch = build(stage.path, draft=True)
            dtaken = feed(draft, iter(fed))
            dref, _, _ = build(stage.path, draft=True)
            feed(dref, whole_checkpoint(Path(case["source"])))
            out["draft"] = {
                "class": dcls,
                "arch": darch,
                "params": {n: p.numel() for n, p in draft.named_parameters()},
                "taken": dtaken,
                "nan_after_stage": sorted(n for n, c in nan_counts(draft).items() if c),
                "differs_from_whole": differing(draft, dref),
            }
        out["seconds"] = round(time.perf_counter() - t, 2)
        return out

    results = {"import_seconds": round(import_s, 2), "cases": {c["id"]: run(c) for c in job["cases"]}}
    Path(job["result"]).write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])
