"""The server integrations: vLLM's load format ``qwen35-stages`` (:mod:`.vllm`), the SGLang
plugin (:mod:`.sglang`), the one choice both make for a rank, once every rank of the deployment
agreed on the partition and the commit (:mod:`.deployment`), a rank's stage of an unsplit
checkpoint that both build when the model they are handed is not a split (:mod:`.unsplit`), and
the stage cache those stages are kept in (:mod:`.stagecache`).

Each server loads its module in every process that may load weights (entry points in
pyproject.toml); the stage itself is opened and streamed by the shim every server imports,
:mod:`qwen35_reshard.loader`. Nothing here imports vLLM, SGLang or torch at import time.
"""
