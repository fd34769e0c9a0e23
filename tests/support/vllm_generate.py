"""Start the real vLLM engine on a model directory and print its greedy tokens (one JSON line).

Run with the vLLM virtualenv's python by tests/engine/test_vllm_engine.py, one engine per process:

    python vllm_generate.py SPEC_JSON

SPEC_JSON: {"model": path, "pp": int, "load_format": str, "prompts": [[token ids], ...],
"max_tokens": int}, and optionally "tp": int and "expert_parallel": bool (tests/engine/test_vllm_ep.py).
VLLM_PP_LAYER_PARTITION, if set, is the engine's own. Text only (``language_model_only``), prompt
token ids in, token ids out, no tokenizer: what is under test is which weights each rank loads.
On success the last line of stdout is ``RESULT {"tokens": [[...], ...]}``; a failed start exits
non-zero with vLLM's own traceback.

With ``expert_parallel`` two things are installed in every engine process (vLLM starts its engine
core and workers with ``spawn``, which imports this script again in each as ``__mp_main__``, so
they are installed at import, told to by ``EP_PROBE_ENV``, which the children inherit):

- a record of every rank's parameters as loaded, before vLLM's post-processing repacks them
  (``process_weights_after_loading``): each parameter's sha256, and for the routed experts one
  sha256 per expert by global id (through the layer's own expert map). Printed as
  ``PARAMS [per rank ...]`` (fetched from the workers with ``collective_rpc``) before generating.
- vLLM 0.32's CPU MoE kernel (``CPUUnquantizedExperts.apply``) ignores the expert map it is given
  and indexes the rank's local weights with global expert ids: with expert parallelism it reads
  past them (the SIGSEGV seen here). The wrapper maps the router's global ids to local ones
  through that expert map and zeroes the weight of experts another rank holds, which is what
  vLLM's GPU kernels do with the map; every rank's partial sum is then all-reduced by vLLM as
  usual. Without an expert map (no expert parallelism) the kernel runs untouched.
"""

import hashlib
import json
import os
import sys

EP_PROBE_ENV = "QWEN35_RESHARD_TEST_VLLM_EP_PROBE"
# The engine's settings for a tiny text-only model on CPU, shared with benchmarks/server_load.py.
CPU_ENGINE = {
    "language_model_only": True,
    "skip_tokenizer_init": True,
    "dtype": "bfloat16",  # the CPU Gated DeltaNet kernel needs bf16
    "max_model_len": 64,
    "max_num_seqs": 4,
    "kv_cache_memory_bytes": 64 << 20,
    # PP on the CPU worker needs the warm-up that eager mode skips; "eager" backend, no inductor.
    "compilation_config": {"mode": 2, "backend": "eager"},
    "seed": 0,
}
LOADED: dict = {}  # this process's rank, as loaded: see record_loaded


def digest(tensor) -> str:
    import torch

    return hashlib.sha256(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def record_loaded(model) -> None:
    """``LOADED``: every parameter's sha256; for each routed-experts module with an expert map,
    its 3-D parameters' sha256 per expert, by global id."""
    import torch

    experts = {}
    for module_name, module in model.named_modules():
        expert_map = getattr(module, "expert_map", None)
        if not isinstance(expert_map, torch.Tensor) or not hasattr(module, "w13_weight"):
            continue
        local = {int(loc): g for g, loc in enumerate(expert_map.tolist()) if loc >= 0}
        for name, p in module.named_parameters(recurse=False):
            if p.dim() == 3 and p.shape[0] == len(local):
                experts[f"{module_name}.{name}"] = {local[i]: digest(p[i]) for i in range(p.shape[0])}
    LOADED.update(params={n: digest(p) for n, p in model.named_parameters()}, experts=experts)


def install_ep_probes() -> None:
    """The record of loaded parameters and the CPU MoE kernel's expert map (module docstring)."""
    import torch
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe
    from vllm.model_executor.model_loader import base_loader

    post_process = base_loader.process_weights_after_loading

    def recorded(model, model_config, device):
        record_loaded(model)
        return post_process(model, model_config, device)

    base_loader.process_weights_after_loading = recorded
    apply = cpu_moe.CPUUnquantizedExperts.apply

    def mapped(self, **kw):
        expert_map = kw.get("expert_map")
        if expert_map is not None:
            local = expert_map[kw["topk_ids"].long()]
            weights = kw["topk_weights"]
            kw["topk_weights"] = torch.where(local >= 0, weights, torch.zeros_like(weights))
            kw["topk_ids"] = local.clamp(min=0).to(kw["topk_ids"].dtype)
            kw["expert_map"] = None
        return apply(self, **kw)

    cpu_moe.CPUUnquantizedExperts.apply = mapped


def loaded_on_rank(worker) -> dict:
    """Run in each worker by ``collective_rpc``: its rank and what ``record_loaded`` saw."""
    from vllm.distributed import get_ep_group, get_tensor_model_parallel_rank

    probe = sys.modules.get("__mp_main__") or sys.modules["__main__"]
    ranks = {"tp_rank": get_tensor_model_parallel_rank(), "ep_rank": get_ep_group().rank_in_group}
    return {**ranks, **probe.LOADED}


if os.environ.get(EP_PROBE_ENV) == "1":
    install_ep_probes()


def main() -> None:
    spec = json.loads(sys.argv[1])
    # One NUMA node here: do not pin the pipeline ranks' OpenMP threads to disjoint cores.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    ep = bool(spec.get("expert_parallel"))
    if ep:
        os.environ[EP_PROBE_ENV] = "1"  # for the engine processes, which import this script again
        # collective_rpc sends loaded_on_rank by pickle, which vLLM allows only when told to.
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        install_ep_probes()
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=spec["model"],
        load_format=spec["load_format"],
        pipeline_parallel_size=spec["pp"],
        tensor_parallel_size=spec.get("tp", 1),
        enable_expert_parallel=ep,
        **CPU_ENGINE,
    )
    if ep:
        print("PARAMS " + json.dumps(llm.collective_rpc(loaded_on_rank)), flush=True)
    prompts = [{"prompt_token_ids": ids} for ids in spec["prompts"]]
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], detokenize=False)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    print("RESULT " + json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outputs]}), flush=True)


if __name__ == "__main__":
    main()
