"""Stand-in for vllm in qwen35-reshard's SGLang test environment.

On a machine that is neither CUDA nor ROCm, SGLang's rotary embedding imports a fallback kernel
from ``vllm._custom_ops`` while it is being built (it is only called in a forward pass, which
the test never runs). Every name in ``vllm._custom_ops`` is a function that raises when called.
"""
