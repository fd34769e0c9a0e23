#!/usr/bin/env bash
# Build the environment in which tests/engine/test_sglang_loading.py runs SGLang's own model code:
#   bash .ci/sglang/build-venv.sh VENV
# SGLang's wheel pins a CUDA torch and CUDA-only kernels that cannot install or run on a CPU
# machine, so it is installed with --no-deps beside torch 2.13.0 (CPU) and the light packages
# its import chain needs (requirements.txt, every one pinned and installed with --no-deps so
# nothing can pull a CUDA build). Two imports that have no CPU wheel are replaced by the tiny
# stand-ins in stubs/: torchvision (imported by unrelated image processors and configs) and
# vllm (a fallback kernel import on non-CUDA machines); neither is used by the code under test.
# This checkout is installed in it (no deps) for the sglang.srt.plugins entry point that gives
# each pipeline rank its stage (qwen35_reshard/servers/sglang.py, tests/engine/test_sglang_plugin.py).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${1:?usage: build-venv.sh VENV}"

python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --no-compile -r "$here/requirements.txt"
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
cp -r "$here/stubs/torchvision" "$here/stubs/vllm" "$site/"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps -e "$here/../.."
# Fail here, not in the test, when the environment cannot import the model code.
"$venv/bin/python" -c 'import sglang.srt.models.qwen3_5, sglang.srt.models.qwen3_5_mtp, sglang.srt.models.qwen3_5_text' 2>/dev/null
"$venv/bin/python" -c 'import qwen35_reshard.servers.sglang'
echo "SGLang $("$venv/bin/python" -c 'import sglang; print(sglang.__version__)') ready in $venv"
