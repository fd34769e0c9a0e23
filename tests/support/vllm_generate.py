"""Start the real vLLM engine on a model directory and print its greedy tokens (one JSON line).

Run with the vLLM virtualenv's python by tests/engine/test_vllm_engine.py, one engine per process:

    python vllm_generate.py SPEC_JSON

SPEC_JSON: {"model": path, "pp": int, "load_format": str, "prompts": [[token ids], ...],
"max_tokens": int}. VLLM_PP_LAYER_PARTITION, if set, is the engine's own. Text only
(``language_model_only``), prompt token ids in, token ids out, no tokenizer: what is under test
is which weights each pipeline rank loads. On success the last line of stdout is
``RESULT {"tokens": [[...], ...]}``; a failed start exits non-zero with vLLM's own traceback.
"""

import json
import os
import sys


def main() -> None:
    spec = json.loads(sys.argv[1])
    # One NUMA node here: do not pin the pipeline ranks' OpenMP threads to disjoint cores.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=spec["model"],
        load_format=spec["load_format"],
        pipeline_parallel_size=spec["pp"],
        language_model_only=True,
        skip_tokenizer_init=True,
        dtype="bfloat16",  # the CPU Gated DeltaNet kernel needs bf16
        max_model_len=64,
        max_num_seqs=4,
        kv_cache_memory_bytes=64 << 20,
        # PP on the CPU worker needs the warm-up that eager mode skips; "eager" backend, no inductor.
        compilation_config={"mode": 2, "backend": "eager"},
        seed=0,
    )
    prompts = [{"prompt_token_ids": ids} for ids in spec["prompts"]]
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], detokenize=False)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    print("RESULT " + json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outputs]}), flush=True)


if __name__ == "__main__":
    main()
