"""Runs inside an SGLang environment: SGLang's model code loads stages (tests/engine/test_sglang_loading.py).

SGLang's parallel context is process-global, so every pipeline rank runs in a process of its
own: this process imports SGLang once (the slow part), then forks one child per job (a rank of
one pipeline layout), at most ``parallel`` at a time; the child sets up that rank and runs every
case of the layout. For each case it builds the model the way SGLang's own loader does
(``ModelConfig`` from the stage's ``config.json``, the class from SGLang's model registry,
``_initialize_model``), sets every parameter to NaN, and feeds ``load_weights``:

- exactly the stage, through ``qwen35_reshard.loader``, recording which tensors filled some
  parameter (a tensor that fills nothing is one SGLang drops);
- the whole source checkpoint, into a second model built the same way (SGLang skips what
  belongs to other ranks), as the reference the stage-fed model must equal.

On the last rank of a case with MTP kept it does the same with SGLang's MTP draft model
(``ModelConfig(..., is_draft_model=True)``, built in a single-rank pipeline group as SGLang's
``draft_pp_context`` does). Each child writes one JSON result; the test makes the assertions.

Usage: python sglang_worker.py JOBS.json  ({"parallel": N, "jobs": [{pp, rank, partition,
cases, result}, ...]}). Nothing is faked but the pipeline group object, whose four fields
SGLang's model code reads (the stand-in SGLang's own tests install); no process group is made.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace


def pipeline_group(rank: int, size: int) -> SimpleNamespace:
    """What SGLang's model code reads from a process group (pipeline, tensor, expert parallel)."""
    return SimpleNamespace(
        rank_in_group=rank, world_size=size, is_first_rank=rank == 0, is_last_rank=rank == size - 1,
        cpu_group=None, device_group=None,
    )


def nan_counts(model) -> dict[str, int]:
    """NaN elements per parameter."""
    import torch

    return {n: int(torch.isnan(p).sum()) for n, p in model.named_parameters()}


def tracked(model, weights, taken: list[str]):
    """``weights`` passed through, appending to ``taken`` each name that filled some parameter."""
    import torch

    params = dict(model.named_parameters())
    unfilled = nan_counts(model)  # only parameters still holding NaN can change the count
    for name, tensor in weights:
        yield name, tensor
        # load_weights asks for the next tensor once it is done with this one
        now = {n: int(torch.isnan(params[n]).sum()) for n in unfilled}
        if now != unfilled:
            taken.append(name)
        unfilled.clear()
        unfilled.update((n, c) for n, c in now.items() if c)


def feed(model, weights) -> list[str]:
    """Run load_weights; return the names of the tensors that filled some parameter."""
    taken: list[str] = []
    model.load_weights(tracked(model, weights, taken))
    return taken


