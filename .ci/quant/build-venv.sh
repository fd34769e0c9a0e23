#!/usr/bin/env bash
# Build the environment in which tests/engine/test_quant_real.py runs the real quantizer:
#   bash .ci/quant/build-venv.sh VENV
# llm-compressor 0.14 (with compressed-tensors 0.19) pins transformers <= 5.17, older than the
# test environment's, so it gets an environment of its own: torch 2.13.0 (CPU, from the
# machine's find-links), llmcompressor, and transformers as llmcompressor resolves it. Its
# data-free model_free_ptq writes the NVFP4A16, MXFP4A16 and W4A16 checkpoints on CPU, its
# compressors decompress the split's modules, and transformers loads a W4A16 stage
# (tests/support/quant_worker.py). About a minute, 1.5 GB.
set -euo pipefail
venv="${1:?usage: build-venv.sh VENV}"

python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check torch==2.13.0 llmcompressor==0.14.0.1 \
    compressed-tensors==0.19.0
# Fail here, not in the test, when the environment cannot import the producer.
"$venv/bin/python" -c 'import llmcompressor.entrypoints.model_free, compressed_tensors.compressors, transformers'
echo "llm-compressor $("$venv/bin/python" -c 'import llmcompressor; print(llmcompressor.__version__)') ready in $venv"