def whole_checkpoint(source: Path):
    """Every tensor of the checkpoint in ``source``, file by file."""
    from safetensors import safe_open

    index = json.loads((source / "model.safetensors.index.json").read_text())["weight_map"]
    for file in sorted(set(index.values())):
        with safe_open(source / file, "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_tensor(name)


def differing(a, b) -> list[str]:
    """Parameters whose bytes differ (NaN left in both counts as equal)."""
    import torch

    def raw(p):
        return p.detach().flatten().view(torch.uint8)

    pb = dict(b.named_parameters())
    return sorted(n for n, p in a.named_parameters() if not torch.equal(raw(p), raw(pb[n])))


def local_experts(model, source: Path) -> dict[str, list[int]]:
    """For each decoder layer's routed experts in ``model`` (SGLang's fused ``w13_weight``,
    ``[E_local, 2I, H]``), the global id of the checkpoint expert each local slot holds, found by
    its bytes in ``source`` (fused or per-expert): -1 for a slot equal to none."""
    import re

    import torch

    whole = {n: t for n, t in whole_checkpoint(source) if ".mlp.experts." in n and not n.startswith("mtp.")}
    found = {}
    for name, p in model.named_parameters():
        m = re.search(r"layers\.(\d+)\.mlp\.experts\.w13_weight$", name)
        if m is None:
            continue
        prefix = next(k for k in whole if f".layers.{m[1]}.mlp.experts." in k).split(".mlp.experts.")[0]
        fused = whole.get(f"{prefix}.mlp.experts.gate_up_proj")
        if fused is not None:
            experts = dict(enumerate(fused))
        else:
            at = f"{prefix}.mlp.experts."
            ids = {int(k[len(at):].split(".")[0]) for k in whole if k.startswith(at)}
            experts = {e: torch.cat([whole[f"{at}{e}.gate_proj.weight"], whole[f"{at}{e}.up_proj.weight"]])
                       for e in sorted(ids)}
        found[name] = [next((e for e, w in experts.items() if torch.equal(w, slot)), -1) for slot in p]
    return found


def set_up_rank(job: dict) -> tuple[int, int]:
    """SGLang's process-wide context for the job's pipeline rank; ``(pp, rank)``. With ``ep``
    (an expert-parallel group of that size in each stage, SGLang's ``--tp N --ep N``) and
    ``ep_rank``, the process is that rank of its stage's group: its MoE layers hold only the
    rank's experts (``moe_ep_rank``) and its linear layers the TP shard of that rank."""
    import torch
    from sglang.srt.runtime_context import SpawnRanks, get_parallel
    from sglang.srt.server_args import ServerArgs
    from sglang.test.parallel_groups import publish

    torch.set_num_threads(1)  # jobs run side by side, one core each
    pp, rank = job["pp"], job["rank"]
    ep, ep_rank = job.get("ep", 1), job.get("ep_rank", 0)
    if job["partition"] is None:
        os.environ.pop("SGLANG_PP_LAYER_PARTITION", None)
    else:
        os.environ["SGLANG_PP_LAYER_PARTITION"] = job["partition"]
    # The server-args context for this rank (model_path "dummy" as SGLang's own tests do: the
    # model is built from the stage's config, outside server-argument resolution). SGLang's
    # world rank is tp_size * pp_rank + tp_rank; its moe_ep_rank follows from it.
    # Wide EP as deployed (``--enable-dp-attention``): attention (and the vision tower) is not
    # split over the EP group, so any EP size builds.
    wide = {"dp_size": ep, "enable_dp_attention": True} if ep > 1 else {}
    publish(ServerArgs(model_path="dummy", device="cpu", pp_size=pp, tp_size=ep, ep_size=ep, **wide),
            role="test", ranks=SpawnRanks(world_rank=ep * rank + ep_rank))
    # Each job is one process alone (no gloo group): the plugin's cross-rank exchange over the
    # world group (servers/deployment.py) has only this rank to agree with.
    alone = SimpleNamespace(world_size=1, rank_in_group=0, cpu_group=None)
    groups = {"pp_group": pipeline_group(rank, pp), "world_group": alone}
    if ep > 1:  # stand-ins for the groups SGLang's MoE code asks for while it builds (no collective runs)
        groups.update(tp_group=pipeline_group(ep_rank, ep), moe_ep_group=pipeline_group(ep_rank, ep),
                      moe_tp_group=pipeline_group(0, 1))
    get_parallel().override_permanently(**groups)
    return pp, rank


def run_job(job: dict) -> None:
    """Play one pipeline rank: set up SGLang's context for it, run every case, write the result."""
    import sglang
    import torch
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed.parallel_state import patch_pipeline_parallel_group
    from sglang.srt.model_loader.loader import _initialize_model
    from sglang.srt.model_loader.utils import get_model_architecture, set_default_torch_dtype

    from qwen35_reshard import loader

    pp, rank = set_up_rank(job)

    def build(path: Path, *, draft: bool):
        config = ModelConfig(str(path), is_draft_model=draft)
        cls, arch = get_model_architecture(config)
        if draft:  # the draft never spans stages: a single-rank pipeline group
            with patch_pipeline_parallel_group(pipeline_group(0, 1)), set_default_torch_dtype(config.dtype):
                model = _initialize_model(config, LoadConfig())
        else:
            with set_default_torch_dtype(config.dtype):
                model = _initialize_model(config, LoadConfig())
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))
        return model, arch

    def loaded(model, fed, source: Path, *, path: Path, draft: bool) -> dict:
        """Feed ``fed`` to ``model`` and the whole checkpoint to a twin built alike; what each got."""
        taken = feed(model, iter(fed))
        twin, _ = build(path, draft=draft)
        twin.load_weights(whole_checkpoint(source))
        return {
            "params": {n: p.numel() for n, p in model.named_parameters()},
            "taken": taken,
            "nan_after_stage": sorted(n for n, c in nan_counts(model).items() if c),
            "nan_after_whole": sorted(n for n, c in nan_counts(twin).items() if c),
            "differs_from_whole": differing(model, twin),
        }

    results = {}
    for case in job["cases"]:
        t = time.perf_counter()
        source = Path(case["source"])
        stage = loader.open_stage(case["split"], pp_rank=rank)
        model, arch = build(stage.path, draft=False)
        # SGLang's own view of this rank's layers against the stage's: the split must be the one
        # the stage was cut for (what the launch line's partition variable guarantees).
        stage.check(pp_size=pp, start_layer=model.start_layer, end_layer=model.end_layer, pp_rank=rank)
        fed = [(n, w) for n, w in stage.iter_weights(verify=True) if not n.startswith(tuple(case["drop"]))]
        fed += [(n, w) for n, w in whole_checkpoint(source) if n in case["extra"]]
        out = {
            "sglang": sglang.__version__,
            "arch": arch,
            "layers": [model.start_layer, model.end_layer],
            "stage_names": sorted(stage.names),
            "fed": [n for n, _ in fed],
            **loaded(model, fed, source, path=stage.path, draft=False),
            "draft": None,
        }
        if case["draft"]:
            draft, darch = build(stage.path, draft=True)
            out["draft"] = {"arch": darch, **loaded(draft, fed, source, path=stage.path, draft=True)}
        out["seconds"] = round(time.perf_counter() - t, 2)
        results[case["id"]] = out
    Path(job["result"]).write_text(json.dumps(results))


def run_forked(jobs: list[dict], parallel: int, run) -> list[str]:
    """``run(job)`` for every job, each in a forked child, at most ``parallel`` at a time; the
    jobs that failed."""
    pending, running, failed = list(jobs), {}, []
    while pending or running:
        while pending and len(running) < parallel:
            job = pending.pop(0)
            pid = os.fork()
            if pid == 0:  # the child plays one rank, then leaves without running parent cleanup
                code = 0
                try:
                    run(job)
                except BaseException:
                    traceback.print_exc()
                    code = 1
                sys.stderr.flush()
                os._exit(code)
            running[pid] = job
        pid, status = os.wait()
        job = running.pop(pid)
        if os.waitstatus_to_exitcode(status) != 0:
            failed.append(f"pp={job['pp']} partition={job['partition']} rank={job['rank']}")
    return failed


def import_sglang() -> None:
    """Everything the jobs use, imported once before forking (SGLang's model registry imports
    every model module). No parallel context exists yet: each child sets up its own."""
    t0 = time.perf_counter()
    import sglang.srt.model_loader.loader  # noqa: F401
    import sglang.srt.models.registry  # noqa: F401
    import sglang.test.parallel_groups  # noqa: F401

    import qwen35_reshard.loader  # noqa: F401

    print(f"imported SGLang in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)


def main(jobs_path: str, run=run_job) -> int:
    """Run every job of JOBS.json with ``run`` (a rank per forked child); 0 if all succeeded."""
    spec = json.loads(Path(jobs_path).read_text())
    t0 = time.perf_counter()
    import_sglang()
    failed = run_forked(spec["jobs"], spec["parallel"], run)
    if failed:
        print("failed: " + "; ".join(failed), file=sys.stderr)
    print(f"all jobs done in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
